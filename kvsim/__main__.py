"""``python -m kvsim``: see ``kvsim.cli``."""

import sys

from .cli import main

sys.exit(main())

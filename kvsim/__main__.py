"""``python -m kvsim``, the same as the ``kvsim`` command: see ``kvsim.cli``."""

import sys

from .cli import main

sys.exit(main())

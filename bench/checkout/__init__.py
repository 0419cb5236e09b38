"""What every script in bench/ runs before it measures: ``this_checkout(__file__)``. The scripts are
studies run from a checkout, never from an installed kvsim, so this lives beside them rather than in the
package (``kvsim.bench`` holds what ``kvsim bench`` runs). A script imports it as ``checkout``: Python puts
the script's own folder first on ``sys.path``."""

from __future__ import annotations

from pathlib import Path

import kvsim

#: the checkout whose kvsim this process imports
ROOT = Path(kvsim.__file__).resolve().parents[1]


def this_checkout(script: str) -> Path:
    """The checkout of the ``bench/`` script whose ``__file__`` is ``script``, once it is the checkout whose
    kvsim is imported. The scripts take kvsim as installed (``pip install -e .``, the README's set-up) or
    as PYTHONPATH names it, not by editing ``sys.path``; a figure measured on another copy's code would be
    that copy's, so a mismatch is refused in one line saying how to run the script."""
    root = Path(script).resolve().parents[1]
    if root != ROOT:
        raise SystemExit(f"{Path(script).name}: error: kvsim is imported from {ROOT}, not this checkout ({root}); "
                         f"install it (pip install -e {root}) or run with PYTHONPATH={root}")
    return root

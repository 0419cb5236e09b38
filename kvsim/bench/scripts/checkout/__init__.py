"""What every script in kvsim/bench/scripts/ runs before it measures: ``this_checkout(__file__)``. The scripts are
studies run from a checkout (``python kvsim/bench/scripts/NAME.py``), never from an installed kvsim, so this
lives beside them and, like them, stays out of the built wheel (pyproject.toml), which ships what ``kvsim
bench`` runs. A script imports it as ``checkout``: Python puts the script's own folder first on
``sys.path``."""

from __future__ import annotations

from pathlib import Path

import kvsim

#: the checkout whose kvsim this process imports
ROOT = Path(kvsim.__file__).resolve().parents[1]


def this_checkout(script: str) -> Path:
    """The checkout of the ``kvsim/bench/scripts/`` script whose ``__file__`` is ``script``, once it is the checkout whose
    kvsim is imported. The scripts take kvsim as installed (``pip install -e .``, the README's set-up) or
    as PYTHONPATH names it, not by editing ``sys.path``; a figure measured on another copy's code would be
    that copy's, so a mismatch is refused in one line saying how to run the script."""
    root = Path(script).resolve().parents[3]  # <checkout>/kvsim/bench/scripts/NAME.py
    if root != ROOT:
        raise SystemExit(f"{Path(script).name}: error: kvsim is imported from {ROOT}, not this checkout ({root}); "
                         f"install it (pip install -e {root}) or run with PYTHONPATH={root}")
    return root

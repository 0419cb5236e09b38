"""Benchmarks, imported only by ``python -m kvsim bench`` and the checkout's ``bench/`` scripts: ``speed``
(the reference path against the fast engine, and whole CLI processes) and ``browser`` (the app in headless
Chromium)."""

from __future__ import annotations

import os
from pathlib import Path

#: the checkout whose kvsim and app.py the benchmarks' child processes run
ROOT = Path(__file__).resolve().parents[2]


def checkout_env(**extra: str) -> dict:
    """This process's environment with ``extra`` set and the checkout first on PYTHONPATH, so a child
    process (``python -m kvsim``, ``streamlit run app.py``) imports this checkout's kvsim."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **extra, "PYTHONPATH": path}


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

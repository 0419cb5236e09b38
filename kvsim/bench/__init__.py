"""What ``python -m kvsim bench`` runs, one module per section (``speed``: the reference path against the
fast engine, and whole CLI processes; ``browser``: the app in headless Chromium; ``load``, ``long``,
``generate``, ``truth_speed``), imported by nothing else in the package; and, in ``scripts/``, every other
benchmark and study, run from a checkout as ``python kvsim/bench/scripts/NAME.py`` (left out of the built
wheel: some take the suite's tiny models from tests/). They reuse some of these modules; what only they need
lives beside them (``scripts/checkout``)."""

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


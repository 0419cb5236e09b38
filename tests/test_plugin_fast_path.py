"""docs/architecture.md's "A fast path": a policy from outside the package declares its hooks of the engine's
step loop beside it, and the engine replays it with them, bit for bit its own reference and sliding_window's."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from random_traces import random_trace

import kvsim
from kvsim.policies import POLICIES
from kvsim.sim import engine

ROOT = Path(__file__).resolve().parent.parent
SECTION = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("## Adding a policy\n")[1].split("\n## ")[0]
#: the section's second python block (its first is the reference-only ``newest``, tests/test_plugins.py's)
FAST_NEWEST = re.findall(r"^```python\n(.*?)^```", SECTION, re.S | re.M)[1]


@pytest.fixture(scope="module")
def fast_newest(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "fast_newest.py"
    path.write_text(FAST_NEWEST, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("kvsim_test_fast_newest", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    try:
        yield module
    finally:
        POLICIES.pop("fast_newest", None)
        sys.modules.pop(spec.name, None)


def test_the_pages_fast_policy_replays_on_the_engine_as_its_reference_and_sliding_window(fast_newest):
    trace = random_trace(90, seed=6)
    assert "fast_newest" in engine.FAST and engine.covers(trace, "fast_newest") == engine.AVAILABLE
    kw = dict(budget=12, record_kept=True, record_victims=True)
    fast = kvsim.replay(trace, "fast_newest", **kw)
    for other in (kvsim.replay(trace, "fast_newest", reference=True, **kw), kvsim.replay(trace, "sliding_window", **kw)):
        assert np.array_equal(fast.retained_mass_series, other.retained_mass_series)
        assert np.array_equal(fast.top_k_recall_series, other.top_k_recall_series)
        assert np.array_equal(fast.kept_history, other.kept_history)
        assert fast.victims_history == other.victims_history
    if engine.AVAILABLE:  # the loop specialised with the page's hooks, named after them and their file
        assert engine.FAST["fast_newest"].steps.py_func.__name__.startswith("fast_newest_steps_")
    swept = kvsim.sweep(trace, "fast_newest", 4, "budget", range(4, 40, 5))  # one pass for every budget
    assert [{k: v for k, v in row.items() if k != "policy"} for row in swept] == [
        {k: v for k, v in row.items() if k != "policy"} for row in kvsim.sweep(trace, "sliding_window", 4, "budget", range(4, 40, 5))]

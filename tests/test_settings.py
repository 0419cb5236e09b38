"""Typed settings end to end (issue 32, point 3): a value is validated once, as a ``PolicySpec``; one
sweep (``kvsim.sim.simulate.sweep``, the proxies' too); one window rule (``kvsim.analysis.windows``);
and whether a trace is dense or stored as queries and keys is the data layer's business alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

import kvsim
from kvsim import cli
from kvsim.analysis import proxies as px
from kvsim.analysis import tune, windows
from kvsim.data import qk
from kvsim.data.trace import from_array
from kvsim.policies import PolicySpec
from kvsim.sim import simulate
from kvsim.views import window_truth as vt

REPO = Path(__file__).resolve().parent.parent
#: what only the trace's stores may ask of themselves
STORE_KIND = re.compile(r"\b(dense_at_hand|on_demand)\b")


def _sources():
    yield REPO / "app.py"
    for folder in ("kvsim",):  # the bench scripts among them (kvsim/bench/scripts)
        yield from sorted((REPO / folder).rglob("*.py"))


def test_only_the_data_layer_asks_whether_a_trace_is_dense():
    data = REPO / "kvsim" / "data"
    found = [f"{path.relative_to(REPO)}:{n}" for path in _sources() if data not in path.parents
             for n, line in enumerate(path.read_text().splitlines(), 1) if STORE_KIND.search(line)]
    assert found == [], "ask the trace's store for what is needed (kvsim/data/derived.py), not which kind it is"


@pytest.fixture(scope="module")
def twins():
    """A query/key trace and the dense trace of its own matrix: the same weights behind two stores."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((2, 61, 8), (61, 8), (61, 8)))
    long = qk.from_qk(q, k, v, scale=0.35)
    return long, from_array(np.array(long.attention), name="dense twin")


def test_the_stores_answer_the_readers_of_every_weight_alike(twins):
    long, dense = twins
    for trace in twins:
        assert trace.derived.no_matrix() is None
        assert trace.derived.whole(lambda A: A.shape, lambda stats: None) == (61, 61)
    assert np.array_equal(long.derived.row_scratch(), np.zeros((1, 61), dtype=np.float32))
    assert dense.derived.row_scratch() is None
    # the engine reads both through their kernel views, to the same figures as the reference loop
    for trace in twins:
        fast = kvsim.replay(trace, "h2o", budget=9, recent_window=3)
        ref = kvsim.replay(trace, "h2o", budget=9, recent_window=3, reference=True)
        assert fast.summary() == ref.summary()


def test_a_trace_past_its_dense_length_says_why_in_one_line(twins, monkeypatch):
    long, _ = twins
    monkeypatch.setattr(qk, "DENSE_LIMIT", 40)
    why = long.derived.no_matrix()
    assert why is not None and "\n" not in why and "60 steps" in why and "at most 40" in why
    assert long.derived.whole(lambda A: "the matrix", lambda stats: stats.steps) == 60  # one pass over every row


# --- one sweep --------------------------------------------------------------------------------------


def test_the_proxies_sweep_is_the_simulators_sweep(monkeypatch, make_trace):
    trace = make_trace(60, seed=3)
    calls = []
    real = simulate.sweep
    monkeypatch.setattr(simulate, "sweep", lambda *a, **kw: calls.append(kw.get("summarise")) or real(*a, **kw))
    rows = px.sweep(trace, "h2o", 8, "recent_window", [1, 4, 7])
    assert len(calls) == 1 and calls[0] is not None
    plain = real(trace, "h2o", 8, "recent_window", [1, 4, 7])
    assert [r["retained_mass"] for r in rows] == [r["retained_mass"] for r in plain]
    # and so the simulator's checks: a value both swept and fixed is refused, not silently replaced
    with pytest.raises(ValueError, match="recent_window is both swept and fixed"):
        px.sweep(trace, "h2o", 8, "recent_window", [1, 4], recent_window=3)


def test_a_sweep_of_a_spec_is_the_sweep_of_its_name_and_parameters(make_trace):
    trace = make_trace(70, seed=4)
    spec = PolicySpec.of("snapkv", 12, recent_window=5, observation_window=3)
    by_spec = kvsim.sweep(trace, spec, None, "recent_window", range(1, 12))
    by_name = kvsim.sweep(trace, "snapkv", 12, "recent_window", range(1, 12), observation_window=3)
    assert by_spec == by_name
    assert windows.sweep_coarse_to_fine(trace, spec, None, "recent_window", 1, 11, points=4) == \
        windows.sweep_coarse_to_fine(trace, "snapkv", 12, "recent_window", 1, 11, points=4, observation_window=3)


# --- one window rule --------------------------------------------------------------------------------


def test_every_best_is_the_window_rules():
    assert kvsim.best is windows.best_row
    rows = [{"recent_window": w, "retained_mass": m} for w, m in ((1, 0.5), (2, 0.9), (3, 0.9), (4, 0.7))]
    assert windows.best_row(rows)["recent_window"] == 2 == windows.choose_window(rows).best  # the first of equal
    # a loss: the least, the first of equal ones, in the truth view, the tune and the regret alike
    kl = (0.3, 0.1, 0.1, 0.2)
    truth = vt.Truth((1, 2, 3, 4), kl, (0.0,) * 4, "measured here", {})
    assert truth.best == 2 == [1, 2, 3, 4][windows.best_of(kl, -1)]
    assert tune._best("kl", [1, 2, 3, 4], list(kl), -1, None)["model_window"] == 2
    assert windows.regret([0.0, 1.0, 1.0, 0.5], kl) == 0.0


def test_no_module_but_the_rules_defines_a_best_or_sweeps_coarse_to_fine():
    rule = REPO / "kvsim" / "analysis" / "windows.py"
    defined = []
    for path in sorted((REPO / "kvsim").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module-level: a view's property may ask the rule
            if isinstance(node, ast.FunctionDef) and node.name in ("best", "best_row", "best_of", "sweep_coarse_to_fine"):
                defined.append((path, node.name))
    assert {p for p, _ in defined} == {rule}, defined


# --- a value validated once -------------------------------------------------------------------------


def test_the_cli_validates_a_replays_settings_once_and_says_so_as_before(monkeypatch, capsys):
    made = []
    real = PolicySpec.of.__func__
    monkeypatch.setattr(PolicySpec, "of", classmethod(lambda cls, *a, **kw: made.append(a) or real(cls, *a, **kw)))
    assert cli.main(["replay", "--trace", "canonical", "--policy", "h2o", "--budget", "16", "--recent-window", "32"]) == 2
    assert capsys.readouterr().err.strip() == "kvsim: error: --recent-window 32 must be below --budget 16"
    assert len(made) == 1
    made.clear()
    assert cli.main(["replay", "--trace", "canonical", "--policy", "h2o", "--budget", "64", "--recent-window", "8",
                     "--json"]) == 0
    assert len(made) == 1  # the spec made from the flags is the one replayed


def test_a_tune_makes_each_windows_spec_once_for_every_trace(monkeypatch, make_trace):
    traces = [make_trace(50, seed=s, name=f"t{s}") for s in (1, 2, 3)]
    made = []
    real = PolicySpec.of.__func__
    monkeypatch.setattr(PolicySpec, "of", classmethod(lambda cls, *a, **kw: made.append(a) or real(cls, *a, **kw)))
    result = tune.tune(traces, "h2o", 8, windows=[1, 3, 5], by="retained_mass")
    assert sum(name == "h2o" for name, *_ in made) == 3  # one per window, not one per window and trace
    want = [kvsim.sweep(t, "h2o", 8, "recent_window", [1, 3, 5]) for t in traces]
    assert [list(t.retained_mass) for t in result.traces] == [[r["retained_mass"] for r in rows] for rows in want]
    made.clear()
    with pytest.raises(ValueError, match="recent_window must be less than budget"):  # before any trace is swept
        tune.tune(traces, "h2o", 8, windows=[1, 8], by="retained_mass")
    assert all(name == "h2o" for name, *_ in made)

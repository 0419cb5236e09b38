"""Trace statistics (``describe``), the trace catalog behind ``--trace`` and the ``sweep`` function."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tolerance import rounding

import kvsim
from kvsim import best, sweep
from kvsim.analysis.claims.measure import BAND_TOLERANCE
from kvsim.analysis.metrics import describe
from kvsim.data import catalog


def describe_by_hand(trace, band, top_k, sinks):
    """The same figures, one row at a time, the obvious way."""
    sink, recent, top, effective = [], [], [], []
    for t in range(1, trace.steps + 1):
        row = trace.attention[t, :t].astype(np.float64)
        if t > sinks:
            sink.append(row[:sinks].sum())
        if t > band:
            recent.append(row[t - band :].sum())
        if t > top_k:
            top.append(np.sort(row)[-top_k:].sum())
        p = row[row > 0]
        effective.append(math.exp(-(p * np.log(p)).sum()))
    mean = lambda xs: float(np.mean(xs)) if xs else None  # noqa: E731
    return {
        "steps": trace.steps,
        "sinks": sinks,
        "sink_share": mean(sink),
        "band": band,
        "recent_share": mean(recent),
        "top_k": top_k,
        "top_k_share": mean(top),
        "effective_positions": mean(effective),
    }


@pytest.mark.parametrize(("band", "top_k", "sinks"), [(64, 32, 4), (1, 1, 1), (7, 3, 2), (200, 100, 150)])
@pytest.mark.parametrize("ties", [False, True])
def test_describe_matches_a_row_by_row_computation(band, top_k, sinks, ties, make_trace):
    trace = make_trace(150, seed=8, ties=ties)
    got = describe(trace, band=band, top_k=top_k, sinks=sinks, chunk=16)  # small chunks: many blocks
    want = describe_by_hand(trace, band, top_k, sinks)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if value is None or isinstance(value, int):
            assert got[key] == value, key
        else:
            # float64 means over 150 rows of sums of at most 151 terms; effective_positions is exp of an entropy
            # (at most log 151), whose absolute rounding becomes its relative one
            assert got[key] == pytest.approx(value, rel=2 * rounding(150 + 151, np.log(151), np.float64)), key


def test_describe_uniform_rows():
    n = 41
    a = np.tril(np.ones((n, n)), k=-1)
    d = describe(kvsim.from_array(a), band=10, top_k=5, sinks=4)
    # the rows are float32 (1/t rounded, half an ulp each): a share of them, or the exp of their entropy (at most
    # log n), moves by that relatively, times (log n + 1); then the float64 means over n rows of n-term sums
    same = rounding(1, np.log(n) + 1) + 2 * rounding(n + n, np.log(n), np.float64)
    assert d["recent_share"] == pytest.approx(np.mean([10 / t for t in range(11, n)]), rel=same)
    assert d["effective_positions"] == pytest.approx(np.mean(np.arange(1, n)), rel=same)  # uniform over t gives t


def test_describe_the_canonical_trace(canonical):
    d = describe(canonical)
    assert d["steps"] == 4096
    assert d["recent_share"] == pytest.approx(0.55, abs=BAND_TOLERANCE)  # docs/domain.md's target
    assert d["sink_share"] == pytest.approx(0.15, abs=BAND_TOLERANCE)  # the generator's sink share, to the same
    assert 0 < d["top_k_share"] < 1 and 1 < d["effective_positions"] < 4096


@pytest.mark.parametrize("bad", [{"band": 0}, {"top_k": 0}, {"sinks": -1}, {"band": 2.5}])
def test_describe_refuses_bad_arguments(bad, make_trace):
    with pytest.raises(ValueError, match=next(iter(bad))):
        describe(make_trace(5), **bad)


def test_available_traces_lists_canonical_first():
    names = catalog.available_traces()
    assert names[0] == "canonical"
    assert names[1:] == sorted(names[1:])


def test_resolve_shipped_stems_and_paths(tmp_path, monkeypatch, make_trace):
    monkeypatch.setattr(catalog, "TRACES_DIR", tmp_path)
    kvsim.save_npz(make_trace(10, seed=1, name="beta"), tmp_path / "beta.npz")
    kvsim.save_npz(make_trace(12, seed=2, name="alpha"), tmp_path / "alpha.npz")
    assert catalog.available_traces() == ["canonical", "alpha", "beta"]
    assert catalog.resolve_trace("alpha").steps == 12
    assert catalog.resolve_trace(str(tmp_path / "beta.npz")).steps == 10
    with pytest.raises(kvsim.TraceError, match="unknown trace 'gamma'.*alpha, beta"):
        catalog.resolve_trace("gamma")
    with pytest.raises(kvsim.TraceError, match="no such file"):
        catalog.resolve_trace(str(tmp_path / "gamma.npz"))


def test_resolve_canonical(canonical):
    assert catalog.resolve_trace("canonical").steps == canonical.steps


def test_sweep_is_one_replay_per_value_in_order(make_trace):
    trace = make_trace(50, seed=6)
    calls = []
    rows = sweep(trace, "h2o", 12, "recent_window", [6, 2, 4], progress=calls.append)
    assert [r["recent_window"] for r in rows] == [6, 2, 4]
    for r in rows:
        assert r == kvsim.replay(trace, "h2o", budget=12, recent_window=r["recent_window"]).summary()
    assert calls and calls == sorted(calls) and calls[-1] == 1.0  # the fraction done
    assert best(rows) == max(rows, key=lambda r: r["retained_mass"])


def test_sweep_over_the_budget(make_trace):
    trace = make_trace(40, seed=6)
    rows = sweep(trace, "streaming_llm", 0, "budget", [5, 9], sinks=2)
    assert [(r["budget"], r["sinks"]) for r in rows] == [(5, 2), (9, 2)]
    assert rows[1] == kvsim.replay(trace, "streaming_llm", budget=9, sinks=2).summary()


def test_sweep_refuses_a_bad_value_before_any_work(make_trace):
    calls = []
    with pytest.raises(ValueError, match="recent_window"):
        sweep(make_trace(30), "h2o", 8, "recent_window", [2, 4, 8], progress=lambda *a: calls.append(a))
    assert calls == []


def test_best_keeps_the_first_of_equals():
    rows = [{"w": 1, "retained_mass": 0.5}, {"w": 2, "retained_mass": 0.7}, {"w": 3, "retained_mass": 0.7}]
    assert best(rows)["w"] == 2


def test_coarse_to_fine_sweep_finds_the_exact_peak_at_a_fraction_of_the_cost(make_trace):
    trace = make_trace(300, seed=11)
    full = sweep(trace, "h2o", 120, "recent_window", range(1, 120))
    seen = []
    rows = kvsim.analysis.windows.sweep_coarse_to_fine(trace, "h2o", 120, "recent_window", 1, 119, marks=[32, 64],
                                               points=16, progress=seen.append)
    windows = [r["recent_window"] for r in rows]
    assert windows == sorted(windows) and len(windows) < len(full) and {1, 32, 64, 119} <= set(windows)
    by_window = {r["recent_window"]: r for r in full}
    assert all(r == by_window[r["recent_window"]] for r in rows)  # every point is the full sweep's
    assert best(rows)["recent_window"] == best(full)["recent_window"] or (
        best(rows)["retained_mass"] == best(full)["retained_mass"])
    assert seen == sorted(seen) and seen[-1] == 1.0
    small = kvsim.analysis.windows.sweep_coarse_to_fine(trace, "h2o", 12, "recent_window", 1, 11, points=64)
    assert small == sweep(trace, "h2o", 12, "recent_window", range(1, 12))

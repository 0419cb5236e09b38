"""The CLI benchmark's plain-Python baseline: the H2O card's pseudo-code must compute what the
reference computes, or the speed-up it is measured against means nothing. Not timed."""

from __future__ import annotations

import numpy as np
import pytest
from random_traces import random_trace
from tolerance import rounding

from kvsim import replay
from kvsim.bench import speed as bench


@pytest.mark.parametrize("seed, budget, recent_window", [(0, 16, 4), (1, 24, 1), (2, 8, 7), (3, 40, 12)])
def test_the_card_pseudo_code_agrees_with_the_reference(seed, budget, recent_window):
    trace = random_trace(120, seed=seed)
    topk = [set(int(p) for p in row.nonzero()[0]) for row in trace.topk_mask(32)]
    mass, recall = bench.card_h2o(trace.attention, budget, recent_window, topk)
    ref = replay(trace, "h2o", budget=budget, recent_window=recent_window)
    # two float64 means over 120 steps of figures that are themselves sums of at most budget weights
    assert mass == pytest.approx(ref.retained_mass, abs=2 * rounding(120 + budget, 1.0, np.float64))
    assert recall == pytest.approx(ref.top_k_recall, abs=2 * rounding(120 + 32, 1.0, np.float64))


def test_the_card_pseudo_code_tells_windows_apart():
    """A check that could not fail would hide a baseline that ignores recent_window."""
    trace = random_trace(120, seed=5)
    topk = [set(int(p) for p in row.nonzero()[0]) for row in trace.topk_mask(32)]
    got = {w: bench.card_h2o(trace.attention, 16, w, topk)[0] for w in (1, 8, 15)}
    assert len(set(got.values())) == 3


def _figures(warm_s=0.9, cli_speedup=60.0, table_s=1.2, replay_s=0.04, identical=True):
    return {"cli": {"warm_seconds": warm_s}, "card": {"cli_warm_speedup": cli_speedup},
            "table_cli": {"median_seconds": table_s}, "replay": {"engine_seconds": replay_s, "identical": identical},
            "sweep": {"identical": True}}


def test_each_target_passes_or_fails_on_its_own_figure():
    assert all(bench.targets(_figures()).values())
    assert bench.targets(_figures(warm_s=1.0))["cli_sweep_within_1_s"]  # "within": the target itself is met
    missed = {
        "cli_sweep_within_1_s": _figures(warm_s=1.01),
        "cli_sweep_60x_faster_than_card_pseudo_code": _figures(cli_speedup=59.9),
        "table_within_1_5_s": _figures(table_s=1.51),
        "one_replay_under_50_ms": _figures(replay_s=0.05),  # "under": 50 ms itself misses
        "results_identical": _figures(identical=False),
    }
    for name, doc in missed.items():
        got = bench.targets(doc)
        assert [k for k, ok in got.items() if not ok] == [name]
    assert set(bench.targets(_figures())) == set(missed)


def test_the_startup_split_is_printed_phase_by_phase_with_its_total_and_the_floors():
    split = {"interpreter": 0.03, "imports": 0.12, "kernel_load": 0.2, "work": 0.4, "exit": 0.05}
    startup = {"sweep": split, "replay": {**split, "work": 0.01}, "replay_command": "python -m kvsim replay ...",
               "floors": {"python -c pass": 0.03, "python -c 'import numba'": 0.45}, "bytecode_cached": False}
    lines = bench._startup_lines(startup)
    sweep = next(x for x in lines if x.strip().startswith("sweep")).split()
    assert sweep[1:] == ["0.030", "0.120", "0.200", "0.400", "0.050", "0.800"]
    assert next(x for x in lines if x.strip().startswith("replay ")).split()[-1] == "0.410"
    assert "not cached" in lines[0] and "python -c 'import numba' 0.450 s" in lines[-2]
    assert bench._startup_lines(None) == []

"""The split searched by the truth (kvsim.allocation.search, ``quality --allocate optimal --by kl``)
and ``tune --allocate auto`` (kvsim.allocation.tune): a move keeps the memory and the bounds, the
search never ends worse by the truth than the best static split it starts from, a second run reads every
measurement from the disk cache, and auto picks the candidate with the best figure."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_quality import HAS_TORCH, _private_cache, session, text_path  # noqa: F401  (the tiny model's session)

from kvsim.allocation import allocators as al
from kvsim.allocation.search import FIRST_STEP, head_groups, search, shift, spread
from kvsim.allocation.tune import CANDIDATES, choose
from kvsim.cli.entry import main
from kvsim.data.catalog import resolve_bundle
from kvsim.policies import PolicySpec

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")


def test_spread_is_even_within_the_caps_and_refuses_what_they_cannot_hold():
    assert spread(7, np.array([10, 10, 10])).tolist() == [3, 2, 2]
    assert spread(7, np.array([1, 10, 10])).tolist() == [1, 3, 3]
    assert spread(0, np.array([4, 4])).tolist() == [0, 0]
    assert spread(9, np.array([4, 4])) is None


def test_a_move_keeps_the_memory_and_every_head_within_its_bounds():
    rng = np.random.default_rng(3)
    low, high = 5, 40
    for _ in range(200):
        n = int(rng.integers(2, 9))
        b = rng.integers(low, high + 1, size=n).tolist()
        group = sorted(rng.choice(n, size=int(rng.integers(1, n)), replace=False).tolist())
        step, sign = int(rng.integers(1, 12)), int(rng.choice([-1, 1]))
        got = shift(b, group, step, sign, low, high)
        if got is None:
            continue
        assert sum(got) == sum(b) and min(got) >= low and max(got) <= high
        moved = [got[i] - b[i] for i in group]
        assert all(0 <= sign * d <= step for d in moved) and any(moved)
    assert shift([5, 5], [0], 3, -1, 5, 40) is None  # nothing can go below the minimum
    assert shift([5, 40], [0], 3, +1, 5, 40) == [8, 37]


def _bowl(target):
    """A made-up truth: the squared distance of a split from ``target`` (its minimum), each call counted."""
    calls = []

    def measure(b):
        calls.append(list(b))
        return {"kl": float(np.sum((np.asarray(b) - target) ** 2)), "delta_nll": 0.0}
    return measure, calls


def test_the_search_moves_toward_the_truths_minimum_and_never_ends_above_its_start():
    target = np.array([60, 60, 20, 20, 20, 20])  # 200 positions, as the start's
    measure, calls = _bowl(target)
    start = [40, 40, 30, 30, 30, 30]
    groups = [[0, 1], [2, 3], [4, 5]]
    got = search(start, groups, 5, 100, 32, measure, measurements=100)
    first = measure(start)["kl"]
    assert got["kl"] < first and sum(got["budgets"]) == 200
    assert got["budgets"] == target.tolist()  # the bowl's minimum is reachable by the moves: found
    assert got["moves"][0] == {"group": 0, "direction": "more", "step": 32 // FIRST_STEP, "kl": got["moves"][0]["kl"]}
    assert [m["kl"] for m in got["moves"]] == sorted((m["kl"] for m in got["moves"]), reverse=True)
    assert "below" in got["stopped"]
    assert len(calls) == len({tuple(c) for c in calls}) + 1  # no split measured twice (the last call: this test's)


def test_the_search_stops_at_its_measurement_budget_and_keeps_the_start_where_nothing_helps():
    start = [30, 30, 30]
    measure, calls = _bowl(np.array(start))  # the start is the minimum: no move can help
    got = search(start, [[0], [1], [2]], 5, 100, 32, measure, measurements=4)
    assert got["budgets"] == start and got["moves"] == [] and got["tried"] == 4 and len(calls) == 5
    assert got["stopped"] == "the measurement budget (4 splits tried)"


@pytest.fixture
def heads(session):  # noqa: F811
    return [al.Head(x, h, session.traces[x][h]) for x in range(session.layers) for h in range(session.kv_heads)]


def _truth(session, spec, counter):  # noqa: F811
    from kvsim.allocation.truth import cached_open_truth

    def measure(flat):
        grid = [[flat[x * session.kv_heads + h] for h in range(session.kv_heads)] for x in range(session.layers)]
        r = cached_open_truth(session, spec.name, grid, spec.kwargs)
        counter.append(r["cached"])
        return r
    return measure


@needs_torch
def test_the_search_by_the_truth_never_ends_worse_than_the_best_static_split_and_a_second_run_measures_nothing(
        session, heads):  # noqa: F811
    from kvsim.allocation.search import search_from_static

    spec = PolicySpec.of("h2o", 12, recent_window=4)
    kinds = session.model.config.layer_types
    first: list[bool] = []
    got = search_from_static(heads, spec, _truth(session, spec, first), figure="kl", kinds=kinds, measurements=6)
    best_static = min(c["kl"] for c in got["candidates"])
    assert [c["allocator"] for c in got["candidates"]] == ["uniform", "pyramidkv", "cake", "optimal"]
    assert got["search"]["kl"] <= best_static
    assert (got["search"]["kl"] < best_static) == bool(got["search"]["moves"])
    budgets = got["allocation"].budgets
    assert sum(budgets) == 12 * len(heads) and min(budgets) >= 5 and max(budgets) <= session.steps
    assert got["groups"] == [[0], [1], [2], [3]]  # the tiny model's layers alternate sliding and global
    assert got["search"]["tried"] <= 6 and not any(first[:1])
    again: list[bool] = []
    second = search_from_static(heads, spec, _truth(session, spec, again), figure="kl", kinds=kinds, measurements=6)
    assert all(again) and second["search"]["measured"] == 0 and not any(c["cached"] is False for c in second["candidates"])
    assert second["allocation"].budgets == budgets and second["search"]["kl"] == got["search"]["kl"]


def test_auto_picks_the_candidate_with_the_best_figure_by_mass_and_by_a_truth():
    bundle = resolve_bundle("gemma3-270m-heapq")
    heads = al.load_heads(bundle)
    spec = PolicySpec.of("h2o", 48, recent_window=16)
    by_mass = choose(heads, spec, "retained_mass")
    figures = {c["allocator"]: c["figure"] for c in by_mass["candidates"]}
    assert list(figures) == list(CANDIDATES) and by_mass["chosen"] == max(figures, key=figures.get)
    assert by_mass["chosen"] == "optimal"  # the exact optimum of mass bounds every static split's mass
    assert set(by_mass["left_out"]) == {"adakv", "duo"} and "one KV head" in by_mass["left_out"]["adakv"]
    # a made-up truth that prefers pyramidkv's split: the lowest figure wins whatever mass says
    pyramid = np.array(next(c["budgets"] for c in by_mass["candidates"] if c["allocator"] == "pyramidkv"))
    by_kl = choose(heads, spec, "kl", lambda b: {"kl": float(np.abs(np.asarray(b) - pyramid).sum()), "delta_nll": 0.0})
    assert by_kl["chosen"] == "pyramidkv" and by_kl["allocation"] == [
        {"layer": x, "kv_head": 0, "budget": int(b)} for x, b in enumerate(pyramid)]
    with pytest.raises(ValueError, match="needs the truth"):
        choose(heads, spec, "kl")


@pytest.mark.parametrize("argv, message", [
    (["quality", "heapq", "--policy", "h2o", "--budget", "64", "--mode", "open", "--allocate", "cake", "--by", "kl"],
     "--by kl searches the split by the truth: it goes with --allocate optimal, not cake"),
    (["quality", "heapq", "--policy", "h2o", "--budget", "64", "--mode", "open", "--by", "kl"],
     "--by chooses how --allocate's split is made: give --allocate optimal"),
    (["quality", "heapq", "--policy", "h2o", "--budget", "64", "--mode", "open", "--allocate", "optimal",
      "--measurements", "3"], "--measurements bounds the search by the truth"),
    (["tune", "--trace", "gemma3-270m-heapq", "--budget", "64", "--allocate", "auto", "--per-layer", "--serial"],
     "does not go with --per-layer"),
    (["tune", "--trace", "gemma3-270m-heapq", "--budget", "64", "--allocate", "auto", "--by", "output_error", "--serial"],
     "--by output_error is a proxy of one window's figure"),
    (["tune", "--trace", "gemma3-270m-L05", "--budget", "64", "--allocate", "auto", "--serial"],
     "give a bundle (a recording of every layer), not one trace"),
])
def test_bad_input_is_refused_in_one_line_before_any_work(argv, message, capsys):
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_tune_allocate_auto_names_the_chosen_allocator_and_its_split(tmp_path, capsys):
    assert main(["tune", "--trace", "gemma3-270m-heapq", "--budget", "48", "--by", "retained_mass", "--allocate", "auto",
                 "--serial", "--quiet", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    a = doc["allocate"]
    assert a["by"] == "retained_mass" and a["recent_window"] == doc["model_window"]
    assert a["chosen"] == max(a["candidates"], key=lambda c: c["figure"])["allocator"]
    assert sum(r["budget"] for r in doc["allocation"]) == 48 * 18 and min(r["budget"] for r in doc["allocation"]) > a["recent_window"]
    # what generate --allocate reads from the file: the split and the policy it was made for
    from kvsim.allocation.split import read_allocation

    (tmp_path / "tune.json").write_text(json.dumps(doc))
    budgets, policy = read_allocation(tmp_path / "tune.json")
    assert policy == "h2o" and [budgets[(x, 0)] for x in range(18)] == [r["budget"] for r in doc["allocation"]]


def test_the_groups_are_whole_layers_in_runs_of_one_attention_kind():
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]  # Gemma-3-270M's
    assert head_groups([(x, 0) for x in range(18)], kinds) == [[0, 1, 2, 3, 4], [5], [6, 7, 8, 9, 10], [11],
                                                                [12, 13, 14, 15, 16], [17]]
    shape = [(x, h) for x in range(4) for h in range(2)]  # two KV heads per layer: a layer's heads move together
    assert head_groups(shape, ["sliding", "sliding", "global", "global"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@needs_torch
def test_tunes_truth_measures_a_split_at_the_tuned_window_once_then_reads_it(session):  # noqa: F811
    """``tune --allocate auto --by kl``'s measure (the CLI's truth, its session opened already): the split's
    open-loop truth at model_window, through the disk cache, counted as tune's summary counts it."""
    import argparse

    from kvsim.allocation.truth import open_truth
    from kvsim.cli.tune_command import _Truth

    truth = _Truth.__new__(_Truth)
    truth.args = argparse.Namespace(policy="h2o", no_cache=False, trace="tiny")
    truth.policy, truth.fixed = "h2o", {}  # what tune holds (its plan's or its flags' policy, other parameters as given)
    truth.session, truth.counts = session, {"read": 0, "measured": 0}
    truth.at = lambda window: {**truth.fixed, "recent_window": window}  # as _Tuning.at hands it over
    flat = [16, 8] * session.layers  # the same memory as 12 per head
    got = truth.split(flat, 4)
    want = open_truth(session, "h2o", [[16, 8]] * session.layers, {"recent_window": 4})
    assert got["kl"] == want["kl"] and got["delta_nll"] == want["delta_nll"] and got["cached"] is False
    assert truth.split(flat, 4)["cached"] is True and truth.counts == {"read": 1, "measured": 1}

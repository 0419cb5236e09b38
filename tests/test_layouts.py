"""The serving layouts (``kvsim.policykit.layouts``, issue 45; docs/serving.md) against the rules of
docs/domain.md, "What a serving engine allows", on small hand-made traces: never more than the budget held,
between ``budget - s + 1`` and the budget once full, whole complete blocks only, the recency policies' oldest
block first and the older block on ties, the same positions in every head under shared selection, the cache
growing between decisions and never past the budget; with no constraint every policy is its bare self, bit
for bit, and so is the wrapper's own machinery at block size 1. On the shipped gemma3-270m L05 trace (512
steps, budget 256): the optimum under blocks at or above every online policy with blocks of 16 and at or
below the unconstrained optimum."""

from __future__ import annotations

import time

import numpy as np
import pytest
from random_traces import random_trace

import kvsim
from kvsim.data import vectors
from kvsim.data.catalog import resolve_trace
from kvsim.policies import POLICIES, PolicySpec
from kvsim.policykit.layouts import Layout, LayoutError, paged
from kvsim.policykit.layouts.held import LayoutPolicy
from kvsim.policykit.registry import compared, online
from kvsim.sim.harness import replay_reference
from kvsim.sim.layered import replay_layer
from kvsim.sim.simulate import replay

#: the attention policies of the comparisons, each at a window a small budget holds
SMALL = {"h2o": {"recent_window": 4}, "tova": {}, "snapkv": {"recent_window": 4}, "scissorhands": {"recent_window": 4},
         "streaming_llm": {"sinks": 2}, "sliding_window": {}, "h2o_normalized": {"recent_window": 4}}


def counts(history: np.ndarray) -> np.ndarray:
    return (history >= 0).sum(axis=1)


def test_no_constraint_is_the_bare_policy_bit_for_bit():
    trace = random_trace(80, 1)
    for name in compared():
        spec = PolicySpec.of(name, 16, **{p.name: 3 for p in kvsim.policies.tunables(name) if p.below_budget})
        bare = replay(trace, spec, reference=True)
        for layout in (None, Layout(), Layout(1, False, 1)):
            again = replay(trace, spec, layout=layout)
            assert np.array_equal(again.retained_mass_series, bare.retained_mass_series), name
            assert again.summary() == replay(trace, spec).summary()
        # the wrapper itself at block size 1, one head, interval 1: the policy's own evict, the same bits
        wrapped = replay_reference(trace, LayoutPolicy(spec.build(trace), Layout(), 16))
        assert np.array_equal(wrapped.retained_mass_series, bare.retained_mass_series), name


def test_summed_scores_of_identical_heads_are_each_head_alone():
    """Shared selection of two copies of one head at block size 1: the summed score is twice each head's, so
    the choice (by the layout's own scoring and removal, not the policy's evict) is the bare policy's."""
    trace = random_trace(70, 2)
    for name, params in SMALL.items():
        spec = PolicySpec.of(name, 12, **params)
        bare = replay(trace, spec, reference=True)
        layer = replay_layer([trace, trace], spec, Layout(1, True, 1))
        for head in layer["heads"]:
            assert np.array_equal(head.retained_mass_series, bare.retained_mass_series), name


@pytest.mark.parametrize("s,budget", [(4, 16), (4, 18), (8, 24), (2, 11)])
def test_blocks_hold_whole_blocks_never_above_the_budget(s, budget):
    trace = random_trace(90, 3)
    memory = budget // s * s
    for name, params in SMALL.items():
        result = replay(trace, name, budget=budget, layout=Layout(s, False, 1), record_kept=True,
                        record_victims=True, **params)
        held = counts(result.kept_history)
        assert held.max() <= memory and result.memory == memory
        full = np.arange(1, 91) >= memory
        assert np.all(held[full] >= memory - s + 1), name
        for t, (row, victims) in enumerate(zip(result.kept_history, result.victims_history, strict=True), start=1):
            kept = row[row >= 0]
            for b in np.unique(kept // s):  # every block but the one filling is held whole
                if b < t // s:
                    assert np.isin(np.arange(b * s, b * s + s), kept).all(), (name, t, b)
            if victims:  # whole complete blocks leave, only when a block opens (interval 1)
                assert t % s == 0 and len(victims) % s == 0
                assert {v // s for v in victims} <= set(range(t // s)) or s == 1


def test_recency_policies_evict_the_oldest_block():
    trace = random_trace(64, 4)
    s, budget = 4, 16
    window = replay(trace, "sliding_window", budget=budget, layout=Layout(s), record_kept=True)
    for t, row in enumerate(window.kept_history, start=1):
        kept = row[row >= 0]
        first = max(0, (t // s - budget // s + 1) * s)
        assert np.array_equal(kept, np.arange(first, t + 1)), t
    sinks = replay(trace, "streaming_llm", budget=budget, layout=Layout(s), sinks=2, record_kept=True)
    last = sinks.kept_history[-1]
    assert np.isin(np.arange(s), last).all()  # the sinks' block stays; the oldest of the others went


def test_the_lowest_block_goes_the_older_first_on_ties():
    kept = np.arange(49)
    flat = np.ones(49)
    assert paged.choose(kept, flat, 48, 16, 1).tolist() == list(range(16))  # all equal: block 0, the oldest
    scores = np.ones(49)
    scores[16:32] = 0.5
    assert paged.choose(kept, scores, 48, 16, 1).tolist() == list(range(16, 32))
    scores[:16] = 0.5
    assert paged.choose(kept, scores, 48, 16, 1).tolist() == list(range(16))  # a tie: the older block
    scores[:] = 1.0
    scores[:32] = np.inf  # protected (a window, sinks); block 2 is complete only once 47 is in
    with pytest.raises(LayoutError):
        paged.choose(kept[:-1], scores[:-1], 47 - 1, 16, 1)
    assert paged.choose(kept[:48], scores[:48], 47, 16, 1).tolist() == list(range(32, 48))


def test_shared_selection_holds_the_same_positions_in_every_head():
    rng = np.random.default_rng(5)
    heads = [random_trace(80, rng) for _ in range(3)]
    for layout in (Layout(1, True, 1), Layout(4, True, 1), Layout(4, True, 3)):
        for name, params in SMALL.items():
            out = replay_layer(heads, PolicySpec.of(name, 16, **params), layout, record_kept=True)
            first = out["heads"][0].kept_history
            for other in out["heads"][1:]:
                assert np.array_equal(other.kept_history, first), (name, layout)
            assert counts(first).max() <= 16
    apart = replay_layer(heads, PolicySpec.of("tova", 16), Layout(2), record_kept=True)
    assert any(not np.array_equal(apart["heads"][0].kept_history, h.kept_history) for h in apart["heads"][1:])


@pytest.mark.parametrize("s,k", [(1, 5), (1, 1), (4, 3), (4, 8)])
def test_decisions_at_intervals_grow_the_cache_between_them_never_past_the_budget(s, k):
    trace = random_trace(100, 6)
    budget = 20
    layout = Layout(s, False, k)
    floor = layout.floor(budget)
    for name, params in SMALL.items():
        result = replay(trace, name, budget=budget, layout=layout, record_kept=True, record_victims=True, **params)
        held = counts(result.kept_history)
        assert held.max() <= budget // s * s
        for t in range(1, 101):
            if t % k:  # no decision: nothing leaves, the cache grows by one
                assert result.victims_history[t - 1] == [], (name, t)
                assert held[t - 1] == (held[t - 2] if t > 1 else 1) + 1
            elif held[t - 1] < (held[t - 2] if t > 1 else 1) + 1:  # it evicted: down to the floor, or above it
                assert held[t - 1] >= floor
        if s == 1:
            assert held[80 // k * k - 1] == budget - k + 1  # full by then: down to budget - k + 1 at a decision


def test_the_optimum_under_blocks_bounds_every_online_policy_with_blocks():
    """The shipped gemma3-270m L05 trace, its first 512 steps, budget 256, blocks of 16."""
    whole = resolve_trace("gemma3-270m-L05")
    trace = kvsim.from_array(whole.attention[:513, :513], name="L05-512")
    budget, layout = 256, Layout(16)
    free = replay(trace, "optimal", budget=budget).retained_mass
    blocks = replay(trace, "optimal", budget=budget, layout=layout).retained_mass
    assert blocks <= free + 1e-12
    start = time.perf_counter()
    names = [n for n in online() if not vectors.missing(trace, POLICIES[n].reads, getattr(POLICIES[n], "reads_meta", False))]
    assert {"h2o", "tova", "snapkv", "streaming_llm", "random"} <= set(names)
    online_mass = {name: replay(trace, name, budget=budget, layout=layout).retained_mass for name in names}
    seconds = time.perf_counter() - start
    assert all(m <= blocks + 1e-12 for m in online_mass.values()), online_mass
    assert seconds < 120, f"{len(online_mass)} online replays of 512 steps took {seconds:.1f} s on the reference path"


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="larger than the budget"):
        Layout(32).check("h2o", 16, {"recent_window": 4})
    with pytest.raises(ValueError, match="evict_every"):
        Layout(1, False, 0)
    with pytest.raises(ValueError, match="recent_window 32 must be below"):
        Layout(1, False, 40).check("h2o", 64, {"recent_window": 32})
    with pytest.raises(ValueError, match="offline reference"):
        Layout(16).check("greedy_future", 64, {})
    with pytest.raises(ValueError, match="--block-size only"):
        Layout(16, True).check("optimal", 64, {})
    assert Layout(16).check("h2o", 250, {}) == [
        "budget 250 is no multiple of block_size 16: rounded down to 15 whole blocks (240 positions)"]
    assert Layout(1, True).check("h2o", 64, {}, heads=1) == ["shared selection on a trace with one KV head: a no-op"]


def test_every_online_policy_runs_under_every_layout():
    """The scores a layout sums are each policy's own, read the one way for every SlotPolicy (the key, value and
    query scorers included), and removal keeps their per-position state aligned: nothing fails, nothing overfills."""
    trace = random_trace(150, 3, members=True)
    for name in online():
        params = {p.name: 3 for p in kvsim.policies.tunables(name) if p.below_budget}
        for layout in (Layout(4), Layout(4, False, 3), Layout(1, False, 5), Layout(1, True, 1)):
            result = replay(trace, name, budget=32, layout=layout, record_kept=True, **params)
            assert counts(result.kept_history).max() <= 32, (name, layout)

"""The policy family beyond the cards: scissorhands, tova, the greedy offline reference and the upper bound.

Each policy's own eviction orders, the H2O card's distinguishing vector (h2o vs scissorhands),
and invariants over random small traces. The registry-wide contract lives in test_policies_contract.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from random_traces import random_trace
from tolerance import rounding

import kvsim
from kvsim.policies.greedy_future import BLOCK, GreedyFuture
from kvsim.policykit.upper_bound import upper_bound_series, upper_bound_summary


def trace_from_rows(rows) -> kvsim.Trace:
    """A trace whose row t (1-based) is ``rows[t - 1]`` over positions 0 .. t-1."""
    T = len(rows)
    A = np.zeros((T + 1, T + 1))
    for t, row in enumerate(rows, start=1):
        A[t, :t] = row
    return kvsim.from_array(A)


def step(policy, pos, attn, budget=None):
    policy.on_decode_step(pos, None if attn is None else np.asarray(attn, dtype=np.float32))
    return policy.evict(policy.budget if budget is None else budget)


# --- the H2O card's distinguishing vector -------------------------------------------------------

#: position 0 takes the whole of step 1 and 0.98 of step 2, then 0.01 of every row after
SPIKE_ROWS = [[1.0], [0.98, 0.02]] + [[0.01] + [0.99 / (t - 1)] * (t - 1) for t in range(3, 13)]


def test_h2o_defends_an_early_spike_that_scissorhands_evicts():
    tr = trace_from_rows(SPIKE_ROWS)
    h2o = kvsim.replay(tr, "h2o", budget=4, recent_window=2, record_victims=True, record_kept=True)
    sh = kvsim.replay(tr, "scissorhands", budget=4, recent_window=2, record_victims=True, record_kept=True)
    # step 4 is the first eviction: the same steps, the same candidates [0, 1, 2]
    assert h2o.victims_history[3] == [2]  # 0 has the highest sum (about 2.0)...
    assert sh.victims_history[3] == [0]  # ...and a single vote (step 2; step 1's 1.0 is not > 1/1)
    assert 0 in h2o.kept_history[-1]  # h2o defends it for the rest of the run
    assert 0 not in sh.kept_history[3]


# --- scissorhands ---------------------------------------------------------------------------------


def test_scissorhands_votes_strictly_above_fair_share():
    p = kvsim.make_policy("scissorhands", budget=8, recent_window=0)
    step(p, 1, [1.0])  # n = 1: 1.0 is the fair share, not above it
    assert p.scores.tolist() == [0, 0]
    step(p, 2, [0.5, 0.5])  # exactly 1/2 each: no vote
    assert p.scores.tolist() == [0, 0, 0]
    step(p, 3, [0.6, 0.3, 0.1])  # threshold 1/3
    assert p.scores.tolist() == [1, 0, 0, 0]
    step(p, 4, [0.25, 0.25, 0.25, 0.25])
    assert p.scores.tolist() == [1, 0, 0, 0, 0]
    # a uniform row of three as the harness renormalises it: float32(1/3) > 1/3 in float64,
    # which is why the fair share is compared in float32
    third = np.float32(1.0) / np.float32(3.0)
    assert np.float64(third) > 1 / 3
    q = kvsim.make_policy("scissorhands", budget=8, recent_window=0)
    step(q, 1, [1.0])
    step(q, 2, [0.5, 0.5])
    step(q, 3, [third] * 3)
    assert q.scores.tolist() == [0, 0, 0, 0]
    assert p.keeps_scores and p.scores.dtype == np.float64


def test_scissorhands_none_adds_no_votes_and_keeps_the_window():
    p = kvsim.make_policy("scissorhands", budget=8, recent_window=0, history_window=2)
    step(p, 1, [1.0])
    step(p, 2, [0.9, 0.1])  # vote for 0
    before = p.scores
    step(p, 3, None)
    step(p, 4, None)
    assert p.scores[:3].tolist() == before.tolist()  # None does not age the window either
    step(p, 5, [0.7, 0.1, 0.1, 0.05, 0.05])  # vote for 0 again (threshold 0.2)
    assert p.scores[0] == 2
    step(p, 6, [0.04, 0.8, 0.04, 0.04, 0.04, 0.04])  # the step-2 vote leaves the window
    assert p.scores[:2].tolist() == [1, 1]


def test_scissorhands_whole_run_equals_a_window_longer_than_the_run():
    tr = random_trace(40, 3, shape="heavy")
    whole = kvsim.replay(tr, "scissorhands", budget=8, recent_window=2, record_kept=True)
    longer = kvsim.replay(tr, "scissorhands", budget=8, recent_window=2, history_window=40, record_kept=True)
    short = kvsim.replay(tr, "scissorhands", budget=8, recent_window=2, history_window=3, record_kept=True)
    np.testing.assert_array_equal(whole.kept_history, longer.kept_history)
    assert not np.array_equal(whole.kept_history, short.kept_history)


def test_scissorhands_evicts_lowest_count_lower_position_on_ties_recent_protected():
    p = kvsim.make_policy("scissorhands", budget=4, recent_window=1)
    step(p, 1, [1.0])
    step(p, 2, [0.2, 0.8])  # vote: 1
    step(p, 3, [0.1, 0.8, 0.1])  # vote: 1
    # counts after step 4's votes [0, 3, 0, 0]; admit 4 -> evict one of [0, 1, 2, 3] (4 protected)
    assert step(p, 4, [0.1, 0.7, 0.1, 0.1]) == [0]  # 0, 2 and 3 tie at 0: the lower goes
    assert p.kept.tolist() == [1, 2, 3, 4]
    p2 = kvsim.make_policy("scissorhands", budget=5, recent_window=1)
    for t in range(1, 6):
        p2.on_decode_step(t, np.full(t, 1.0 / t, dtype=np.float32))
    assert p2.evict(2) == [0, 1, 2, 3]  # several at once: ascending, the newest protected


@pytest.mark.parametrize(
    "params, field",
    [
        ({"recent_window": 64}, "recent_window"),
        ({"recent_window": -1}, "recent_window"),
        ({"history_window": -1}, "history_window"),
        ({"budget": 0}, "budget"),
    ],
)
def test_scissorhands_refusals_name_the_parameter(params, field):
    with pytest.raises(ValueError, match=field):
        kvsim.make_policy("scissorhands", **{"budget": 64, **params})


# --- tova -----------------------------------------------------------------------------------------


def test_tova_evicts_lowest_latest_weight_and_never_the_newest():
    p = kvsim.make_policy("tova", budget=3)
    step(p, 1, [1.0])
    step(p, 2, [0.4, 0.6])
    assert step(p, 3, [0.5, 0.1, 0.4]) == [1]  # only the latest row counts
    assert step(p, 4, [0.0, 0.0, 0.0]) == [0]  # all tied at zero: lower position; 4 is safe
    assert p.kept.tolist() == [2, 3, 4]


def test_tova_none_keeps_weights_and_unweighted_positions_rank_above_weighted():
    p = kvsim.make_policy("tova", budget=3)
    step(p, 1, [1.0])
    step(p, 2, [0.3, 0.7])
    assert step(p, 3, None) == [0]  # weights from step 2 still stand: 0 has 0.3 < 0.7
    assert step(p, 4, None) == [1]  # 1 has 0.7; 2 and 3 have no weight yet, 4 is the newest
    assert step(p, 5, None) == [2]  # nothing weighted left: the lower unweighted position
    assert np.isnan(p.weights).all()


def test_tova_budget_one_keeps_only_the_newest():
    tr = random_trace(10, 5, shape="heavy")
    r = kvsim.replay(tr, "tova", budget=1, record_kept=True)
    assert r.kept_history[:, 0].tolist() == list(range(1, 11))


# --- greedy_future (offline, greedy) and the upper bound -------------------------------------------


def test_greedy_future_needs_the_trace():
    with pytest.raises(ValueError, match="trace"):
        kvsim.make_policy("greedy_future", budget=4)
    assert GreedyFuture.needs_trace


def test_greedy_future_evicts_least_attention_still_to_come():
    # future attention after step 3: position 0 gets 0.1 + 0.1, 1 gets 0.5 + 0.2, 2 gets 0.2 + 0.3,
    # 3 gets 0.2 + 0.4 -> evict 0, then after step 4 the future is row 5 alone
    rows = [[1.0], [0.5, 0.5], [0.3, 0.3, 0.4], [0.1, 0.5, 0.2, 0.2], [0.1, 0.2, 0.3, 0.4, 0.0]]
    r = kvsim.replay(trace_from_rows(rows), "greedy_future", budget=3, record_victims=True)
    assert r.victims_history == [[], [], [0], [4], [1]]
    tied = [[1.0], [0.5, 0.5], [0.3, 0.3, 0.4]]  # after step 2, 0 and 1 both have 0.3 to come
    assert kvsim.replay(trace_from_rows(tied), "greedy_future", budget=2, record_victims=True).victims_history[1] == [0]


def test_greedy_future_attention_matches_brute_force_across_blocks():
    tr = random_trace(2 * BLOCK + 17, 7, shape="heavy")
    o = GreedyFuture(budget=8, trace=tr)
    A = tr.attention.astype(np.float64)
    positions = np.arange(tr.steps + 1)
    for after in (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, tr.steps - 1, tr.steps):
        # two float64 sums, in different orders, of at most T weights of at most 1 each
        np.testing.assert_allclose(o.future_attention(positions, after), A[after + 1 :].sum(axis=0), rtol=0,
                                   atol=2 * rounding(tr.steps, tr.steps, np.float64))


def test_upper_bound_is_the_top_budget_sum_of_each_row():
    tr = random_trace(30, 11, shape="heavy")
    ub = upper_bound_series(tr, 5)
    for t in range(1, 31):
        row = np.sort(tr.attention[t, :t].astype(np.float64))[::-1]
        assert ub[t - 1] == pytest.approx(row[:5].sum(), abs=2 * rounding(5, 1.0, np.float64))  # two float64 sums of 5
    # nothing ever evicted: a whole row, whose float32 weights sum to 1 within one rounding each
    np.testing.assert_allclose(upper_bound_series(tr, 30), 1.0, rtol=0, atol=rounding(31))


def test_greedy_future_at_the_last_step_holds_the_best_of_its_candidates():
    # after step T-1 the attention still to come is row T alone, so greedy_future's last eviction
    # keeps the best `budget` of the positions it held: the one step where greedy is optimal
    tr = random_trace(25, 13, shape="heavy")
    o = GreedyFuture(budget=6, trace=tr)
    for t in range(1, 25):
        o.on_decode_step(t, None)
        if t < 24:
            o.evict(6)
    candidates = o.kept
    o.evict(6)
    row = tr.attention[25].astype(np.float64)
    assert row[o.kept].sum() == pytest.approx(np.sort(row[candidates])[-6:].sum(), abs=2 * rounding(6, 1.0, np.float64))


def test_greedy_future_is_not_an_upper_bound_on_other_policies():
    # what is true: greedy_future never passes the upper bound. What is not: that it beats every
    # policy (it ranks by total future attention, which favours long-lived low weights over the
    # recency band). Pin that on a canonical-shaped trace without prompt anchors, with a flat band
    # and a long thin opening tail (the generator's version-1 shape), where tova beats it by a wide
    # margin, so nobody reads greedy_future as "the best possible" (that is `optimal`). (On the anchored canonical trace
    # tova beats greedy_future only narrowly at budget 256: 0.9367 against 0.9345.)
    tr = kvsim.generate_canonical(kvsim.CanonicalConfig(
        steps=600, anchors=0, anchor_share=0.0, band_noise=0.3, band_share=0.5435,
        background_noise=1.0, background_lean=1.6))
    greedy = kvsim.replay(tr, "greedy_future", budget=64)
    tova = kvsim.replay(tr, "tova", budget=64)
    ub = upper_bound_series(tr, 64)
    slack = 2 * rounding(65, 1.0, np.float64)  # two float64 sums of at most 65 kept weights
    assert np.all(greedy.retained_mass_series <= ub + slack)
    assert np.all(tova.retained_mass_series <= ub + slack)
    assert tova.retained_mass > greedy.retained_mass


# --- invariants over random traces ---------------------------------------------------------------

FAMILY = [
    ("sliding_window", {}),
    ("streaming_llm", {"sinks": 0}),
    ("h2o", {"recent_window": 0}),
    ("h2o", {"recent_window": 1}),
    ("scissorhands", {"recent_window": 1}),
    ("scissorhands", {"recent_window": 1, "history_window": 2}),
    ("tova", {}),
    ("greedy_future", {}),
]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 24),
    budget=st.integers(2, 8),
    zero_share=st.sampled_from([0.0, 0.5, 0.9]),
)
def test_no_policy_passes_the_upper_bound(seed, steps, budget, zero_share):
    tr = random_trace(steps, seed, shape="heavy", zero_share=zero_share)
    ub = upper_bound_series(tr, budget)
    assert ub.shape == (steps,) and np.all(ub <= 1 + rounding(steps + 1))  # a whole float32 row at most
    for name, params in FAMILY:
        r = kvsim.replay(tr, name, budget=budget, record_kept=True, **params)  # the harness checks victims
        assert np.all(r.retained_mass_series <= ub + 2 * rounding(budget + 1, 1.0, np.float64)), name  # two kept sums
        if name == "tova":  # the newest position survives every eviction
            assert np.all(r.kept_history.max(axis=1) == np.arange(1, steps + 1))
        if name == "scissorhands":  # the recent window is never evicted
            assert all(t in r.kept_history[t - 1] for t in range(1, steps + 1))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(2, 20), budget=st.integers(2, 6))
def test_scissorhands_counts_are_votes(seed, steps, budget):
    """Counts are whole numbers no larger than the observed steps a position has been held for,
    and a window of N never lets a count pass N."""
    tr = random_trace(steps, seed, shape="heavy")
    for window in (0, 2):
        r = kvsim.replay(tr, "scissorhands", budget=budget, recent_window=1, history_window=window, record_scores=True)
        for t in range(1, steps + 1):
            held = r.score_positions[t - 1] >= 0
            counts = r.score_history[t - 1, held]
            ages = t - r.score_positions[t - 1, held]  # steps each has been shown to a query
            assert np.all(counts == np.round(counts)) and np.all(counts >= 0)
            assert np.all(counts <= ages)
            if window:
                assert np.all(counts <= window)


def test_upper_bound_summary_recall_is_what_budget_positions_can_hold():
    tr = random_trace(12, 17, shape="heavy")
    # top_k 4: steps 1..4 want t positions, the rest want 4; a budget of 2 holds 2 of them
    want = np.minimum(4, np.arange(1, 13))
    s = upper_bound_summary(tr, budget=2, top_k=4)
    # float64 means of 12 figures of at most 1, each side its own sum and division
    assert s["top_k_recall"] == pytest.approx(np.mean(np.minimum(2, want) / want), abs=2 * rounding(13, 1.0, np.float64))
    assert s["retained_mass"] == pytest.approx(upper_bound_series(tr, 2).mean(), abs=2 * rounding(13, 1.0, np.float64))
    assert upper_bound_summary(tr, budget=4, top_k=4)["top_k_recall"] == 1.0


# --- the fast engine's scissorhands path ---------------------------------------------------------

"""Baselines from practice: h2o_normalized, snapkv and random. Each one's own eviction orders, the
vector that tells it apart from its nearest neighbour, and its parameters. The registry-wide
contract (budget, victims, None, determinism) lives in test_policies_contract."""

from __future__ import annotations

import numpy as np
import pytest
from tolerance import rounding

import kvsim
from kvsim.policies.random_eviction import DEFAULT_SEED


def trace_from_rows(rows) -> kvsim.Trace:
    T = len(rows)
    A = np.zeros((T + 1, T + 1))
    for t, row in enumerate(rows, start=1):
        A[t, :t] = row
    return kvsim.from_array(A)


def step(policy, pos, attn):
    policy.on_decode_step(pos, None if attn is None else np.asarray(attn, dtype=np.float32))
    return policy.evict(policy.budget)


# --- h2o_normalized -------------------------------------------------------------------------------


def test_h2o_normalized_ranks_by_rate_where_h2o_ranks_by_total():
    """Same steps, same candidates [0, 1, 2] at the first eviction: h2o evicts 2, the newest
    candidate, whose one row gave it less in total (0.6) than 1's two rows (0.8); normalised, 2
    took 0.6 a step and 1 only 0.4, so 1 goes."""
    rows = [[1.0], [0.5, 0.5], [0.1, 0.3, 0.6]]
    for name, victim in (("h2o", 2), ("h2o_normalized", 1)):
        p = kvsim.make_policy(name, budget=3, recent_window=1)
        assert step(p, 1, rows[0]) == [] and step(p, 2, rows[1]) == []
        assert step(p, 3, rows[2]) == [victim], name
    p = kvsim.make_policy("h2o_normalized", budget=8, recent_window=1)
    for t, row in enumerate(rows, start=1):
        step(p, t, row)
    # float32 sums of at most 3 float32 weights, then one division by the step count
    np.testing.assert_allclose(p.scores, [1.6 / 3, 0.8 / 2, 0.6 / 1, 0.0], rtol=rounding(3 + 2))


def test_h2o_normalized_none_does_not_count_as_a_step_held():
    p = kvsim.make_policy("h2o_normalized", budget=8, recent_window=0)
    step(p, 1, [1.0])
    step(p, 2, None)
    step(p, 3, None)
    assert p.scores.tolist() == [1.0, 0.0, 0.0, 0.0]  # 1.0 over one observed step, not over three
    step(p, 4, [0.5, 0.5, 0.0, 0.0])
    assert p.scores[:2].tolist() == [0.75, 0.5]


def test_h2o_normalized_ties_evict_the_lower_position_and_protect_the_recent_window():
    p = kvsim.make_policy("h2o_normalized", budget=3, recent_window=1)
    step(p, 1, [1.0])
    step(p, 2, [1.0, 0.0])
    assert step(p, 3, [1.0, 0.0, 0.0]) == [1]  # 1 and 2 both average 0: the lower goes; 3 is protected
    assert p.kept.tolist() == [0, 2, 3]
    q = kvsim.make_policy("h2o_normalized", budget=2, recent_window=0)
    step(q, 1, [1.0])
    assert step(q, 2, [0.5, 0.5]) == [2]  # the newcomer has no steps yet: score 0, the lowest
    r = kvsim.make_policy("h2o_normalized", budget=2, recent_window=1)
    step(r, 1, [1.0])
    assert step(r, 2, [0.5, 0.5]) == [1]  # 0: 1.5/2 = 0.75, 1: 0.5/1 = 0.5


# --- snapkv ---------------------------------------------------------------------------------------

#: position 0 takes the whole of step 1 and 0.98 of step 2, then 0.01 of every row after (the H2O
#: card's distinguishing vector, as in test_family)
SPIKE_ROWS = [[1.0], [0.98, 0.02]] + [[0.01] + [0.99 / (t - 1)] * (t - 1) for t in range(3, 13)]


def test_snapkv_forgets_an_early_spike_that_h2o_defends():
    tr = trace_from_rows(SPIKE_ROWS)
    h2o = kvsim.replay(tr, "h2o", budget=4, recent_window=2, record_victims=True, record_kept=True)
    snap = kvsim.replay(tr, "snapkv", budget=4, recent_window=2, observation_window=2, record_victims=True,
                        record_kept=True)
    assert h2o.victims_history[3] == [2]  # 0's sum (about 2.0) defends it...
    assert snap.victims_history[3] == [0]  # ...but the last two rows gave it 0.01 each
    assert 0 in h2o.kept_history[-1] and 0 not in snap.kept_history[3]


def test_snapkv_scores_are_the_last_rows_only_and_none_keeps_the_window():
    p = kvsim.make_policy("snapkv", budget=8, recent_window=0, observation_window=2)
    step(p, 1, [1.0])
    step(p, 2, [0.5, 0.5])
    assert p.scores.tolist() == [1.5, 0.5, 0.0]
    step(p, 3, [0.25, 0.25, 0.5])  # row 1 leaves the window
    assert p.scores.tolist() == [0.75, 0.75, 0.5, 0.0]
    step(p, 4, None)  # no information: nothing added, nothing leaves
    assert p.scores.tolist() == [0.75, 0.75, 0.5, 0.0, 0.0]
    step(p, 5, [0.0, 0.0, 0.0, 0.5, 0.5])  # row 2 leaves now
    assert p.scores.tolist() == [0.25, 0.25, 0.5, 0.5, 0.5, 0.0]


@pytest.mark.parametrize("window", [0, 200])
def test_snapkv_with_an_unbounded_window_is_h2o(window, make_trace):
    tr = make_trace(120, seed=4)
    h2o = kvsim.replay(tr, "h2o", budget=16, recent_window=4, record_kept=True, record_scores=True)
    snap = kvsim.replay(tr, "snapkv", budget=16, recent_window=4, observation_window=window, record_kept=True,
                        record_scores=True)
    np.testing.assert_array_equal(snap.kept_history, h2o.kept_history)
    np.testing.assert_array_equal(snap.score_history, h2o.score_history)  # bit for bit
    short = kvsim.replay(tr, "snapkv", budget=16, recent_window=4, observation_window=3, record_kept=True)
    assert not np.array_equal(short.kept_history, h2o.kept_history)


def test_snapkv_ties_evict_the_lower_position():
    p = kvsim.make_policy("snapkv", budget=3, recent_window=1, observation_window=1)
    step(p, 1, [1.0])
    step(p, 2, [0.5, 0.5])
    assert step(p, 3, [0.0, 0.0, 1.0]) == [0]  # 0 and 1 tie at 0 in the window: the lower goes
    assert p.kept.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    ("name", "params", "field"),
    [
        ("snapkv", {"observation_window": -1}, "observation_window"),
        ("snapkv", {"recent_window": 64}, "recent_window"),
        ("h2o_normalized", {"recent_window": 64}, "recent_window"),
        ("h2o_normalized", {"recent_window": -2}, "recent_window"),
    ],
)
def test_refusals_name_the_parameter(name, params, field):
    with pytest.raises(ValueError, match=field):
        kvsim.make_policy(name, budget=64, **params)


def test_defaults():
    assert kvsim.policy_params("h2o_normalized") == {"recent_window": 32}
    assert kvsim.policy_params("snapkv") == {"recent_window": 32, "observation_window": 32}
    assert kvsim.policy_params("random") == {}


# --- random ---------------------------------------------------------------------------------------


def victims_of(rng, make_trace, budget=5):
    tr = make_trace(200, seed=1)
    p = kvsim.make_policy("random", budget=budget, rng=rng)
    return kvsim.replay(tr, p, record_victims=True).victims_history


def test_random_same_seed_same_victims_and_none_is_the_default_seed(make_trace):
    a = victims_of(np.random.default_rng(7), make_trace)
    assert a == victims_of(np.random.default_rng(7), make_trace)
    assert a != victims_of(np.random.default_rng(8), make_trace)
    assert victims_of(None, make_trace) == victims_of(np.random.default_rng(DEFAULT_SEED), make_trace)
    assert kvsim.POLICIES["random"].uses_rng and not kvsim.POLICIES["random"].reads_attention


def test_random_draws_uniformly_among_the_candidates():
    # budget 4, recent_window 0: five candidates at every eviction, the newcomer among them. Over
    # 5000 evictions from a fixed seed each rank is drawn about 1000 times, within 3.5 standard
    # deviations (28 each); a fixed draw, so this cannot flake, and a rule that favoured or starved
    # any rank by 15% would fail it
    p = kvsim.make_policy("random", budget=4, rng=np.random.default_rng(11))
    counts = np.zeros(5, dtype=int)
    for t in range(1, 5004):
        p.on_decode_step(t, None)
        held = p.kept
        victims = p.evict(4)
        if victims:
            counts[int(np.flatnonzero(held == victims[0])[0])] += 1
    assert counts.sum() == 5000 and np.all(np.abs(counts - 1000) < 100), counts


def test_random_evicts_several_at_once_in_ascending_order():
    q = kvsim.make_policy("random", budget=6, rng=np.random.default_rng(0))
    for t in range(1, 401):
        q.on_decode_step(t, None)
        if t < 400:
            assert len(q.evict(6)) == (t >= 6)
    victims = q.evict(3)  # four of the seven held, in ascending order, the newest a candidate too
    assert len(victims) == 4 and victims == sorted(set(victims)) and len(q.kept) == 3
    newest = [kvsim.make_policy("random", budget=1, rng=np.random.default_rng(s)) for s in range(40)]
    for p in newest:
        p.on_decode_step(1, None)
    assert {tuple(p.evict(1)) for p in newest} == {(0,), (1,)}  # nothing protected, not even the newcomer

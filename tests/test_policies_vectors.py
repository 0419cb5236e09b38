"""The policy cards' distinguishing vectors: the small cases that tell each policy from its neighbour,
and H2O's float64 exactness over a thousand steps."""

from __future__ import annotations

import numpy as np
import pytest
from tolerance import rounding

import kvsim


def step(policy, t, attn=None):
    """One harness step by hand: show ``attn`` (float32, aligned with kept), admit t, evict."""
    if attn is not None:
        attn = np.asarray(attn, dtype=np.float32)
    policy.on_decode_step(t, attn)
    return policy.evict(policy.budget)


# --- sliding_window against streaming_llm ---------------------------------------------------------


def test_sliding_window_evicts_0_1_2_where_streaming_llm_keeps_them_and_evicts_4_on():
    window = kvsim.make_policy("sliding_window", budget=5)
    pinned = kvsim.make_policy("streaming_llm", budget=5, sinks=4)
    window_victims = [step(window, t) for t in range(1, 9)]
    pinned_victims = [step(pinned, t) for t in range(1, 9)]
    # steps 1..4 fill the cache (0..4 is five positions); from step 5 one position goes per step
    assert window_victims == [[], [], [], [], [0], [1], [2], [3]]
    assert pinned_victims == [[], [], [], [], [4], [5], [6], [7]]
    assert window.kept.tolist() == [4, 5, 6, 7, 8]
    assert pinned.kept.tolist() == [0, 1, 2, 3, 8]


def test_sliding_window_budget_1_keeps_only_the_newest():
    window = kvsim.make_policy("sliding_window", budget=1)
    assert window.kept.tolist() == [0]
    for t in range(1, 12):
        assert step(window, t) == [t - 1]
        assert window.kept.tolist() == [t]


def test_sliding_window_victims_oldest_first_when_several_go_at_once():
    window = kvsim.make_policy("sliding_window", budget=6)
    for t in range(1, 6):
        window.on_decode_step(t, None)
    assert window.evict(2) == [0, 1, 2, 3]
    assert window.kept.tolist() == [4, 5]


def test_streaming_llm_with_no_sinks_is_a_sliding_window():
    a = kvsim.make_policy("streaming_llm", budget=3, sinks=0)
    b = kvsim.make_policy("sliding_window", budget=3)
    assert [step(a, t) for t in range(1, 10)] == [step(b, t) for t in range(1, 10)]


# --- h2o ----------------------------------------------------------------------------------------


def spike_trace(steps: int = 40) -> kvsim.Trace:
    """Position 1 takes almost the whole of steps 2 and 3 and nearly nothing after; the rest of
    every row goes to the most recent positions."""
    n = steps + 1
    a = np.zeros((n, n))
    a[1, 0] = 1.0
    a[2, :2] = [0.02, 0.98]
    a[3, :3] = [0.01, 0.98, 0.01]
    for t in range(4, n):
        a[t, 1] = 0.001
        a[t, max(2, t - 3) : t] = 1.0  # the three newest (after position 1) share the rest
        a[t, 0] = 0.001
        a[t] /= a[t].sum()
    return kvsim.from_array(a, name="spike")


def test_h2o_defends_the_early_spike_where_the_window_drops_it():
    trace = spike_trace()
    h2o = kvsim.replay(trace, "h2o", budget=4, recent_window=1, record_kept=True, record_scores=True)
    window = kvsim.replay(trace, "sliding_window", budget=4, record_kept=True)
    held = lambda result, pos: [(result.kept_history[t] == pos).any() for t in range(trace.steps)]  # noqa: E731
    assert all(held(h2o, 1)), "h2o evicted the spike"
    assert not any(held(window, 1)[4:]), "the window kept position 1 past step 4"
    # and it is defended because its cumulative score stays the highest of any evictable position
    last = h2o.score_history[-1]
    positions = h2o.score_positions[-1]
    assert positions[np.nanargmax(last)] == 1
    assert h2o.retained_mass < 1.0  # the trace does make it choose


def test_h2o_ties_evict_the_lower_position():
    h2o = kvsim.make_policy("h2o", budget=3, recent_window=1)
    assert step(h2o, 1, [1.0]) == []  # scores [1]
    assert step(h2o, 2, [0.75, 0.25]) == []  # scores [1.75, 0.25, 0]
    # position 1 gains 0, position 2 gains 0.25: both at 0.25, exactly (powers of two)
    assert step(h2o, 3, [0.75, 0.0, 0.25]) == [1]
    assert h2o.kept.tolist() == [0, 2, 3]
    assert h2o.scores.tolist() == [2.5, 0.25, 0.0]


def test_h2o_all_zero_scores_evict_the_lowest_unprotected_positions():
    h2o = kvsim.make_policy("h2o", budget=6, recent_window=2)
    for t in range(1, 6):
        h2o.on_decode_step(t, None)
    assert h2o.evict(2) == [0, 1, 2, 3]
    assert h2o.kept.tolist() == [4, 5]


def test_h2o_victims_ascending_though_chosen_out_of_order():
    h2o = kvsim.make_policy("h2o", budget=6, recent_window=1)
    for t in range(1, 5):  # no eviction needed: 0..4 is five positions, under the budget
        h2o.on_decode_step(t, None)
    h2o.on_decode_step(5, np.array([0.35, 0.1, 0.3, 0.05, 0.2], dtype=np.float32))
    # argmin order is 3 (0.05), 1 (0.1), 4 (0.2); 5 is protected by the window
    assert h2o.evict(3) == [1, 3, 4]
    assert h2o.kept.tolist() == [0, 2, 5]
    assert h2o.scores.tolist() == [np.float32(0.35), np.float32(0.3), 0.0]


def test_h2o_recent_window_zero_evicts_the_newest_at_once(make_trace):
    """The card's pitfall: a position admitted this step has score 0, so without a window it is
    the first thing evicted, every step, and the cache never advances."""
    trace = make_trace(30, seed=4)
    result = kvsim.replay(trace, "h2o", budget=3, recent_window=0, record_victims=True, record_kept=True)
    assert result.victims_history[3:] == [[t] for t in range(4, 31)]
    assert result.kept_history[-1].tolist() == [0, 1, 2]
    # with a window of 1 the same trace does advance
    advancing = kvsim.replay(trace, "h2o", budget=3, recent_window=1, record_kept=True)
    assert advancing.kept_history[-1][-1] == 30


def test_h2o_accumulates_in_float64_exactly_over_a_thousand_steps():
    steps = 1000
    rng = np.random.default_rng(7)
    h2o = kvsim.make_policy("h2o", budget=steps + 1, recent_window=0)  # nothing is ever evicted
    shown = np.zeros((steps, steps + 1), dtype=np.float32)  # row t-1: what step t showed each position
    for t in range(1, steps + 1):
        w = rng.random(t).astype(np.float32)
        w = (w / w.sum(dtype=np.float32)).astype(np.float32)
        shown[t - 1, :t] = w
        h2o.on_decode_step(t, w)
        assert h2o.evict(h2o.budget) == []
    # the reference: each position's float32 weights, widened, added in step order (cumsum is a
    # sequential sum, and adding 0.0 for the steps before a position existed changes nothing)
    exact = np.cumsum(shown.astype(np.float64), axis=0)[-1]
    assert np.array_equal(h2o.scores, exact)
    position_0 = 0.0
    for w in shown[:, 0]:
        position_0 += float(w)
    assert h2o.scores[0] == position_0
    # a float32 accumulator would not get there: low-order bits are lost along the way ...
    single = np.cumsum(shown, axis=0, dtype=np.float32)[-1].astype(np.float64)
    assert not np.array_equal(single, exact)
    assert np.count_nonzero(single != exact) > steps // 2


def test_float32_accumulation_would_evict_the_wrong_position():
    """Position 0 is shown 0.1 (as float32) at each of 1000 steps; position 1 is shown 0.125 at
    each of 800. Exactly, 0 has 1000 * float32(0.1) = 100.0000015 against 1's 100.0, so 1 goes; a
    float32 accumulator reaches only 99.99905 for position 0 and would evict it instead."""
    steps = 1000
    h2o = kvsim.make_policy("h2o", budget=steps + 1, recent_window=steps - 1)  # protects 2 .. 1000
    acc32 = np.zeros(2, dtype=np.float32)
    for t in range(1, steps + 1):
        w = np.zeros(t, dtype=np.float32)
        w[0] = 0.1
        if 2 <= t <= 801:
            w[1] = 0.125
        acc32 += w[:2]
        h2o.on_decode_step(t, w)
        assert h2o.evict(h2o.budget) == []
    assert h2o.scores[:2].tolist() == [1000 * float(np.float32(0.1)), 100.0]
    assert acc32[0] < acc32[1]  # the float32 order is the wrong way round
    assert h2o.evict(steps) == [1]


@pytest.mark.parametrize("recent_window", [0, 1, 5])
def test_h2o_protects_exactly_the_recent_window(recent_window, make_trace):
    trace = make_trace(40, seed=9)
    result = kvsim.replay(trace, "h2o", budget=8, recent_window=recent_window, record_kept=True)
    for t in range(1, trace.steps + 1):
        kept = set(result.kept_history[t - 1].tolist())
        assert set(range(max(0, t - recent_window + 1), t + 1)) <= kept


class _Recorder(kvsim.Policy):
    """Holds everything (budget permitting, by sliding) and records what the harness shows it."""

    name = "recorder_for_test"
    reads_attention = True

    def __init__(self, budget=8, rng=None):
        super().__init__(budget, rng)
        self.inner = kvsim.make_policy("sliding_window", budget=budget)
        self.shown = []

    @property
    def kept(self):
        return self.inner.kept

    def on_decode_step(self, pos, attn):
        self.shown.append((self.kept.copy(), attn))
        self.inner.on_decode_step(pos, attn)

    def evict(self, budget):
        return self.inner.evict(budget)


def test_harness_shows_the_row_renormalised_over_kept_as_float32(make_trace):
    trace = make_trace(20, seed=3)
    policy = _Recorder(budget=5)
    result = kvsim.replay(trace, policy)
    for t, (kept, attn) in enumerate(policy.shown, start=1):
        assert attn.dtype == np.float32 and attn.shape == kept.shape
        row = trace.attention[t, kept].astype(np.float64)
        assert np.array_equal(attn, (row / row.sum()).astype(np.float32))
        assert result.retained_mass_series[t - 1] == pytest.approx(row.sum(), abs=2 * rounding(5, 1.0, np.float64))  # 5 kept

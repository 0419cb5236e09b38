"""The value-weighted scorers, vatp (attention x |v|_1) and critical (attention x the group mean of
|W_O^h v|_2): small cases computed by hand from each definition, the engine against the reference bit for
bit, and a trace without what they read refused in one line.

The hand cases use weights, values and norms that are powers of two (or small sums of them), so every
accumulated score and product below is exact in float64 and the expected numbers are written as they are.
"""

from __future__ import annotations

import numpy as np
import pytest
from random_traces import random_trace, with_members

import kvsim
from kvsim import cli
from kvsim.data.trace import TraceError, load_npz, save_npz
from kvsim.policies.critical import out_norm
from kvsim.policies.vatp import value_l1
from kvsim.sim import engine

needs_engine = pytest.mark.skipif(not engine.AVAILABLE, reason="numba is not installed: no engine to compare with")


def step(policy, t, attn, member):
    """One harness step by hand: hand position t's row over, show ``attn`` (float32), admit t, evict."""
    policy.see(t, member)
    policy.on_decode_step(t, None if attn is None else np.asarray(attn, dtype=np.float32))
    return policy.evict(policy.budget)


# the attention of the first three steps (rows of the kept set, already renormalised) for the hand cases
ROWS = [[1.0], [0.5, 0.5], [0.25, 0.25, 0.5]]
# so after step 3 the accumulated attention of positions 0, 1, 2, 3 is 1.75, 0.75, 0.5 and 0 (the newcomer)


def drive_by_hand(policy, members):
    policy.see(0, members[0])
    return [step(policy, t, ROWS[t - 1], members[t]) for t in (1, 2, 3)]


def test_vatp_by_hand_evicts_what_the_value_norm_makes_least_where_h2o_evicts_the_least_attention():
    values = [[0.5, -0.5], [2.0, 0.0], [4.0, 0.0], [1.0, -1.0]]  # |v|_1: 1, 2, 4, 2
    vatp = kvsim.make_policy("vatp", budget=3, recent_window=1, sinks=0)
    victims = drive_by_hand(vatp, [{"values": np.array(v, dtype=np.float32)} for v in values])
    # step 3: products 1.75 x 1 = 1.75, 0.75 x 2 = 1.5, 0.5 x 4 = 2.0 (3 is in the window): 1 goes
    assert victims == [[], [], [1]]
    assert vatp.kept.tolist() == [0, 2, 3]
    assert vatp.scores.tolist() == [1.75, 2.0, 0.0]
    h2o = kvsim.make_policy("h2o", budget=3, recent_window=1)
    for t in (1, 2, 3):
        h2o.on_decode_step(t, np.asarray(ROWS[t - 1], dtype=np.float32))
    assert h2o.evict(3) == [2]  # the least attention, 0.5


def test_vatp_ties_evict_the_older_position():
    values = [[1.0], [2.0], [3.0], [1.0]]  # step 3's products: 1.75, 0.75 x 2 = 1.5, 0.5 x 3 = 1.5
    vatp = kvsim.make_policy("vatp", budget=3, recent_window=1, sinks=0)
    assert drive_by_hand(vatp, [{"values": np.array(v)} for v in values])[-1] == [1]


def test_vatp_keeps_the_sinks_the_lowest_product_would_take():
    values = [[0.0625], [2.0], [4.0], [1.0]]  # position 0's product 1.75 / 16 is the lowest
    free = kvsim.make_policy("vatp", budget=3, recent_window=1, sinks=0)
    pinned = kvsim.make_policy("vatp", budget=3, recent_window=1, sinks=1)
    members = [{"values": np.array(v)} for v in values]
    assert drive_by_hand(free, members)[-1] == [0]
    assert drive_by_hand(pinned, members)[-1] == [1]  # 1.5 against position 2's 2.0
    assert pinned.scores.tolist() == [1.75 * 0.0625, 2.0, 0.0]  # the score view shows the product still


def test_vatp_evicts_the_oldest_sink_when_only_sinks_are_left_to_choose_from():
    values = [[1.0], [1.0], [1.0], [1.0]]
    vatp = kvsim.make_policy("vatp", budget=3, recent_window=2, sinks=2)  # 0, 1 pinned; 2, 3 in the window
    assert drive_by_hand(vatp, [{"values": np.array(v)} for v in values])[-1] == [0]


def test_vatp_with_equal_value_norms_and_no_sinks_is_h2o(make_trace):
    trace = make_trace(120, seed=3)
    n = trace.steps + 1
    trace.values = np.tile(np.array([[0.5, -1.5, 2.0]], dtype=np.float32), (n, 1))  # |v|_1 = 4 everywhere
    for budget, window in ((8, 1), (16, 4), (40, 10)):
        vatp = kvsim.replay(trace, "vatp", budget=budget, recent_window=window, sinks=0, record_kept=True, reference=True)
        h2o = kvsim.replay(trace, "h2o", budget=budget, recent_window=window, record_kept=True, reference=True)
        assert np.array_equal(vatp.kept_history, h2o.kept_history)


def test_critical_by_hand_weighs_by_the_group_mean_of_the_heads_norms():
    # per query head norms of |W_O^h v_p|_2 (G = 2); their means 1, 1, 4, 1: position 2 is defended
    norms = [[0.5, 1.5], [2.0, 0.0], [7.0, 1.0], [2.0, 0.0]]
    critical = kvsim.make_policy("critical", budget=3, recent_window=1)
    victims = drive_by_hand(critical, [{"out_norms": np.array(v, dtype=np.float32)} for v in norms])
    # step 3: 1.75 x 1, 0.75 x 1, 0.5 x 4 = 2: position 1 goes (h2o would take 2)
    assert victims == [[], [], [1]]
    assert critical.kept.tolist() == [0, 2, 3]
    assert critical.scores.tolist() == [1.75, 2.0, 0.0]
    # one head's norm alone would not do: by the first head's, position 0's 1.75 x 0.5 = 0.875 is the lowest
    # (position 1's 0.75 x 2 = 1.5)
    first_head = kvsim.make_policy("critical", budget=3, recent_window=1)
    assert drive_by_hand(first_head, [{"out_norms": np.array(v[:1])} for v in norms])[-1] == [0]


def test_the_norms_are_the_same_bits_for_one_row_and_for_the_whole_array():
    rng = np.random.default_rng(5)
    values = rng.standard_normal((50, 64)).astype(np.float32)
    whole = value_l1(values)
    for p in range(50):
        assert value_l1(values[p]) == whole[p]
        total = 0.0
        for x in values[p]:  # the definition: |x| widened to float64, added in dimension order
            total += abs(float(x))
        assert whole[p] == total
    norms = rng.random((50, 3)).astype(np.float32)
    whole = out_norm(norms)
    for p in range(50):
        assert out_norm(norms[p]) == whole[p]
        assert whole[p] == (float(norms[p, 0]) + float(norms[p, 1]) + float(norms[p, 2])) / 3


def test_a_policy_shown_no_rows_says_so():
    vatp = kvsim.make_policy("vatp", budget=4, recent_window=1, sinks=0)
    with pytest.raises(ValueError, match="position 0's values were never handed over"):
        vatp.on_decode_step(1, np.ones(1, dtype=np.float32))
    vatp.see(0, {"values": np.ones(2)})
    with pytest.raises(ValueError, match="position 1's values were not handed over"):
        vatp.on_decode_step(1, np.ones(1, dtype=np.float32))


def test_a_norm_that_overflows_is_refused():
    trace = random_trace(5, 1)
    trace.values = np.full((6, 2), 1e308)  # |v|_1 = 2e308: infinite in float64
    with pytest.raises(ValueError, match="vatp: the values norm overflows float64"):
        kvsim.replay(trace, "vatp", budget=3, recent_window=1, sinks=0, reference=True)


@pytest.mark.parametrize(("name", "member", "how"), [("vatp", "values", "kvsim record"),
                                                     ("critical", "out_norms", "kvsim record --vectors")])
def test_a_trace_without_the_member_is_refused_in_one_line(name, member, how, make_trace):
    trace = make_trace(20, seed=1)
    for reference in (True, False):
        with pytest.raises(TraceError) as e:
            kvsim.replay(trace, name, budget=8, recent_window=2, reference=reference)
        assert "\n" not in str(e.value) and f"policy {name} reads {member}" in str(e.value) and how in str(e.value)


@pytest.mark.parametrize(("name", "member"), [("vatp", "values"), ("critical", "out_norms")])
def test_the_cli_refuses_the_canonical_trace_in_one_line(name, member, capsys):
    assert cli.main(["replay", "--policy", name, "--trace", "canonical"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvsim: error: canonical: ") and f"reads {member}" in err


def test_the_cli_replays_a_trace_file_that_carries_them(tmp_path, capsys):
    trace = with_members(random_trace(60, 4), 4)
    path = tmp_path / "with-values.npz"
    save_npz(trace, path)
    loaded = load_npz(path)
    assert np.array_equal(loaded.values, trace.values) and np.array_equal(loaded.out_norms, trace.out_norms)
    for name in ("vatp", "critical"):
        assert cli.main(["replay", "--policy", name, "--trace", str(path), "--budget", "16", "--recent-window", "4"]) == 0
        out = capsys.readouterr().out
        want = kvsim.replay(loaded, name, budget=16, recent_window=4, reference=True).retained_mass
        assert name in out and f"{want:.4f}" in out


@needs_engine
@pytest.mark.parametrize("name", ["vatp", "critical"])
@pytest.mark.parametrize("levels", [0, 1, 2])
def test_engine_equals_the_reference_bit_for_bit(name, levels):
    """Every configuration of a grid on a trace whose attention, values and norms tie often (levels 1, 2)
    or never (0): kept sets, victims, scores and both series, the very bits."""
    trace = with_members(random_trace(300, 7 + levels, shape="levels", levels=2, zero_share=0.3), levels, levels=levels,
                         heads=3)
    grid = [dict(budget=b, recent_window=w, **({"sinks": s} if name == "vatp" else {}))
            for b in (2, 9, 40) for w in sorted({0, 1, b // 2, b - 1}) for s in (0, 1, 4) if s < b]
    if name == "critical":
        grid = [dict(t) for t in {tuple(sorted(g.items())) for g in grid}]
    record = dict(top_k=8, record_kept=True, record_scores=True, record_victims=True)
    for config in grid:
        fast = kvsim.replay(trace, name, **config, **record)
        ref = kvsim.replay(trace, name, reference=True, **config, **record)
        assert fast.summary() == ref.summary(), config
        assert np.array_equal(fast.retained_mass_series, ref.retained_mass_series), config
        assert np.array_equal(fast.top_k_recall_series, ref.top_k_recall_series), config
        assert np.array_equal(fast.kept_history, ref.kept_history), config
        assert fast.victims_history == ref.victims_history, config
        assert np.array_equal(fast.score_history, ref.score_history, equal_nan=True), config
        assert np.array_equal(fast.score_positions, ref.score_positions), config

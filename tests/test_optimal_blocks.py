"""The exact optimum under blocks (``kvsim.policykit.optimal_blocks``, issue 45 item 3): equal to an
exhaustive search over every whole-block schedule on small traces, ``optimal`` itself at block size 1,
never above ``optimal`` at the same budget, its mass that of its own kept sets by the harness's
arithmetic, its certificate, its disk cache and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
from random_traces import random_trace
from tolerance import rounding

import kvsim
from kvsim.policies import optimal
from kvsim.policykit import optimal_blocks
from kvsim.policykit.optimal_blocks import block_schedule, certify, check_block_size, solve
from kvsim.sim.harness import kept_mask_of, kept_sum


def exhaustive(trace: kvsim.Trace, budget: int, s: int) -> float:
    """The best total retained mass over every schedule of whole-block evictions, by trying them all:
    the block rules of docs/domain.md played out directly on held positions, in the harness's order
    (query t scores the held set; t is admitted; if t opens a block and the held positions already
    fill ``budget // s`` blocks, one complete block goes: any held block but the one t fills, which
    at s = 1 is complete on admission and may go too). Independent of the assignment formulation."""
    A = trace.attention.astype(np.float64).tolist()
    T, blocks = trace.steps, budget // s
    best = -1.0

    def walk(t: int, held: tuple, acc: float) -> None:
        nonlocal best
        if t > T:
            best = max(best, acc)
            return
        acc += sum(A[t][p] for p in held)
        opens = t % s == 0
        held_blocks = sorted({p // s for p in held})
        held = (*held, t)
        if opens and len(held_blocks) == blocks:
            candidates = [*held_blocks, t // s] if s == 1 else held_blocks
            for b in candidates:
                walk(t + 1, tuple(p for p in held if p // s != b), acc)
        else:
            assert len(held_blocks) + opens <= blocks
            walk(t + 1, held, acc)

    walk(1, (0,), 0.0)
    return best


def total_tolerance(steps: int, budget: int) -> float:
    """Two float64 sums of the kept weights in different orders: at most budget + 1 terms a row, rows
    summing to at most 1, over ``steps`` rows."""
    return 2 * rounding(steps * (budget + 1), steps, np.float64)


CASES = [(s, blocks, seed) for s in (2, 3, 4) for blocks in (2, 3, 4) for seed in range(3)]


@pytest.mark.parametrize(("s", "blocks", "seed"), CASES)
def test_equals_exhaustive_search_over_whole_block_schedules(s, blocks, seed):
    rng = np.random.default_rng(100 * s + 10 * blocks + seed)
    # about 6 - 7 evicting block openings, so the search tries at most blocks ** 7 schedules
    steps = int(rng.integers(s * (blocks + 5), s * (blocks + 6) + 1))
    extra = int(rng.integers(0, s)) if seed == 2 else 0  # a budget no multiple of s: rounded down
    budget = blocks * s + extra
    for tr in (random_trace(steps, rng, shape="heavy", zero_share=[0.0, 0.5, 0.3][seed]),
               random_trace(steps, rng, shape="heavy", ties=True), random_trace(steps, rng)):
        x = solve(tr, budget, s)
        best = exhaustive(tr, budget, s)
        assert x.blocks == blocks and (x.note is None) == (extra == 0)
        assert x.objective == pytest.approx(best, abs=total_tolerance(steps, budget))
        assert x.retained_mass * steps == pytest.approx(best, abs=total_tolerance(steps, budget))
        assert certify(tr, x) <= 2 * rounding(steps * (steps + 1) // 2, 1.0, np.float64)


@pytest.mark.parametrize("seed", range(4))
def test_block_size_one_is_optimal_bit_for_bit(seed):
    """At s = 1 the block costs are optimal's costs entry for entry and the solver makes the same
    moves: the same victims, the same objective, and the same kept sets, so the same harness mass."""
    rng = np.random.default_rng(seed)
    for steps, budget in ((30, 4), (120, 16), (200, 7), (10, 12)):
        tr = random_trace(steps, rng, shape=["gamma", "heavy"][seed % 2], ties=seed >= 2)
        x, o = solve(tr, budget, 1), optimal.solve(tr, budget)
        assert np.array_equal(x.victims, o.victims) and x.objective == o.objective
        r = kvsim.replay(tr, "optimal", budget=budget, record_kept=True)
        assert x.retained_mass == r.retained_mass
        assert np.array_equal(x.retained_mass_series, r.retained_mass_series)
        assert np.array_equal(kept_mask_of(x.kept_history()), r.kept_mask())
    tr = random_trace(9, rng)
    for budget in (1, 2, 3, 5):  # every legal schedule, tried
        assert solve(tr, budget, 1).objective == pytest.approx(exhaustive(tr, budget, 1), abs=total_tolerance(9, budget))


@pytest.mark.parametrize("seed", range(3))
def test_never_above_the_unconstrained_optimum_at_the_same_budget(seed):
    rng = np.random.default_rng(50 + seed)
    tr = random_trace(300, rng, shape=["gamma", "heavy", "levels"][seed])
    for budget in (16, 20, 33, 64):
        best = optimal.solve(tr, budget).objective
        last = best
        for s in (1, 2, 4, 8, 16):
            x = solve(tr, budget, s)
            # a block schedule's kept sets grow into a legal schedule without blocks (docstring)
            assert x.objective <= best + total_tolerance(300, budget)
            if budget % 16 == 0:  # each block size's blocks are unions of the smaller's: never better
                assert x.objective <= last + total_tolerance(300, budget)
                last = x.objective


def test_its_mass_is_that_of_its_own_kept_sets_and_they_obey_the_block_rules():
    tr = random_trace(160, 7)
    A = tr.attention
    for budget, s in ((16, 4), (30, 8), (12, 3), (8, 8)):
        x = solve(tr, budget, s)
        hist = x.kept_history()
        cap = x.blocks * s
        prev: set = {0}
        for t in range(1, tr.steps + 1):
            kept = np.sort(np.fromiter(prev, np.int64))  # what query t sees
            assert x.retained_mass_series[t - 1] == kept_sum(A[t], kept)
            assert x.retained_mass_series[t - 1] == pytest.approx(A[t, kept].astype(np.float64).sum(),
                                                                  abs=rounding(kept.size, 1.0, np.float64))
            now = set(hist[t - 1][hist[t - 1] >= 0].tolist())
            assert now <= prev | {t} and t in now  # never re-admitted; the newest never evicted
            gone = (prev | {t}) - now
            blocks = {p // s for p in gone}
            assert len(blocks) <= 1 and not any(p // s in blocks for p in now)  # one whole block at most
            assert all(b * s + s - 1 <= t and (s == 1 or b != t // s) for b in blocks)  # a complete one
            assert len(now) <= cap and (t < cap or len(now) >= cap - s + 1)
            assert (len(gone) > 0) == (t % s == 0 and t >= cap)  # only when a block opens on a full cache
            prev = now
        assert x.retained_mass == pytest.approx(x.objective / tr.steps, abs=total_tolerance(tr.steps, budget) / tr.steps)


def test_refusals_and_the_rounding_note():
    with pytest.raises(ValueError, match="block_size 17 is larger than the budget") as e:
        check_block_size(17, 16)
    assert "\n" not in str(e.value)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="block_size"):
            check_block_size(bad, 16)
    with pytest.raises(ValueError, match="budget"):
        check_block_size(4, 0)
    assert check_block_size(16, 256) == (16, 16, None)
    s, blocks, note = check_block_size(16, 100)
    assert (s, blocks) == (16, 6) and note == "budget 100 is no multiple of block_size 16: rounded down to 6 whole blocks (96 positions)"
    tr = random_trace(40, 1)
    assert solve(tr, 100, 16).note == note and solve(tr, 100, 16).victims.size == 0  # never full: nothing evicted
    assert solve(tr, 100, 16).objective == optimal.solve(tr, 100).objective


def test_disk_cache_round_trips_and_survives_damage(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(optimal_blocks, "CACHE_MIN_STEPS", 1)
    tr = random_trace(120, 3)
    a = block_schedule(tr, 35, 8)
    path = optimal_blocks.cache_file(tr, 4, 8)
    assert path.exists()
    b = block_schedule(tr, 32, 8)  # the same four blocks: the same file
    assert b.seconds == 0.0 and b.note is None and a.note is not None
    assert np.array_equal(a.victims, b.victims) and a.objective == b.objective
    assert np.array_equal(a.retained_mass_series, b.retained_mass_series) and np.array_equal(a.w, b.w)
    path.write_bytes(b"damaged")
    c = block_schedule(tr, 32, 8)
    assert c.seconds > 0 and np.array_equal(c.victims, a.victims)
    assert certify(tr, c) <= 2 * rounding(120 * 121 // 2, 1.0, np.float64)

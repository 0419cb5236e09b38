"""The fast engine against the reference harness: same kept sets, victims, scores and metrics, bit
for bit; and the on-disk cache of the canonical trace.

Every equivalence test needs the engine itself: without numba ``kvsim.replay`` would compare the
reference with itself, so those tests are skipped (and say why) rather than passed.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_traces import random_trace, with_members
from tolerance import rounding

import kvsim
from kvsim.data import canonical, derived, vectors
from kvsim.data import store as cache
from kvsim.data.trace import Trace, load_npz, save_npz
from kvsim.sim import engine

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
needs_engine = pytest.mark.skipif(
    not engine.AVAILABLE, reason="numba is not installed: no engine to compare with the reference"
)


_attention = st.one_of(
    st.builds(
        partial(random_trace, shape="levels"),
        seed=st.integers(0, 2**32 - 1),
        steps=st.integers(1, 80),
        levels=st.sampled_from([1, 2, 3, 1000]),
        zero_share=st.sampled_from([0.0, 0.3, 0.9]),
    ),
    st.builds(partial(random_trace, shape="heavy"), seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 40),
              zero_share=st.sampled_from([0.0, 0.5, 0.95])),
)
#: each carrying the members the scorers beyond attention read (vatp's values, critical's norms), drawn from
#: a few levels as often as not, so their products tie exactly too
traces = st.builds(with_members, _attention, seed=st.integers(0, 2**16), levels=st.sampled_from([0, 1, 2]))


def reference(trace, policy, budget, **kw):
    return kvsim.replay(trace, policy, budget=budget, reference=True, **kw)


def assert_same(fast, ref):
    assert fast.summary() == ref.summary()
    assert np.array_equal(fast.retained_mass_series, ref.retained_mass_series)
    assert np.array_equal(fast.top_k_recall_series, ref.top_k_recall_series)
    assert np.array_equal(fast.kept_history, ref.kept_history)
    assert fast.victims_history == ref.victims_history
    if ref.score_history is None:
        assert fast.score_history is None
    else:
        assert np.array_equal(fast.score_history, ref.score_history, equal_nan=True)
        assert np.array_equal(fast.score_positions, ref.score_positions)


def both(trace, policy, budget, top_k=32, **params):
    assert engine.covers(trace, policy)
    kw = dict(top_k=top_k, record_kept=True, record_scores=True, record_victims=True, **params)
    return kvsim.replay(trace, policy, budget=budget, **kw), reference(trace, policy, budget, **kw)


def draw_params(data, name: str, budget: int) -> dict:
    """A value for each of the policy's tunables: below the budget where the registry says so,
    else from a spread that includes 0 (a history window of 0 counts the whole run)."""
    return {
        p.name: data.draw(st.integers(p.minimum, p.upper(budget)) if p.below_budget
                          else st.sampled_from([v for v in (0, 1, 2, 5, 100) if v >= p.minimum]), label=p.name)
        for p in kvsim.tunables(name)
    }


@needs_engine
@pytest.mark.parametrize("name", sorted(engine.FAST))
@SETTINGS
@given(trace=traces, data=st.data())
def test_engine_replay_matches_the_reference_every_step(name, trace, data):
    """Every policy in the engine's table: kept sets, victims, scores and both series, bit for bit;
    and the kept sets alone (the app's kept view records nothing else, so the engine allocates and
    computes no scores: snapkv then finds its victims through running sums)."""
    budget = data.draw(st.integers(1, trace.steps + 2), label="budget")
    top_k = data.draw(st.sampled_from([1, 3, 32]), label="top_k")
    params = draw_params(data, name, budget)
    fast, ref = both(trace, name, budget, top_k=top_k, **params)
    assert_same(fast, ref)
    kept = kvsim.replay(trace, name, budget=budget, top_k=top_k, record_kept=True, **params)
    assert kept.score_history is None and np.array_equal(kept.kept_history, ref.kept_history)
    assert np.array_equal(kept.retained_mass_series, ref.retained_mass_series)


@needs_engine
@pytest.mark.parametrize("name", sorted(engine.FAST))
@SETTINGS
@given(trace=traces, data=st.data())
def test_engine_batches_match_the_reference_per_configuration(name, trace, data):
    """Several budgets and parameters of one policy in one pass: each configuration's series are
    the reference's, bit for bit."""
    budgets = data.draw(st.lists(st.integers(1, trace.steps + 2), min_size=1, max_size=6), label="budgets")
    configs = [(b, draw_params(data, name, b)) for b in budgets]
    built = [kvsim.make_policy(name, budget=b, trace=trace, **p) for b, p in configs]  # offline ones read it
    mass, recall, _ = engine.run(trace, built, 32)
    for i, (b, p) in enumerate(configs):
        ref = reference(trace, name, b, **p)
        assert np.array_equal(mass[i], ref.retained_mass_series), (b, p)
        assert np.array_equal(recall[i], ref.top_k_recall_series), (b, p)


@needs_engine
@pytest.mark.parametrize("name", sorted(engine.FAST))
@SETTINGS
@given(trace=traces, data=st.data())
def test_engine_budget_sweeps_match_the_reference(name, trace, data):
    """A sweep over budgets through ``kvsim.sweep`` (batches on several threads when there are
    enough of them): each summary is the reference's."""
    budgets = data.draw(st.lists(st.integers(1, trace.steps + 2), min_size=1, max_size=20), label="budgets")
    low = min(budgets)
    params = draw_params(data, name, low)  # within the bounds of every budget swept
    got = kvsim.sweep(trace, name, low, "budget", budgets, **params)
    assert got == [reference(trace, name, b, **params).summary() for b in budgets]


@needs_engine
def test_random_draws_from_the_generator_it_is_given():
    """random's victims come from the generator handed to make_policy, drawn with the reference's
    own calls: same victims for the same seed, and the generator left where the reference leaves it."""
    trace = random_trace(60, 3, shape="levels", levels=2, zero_share=0.3)
    for budget in (1, 7, 30):
        fast, ref = (kvsim.make_policy("random", budget=budget, rng=np.random.default_rng(11)) for _ in range(2))
        got = engine.replay(trace, fast, top_k=32, record_kept=True, record_victims=True)
        want = kvsim.replay(trace, ref, top_k=32, record_kept=True, record_victims=True)
        assert_same(got, want)
        assert fast.rng.bit_generator.state == ref.rng.bit_generator.state
    other = engine.replay(trace, kvsim.make_policy("random", budget=7, rng=np.random.default_rng(12)), top_k=32,
                          record_victims=True)
    assert other.victims_history != engine.replay(trace, kvsim.make_policy("random", budget=7), top_k=32,
                                                  record_victims=True).victims_history


@pytest.mark.parametrize("name", sorted(engine.FAST))
def test_every_engine_policy_gives_what_its_kernel_state_takes(name):
    """A policy's ``engine_inputs`` names exactly the keyword arguments of its kernel's state (after
    the shape), one row per configuration where the input is per configuration."""
    trace = with_members(random_trace(30, 2, shape="levels", levels=3, zero_share=0.3))  # what the scorers read
    budgets = [4, 9]
    built = [kvsim.make_policy(name, budget=b, trace=trace, **{p.name: 1 for p in kvsim.tunables(name)}) for b in budgets]
    cls = type(built[0])
    inputs = (cls.engine_inputs(built, trace.steps, vectors.require(trace, cls.reads, name)) if cls.reads
              else cls.engine_inputs(built, trace.steps))
    state = inspect.signature(engine.FAST[name].state)
    assert set(inputs) == set(list(state.parameters)[1:])
    for key, value in inputs.items():
        assert isinstance(value, np.ndarray), key
        if key not in ("suffix", "multipliers", "keys", "vnorm", "pre", "cos", "sin"):  # greedy_future's suffix sums,
            # the value-weighted policies' multipliers, the key-aware ones' keys, expected_attention's value norms,
            # turned-back queries and rotations: per position of the trace, not per configuration
            assert value.shape[0] == len(budgets), key


@needs_engine
def test_optimal_refuses_an_illegal_schedule(monkeypatch):
    """A schedule that evicts a position twice (only a damaged cache could give one) is refused,
    as the reference's victims check refuses it, not replayed."""
    from kvsim.policies import optimal
    from kvsim.sim.harness import ContractError

    trace = random_trace(30, 5, shape="levels", levels=3, zero_share=0.0)
    good = optimal.solve(trace, 10)
    bad = optimal.OptimalSchedule(good.steps, good.budget, np.full_like(good.victims, good.victims[0]),
                                  good.objective, good.u, good.w)
    monkeypatch.setattr(optimal, "optimal_schedule", lambda *a, **k: bad)
    for use_reference in (True, False):
        with pytest.raises(ContractError):
            kvsim.replay(trace, "optimal", budget=10, reference=use_reference)


@needs_engine
@SETTINGS
@given(trace=traces, data=st.data())
def test_sweep_summaries_match_reference(trace, data):
    budget = data.draw(st.integers(2, trace.steps + 2), label="budget")
    windows = list(range(budget))
    got = kvsim.sweep(trace, "h2o", budget, "recent_window", windows)
    assert got == [reference(trace, "h2o", budget, recent_window=w).summary() for w in windows]
    budgets = data.draw(st.lists(st.integers(1, 90), min_size=1, max_size=4), label="budgets")
    for policy, params in (("sliding_window", {}), ("streaming_llm", {"sinks": 0})):
        got = kvsim.sweep(trace, policy, budget, "budget", budgets, **params)
        assert got == [reference(trace, policy, b, **params).summary() for b in budgets]
    got = kvsim.sweep(trace, "streaming_llm", budget, "sinks", range(budget))
    assert got == [reference(trace, "streaming_llm", budget, sinks=s).summary() for s in range(budget)]
    assert kvsim.sweep(trace, "h2o", budget, "recent_window", windows, reference=True) == kvsim.sweep(
        trace, "h2o", budget, "recent_window", windows)


@needs_engine
def test_zero_kept_mass_passes_zeros():
    """A kept set whose weights are all zero: observed attention is zeros and scores stay put."""
    a = np.zeros((6, 6), dtype=np.float32)
    a[1:, 0] = 1.0  # every row on position 0 only, so the rest score exactly 0
    a[5, :5] = [0.0, 0.5, 0.5, 0.0, 0.0]
    trace = Trace(a)  # built directly: rows 1..4 put nothing on positions 1..4
    for budget in (1, 2, 3):
        for w in range(budget):
            assert_same(*both(trace, "h2o", budget, recent_window=w))


def test_engine_equivalence_is_skipped_not_passed_without_numba():
    """With numba blocked, the equivalence tests must report skipped: passing would mean they
    compared the reference with itself."""
    root = Path(__file__).resolve().parent.parent
    block = ("import sys, pytest; sys.modules['numba'] = None; "
             "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', '-k', 'match or zero_kept', sys.argv[1]]))")
    done = subprocess.run([sys.executable, "-c", block, str(Path(__file__))], capture_output=True, text=True,
                          cwd=root, timeout=300)
    tail = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout[-2000:]
    assert "skipped" in tail and "passed" not in tail, tail
    assert "numba is not installed" in done.stdout


@pytest.fixture(scope="module")
def canonical_trace():
    return canonical.generate()


@needs_engine
def test_canonical_windows_bit_identical(canonical_trace):
    windows = [1, 32, 64, 255]
    swept = kvsim.sweep(canonical_trace, "h2o", 256, "recent_window", windows)
    for w, row in zip(windows, swept, strict=True):
        ref = reference(canonical_trace, "h2o", 256, recent_window=w)
        fast = kvsim.replay(canonical_trace, "h2o", budget=256, recent_window=w)
        assert row == ref.summary() == fast.summary()
        assert np.array_equal(fast.retained_mass_series, ref.retained_mass_series)
        assert np.array_equal(fast.top_k_recall_series, ref.top_k_recall_series)
    assert swept[2]["retained_mass"] == pytest.approx(0.9562, abs=0.5e-4 + rounding(1))  # the README's figure, 4 decimals


@needs_engine
@pytest.mark.parametrize("name", ["greedy_future", "random", "optimal"])
def test_canonical_offline_and_random_bit_identical(canonical_trace, name, tmp_path, monkeypatch):
    """The table's rows that the engine took over from the reference: same victims, kept sets and
    series at budget 256 on the canonical trace (the optimum solved into a scratch cache)."""
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    kw = dict(budget=256, record_kept=True, record_victims=True)
    fast, ref = kvsim.replay(canonical_trace, name, **kw), kvsim.replay(canonical_trace, name, reference=True, **kw)
    assert_same(fast, ref)


@needs_engine
def test_topk_positions_match_the_mask(canonical_trace):
    tops = canonical_trace.derived.topk(32)
    mask = canonical_trace.topk_mask(32)
    for t in range(1, canonical_trace.steps + 1):
        row = np.zeros(canonical_trace.steps + 1, dtype=np.uint8)
        row[tops[t][tops[t] >= 0]] = 1
        assert np.array_equal(row, mask[t]), t


@needs_engine
def test_sweep_batches_progress_and_fallback(monkeypatch):
    trace = random_trace(40, 7, shape="levels", levels=3, zero_share=0.3)
    seen = []
    monkeypatch.setattr(engine, "_BATCH", 3)  # 8 values: three passes, the last one short
    fast = kvsim.sweep(trace, "h2o", 8, "recent_window", range(8), progress=seen.append)
    assert fast == [reference(trace, "h2o", 8, recent_window=w).summary() for w in range(8)]
    assert seen == sorted(seen) and seen[-1] == 1.0 and len(seen) == 3
    # a policy the engine does not cover goes through the reference, one value at a time, with the
    # same progress signature (the fraction done)
    monkeypatch.setattr(engine, "FAST", {})
    seen.clear()
    slow = kvsim.sweep(trace, "h2o", 8, "recent_window", range(8), progress=seen.append)
    assert slow == fast
    assert seen == [(i + 1) / 8 for i in range(8)]
    seen.clear()
    assert kvsim.replay(trace, "h2o", budget=8, recent_window=3, progress=seen.append).summary() == fast[3]
    assert seen and seen[-1] == 1.0


@pytest.mark.parametrize("use_engine", [True, False])
def test_sweep_refuses_bad_values(use_engine, monkeypatch):
    if not use_engine:
        monkeypatch.setattr(engine, "FAST", {})
    trace = random_trace(20, 1, shape="levels", levels=3, zero_share=0.0)
    with pytest.raises(ValueError, match="recent_window"):
        kvsim.sweep(trace, "h2o", 8, "recent_window", [3, 8])
    with pytest.raises(ValueError, match="sinks"):
        kvsim.sweep(trace, "h2o", 8, "sinks", [1])
    with pytest.raises(ValueError, match="budget"):
        kvsim.replay(trace, "sliding_window", budget=0)
    with pytest.raises(ValueError, match="top_k"):
        kvsim.sweep(trace, "h2o", 8, "recent_window", [3], top_k=0)
    with pytest.raises(ValueError, match="top_k"):
        kvsim.replay(trace, "h2o", budget=8, recent_window=3, top_k=0)


# --- the canonical trace cache ------------------------------------------------------------------

SMALL = canonical.CanonicalConfig(steps=96)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_round_trip(cache_dir):
    fresh = canonical.generate(SMALL)
    first = cache.canonical_trace(SMALL)
    path = cache.cache_path(SMALL)
    assert path.parent == cache_dir and path.is_file() and path.with_suffix(".json").is_file()
    assert not list(cache_dir.glob("*.part"))
    again = cache.canonical_trace(SMALL)
    assert np.array_equal(again.attention, fresh.attention) and np.array_equal(first.attention, fresh.attention)
    assert not again.attention.flags.writeable  # the memory map, not a copy
    assert again.meta == fresh.meta and again.name == "canonical"
    # the fingerprint (the optimum's cache key) is read from beside the trace, not hashed again,
    # and is the one the data hashes to
    assert again.derived.has_fingerprint and again.fingerprint == fresh.fingerprint
    # a sidecar written before it held the fingerprint gets it added on the next read, once
    record = json.loads(path.with_suffix(".json").read_text())
    del record["fingerprint"]
    path.with_suffix(".json").write_text(json.dumps(record))
    assert not cache._read(path, SMALL).derived.has_fingerprint
    upgraded = cache.canonical_trace(SMALL)
    assert upgraded.fingerprint == fresh.fingerprint and np.array_equal(upgraded.attention, fresh.attention)
    assert cache._read(path, SMALL).derived.has_fingerprint


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "json", "no-json"])
def test_cache_damage_regenerates(cache_dir, damage):
    fresh = canonical.generate(SMALL)
    cache.canonical_trace(SMALL)
    path = cache.cache_path(SMALL)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "garbage":
        path.write_bytes(b"\x80\x04not an npy file")
    elif damage == "json":
        path.with_suffix(".json").write_text("{not json")
    else:
        path.with_suffix(".json").unlink()
    assert cache._read(path, SMALL) is None
    trace = cache.canonical_trace(SMALL)
    assert np.array_equal(trace.attention, fresh.attention)
    repaired = cache._read(path, SMALL)  # and the cache was rewritten whole
    assert repaired is not None and np.array_equal(repaired.attention, fresh.attention)


def test_cache_key_follows_version_and_config(cache_dir, monkeypatch):
    cache.canonical_trace(SMALL)
    v1 = cache.cache_path(SMALL)
    assert cache.cache_path(canonical.CanonicalConfig(steps=97)) != v1
    monkeypatch.setattr(canonical, "VERSION", canonical.VERSION + 1)
    v2 = cache.cache_path(SMALL)
    assert v2 != v1 and f"v{canonical.VERSION}" in v2.name
    assert cache._read(v1, SMALL) is None  # a file from the old generator is not taken for the new one
    cache.canonical_trace(SMALL)
    assert v2.is_file()


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSIM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "kvsim"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "kvsim"


def test_unwritable_cache_generates_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(blocker / "cache"))  # mkdir under a file fails, even as root
    trace = cache.canonical_trace(SMALL)
    assert np.array_equal(trace.attention, canonical.generate(SMALL).attention)
    assert blocker.read_text() == "not a directory"


# --- the benchmark's process runner -------------------------------------------------------------


def test_bench_times_a_whole_cli_process(tmp_path, monkeypatch):
    from kvsim.bench import speed as bench

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "small.npz"
    save_npz(canonical.generate(SMALL), path)
    args = ["sweep", "--trace", str(path), "--policy", "h2o", "--budget", "16", "--recent-window", "1:15", "--json"]
    run = bench._cli_run({}, args)
    assert run["rows"] == 15 and run["seconds"] > 0
    split = run["split"]  # where the process's time went: its phases add up to the whole, each its own share
    assert list(split) == ["interpreter", "imports", "kernel_load", "work", "exit"]
    assert all(split[p] > 0 for p in ("interpreter", "imports", "work")) and split["exit"] > -0.01
    assert split["kernel_load"] > 0 if engine.AVAILABLE else split["kernel_load"] == 0
    assert abs(sum(split.values()) - run["seconds"]) < 0.05
    rows = kvsim.sweep(load_npz(path), "h2o", 16, "recent_window", range(1, 16))
    assert run["best_recent_window"] == max(rows, key=lambda r: r["retained_mass"])["recent_window"]
    assert run["peak_rss_mb"] is None or 10 < run["peak_rss_mb"] < 4096
    with pytest.raises(RuntimeError, match="--recent-window 16 must be below --budget 16"):
        bench._cli_run({}, [*args[:-3], "--recent-window", "1:16", "--json"])
    assert bench._sample(list(range(1, 256)), 16)[::15] == [1, 255]


def test_without_numba_kvsim_and_the_cli_fall_back_to_the_reference(tmp_path):
    """numba missing must not break ``import kvsim`` or the CLI: the same figures, by the reference,
    and the benchmark (which times the engine) refuses in one line."""
    import json

    trace = random_trace(40, 3, shape="levels", levels=6, zero_share=0.1)
    path = tmp_path / "small.npz"
    save_npz(trace, path)
    block = "import sys, runpy; sys.modules['numba'] = None; sys.argv = ['kvsim', *sys.argv[1:]]; "
    run = "runpy.run_module('kvsim', run_name='__main__')"

    def cli(*args):
        return subprocess.run([sys.executable, "-c", block + run, *args], capture_output=True, text=True, timeout=120)

    done = cli("sweep", "--trace", str(path), "--policy", "h2o", "--budget", "8", "--recent-window", "0:7", "--json")
    assert done.returncode == 0, done.stderr
    got = [(r["recent_window"], r["retained_mass"], r["top_k_recall"]) for r in json.loads(done.stdout)]
    loaded = load_npz(path)
    want = [(w, r.retained_mass, r.top_k_recall) for w in range(8)
            for r in [reference(loaded, "h2o", 8, recent_window=w)]]
    assert got == want
    bench = cli("bench", "--json")
    assert bench.returncode != 0 and bench.stdout == ""
    assert bench.stderr.count("\n") == 1 and "numba is not installed" in bench.stderr and "Traceback" not in bench.stderr


@needs_engine
def test_topk_positions_are_kept_beside_the_cached_trace_and_survive_damage(cache_dir):
    trace = cache.canonical_trace(SMALL)
    fresh = derived._topk_positions(trace.derived.kernel_attention(), 32)
    assert np.array_equal(trace.derived.topk(32), fresh)
    path = cache.cache_path(SMALL).with_suffix("")
    path = path.with_name(path.name + "-topk32.npy")
    assert path.is_file() and np.array_equal(np.load(path), fresh)
    again = cache.canonical_trace(SMALL)  # a new process's view: read from disk, same positions
    assert np.array_equal(again.derived.topk(32), fresh)
    path.write_bytes(b"damaged")
    third = cache.canonical_trace(SMALL)
    assert np.array_equal(third.derived.topk(32), fresh) and np.array_equal(np.load(path), fresh)


@needs_engine
@pytest.mark.parametrize("levels", [2, 1000])
def test_snapkv_victims_found_through_running_sums_on_long_tied_traces(levels):
    """Unrecorded snapkv configurations pick each victim through a running sum of its window and
    sum exactly only the slots that could be smallest; over hundreds of steps of exact ties (and
    of near-ties) the series are still the reference's, bit for bit."""
    trace = random_trace(400, 7, shape="levels", levels=levels, zero_share=0.3)
    configs = [(64, 8, 5), (64, 0, 1), (130, 32, 40), (17, 3, 400)]  # budget, recent_window, observation_window
    built = [kvsim.make_policy("snapkv", budget=b, recent_window=r, observation_window=w) for b, r, w in configs]
    mass, recall, _ = engine.run(trace, built, 32)
    for i, (b, r, w) in enumerate(configs):
        ref = reference(trace, "snapkv", b, recent_window=r, observation_window=w)
        assert np.array_equal(mass[i], ref.retained_mass_series), configs[i]
        assert np.array_equal(recall[i], ref.top_k_recall_series), configs[i]


def test_a_shipped_trace_is_decoded_once_into_the_cache(cache_dir, tmp_path):
    """A trace file read through the cache is the file's trace (same bits, name, meta and
    fingerprint); a damaged entry is rewritten, and a changed file is read afresh."""
    src = tmp_path / "small.npz"
    save_npz(random_trace(30, 3, shape="levels", levels=5, zero_share=0.2), src)
    calls = []

    def load(path):
        calls.append(path)
        return load_npz(path)

    direct = load_npz(src)
    for _ in range(2):
        got = cache.file_trace(src, load)
        assert np.array_equal(got.attention, direct.attention) and got.attention.dtype == np.float32
        assert (got.name, got.meta, got.fingerprint) == (direct.name, direct.meta, direct.fingerprint)
    assert len(calls) == 1  # the second read came from the cache
    (entry,) = cache_dir.glob("file-small-*.npy")
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged: the CRC no longer holds
    entry.write_bytes(bytes(data))
    assert np.array_equal(cache.file_trace(src, load).attention, direct.attention) and len(calls) == 2
    save_npz(random_trace(30, 4, shape="levels", levels=5, zero_share=0.2), src)  # the file itself changed
    assert np.array_equal(cache.file_trace(src, load).attention, load_npz(src).attention) and len(calls) == 3


@needs_engine
def test_prepare_says_so_only_when_it_compiles(tmp_path):
    """``engine.prepare`` reports one note when numba compiles the policy's kernels (a fresh cache)
    and nothing when a later process loads them from disk; a policy the engine does not replay is
    a no-op."""
    root = Path(__file__).resolve().parent.parent
    script = ("import sys; from kvsim.sim import engine; seen = []; "
              "engine.prepare('tova', lambda f, note='': seen.append((f, note))); print(seen)")
    # and what it compiled is all a later replay or sweep of the policy calls
    after = ("import kvsim, numpy as np; from kvsim.sim import engine; from numba.core import event; "
             "engine.prepare('tova'); rec = event.RecordingListener(); "
             "trace = kvsim.from_array(np.tril(np.random.default_rng(0).random((50, 50)), -1)); "
             "ctx = event.install_listener('numba:compile', rec); ctx.__enter__(); "
             "kvsim.replay(trace, 'tova', budget=8, record_kept=True); kvsim.sweep(trace, 'tova', 4, 'budget', range(4, 40)); "
             "print(len(rec.buffer))")
    env = {**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}

    def run(code=script):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    first = run()
    assert first.startswith("[(None, 'compiling the tova engine (once per install") and first.count("None") == 1
    assert run() == "[]"
    assert run(after) == "0"
    seen = []
    engine.prepare("no_such_policy", lambda f, note="": seen.append(note))
    assert seen == []

"""The key-aware scorers (issue 34): knorm evicts the held key with the largest L2 norm, keydiff the held
key most similar (cosine) to the mean of the held unit keys. Each against a case worked out by hand from
its definition, the engine against the reference bit for bit, a trace without keys refused in one line
by the CLI, and a replay of a query/key trace file, which carries its keys."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import kvsim
from kvsim import cli
from kvsim.data import qk_files
from kvsim.data.trace import TraceError
from kvsim.policies.keydiff import compiled_unit_keys, unit_keys
from kvsim.policies.knorm import KNorm, compiled_key_norms, key_norms
from kvsim.sim import engine
from kvsim.sim.simulate import replay

NAMES = ("knorm", "keydiff")


def walk(name: str, keys, budget: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Step policy ``name`` by hand over positions 1 .. len(keys) - 1 the way the harness does (see the
    key, admit, evict): the victims of each step and the scores just before each eviction."""
    policy = kvsim.make_policy(name, budget=budget)
    policy.see(0, {"keys": np.asarray(keys[0])})
    victims, scores = [], []
    for t in range(1, len(keys)):
        policy.see(t, {"keys": np.asarray(keys[t])})
        policy.on_decode_step(t, None)
        scores.append(policy.scores)
        victims.append(policy.evict(budget))
    return victims, scores


def keyed_trace(keys, name="keyed") -> kvsim.Trace:
    """A trace whose every row spreads its weight evenly over the earlier positions, carrying ``keys``."""
    n = len(keys)
    a = np.tril(np.ones((n, n)), -1)
    a[1:] /= a[1:].sum(axis=1, keepdims=True)
    trace = kvsim.from_array(a, name=name)
    trace.keys = np.asarray(keys, dtype=np.float32)
    return trace


# --- knorm by hand ----------------------------------------------------------------------------------

#: norms 5, 1, 2, 10, 5, 5 (3-4-5 and 6-8-10 triangles: every norm exact)
KNORM_KEYS = [(3, 4), (1, 0), (0, 2), (6, 8), (0, 5), (4, 3)]


def test_knorm_evicts_the_largest_norm_the_newest_included_and_the_older_on_ties():
    # budget 3: steps 1 and 2 fill the cache (0, 1, 2);
    # step 3: norms 5, 1, 2, 10 -> the newcomer 3 (10) goes at once: it has a key, so it may go;
    # step 4: norms 5, 1, 2, 5 over 0, 1, 2, 4 -> 0 and 4 tie at 5: the older, 0, goes;
    # step 5: norms 1, 2, 5, 5 over 1, 2, 4, 5 -> 4 and 5 tie: 4 goes
    victims, scores = walk("knorm", KNORM_KEYS, budget=3)
    assert victims == [[], [], [3], [0], [4]]
    # the scores view's score is 1 / norm (the lowest goes): 1/1, 1/2, 1/5, 1/5 over 1, 2, 4, 5 at step 5
    assert scores[-1].tolist() == [1.0, 0.5, 0.2, 0.2]
    for reference in (False, True):
        result = replay(keyed_trace(KNORM_KEYS), "knorm", budget=3, record_victims=True, record_kept=True,
                        reference=reference)
        assert result.victims_history == victims
        assert result.kept_history[-1].tolist() == [1, 2, 5]


def test_knorm_evicting_several_at_once_takes_the_largest_norms_in_ascending_order():
    policy = kvsim.make_policy("knorm", budget=6)
    policy.see(0, {"keys": np.array([3.0, 4.0])})
    for t, key in enumerate([(1, 0), (0, 2), (6, 8), (0, 5)], start=1):
        policy.see(t, {"keys": np.array(key, dtype=float)})
        policy.on_decode_step(t, None)
    # norms 5, 1, 2, 10, 5 over 0..4; down to 2: 3 (10), then 0 and 4 (5 each, 0 first), ascending
    assert policy.evict(2) == [0, 3, 4]
    assert policy.kept.tolist() == [1, 2]


# --- keydiff by hand --------------------------------------------------------------------------------

#: unit keys (1, 0), (0, 1), (1, 0), (0, -1), (0.6, 0.8)
KEYDIFF_KEYS = [(1, 0), (0, 3), (2, 0), (0, -4), (3, 4)]


def test_keydiff_evicts_the_key_closest_to_the_mean_unit_key():
    # budget 2, the anchor s = the sum of the held unit keys (the mean's direction), newcomer included:
    # step 1: 0, 1 held, nothing to evict;
    # step 2: units (1,0), (0,1), (1,0): s = (2,1), |s| = sqrt 5; cosines 2/sqrt5, 1/sqrt5, 2/sqrt5:
    #         0 and 2 tie at the largest: the older, 0, goes;
    # step 3: units (0,1), (1,0), (0,-1) over 1, 2, 3: s = (1,0); cosines 0, 1, 0: 2 goes;
    # step 4: units (0,1), (0,-1), (0.6,0.8) over 1, 3, 4: s = (0.6,0.8), |s| = 1; cosines 0.8, -0.8, 1:
    #         the newcomer 4 goes
    victims, scores = walk("keydiff", KEYDIFF_KEYS, budget=2)
    assert victims == [[], [0], [2], [4]]
    # the view's score is 1 - cos: at step 3 exactly 1, 0, 1 (every sum and product above is exact)
    assert scores[2].tolist() == [1.0, 0.0, 1.0]
    r5 = 1 / math.sqrt(5)
    # at step 2, within a few roundings of 1 - 2/sqrt5, 1 - 1/sqrt5 (one sqrt, one division, one subtraction)
    np.testing.assert_allclose(scores[1], [1 - 2 * r5, 1 - r5, 1 - 2 * r5], rtol=0, atol=4 * np.finfo(float).eps)
    for reference in (False, True):
        result = replay(keyed_trace(KEYDIFF_KEYS), "keydiff", budget=2, record_victims=True, reference=reference)
        assert result.victims_history == victims


def test_keydiff_anchors_on_the_unit_keys_not_the_raw_ones():
    """kvpress's anchor: the mean of the normalised keys. Keys (10, 0), (0, 1), (0, 1): the unit keys' sum
    (1, 2) is closest to 1 and 2 (cos 2/sqrt5 each, against 1/sqrt5 for 0), so 1 goes; the raw keys' mean
    (10, 2)/3 would be closest to 0 (cos 10/sqrt104, about 0.98) and evict it instead."""
    victims, _ = walk("keydiff", [(10, 0), (0, 1), (0, 1)], budget=2)
    assert victims == [[], [1]]
    raw = np.array([(10, 0), (0, 1), (0, 1)], dtype=float)
    mean = raw.mean(axis=0)
    assert int(np.argmax(raw @ mean / np.linalg.norm(raw, axis=1))) == 0  # the other reading's victim


def test_keydiff_zero_keys_have_cosine_zero_and_a_zero_anchor_evicts_the_oldest():
    # a zero key stays zero when normalised (as F.normalize leaves it); with every held key zero the
    # anchor is zero and every cosine 0: all tie, the oldest goes
    victims, scores = walk("keydiff", [(0, 0), (0, 0), (0, 0)], budget=2)
    assert victims == [[], [0]] and scores[1].tolist() == [1.0, 1.0, 1.0]


# --- what they read ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_admitting_a_position_whose_key_was_not_seen_is_refused(name):
    policy = kvsim.make_policy(name, budget=4)
    with pytest.raises(ValueError, match=f"^{name}: position 0's key was never seen"):
        policy.on_decode_step(1, None)
    policy = kvsim.make_policy(name, budget=4)
    policy.see(0, {"keys": np.ones(3)})
    with pytest.raises(ValueError, match=f"^{name}: position 1 admitted before its key was seen"):
        policy.on_decode_step(1, None)
    with pytest.raises(ValueError, match=rf"^{name}: the key of position 2 has shape \(2, 3\)"):
        policy.see(2, {"keys": np.ones((2, 3))})


@pytest.mark.parametrize("name", NAMES)
def test_a_trace_without_keys_is_refused_in_one_line(name, capsys):
    assert cli.main(["replay", "--policy", name, "--trace", "canonical"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "reads keys" in err and "--store qk" in err, err
    bare = kvsim.from_array(np.tril(np.ones((5, 5)), -1), name="bare")
    with pytest.raises(TraceError, match=f"^bare: policy {name} reads keys"):
        replay(bare, name, budget=2)


# --- the engine against the reference -----------------------------------------------------------------


#: four keys, two of one norm: every position taking one of them, norms and cosines tie exactly
FOUR_KEYS = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [2, 0, 0, 0], [0.5, 0.5, 0, 0]], dtype=np.float32)


def random_keys(n: int, seed: int, ties: bool) -> np.ndarray:
    """``n`` float32 keys: normal, of norms spread over 0.5 .. 2; with ``ties``, each one of ``FOUR_KEYS``."""
    rng = np.random.default_rng(seed)
    if ties:
        return FOUR_KEYS[rng.integers(0, 4, size=n)]
    return (rng.standard_normal((n, 8)) * rng.uniform(0.5, 2.0, size=(n, 1))).astype(np.float32)


def _same(a, b) -> bool:
    return (np.array_equal(a.retained_mass_series, b.retained_mass_series)
            and np.array_equal(a.top_k_recall_series, b.top_k_recall_series)
            and np.array_equal(a.kept_history, b.kept_history)
            and np.array_equal(a.score_history, b.score_history, equal_nan=True)
            and np.array_equal(a.score_positions, b.score_positions)
            and a.victims_history == b.victims_history)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ties", [False, True])
def test_the_engine_equals_the_reference_bit_for_bit(name, ties, make_trace):
    trace = make_trace(150, seed=21, ties=ties)
    trace.keys = random_keys(trace.steps + 1, 21, ties)
    assert engine.covers(trace, name)
    for budget in (1, 2, 9, 64, 200):
        kw = dict(budget=budget, record_kept=True, record_scores=True, record_victims=True)
        fast, ref = replay(trace, name, **kw), replay(trace, name, reference=True, **kw)
        assert _same(fast, ref), (name, budget)
    # keys as float16 and float64: the engine reads them as the reference does, through float64
    for dtype in (np.float16, np.float64):
        trace.keys = trace.keys.astype(dtype)
        kw = dict(budget=9, record_kept=True, record_scores=True, record_victims=True)
        assert _same(replay(trace, name, **kw), replay(trace, name, reference=True, **kw)), dtype


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_kernels_norms_and_unit_keys_are_the_references_row_by_row(dtype):
    keys = np.random.default_rng(3).normal(size=(40, 24)).astype(dtype)
    keys[7] = 0.0  # a zero key: norm 0, unit key 0
    norms, units = key_norms(keys), unit_keys(keys)
    for p in range(40):  # what ``see`` computes from one row, bit for bit the whole array's row
        assert key_norms(keys[p]) == norms[p] and np.array_equal(unit_keys(keys[p]), units[p])
    # and what the engine computes from the keys ``engine_inputs`` hands it
    handed = KNorm.engine_inputs([], 39, {"keys": keys})["keys"]
    assert handed.dtype == np.float64 and np.array_equal(handed, keys)
    assert np.array_equal(compiled_key_norms(handed), norms)
    assert np.array_equal(compiled_unit_keys(handed), units) and not units[7].any()


@pytest.mark.parametrize("name", NAMES)
def test_prepare_compiles_on_a_trace_of_its_own_members(name):
    engine.prepare(name)  # its tiny trace carries keys: preparing a key-reading policy does not fail
    assert engine.ready(kvsim.from_array(np.tril(np.ones((3, 3)), -1)), name)


# --- a query/key trace carries its keys ----------------------------------------------------------------


def test_replay_reads_the_keys_of_a_query_key_trace_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(8)
    G, N, D = 2, 120, 16
    q = rng.normal(size=(G, N, D)).astype(np.float16)
    k = (rng.normal(size=(N, D)) * rng.uniform(0.5, 2.0, size=(N, 1))).astype(np.float16)
    v = rng.normal(size=(N, D)).astype(np.float16)
    path = tmp_path / "toy-L00.qk.npz"
    qk_files.save_qk(path, q, k, v, {"layer": 0, "head": 0, "query_heads": [0, 1], "scale": D ** -0.5, "softcap": None,
                               "sliding_window": None, "gqa": "mean", "model": "random", "text": {"source": "none"}})
    trace = qk_files.load_qk(path)
    norms = key_norms(k)
    for name in NAMES:
        kw = dict(budget=16, record_kept=True, record_scores=True, record_victims=True)
        fast, ref = replay(trace, name, **kw), replay(trace, name, reference=True, **kw)
        assert _same(fast, ref), name
        assert cli.main(["replay", "--policy", name, "--trace", str(path), "--budget", "16", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["policy"] == name and doc["retained_mass"] == fast.retained_mass
    # knorm's every victim was the largest norm held at its step (the older on ties)
    result = replay(trace, "knorm", budget=16, record_kept=True, record_victims=True)
    for t in range(16, N):
        held = [*result.kept_history[t - 2].tolist(), t]
        largest = max(held, key=lambda p: (norms[p], -p))
        assert result.victims_history[t - 1] == [largest], t


# --- where every policy is listed -------------------------------------------------------------------------


def test_a_table_allocated_over_a_bundle_without_keys_refuses_them_in_its_rows(tmp_path, capsys):
    from kvsim.data.bundle import write_manifest
    from kvsim.data.trace import save_npz

    folder = tmp_path / "bare2"
    folder.mkdir()
    entries = []
    for layer in range(2):
        name = f"bare-L{layer:02d}.npz"
        a = np.tril(np.random.default_rng(layer).random((41, 41)), -1)
        save_npz(kvsim.from_array(a, name=name), folder / name)  # attention only
        entries.append({"file": name, "layer": layer, "head": 0, "query_heads": [0]})
    write_manifest(folder, {"name": "bare2", "model": "random", "text": {"source": "random", "licence": "none"},
                            "steps": 40, "traces": entries})
    assert cli.main(["table", "--trace", str(folder), "--budget", "8", "--allocate", "uniform", "--json"]) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for name in NAMES:
        assert rows[name]["retained_mass"] is None and rows[name]["refused"] == f"{name} reads keys, which bare2's traces do not hold"
    assert rows["tova"]["retained_mass"] is not None


def test_the_apps_settings_leave_out_what_the_trace_cannot_feed(monkeypatch):
    """The app's sidebar choice on a trace without keys: knorm and keydiff are left out, each saying what it
    reads, and the rest run (``controls.Settings.read`` with a session of our own)."""
    import types

    from kvsim.app import controls, state

    session = {**state.defaults(), "budget": 64, "step": 10, "policies": ["h2o", "knorm", "keydiff"]}
    monkeypatch.setattr(controls, "st", types.SimpleNamespace(session_state=session))
    settings = controls.Settings.read(kvsim.canonical_trace())
    assert {"knorm", "keydiff"} <= set(settings.left_out) and [s.name for s in settings.runs] == ["h2o"]
    assert [p.split(" of ")[0] for p in settings.problems] == [f"{n} reads the keys" for n in NAMES]

"""Query/key traces (kvsim.data.qk): rows computed from queries and keys equal the one NumPy statement of
the definition (``qk_rows.reference_rows``), every registered policy replays a query/key trace exactly as
it replays the dense matrix of the same weights (engine and reference harness alike), the file loads
where a trace loads (a path, a bundle's ``DIR:L01``, tune, export) and bad files are refused in one line
with nothing half-written. Small random queries and keys with known constants: no model needed."""

from __future__ import annotations

import importlib
import pickle

import numpy as np
import pytest
from tolerance import attention_rows, logit_magnitude, rounding

from kvsim import cli
from kvsim.analysis.tune import tune
from kvsim.data import qk, qk_files, qk_rows
from kvsim.data.bundle import load_bundle, write_manifest
from kvsim.data.catalog import resolve_trace
from kvsim.data.trace import Trace, TraceError, load_npz
from kvsim.policykit.registry import POLICIES
from kvsim.policykit.upper_bound import upper_bound_series
from kvsim.sim.simulate import replay, sweep

G, N, D = 2, 200, 12
#: (softcap, sliding_window, gqa): plain, Gemma-like soft-capping with a window, the max rule
CONSTANTS = [(None, None, "mean"), (3.0, 40, "mean"), (None, None, "max")]


def _arrays(seed=0, n=N):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(G, n, D)).astype(np.float16)
    k = rng.normal(size=(n, D)).astype(np.float16)
    v = rng.normal(size=(n, D + 4)).astype(np.float16)
    return q, k, v


def _meta(layer=1, window=None, **extra):
    return {"layer": layer, "head": 0, "query_heads": [2, 3], "scale": D ** -0.5, "softcap": None,
            "sliding_window": window, "gqa": "mean", "model": "random", "text": {"source": "none"}, **extra}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("softcap,window,gqa", CONSTANTS)
def test_rows_equal_the_numpy_definition_and_are_softmaxes(softcap, window, gqa):
    q, k, v = _arrays()
    trace = qk.from_qk(q, k, v, scale=0.6, softcap=softcap, sliding_window=window, gqa=gqa)
    expected = qk_rows.reference_rows(q, k, 0.6, softcap, window, gqa)
    # float32 rows against float64 ones from the same queries and keys: each weight within float32 rounding
    np.testing.assert_allclose(trace.attention, expected, rtol=attention_rows(D, logit_magnitude(q, k, 0.6), N, G), atol=0)
    # a row divided by its float32 sum of at most N weights, one rounding each: it sums to 1 within that
    np.testing.assert_allclose(trace.attention[1:].sum(axis=1, dtype=np.float64), 1.0, rtol=0, atol=rounding(N + 1))
    assert trace.steps == N - 1 and trace.values is v
    if window:  # nothing outside the window, the window itself all there
        assert not trace.attention[100, : 100 - window + 1].any() and trace.attention[100, 100 - window + 1 : 100].all()


@pytest.mark.parametrize("softcap,window,gqa", CONSTANTS)
def test_every_policy_replays_the_same_from_queries_and_keys_as_from_the_matrix(softcap, window, gqa, fit_args):
    q, k, v = _arrays(1)
    rope = {"rope_inv_freq": (1e4 ** (-np.arange(0, D, 2) / D)).tolist(), "rope_layout": "rotate_half",
            "rope_theta": 1e4}  # for expected_attention
    norms = (np.random.default_rng(1).random((q.shape[1], q.shape[0])) + 0.05).astype(np.float32)  # for critical
    trace = qk.from_qk(q, k, v, scale=0.6, softcap=softcap, sliding_window=window, gqa=gqa, meta=rope, out_norms=norms)
    # the very same float32 weights, as a matrix, with the members and RoPE the scorers beyond attention read
    dense = Trace(np.array(trace.attention), meta=rope, values=np.array(trace.values), keys=trace.keys,
                  queries=trace.queries, out_norms=norms)
    for name in POLICIES:
        kw = dict(budget=24, record_kept=True, **fit_args(name, 24, dense))
        runs = [replay(trace, name, **kw), replay(trace, name, reference=True, **kw), replay(dense, name, **kw)]
        for other in runs[1:]:
            assert np.array_equal(runs[0].retained_mass_series, other.retained_mass_series), name
            assert np.array_equal(runs[0].top_k_recall_series, other.top_k_recall_series), name
            assert np.array_equal(runs[0].kept_history, other.kept_history), name
    assert sweep(trace, "h2o", 24, "recent_window", range(1, 24)) == sweep(dense, "h2o", 24, "recent_window", range(1, 24))
    assert np.array_equal(upper_bound_series(trace, 24), upper_bound_series(dense, 24))  # its rows a block at a time


def test_a_file_round_trips_and_its_normalisers_are_read_back_not_recomputed(tmp_path, monkeypatch):
    q, k, v = _arrays(2)
    path = tmp_path / "toy-L01.qk.npz"
    qk_files.save_qk(path, q, k, v, _meta(softcap=2.5, window=30))
    first = resolve_trace(str(path))
    assert isinstance(first, qk.QKTrace) and first.name == "toy-L01" and first.meta["steps"] == N - 1
    mass = replay(first, "h2o", budget=40).retained_mass
    expected = qk_rows.reference_rows(q, k, D ** -0.5, 2.5, 30, "mean")
    # float32 rows against float64 ones from the same queries and keys: each weight within float32 rounding
    np.testing.assert_allclose(first.attention, expected, rtol=attention_rows(D, logit_magnitude(q, k, D ** -0.5), N, G), atol=0)

    def no_pass(*a):
        raise AssertionError("the normalisers were computed again")

    monkeypatch.setattr(qk_rows, "row_pass", no_pass)
    again = qk_files.load_qk(path)
    assert replay(again, "h2o", budget=40).retained_mass == mass and again.fingerprint == first.fingerprint
    copy = pickle.loads(pickle.dumps(again))  # what a Dask worker gets
    assert replay(copy, "h2o", budget=40).retained_mass == mass


def _write_bundle(folder, n_layers=2, store="qk"):
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for layer in range(n_layers):
        q, k, v = _arrays(10 + layer)
        window = 50 if layer == 0 else None
        name = f"toy-L{layer:02d}.qk.npz"
        qk_files.save_qk(folder / name, q, k, v, _meta(layer=layer, window=window))
        entries.append({"file": name, "layer": layer, "head": 0, "query_heads": [2, 3],
                        "attention": "sliding" if window else "global", "sliding_window": window})
    write_manifest(folder, {"name": "toyqk", "model": "random", "text": {"source": "none"}, "steps": N - 1,
                            "store": store, "traces": entries})
    return folder


def test_a_bundle_of_query_key_traces_serves_selectors_tune_and_export(tmp_path, capsys):
    folder = _write_bundle(tmp_path / "toyqk")
    trace = resolve_trace(f"{folder}:L01")
    assert isinstance(trace, qk.QKTrace) and trace.meta["layer"] == 1
    result = tune(load_bundle(folder), "h2o", budget=40)
    assert [t.name for t in result.traces] == ["toy-L00", "toy-L01"]
    assert cli.main(["export", "--trace", f"{folder}:L00", "--out", str(tmp_path / "d.npz")]) == 0
    exported = load_npz(tmp_path / "d.npz")
    # the same float32 weights, each row renormalised in float64 by the loader: moved by its sum's rounding at most
    np.testing.assert_allclose(exported.attention, resolve_trace(f"{folder}:L00").attention, rtol=rounding(N + 1), atol=0)
    capsys.readouterr()


def test_export_refuses_a_query_key_trace_longer_than_the_dense_limit_in_one_line(tmp_path, capsys, monkeypatch):
    folder = _write_bundle(tmp_path / "toyqk", n_layers=1)
    monkeypatch.setattr(qk, "DENSE_LIMIT", 100)
    monkeypatch.setattr(importlib.import_module("kvsim.cli.commands"), "DENSE_LIMIT", 100)  # export's, imported lazily
    assert cli.main(["export", "--trace", f"{folder}:L00", "--out", str(tmp_path / "d.npz")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "199 steps" in err and "100 steps" in err
    assert not (tmp_path / "d.npz").exists()
    with pytest.raises(TraceError, match="no dense matrix"):
        _ = resolve_trace(f"{folder}:L00").attention
    assert replay(resolve_trace(f"{folder}:L00"), "h2o", budget=40).steps == N - 1  # the rows on demand still serve


def _saved(tmp_path):
    q, k, v = _arrays(3)
    path = tmp_path / "bad.qk.npz"
    arrays = {"q": q, "k": k, "v": v}
    meta = {"format": qk_files.FORMAT, "version": qk_files.VERSION, "steps": N - 1, **_meta()}
    qk_files.save_qk(path, q, k, v, meta)
    return path, arrays, meta


def _rewrite(path, arrays, meta):
    import json

    raw = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays, meta=raw)


@pytest.mark.parametrize("change,message", [
    (lambda a, m: a.update(k=a["k"][:-1]), "'k' has shape"),
    (lambda a, m: m.update(steps=10), "meta 'steps' is 10 but the arrays hold 200 positions"),
    (lambda a, m: m.update(query_heads=[0, 1, 2]), "names 3 query heads but 'q' holds 2"),
    (lambda a, m: m.update(format="other"), "meta 'format' must be 'kvsim-qk'"),
    (lambda a, m: m.update(gqa="sum"), "meta 'gqa' must be one of mean, max"),
    (lambda a, m: m.update(scale=-1.0), "meta 'scale' must be a positive number"),
    (lambda a, m: m.pop("scale"), "meta is missing 'scale'"),
    (lambda a, m: a.update(q=np.where(np.arange(N)[None, :, None] == 7, np.float16(np.nan), a["q"])), "'q' has NaN"),
    (lambda a, m: a.pop("v"), "missing key 'v'"),
    (lambda a, m: a.update(q=a["q"].astype(np.int32)), "'q' dtype int32 is not float16 or float32"),
])
def test_an_inconsistent_file_is_refused_in_one_line_naming_it(tmp_path, change, message):
    path, arrays, meta = _saved(tmp_path)
    change(arrays, meta)
    _rewrite(path, arrays, meta)
    with pytest.raises(TraceError) as e:
        qk_files.load_qk(path)
    assert str(e.value).startswith(str(path)) and message in str(e.value) and "\n" not in str(e.value)


def test_a_truncated_file_is_refused_in_one_line(tmp_path):
    path, _, _ = _saved(tmp_path)
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 30):
        path.write_bytes(data[:cut])
        with pytest.raises(TraceError, match="truncated") as e:
            qk_files.load_qk(path)
        assert "\n" not in str(e.value)


def test_save_refuses_inconsistent_arrays_and_writes_nothing(tmp_path):
    q, k, v = _arrays(4)
    path = tmp_path / "x.qk.npz"
    with pytest.raises(TraceError, match="names 3 query heads"):
        qk_files.save_qk(path, q, k, v, _meta(query_heads=[0, 1, 2]))
    with pytest.raises(TraceError, match="'v' has shape"):
        qk_files.save_qk(path, q, k, v[:-1], _meta())
    assert list(tmp_path.iterdir()) == []


def test_a_bundle_whose_entry_disagrees_with_its_file_is_refused_in_one_line(tmp_path):
    import json

    folder = _write_bundle(tmp_path / "toyqk")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["traces"][1]["query_heads"] = [0, 1]  # the file says [2, 3]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="meta 'query_heads' is \\[2, 3\\] but the bundle's manifest says \\[0, 1\\]"):
        resolve_trace(f"{folder}:L01")
    manifest["store"] = "dense"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="'store' is 'dense', so 'toy-L00.qk.npz' must be a dense trace file"):
        load_bundle(folder)


def test_a_step_beyond_the_recording_is_refused():
    q, k, v = _arrays(5)
    trace = qk.from_qk(q, k, v, scale=0.5, name="toy")
    with pytest.raises(TraceError, match="toy: step 200 is beyond the recording \\(199 steps\\)"):
        trace.derived.row(200, np.array([0, 1]))


def test_tune_past_the_dense_limit_falls_back_to_mass_and_refuses_the_truth_in_one_line(tmp_path, capsys, monkeypatch):
    """A query/key bundle longer than the dense rows: the value proxies (they read whole rows) give way
    to retained mass, labelled, and the truth (a session holds every layer's rows, dense) is refused in
    one line instead of being tried."""
    from kvsim.analysis import tune as tune_mod

    folder = _write_bundle(tmp_path / "toyqk")
    monkeypatch.setattr(qk, "DENSE_LIMIT", 100)
    monkeypatch.setattr(importlib.import_module("kvsim.cli.tune_command"), "DENSE_LIMIT", 100)  # imported lazily by cli.main
    doc = tune(load_bundle(folder), "h2o", budget=40, by=tune_mod.BEST_PROXY).to_dict()
    assert doc["by_detail"]["fell_back_to"] == "retained_mass" and "no dense matrix" in doc["by_detail"]["note"]
    assert doc["model_window"] == doc["model"]["one_window"]["recommended_window"]
    assert cli.main(["tune", "--trace", str(folder), "--budget", "40", "--serial", "--quiet", "--by", "kl",
                     "--model", "gemma3-270m", "--text", str(tmp_path / "t.txt")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the truth of 199 steps is out of reach here" in err and "at most 100 steps" in err

"""A query/key trace too long for its dense matrix is analysed from one pass over its rows
(``kvsim.data.row_stats``): its features, ``describe`` and the trace view's image must be what the
dense matrix gives, and the pass must run once per trace and machine. Here the dense limit is
lowered so a small trace takes the long path, and the same trace with the limit in place is the
reference."""

from __future__ import annotations

import numpy as np
import pytest
from tolerance import rounding

from kvsim.analysis import features, metrics
from kvsim.data import qk, qk_files, row_stats
from kvsim.views.figures import trace as trace_figure

G, D = 2, 16


def _arrays(n=1400, seed=0):
    """Queries and keys with a sink at 0 and two heavy hitters (n / 7, n / 2) that every query finds."""
    rng = np.random.default_rng(seed)
    q = (rng.normal(size=(G, n, D)) + 0.5).astype(np.float16)
    k = rng.normal(size=(n, D)).astype(np.float16)
    k[0], k[n // 7], k[n // 2] = 1.5, 1.2, 1.1
    return q, k, rng.normal(size=(n, D)).astype(np.float16)


def _trace(n=1400, window=None) -> qk.QKTrace:
    return qk.from_qk(*_arrays(n), scale=D ** -0.5, softcap=None, sliding_window=window, gqa="mean")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("window", [None, 300])
def test_the_long_path_gives_the_dense_features_statistics_and_image(window, monkeypatch):
    dense = _trace(window=window)
    want_features = features.trace_features(dense)
    want_describe = [metrics.describe(dense, band=b, sinks=s) for b, s in ((64, 1), (want_features.band, 3))]
    want_image = trace_figure.trace_image(dense)
    monkeypatch.setattr(qk, "DENSE_LIMIT", 100)
    long = _trace(window=window)
    assert long.derived.no_matrix() is not None
    got = features.trace_features(long)
    assert got == want_features
    if window is None:  # a sink and both heavy hitters found (a window of 300 hides them from late rows)
        assert got.sinks >= 1 and {p for p, _, _ in got.heavy} >= {200, 700}
    for want, (b, s) in zip(want_describe, ((64, 1), (want_features.band, 3)), strict=True):
        have = metrics.describe(long, band=b, sinks=s)
        assert have.keys() == want.keys()
        for key, value in want.items():
            # the same float32 rows, summed in float64 in other blocks: means over 1400 rows of sums of at most
            # 1401 terms, effective_positions an exp of an entropy of at most log 1401
            same = 2 * rounding(1400 + 1401, np.log(1401), np.float64)
            assert have[key] == pytest.approx(value, rel=same, abs=same), key
    rgb, block, span = trace_figure.trace_image(long)
    assert block == want_image[1] and np.array_equal(rgb, want_image[0])
    assert span == pytest.approx(want_image[2], rel=2 * rounding(1400 + 1401, 1.0, np.float64))  # block means of the same rows
    with pytest.raises(qk.TraceError):  # and the dense matrix itself is still refused
        _ = long.attention


def test_the_pass_runs_once_and_is_read_back_from_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(qk, "DENSE_LIMIT", 100)
    path = tmp_path / "t.qk.npz"
    qk_files.save_qk(path, *_arrays(400), {"layer": 0, "head": 0, "query_heads": [0, 1], "scale": D ** -0.5, "softcap": None,
               "sliding_window": None, "gqa": "mean", "model": "random", "text": {"source": "none"}})
    first = qk_files.load_qk(path)
    calls = []
    stats = first.derived.row_stats(lambda f, note="": calls.append(f))
    assert calls and calls[-1] == 1.0
    stored = row_stats.path_for(first.derived.disk_stem)
    assert stored.is_file()
    again = qk_files.load_qk(path)
    monkeypatch.setattr(row_stats, "compute", lambda *a, **k: pytest.fail("the pass ran again"))
    back = again.derived.row_stats()
    assert np.array_equal(back.column, stats.column) and np.array_equal(back.top, stats.top)
    stored.write_bytes(stored.read_bytes()[:100])  # a damaged file is computed again, not trusted
    monkeypatch.undo()
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(qk, "DENSE_LIMIT", 100)
    third = qk_files.load_qk(path)
    assert np.array_equal(third.derived.row_stats().column, stats.column)


def test_what_the_pass_does_not_keep_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(qk, "DENSE_LIMIT", 100)
    long = _trace(n=400)
    with pytest.raises(ValueError, match=r"^band 600 is more than .* \(at most 544\)$"):
        metrics.describe(long, band=600, sinks=1)
    with pytest.raises(ValueError, match=r"^top_k 65 is more than"):
        metrics.describe(long, top_k=65, sinks=1)


@pytest.mark.parametrize("window", [None, 300])
def test_greedy_future_reads_rows_a_block_at_a_time_at_any_length(window, monkeypatch):
    """The offline reference that looks ahead needs only block suffix sums of whole rows and the held
    weights of the rows to come: past the dense limit it replays exactly as the dense matrix does,
    on the engine and on the reference harness."""
    from kvsim.sim.simulate import replay

    dense = _trace(n=400, window=window)
    want = replay(dense, "greedy_future", budget=48, record_kept=True)
    monkeypatch.setattr(qk, "DENSE_LIMIT", 100)
    long = _trace(n=400, window=window)
    got = replay(long, "greedy_future", budget=48, record_kept=True)
    assert got.retained_mass == want.retained_mass and np.array_equal(got.kept_history, want.kept_history)
    ref = replay(long, "greedy_future", budget=48, reference=True, record_kept=True)
    assert ref.retained_mass == want.retained_mass and np.array_equal(ref.kept_history, want.kept_history)


def test_a_stored_pass_of_another_shape_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(qk, "DENSE_LIMIT", 100)
    stats = row_stats.compute(_trace(n=300).derived)
    path = tmp_path / "s.npz"
    row_stats.write(path, stats)
    assert row_stats.read(path, 299) is not None and row_stats.read(path, 298) is None
    arrays = {f: getattr(stats, f) for f in row_stats.RowStats.__dataclass_fields__}
    np.savez(path, **{**arrays, "late": arrays["late"][:-1]})  # a sum of the wrong length
    assert row_stats.read(path, 299) is None


def test_describe_on_the_command_line_takes_a_long_trace_and_refuses_what_it_cannot_in_one_line(tmp_path, monkeypatch,
                                                                                                capsys):
    import json

    from kvsim import cli

    path = tmp_path / "t.qk.npz"
    qk_files.save_qk(path, *_arrays(400), {"layer": 0, "head": 0, "query_heads": [0, 1], "scale": D ** -0.5, "softcap": None,
                                      "sliding_window": None, "gqa": "mean", "model": "random", "text": {"source": "none"}})
    want = metrics.describe(qk_files.load_qk(path), band=64)
    monkeypatch.setattr(qk, "DENSE_LIMIT", 100)
    assert cli.main(["describe", "--trace", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    # the same rows, summed in other blocks: a float64 mean over 399 rows of at most 400 terms
    assert got["steps"] == 399 and got["sink_share"] == pytest.approx(want["sink_share"], rel=2 * rounding(399 + 400, 1.0, np.float64))
    assert cli.main(["describe", "--trace", str(path), "--band", "600"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvsim: error: --band 600 is more than a trace past its dense length is described at (at most 544)"]


def test_the_long_benchmark_times_the_row_pass(tmp_path):
    from test_qk_trace import _write_bundle

    from kvsim.bench import long

    doc = long.run(str(_write_bundle(tmp_path / "toyqk")), with_tune=False)
    assert doc["row_pass_seconds"] > 0 and "row pass of toy-L01 (features, describe, the trace view)" in long.render(doc)

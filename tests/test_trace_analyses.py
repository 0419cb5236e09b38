"""A trace's features and ``describe`` kept on disk beside its cache entry (``cache.derived``): read
back by a fresh process, equal to the direct computation, recomputed when damaged or when the
analysis code changed, never stored for a trace without an entry, harmless when unwritable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from random_traces import random_trace

from kvsim.analysis import features, metrics
from kvsim.data import canonical
from kvsim.data import store as cache
from kvsim.data.trace import from_array, load_npz, save_npz

SMALL = canonical.CanonicalConfig(steps=96)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def counted(monkeypatch):
    """How many times each analysis was computed: ``counted["features"]``, ``counted["describe"]``."""
    calls = {"features": 0, "describe": 0}
    trace_features, describe = features.trace_features, metrics.describe

    def count_features(trace, **kw):
        calls["features"] += 1
        return trace_features(trace, **kw)

    def count_describe(trace, **kw):
        calls["describe"] += 1
        return describe(trace, **kw)

    monkeypatch.setattr(features, "trace_features", count_features)
    monkeypatch.setattr(metrics, "describe", count_describe)
    return calls


def file_trace(tmp_path, steps: int = 400):
    """A small shipped-style trace: an ``.npz`` read through the cache, its features all measured
    (a canonical trace's attention without its metadata: sinks, a band and heavy hitters to find)."""
    src = tmp_path / f"small{steps}.npz"
    if not src.exists():
        save_npz(from_array(canonical.generate(canonical.CanonicalConfig(steps=steps)).attention), src)
    return cache.file_trace(src, load_npz)


def opened(kind: str, tmp_path):
    """A fresh in-memory trace object read from the cache, as a new process gets it."""
    return cache.canonical_trace(SMALL) if kind == "canonical" else file_trace(tmp_path)


def analyses(trace) -> tuple:
    f = features.trace_features_cached(trace)
    return f, metrics.describe_cached(trace, band=f.band, top_k=32, sinks=max(1, f.sinks))


def direct(trace) -> tuple:
    f = features.trace_features(trace)
    return f, metrics.describe(trace, band=f.band, top_k=32, sinks=max(1, f.sinks))


def stored(cache_dir, name: str) -> list:
    return sorted(cache_dir.glob(f"*-{name}-*.json"))


@pytest.mark.parametrize("kind", ["canonical", "file"])
def test_a_second_process_reads_the_analyses_from_disk_and_they_equal_the_direct_ones(cache_dir, tmp_path,
                                                                                     monkeypatch, kind):
    trace = opened(kind, tmp_path)
    want = direct(trace)
    got = analyses(trace)
    assert got == want and type(got[0].heavy) is tuple and all(type(h) is tuple for h in got[0].heavy)
    assert len(stored(cache_dir, "features")) == 1 and len(stored(cache_dir, "describe")) == 1
    assert not list(cache_dir.glob("*.part"))

    def refuse(*args, **kw):
        raise AssertionError("computed again instead of read from disk")

    monkeypatch.setattr(features, "trace_features", refuse)
    monkeypatch.setattr(metrics, "describe", refuse)
    again = opened(kind, tmp_path)
    assert again is not trace and again.derived.disk_stem is not None
    assert analyses(again) == want
    f = features.trace_features_cached(again)
    assert type(f.heavy) is tuple and all(type(h) is tuple and len(h) == 3 for h in f.heavy)
    assert f.heavy == want[0].heavy and f.heavy and f.sinks and f.band_known
    if kind == "file":  # every feature measured on the attention, none read from metadata
        assert all(s.startswith("measured") for s in (f.sink_source, f.band_source, f.heavy_source))
    with pytest.raises(AssertionError, match="computed again"):  # other arguments: not on disk yet
        metrics.describe_cached(again, band=want[0].band + 1, top_k=32, sinks=1)


def test_shares_that_are_none_round_trip(cache_dir, tmp_path, counted):
    trace = file_trace(tmp_path, steps=20)
    want = metrics.describe(trace, band=64, top_k=32, sinks=4)
    assert want["recent_share"] is None and want["top_k_share"] is None
    counted["describe"] = 0
    assert metrics.describe_cached(trace, band=64, top_k=32, sinks=4) == want
    assert metrics.describe_cached(file_trace(tmp_path, steps=20), band=64, top_k=32, sinks=4) == want
    assert counted["describe"] == 1


FEATURE_DAMAGE = {
    "truncated": lambda text: text[: len(text) // 2],
    "empty": lambda text: "",
    "not utf-8": lambda text: "\udcff",
    "a list": lambda text: "[1, 2, 3]",
    "no record": lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "record"}),
    "other version": lambda text: json.dumps({**json.loads(text), "version": "0"}),
    "steps a bool": lambda text: _edit(text, steps=True),
    "steps a float": lambda text: _edit(text, steps=96.0),
    "sinks a string": lambda text: _edit(text, sinks="4"),
    "heavy not a list": lambda text: _edit(text, heavy="[]"),
    "heavy of pairs": lambda text: _edit(text, heavy=[[1, 2]]),
    "heavy of floats": lambda text: _edit(text, heavy=[[1.0, 2, 3]]),
    "live_known an int": lambda text: _edit(text, live_known=1),
    "a field missing": lambda text: _edit(text, band_source=None, drop="band_source"),
    "a field more": lambda text: _edit(text, colour="red"),
}


def _edit(text: str, drop: str | None = None, **fields) -> str:
    entry = json.loads(text)
    entry["record"].update(fields)
    if drop:
        del entry["record"][drop]
    return json.dumps(entry)


@pytest.mark.parametrize("damage", sorted(FEATURE_DAMAGE))
def test_damaged_features_are_computed_again_and_rewritten(cache_dir, tmp_path, counted, damage):
    trace = file_trace(tmp_path)
    want = features.trace_features_cached(trace)
    (path,) = stored(cache_dir, "features")
    text = FEATURE_DAMAGE[damage](path.read_text())
    if damage == "not utf-8":
        path.write_bytes(b"\xff\xfe{")
    else:
        path.write_text(text)
    counted["features"] = 0
    assert features.trace_features_cached(file_trace(tmp_path)) == want and counted["features"] == 1
    assert features.TraceFeatures.from_record(json.loads(path.read_text())["record"]) == want  # rewritten whole
    assert features.trace_features_cached(file_trace(tmp_path)) == want and counted["features"] == 1


DESCRIBE_DAMAGE = {
    "truncated": lambda entry: None,
    "a share a string": lambda entry: entry["record"].update(sink_share="0.5"),
    "a share an int": lambda entry: entry["record"].update(sink_share=1),
    "steps of another trace": lambda entry: entry["record"].update(steps=entry["record"]["steps"] + 1),
    "band another": lambda entry: entry["record"].update(band=entry["record"]["band"] + 1),
    "a key missing": lambda entry: entry["record"].pop("effective_positions"),
    "a key more": lambda entry: entry["record"].update(extra=1.0),
    "record a list": lambda entry: entry.update(record=[1.0]),
    "other params": lambda entry: entry.update(params={"band": 1, "top_k": 32, "sinks": 4}),
}


@pytest.mark.parametrize("damage", sorted(DESCRIBE_DAMAGE))
def test_damaged_describe_is_computed_again_and_rewritten(cache_dir, tmp_path, counted, damage):
    trace = file_trace(tmp_path)
    want = metrics.describe_cached(trace, band=64, top_k=32, sinks=4)
    (path,) = stored(cache_dir, "describe")
    entry = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:-7])
    else:
        DESCRIBE_DAMAGE[damage](entry)
        path.write_text(json.dumps(entry))
    counted["describe"] = 0
    assert metrics.describe_cached(file_trace(tmp_path), band=64, top_k=32, sinks=4) == want
    assert counted["describe"] == 1 and json.loads(path.read_text())["record"] == want
    assert metrics.describe_cached(file_trace(tmp_path), band=64, top_k=32, sinks=4) == want
    assert counted["describe"] == 1


def test_an_edited_analysis_module_is_computed_afresh(cache_dir, tmp_path, counted, monkeypatch):
    trace = file_trace(tmp_path)
    want = analyses(trace)
    assert counted == {"features": 1, "describe": 1}
    assert analyses(file_trace(tmp_path)) == want and counted == {"features": 1, "describe": 1}
    # the versions are hashes of the modules' source files: another hash stands for an edit
    assert features.features_version() == cache.source_version(features.__file__) != metrics.describe_version()
    monkeypatch.setattr(features, "features_version", lambda: "edited")
    assert analyses(file_trace(tmp_path)) == want and counted == {"features": 2, "describe": 1}
    monkeypatch.setattr(metrics, "describe_version", lambda: "edited")
    assert analyses(file_trace(tmp_path)) == want and counted == {"features": 2, "describe": 2}
    assert len(stored(cache_dir, "features")) == 2 and len(stored(cache_dir, "describe")) == 2
    assert analyses(file_trace(tmp_path)) == want and counted == {"features": 2, "describe": 2}


def test_a_trace_without_a_cache_entry_never_touches_the_disk(cache_dir, counted, monkeypatch):
    trace = random_trace(200, seed=5)  # built in memory, like an upload
    assert trace.derived.disk_stem is None
    monkeypatch.setattr(cache, "atomic_write", lambda *a, **kw: pytest.fail("wrote to disk"))
    want = direct(trace)
    counted.update(features=0, describe=0)
    assert analyses(trace) == want and analyses(trace) == want
    assert counted == {"features": 2, "describe": 2}
    assert not cache_dir.exists()


def test_an_unwritable_cache_still_gives_the_analyses(cache_dir, tmp_path, counted):
    trace = file_trace(tmp_path)
    want = direct(trace)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    trace.derived.disk_stem = blocker / "cache" / "file-small"  # mkdir under a file fails, even as root
    counted.update(features=0, describe=0)
    assert analyses(trace) == want and analyses(trace) == want
    assert counted == {"features": 2, "describe": 2}
    assert blocker.read_text() == "not a directory"


def test_features_record_round_trip_and_refusals():
    f = features.TraceFeatures(steps=10, sinks=2, band=4, heavy=((3, 4, 9), (5, 6, 10)), heavy_source="s",
                              live_known=True, band_known=True, band_source="b", sink_source="k")
    record = f.to_record()
    assert set(features._RECORD_TYPES) | {"heavy"} == set(record)  # every field type-checked on the way back
    assert features.TraceFeatures.from_record(json.loads(json.dumps(record))) == f
    for bad in ([], {**record, "heavy": [[3, 4, True]]}, {**record, "band_known": "yes"}, {**record, "x": 1}):
        with pytest.raises(ValueError):
            features.TraceFeatures.from_record(bad)


def test_a_value_that_does_not_read_back_exactly_is_not_stored(cache_dir, tmp_path):
    trace = file_trace(tmp_path)
    for i, value in enumerate(({"x": (1, 2)}, {"x": float("nan")}, {"x": {1, 2}})):  # a tuple, NaN, a set
        assert cache.derived(trace, f"odd{i}", {}, "1", lambda value=value: value) is value
    assert not list(cache_dir.glob("*-odd*"))


def test_the_features_are_analysis_and_the_selection_parsers_plain_python():
    """``kvsim.analysis.features`` loads no view and no Plotly (it is the analysis layer), and the
    selection parsers load neither Plotly nor Streamlit: both are usable, and testable, on their own."""
    code = ("import sys, kvsim.analysis.features, kvsim.views.selection; "
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('plotly', 'streamlit') "
            "or m.startswith('kvsim.views.figures'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(features.__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""

"""What ships in ``traces/kept/`` (``kvsim.data.kept``): the cache's documents for the shipped traces, so a fresh
install reads the curve view and the claims instead of computing them (issue 56). These tests fail when the
engine, a policy, the data layer or an analysis changed without the data written again: run
``python -m kvsim.app.ship_kept``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import kvsim
from kvsim.data import kept, store
from kvsim.data.catalog import shipped_traces

APP = str(Path(__file__).resolve().parent.parent / "app.py")
#: the cheapest shipped real trace to compute again (attention alone, no members)
CHEAP = "gemma3-270m-L05"
REGENERATE = "the shipped cache documents are stale: run `python -m kvsim.app.ship_kept` and commit traces/kept/"


def shipped(trace: kvsim.Trace) -> dict[str, dict]:
    key = kept.content_key(trace)
    return {n.split("/", 1)[1]: d for n, d in kept._documents(str(kept.KEPT_DIR)).items() if n.startswith(f"{key}/")}


def test_every_shipped_trace_ships_small_json_named_by_the_caches_key_function():
    files = sorted(kept.KEPT_DIR.glob("*.json"))
    assert {p.stem for p in files} == {*shipped_traces(), "tuning"}
    assert sum(p.stat().st_size for p in files) < 2_000_000
    for path in files:
        doc = json.loads(path.read_text(encoding="utf-8"))
        for name, entry in doc["entries"].items():
            if name.startswith("tuning/"):
                continue
            key, file_name = name.split("/", 1)
            assert key == doc["content_key"]
            assert store.derived_name(entry["name"], entry["params"], entry["version"])[1] == file_name


def test_the_shipped_documents_are_what_the_code_computes_now(tmp_path, monkeypatch):
    """On an empty cache with nothing shipped read, the curve view's cheap part of the cheap trace (its
    features, the h2o curve over every window, the recency lines) is computed and kept under the same
    names, with the same contents, as shipped."""
    from kvsim.policies import PolicySpec
    from kvsim.policykit.base import WINDOW
    from kvsim.sim import summaries
    from kvsim.views import figures

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(kept.OFF_ENV, "1")
    trace = kvsim.resolve_trace(CHEAP)
    figures.trace_features_cached(trace)
    summaries.sweep(trace, PolicySpec.of("h2o", 256, recent_window=1), None, WINDOW, range(1, 256), top_k=32)
    for name in ("sliding_window", "streaming_llm"):
        summaries.summary(trace, PolicySpec.of(name, 256, **kvsim.policy_params(name)),
                          32)
    entry = trace.derived.disk_stem.name
    computed = {p.name[len(entry) + 1:]: json.loads(p.read_text()) for p in tmp_path.glob(f"{entry}-*.json")}
    assert len(computed) >= 4
    ships = shipped(trace)
    for name, doc in computed.items():
        assert name in ships, f"{name} not shipped: {REGENERATE}"
        assert ships[name] == doc, f"{name} differs: {REGENERATE}"


def _no_computing(monkeypatch) -> None:
    """Whatever the views would compute and keep raises: what they show must be read."""
    from kvsim.analysis import tune_sweep
    from kvsim.policies import optimal
    from kvsim.sim import simulate

    def refuse(*args, **kwargs):
        raise AssertionError(f"computed, not read: {REGENERATE}")

    derived = store.derived

    def read_only(trace, name, params, version, compute, *args, **kwargs):
        return derived(trace, name, params, version, refuse, *args, **kwargs)

    monkeypatch.setattr(store, "derived", read_only)
    for owner, name in ((simulate, "sweep"), (optimal, "optimal_schedule"), (tune_sweep, "tune_trace")):
        monkeypatch.setattr(owner, name, refuse)


@pytest.mark.parametrize("name", list(shipped_traces()))
def test_a_shipped_traces_curve_is_read_on_an_empty_cache(name, tmp_path, monkeypatch):
    """The first visit of Choosing recent_window on each shipped trace, with an empty cache: every curve and line
    drawn at once, from what ships; nothing swept, replayed, solved or tuned."""
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    _no_computing(monkeypatch)
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"view": "Choosing recent_window", "trace": name, "budget": "256"})
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    words = " ".join([c.value for c in at.caption] + [i.value for i in at.info])
    assert "Still replaying" not in words and "being solved" not in words
    fig = json.loads(at.get("plotly_chart")[0].proto.spec)
    drawn = {str(t.get("name", "")).split(" ")[0] for t in fig["data"]}
    assert {"h2o", "scissorhands", "optimal", "sliding_window", "upper"} <= drawn


def test_the_claims_of_a_shipped_trace_are_read_on_an_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    _no_computing(monkeypatch)  # the ledger is kept through store.derived
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"view": "Claims", "trace": CHEAP})
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    assert any("Every checkable claim" in m.value for m in at.markdown)


def test_an_upload_that_copies_a_shipped_trace_reads_what_ships(tmp_path, monkeypatch):
    """An upload has no cache entry; keyed by its content, a copy of a shipped file reads its documents."""
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    path = shipped_traces()[CHEAP]
    upload = kvsim.load_trace(path)
    assert upload.derived.disk_stem is None
    assert kept.content_key(upload) == kept.content_key(kvsim.resolve_trace(CHEAP))
    _no_computing(monkeypatch)
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"view": "Choosing recent_window", "budget": "256"})
    at.run()
    at.sidebar.file_uploader[0].set_value(("copy.npz", path.read_bytes(), "application/octet-stream"))
    started = time.perf_counter()
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    words = " ".join([c.value for c in at.caption] + [i.value for i in at.info])
    assert "uploaded: copy.npz" in [s.value for s in at.sidebar.selectbox]
    assert "Still replaying" not in words and "being solved" not in words
    assert time.perf_counter() - started < 60
    fig = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert {"h2o", "optimal"} <= {str(t.get("name", "")).split(" ")[0] for t in fig["data"]}

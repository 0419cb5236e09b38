"""The app's recent_window curves kept beside the trace (``kvsim.sim.summaries.sweep``): a fresh process reads
the rows an earlier one swept, the same rows; other values, code or traces sweep afresh."""

from __future__ import annotations

import json

import pytest

import kvsim
from kvsim.analysis.windows import sweep_coarse_to_fine
from kvsim.data import store
from kvsim.policies import PolicySpec
from kvsim.sim import simulate, summaries


@pytest.fixture
def trace(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    return store.canonical_trace()


def _counting(monkeypatch):
    calls = []
    real = simulate.sweep

    def counted(*args, **kwargs):
        calls.append(list(args[4]) if len(args) > 4 else list(kwargs.get("values", ())))
        return real(*args, **kwargs)

    monkeypatch.setattr(simulate, "sweep", counted)
    return calls


def test_a_sweep_is_read_back_the_same_and_not_replayed(trace, monkeypatch, tmp_path):
    spec = PolicySpec.of("h2o", 64)
    first = summaries.sweep(trace, spec, None, "recent_window", range(1, 64), top_k=8)
    assert first == kvsim.sweep(trace, spec, None, "recent_window", range(1, 64), top_k=8)
    kept = list(tmp_path.glob("canonical-*-sweep-*.json"))
    assert len(kept) == 1
    calls = _counting(monkeypatch)
    assert summaries.sweep(trace, spec.replace(recent_window=7), None, "recent_window", range(1, 64), top_k=8) == first
    assert calls == []  # the swept parameter's own value is not part of the key
    summaries.sweep(trace, spec, None, "recent_window", [5, 9], top_k=8)  # other values: swept
    summaries.sweep(trace, spec, None, "recent_window", range(1, 64), top_k=4)  # another top-k: swept
    summaries.sweep(trace, PolicySpec.of("h2o", 80), None, "recent_window", range(1, 64), top_k=8)  # another budget
    assert calls == [[5, 9], list(range(1, 64)), list(range(1, 64))]


def test_a_damaged_or_foreign_file_is_swept_again(trace, monkeypatch, tmp_path):
    spec = PolicySpec.of("h2o", 48)
    rows = summaries.sweep(trace, spec, None, "recent_window", [1, 2, 3], top_k=8)
    (path,) = tmp_path.glob("canonical-*-sweep-*.json")
    doc = json.loads(path.read_text())
    doc["record"]["rows"] = doc["record"]["rows"][:2]  # rows that are not this sweep's
    path.write_text(json.dumps(doc))
    calls = _counting(monkeypatch)
    assert summaries.sweep(trace, spec, None, "recent_window", [1, 2, 3], top_k=8) == rows
    path.write_text("{not json")
    assert summaries.sweep(trace, spec, None, "recent_window", [1, 2, 3], top_k=8) == rows
    assert calls == [[1, 2, 3], [1, 2, 3]]


def test_the_coarse_to_fine_sweep_through_it_gives_the_same_rows(trace):
    spec = PolicySpec.of("h2o", 128)
    plain = sweep_coarse_to_fine(trace, spec, None, "recent_window", 1, 127, marks=(32,), points=8, top_k=8)
    kept = sweep_coarse_to_fine(trace, spec, None, "recent_window", 1, 127, marks=(32,), points=8, top_k=8,
                                run=summaries.sweep)
    again = sweep_coarse_to_fine(trace, spec, None, "recent_window", 1, 127, marks=(32,), points=8, top_k=8,
                                 run=summaries.sweep)
    assert plain == kept == again


def test_a_trace_without_a_cache_entry_is_swept_and_nothing_written(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    from kvsim.data import canonical

    trace = canonical.generate(canonical.CanonicalConfig(steps=128))
    assert trace.derived.disk_stem is None
    rows = summaries.sweep(trace, PolicySpec.of("h2o", 64), None, "recent_window", [1, 8], top_k=8)
    assert [r["recent_window"] for r in rows] == [1, 8]
    assert list(tmp_path.iterdir()) == []


def test_the_claims_ledger_is_kept_and_read_back_the_same(trace, monkeypatch, tmp_path):
    import importlib

    ledger_module = importlib.import_module("kvsim.analysis.claims.ledger")  # the package's ledger is the function

    first = ledger_module.kept_ledger(trace)
    assert first == ledger_module.ledger(trace)
    assert len(list(tmp_path.glob("canonical-*-claims-*.json"))) == 1
    calls = []
    monkeypatch.setattr(ledger_module, "ledger", lambda *a, **k: calls.append(a) or [])
    assert ledger_module.kept_ledger(trace) == first and calls == []

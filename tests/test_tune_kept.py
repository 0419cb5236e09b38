"""The app's bundle tuning kept on disk (``tune(..., keep=True)``, ``tune_sweep.kept_unit``): a later tune of the
same trace files, configurations and code reads each trace's sweep back, the same result; nothing else is kept."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvsim.analysis import tune_sweep
from kvsim.analysis.tune import tune
from kvsim.data.bundle import load_bundle
from kvsim.data.catalog import TRACES_DIR


@pytest.fixture
def bundle():
    return load_bundle(TRACES_DIR / "gemma3-270m-heapq")


def _counting(monkeypatch):
    calls = []
    real = tune_sweep.tune_trace

    def counted(trace, specs, top_k=8, layout=None):
        calls.append(trace.name)
        return real(trace, specs, top_k=top_k, layout=layout)

    monkeypatch.setattr(tune_sweep, "tune_trace", counted)
    return calls


def _same(a, b) -> None:
    assert a.windows == b.windows and a.model_window == b.model_window
    for x, y in zip(a.traces, b.traces, strict=True):
        assert np.array_equal(x.retained_mass, y.retained_mass) and np.array_equal(x.top_k_recall, y.top_k_recall)
        assert x.baselines == y.baselines and x.recommended_window == y.recommended_window


def test_a_kept_tuning_is_read_back_the_same(bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    plain = tune(bundle, "h2o", 64, windows=range(1, 64, 9), top_k=8)
    assert not (tmp_path / "tuning").exists()  # without keep nothing is written
    first = tune(bundle, "h2o", 64, windows=range(1, 64, 9), top_k=8, keep=True)
    assert len(list((tmp_path / "tuning").glob("unit-*.json"))) == len(bundle.traces)
    calls = _counting(monkeypatch)
    again = tune(bundle, "h2o", 64, windows=range(1, 64, 9), top_k=8, keep=True)
    assert calls == []
    _same(plain, first)
    _same(first, again)
    tune(bundle, "h2o", 64, windows=range(1, 64, 9), top_k=4, keep=True)  # another top-k: swept again
    assert len(calls) == len(bundle.traces)


def test_a_damaged_kept_unit_is_swept_again(bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    path = str(bundle.traces[0].path)
    specs = tune_sweep.window_specs("h2o", 64, [8, 16], {})
    first = tune_sweep.kept_unit(path, "L00", specs, 8)
    (kept,) = (tmp_path / "tuning").glob("unit-*.json")
    doc = json.loads(kept.read_text())
    doc["result"]["retained_mass"] = doc["result"]["retained_mass"][:1]  # not this sweep's
    kept.write_text(json.dumps(doc))
    calls = _counting(monkeypatch)
    assert tune_sweep.kept_unit(path, "L00", specs, 8) == first
    kept.write_text("{")
    assert tune_sweep.kept_unit(path, "L00", specs, 8) == first
    assert len(calls) == 2

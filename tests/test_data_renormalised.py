"""Issue 21, item 5: a trace whose rows the loader renormalised says so (``meta["renormalised"]``,
``kvsim.analysis.metrics.repair_note``, ``kvsim describe`` in text and ``--json``); a clean one says nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tolerance import rounding

import kvsim
from kvsim import cli
from kvsim.analysis import metrics
from kvsim.data import trace as trace_module
from kvsim.data.catalog import resolve_trace


def renormalised(trace):
    return metrics.renormalised(trace)


def repair_note(trace):
    return metrics.repair_note(trace)


ROW_SUM_TOLERANCE = getattr(trace_module, "ROW_SUM_TOLERANCE", 1e-3)


def scaled_file(tmp_path, make_trace, steps: int = 60, lo: float = 1.5, hi: float = 315.0):
    """A trace file whose rows sum from ``lo`` (row 1) to ``hi`` (the last row), not 1."""
    trace = make_trace(steps, seed=5, name="scaled")
    scale = np.geomspace(lo, hi, steps)
    attention = trace.attention.astype(np.float64)
    attention[1:] *= scale[:, None]
    path = tmp_path / "scaled.npz"
    np.savez_compressed(path, attention=attention)
    return path, trace


def test_a_scaled_upload_records_what_was_renormalised(tmp_path, make_trace):
    path, clean = scaled_file(tmp_path, make_trace)
    trace = kvsim.load_trace(path)
    record = trace.meta["renormalised"]
    assert record["rows"] == 60 and record["tolerance"] == ROW_SUM_TOLERANCE
    # scaled in float64 from float32 rows that sum to 1 within half an ulp of each of their 60 weights
    assert record["min_sum"] == pytest.approx(1.5, rel=rounding(61)) and record["max_sum"] == pytest.approx(315.0, rel=rounding(61))
    assert renormalised(trace) == record
    note = repair_note(trace)
    assert note == ("Renormalised 60 of 60 rows: their weights summed to 1.5-315, not 1; "
                    "every figure uses the rows divided by their sums.")
    # the repair itself: divided by a sum within rounding(61) of the scale, stored as float32
    np.testing.assert_allclose(trace.attention, clean.attention, rtol=rounding(62), atol=0)


def test_only_the_rows_that_were_off_count(tmp_path, make_trace):
    trace = make_trace(40, seed=2)
    attention = trace.attention.astype(np.float64)
    attention[7] *= 2.0
    attention[30] *= 1 + 3 * ROW_SUM_TOLERANCE
    attention[12] *= 1 + ROW_SUM_TOLERANCE / 4  # float16-sized rounding: not a repair
    got = kvsim.from_array(attention)
    assert got.meta["renormalised"]["rows"] == 2
    assert got.meta["renormalised"]["min_sum"] == pytest.approx(1.003, rel=rounding(41))  # a 40-weight row, scaled
    assert "2 of 40 rows" in repair_note(got) and "1.003-2" in repair_note(got)


def test_clean_traces_say_nothing(tmp_path, make_trace, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    normalised = kvsim.from_array(make_trace(50, seed=1).attention)  # rows that sum to 1 in float32
    for trace in (normalised, resolve_trace("canonical"), resolve_trace("gemma3-270m-L11")):
        assert "renormalised" not in trace.meta, trace.name
        assert renormalised(trace) is None and repair_note(trace) is None


def test_a_repaired_trace_saved_and_read_again_is_clean(tmp_path, make_trace):
    """The loader owns the key: the saved file holds normalised rows, so it claims no repair (nor can a
    file's own meta forge one)."""
    path, _ = scaled_file(tmp_path, make_trace)
    repaired = kvsim.load_trace(path)
    again = tmp_path / "again.npz"
    kvsim.save_npz(repaired, again)
    assert "renormalised" not in kvsim.load_trace(again).meta
    assert repair_note(kvsim.load_trace(again)) is None


def test_describe_says_it_in_text_and_json(tmp_path, make_trace, capsys):
    path, _ = scaled_file(tmp_path, make_trace)
    assert cli.main(["describe", "--trace", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["renormalised"]["rows"] == 60
    assert doc["renormalised"]["min_sum"] == pytest.approx(1.5, rel=rounding(61))
    assert doc["renormalised"]["max_sum"] == pytest.approx(315.0, rel=rounding(61))
    assert doc["note"].startswith("Renormalised 60 of 60 rows")
    assert cli.main(["describe", "--trace", str(path)]) == 0
    text = capsys.readouterr().out
    assert "note: Renormalised 60 of 60 rows: their weights summed to 1.5-315, not 1" in text


def test_describe_of_a_clean_trace_has_no_note(tmp_path, make_trace, capsys):
    path = tmp_path / "clean.npz"
    kvsim.save_npz(kvsim.from_array(make_trace(30, seed=3).attention), path)
    assert cli.main(["describe", "--trace", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "renormalised" not in doc and "note" not in doc
    assert cli.main(["describe", "--trace", str(path)]) == 0
    assert "note:" not in capsys.readouterr().out


def test_the_app_says_what_it_renormalised_in_an_upload():
    """An upload whose rows sum to 1.5-315 is used divided by its sums, and the sidebar and the trace
    view say so with the range (before, it loaded as if clean)."""
    from test_app import npz_bytes, run

    n = 301
    a = np.tril(np.ones((n, n)), k=-1)
    a[1:] *= np.linspace(1.5, 315.0, n - 1)[:, None] / np.maximum(a[1:].sum(axis=1, keepdims=True), 1)
    at = run({"budget": "64"}, view="The trace")
    at.sidebar.file_uploader[0].set_value(("scaled.npz", npz_bytes(attention=a.astype(np.float32)),
                                           "application/octet-stream")).run()
    assert [e.value for e in at.error] == []
    side = [w.value for w in at.sidebar.warning]
    assert any(w.startswith("scaled.npz: Renormalised 300 of 300 rows") and "1.5-315" in w for w in side), side
    assert any(w.value.startswith("Renormalised 300 of 300 rows") for w in at.main.warning)
    at = run({"budget": "64"}, view="The trace")  # the canonical trace: nothing was repaired, nothing is said
    assert not any("Renormalised" in w.value for w in [*at.warning, *at.sidebar.warning])

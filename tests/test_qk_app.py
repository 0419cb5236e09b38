"""The app on a bundle of query/key traces (Streamlit's AppTest): a layer of it opens in every view, one
longer than its dense matrix (``qk.DENSE_LIMIT`` steps) opens whole, drawn from one pass over its rows, and
a recording in the cache directory is offered. The limit is lowered for the test so a 199-step bundle
stands for a 32k one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest
from test_qk_trace import _write_bundle

from kvsim.data import catalog, qk

APP = str(Path(__file__).resolve().parent.parent / "app.py")


@pytest.fixture
def shipped_qk(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(catalog, "TRACES_DIR", tmp_path / "traces")
    _write_bundle(tmp_path / "traces" / "toyqk")
    st.cache_resource.clear()
    yield
    st.cache_resource.clear()


@pytest.mark.parametrize("view", ["Kept positions", "Cumulative scores", "Choosing recent_window", "The trace"])
def test_a_query_key_trace_longer_than_its_dense_matrix_opens_whole_in_every_view(shipped_qk, monkeypatch, view):
    monkeypatch.setattr(qk, "DENSE_LIMIT", 150)
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params.update({"trace": "toyqk:L01", "view": view, "budget": "64"})
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    captions = " ".join(c.value for c in at.sidebar.caption)
    assert "199 steps, stored as queries and keys" in captions
    assert "optimal reads the whole matrix (at most 150 steps) and is left out" in captions
    assert at.sidebar.slider[0].max == 199  # every step, not a prefix
    if view == "The trace":
        table = at.dataframe[0].value
        assert table["value"][0] == "199"
    if view == "Choosing recent_window":  # the references that read the whole matrix are left out, quietly
        assert not [i.value for i in at.info if "optimum" in i.value]


def test_a_policy_that_reads_the_whole_matrix_is_left_out_of_a_long_trace_in_one_line(shipped_qk, monkeypatch):
    monkeypatch.setattr(qk, "DENSE_LIMIT", 150)
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params.update({"trace": "toyqk:L01", "budget": "64", "policies": "h2o,greedy_future,optimal"})
    at.run()
    assert [e.value for e in at.exception] == []
    assert [e.value for e in at.error] == [
        "optimal reads the whole attention matrix, which a trace of 199 steps stored as queries and keys does not "
        "have here (at most 150 steps); it is left out on this trace."]
    (kept,) = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    assert [t["name"] for t in kept["data"] if t["type"] == "image" and t["name"] in ("h2o", "greedy_future", "optimal")] == [
        "h2o", "greedy_future"]  # greedy_future reads rows a block at a time: it runs at any length


def test_a_recording_in_the_cache_directory_is_offered_and_opens(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(cache))
    monkeypatch.setattr(catalog, "TRACES_DIR", tmp_path / "traces")  # nothing shipped
    _write_bundle(cache / catalog.RECORDINGS_DIR / "toy-199-qk-0123456789abcdef")
    st.cache_resource.clear()
    try:
        at = AppTest.from_file(APP, default_timeout=180)
        at.query_params.update({"trace": "toy-199-qk-0123456789abcdef:L00", "budget": "64"})
        at.run()
        assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
        assert "toy-199-qk-0123456789abcdef:L01" in at.sidebar.selectbox[0].options
        assert at.query_params["trace"] == "toy-199-qk-0123456789abcdef:L00" and not at.warning
    finally:
        st.cache_resource.clear()

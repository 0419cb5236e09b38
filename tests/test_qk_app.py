"""The app on a bundle of query/key traces (Streamlit's AppTest): a layer of it opens in every view, and one
longer than the app draws (its views read whole rows) opens as its first ``qk.DENSE_LIMIT`` steps with a
line saying so. The limit is lowered for the test so a 300-step bundle stands for a 32k one."""

from __future__ import annotations

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


@pytest.mark.parametrize("view", ["Kept positions", "Choosing recent_window", "The trace"])
def test_a_query_key_trace_longer_than_the_app_draws_opens_as_its_first_steps(shipped_qk, monkeypatch, view):
    monkeypatch.setattr(qk, "DENSE_LIMIT", 150)
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params.update({"trace": "toyqk:L01", "view": view, "budget": "64"})
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    captions = " ".join(c.value for c in at.sidebar.caption)
    assert "showing the first 150 of the recording's 199 steps" in captions

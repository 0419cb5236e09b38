"""Choosing recent_window on a trace switched to (issue 56): while the new trace's curves are replayed, nothing of
the previous trace's chart or its words stays on screen, and what is drawn so far is said.

What the browser shows mid-run is rebuilt from the deltas the script sent (Streamlit's ForwardMsgQueue): the
previous run's elements stay, faded, until a delta of the new run replaces them (an element at their path or
above it); a block re-sent at the same path keeps its children until they are replaced."""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
from streamlit.runtime.forward_msg_queue import ForwardMsgQueue
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parent.parent / "app.py")
#: what a stale element of these kinds would say of the previous trace's curve
CURVE_KINDS = ("plotly_chart", "markdown", "caption", "progress", "info")


def _kind(msg) -> str:
    delta = msg.delta
    which = delta.WhichOneof("type")
    if which == "new_element":
        return delta.new_element.WhichOneof("type")
    return "add_block" if which == "add_block" else None


def _text(msg) -> str:
    if msg.delta.WhichOneof("type") != "new_element":
        return ""
    element = msg.delta.new_element
    which = element.WhichOneof("type")
    return str(getattr(getattr(element, which), "body", "")) if which else ""


def _screen(events: list) -> dict:
    """path -> (run, kind, text) as the browser holds it after ``events``."""
    shown: dict = {}
    for run, path, kind, text in events:
        if kind is None:  # a transient (a spinner's) replaces nothing
            continue
        if kind != "add_block":  # an element replaces whatever was at its path, children and all
            for p in [p for p in shown if len(p) > len(path) and p[:len(path)] == path]:
                del shown[p]
        shown[path] = (run, kind, text)
    return shown


def _npz(attention: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, attention=attention)
    return buf.getvalue()


def test_a_switched_trace_never_shows_the_previous_traces_chart_or_words(monkeypatch, tmp_path):
    from kvsim.sim import simulate

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    events: list = []
    run = ["old"]
    enqueue = ForwardMsgQueue.enqueue

    def recording(self, msg):
        if msg.HasField("delta"):
            events.append((run[0], tuple(msg.metadata.delta_path), _kind(msg), _text(msg)))
        return enqueue(self, msg)

    marks: list[int] = []
    sweep, replay = simulate.sweep, simulate.replay

    def marked(real):
        def call(trace, *args, **kwargs):  # a replay of the new trace: what is on screen meanwhile is checked
            if trace.name == "fresh" and run[0] == "new":
                marks.append(len(events))
            return real(trace, *args, **kwargs)
        return call

    monkeypatch.setattr(ForwardMsgQueue, "enqueue", recording)
    monkeypatch.setattr(simulate, "sweep", marked(sweep))
    monkeypatch.setattr(simulate, "replay", marked(replay))
    rng = np.random.default_rng(56)
    first, fresh = (np.tril(rng.gamma(0.3, size=(401, 401)) + 1e-6, k=-1).astype(np.float32) for _ in range(2))
    at = AppTest.from_file(APP, default_timeout=240)
    at.query_params.update({"view": "Choosing recent_window", "budget": "64"})
    at.run()
    at.sidebar.file_uploader[0].set_value(("first.npz", _npz(first), "application/octet-stream"))
    started = len(events)
    at.run()  # the previous trace: an upload, drawn whole (its lines too)
    for _ in range(480):
        words = " ".join([c.value for c in at.caption] + [i.value for i in at.info])
        if "Still replaying" not in words and "being solved" not in words and "drawn last" not in words:
            break
        time.sleep(0.25)
        started = len(events)
        at.run()
    assert [e.value for e in at.exception] == []
    old = events[started:]
    assert any(kind == "plotly_chart" for _, kind, _ in _screen(old).values())

    run[0] = "new"
    at.sidebar.file_uploader[0].set_value(("fresh.npz", _npz(fresh), "application/octet-stream"))
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    assert marks, "the new trace's curves were not replayed"
    new_start = len(events) - len([e for e in events if e[0] == "new"])
    for mark in marks:
        shown = _screen(old + events[new_start:mark])
        stale = [(path, kind, text[:60]) for path, (who, kind, text) in shown.items()
                 if who == "old" and path[0] == 0 and kind in CURVE_KINDS]
        assert stale == [], f"on screen while the new trace's curves are replayed: {stale}"
    for _ in range(480):  # what the background replays ends before the test does (and is drawn)
        words = " ".join([c.value for c in at.caption] + [i.value for i in at.info])
        if "Still replaying" not in words and "being solved" not in words and "drawn last" not in words:
            break
        time.sleep(0.25)
        at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    assert at.get("plotly_chart"), "the new trace's chart is drawn"

"""Issue 21, what a newcomer trips on in the app's state: a view's zoom and step belong to the trace
they were set on (item 1), and the policy lab says what it did and what it measures (item 7)."""

from __future__ import annotations

import io

import numpy as np
from streamlit.testing.v1 import AppTest
from test_app import problems, run, widget

LAYER = "gemma3-270m-heapq:L00"  # a 1024-step layer of the shipped bundle


def npz(steps: int, seed: int = 3) -> bytes:
    a = np.tril(np.random.default_rng(seed).random((steps + 1, steps + 1)), k=-1).astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, attention=a)
    return buf.getvalue()


def zoom(at: AppTest) -> tuple[tuple, tuple]:
    return (widget(at, "slider", "positions", sidebar=False).value, widget(at, "slider", "steps", sidebar=False).value)


def zoom_to(at: AppTest, positions: tuple, steps: tuple) -> AppTest:
    widget(at, "slider", "positions", sidebar=False).set_value(positions)
    widget(at, "slider", "steps", sidebar=False).set_value(steps)
    return at.run()


def step(at: AppTest) -> int:
    return widget(at, "slider", "step").value


def captions(at: AppTest) -> str:
    return " ".join(c.value for c in at.caption)


# --- item 1: the zoom and the step follow the trace -------------------------------------------


def test_choosing_another_trace_resets_the_zoom_and_the_step():
    at = run({"trace": LAYER})
    assert step(at) == 1024 and zoom(at) == ((0, 1024), (1, 1024))
    zoom_to(at, (100, 300), (200, 400))
    widget(at, "selectbox", "trace").set_value("canonical").run()
    assert problems(at) == [] and [e.value for e in at.error] == []
    assert zoom(at) == ((0, 4096), (1, 4096))  # the whole of the new run, not L00's corner of it
    assert step(at) == 4096 and at.query_params["step"] == "4096"
    assert "zoomed to" not in captions(at)


def test_an_upload_and_a_refused_upload_reset_the_zoom():
    at = run()
    zoom_to(at, (50, 100), (60, 120))
    at.sidebar.file_uploader[0].set_value(("mine.npz", npz(300), "application/octet-stream")).run()
    assert problems(at) == [] and zoom(at) == ((0, 300), (1, 300)) and step(at) == 300
    zoom_to(at, (10, 20), (30, 40))
    bad = np.tril(np.ones((5, 5)), k=-1).astype(np.float32)
    bad[3, 1] = np.nan
    buf = io.BytesIO()
    np.savez(buf, attention=bad)
    at.sidebar.file_uploader[0].set_value(("broken.npz", buf.getvalue(), "application/octet-stream")).run()
    assert problems(at) == [] and any("showing canonical instead" in e.value for e in at.error)
    assert zoom(at) == ((0, 4096), (1, 4096)) and step(at) == 4096


def test_a_zoom_in_force_is_said_above_the_figure_and_can_be_reset():
    at = run()
    assert "zoomed to" not in captions(at)
    zoom_to(at, (100, 300), (200, 400))
    assert "zoomed to positions 100..300, steps 200..400 of 4096" in captions(at)
    [b for b in at.button if b.label == "reset: the whole run"][0].click().run()
    assert zoom(at) == ((0, 4096), (1, 4096)) and "zoomed to" not in captions(at)


def test_a_tour_step_over_another_trace_keeps_its_own_step():
    at = run({"trace": LAYER})
    [b for b in at.sidebar.button if b.label == "start the guided tour"][0].click().run()
    assert problems(at) == [] and widget(at, "selectbox", "trace").value == "canonical"
    assert step(at) == 2048 and zoom(at) == ((0, 4096), (1, 4096))


def test_a_link_keeps_its_step():
    at = run({"trace": "canonical", "step": "1500"})
    assert step(at) == 1500 and problems(at) == []

"""Issue 21, what a newcomer trips on in the app's state: a view's zoom and step belong to the trace
they were set on (item 1), and the policy lab says what it did and what it measures (item 7)."""

from __future__ import annotations

import io
import json

import numpy as np
from streamlit.testing.v1 import AppTest
from test_app import problems, run, widget

from kvsim.analysis import lab

LAYER = "gemma3-270m-heapq:L00"  # a 1024-step layer of the shipped bundle


def npz(steps: int, seed: int = 3) -> bytes:
    a = np.tril(np.random.default_rng(seed).random((steps + 1, steps + 1)), k=-1).astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, attention=a)
    return buf.getvalue()


def open_zoom(at: AppTest) -> AppTest:
    """Open the kept view's zoom panel, as a user does: its sliders are drawn only while it is open."""
    if not ("zoom_open" in at.session_state and at.session_state["zoom_open"]):
        at.session_state["zoom_open"] = True
        at.run()
    return at


def zoom(at: AppTest) -> tuple[tuple, tuple]:
    open_zoom(at)
    return (widget(at, "slider", "positions", sidebar=False).value, widget(at, "slider", "steps", sidebar=False).value)


def zoom_to(at: AppTest, positions: tuple, steps: tuple) -> AppTest:
    open_zoom(at)
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
    assert "**Each panel is one policy's cache over the region zoomed to.**" in " ".join(m.value for m in at.markdown)
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


# --- item 7: the policy lab says what it set, what its note is about, and when a step is measured ----


def lab_app() -> AppTest:
    return run(view="Policy lab")


def lab_text(at: AppTest) -> str:
    return " ".join(e.value for kind in ("markdown", "caption", "info", "warning") for e in getattr(at, kind))


def test_switching_a_lab_side_to_h2o_keeps_a_sensible_recent_window_and_says_so():
    at = lab_app()
    assert at.number_input(key="lab_budget").value == 5
    at.selectbox(key="lab_left").set_value("h2o").run()
    assert problems(at) == [] and [e.value for e in at.error] == []
    assert at.number_input(key="lab_left_rw").value == 2  # h2o's default 32 does not fit budget 5: half of it
    assert "recent_window set to 2 for h2o" in lab_text(at)
    assert "h2o (recent_window=2), step" in json.loads(at.get("plotly_chart")[0].proto.spec)["layout"]["title"]["text"]


def test_the_lab_says_when_recent_window_0_evicts_each_new_position():
    at = lab_app()
    at.selectbox(key="lab_left").set_value("h2o").run()
    at.number_input(key="lab_left_rw").set_value(0).run()
    assert "recent_window set to" not in lab_text(at)  # the user's own value now
    assert "With recent_window 0, h2o evicts each new position at once" in lab_text(at)


def test_the_presets_note_is_marked_when_the_policies_change():
    at = lab_app()
    preset = lab.PRESETS["sliding_window vs streaming_llm"]
    assert preset.watch in [i.value for i in at.info]
    at.selectbox(key="lab_right").set_value("h2o").run()
    assert preset.watch not in [i.value for i in at.info]
    assert "no longer applies" in lab_text(at) and "sliding_window vs streaming_llm (sinks=4) at budget 5" in lab_text(at)
    at.selectbox(key="lab_right").set_value("streaming_llm").run()
    assert preset.watch in [i.value for i in at.info]  # the preset's own pair again
    at.number_input(key="lab_budget").set_value(6).run()
    assert preset.watch not in [i.value for i in at.info] and "no longer applies" in lab_text(at)


def test_a_lab_steps_figure_says_it_is_measured_before_the_steps_eviction():
    at = lab_app()
    title = json.loads(at.get("plotly_chart")[0].proto.spec)["layout"]["title"]["text"]
    assert title.startswith("sliding_window, step 5: retained 1.000, then evicts 0<br>")
    assert "query 5's attention on the cache it found, measured before this step's eviction" in title


# --- item 6: a tour step is a slide whose words match its figure --------------------------------------


def kept_figure(at: AppTest) -> dict:
    (spec,) = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    return spec


def shapes(spec: dict, prefix: str) -> list[dict]:
    return [s for s in spec["layout"].get("shapes", []) if str(s.get("name", "")).startswith(prefix)]


def test_the_sinks_step_describes_only_marks_its_difference_figure_draws():
    at = run({"tour": "sinks"})
    spec = kept_figure(at)
    text = " ".join(m.value for m in at.markdown)
    # the difference draws no heavy-hitter fates and no protected window (neither policy has one) ...
    assert not [t for t in spec["data"] if t.get("name") == "evicted here"] and not shapes(spec, "protected window")
    # ... and so its notes name neither (before: "a red line runs ...; an × marks ..." and "a dashed green line")
    assert "a red line runs while the policy holds it" not in text and "dashed green line" not in text
    assert "*a panel per policy* shows which each keeps" in text
    assert not at.title  # a slide: the tour box is the heading, the figure fits under it


def test_the_heavy_hitters_step_says_what_its_panels_draw():
    at = run({"tour": "heavy-hitters"})
    spec = kept_figure(at)
    text = " ".join(m.value for m in at.markdown)
    assert [t for t in spec["data"] if t.get("name") == "evicted here"] and shapes(spec, "protected window (age 32)")
    assert "a red line runs while the policy holds it" in text and "dashed green line" in text
    # the step's words and the notes under its figure tell the same story: h2o loses two of them
    assert "h2o's cumulative scores keep all but two" in text and "h2o (recent_window=32) loses 2 of" in text


def test_the_window_step_rings_the_default_under_the_current_star():
    at = run({"tour": "window"})
    (curve,) = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    star = [t for t in curve["data"] if t.get("name") == "current recent_window (32)"][0]["marker"]
    default = [t for t in curve["data"] if t.get("name") == "shipped default (32)"][0]["marker"]
    assert default["symbol"].endswith("-open") and default["size"] > star["size"]  # visible round the star
    assert "orange ring round the red star" in " ".join(m.value for m in at.markdown)
    at = run({"recent_window": "64"}, view="Choosing recent_window")  # apart from the star: a plain disc
    (curve,) = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    default = [t for t in curve["data"] if t.get("name") == "shipped default (32)"][0]["marker"]
    assert default["symbol"] == "circle" and default["size"] == 12

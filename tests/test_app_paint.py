"""Issue 20, item 6: what a first paint draws. The panels a user opens on demand (the sidebar's
more policy parameters, the kept view's zoom) build their inputs only while open, and the values set
in them outlive the panel being folded away."""

from __future__ import annotations

from test_app import problems, run, widget


def labels(elements) -> list[str]:
    return [e.label for e in elements]


def test_the_first_paint_builds_no_folded_inputs():
    at = run()
    assert problems(at) == []
    assert labels(at.sidebar.number_input) == ["budget", "recent_window", "sinks"]
    assert labels(at.main.slider) == [] and "the whole run" not in labels(at.button)
    assert {"more policy parameters", "zoom to single positions (re-drawn from the replay at full resolution)"} <= {
        e.label for e in at.expander}


def test_the_plan_and_the_reading_are_built_only_when_opened():
    """The sidebar's "run these settings elsewhere" and the kept view's "how to read this picture" are
    folded on a first paint and build nothing inside; opened, they hold a plan per online policy and the
    paragraph."""
    at = run()
    assert problems(at) == [] and {"run these settings elsewhere", "how to read this picture"} <= {e.label for e in at.expander}
    assert not [b for b in at.get("download_button") if b.label.startswith("plan: ")]
    assert not any("box select" in m.value for m in at.markdown)
    at.session_state["plan_open"] = True
    at.session_state["kept_how_open"] = True
    at.run()
    assert problems(at) == []
    assert [b.label for b in at.get("download_button") if b.label.startswith("plan: ")] == [
        "plan: sliding_window", "plan: streaming_llm", "plan: h2o"]
    assert any("box select" in m.value for m in at.main.markdown)


def test_a_policy_parameter_set_in_the_panel_outlives_its_folding():
    at = run({"policies": "snapkv"})
    at.session_state["more_params_open"] = True
    at.run()
    assert labels(at.sidebar.number_input)[:5] == ["budget", "recent_window", "sinks", "history_window", "observation_window"]
    assert set(labels(at.sidebar.number_input)[5:]) == {"query_window", "future_positions", "refresh"}  # expected_attention's
    widget(at, "number_input", "observation_window").set_value(16).run()
    at.session_state["more_params_open"] = False
    at.run()
    at.run()  # a second run with the panel folded: Streamlit would have dropped a hidden input's value by now
    assert problems(at) == [] and "observation_window" not in labels(at.sidebar.number_input)
    assert at.session_state["observation_window"] == 16 and at.query_params["observation_window"] == "16"
    assert "| snapkv (recent_window=32, observation_window=16) |" in " ".join(m.value for m in at.markdown)


def test_a_zoom_set_in_the_panel_outlives_its_folding():
    at = run()
    at.session_state["zoom_open"] = True
    at.run()
    assert labels(at.main.slider) == ["positions", "steps"]
    widget(at, "slider", "positions", sidebar=False).set_value((100, 300)).run()
    at.session_state["zoom_open"] = False
    at.run()
    at.run()
    assert problems(at) == [] and labels(at.main.slider) == []
    assert "zoomed to positions 100..300, steps 1..4096 of 4096" in " ".join(c.value for c in at.caption)
    at.session_state["zoom_open"] = True
    at.run()
    assert widget(at, "slider", "positions", sidebar=False).value == (100, 300)

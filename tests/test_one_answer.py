"""Issue 31, items 4 and 5 through the app (Streamlit's AppTest): one answer per question (the truth's
sentences name what they compare, and two views asked the same question read one function), and the text
says what the picture draws."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def app(**query) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=240)
    for key, value in query.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def text_of(at: AppTest) -> str:
    return " ".join(m.value for m in at.markdown)


def figures_of(at: AppTest) -> list[dict]:
    import json

    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


# --- item 5: the trace view's heavy hitters, counted as drawn --------------------------------------


@pytest.mark.parametrize("trace", ["canonical", "gemma3-270m-L11"])
def test_the_trace_view_counts_the_triangles_it_draws(trace):
    """The trace view said "24 heavy hitters, red triangles" beside 8 triangles on the canonical trace: the
    number of triangles the text states is the number the figure draws, and the ×n beside them add up to
    the heavy hitters' count."""
    at = app(trace=trace, view="The trace")
    text = text_of(at)
    (fig,) = figures_of(at)
    (heavy,) = [t for t in fig["data"] if str(t.get("name", "")).startswith("heavy hitter")]
    drawn = len(heavy["x"])
    stated = re.search(r"heavy hitters \((\d+)(?:, drawn as (\d+) red triangles|, a red triangle at each)", text)
    assert stated, text
    n = int(stated.group(1))
    assert drawn == (int(stated.group(2)) if stated.group(2) else n)
    assert sum(int(x[1:]) if x else 1 for x in heavy["text"]) == n
    if trace == "canonical":
        assert (n, drawn) == (24, 8)


# --- item 5: the optimum's place says when it comes ------------------------------------------------


def test_a_background_job_says_when_it_began_and_nothing_while_it_waits():
    """The solve's status carries how long it has run (None while it waits behind another job), the
    figures "when it comes" is computed from."""
    import threading
    import time

    from kvsim.app.services import Background

    pool = Background(workers=1, bound=4)
    first_may_end, second_began = threading.Event(), threading.Event()
    pool.poll("first", lambda progress: first_may_end.wait(10))
    waiting = pool.poll("second", lambda progress: second_began.set())
    assert (waiting.done, waiting.elapsed_s) == (False, None)
    time.sleep(0.2)
    running = pool.poll("first", lambda progress: None)
    assert running.done is False and 0.15 <= running.elapsed_s < 10
    first_may_end.set()
    assert second_began.wait(10)


def test_the_optimums_place_says_when_it_comes():
    """It said "(0% done)" and no more: now whether it waits, how long it has run, and at some progress
    the time left at the pace so far."""
    from kvsim.views.story import when_done

    assert "waits for the background worker" in when_done(0.0, None)
    assert "started 12 s ago" in when_done(0.0, 12.4) and "%" not in when_done(0.0, 12.4)
    assert when_done(0.25, 30.0) == "25% done in 30 s; at that pace about 90 s more (about 120 s in all)."


# --- item 4: one answer per question ---------------------------------------------------------------

#: a truth sentence: "**<who picks>: proxy and truth agree.**" then what each side was measured over
VERDICT = re.compile(r"\*\*(?P<subject>[^*:]+): proxy and truth (?P<verdict>agree|disagree)\.\*\*")


def truth_sentences(at: AppTest) -> dict[str, str]:
    """The page's truth sentences by the pick they are about; a pick stated twice must read the same."""
    found: dict[str, str] = {}
    for m in at.markdown:
        hit = VERDICT.search(m.value)
        if hit:
            sentence = m.value[hit.start():].split(" `python -m kvsim")[0].split(" (The *Your model*")[0]
            assert found.setdefault(hit["subject"], sentence) == sentence, hit["subject"]
    return found


def test_the_curve_view_and_your_model_give_one_answer_naming_what_they_compare():
    """On gemma3-270m-L11 the curve view said "Proxy and truth disagree (+24% KL)" while Your model said "Proxy and
    truth agree": one compared L11's own window at 4096 steps, the other one window for all layers at 1024, unsaid.
    Now both views state the one-window answer from one function (``kvsim.app.truth_panel.model_answer``), word for
    word; the curve view adds its layer's own pick under a headline of its own; and every truth sentence names
    the layers, the window rule, the budget and the steps of both sides."""
    curve = app(trace="gemma3-270m-L11", view="Choosing recent_window", budget="256", policies="h2o")
    # the shipped L11 carries values (issue 34): the value-aware proxy's pick is a replay per window, asked for
    assert "Attention-output error on L11" not in truth_sentences(curve)
    curve.button(key="output_error_button").click().run(timeout=900)
    model = app(view="Your model", budget="256", bundle="gemma3-270m-heapq")
    on_curve, on_model = truth_sentences(curve), truth_sentences(model)
    # the shipped L11 carries values (issue 34), so the value-aware proxy's pick is stated too, under its own name
    value = "Attention-output error on L11"
    assert set(on_curve) == {"One window for all layers", "L11's own window", value}, on_curve
    assert set(on_model) == {"One window for all layers"}, on_model
    assert on_curve["One window for all layers"] == on_model["One window for all layers"]
    for sentence in [*on_curve.values(), *on_model.values()]:
        assert "every layer's cache held to budget 256 by h2o" in sentence  # the truth's layers and budget
        assert re.search(r"\(1024 steps of heapq\.py, open loop, \d+ windows measured\)", sentence)  # its steps
        # the proxy's window rule
        assert ("the least error at the truth's windows" if sentence is on_curve[value] else "within 0.005 of") in sentence
    assert "of L11 alone over its 4096 steps" in on_curve["L11's own window"]
    assert "Attention-output error of L11 alone over its 4096 steps" in on_curve[value]
    assert "averaged over the 18 layers of gemma3-270m-heapq (1024 steps" in on_curve["One window for all layers"]


@pytest.mark.parametrize("budget", [256, 64, 128])
def test_proxy_against_truth_follows_the_sidebars_budget_or_says_why_in_its_headline(budget):
    """It showed budget 64 at 256 steps under the sidebar's 256, said only in a footer. Now it shows what is
    measured at the sidebar's budget (256: the truth's sweep; 64: the shipped quality runs) and says so first;
    where nothing is (128), its headline, above the figures, says so and which budget it shows instead."""
    at = app(view="Proxy against truth", budget=str(budget))
    (table,) = [d.value for d in at.dataframe]
    shown = set(table["budget"])
    if budget == 128:
        assert shown == {64}
        (warning,) = at.warning
        assert warning.value.startswith("**Budget 64 shown, not the sidebar's 128:**") and "--budget 128" in warning.value
    else:
        assert shown == {budget} and not at.warning
        assert at.markdown[0].value.startswith(f"**At budget {budget}, the sidebar's:**")
    steps = {256: "1024 steps", 64: "256 steps", 128: "256 steps"}[budget]
    headline = at.warning[0].value if budget == 128 else at.markdown[0].value
    assert steps in headline

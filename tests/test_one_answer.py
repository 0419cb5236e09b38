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

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

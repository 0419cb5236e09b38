"""The kept view's and the curve's panels are laid out by hand (``kvsim.views.figures.common.subplots``),
not by Plotly's ``make_subplots`` (slow the first time per grid): the figure must come out the same, axis
for axis, domain for domain, title for title."""

import plotly.graph_objects as go
import pytest
from plotly.subplots import make_subplots

from kvsim.views.figures.common import subplots

GRIDS = [
    dict(rows=1, cols=1, horizontal_spacing=0.025, vertical_spacing=0.0),
    dict(rows=1, cols=3, horizontal_spacing=0.025, vertical_spacing=0.0),
    dict(rows=2, cols=3, horizontal_spacing=0.025, vertical_spacing=0.2),
    dict(rows=3, cols=3, horizontal_spacing=0.025, vertical_spacing=0.17),
    dict(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08),
    dict(rows=3, cols=2, shared_xaxes=True, horizontal_spacing=0.1, vertical_spacing=0.05),
]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g['rows']}x{g['cols']}{'-shared' * g.get('shared_xaxes', False)}")
def test_frame_is_make_subplots(grid):
    titles = [f"<b>panel {i}</b><br>mass 0.{i}" for i in range(grid["rows"] * grid["cols"])]
    want = make_subplots(subplot_titles=titles, **grid).to_dict()
    assert go.Figure(subplots(titles, **grid), _validate=False).to_dict() == want


def test_frames_are_fresh():
    a = subplots(["a"], rows=1, cols=1)
    a["layout"]["xaxis"]["range"] = [0, 1]
    assert "range" not in subplots(["a"], rows=1, cols=1)["layout"]["xaxis"]

"""What a reader chose on a figure, read from a Plotly selection event (Streamlit's ``on_select``
state, a plain dict): a box drawn on the kept view (``selected_region``) or a point chosen on the
recent_window curve (``selected_recent_window``). Pure functions, no Streamlit: the app passes the
event in and gets a value or None back.

``Region`` lives here, not with the kept view's figures, because it is what a box selects; the
kept view and its pooling take one to say which part of the run they draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    """The part of the kept image a figure shows: positions ``p0 .. p1``, decode steps ``t0 .. t1``."""

    p0: int
    p1: int
    t0: int
    t1: int

    @classmethod
    def whole(cls, steps: int) -> Region:
        return cls(0, steps, 1, steps)

    def clip(self, steps: int) -> Region:
        p0 = min(max(0, int(self.p0)), steps)
        t0 = min(max(1, int(self.t0)), steps)
        return Region(p0, min(max(p0, int(self.p1)), steps), t0, min(max(t0, int(self.t1)), steps))

    @property
    def width(self) -> int:
        return self.p1 - self.p0 + 1

    @property
    def height(self) -> int:
        return self.t1 - self.t0 + 1


def selected_region(selection, steps: int) -> Region | None:
    """The region of the first box drawn on ``kept_heatmap`` in a Plotly selection event
    (Streamlit's ``on_select`` state), clipped to the run; None when no box was drawn."""
    try:
        box = selection["selection"]["box"][0]
        x0, x1 = sorted(float(v) for v in box["x"][:2])
        y0, y1 = sorted(float(v) for v in box["y"][:2])
    except (KeyError, TypeError, IndexError, ValueError):
        return None
    region = Region(math.floor(x0 + 0.5), math.floor(x1 + 0.5), math.floor(y0 + 0.5), math.floor(y1 + 0.5)).clip(steps)
    return region if region.width > 1 and region.height > 1 else None


def selected_recent_window(selection) -> int | None:
    """The recent_window of the first chosen point of ``recent_window_curve`` in a Plotly selection
    event (Streamlit's ``on_select`` state), or None when no curve point was chosen."""
    try:
        points = selection["selection"]["points"]
    except (KeyError, TypeError):
        return None
    for p in points or []:
        value = p.get("customdata", p.get("x"))
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
            return int(value)
    return None


"""What the figures share: the colours of the kinds of position, a replay's label, and the subplots'
frame."""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence

import plotly.io as pio
from plotly.subplots import make_subplots

from ...sim.harness import ReplayResult

#: the kinds of position, one colour each wherever they are drawn
SINK_COLOUR = "rgba(31, 119, 180, 0.9)"
BAND_COLOUR = "rgba(255, 127, 14, 0.9)"
HEAVY_COLOUR = "rgba(214, 39, 40, 0.85)"
STALE_COLOUR = "rgba(148, 103, 189, 0.9)"
RECENT_COLOUR = "rgba(44, 160, 44, 0.9)"
OTHER_COLOUR = "rgba(127, 127, 127, 0.75)"
CURRENT_COLOUR = "#d62728"


def policy_label(result: ReplayResult) -> str:
    """``h2o (recent_window=32)``: the name plus the parameters that made this run; under a serving layout
    (``kvsim.policykit.layouts``) its constraints too, ``h2o (recent_window=32, block_size=16)``."""
    parts = _label_parts(result)
    return f"{result.policy} ({', '.join(parts)})" if parts else result.policy


def _label_parts(result: ReplayResult) -> list[str]:
    """The parameters, then the layout's constraints (none without one: today's labels)."""
    parts = [f"{k}={v}" for k, v in result.params.items() if isinstance(v, (int, float, str))]
    layout = getattr(result, "layout", None)
    return parts + ([] if layout is None or layout.plain else layout.label.split())


def panel_label(result: ReplayResult, width: int = 34) -> str:
    """``policy_label`` for a narrow panel's title: on one line when it fits ``width`` characters, else the
    name in bold and the parameters (and layout) below it in smaller type, broken between parameters
    (expected_attention's four ran across its neighbour's title)."""
    label = policy_label(result)
    if len(label) <= width:
        return f"<b>{label}</b>"
    lines, line = [], ""
    for part in _label_parts(result):
        if line and len(line) + len(part) + 2 > width:
            lines.append(line + ",")
            line = part
        else:
            line = f"{line}, {part}" if line else part
    lines.append(line)
    return f"<b>{result.policy}</b><br><span style='font-size:11px'>{'<br>'.join(lines)}</span>"


def log_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """The ticks of a log scale spanning 10**lo .. 10**hi (``lo``, ``hi`` in log10 units): their
    places in log10 units and their labels, one format for every log axis and colour bar ("1e-4",
    "5e-4"); left to Plotly, one chart labelled the same scale "100µ" and the next "1e-4". Every decade
    inside the span; where fewer than two fit, the 2s and 5s between them too."""
    decades = [k for k in range(math.floor(lo), math.ceil(hi) + 1) if lo - 1e-9 <= k <= hi + 1e-9]
    mantissas = (1,) if len(decades) >= 2 else (1, 2, 5)
    ticks = sorted((k + math.log10(m), f"{m}e{k}") for k in range(math.floor(lo), math.ceil(hi) + 1) for m in mantissas)
    ticks = [(at, text) for at, text in ticks if lo - 1e-9 <= at <= hi + 1e-9]
    return [at for at, _ in ticks], [text for _, text in ticks]


def subplots(titles: Sequence[str], **grid) -> dict:
    """``make_subplots(subplot_titles=titles, **grid)`` as a figure's dict, a fresh copy to draw on.
    ``make_subplots`` validates every property it sets (30-50 ms a figure, a fifth of the curve's
    time and of a new kept figure's), so the frame is made once per grid, number of titles and
    default template (Streamlit sets its own on import), and the titles, which alone vary, are
    written into it."""
    frame = copy.deepcopy(_subplots(len(titles), tuple(sorted(grid.items())), str(pio.templates.default)))
    for note, title in zip(frame["layout"]["annotations"], titles, strict=True):
        note["text"] = title
    return frame


@functools.cache
def _subplots(titles: int, grid: tuple, template: str) -> dict:
    return make_subplots(subplot_titles=[f"title {i}" for i in range(titles)], **dict(grid)).to_dict()

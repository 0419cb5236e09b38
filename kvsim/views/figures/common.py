"""What the figures share: the colours of the kinds of position, a replay's label, and the subplots'
frame."""

from __future__ import annotations

import math
from collections.abc import Sequence

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


def subplots(titles: Sequence[str], *, rows: int, cols: int, horizontal_spacing: float = 0.0,
             vertical_spacing: float = 0.0, shared_xaxes: bool = False) -> dict:
    """``make_subplots(subplot_titles=titles, ...)``'s figure as a dict (the same axes, domains and
    titles, to the last bit; the template is added by ``go.Figure``), a fresh one to draw on, built by
    hand: ``make_subplots`` validates every property it sets, and the first frame of each grid in a
    server took it 0.07 s (the six-policy grid) to 0.25 s (the curve's two panels) of the view's first
    visit (``python kvsim/bench/scripts/step_costs.py --server curve1024``). Cells from the top left,
    row by row; ``shared_xaxes``: every panel's x axis matches its column's lowest, whose tick labels
    alone are shown. The spacings are given (no space between the panels where not; Plotly's defaults
    differ)."""
    h, v = horizontal_spacing, vertical_spacing
    widths = [(1.0 - h * (cols - 1)) / cols] * cols
    heights = [(1.0 - v * (rows - 1)) / rows] * rows
    layout: dict = {}
    notes = []
    for r in range(rows):
        up = rows - 1 - r  # rows counted from the bottom, as Plotly lays them out
        y0 = sum(heights[:up]) + up * v
        y_domain = [min(max(y0, 0.0), 1.0), min(max(y0 + heights[-1 - r], 0.0), 1.0)]
        for c in range(cols):
            x0 = sum(widths[:c]) + c * h
            x_domain = [x0, x0 + widths[c]]
            n = "" if r * cols + c == 0 else r * cols + c + 1
            layout[f"xaxis{n}"] = {"anchor": f"y{n}", "domain": x_domain}
            layout[f"yaxis{n}"] = {"anchor": f"x{n}", "domain": y_domain}
            notes.append((sum(x_domain) / 2.0, y_domain[1]))
    if shared_xaxes and rows > 1:
        for r in range(rows - 1):
            for c in range(cols):
                n = "" if r * cols + c == 0 else r * cols + c + 1
                layout[f"xaxis{n}"].update(matches=f"x{(rows - 1) * cols + c + 1}", showticklabels=False)
    layout["annotations"] = [
        {"font": {"size": 16}, "showarrow": False, "text": title, "x": x, "xanchor": "center", "xref": "paper", "y": y,
         "yanchor": "bottom", "yref": "paper"}
        for title, (x, y) in zip(titles, notes, strict=False)
    ]
    return {"data": [], "layout": layout}

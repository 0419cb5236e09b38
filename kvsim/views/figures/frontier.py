"""Memory against the truth: each (policy, allocator) cell's KL (open loop) at the positions it holds in
all, the Pareto-best cells marked (no other cell reaches a lower KL with as few positions or fewer).
Only measured cells are drawn; the caller says which are not and how to measure them."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from ...policies import POLICIES

#: one marker per allocator (colour is the policy's own, ``Display.colour``)
SYMBOLS = {"uniform": "circle", "pyramidkv": "triangle-up", "cake": "square", "optimal": "diamond"}


def pareto(points: list[dict], y: str = "kl") -> list[dict]:
    """The Pareto-best points by (``positions``, ``y``), both lower is better: a point is kept when no other
    has at most its positions and a lower ``y``, or fewer positions and the same ``y``. Sorted by positions."""
    best, out = float("inf"), []
    for p in sorted(points, key=lambda p: (p["positions"], p[y])):
        if p[y] < best:
            out.append(p)
            best = p[y]
    return out


def frontier_figure(points: list[dict], *, title: str = "", y: str = "kl", y_title: str = "KL (full || evicted), nats",
                    ticks: dict[int, str] | None = None) -> go.Figure:
    """``points``: dicts with ``policy``, ``allocate``, ``budget``, ``positions`` and ``y`` (and ``delta_nll``,
    ``retained_mass`` for the hover). One marker per cell, the policy's colour, the allocator's symbol; a
    line per (policy, allocator) across budgets; the Pareto frontier as a step line with ringed markers.
    ``ticks``: {positions: label} for the memory axis (the grid's budgets), all shown whether measured or not."""
    fig = go.Figure()
    keys = sorted({(p["policy"], p["allocate"]) for p in points},
                  key=lambda k: (list(POLICIES).index(k[0]) if k[0] in POLICIES else 99, list(SYMBOLS).index(k[1])
                                 if k[1] in SYMBOLS else 99))
    for policy, allocate in keys:
        mine = sorted((p for p in points if (p["policy"], p["allocate"]) == (policy, allocate)), key=lambda p: p["positions"])
        colour = POLICIES[policy].display.colour if policy in POLICIES else "#444444"
        fig.add_trace(go.Scatter(
            x=[p["positions"] for p in mine], y=[p[y] for p in mine], mode="lines+markers", name=f"{policy}, {allocate}",
            line={"color": colour, "width": 1, "dash": "dot" if allocate != "uniform" else "solid"},
            marker={"symbol": SYMBOLS.get(allocate, "x"), "size": 9, "color": colour},
            customdata=[[p["budget"], p.get("delta_nll", float("nan")), p.get("retained_mass", float("nan"))] for p in mine],
            hovertemplate=(f"{policy}, {allocate}<br>%{{x}} positions (budget %{{customdata[0]}} per head on average)"
                           f"<br>{y}: %{{y:.4f}}<br>delta NLL %{{customdata[1]:.4f}}, retained mass %{{customdata[2]:.4f}}"
                           "<extra></extra>")))
    best = pareto(points, y)
    if best:
        xs, ys = [], []
        for p in best:  # a step: each frontier point holds until the next one lowers the figure
            if xs:
                xs.append(p["positions"])
                ys.append(ys[-1])
            xs.append(p["positions"])
            ys.append(p[y])
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="Pareto frontier", line={"color": "#222222", "width": 2},
                                 hoverinfo="skip"))
        fig.add_trace(go.Scatter(
            x=[p["positions"] for p in best], y=[p[y] for p in best], mode="markers+text", name="Pareto-best",
            marker={"symbol": "circle-open", "size": 20, "line": {"width": 2.5, "color": "#222222"}, "color": "#222222"},
            text=[f"{p['policy']}, {p['allocate']}" for p in best], textposition="top right", textfont={"size": 11},
            hoverinfo="skip"))
    fig.update_xaxes(title_text="memory: positions held in all (budget x layers x KV heads)", type="log")
    if ticks:
        lo, hi = min(ticks), max(ticks)
        fig.update_xaxes(tickvals=list(ticks), ticktext=list(ticks.values()),
                         range=[math.log10(lo) - 0.12, math.log10(hi) + 0.12])
    fig.update_yaxes(title_text=y_title, rangemode="tozero")
    fig.update_layout(title={"text": title}, template="plotly_white", height=520,
                      legend={"orientation": "v", "x": 1.02, "y": 1}, margin={"l": 70, "r": 20, "t": 60, "b": 60})
    return fig


__all__ = ["SYMBOLS", "frontier_figure", "pareto"]

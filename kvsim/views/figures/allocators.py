"""The allocation view's figures: each allocator's budget grid (layer x KV head) as a picture on one
colour scale, and the bundle's mean retained mass each reaches at the same memory with the share of the
uniform-to-optimum gap it closes (``kvsim.analysis.allocation.compare``'s rows)."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots


def budget_grids(rows: list[dict], *, title: str = "") -> go.Figure:
    """One heatmap per allocator: layers down (layer 0 at the top), KV heads across, colour the budget
    (one scale for all, so a darker cell is fewer positions whichever panel it is in). adakv's panel
    shows each head's share of its layer's pool (the pool is shared while it replays)."""
    grids = [r["measured"].allocation.grid() for r in rows]
    lo = min(float(np.nanmin(g)) for _, _, g in grids)
    hi = max(float(np.nanmax(g)) for _, _, g in grids)
    names = [_panel_title(r) for r in rows]
    fig = make_subplots(rows=1, cols=len(rows), subplot_titles=names, shared_yaxes=True, horizontal_spacing=0.02)
    for i, (layers, kv, g) in enumerate(grids):
        fig.add_trace(go.Heatmap(
            z=g.astype(np.float32), x=[f"H{h}" for h in kv], y=[f"L{x:02d}" for x in layers], zmin=lo, zmax=hi,
            colorscale="Viridis", showscale=i == len(grids) - 1, colorbar={"title": {"text": "budget"}},
            hovertemplate=f"{rows[i]['allocator']}: %{{y}} %{{x}}, budget %{{z:.0f}}<extra></extra>",
        ), row=1, col=i + 1)
    fig.update_yaxes(autorange="reversed")
    fig.update_yaxes(title_text="layer", row=1, col=1)
    # the panels' three-line titles sit between the figure's title and the grids
    fig.update_layout(title={"text": title, "y": 0.99, "yanchor": "top"}, template="plotly_white",
                      height=max(360, 150 + 18 * len(grids[0][0])), margin={"l": 60, "r": 20, "t": 120, "b": 40})
    for a in fig.layout.annotations:
        a.font = {"size": 11}
    return fig


def _panel_title(row: dict) -> str:
    gap = row["gap_closed"]
    closed = "" if gap is None else f"<br>{100 * gap:.0f}% of the gap"
    return f"{row['allocator']}<br>{row['retained_mass']:.4f}{closed}"


def mass_bars(rows: list[dict], *, title: str = "") -> go.Figure:
    """The bundle's mean retained mass of each allocator at the same memory, uniform's and the optimum's
    marked as lines, each bar labelled with the share of the gap from uniform to the optimum it closes."""
    names = [r["allocator"] for r in rows]
    mass = np.asarray([r["retained_mass"] for r in rows], dtype=np.float64)
    text = [f"{m:.4f}" + ("" if r["gap_closed"] is None else f" ({100 * r['gap_closed']:.0f}% of the gap)")
            for m, r in zip(mass, rows, strict=True)]
    fig = go.Figure(go.Bar(x=names, y=mass, text=text, textposition="outside", marker={"color": "#4c78a8"},
                           hovertemplate="%{x}: retained mass %{y:.4f}<extra></extra>", cliponaxis=False))
    by = dict(zip(names, mass, strict=True))
    for name, dash in (("uniform", "dot"), ("optimal", "dash")):
        if name in by:
            fig.add_hline(y=by[name], line={"dash": dash, "color": "#e8112d", "width": 1.2},
                          annotation={"text": name, "font": {"color": "#e8112d"}}, annotation_position="right")
    span = float(mass.max() - mass.min()) or 0.01
    fig.update_yaxes(title_text="bundle mean retained mass", range=[float(mass.min()) - 0.6 * span,
                                                                   float(mass.max()) + 0.5 * span])
    fig.update_layout(title=title, template="plotly_white", height=380, margin={"l": 60, "r": 80, "t": 60, "b": 40})
    return fig


__all__ = ["budget_grids", "mass_bars"]

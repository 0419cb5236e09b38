"""The allocation view's figures: each allocator's budget grid (layer x KV head) as a picture on one
colour scale, and the bundle's mean retained mass each reaches at the same memory against uniform's, in
words ("worse than uniform by 0.0213") and as zero-based bars (``kvsim.allocation.allocators.compare``'s rows)."""

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
    names = [_panel_title(r, _uniform(rows)) for r in rows]
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
                      height=max(410, 200 + 18 * len(grids[0][0])), margin={"l": 60, "r": 20, "t": 170, "b": 40})
    for a in fig.layout.annotations:  # the panels' titles: read at a glance, as large as the axes' labels
        a.font = {"size": 14}
    return fig


def against_uniform(row: dict, uniform: float | None) -> str:
    """An allocator's mass against uniform's at the same memory, in words a user reads: "worse than uniform
    by 0.0213", "better than uniform by 0.0040, 45% of the way to the optimum", "the baseline"."""
    if row["allocator"] == "uniform" or uniform is None:
        return "the baseline" if row["allocator"] == "uniform" else ""
    d = row["retained_mass"] - uniform
    if round(abs(d), 4) == 0:
        return "level with uniform"
    words = f"{'better' if d > 0 else 'worse'} than uniform by {abs(d):.4f}"
    gap = row["gap_closed"]
    if row["allocator"] == "optimal":
        return f"the optimum: {words}"
    if d > 0 and gap is not None:
        return f"{words}, {100 * gap:.0f}% of the way to the optimum"
    return words


def _uniform(rows: list[dict]) -> float | None:
    return next((r["retained_mass"] for r in rows if r["allocator"] == "uniform"), None)


def _panel_title(row: dict, uniform: float | None = None) -> str:
    # a panel is narrow: the reading broken after its comma and colon, and before "by" (at 1280 x 800 four
    # panels are about 190 px each, and "worse than uniform by 0.0171" ran into its neighbour's title)
    said = _wrapped(against_uniform(row, uniform), before=(" by ", " to the optimum"))
    return f"<b>{row['allocator']}</b><br>mass {row['retained_mass']:.4f}" + "".join(f"<br>{part}" for part in said)


#: a mass better than uniform's, and one worse
BETTER, WORSE = "#4c78a8", "#e45756"


def mass_bars(rows: list[dict], *, title: str = "") -> go.Figure:
    """Each allocator's bundle mean retained mass at the same memory, drawn as its difference from
    uniform's: a bar from zero (uniform) up where it keeps more, down where it keeps less, so a bar's
    length is the message on a zero-based axis (the masses themselves differ in the third decimal, and
    bars of them from a cut axis magnified that). The optimum's difference is marked as a line; each bar
    is labelled with its mass and its reading. Without uniform the masses are drawn from zero."""
    names = [r["allocator"] for r in rows]
    mass = np.asarray([r["retained_mass"] for r in rows], dtype=np.float64)
    base = _uniform(rows)
    y = mass - (base if base is not None else 0.0)
    # the mass on the bar, the reading under it (a bar is too narrow for a sentence: plotly would shrink it)
    ticks = [f"<b>{r['allocator']}</b>" + "".join(f"<br>{part}" for part in _wrapped(against_uniform(r, base)))
             for r in rows]
    colours = [WORSE if d < 0 else BETTER for d in y]
    fig = go.Figure(go.Bar(x=names, y=y, text=[f"{m:.4f}" for m in mass], textposition="outside", constraintext="none",
                           textfont={"size": 13}, marker={"color": colours}, customdata=mass, cliponaxis=False,
                           hovertemplate="%{x}: retained mass %{customdata:.4f} (%{y:+.4f} against uniform)<extra></extra>"))
    if base is not None:
        fig.add_hline(y=0, line={"color": "black", "width": 1.2},
                      annotation={"text": f"uniform {base:.4f}"}, annotation_position="right")
        if "optimal" in names:
            fig.add_hline(y=float(y[names.index("optimal")]), line={"dash": "dash", "color": "#e8112d", "width": 1.2},
                          annotation={"text": "optimal", "font": {"color": "#e8112d"}}, annotation_position="right")
    low, high = min(0.0, float(y.min())), max(0.0, float(y.max()))
    pad = 0.25 * ((high - low) or 0.01)
    axis = ("retained mass minus uniform's" if base is not None else "bundle mean retained mass")
    fig.update_yaxes(title_text=axis, range=[low - pad, high + pad], zeroline=True, tickformat="+.3f" if base is not None else None)
    fig.update_xaxes(tickvals=names, ticktext=ticks)
    fig.update_layout(title=title, template="plotly_white", height=440, margin={"l": 70, "r": 110, "t": 60, "b": 90},
                      font={"size": 13})
    return fig


def _wrapped(words: str, before: tuple[str, ...] = ()) -> list[str]:
    """A reading in the lines of a tick label: broken after its comma and colon, and before each of ``before``."""
    words = words.replace(": ", ":|").replace(", ", ",|")
    for b in before:
        words = words.replace(b, "|" + b.lstrip())
    return [part.strip() for part in words.split("|") if part.strip()]


__all__ = ["against_uniform", "budget_grids", "mass_bars"]

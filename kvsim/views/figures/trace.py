"""The trace view: the attention matrix itself, log-scaled and block-averaged, with its sinks, band
and heavy hitters pointed at."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.colors import hex_to_rgb, sequential

from ...analysis.features import TraceFeatures
from ...data.derived import block_means
from ...data.trace import Trace
from .common import HEAVY_COLOUR, log_ticks


def _lut(scale: Sequence[str]) -> np.ndarray:
    """A 256-entry uint8 RGB lookup table interpolated along a Plotly hex colour scale."""
    stops = np.array([hex_to_rgb(c) for c in scale], dtype=np.float64)
    at = np.linspace(0, 1, len(stops))
    u = np.linspace(0, 1, 256)
    return np.stack([np.interp(u, at, stops[:, k]) for k in range(3)], axis=1).round().astype(np.uint8)


def attention_image(attention: np.ndarray, size: int = 1024) -> tuple[np.ndarray, int, tuple[float, float]]:
    """Block-average the trace's rows 1..T over positions 0..T-1 into at most ``size`` x ``size``
    blocks, take log10 and colour it (Viridis). Returns ``(rgb uint8 (n, n, 3), block, (lo, hi))``
    with lo/hi the log10 range the colours span. Cells with no attention (the future) are white."""
    means, block = block_means(attention, size)
    rgb, span = coloured(means)
    return rgb, block, span


def trace_image(trace: Trace, size: int = 1024) -> tuple[np.ndarray, int, tuple[float, float]]:
    """``attention_image`` of the trace's matrix, or, for a trace too long for it, of the block sums
    one pass over its rows kept (``kvsim.data.row_stats``, at its own size)."""
    means, block = trace.derived.whole(lambda A: block_means(A, size), lambda stats: (stats.block_means(), stats.image_block))
    rgb, span = coloured(means)
    return rgb, block, span


def coloured(means: np.ndarray) -> tuple[np.ndarray, tuple[float, float]]:
    """``(rgb, (lo, hi))``: the block means in log10, coloured; cells with no attention white."""
    positive = means > 0
    logs = np.full(means.shape, np.nan)
    np.log10(means, out=logs, where=positive)
    vals = logs[positive]
    lo = float(np.percentile(vals, 1)) if vals.size else 0.0
    hi = float(vals.max()) if vals.size else 1.0
    if hi <= lo:
        hi = lo + 1.0
    idx = np.clip((np.nan_to_num(logs, nan=lo) - lo) / (hi - lo) * 255, 0, 255).astype(np.uint8)
    rgb = _lut(sequential.Viridis)[idx]
    rgb[~positive] = 255
    return rgb, (lo, hi)


def heavy_marks_drawn(features: TraceFeatures) -> list[list[int]]:
    """The heavy hitters as the trace view draws them: one triangle per group of neighbours closer than
    a triangle's width (``kvsim.views.figures.kept.heavy_marks`` over the whole run), so the figure and
    its text count the same marks (the canonical trace's 24 heavy hitters are 8 triangles)."""
    from .kept import heavy_marks

    return heavy_marks([p for p, _, _ in features.heavy], features.steps)


def trace_matrix(trace: Trace, features: TraceFeatures, size: int = 1024) -> go.Figure:
    """The attention matrix, log-scaled and block-averaged to at most ``size`` x ``size``, with the
    sinks and heavy hitters pointed at from the top edge (the stripes themselves are the data)."""
    rgb, block, (lo, hi) = trace_image(trace, size)
    import plotly.express as px  # here only: the kept view, the first page, never needs it

    fig = px.imshow(rgb, binary_string=True)
    centre = (block - 1) / 2
    fig.update_traces(
        x0=centre, dx=block, y0=1 + centre, dy=block,
        hovertemplate="positions from %{x:.0f}<br>steps from %{y:.0f}<extra>" + f"{block} x {block} block</extra>",
    )
    T = trace.steps
    marks = heavy_marks_drawn(features)
    if marks:
        born = {p: first for p, first, _ in features.heavy}
        fig.add_trace(
            go.Scatter(
                x=[group[0] for group in marks], y=[min(born[p] for p in group) for group in marks],
                mode="markers+text", name="heavy hitter (born here; ×n: n neighbours)",
                # the count on the white of the future, right of the diagonal, where it reads
                text=[f"×{len(group)}" if len(group) > 1 else "" for group in marks], textposition="middle right",
                textfont=dict(size=12, color="#b01e1e"),
                customdata=[", ".join(map(str, group)) for group in marks],
                marker=dict(symbol="triangle-left", size=9, color=HEAVY_COLOUR),
                cliponaxis=False,  # the first, born in the top rows, was cut in half by the plot's edge, its ×3 too
                hovertemplate="heavy hitters at positions %{customdata}<extra></extra>",
            )
        )
    note = dict(showarrow=True, arrowhead=2, bgcolor="rgba(255,255,255,0.85)", font=dict(size=12, color="#222"))
    if features.sinks:
        where = "position 0" if features.sinks == 1 else f"positions 0-{features.sinks - 1}"
        fig.add_annotation(x=0, y=0.8 * T, ax=60, ay=0, text=f"sinks ({where})", **note)
    if features.band_known:
        fig.add_annotation(
            x=0.45 * T, y=0.45 * T + features.band / 2, ax=70, ay=-30, text=f"recency band ({features.band})", **note
        )
    # a colour bar for the image, carried by an invisible marker
    fig.add_trace(
        go.Scatter(
            x=[0, 0], y=[1, 1], mode="markers", showlegend=False, hoverinfo="skip",
            marker=dict(
                color=[lo, hi], colorscale="Viridis", showscale=True, opacity=0, size=1,
                colorbar=dict(title=dict(text="attention<br>(log)"), thickness=12, len=0.8,
                              tickvals=log_ticks(lo, hi)[0], ticktext=log_ticks(lo, hi)[1]),
            ),
        )
    )
    fig.update_xaxes(title_text="position", range=[-0.5, T + 0.5])
    fig.update_yaxes(title_text="decode step", range=[T + 0.5, 0.5])
    fig.update_layout(
        height=720, margin=dict(l=60, r=20, t=30, b=40), legend=dict(orientation="h", yanchor="top", y=-0.08, x=0)
    )
    return fig

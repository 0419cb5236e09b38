"""Pure figure functions for a recorded model (a bundle) tuned by ``kvsim.analysis.tune``: results in, Plotly
figures out, no I/O, so they are tested without a browser and the app only lays them out.

- ``tune_heatmap``: layer (and KV head) x recent_window, coloured by retained mass, each row's
  recommended window marked (and the best, and the one window recommended for the whole model);
- ``tune_curve``: one trace's curve over recent_window with its best and recommended windows and the
  baselines, for the row the user picks.

The matrices go to Plotly as float32 arrays (typed arrays in the figure's JSON), never as lists.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ..analysis.tune import TuneResult
from ..policykit.base import WINDOW
from .figures.curve import style_of


def _labels(result: TuneResult) -> list[str]:
    """``L05`` when every layer has one KV head, else ``L05H1``."""
    per_layer = {}
    for t in result.traces:
        per_layer[t.layer] = per_layer.get(t.layer, 0) + 1
    one = all(c == 1 for c in per_layer.values())
    return [f"L{t.layer:02d}" if one else t.label for t in result.traces]


def tune_heatmap(result: TuneResult, *, height: int | None = None) -> go.Figure:
    """Retained mass of every (layer, KV head) at every recent_window, one row per trace (layer 0 at
    the top), with the recommended window of each row marked by a circle, its best by a cross, and
    the window recommended for all layers at once as a dashed line."""
    z = result.mass_matrix().astype(np.float32)
    labels = _labels(result)
    windows = np.asarray(result.windows, dtype=np.int32)
    rows = np.arange(len(labels), dtype=np.int32)
    rec = np.asarray([t.recommended_window for t in result.traces], dtype=np.int32)
    best = np.asarray([t.best_window for t in result.traces], dtype=np.int32)
    kinds = [t.attention for t in result.traces]
    tol = result.tolerance
    fig = go.Figure()
    fig.add_trace(go.Heatmap(
        z=z, x=windows, y=rows, colorscale="Viridis", zmin=float(np.nanmin(z)), zmax=float(np.nanmax(z)),
        colorbar={"title": {"text": "retained mass"}},
        customdata=np.repeat(np.asarray(labels, dtype=object)[:, None], len(windows), axis=1),
        hovertemplate="%{customdata} recent_window %{x}<br>retained mass %{z:.4f}<extra></extra>",
    ))
    fig.add_trace(go.Scatter(
        x=rec, y=rows, mode="markers", name=f"recommended (smallest within {tol} of the best)",
        marker={"symbol": "circle-open", "size": 11, "color": "#e8112d", "line": {"width": 2.5}},
        customdata=np.asarray([t.recommended_mass for t in result.traces], dtype=np.float64),
        text=[f"{label} ({kind})" for label, kind in zip(labels, kinds, strict=True)],
        hovertemplate="%{text}: recommended recent_window %{x}, retained mass %{customdata:.4f}<extra></extra>",
    ))
    fig.add_trace(go.Scatter(
        x=best, y=rows, mode="markers", name="best",
        marker={"symbol": "x-thin", "size": 9, "color": "black", "line": {"width": 2}},
        customdata=np.asarray([t.best_mass for t in result.traces], dtype=np.float64), text=labels,
        hovertemplate="%{text}: best recent_window %{x}, retained mass %{customdata:.4f}<extra></extra>",
    ))
    shared = result.model_wide()["one_window"]["recommended_window"]
    fig.add_vline(x=shared, line={"dash": "dash", "color": "#e8112d", "width": 1.5},
                  annotation={"text": f"one window for all layers: {shared}", "yref": "paper", "y": 1.0,
                              "yanchor": "bottom", "font": {"color": "#e8112d"}},
                  annotation_position="top")
    fig.update_yaxes(title_text="layer" if labels[0].count("H") == 0 else "layer, KV head", tickmode="array",
                     tickvals=rows, ticktext=labels, autorange="reversed")
    fig.update_xaxes(title_text=WINDOW)
    fig.update_layout(
        title=f"{result.policy} on {result.source}, budget {result.budget}: retained mass per layer and recent_window",
        template="plotly_white", height=height or max(320, 60 + 24 * len(labels)),
        legend={"orientation": "h", "y": -0.18, "x": 0.0}, margin={"l": 70, "r": 20, "t": 60, "b": 90},
    )
    return fig


def tune_curve(result: TuneResult, layer: int, head: int = 0) -> go.Figure:
    """One trace's retained mass and top-k recall over recent_window, its best and recommended windows
    marked, sliding_window and streaming_llm at the same budget as horizontal lines."""
    match = [t for t in result.traces if t.layer == layer and t.head == head]
    if not match:
        raise ValueError(f"the tuning has no layer {layer} KV head {head}")
    t = match[0]
    x = np.asarray(result.windows, dtype=np.int32)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=t.retained_mass.astype(np.float32), mode="lines", name="retained mass"))
    fig.add_trace(go.Scatter(x=x, y=t.top_k_recall.astype(np.float32), mode="lines", name=f"top-{result.top_k} recall",
                             line={"dash": "dot"}))
    fig.add_trace(go.Scatter(x=np.asarray([t.recommended_window]), y=np.asarray([t.recommended_mass]), mode="markers",
                             name=f"recommended {t.recommended_window} (the smallest within {result.tolerance:g} of the best)",
                             marker={"symbol": "circle", "size": 11}))
    fig.add_trace(go.Scatter(x=np.asarray([t.best_window]), y=np.asarray([t.best_mass]), mode="markers",
                             name=f"best {t.best_window}", marker={"symbol": "x", "size": 10}))
    # each baseline a line across the chart in its policy's style (the curve view's), named in the
    # legend, not by a label on the line: two baselines close together had their labels on each other
    for policy, (mass, _recall) in t.baselines.items():
        style = style_of(policy)
        line = {"color": style.colour, "dash": style.dash, "width": 2}
        fig.add_hline(y=mass, line=line)
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line=line, name=f"{policy} {mass:.3f}",
                                 hoverinfo="skip"))
    fig.update_xaxes(title_text=WINDOW)
    fig.update_yaxes(title_text="mean over steps")
    fig.update_layout(title=f"{t.name} ({t.attention}): {result.policy} at budget {result.budget}",
                      template="plotly_white", height=460, margin={"l": 60, "r": 20, "t": 60, "b": 110},
                      legend={"orientation": "h", "x": 0.0, "y": -0.2, "yanchor": "top"})
    return fig


__all__ = ["tune_curve", "tune_heatmap"]

"""Figures for the proxy against the truth: pure functions from ``kvsim.models.quality`` results (the dicts of
``python -m kvsim quality --json``) to Plotly figures, so they are tested without a browser.

- ``curve_figure``: delta NLL, KL and retained mass over a swept parameter (recent_window), side by
  side, one line per (budget, mode): does the proxy's curve peak where the loss bottoms out?
- ``scatter_figure``: delta NLL against retained mass across policies and windows, with the Spearman
  rank correlation per mode in the title: does more retained mass mean less loss?
- ``spearman``: the rank correlation itself (numpy only).
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..analysis.windows import spearman
from ..policykit.base import WINDOW
from .figures.curve import style_of

#: one colour per policy, in registry order; modes differ by dash (lines) and symbol (markers)
_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
_DASH = {"closed": "solid", "open": "dash"}
_SYMBOL = {"closed": "circle", "open": "circle-open"}


def _label(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def curve_figure(results: list[dict], param: str = WINDOW, policy: str = "h2o") -> go.Figure:
    """delta NLL, KL and retained mass of ``policy`` over ``param``: one line per (budget, mode)."""
    rows = [r for r in results if r["policy"] == policy and param in r["params"]]
    if not rows:
        raise ValueError(f"no {policy} results with {param} among the {len(results)} given")
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.07,
                        subplot_titles=["delta NLL (nats per token)", "KL(full || evicted)", "retained mass (simulator)"])
    budgets = sorted({r["budget"] for r in rows})
    for bi, budget in enumerate(budgets):
        color = _COLORS[bi % len(_COLORS)]
        for mode in ("closed", "open"):
            line = sorted((r for r in rows if r["budget"] == budget and r["mode"] == mode), key=lambda r: r["params"][param])
            if not line:
                continue
            x = [r["params"][param] for r in line]
            for col, key in enumerate(("delta_nll", "kl", "retained_mass"), start=1):
                fig.add_trace(go.Scatter(
                    x=x, y=[r[key] for r in line], mode="lines+markers", name=f"budget {budget}, {mode}",
                    legendgroup=f"{budget}-{mode}", showlegend=col == 1,
                    line={"color": color, "dash": _DASH[mode]}, marker={"symbol": _SYMBOL[mode]},
                ), row=1, col=col)
    for col in (1, 2, 3):
        fig.update_xaxes(title_text=param, row=1, col=col)
    steps = rows[0]["steps"]
    fig.update_layout(
        title=f"{policy} over {param}: what the model loses (left, middle) beside what the simulator measures "
              f"(right), {steps} steps",
        template="plotly_white", height=420, legend={"orientation": "h", "y": -0.22},
    )
    return fig


def scatter_figure(results: list[dict]) -> go.Figure:
    """delta NLL against retained mass, one marker per result, coloured by policy; the title gives
    the Spearman rank correlation per mode (higher mass should mean lower loss: a good proxy is
    close to -1)."""
    if not results:
        raise ValueError("no results to plot")
    policies = list(dict.fromkeys(r["policy"] for r in results))
    fig = go.Figure()
    for policy in policies:  # each in its own colour, the one every view gives it (held apart: test_views_text.py)
        for mode in ("closed", "open"):
            pts = [r for r in results if r["policy"] == policy and r["mode"] == mode]
            if not pts:
                continue
            fig.add_trace(go.Scatter(
                x=[r["retained_mass"] for r in pts], y=[r["delta_nll"] for r in pts], mode="markers",
                name=f"{policy} ({mode})",
                marker={"color": style_of(policy).colour, "symbol": _SYMBOL[mode], "size": 9},
                text=[f"budget {r['budget']} {_label(r['params'])}" for r in pts],
                hovertemplate="%{text}<br>retained mass %{x:.4f}<br>delta NLL %{y:.4f}<extra></extra>",
            ))
    rhos = []
    for mode in ("closed", "open"):
        pts = [r for r in results if r["mode"] == mode]
        if pts:
            rho = spearman([r["retained_mass"] for r in pts], [r["delta_nll"] for r in pts])
            rhos.append(f"{mode}: rho = {rho:.3f} (n = {len(pts)})" if math.isfinite(rho) else f"{mode}: rho n/a")
    fig.update_layout(
        title="delta NLL against retained mass; Spearman " + "; ".join(rhos),
        xaxis_title="retained mass (simulator, mean over layers and KV heads)",
        yaxis_title="delta NLL (nats per token)", template="plotly_white", height=460,
    )
    return fig


__all__ = ["curve_figure", "scatter_figure", "spearman"]

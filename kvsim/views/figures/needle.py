"""The needle view's figures (``kvsim needle``, docs/needle.md): the accuracy grids side by side, the
control's first, and one trial's kept positions in one layer with the pass key's columns marked and
the step at which each of its tokens left.

A grid's cell is the share of the trials the full cache got right that the policy got right too; where
the control got none right the cell is grey and says so (labelled, not counted).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .curve import style_of
from .pooling import _source

#: the most pixels a trial's kept picture has per side (a 4096-token trial is pooled to it)
TRIAL_PIXELS = 640
KEY_COLOUR = "#d62728"
FAILED_COLOUR = "#bdbdbd"


def _percent(v) -> str:
    return "control fails" if v is None else f"{100 * v:.0f}%"


def needle_heatmaps(doc: dict):
    """One heatmap per grid, the control's first (depth down, length across), in one row: what each
    policy still retrieves, beside what the full cache does; a click on a cell selects its (length, depth)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    grids = [{"label": "full cache (control)", "policy": None, "accuracy": doc["control"]["accuracy"]}, *doc["grids"]]
    fig = make_subplots(rows=1, cols=len(grids), shared_yaxes=True, horizontal_spacing=0.02,
                        subplot_titles=[g["label"] for g in grids])
    lengths = [str(n) for n in doc["lengths"]]
    depths = [f"{d:g}" for d in doc["depths"]]
    control = doc["control"]["accuracy"]
    for i, g in enumerate(grids, start=1):
        z = np.array([[np.nan if v is None else v for v in row] for row in g["accuracy"]], dtype=float)
        text = [[_percent(v) if g["policy"] is not None else f"{100 * v:.0f}%" for v in row] for row in g["accuracy"]]
        failed = np.isnan(z)
        if failed.any():  # a grey layer under the labelled cells
            fig.add_trace(go.Heatmap(z=np.where(failed, 0.0, np.nan), x=lengths, y=depths, showscale=False,
                                     colorscale=[[0, FAILED_COLOUR], [1, FAILED_COLOUR]], hoverinfo="skip", xgap=1, ygap=1),
                          row=1, col=i)
        fig.add_trace(go.Heatmap(z=z, x=lengths, y=depths, zmin=0, zmax=1, colorscale="Viridis", text=text,
                                 texttemplate="%{text}", showscale=i == len(grids), hoverinfo="skip",
                                 colorbar=dict(title="retrieved", tickformat=".0%"), xgap=1, ygap=1, name=g["label"]),
                      row=1, col=i)
        # a heatmap's cells cannot be selected: an invisible marker on each is what a click selects
        xs = [n for _ in depths for n in lengths]
        ys = [d for d in depths for _ in lengths]
        flat = [t for row in text for t in row]
        controls = [_percent(c) for crow in control for c in crow]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", marker=dict(size=28, opacity=0, symbol="square"),
                                 customdata=list(zip(flat, controls, strict=True)), showlegend=False, name="cells",
                                 hovertemplate="depth %{y}, length %{x}: %{customdata[0]} (control %{customdata[1]})"
                                               "<br>click to open this trial<extra></extra>"), row=1, col=i)
        if g["policy"] is not None:
            fig.layout.annotations[i - 1].font = dict(color=style_of(g["policy"]).colour)
        fig.update_xaxes(title_text="prompt length (tokens)", type="category", row=1, col=i)
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_yaxes(title_text="needle depth", row=1, col=1)
    fig.update_layout(height=160 + 34 * len(depths), margin=dict(l=60, r=20, t=50, b=50), clickmode="event+select")
    return fig


def leaderboard_figure(table: dict, *, title: str = ""):
    """A leaderboard table (``kvsim.views.leaderboard``) as one heatmap per column (prompt length, budget):
    a row per policy, the control's first, a cell per depth, coloured by the share of trials it found the
    key in and labelled as docs/needle.md writes it (found, -, a share); grey where not run or not counted."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from ..leaderboard import column_label, word

    names = ["full cache (control)", *table["rows"]]
    lines = [table["control"], *table["rows"].values()]
    depths = [f"depth {d:g}" for d in table["depths"]]
    columns = table["columns"]
    fig = make_subplots(rows=1, cols=len(columns), shared_yaxes=True, horizontal_spacing=0.015,
                        subplot_titles=[column_label(c, table) for c in columns])
    for i in range(len(columns)):
        cells = [line[i] for line in lines]
        z = np.array([[np.nan] * len(depths) if c is None else [np.nan if v is None else v for v in c] for c in cells],
                     dtype=float)
        text = [["not run"] * len(depths) if c is None else [word(v) for v in c] for c in cells]
        grey = np.isnan(z)
        if grey.any():
            fig.add_trace(go.Heatmap(z=np.where(grey, 0.0, np.nan), x=depths, y=names, showscale=False, text=text,
                                     texttemplate="%{text}", colorscale=[[0, FAILED_COLOUR], [1, FAILED_COLOUR]],
                                     hoverinfo="skip", xgap=2, ygap=2), row=1, col=i + 1)
        fig.add_trace(go.Heatmap(z=z, x=depths, y=names, zmin=0, zmax=1, colorscale="Viridis", text=text,
                                 texttemplate="%{text}", showscale=i == len(columns) - 1, xgap=2, ygap=2,
                                 colorbar=dict(title="found", tickformat=".0%"), name=column_label(columns[i], table),
                                 hovertemplate="%{y}, %{x}: %{text}<extra></extra>"), row=1, col=i + 1)
    for a in fig.layout.annotations:
        a.font = dict(size=14)
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category", tickfont=dict(size=11))
    fig.update_layout(title=title or None, height=120 + 26 * len(names), template="plotly_white",
                      margin=dict(l=150, r=20, t=90 if title else 50, b=40))
    return fig


def kept_mask(left: np.ndarray, steps: int) -> np.ndarray:
    """bool ``(steps, steps)``: row t, position p held after step t (``left`` is each position's
    departure step, -1 for held to the end; position p is admitted at step p)."""
    p = np.arange(steps)
    t = p[:, None]
    gone = left[:steps]
    return (p[None, :] <= t) & ((gone[None, :] < 0) | (gone[None, :] > t))


def _pooled(mask: np.ndarray, pixels: int) -> tuple[np.ndarray, int]:
    """The share held per block of ``b x b`` cells, as grey levels (held dark), and ``b``."""
    n = mask.shape[0]
    b = max(1, -(-n // pixels))
    m = -(-n // b) * b
    padded = np.zeros((m, m), dtype=np.float32)
    padded[:n, :n] = mask
    share = padded.reshape(m // b, b, m // b, b).mean(axis=(1, 3))
    return (255 - np.round(share * 200)).astype(np.uint8), b


def trial_kept(left: np.ndarray, key_positions: Sequence[int], prompt_tokens: int, steps: int, *, title: str = ""):
    """One (layer, KV head)'s cache over a trial's ``steps`` positions: steps down, positions across,
    held dark; the key's columns in red, an x where each key token left, and the line where the answer
    starts."""
    import plotly.graph_objects as go

    img, b = _pooled(kept_mask(left, steps), TRIAL_PIXELS)
    fig = go.Figure(go.Image(source=_source(img), x0=0, dx=b, y0=0, dy=b, hoverinfo="skip"))
    keys = list(key_positions)
    for p in keys:
        fig.add_shape(type="rect", x0=p - 0.5, x1=p + 0.5 + max(0, b - 1), y0=0, y1=steps, line_width=0,
                      fillcolor=KEY_COLOUR, opacity=0.35)
    gone = [(p, int(left[p])) for p in keys if left[p] >= 0]
    if gone:
        fig.add_trace(go.Scatter(x=[p for p, _ in gone], y=[s for _, s in gone], mode="markers",
                                 marker=dict(symbol="x", size=10, color=KEY_COLOUR, line=dict(width=2)),
                                 name="key token left", hovertemplate="key token at %{x} left at step %{y}<extra></extra>"))
    stayed = [p for p in keys if left[p] < 0]
    if stayed:
        fig.add_trace(go.Scatter(x=stayed, y=[steps - 1] * len(stayed), mode="markers", name="key token held to the end",
                                 marker=dict(symbol="circle-open", size=9, color=KEY_COLOUR),
                                 hovertemplate="key token at %{x} held to the end<extra></extra>"))
    fig.add_hline(y=prompt_tokens - 1, line=dict(color="#1f77b4", dash="dot", width=1),
                  annotation_text="the answer starts", annotation_position="bottom right")
    fig.update_xaxes(title_text="position", range=[0, steps])
    fig.update_yaxes(title_text="step", range=[steps, 0])
    fig.update_layout(title=title, height=560, margin=dict(l=60, r=20, t=50, b=50), showlegend=True,
                      legend=dict(orientation="h", y=-0.12))
    return fig


def fate_rows(cell: dict) -> list[dict]:
    """Per policy and layer, when the key left that layer's cache (the last of its tokens; each KV
    head), in words: the table beside the trial's picture; with the exact optimum's step where the grid
    measured it (``kvsim needle --optimum``: optimal on the control's attention at the same budgets)."""
    rows = []
    for run in cell["runs"]:
        for layer, heads in enumerate(run["key_left"] or []):
            firsts = (run.get("key_first_left") or [[None] * len(heads)] * (layer + 1))[layer]
            row = {"policy": run["label"], "layer": layer, "answer": run["answer"] or "", "retrieved": run["correct"],
                   "key lost at step": ", ".join("held" if s is None else str(s) for s in heads),
                   "first key token lost at step": ", ".join("none" if s is None else str(s) for s in firsts)}
            if run.get("optimal_key_left") is not None:  # kvsim needle --optimum
                row["exact optimum: key lost at step"] = ", ".join("held" if s is None else str(s)
                                                                   for s in run["optimal_key_left"][layer])
            rows.append(row)
    return rows


__all__ = ["fate_rows", "kept_mask", "leaderboard_figure", "needle_heatmaps", "trial_kept"]

"""The score view: the cache at one step just before eviction, each held position's score by
position and the scores' distribution, stacked by kind of position, with the eviction threshold."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...analysis.features import TraceFeatures
from ...policies import Display
from ...policykit.base import WINDOW
from ...policykit.registry import display_of
from ...sim.harness import ReplayResult
from .common import HEAVY_COLOUR, OTHER_COLOUR, RECENT_COLOUR, SINK_COLOUR, STALE_COLOUR, log_ticks, policy_label

if TYPE_CHECKING:  # imported where a snapshot is built: ``import kvsim.views.figures`` stays ~0.3 s lighter
    import pandas as pd

#: the kinds of position the score view tells apart, in legend order ("heavy hitter" alone: a trace
#: that does not say when its heavy hitters go stale)
CATEGORIES = ("sink", "heavy hitter (live)", "heavy hitter (stale)", "heavy hitter", "recent window", "other")
CATEGORY_COLOURS = dict(
    zip(CATEGORIES, (SINK_COLOUR, HEAVY_COLOUR, STALE_COLOUR, HEAVY_COLOUR, RECENT_COLOUR, OTHER_COLOUR), strict=True)
)


def score_snapshot(result: ReplayResult, step: int, features: TraceFeatures) -> pd.DataFrame:
    """The cache at ``step`` just before eviction: one row per held position with its score, its
    category (CATEGORIES) and whether it was evicted at this step."""
    if result.score_history is None or result.score_positions is None:
        raise ValueError(f"{result.policy}: replay has no scores (a score-keeping policy, record_scores=True)")
    if result.kept_history is None:
        raise ValueError(f"{result.policy}: replay was run without record_kept=True")
    T = result.steps
    if not 1 <= step <= T:
        raise ValueError(f"step must be between 1 and {T}, got {step}")
    pos = result.score_positions[step - 1]
    valid = pos >= 0
    pos = pos[valid].astype(np.int64)
    score = result.score_history[step - 1][valid]
    after = result.kept_history[step - 1]
    evicted = ~np.isin(pos, after[after >= 0])
    rw = int(result.params.get(WINDOW, 0) or 0)
    # the newest rw held positions are out of the score's reach (the policy's kept[len - rw:])
    protected = np.zeros(pos.size, dtype=bool)
    if rw > 0:
        protected[max(0, pos.size - rw):] = True
    live = {p for p, first, last in features.heavy if first <= step <= last}
    ever = {p for p, first, _ in features.heavy if first <= step}
    category = np.full(pos.size, "other", dtype=object)
    for i, p in enumerate(pos.tolist()):
        if p < features.sinks:
            category[i] = "sink"
        elif protected[i]:
            category[i] = "recent window"
        elif p in live:
            category[i] = "heavy hitter (live)" if features.live_known else "heavy hitter"
        elif p in ever:
            category[i] = "heavy hitter (stale)"
    import pandas as pd

    return pd.DataFrame({"position": pos, "score": score, "category": category, "evicted": evicted})


def eviction_threshold(snapshot: pd.DataFrame) -> float | None:
    """The largest score evicted at this step: every evictable position scoring at or below it went.
    None when nothing was evicted (the cache was not yet full)."""
    victims = snapshot.loc[snapshot["evicted"], "score"]
    return float(victims.max()) if len(victims) else None


def score_name(policy: str) -> str:
    """What the policy's score counts, for axis titles (its class's ``display``)."""
    display = display_of(policy)
    return display.score_name if display is not None else Display.score_name


#: the panels' height and the room above them (the title, two rows of the key, the panels' titles), in pixels
SCORES_PLOT, SCORES_TOP = 340, 126


def score_distribution(result: ReplayResult, step: int, features: TraceFeatures) -> go.Figure:
    """Left: each held position's cumulative score against its position (log scale). Right: the
    distribution of those scores, stacked by kind. The eviction threshold is marked on both."""
    snap = score_snapshot(result, step, features)
    threshold = eviction_threshold(snap)
    positive = snap["score"][snap["score"] > 0]
    floor = float(positive.min()) / 10 if len(positive) else 1e-6
    shown = snap["score"].clip(lower=floor)
    logs = np.log10(shown)
    fig = make_subplots(
        rows=1, cols=2, column_widths=[0.62, 0.38], horizontal_spacing=0.08,
        subplot_titles=(f"score by position, step {step}", "how the scores are distributed"),
    )
    for cat in CATEGORIES:
        sel = snap["category"] == cat
        if not sel.any():
            continue
        colour = CATEGORY_COLOURS[cat]
        fig.add_trace(
            go.Scatter(
                x=snap["position"][sel], y=shown[sel], mode="markers", name=cat, legendgroup=cat,
                marker=dict(color=colour, size=7, symbol=np.where(snap["evicted"][sel], "x", "circle")),
                customdata=np.stack([snap["score"][sel], snap["evicted"][sel].map({True: "evicted now", False: "kept"})], axis=1),
                hovertemplate="position %{x}<br>score %{customdata[0]:.4g}<br>%{customdata[1]}<extra>" + cat + "</extra>",
            ),
            row=1, col=1,
        )
        fig.add_trace(
            go.Histogram(
                x=logs[sel], name=cat, legendgroup=cat, showlegend=False, marker_color=colour,
                xbins=dict(size=0.1), hovertemplate="log10 score %{x}<br>%{y} positions<extra>" + cat + "</extra>",
            ),
            row=1, col=2,
        )
    victims = snap[snap["evicted"]]
    if len(victims):
        fig.add_trace(
            go.Scatter(
                x=victims["position"], y=shown[snap["evicted"]], mode="markers", name="evicted at this step (ringed ×)",
                marker=dict(color="black", size=13, symbol="circle-x-open", line=dict(width=1.5)),
                hoverinfo="skip",
            ),
            row=1, col=1,
        )
    # a log axis takes its range, and any shape or annotation on it, in log10 units: everything
    # below is placed in those units, from the data, so the axis spans the scores and no more
    y_lo, y_hi = float(logs.min()) - 0.15, float(logs.max()) + 0.25
    if threshold is not None:
        _mark_threshold(fig, snap, threshold, floor, (y_lo, y_hi))
        title = f"{policy_label(result)}: {len(snap)} held before eviction at step {step}, {len(victims)} evicted"
    else:
        title = f"{policy_label(result)}: step {step}, the cache is not full yet, nothing is evicted"
    # both panels show the same scale: the same ticks, labelled alike (``log_ticks``)
    ticks, labels = log_ticks(y_lo, y_hi)
    fig.update_yaxes(type="log", title_text=f"{score_name(result.policy)} (log)", range=[y_lo, y_hi], row=1, col=1,
                     tickvals=[10.0 ** k for k in ticks], ticktext=labels)
    fig.update_xaxes(title_text="position", row=1, col=1)
    fig.update_xaxes(title_text=f"{score_name(result.policy)} (log)", tickvals=ticks, ticktext=labels, row=1, col=2)
    fig.update_yaxes(title_text="positions", row=1, col=2)
    # the key between the title and the panels' titles (under the axis it was below the fold at 1280 x 800):
    # room for two rows of it, growing upwards from just above the panels' titles
    fig.update_layout(
        barmode="stack", height=SCORES_PLOT + SCORES_TOP + 50, title=dict(text=title, x=0, y=1, yref="container",
                                                                          yanchor="top", pad=dict(t=8), font=dict(size=14)),
        margin=dict(l=60, r=20, t=SCORES_TOP, b=50),
        legend=dict(orientation="h", yanchor="bottom", y=1 + 36 / SCORES_PLOT, x=0),
    )
    return fig


#: the score-by-position panel at its narrowest in the app (px; about 580 at 1500 x 1100), and the
#: threshold label's height and its text's width per character (12 px text): where the label may go
PANEL_PX = (480, 340)
LABEL_PX = (18, 7.0)
#: a point's marker radius (px) and the label's margin around it
POINT_PX = 6


def label_spot(x: np.ndarray, y: np.ndarray, level: float, y_range: tuple[float, float], chars: int) -> tuple[float, bool]:
    """Where the threshold's label goes on its line: the x of its centre, and whether above the line
    (else below), chosen so that the label covers no point (``x`` positions, ``y`` log10 scores, on an
    axis spanning ``y_range``); failing that, the fewest, as far from the rest as can be."""
    w_px, h_px = PANEL_PX
    lo, hi = float(x.min()), float(x.max())
    span = max(hi - lo, 1.0)
    # in pixels of the narrowest panel, origin at the line's left end
    px = (x - lo) / span * w_px
    py = (y - level) / max(y_range[1] - y_range[0], 1e-9) * h_px
    half = (LABEL_PX[1] * chars + 8) / 2
    best = None
    for centre in np.linspace(half, max(half, w_px - half), 41)[::-1]:  # rightmost first: beside the newest
        for above in (False, True):
            y0, y1 = (2, 2 + LABEL_PX[0]) if above else (-2 - LABEL_PX[0], -2)
            dx = np.maximum(np.abs(px - centre) - half, 0)
            dy = np.maximum(np.maximum(y0 - py, py - y1), 0)
            gap = np.hypot(dx, dy) - POINT_PX
            key = (int((gap < 0).sum()), -float(gap.min()) if gap.size else 0.0)
            if best is None or key < best[0]:
                best = (key, centre, above)
    _, centre, above = best
    return lo + centre / w_px * span, above


def _mark_threshold(fig: go.Figure, snap: pd.DataFrame, threshold: float, floor: float,
                    y_range: tuple[float, float]) -> None:
    """The eviction threshold: a dashed line across the held positions, labelled where the label
    covers no point (``label_spot``), and down the distribution (at ``floor`` when it is below what
    the log axis shows)."""
    t_shown = max(threshold, floor)
    x0, x1 = float(snap["position"].min()), float(snap["position"].max())
    fig.add_trace(
        go.Scatter(
            x=[x0, x1], y=[t_shown, t_shown], mode="lines", line=dict(color="black", dash="dash", width=1.5),
            name=f"eviction threshold ({threshold:.4g})", hovertemplate=f"eviction threshold {threshold:.4g}<extra></extra>",
        ),
        row=1, col=1,
    )
    text = f"eviction threshold {threshold:.4g}"
    x, above = label_spot(snap["position"].to_numpy(float), np.log10(snap["score"].clip(lower=floor).to_numpy(float)),
                          math.log10(t_shown), y_range, len(text))
    fig.add_annotation(
        x=x, y=math.log10(t_shown), xref="x", yref="y", text=text, showarrow=False, xanchor="center",
        yanchor="bottom" if above else "top", yshift=2 if above else -2, bgcolor="rgba(255,255,255,0.8)",
        font=dict(size=12),
    )
    fig.add_vline(x=math.log10(t_shown), line=dict(color="black", dash="dash"), row=1, col=2)

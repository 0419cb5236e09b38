"""Figure builders for the app: pure functions, replay results and traces in, Plotly figures out.

Nothing here imports Streamlit, so every figure is built and tested without a browser. Images go to
Plotly as uint8 arrays through ``px.imshow(..., binary_string=True)``: the browser receives one PNG
per panel (tens of kilobytes for a 4096 x 4097 kept mask) instead of sixteen million numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.colors import hex_to_rgb, sequential
from plotly.subplots import make_subplots

from .harness import ReplayResult
from .trace import Trace

#: grey levels of the kept-position image: kept cells dark, evicted white, not-yet-generated light
KEPT, EVICTED, FUTURE = 30, 255, 222

SINK_COLOUR = "rgba(31, 119, 180, 0.9)"
BAND_COLOUR = "rgba(255, 127, 14, 0.9)"
HEAVY_COLOUR = "rgba(214, 39, 40, 0.85)"
STALE_COLOUR = "rgba(148, 103, 189, 0.9)"
RECENT_COLOUR = "rgba(44, 160, 44, 0.9)"
OTHER_COLOUR = "rgba(127, 127, 127, 0.75)"
CURRENT_COLOUR = "#d62728"

#: the kinds of position the score view tells apart, in legend order ("heavy hitter" alone: a trace
#: that does not say when its heavy hitters go stale)
CATEGORIES = ("sink", "heavy hitter (live)", "heavy hitter (stale)", "heavy hitter", "recent window", "other")
CATEGORY_COLOURS = dict(
    zip(CATEGORIES, (SINK_COLOUR, HEAVY_COLOUR, STALE_COLOUR, HEAVY_COLOUR, RECENT_COLOUR, OTHER_COLOUR), strict=True)
)


# --------------------------------------------------------------------------------------------
# what a trace is made of


@dataclass(frozen=True)
class TraceFeatures:
    """The structures the figures draw as shapes."""

    steps: int  # T
    sinks: int  # positions 0 .. sinks-1 are attention sinks
    band: int  # the recency band: the newest ``band`` positions of each row
    heavy: tuple  # ((position, first step, last step), ...) of each heavy hitter
    heavy_source: str  # where ``heavy`` came from, said in the page
    live_known: bool = False  # True when the trace says when each heavy hitter goes stale
    band_known: bool = False  # True when the trace says how wide its band is (else ``band`` is assumed)


def trace_features(trace: Trace, *, sinks: int = 4, band: int = 64, n_heavy: int = 8) -> TraceFeatures:
    """Sinks, band and heavy hitters of ``trace``.

    The canonical trace says what it was built from (``meta["config"]``, ``meta["heavy_hitters"]``):
    those are used as they are. Any other trace gets ``sinks`` and ``band`` as given and, for heavy
    hitters, its ``n_heavy`` top cumulative scorers (largest column sums, sinks excluded), shown live
    from their birth to the end.
    """
    T = trace.steps
    meta = trace.meta if isinstance(trace.meta, dict) else {}
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    sinks = _int_or(cfg.get("sinks"), sinks)
    band_known = _int_or(cfg.get("band_width"), None) is not None
    band = _int_or(cfg.get("band_width"), band)
    epoch = _int_or(cfg.get("epoch"), None)
    listed = meta.get("heavy_hitters")
    if isinstance(listed, list) and listed and all(isinstance(p, int) and 0 <= p <= T for p in listed):
        heavy = tuple((p, p + 1, min(T, p + epoch) if epoch else T) for p in sorted(listed))
        source = "here, the ones the trace's metadata lists"
        live_known = epoch is not None
    else:
        col = trace.attention.sum(axis=0, dtype=np.float64)
        col[: min(sinks, col.size)] = -np.inf
        top = np.argsort(-col, kind="stable")[: max(0, min(n_heavy, col.size - sinks))]
        heavy = tuple((int(p), int(p) + 1, T) for p in sorted(top.tolist()) if int(p) < T)
        source = f"here, the {len(heavy)} positions with the most attention over the whole trace"
        live_known = False
    return TraceFeatures(
        steps=T, sinks=sinks, band=band, heavy=heavy, heavy_source=source, live_known=live_known, band_known=band_known
    )


def _int_or(value, default):
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def policy_label(result: ReplayResult) -> str:
    """``h2o (recent_window=32)``: the name plus the parameters that made this run."""
    params = {k: v for k, v in result.params.items() if isinstance(v, (int, float, str))}
    inner = ", ".join(f"{k}={v}" for k, v in params.items())
    return f"{result.policy} ({inner})" if inner else result.policy


# --------------------------------------------------------------------------------------------
# 1. kept positions


def kept_image(result: ReplayResult) -> np.ndarray:
    """uint8 ``(T, T + 1)``: row t - 1 is the cache after step t; KEPT where position p is held,
    EVICTED where it existed but was let go, FUTURE where it does not exist yet (p > t)."""
    mask = result.kept_mask()
    img = np.where(mask.astype(bool), np.uint8(KEPT), np.uint8(EVICTED))
    T = result.steps
    future = np.arange(T + 1)[None, :] > np.arange(1, T + 1)[:, None]
    img[future] = FUTURE
    return img


def kept_image_source(result: ReplayResult) -> str:
    """The kept image as the PNG data URI Plotly draws. Encoding a 4096 x 4097 image takes about
    half a second, so the app keeps this per replay and hands it back through ``sources``."""
    return px.imshow(kept_image(result), binary_string=True).data[0].source


def kept_heatmap(
    results: Sequence[ReplayResult],
    features: TraceFeatures,
    *,
    step: int | None = None,
    max_cols: int = 3,
    sources: Sequence[str] | None = None,
) -> go.Figure:
    """One panel per replay, side by side (wrapping after ``max_cols``), decode step down, position
    across, at full resolution. Zoom is shared between panels so the same region can be compared.
    Sinks, the recency band and heavy hitters are drawn as shapes on every panel; ``step`` as a line.
    ``sources``, if given, are the panels' ``kept_image_source`` already encoded.
    """
    if not results:
        raise ValueError("kept_heatmap needs at least one replay")
    n = len(results)
    cols = min(n, max_cols)
    rows = math.ceil(n / cols)
    titles = [
        f"<b>{policy_label(r)}</b><br>mass {r.retained_mass:.3f} · top-{r.top_k} recall {r.top_k_recall:.3f}"
        for r in results
    ]
    fig = make_subplots(
        rows=rows, cols=cols, subplot_titles=titles, horizontal_spacing=0.03, vertical_spacing=0.12 / rows
    )
    T = features.steps
    for i, result in enumerate(results):
        if result.steps != T:
            raise ValueError(f"{result.policy}: replay has {result.steps} steps, the trace has {T}")
        row, col = i // cols + 1, i % cols + 1
        source = sources[i] if sources is not None else kept_image_source(result)
        image = go.Image(
            source=source,
            x0=0, dx=1, y0=1, dy=1, name=result.policy,
            hovertemplate="position %{x}<br>after step %{y}<extra>" + result.policy + "</extra>",
        )
        fig.add_trace(image, row=row, col=col)
        _feature_shapes(fig, features, row=row, col=col, legend=(i == 0), step=step)
    fig.update_xaxes(matches="x", range=[-0.5, T + 0.5], title_text="position", showgrid=False)
    fig.update_yaxes(matches="y", range=[T + 0.5, 0.5], showgrid=False)
    for r in range(1, rows + 1):
        fig.update_yaxes(title_text="decode step", row=r, col=1)
        for c in range(2, cols + 1):
            fig.update_yaxes(showticklabels=False, row=r, col=c)
    fig.update_layout(
        height=470 * rows + 70,
        margin=dict(l=60, r=20, t=80, b=40),
        legend=dict(orientation="h", yanchor="top", y=-0.12 / rows, x=0),
        plot_bgcolor="white",
    )
    return fig


def _feature_shapes(fig: go.Figure, f: TraceFeatures, *, row: int, col: int, legend: bool, step: int | None) -> None:
    T = f.steps
    common = dict(row=row, col=col, layer="above")
    if f.sinks > 0:
        # outlines with a faint fill: zoomed in, the kept cells inside stay readable
        fig.add_shape(
            type="rect", x0=-0.5, x1=f.sinks - 0.5, y0=0.5, y1=T + 0.5,
            line=dict(color=SINK_COLOUR, width=2), fillcolor="rgba(31, 119, 180, 0.15)",
            name=f"sinks (positions 0-{f.sinks - 1})", showlegend=legend, legendgroup="sinks", **common,
        )
    if f.band > 0:
        b = f.band
        # rows t hold the band at positions t-band .. t-1
        fig.add_shape(
            type="path", path=f"M 0,1 L {T - 1},{T} L {max(T - b, 0)},{T} L 0,{min(b, T)} Z",
            line=dict(color=BAND_COLOUR, width=1.5), fillcolor="rgba(255, 127, 14, 0.12)",
            name=f"recency band ({b} newest positions)", showlegend=legend, legendgroup="band", **common,
        )
    for j, (p, first, last) in enumerate(f.heavy):
        fig.add_shape(
            type="rect", x0=p - 0.5, x1=p + 0.5, y0=first - 0.5, y1=last + 0.5, line=dict(color=HEAVY_COLOUR, width=1.5),
            name="heavy hitter, while live" if f.live_known else "heavy hitter, from its birth",
            showlegend=legend and j == 0, legendgroup="heavy", **common,
        )
    if step is not None:
        fig.add_shape(
            type="line", x0=-0.5, x1=T + 0.5, y0=step, y1=step, line=dict(color="black", width=1, dash="dash"),
            name=f"step {step}", showlegend=legend, legendgroup="step", **common,
        )


# --------------------------------------------------------------------------------------------
# 2. cumulative scores at one step


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
    rw = int(result.params.get("recent_window", 0) or 0)
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
    return pd.DataFrame({"position": pos, "score": score, "category": category, "evicted": evicted})


def eviction_threshold(snapshot: pd.DataFrame) -> float | None:
    """The largest score evicted at this step: every evictable position scoring at or below it went.
    None when nothing was evicted (the cache was not yet full)."""
    victims = snapshot.loc[snapshot["evicted"], "score"]
    return float(victims.max()) if len(victims) else None


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
                x=victims["position"], y=shown[snap["evicted"]], mode="markers", name="evicted at this step",
                marker=dict(color="black", size=13, symbol="circle-open", line=dict(width=2)),
                hoverinfo="skip",
            ),
            row=1, col=1,
        )
    if threshold is not None:
        t_shown = max(threshold, floor)
        fig.add_hline(
            y=t_shown, line=dict(color="black", dash="dash"), row=1, col=1,
            annotation_text=f"eviction threshold {threshold:.4g}", annotation_position="bottom right",
            annotation_bgcolor="rgba(255,255,255,0.8)",
        )
        fig.add_vline(x=math.log10(t_shown), line=dict(color="black", dash="dash"), row=1, col=2)
        title = f"{policy_label(result)}: {len(snap)} held before eviction at step {step}, {len(victims)} evicted"
    else:
        title = f"{policy_label(result)}: step {step}, the cache is not full yet, nothing is evicted"
    fig.update_yaxes(type="log", title_text="cumulative score (log)", row=1, col=1)
    fig.update_xaxes(title_text="position", row=1, col=1)
    lo, hi = math.floor(float(logs.min())), math.ceil(float(logs.max()))
    ticks = list(range(lo, hi + 1))
    fig.update_xaxes(
        title_text="cumulative score (log)", tickvals=ticks, ticktext=[f"1e{k}" for k in ticks], row=1, col=2
    )
    fig.update_yaxes(title_text="positions", row=1, col=2)
    fig.update_layout(
        barmode="stack", height=460, title=dict(text=title, x=0, font=dict(size=14)),
        margin=dict(l=60, r=20, t=80, b=40), legend=dict(orientation="h", yanchor="bottom", y=-0.3, x=0),
    )
    return fig


# --------------------------------------------------------------------------------------------
# 3. retained mass and recall against recent_window


#: styles of the curve's lines. Deployable policies get colours; the offline references are drawn
#: in black and grey, dotted, so nobody reads them as one more policy to deploy.
PRIMARY_COLOUR = "#1f77b4"
COMPANION_STYLES = (("#9467bd", "solid"), ("#8c564b", "solid"), ("#e377c2", "solid"))
REFERENCE_STYLES = (("#2ca02c", "dash"), ("#bcbd22", "dashdot"), ("#e377c2", "longdash"), ("#8c564b", "dash"))
#: (colour, dash, width): the upper bound in black, any other offline reference in grey
BOUND_STYLE = ("black", "dot", 2)
OFFLINE_STYLES = (("#7f7f7f", "dot", 3), ("#b0b0b0", "dot", 3))
OFFLINE_TITLE = "<b>offline references</b> (they read the future)"


@dataclass(frozen=True)
class Line:
    """A horizontal line on the recent_window chart: a figure that does not move with recent_window."""

    label: str
    retained_mass: float
    top_k_recall: float
    #: "policy": a deployable policy with no recent_window; "offline": an offline reference that
    #: reads the future; "bound": the per-step upper bound no cache can pass
    kind: str = "policy"
    #: the registry name when the line is a policy's replay (the notes compare against streaming_llm)
    policy: str | None = None

    @classmethod
    def of(cls, summary: Mapping, label: str, kind: str = "policy", policy: str | None = None) -> Line:
        return cls(label, float(summary["retained_mass"]), float(summary["top_k_recall"]), kind, policy)

    @property
    def offline(self) -> bool:
        return self.kind in ("offline", "bound")


def recent_window_curve(
    rows: Sequence[Mapping],
    lines: Sequence[Line] = (),
    *,
    current: int | None,
    default: int = 32,
    band: int = 64,
    top_k: int = 32,
    policy: str = "h2o",
    band_known: bool = True,
    companions: Mapping[str, Sequence[Mapping]] | None = None,
) -> go.Figure:
    """Retained mass (top) and top-k recall (bottom) against recent_window.

    ``policy``'s sweep (``rows``) is the primary curve: it carries the markers at the shipped
    ``default`` and at the trace's ``band`` (labelled as assumed unless ``band_known``), the
    ``current`` recent_window, and the notes computed from the data. ``companions`` are other
    policies swept over the same recent_windows, drawn beside it without markers. ``lines`` are the
    horizontal ones (``Line``): deployable policies in the policies legend, offline references
    dotted under a legend of their own, the upper bound black and the others grey. Curve points
    carry their recent_window as ``customdata`` so a selection can set it.
    """
    if not rows:
        raise ValueError("recent_window_curve needs at least one sweep row")
    df = _sweep_frame(rows)
    x = df["recent_window"].to_numpy()
    others = {name: _sweep_frame(r) for name, r in (companions or {}).items() if r}
    offline = [line for line in lines if line.offline]
    # streaming_llm is the line the story compares against: the boldest style goes to it
    references = sorted((line for line in lines if not line.offline), key=lambda line: line.policy != "streaming_llm")
    metrics = (("retained_mass", "retained mass"), ("top_k_recall", f"top-{top_k} recall"))
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=[m[1] for m in metrics]
    )
    lo, hi = float(x.min()), float(x.max())
    for r, (key, label) in enumerate(metrics, start=1):
        y = df[key].to_numpy()
        # drawn first, so the deployable curves and the markers lie on top of them
        for j, line in enumerate(offline):
            colour, dash, width = BOUND_STYLE if line.kind == "bound" else OFFLINE_STYLES[j % len(OFFLINE_STYLES)]
            _hline(fig, r, line.label, getattr(line, key), label, lo, hi, colour, dash, width, legend="legend2", rank=200 + j)
        for j, line in enumerate(references):
            colour, dash = REFERENCE_STYLES[j % len(REFERENCE_STYLES)]
            _hline(fig, r, line.label, getattr(line, key), label, lo, hi, colour, dash, 2, legend="legend", rank=100 + j)
        for j, (name, other) in enumerate(others.items()):
            colour, dash = COMPANION_STYLES[j % len(COMPANION_STYLES)]
            ox = other["recent_window"].to_numpy()
            fig.add_trace(
                go.Scatter(
                    x=ox, y=other[key].to_numpy(), mode="lines", name=name, legendgroup=name, showlegend=(r == 1),
                    legendrank=10 + j,
                    line=dict(color=colour, width=2, dash=dash), customdata=ox,
                    hovertemplate="recent_window %{x}<br>" + label + " %{y:.4f}<extra>" + name + "</extra>",
                ),
                row=r, col=1,
            )
        fig.add_trace(
            go.Scatter(
                x=x, y=y, mode="lines+markers", name=policy, legendgroup=policy, showlegend=(r == 1), legendrank=1,
                line=dict(color=PRIMARY_COLOUR, width=2.5), marker=dict(size=4, color=PRIMARY_COLOUR),
                customdata=x, hovertemplate="recent_window %{x}<br>" + label + " %{y:.4f}<extra>" + policy + "</extra>",
            ),
            row=r, col=1,
        )
        for mark, text, colour, symbol in (
            (default, f"shipped default ({default})", "#ff7f0e", "circle"),
            (band, f"trace band ({band})" if band_known else f"{band} (assumed band)", "#17becf", "square"),
        ):
            hit = x == mark
            if hit.any():
                fig.add_trace(
                    go.Scatter(
                        x=x[hit], y=y[hit], mode="markers", name=text, legendgroup=text, showlegend=(r == 1),
                        legend="legend3",
                        marker=dict(size=12, color=colour, symbol=symbol, line=dict(color="black", width=1)),
                        hovertemplate=text + "<br>" + label + " %{y:.4f}<extra></extra>",
                    ),
                    row=r, col=1,
                )
        if current is not None and (x == current).any():
            fig.add_trace(
                go.Scatter(
                    x=[current], y=y[x == current], mode="markers", name=f"current recent_window ({current})",
                    legendgroup="current", showlegend=(r == 1), legend="legend3",
                    marker=dict(size=18, color=CURRENT_COLOUR, symbol="star", line=dict(color="black", width=1)),
                    hovertemplate="current recent_window %{x}<br>" + label + " %{y:.4f}<extra></extra>",
                ),
                row=r, col=1,
            )
    for mark, colour in ((default, "#ff7f0e"), (band, "#17becf")):
        if x.min() <= mark <= x.max():
            fig.add_vline(x=mark, line=dict(color=colour, width=1, dash="dot"))
    _annotate_story(fig, df, references, default=default, band=band, policy=policy)
    fig.update_xaxes(title_text="recent_window", row=2, col=1)
    # three legends stacked under the chart: policies, offline references, marks on the primary curve
    legend = dict(orientation="h", x=0, xanchor="left", yanchor="top", font=dict(size=13))
    fig.update_layout(
        height=760, margin=dict(l=60, r=20, t=40, b=40), hovermode="closest",
        # titles sized explicitly: a theme styles the first legend's title, never the extra legends'
        legend=dict(legend, y=-0.08, title=dict(text="<b>policies</b>", side="left", font=dict(size=13))),
        legend2=dict(legend, y=-0.135, title=dict(text=OFFLINE_TITLE, side="left", font=dict(size=13))),
        legend3=dict(legend, y=-0.19, title=dict(text=f"<b>marks on {policy}</b>", side="left", font=dict(size=13))),
    )
    return fig


def _sweep_frame(rows: Sequence[Mapping]) -> pd.DataFrame:
    return pd.DataFrame(list(rows)).sort_values("recent_window").reset_index(drop=True)


def _hline(fig, row, name, value, label, lo, hi, colour, dash, width, *, legend, rank) -> None:
    """A reference as a two-point line across the swept range, hoverable, listed in ``legend``."""
    fig.add_trace(
        go.Scatter(
            x=[lo, hi], y=[value, value], mode="lines", name=name, legendgroup=name, showlegend=(row == 1),
            legend=legend, legendrank=rank, line=dict(color=colour, dash=dash, width=width),
            hovertemplate=f"{name}<br>{label} {value:.4f}<extra></extra>",
        ),
        row=row, col=1,
    )


def sweep_table(curves: Mapping[str, Sequence[Mapping]], *, top_k: int = 32) -> pd.DataFrame:
    """The swept curves side by side, one row per recent_window: for each policy its retained mass,
    its top-k recall and any parameter it was swept with held fixed (``scissorhands history_window``).
    ``budget``, ``top_k`` and ``steps`` come once, from the first curve."""
    if not curves or not any(curves.values()):
        raise ValueError("sweep_table needs at least one swept curve")
    table = None
    for name, rows in curves.items():
        if not rows:
            continue
        df = _sweep_frame(rows)
        shared = [c for c in ("budget", "top_k", "steps") if c in df]
        fixed = [c for c in df.columns if c not in ("policy", "recent_window", "retained_mass", "top_k_recall", *shared)]
        part = df[["recent_window", "retained_mass", "top_k_recall", *fixed]].rename(
            columns={"retained_mass": f"{name} retained_mass", "top_k_recall": f"{name} top_{top_k}_recall",
                     **{c: f"{name} {c}" for c in fixed}}
        )
        if table is None:
            table = df[["recent_window", *shared]].merge(part, on="recent_window")
        else:
            table = table.merge(part, on="recent_window", how="outer")
    return table.sort_values("recent_window").reset_index(drop=True)


def curve_peak(rows: Sequence[Mapping]) -> tuple[int, float]:
    """``(recent_window, retained_mass)`` where the sweep keeps the most; the smallest such window."""
    best = max(sorted(rows, key=lambda r: r["recent_window"]), key=lambda r: r["retained_mass"])
    return int(best["recent_window"]), float(best["retained_mass"])


def _annotate_story(fig, df: pd.DataFrame, references: Sequence[Line], *, default: int, band: int, policy: str) -> None:
    """Say in words what the curve shows, computed from the data (never a fixed sentence)."""
    peak, top = curve_peak(df.to_dict("records"))
    where = " = the trace's band: the gain saturates here" if peak == band else ""
    fig.add_annotation(
        x=peak, y=top, xref="x", yref="y", text=f"peak at {peak}: {top:.3f}{where}",
        showarrow=True, arrowhead=2, ax=60, ay=-30, bgcolor="rgba(255,255,255,0.85)", xanchor="left",
        font=dict(size=13, color="#222"),
    )
    at_default = df[df["recent_window"] == default]
    streaming = next((line for line in references if line.policy == "streaming_llm"), None)
    if len(at_default) and streaming is not None:
        v = float(at_default["retained_mass"].iloc[0])
        s = streaming.retained_mass
        word = "less than" if v < s else "at least as much as"
        fig.add_annotation(
            x=default, y=v, xref="x", yref="y", text=f"at {default}, {policy} keeps {word} streaming_llm ({v:.3f} vs {s:.3f})",
            # low and to the right: under the curves there, clear of the reference lines' labels
            showarrow=True, arrowhead=2, ax=40, ay=75, bgcolor="rgba(255,255,255,0.85)", xanchor="left",
            font=dict(size=13, color="#222"),
        )


def selected_recent_window(selection) -> int | None:
    """The recent_window of the first chosen point of ``recent_window_curve`` in a Plotly selection
    event (Streamlit's ``on_select`` state), or None when no curve point was chosen."""
    try:
        points = selection["selection"]["points"]
    except (KeyError, TypeError):
        return None
    for p in points or []:
        value = p.get("customdata", p.get("x"))
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
            return int(value)
    return None


# --------------------------------------------------------------------------------------------
# 4. the trace


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
    A = np.asarray(attention)[1:, :-1]
    T = A.shape[0]
    block = max(1, math.ceil(T / size))
    n = math.ceil(T / block)
    padded = np.zeros((n * block, n * block), dtype=np.float64)
    padded[:T, :T] = A
    means = padded.reshape(n, block, n, block).mean(axis=(1, 3))
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
    return rgb, block, (lo, hi)


def trace_matrix(trace: Trace, features: TraceFeatures, size: int = 1024) -> go.Figure:
    """The attention matrix, log-scaled and block-averaged to at most ``size`` x ``size``, with the
    sinks and heavy hitters pointed at from the top edge (the stripes themselves are the data)."""
    rgb, block, (lo, hi) = attention_image(trace.attention, size)
    fig = px.imshow(rgb, binary_string=True)
    centre = (block - 1) / 2
    fig.update_traces(
        x0=centre, dx=block, y0=1 + centre, dy=block,
        hovertemplate="positions from %{x:.0f}<br>steps from %{y:.0f}<extra>" + f"{block} x {block} block</extra>",
    )
    T = trace.steps
    if features.heavy:
        fig.add_trace(
            go.Scatter(
                x=[p for p, _, _ in features.heavy], y=[first for _, first, _ in features.heavy], mode="markers",
                name="heavy hitter (born here)", marker=dict(symbol="triangle-left", size=9, color=HEAVY_COLOUR),
                hovertemplate="heavy hitter at position %{x}<extra></extra>",
            )
        )
    note = dict(showarrow=True, arrowhead=2, bgcolor="rgba(255,255,255,0.85)", font=dict(size=12, color="#222"))
    if features.sinks:
        fig.add_annotation(x=0, y=0.8 * T, ax=60, ay=0, text=f"sinks (positions 0-{features.sinks - 1})", **note)
    if features.band:
        fig.add_annotation(
            x=0.45 * T, y=0.45 * T + features.band / 2, ax=70, ay=-30, text=f"recency band ({features.band})", **note
        )
    # a colour bar for the image, carried by an invisible marker
    fig.add_trace(
        go.Scatter(
            x=[0, 0], y=[1, 1], mode="markers", showlegend=False, hoverinfo="skip",
            marker=dict(
                color=[lo, hi], colorscale="Viridis", showscale=True, opacity=0, size=1,
                colorbar=dict(title=dict(text="log10<br>attention"), thickness=12, len=0.8),
            ),
        )
    )
    fig.update_xaxes(title_text="position", range=[-0.5, T + 0.5])
    fig.update_yaxes(title_text="decode step", range=[T + 0.5, 0.5])
    fig.update_layout(
        height=720, margin=dict(l=60, r=20, t=30, b=40), legend=dict(orientation="h", yanchor="top", y=-0.08, x=0)
    )
    return fig


# --------------------------------------------------------------------------------------------
# tables for export


def per_step_table(results: Sequence[ReplayResult]) -> pd.DataFrame:
    """One row per decode step; a retained-mass and a top-k-recall column per replay."""
    if not results:
        raise ValueError("per_step_table needs at least one replay")
    T = results[0].steps
    table = {"step": np.arange(1, T + 1)}
    for r in results:
        if r.steps != T:
            raise ValueError(f"{r.policy}: {r.steps} steps, expected {T}")
        label = policy_label(r)
        table[f"{label} retained_mass"] = r.retained_mass_series
        table[f"{label} top_{r.top_k}_recall"] = r.top_k_recall_series
    return pd.DataFrame(table)

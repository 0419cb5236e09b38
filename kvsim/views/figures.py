"""Figure builders for the app: pure functions, replay results and traces in, Plotly figures out.

Nothing here imports Streamlit, so every figure is built and tested without a browser. Images reach
Plotly as PNGs made from uint8 arrays (``px.imshow(..., binary_string=True)`` or ``_source``), never
as booleans or lists; the kept images are pooled to about the pixels the screen shows, so a redraw
sends a few kilobytes per panel, not a 4096 x 4097 picture.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from PIL import Image
from plotly.colors import hex_to_rgb, sequential
from plotly.subplots import make_subplots

from ..analysis.features import (  # noqa: F401 (the app calls these as figures.<name>)
    HeavyFate,
    TraceFeatures,
    curve_peak,
    heavy_fates,
    trace_features,
    trace_features_cached,
)
from ..data.trace import Trace
from ..jit import AVAILABLE, kernel
from ..sim.harness import ReplayResult, kept_mask_of
from .selection import Region, selected_recent_window, selected_region  # noqa: F401 (as above)

if TYPE_CHECKING:  # imported where a table is built: ``import kvsim.views.figures`` stays ~0.3 s lighter
    import pandas as pd

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


#: grey level of a pooled block where some of the positions that exist are kept and some are not
PARTIAL = 140
#: colours of the difference view (RGB): kept by the first policy only, the second only, both
#: (blocks holding some of each), kept by both, by neither, not generated yet
ONLY_A, ONLY_B, MIXED = (31, 119, 180), (255, 127, 14), (148, 103, 189)
BOTH, NEITHER, NOT_YET = (150, 150, 150), (255, 255, 255), (222, 222, 222)


def difference_counts(history_a: np.ndarray, history_b: np.ndarray) -> tuple[float, float]:
    """Mean over steps of how many positions the first cache holds that the second does not, and
    the reverse, from the two replays' kept histories."""
    T = history_a.shape[0]
    if AVAILABLE:  # one block per step over every position: each step's counts
        only_a, only_b, _ = _pool_kept(history_a, history_b, True, 1, T, 0, T + 1, 1, T + 1, False)
    else:
        masks = [kept_mask_of(history_a), kept_mask_of(history_b)]
        only_a, only_b, _ = _pool_panel(masks, Region.whole(T), 0, 0, 1, T + 1, 1)[0][0]
    return float(only_a.sum(axis=1).mean()), float(only_b.sum(axis=1).mean())


def _pool(a: np.ndarray, br: int, bc: int) -> np.ndarray:
    """Sum of ``a`` over blocks of ``br x bc`` (the edges padded with zeros)."""
    h, w = a.shape
    H, W = -(-h // br), -(-w // bc)
    padded = np.zeros((H * br, W * bc), dtype=np.int32)
    padded[:h, :w] = a
    return padded.reshape(H, br, W, bc).sum(axis=(1, 3))


def _levels(kept: np.ndarray, exists: np.ndarray) -> np.ndarray:
    """Grey levels of pooled blocks: a block is KEPT if every position in it that exists is held,
    PARTIAL if some are, so a single kept column stays visible when thousands of positions share
    a few hundred pixels."""
    img = np.full(kept.shape, EVICTED, dtype=np.uint8)
    img[kept > 0] = PARTIAL
    img[(kept == exists) & (exists > 0)] = KEPT
    img[exists == 0] = FUTURE
    return img


def _split(a: np.ndarray, b: np.ndarray, exists: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Held by the first only, by the second only, by both."""
    return a & ~b & exists, b & ~a & exists, a & b & exists


def _difference_rgb(counts: tuple, exists: np.ndarray) -> np.ndarray:
    """RGB of pooled blocks in the difference view: a block holding any position kept by one policy
    and not the other shows that colour, so a single such column stays visible."""
    only_a, only_b, both = counts
    rgb = np.empty((*exists.shape, 3), dtype=np.uint8)
    rgb[:] = NEITHER
    rgb[both > 0] = BOTH
    rgb[only_a > 0] = ONLY_A
    rgb[only_b > 0] = ONLY_B
    rgb[(only_a > 0) & (only_b > 0)] = MIXED
    rgb[exists == 0] = NOT_YET
    return rgb


def _pool_panel(masks: Sequence[np.ndarray], region: Region, sinks: int, ages: int, br: int, bc: int, ba: int):
    """The reference pooling of one panel, in NumPy: for the main image, the sink strip and the age
    strip, ``(counts, exists)`` pooled over blocks, ``counts`` being ``(kept,)`` for one mask and
    ``(only_a, only_b, both)`` for two; None for a strip that is not drawn. ``panel_layers`` uses the
    kernels below (``_pool_kept``, ``_exists``), which give the same sums from the kept histories,
    never building a mask (the tests hold them to this)."""
    r = region
    steps = np.arange(r.t0, r.t1 + 1)
    bands = [m[r.t0 - 1 : r.t1].astype(bool) for m in masks]

    def pooled(parts, exist, bc_):
        if len(parts) == 1:
            return (_pool(parts[0] & exist, br, bc_),), _pool(exist, br, bc_)
        return tuple(_pool(x, br, bc_) for x in _split(*parts, exist)), _pool(exist, br, bc_)

    cols = np.arange(r.p0, r.p1 + 1)
    main = pooled([b[:, r.p0 : r.p1 + 1] for b in bands], cols[None, :] <= steps[:, None], bc)
    s = min(sinks, r.t1 + 1)
    sink = pooled([b[:, :s] for b in bands], np.arange(s)[None, :] <= steps[:, None], 1) if s else None
    age = None
    if ages:
        pos = steps[:, None] - np.arange(1, ages + 1)[None, :]  # column a - 1 is position t - a
        rows = np.arange(steps.size)[:, None]
        age = pooled([b[rows, np.clip(pos, 0, None)] for b in bands], pos >= 0, ba)
    return main, sink, age


@kernel
def _pool_kept(a, b, two, t0, t1, lo, width, br, bw, by_age):
    """Block counts of kept positions straight from kept histories (``(T, budget)`` int, row t - 1
    the positions held after step t, -1 padded): ``a``, and ``b`` when ``two``. Steps t0 .. t1 are
    pooled br to a block row; a position's column is ``p - lo`` (positions lo .. lo + width - 1) or,
    ``by_age``, its age less one (``t - p - 1``, ages 1 .. width), bw columns to a block.
    ``counts[0]`` is kept (one history) or kept by ``a`` only, ``counts[1]`` by ``b`` only,
    ``counts[2]`` by both. A step costs its held positions, not the trace's length: no
    ``(T, T + 1)`` mask is ever built."""
    H = (t1 - t0 + br) // br
    W = (width + bw - 1) // bw
    counts = np.zeros((3, H, W), dtype=np.int64)
    stamp = np.full(max(a.shape[0], b.shape[0]) + 2, -1, dtype=np.int64)  # stamp[p] == t: a holds p after step t
    for t in range(t0, t1 + 1):
        R = (t - t0) // br
        for i in range(a.shape[1]):
            p = a[t - 1, i]
            if p < 0:
                continue
            stamp[p] = t
            c = t - p - 1 if by_age else p - lo
            if 0 <= c < width:
                counts[0, R, c // bw] += 1
        if two:
            for i in range(b.shape[1]):
                p = b[t - 1, i]
                if p < 0:
                    continue
                c = t - p - 1 if by_age else p - lo
                if 0 <= c < width:
                    counts[2 if stamp[p] == t else 1, R, c // bw] += 1
    if two:
        counts[0] -= counts[2]  # held by a, less those b holds too
    return counts


@kernel
def _exists(t0, t1, lo, width, br, bw, by_age):
    """How many of each block's cells exist (a position exists after step t once p <= t): the
    geometry of ``_pool_kept``'s blocks, whatever is kept."""
    H = (t1 - t0 + br) // br
    W = (width + bw - 1) // bw
    exists = np.zeros((H, W), dtype=np.int64)
    for t in range(t0, t1 + 1):
        R = (t - t0) // br
        last = min(width, t) - 1 if by_age else min(lo + width - 1, t) - lo  # the last column that exists
        for j in range(W):
            c0 = j * bw
            if c0 > last:
                break
            exists[R, j] += min(c0 + bw - 1, last) - c0 + 1
    return exists


def _pool_panel_fast(histories: Sequence[np.ndarray], region: Region, sinks: int, ages: int, br: int, bc: int, ba: int):
    """``_pool_panel`` of the histories' masks, by the kernels: the same sums, from the kept
    histories themselves."""
    r = region
    two = len(histories) == 2
    a, b = histories[0], histories[-1]
    n = 3 if two else 1

    def pool(lo, width, bw, by_age):
        counts = _pool_kept(a, b, two, r.t0, r.t1, lo, width, br, bw, by_age)
        return tuple(counts[:n]), _exists(r.t0, r.t1, lo, width, br, bw, by_age)

    main = pool(r.p0, r.p1 - r.p0 + 1, bc, False)
    s = min(sinks, r.t1 + 1)
    sink = pool(0, s, 1, False) if s else None
    age = pool(0, ages, ba, True) if ages else None
    return main, sink, age


def panel_layers(histories: Sequence[np.ndarray], region: Region, sinks: int, ages: int, size: int) -> dict:
    """The three images of one panel, pooled to about ``size`` pixels across the main image: the
    main image (the region), the sink strip (positions 0 .. sinks-1, one column each, widened) and
    the age strip (the newest ``ages`` positions of every step, by age, widened). One kept history
    (a replay's ``kept_history``): grey levels; two: the difference's colours. Returns the blocks
    and each image as a PNG data URI (with its column count for the strips): small, and cheap to
    keep per replay and region."""
    r = region
    br = max(1, math.ceil(r.height / size))
    bc = max(1, math.ceil(r.width / size))
    ba = max(1, math.ceil(ages / max(1, size // 4)))
    if AVAILABLE:
        main, sink, age = _pool_panel_fast(histories, r, sinks, ages, br, bc, ba)
    else:
        main, sink, age = _pool_panel([kept_mask_of(h) for h in histories], r, sinks, ages, br, bc, ba)

    def image(pooled):
        counts, exists = pooled
        return _levels(counts[0], exists) if len(counts) == 1 else _difference_rgb(counts, exists)

    main_img = image(main)
    sink_img = None if sink is None else image(sink)
    age_img = None if age is None else image(age)
    return {
        "block": (br, bc, ba),
        "main": _source(main_img),
        "sink": None if sink_img is None else (_source(sink_img), sink_img.shape[1]),
        "age": None if age_img is None else (_source(age_img), age_img.shape[1]),
    }


def _source(img: np.ndarray) -> str:
    """A uint8 image (grey or RGB) as the PNG data URI a Plotly image trace draws (what
    ``px.imshow(img, binary_string=True)`` makes, without building a figure around it)."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(img)).save(buf, format="png", compress_level=6)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def age_span(features: TraceFeatures, windows: Sequence[int], budget: int) -> int:
    """How many of the newest positions the age strip shows: twice the widest of the band and the
    policies' windows, at least 64, and never more than the budget or the trace."""
    widest = max([features.band if features.band_known else 0, *windows, 32])
    return max(1, min(2 * widest, max(64, budget), features.steps))


def kept_heatmap(
    results: Sequence[ReplayResult],
    features: TraceFeatures,
    *,
    step: int | None = None,
    max_cols: int = 3,
    region: Region | None = None,
    size: int | None = None,
    compare: bool = False,
    layers: Sequence[dict] | None = None,
    fates: Sequence[Sequence[HeavyFate]] | None = None,
) -> go.Figure:
    """One panel per replay (wrapping after ``max_cols``), decode step down, position across, or
    with ``compare`` one panel of what the first two replays keep differently.

    The images are pooled to about the pixels shown (``size`` across the main image; by default
    1024 shared among the columns), never sent at 4096 x 4097: a block is dark when all of its
    existing positions are held, mid-grey when some are, so one kept column stays visible. Two
    strips widen what is too thin to see: at the left the sink columns, at the right the newest
    positions of every step by age (the policy's protected window, and the trace's band, as
    stripes). ``region`` draws only part of the run, pooled afresh (at full resolution once it is
    no wider than ``size``): that is how single positions are reached. ``layers``, if given, are
    the panels' ``panel_layers`` already computed (the app keeps them), ``fates`` each replay's
    ``heavy_fates`` (with both, the replays need no kept history). Heavy hitters are marked
    beside their column, never over it: a solid red line while the policy holds a live heavy
    hitter, an x where it evicts one still live and dotted while it is missed.
    """
    if not results:
        raise ValueError("kept_heatmap needs at least one replay")
    if compare and len(results) < 2:
        raise ValueError("the difference view needs two replays")
    T = features.steps
    for result in results:
        if result.steps != T:
            raise ValueError(f"{result.policy}: replay has {result.steps} steps, the trace has {T}")
    kept = None
    if layers is None or (not compare and fates is None):
        if any(r.kept_history is None for r in results):
            raise ValueError("kept_heatmap needs replays run with record_kept=True")
        kept = [r.kept_history for r in results]
    region = (region or Region.whole(T)).clip(T)
    windows = [int(r.params.get("recent_window", 0) or 0) for r in results]
    ages = age_span(features, windows, max(r.budget for r in results))
    panels = [(results[0], results[1])] if compare else [(r,) for r in results]
    n = len(panels)
    cols = min(n, max_cols)
    rows = math.ceil(n / cols)
    size = size or max(128, 1024 // cols)
    if compare:
        a, b = results[0], results[1]
        titles = [
            f"<b>blue: kept by {policy_label(a)}</b> (mass {a.retained_mass:.3f}) <b>and not by {policy_label(b)}</b> "
            f"(mass {b.retained_mass:.3f}); orange: the reverse"
        ]
    else:
        titles = [
            f"<b>{policy_label(r)}</b><br>mass {r.retained_mass:.3f} · top-{r.top_k} recall {r.top_k_recall:.3f}"
            for r in results
        ]
    height = (560 if compare else 500) * rows
    fig = make_subplots(
        rows=rows, cols=cols, subplot_titles=titles, horizontal_spacing=0.035,
        vertical_spacing=min(0.3, 130 / (height + 120)) if rows > 1 else 0.0,
    )
    W = region.width
    gap = max(1.0, 0.015 * W)
    sink_w = 0.05 * W if features.sinks else 0.0
    age_w = 0.22 * W
    x_lo = region.p0 - 0.5 - (gap + sink_w if features.sinks else 0)
    x_hi = region.p1 + 0.5 + gap + age_w
    header = 0.07 * region.height
    y_top = region.t0 - 0.5 - header
    refs = [_refs(fig, r, c) for r in range(1, rows + 1) for c in range(1, cols + 1)]
    frame = fig.to_dict()  # the axes and the layout set as plain dicts: through Plotly's objects, most of the time
    layout = frame["layout"]
    ticks = _ticks(region.p0, region.p1)  # on the positions only: the strips beside them have their own labels
    for j, (xref, yref) in enumerate(refs):
        r, c = j // cols + 1, j % cols + 1
        xaxis, yaxis = layout["xaxis" + xref[1:]], layout["yaxis" + yref[1:]]
        xaxis.update(matches="x", range=[x_lo, x_hi], showgrid=False, zeroline=False, tickvals=ticks)
        if r == rows:
            xaxis["title"] = dict(text="position")
        # images pin the aspect ratio by default; the strips make the panel wider than tall, so let it fill
        yaxis.update(matches="y", range=[region.t1 + 0.5, y_top], showgrid=False, zeroline=False, scaleanchor=False)
        if c == 1:
            yaxis["title"] = dict(text="decode step")
        else:
            yaxis["showticklabels"] = False
    layout.update(
        height=height + 150,
        margin=dict(l=60, r=20, t=70, b=110),
        legend=dict(orientation="h", yanchor="top", y=-60 / height, x=0, font=dict(size=13)),
        plot_bgcolor="white",
        dragmode="zoom",  # zoom by default; the box-select tool asks for a full-resolution region
    )
    d = _Drawing()
    for i, panel in enumerate(panels):
        d.at(*refs[i])
        pk = None if kept is None else [kept[results.index(r)] for r in panel]
        lay = layers[i] if layers is not None else panel_layers(pk, region, features.sinks, ages, size)
        br, bc, ba = lay["block"]
        name = " vs ".join(r.policy for r in panel)
        hover = "<extra>" + name + "</extra>"
        d.trace(type="image", source=lay["main"], x0=region.p0 + (bc - 1) / 2, dx=bc, y0=region.t0 + (br - 1) / 2, dy=br,
                name=name, hovertemplate=f"position %{{x:.0f}}<br>after step %{{y:.0f}}<br>block of {bc} x {br}" + hover)
        if lay["sink"] is not None:
            source, s = lay["sink"]
            dx = sink_w / s
            d.trace(type="image", source=source, x0=x_lo + dx / 2, dx=dx, y0=region.t0 + (br - 1) / 2, dy=br,
                    name="sinks", hovertemplate="a sink column, widened<br>after step %{y:.0f}" + hover)
        if lay["age"] is not None:
            source, na = lay["age"]
            dx = age_w / na
            a0 = region.p1 + 0.5 + gap
            d.trace(type="image", source=source, x0=a0 + dx / 2, dx=dx, y0=region.t0 + (br - 1) / 2, dy=br,
                    name="newest positions",
                    hovertemplate=f"the newest {ages} positions by age, widened<br>after step %{{y:.0f}}" + hover)
            _age_marks(d, a0, age_w / ages, ages, features, [windows[results.index(r)] for r in panel], region, y_top)
        _strip_labels(d, features, region, x_lo, sink_w, gap, age_w, ages, y_top, header)
        if not compare:
            fate = fates[results.index(panel[0])] if fates is not None else heavy_fates(pk[0], features)
            _fates(d, fate, features, region, gap)
        _heavy_heads(d, features, region, y_top, header)
        if step is not None and region.t0 <= step <= region.t1:
            d.line(x_lo, step, x_hi, step, dict(color="black", width=1, dash="dash"), f"step {step}", "step")
    if compare:
        d.at("x", "y")
        for colour, label in ((ONLY_A, f"kept by {results[0].policy} only"), (ONLY_B, f"kept by {results[1].policy} only"),
                              (BOTH, "kept by both"), (MIXED, "both kinds in one block")):
            d.trace(type="scatter", x=[None], y=[None], mode="markers", name=label,
                    marker=dict(symbol="square", size=12, color=f"rgb{colour}", line=dict(color="black", width=1)))
    return d.figure(frame)


@dataclass
class _Drawing:
    """What ``kept_heatmap`` draws on its panels, gathered as plain dicts and turned into a figure
    once (``figure``): built through Plotly's objects, each property checked as it is set, the
    figure of six panels took longer than pooling them. The lines are layout shapes, not traces:
    a browser draws a shape far more cheaply than a trace of its own (the six-panel figure opened
    as a link: 1.2 s with its lines as traces, 0.9 s as shapes, ``bench/browser_floor.py``). A
    legend group is shown once, on the first trace or shape that has it, whichever panel that is."""

    traces: list = field(default_factory=list)
    shapes: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    refs: tuple = ("x", "y")
    seen: set = field(default_factory=set)

    def at(self, xref: str, yref: str) -> None:
        """Draw on the subplot of these axes from now on."""
        self.refs = (xref, yref)

    def _legend(self, group: str | None) -> dict:
        if group is None:
            return {}
        first = group not in self.seen
        self.seen.add(group)
        return dict(legendgroup=group, showlegend=first)

    def trace(self, group: str | None = None, **props) -> None:
        self.traces.append(dict(props, xaxis=self.refs[0], yaxis=self.refs[1], **self._legend(group)))

    def line(self, x0, y0, x1, y1, line: dict, name: str, group: str) -> None:
        self.shapes.append(dict(type="line", x0=x0, y0=y0, x1=x1, y1=y1, xref=self.refs[0], yref=self.refs[1],
                                line=line, name=name, **self._legend(group)))

    def path(self, segments: Sequence[tuple], line: dict, name: str, group: str) -> None:
        """Line segments ``(x0, y0, x1, y1)`` of one style as one shape (an SVG path in data
        coordinates): a panel's heavy hitters are one shape each way, not one per hitter. The
        legend entry is a trace of no points in the same group, so that it shows a line (a path
        shape's own entry is drawn as an outline)."""
        if not segments:
            return
        if group not in self.seen:
            self.trace(type="scatter", x=[None], y=[None], mode="lines", line=line, name=name, group=group, hoverinfo="skip")
        path = "".join("M{!r},{!r}L{!r},{!r}".format(*map(float, seg)) for seg in segments)  # plain floats, whatever the type
        self.shapes.append(dict(type="path", path=path, xref=self.refs[0], yref=self.refs[1], line=line, name=name,
                                legendgroup=group, showlegend=False))

    def note(self, **props) -> None:
        self.notes.append(dict(props, xref=self.refs[0], yref=self.refs[1]))

    def figure(self, frame: dict) -> go.Figure:
        """``frame`` (the subplots, axes and layout, as a figure's dict) with everything drawn
        added; not validated again (the tests validate the result once, so a misspelt property
        still fails there)."""
        layout = frame["layout"]
        layout["annotations"] = layout.get("annotations", []) + self.notes
        layout["shapes"] = layout.get("shapes", []) + self.shapes
        return go.Figure(dict(data=frame.get("data", []) + self.traces, layout=layout), _validate=False)


def _ticks(lo: int, hi: int, n: int = 5) -> list[int]:
    """Round tick values from ``lo`` to ``hi``: steps of 1, 2 or 5 times a power of ten."""
    span = max(1, hi - lo)
    raw = span / n
    power = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    return list(range(int(first), int(hi) + 1, int(step)))


def _age_marks(d: _Drawing, a0, per_age, ages, f: TraceFeatures, windows, region: Region, y_top) -> None:
    """In the age strip: the trace's band edge (orange) and each policy's protected window (green)."""
    marks = []
    if f.band_known and f.band <= ages:
        marks.append((f.band, BAND_COLOUR, "dot", f"recency band edge (age {f.band})", "band"))
    for w in sorted(set(w for w in windows if 0 < w <= ages)):
        marks.append((w, RECENT_COLOUR, "dash", f"protected window edge (age {w})", f"window{w}"))
    for age, colour, dash, name, group in marks:
        x = a0 + age * per_age
        d.line(x, y_top, x, region.t1 + 0.5, dict(color=colour, width=2.5, dash=dash), name, group)


def _strip_labels(d: _Drawing, f: TraceFeatures, region: Region, x_lo, sink_w, gap, age_w, ages, y_top, header):
    y = y_top + header / 2
    note = dict(showarrow=False, font=dict(size=10, color="#333"), yanchor="middle")
    if f.sinks:
        d.note(x=x_lo + sink_w / 2, y=y, text="sinks", **note)
    d.note(x=region.p1 + 0.5 + gap + age_w / 2, y=y, text=f"newest {ages} →", **note)


def _refs(fig, row, col) -> tuple[str, str]:
    sub = fig.get_subplot(row, col)
    return sub.xaxis.plotly_name.replace("axis", ""), sub.yaxis.plotly_name.replace("axis", "")


def _heavy_heads(d: _Drawing, f: TraceFeatures, region: Region, y_top, header) -> None:
    """A red triangle above each heavy hitter's column, in the header: where to look."""
    inside = [p for p, _, _ in f.heavy if region.p0 <= p <= region.p1]
    if not inside:
        return
    d.trace(type="scatter", x=inside, y=[y_top + header * 0.75] * len(inside), mode="markers",
            name="heavy hitter (its column)", marker=dict(symbol="triangle-down", size=9, color=HEAVY_COLOUR),
            group="heavyhead", hovertemplate="heavy hitter at position %{x}<extra></extra>")


def _fates(d: _Drawing, fates: Sequence[HeavyFate], f: TraceFeatures, region: Region, gap) -> None:
    """Beside each heavy hitter's column (offset so the column itself stays visible): solid while
    the policy holds it and it is live, an x where it is evicted while live, dotted while missed."""
    off = gap * 0.6
    held = f"heavy hitter held {'while live' if f.live_known else ''}".strip()
    missed = "heavy hitter evicted, still live" if f.live_known else "heavy hitter evicted"
    ex, ey, text, kept, lost = [], [], [], [], []
    for h in fates:
        if not region.p0 <= h.position <= region.p1:
            continue
        x = h.position + off
        kept.append((x, h.first, x, h.last if not h.lost_while_live else h.evicted_at - 1))
        if h.lost_while_live:
            ex.append(x)
            ey.append(h.evicted_at)
            text.append(f"heavy hitter {h.position} evicted at step {h.evicted_at}, live until {h.last}")
            lost.append((x, h.evicted_at, x, h.last))
    d.path(kept, dict(color=HEAVY_COLOUR, width=2.5), held, "held")
    d.path(lost, dict(color=HEAVY_COLOUR, width=1.5, dash="dot"), missed, "missed")
    d.trace(type="scatter", x=ex, y=ey, mode="markers", name="evicted here", group="evicted", text=text,
            marker=dict(symbol="x", size=10, color=HEAVY_COLOUR, line=dict(width=1, color="white")),
            hovertemplate="%{text}<extra></extra>")


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
    import pandas as pd

    return pd.DataFrame({"position": pos, "score": score, "category": category, "evicted": evicted})


def eviction_threshold(snapshot: pd.DataFrame) -> float | None:
    """The largest score evicted at this step: every evictable position scoring at or below it went.
    None when nothing was evicted (the cache was not yet full)."""
    victims = snapshot.loc[snapshot["evicted"], "score"]
    return float(victims.max()) if len(victims) else None


def score_name(policy: str) -> str:
    """What the policy's score counts, for axis titles."""
    return {"scissorhands": "votes (steps above a fair share)", "tova": "latest weight"}.get(policy, "cumulative score")


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
        t_shown = max(threshold, floor)
        x0, x1 = float(snap["position"].min()), float(snap["position"].max())
        fig.add_trace(
            go.Scatter(
                x=[x0, x1], y=[t_shown, t_shown], mode="lines", line=dict(color="black", dash="dash", width=1.5),
                name=f"eviction threshold ({threshold:.4g})", hovertemplate=f"eviction threshold {threshold:.4g}<extra></extra>",
            ),
            row=1, col=1,
        )
        fig.add_annotation(
            x=x1, y=math.log10(t_shown), xref="x", yref="y", text=f"eviction threshold {threshold:.4g}",
            showarrow=False, xanchor="right", yanchor="top", bgcolor="rgba(255,255,255,0.8)", font=dict(size=12),
        )
        fig.add_vline(x=math.log10(t_shown), line=dict(color="black", dash="dash"), row=1, col=2)
        title = f"{policy_label(result)}: {len(snap)} held before eviction at step {step}, {len(victims)} evicted"
    else:
        title = f"{policy_label(result)}: step {step}, the cache is not full yet, nothing is evicted"
    fig.update_yaxes(type="log", title_text=f"{score_name(result.policy)} (log)", range=[y_lo, y_hi], row=1, col=1)
    fig.update_xaxes(title_text="position", row=1, col=1)
    lo, hi = math.floor(float(logs.min())), math.ceil(float(logs.max()))
    ticks = list(range(lo, hi + 1))
    fig.update_xaxes(
        title_text=f"{score_name(result.policy)} (log)", tickvals=ticks, ticktext=[f"1e{k}" for k in ticks], row=1, col=2
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
    #: what the line's policy does, in one line (its class's ``summary``): the notes quote it
    note: str = ""

    @classmethod
    def of(cls, summary: Mapping, label: str, kind: str = "policy", policy: str | None = None, note: str = "") -> Line:
        return cls(label, float(summary["retained_mass"]), float(summary["top_k_recall"]), kind, policy, note)

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
    df = _sweep_columns(rows)
    x = df["recent_window"]
    others = {name: _sweep_columns(r) for name, r in (companions or {}).items() if r}
    offline = [line for line in lines if line.offline]
    # streaming_llm is the line the story compares against: the boldest style goes to it
    references = sorted((line for line in lines if not line.offline), key=lambda line: line.policy != "streaming_llm")
    metrics = (("retained_mass", "retained mass"), ("top_k_recall", f"top-{top_k} recall"))
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=[m[1] for m in metrics]
    )
    lo, hi = float(x.min()), float(x.max())
    for r, (key, label) in enumerate(metrics, start=1):
        y = df[key]
        # the lines first, so the curves and the markers lie on top of them; the policies' lines wide
        # and pale under the offline references' thin dotted ones, so a policy that matches a
        # reference (tova and the upper bound, on the canonical trace) shows as both
        for j, line in enumerate(references):
            colour, dash = REFERENCE_STYLES[j % len(REFERENCE_STYLES)]
            _hline(fig, r, line.label, getattr(line, key), label, lo, hi, colour, dash, 4, legend="legend", rank=100 + j)
        for j, line in enumerate(offline):
            colour, dash, width = BOUND_STYLE if line.kind == "bound" else OFFLINE_STYLES[j % len(OFFLINE_STYLES)]
            _hline(fig, r, line.label, getattr(line, key), label, lo, hi, colour, dash, width, legend="legend2", rank=200 + j)
        for ref, off in coinciding(references, offline, key):
            fig.add_annotation(
                x=hi, y=getattr(off, key), xref=f"x{'' if r == 1 else r}", yref=f"y{'' if r == 1 else r}",
                text=f"{ref.label} {getattr(ref, key):.4f} and {off.label.split(' (')[0]} {getattr(off, key):.4f}: one line",
                showarrow=True, arrowhead=2, ax=-20, ay=28, xanchor="right", bgcolor="rgba(255,255,255,0.85)",
                font=dict(size=12, color="#222"),
            )
        for j, (name, other) in enumerate(others.items()):
            colour, dash = COMPANION_STYLES[j % len(COMPANION_STYLES)]
            ox = other["recent_window"]
            fig.add_trace(
                go.Scatter(
                    x=ox, y=other[key], mode="lines", name=name, legendgroup=name, showlegend=(r == 1),
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
        # a trace without a band gets no band mark: there is no width to point at
        marks = [(default, f"shipped default ({default})", "#ff7f0e", "circle")]
        if band_known:
            marks.append((band, f"trace band ({band})", "#17becf", "square"))
        for mark, text, colour, symbol in marks:
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
    # a dotted line down both panels at each mark, set at once (``add_vline`` re-validates every
    # shape it adds, which was most of the figure's cost)
    fig.update_layout(shapes=[
        dict(type="line", x0=mark, x1=mark, xref=xref, y0=0, y1=1, yref=f"{yref} domain",
             line=dict(color=colour, width=1, dash="dot"))
        for mark, colour in ((default, "#ff7f0e"), *(((band, "#17becf"),) if band_known else ()))
        if x.min() <= mark <= x.max()
        for xref, yref in (("x", "y"), ("x2", "y2"))
    ])
    _annotate_story(fig, rows, references, default=default, band=band if band_known else None, policy=policy)
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


#: two horizontal lines closer than this (in mass or recall) are drawn on top of each other
COINCIDE = 0.003


def coinciding(references: Sequence[Line], offline: Sequence[Line], key: str) -> list[tuple[Line, Line]]:
    """The pairs (policy's line, offline reference) that the chart would draw on top of each other."""
    return [(a, b) for a in references for b in offline if abs(getattr(a, key) - getattr(b, key)) < COINCIDE]


def _sweep_columns(rows: Sequence[Mapping]) -> dict[str, np.ndarray]:
    """The rows as columns sorted by recent_window (what the chart reads; no pandas on the way)."""
    rows = sorted(rows, key=lambda r: r["recent_window"])
    return {k: np.array([r[k] for r in rows]) for k in ("recent_window", "retained_mass", "top_k_recall")}


def _sweep_frame(rows: Sequence[Mapping]) -> pd.DataFrame:
    import pandas as pd

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


def _annotate_story(fig, rows: Sequence[Mapping], references: Sequence[Line], *, default: int, band: int | None,
                    policy: str) -> None:
    """Say in words what the curve shows, computed from the data (never a fixed sentence)."""
    peak, top = curve_peak(rows)
    where = " = the trace's band: the gain saturates here" if peak == band else ""
    fig.add_annotation(
        x=peak, y=top, xref="x", yref="y", text=f"peak at {peak}: {top:.3f}{where}",
        showarrow=True, arrowhead=2, ax=60, ay=-30, bgcolor="rgba(255,255,255,0.85)", xanchor="left",
        font=dict(size=13, color="#222"),
    )
    at_default = [r["retained_mass"] for r in rows if r["recent_window"] == default]
    streaming = next((line for line in references if line.policy == "streaming_llm"), None)
    if at_default and streaming is not None:
        v = float(at_default[0])
        s = streaming.retained_mass
        word = "less than" if v < s else "at least as much as"
        fig.add_annotation(
            x=default, y=v, xref="x", yref="y", text=f"at {default}, {policy} keeps {word} streaming_llm ({v:.3f} vs {s:.3f})",
            # low and to the right: under the curves there, clear of the reference lines' labels
            showarrow=True, arrowhead=2, ax=40, ay=75, bgcolor="rgba(255,255,255,0.85)", xanchor="left",
            font=dict(size=13, color="#222"),
        )


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
    import plotly.express as px  # here only: the kept view, the first page, never needs it

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
    import pandas as pd

    return pd.DataFrame(table)

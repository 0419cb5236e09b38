"""The kept view: one panel per replay (or one of what two replays keep differently), decode step
down, position across, the pooled images of ``pooling`` between a strip of the sink columns and a
strip of the newest positions by age, with the heavy hitters' fates beside their columns.

The figure is gathered as plain dicts (``_Drawing``) and built once, unvalidated: through Plotly's
objects, each property checked as it is set, the six-panel figure took longer than its pooling.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import plotly.graph_objects as go

from ...analysis.features import HeavyFate, TraceFeatures, heavy_fates
from ...policykit.base import WINDOW
from ...sim.harness import ReplayResult
from ..selection import Region
from .common import BAND_COLOUR, HEAVY_COLOUR, RECENT_COLOUR, panel_label, policy_label, subplots
from .pooling import BOTH, MIXED, ONLY_A, ONLY_B, panel_layers


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
    kept = _kept_histories(results, features, compare, layers, fates)
    T = features.steps
    region = (region or Region.whole(T)).clip(T)
    windows = [int(r.params.get(WINDOW, 0) or 0) for r in results]
    at = _Geometry.of(region, features, age_span(features, windows, max(r.budget for r in results)))
    panels = [(results[0], results[1])] if compare else [(r,) for r in results]
    block = block_size(results)
    cols = min(len(panels), max_cols)
    rows = math.ceil(len(panels) / cols)
    size = size or max(128, 1024 // cols)
    frame, refs = _frame(_titles(results, compare), rows, cols, ROW_HEIGHT * rows, at)
    d = _Drawing()
    for i, panel in enumerate(panels):
        d.at(*refs[i])
        pk = None if kept is None else [kept[results.index(r)] for r in panel]
        lay = layers[i] if layers is not None else panel_layers(pk, region, features.sinks, at.ages, size, block)
        if compare:
            fate = None
        else:
            fate = fates[results.index(panel[0])] if fates is not None else heavy_fates(pk[0], features)
        _panel(d, lay, panel, [windows[results.index(r)] for r in panel], fate, features, at, step, cols)
    if compare:
        _difference_legend(d, results[0], results[1])
    return d.figure(frame)


def block_size(results: Sequence[ReplayResult]) -> int:
    """The block size the replays ran under (``kvsim.policykit.layouts``; 1 without blocks): a panel's cells are
    then whole blocks. Replays under different block sizes are refused (one figure, one geometry)."""
    sizes = {getattr(r.layout, "block_size", 1) if r.layout is not None else 1 for r in results}
    if len(sizes) > 1:
        raise ValueError(f"kept_heatmap draws replays of one block size, got {sorted(sizes)}")
    return sizes.pop()


def _kept_histories(results: Sequence[ReplayResult], features: TraceFeatures, compare: bool,
                    layers: Sequence[dict] | None, fates: Sequence | None) -> list | None:
    """The replays' kept histories when the figure must pool or follow heavy hitters itself (None
    when ``layers`` and the fates are given); raises ValueError on replays it cannot draw."""
    if not results:
        raise ValueError("kept_heatmap needs at least one replay")
    if compare and len(results) < 2:
        raise ValueError("the difference view needs two replays")
    T = features.steps
    for result in results:
        if result.steps != T:
            raise ValueError(f"{result.policy}: replay has {result.steps} steps, the trace has {T}")
    if layers is not None and (compare or fates is not None):
        return None
    if any(r.kept_history is None for r in results):
        raise ValueError("kept_heatmap needs replays run with record_kept=True")
    return [r.kept_history for r in results]


#: the sink strip's and the age strip's widths, as shares of the region's width of positions
SINK_SHARE, AGE_SHARE = 0.10, 0.36
#: the height of a row of panels, in pixels of plot: with the key above the titles and the axis
#: below, one row of panels (the default view: two-line titles, a key of two rows) is
#: ``ROW_HEIGHT + TOP + BOTTOM`` = 507 px high, so the page's first screen at 1280 x 800 holds the
#: whole figure, its key and the first lines of its notes. ``TOP`` grows with the titles' lines and the
#: key's rows (``top_margin``).
ROW_HEIGHT, TOP, BOTTOM = 320, 142, 45
#: room above the key for Plotly's tool bar, drawn at the figure's top right while the pointer is on it
#: (the box select is there): on the key's first row it covered the band's entry at 1280 x 800
MODEBAR = 28
#: a line of a panel's title in pixels (16 px type at Plotly's line spacing of 1.3: a title of three
#: lines is 66 px high in Chromium), and the space between the key's bottom and the tallest title's top
TITLE_LINE, KEY_GAP = 22, 10
#: the key: a row of it in pixels (two rows are 58 px high in Chromium, its padding included), and what
#: an entry takes across (its symbol and gap, then each character of its name at 12 px, both rounded
#: up), counted in rows at ``KEY_WIDTH``, less than the narrowest the app draws the figure (900 px in a
#: window 1280 px wide with the sidebar open, less the margins and the key's inset)
KEY_ROW, KEY_ENTRY, KEY_CHAR, KEY_WIDTH = 30, 40, 5.6, 700


def title_lines(titles: Sequence[str]) -> int:
    """The most lines any panel's title takes (a serving layout's constraints add one, a long
    parameter list more)."""
    return max((t.count("<br>") + 1 for t in titles), default=1)


def key_rows(names: Sequence[str], width: float = KEY_WIDTH) -> int:
    """How many rows a horizontal key of ``names`` wraps to in ``width`` pixels (Plotly fills a row
    left to right and starts another when the next entry does not fit)."""
    rows, used = 1, 0.0
    for name in names:
        w = KEY_ENTRY + KEY_CHAR * len(re.sub(r"<[^>]*>", "", name))
        if used and used + w > width:
            rows, used = rows + 1, 0.0
        used += w
    return rows


def top_margin(titles: Sequence[str], names: Sequence[str]) -> tuple[int, int]:
    """The figure's top margin and the key's bottom above the panels, both in pixels: room for the
    key's rows above the tallest title, so that no row of the key lies on a title (under a serving
    layout the titles took a third line and the key's second row sat on them), and above the key the
    tool bar's (``MODEBAR``)."""
    above = KEY_GAP + TITLE_LINE * title_lines(titles)
    return above + KEY_ROW * max(2, key_rows(names)) + MODEBAR, above


@dataclass(frozen=True)
class _Geometry:
    """Where a panel's parts lie, in data coordinates: the region's image between the sink strip
    (at the left, ``sink_w`` wide, only when the trace has sinks) and the age strip (at the right,
    ``age_w`` wide, the newest ``ages`` positions), ``gap`` apart, under a ``header`` that holds the
    heavy hitters' heads (the strips' names are under the axis). Every panel shares it."""

    region: Region
    ages: int
    gap: float
    sink_w: float
    age_w: float
    x_lo: float
    x_hi: float
    header: float
    y_top: float

    @classmethod
    def of(cls, region: Region, features: TraceFeatures, ages: int) -> _Geometry:
        # at 5% and 22% of the region's width the strips were 8 and 37 px at 1280 x 800: too thin to read
        W = region.width
        gap = max(1.0, 0.02 * W)
        sink_w = SINK_SHARE * W if features.sinks else 0.0
        age_w = AGE_SHARE * W
        header = 0.09 * region.height  # the heavy hitters' ▼, and ×n above a shared one
        return cls(
            region, ages, gap, sink_w, age_w, x_lo=region.p0 - 0.5 - (gap + sink_w if features.sinks else 0),
            x_hi=region.p1 + 0.5 + gap + age_w, header=header, y_top=region.t0 - 0.5 - header,
        )

    @property
    def a0(self) -> float:
        """Where the age strip starts."""
        return self.region.p1 + 0.5 + self.gap


def _titles(results: Sequence[ReplayResult], compare: bool) -> list[str]:
    """Each panel's title: its policy and what it keeps, or, comparing, what the colours mean."""
    if compare:
        a, b = results[0], results[1]
        return [
            # two lines, as the panels' titles: on one, "orange: the reverse" ran off the figure at 1280 x 800
            f"<b>blue: kept by {policy_label(a)}</b> (mass {a.retained_mass:.3f}) <b>and not by {policy_label(b)}</b>"
            f"<br>orange: the reverse (mass {b.retained_mass:.3f}); grey: kept by both"
        ]
    return [
        f"{panel_label(r)}<br>mass {r.retained_mass:.3f} · top-{r.top_k} recall {r.top_k_recall:.3f}"
        for r in results
    ]


def _frame(titles: list[str], rows: int, cols: int, height: int, at: _Geometry) -> tuple[dict, list[tuple[str, str]]]:
    """The subplots, their axes and the layout, as a figure's dict, and each panel's axes."""
    region = at.region
    # the axes and the layout set as plain dicts: through Plotly's objects, most of the time
    # between two rows of panels: the upper row's axis and strips' names, and the lower row's titles
    between = 86 + TITLE_LINE * title_lines(titles)
    frame = subplots(titles, rows=rows, cols=cols, horizontal_spacing=0.025,
                     vertical_spacing=min(0.3, between / (height + 120)) if rows > 1 else 0.0)
    refs = [_refs(k) for k in range(1, rows * cols + 1)]
    layout = frame["layout"]
    ticks = _ticks(region.p0, region.p1)  # on the positions only: the strips beside them have their own labels
    for j, (xref, yref) in enumerate(refs):
        r, c = j // cols + 1, j % cols + 1
        xaxis, yaxis = layout["xaxis" + xref[1:]], layout["yaxis" + yref[1:]]
        xaxis.update(matches="x", range=[at.x_lo, at.x_hi], showgrid=False, zeroline=False, tickvals=ticks)
        if r == rows:
            xaxis["title"] = dict(text="position")
        # images pin the aspect ratio by default; the strips make the panel wider than tall, so let it fill
        yaxis.update(matches="y", range=[region.t1 + 0.5, at.y_top], showgrid=False, zeroline=False, scaleanchor=False)
        if c == 1:
            yaxis["title"] = dict(text="decode step")
        else:
            yaxis["showticklabels"] = False
    layout.update(
        height=height + TOP + BOTTOM,  # the top margin is set once the key's entries are known (``fit_key``)
        margin=dict(l=60, r=10, t=TOP, b=BOTTOM),
        # the key on top, above the panels' titles: read before the panels, and on the first screen
        legend=dict(orientation="h", yanchor="bottom", y=1, x=0, font=dict(size=12)),
        plot_bgcolor="white",
        dragmode="zoom",  # zoom by default; the box-select tool asks for a full-resolution region
    )
    return frame, refs


def _panel(d: _Drawing, lay: dict, panel: Sequence[ReplayResult], windows: Sequence[int],
           fate: Sequence[HeavyFate] | None, f: TraceFeatures, at: _Geometry, step: int | None, across: int) -> None:
    """One panel: its images (``lay``, ``panel_layers``), the edges in its age strip, the strips'
    labels, the heavy hitters' fates (``fate``; None in the difference view), their marks (grouped
    as ``heavy_marks`` groups them for ``across`` panels side by side) and the step line."""
    region = at.region
    br, bc, ba = lay["block"]
    name = " vs ".join(r.policy for r in panel)
    hover = "<extra>" + name + "</extra>"
    s = lay.get("block_size", 1)
    cell = (f"block of {bc} x {br}" if s == 1 else
            f"{'one cache block' if bc == s else f'{bc // s} cache blocks'} of {s} positions x {br} step{'s' * (br > 1)}")
    d.trace(type="image", source=lay["main"], x0=lay.get("origin", region.p0) + (bc - 1) / 2, dx=bc,
            y0=region.t0 + (br - 1) / 2, dy=br, name=name,
            hovertemplate=f"position %{{x:.0f}}<br>after step %{{y:.0f}}<br>{cell}" + hover)
    if lay["sink"] is not None:
        source, s = lay["sink"]
        dx = at.sink_w / s
        d.trace(type="image", source=source, x0=at.x_lo + dx / 2, dx=dx, y0=region.t0 + (br - 1) / 2, dy=br,
                name="sinks", hovertemplate="a sink column, widened<br>after step %{y:.0f}" + hover)
    if lay["age"] is not None:
        source, na = lay["age"]
        dx = at.age_w / na
        d.trace(type="image", source=source, x0=at.a0 + dx / 2, dx=dx, y0=region.t0 + (br - 1) / 2, dy=br,
                name="newest positions",
                hovertemplate=f"the newest {at.ages} positions by age, widened<br>after step %{{y:.0f}}" + hover)
        _age_marks(d, at, f, windows)
    _strip_labels(d, f, at)
    _heavy_heads(d, f, at, across)  # first: its key entry leads the heavy hitters' in the legend
    if fate is not None:
        _fates(d, fate, f, at)
    if step is not None and region.t0 <= step <= region.t1:
        d.line(at.x_lo, step, at.x_hi, step, dict(color="black", width=1, dash="dash"), f"step {step}", "step")


def _difference_legend(d: _Drawing, a: ReplayResult, b: ReplayResult) -> None:
    """The difference view's colours, as legend entries of no points."""
    d.at("x", "y")
    for colour, label in ((ONLY_A, f"kept by {a.policy} only"), (ONLY_B, f"kept by {b.policy} only"),
                          (BOTH, "kept by both"), (MIXED, "both kinds in one block")):
        d.trace(type="scatter", x=[None], y=[None], mode="markers", name=label,
                marker=dict(symbol="square", size=12, color=f"rgb{colour}", line=dict(color="black", width=1)))


@dataclass
class _Drawing:
    """What ``kept_heatmap`` draws on its panels, gathered as plain dicts and turned into a figure
    once (``figure``): built through Plotly's objects, each property checked as it is set, the
    figure of six panels took longer than pooling them. The lines are layout shapes, not traces:
    a browser draws a shape far more cheaply than a trace of its own (the six-panel figure opened
    as a link: 1.2 s with its lines as traces, 0.9 s as shapes, ``kvsim/bench/scripts/browser_floor.py``). A
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
        # plain numbers, whatever the type, to six figures (a hundredth of a position or step, far below a pixel:
        # at full precision the six-policy figure was 1.7 KB longer, 69.5 KB)
        path = "".join("M{:.6g},{:.6g}L{:.6g},{:.6g}".format(*map(float, seg)) for seg in segments)
        self.shapes.append(dict(type="path", path=path, xref=self.refs[0], yref=self.refs[1], line=line, name=name,
                                legendgroup=group, showlegend=False))

    def note(self, **props) -> None:
        self.notes.append(dict(props, xref=self.refs[0], yref=self.refs[1]))

    def figure(self, frame: dict) -> go.Figure:
        """``frame`` (the subplots, axes and layout, as a figure's dict) with everything drawn
        added; not validated again (the tests validate the result once, so a misspelt property
        still fails there)."""
        layout = frame["layout"]
        titles = [a["text"] for a in layout.get("annotations", [])]  # the subplots' titles: the frame's only notes
        layout["annotations"] = layout.get("annotations", []) + self.notes
        layout["shapes"] = layout.get("shapes", []) + self.shapes
        data = frame.get("data", []) + self.traces
        height, top, y = _key_place(layout["height"], layout["margin"], titles,
                                    [x["name"] for x in [*data, *self.shapes] if _in_key(x)])
        layout.update(height=height)
        layout["margin"]["t"] = top
        layout["legend"]["y"] = y
        return go.Figure(dict(data=data, layout=layout), _validate=False)


def _in_key(x: dict) -> bool:
    """Whether a trace or shape (as a dict) has an entry in the key: a shape or trace that says so, a
    scatter that does not say otherwise (an image never has one)."""
    shown = x.get("showlegend")
    return bool(x.get("name")) and (shown if shown is not None else x.get("type") == "scatter")


def fit_key(fig: go.Figure) -> go.Figure:
    """``fig`` (a kept figure, changed in place) with its top margin and key placed again for the
    entries it has now: for a figure drawn on after ``kept_heatmap`` (a pass-key trial's marks add
    entries to the key)."""
    layout = fig.layout
    titles = [a.text for a in layout.annotations if a.yref == "paper"]  # the subplots' titles
    names = [x.name for x in [*fig.data, *layout.shapes]
             if x.name and _in_key({"name": x.name, "showlegend": getattr(x, "showlegend", None), "type": x.type})]
    height, top, y = _key_place(layout.height, dict(t=layout.margin.t, b=layout.margin.b), titles, names)
    fig.update_layout(height=height, margin_t=top, legend_y=y)
    return fig


def _key_place(height: int, margin: dict, titles: Sequence[str], names: Sequence[str]) -> tuple[int, int, float]:
    """The figure's height, its top margin and the key's ``y`` (in the panels' heights, from their
    bottom) that put the key's rows above the tallest title (``top_margin``), the panels' height
    unchanged."""
    plot = height - margin["t"] - margin["b"]
    top, above = top_margin(titles, names)
    return plot + top + margin["b"], top, 1 + above / plot


def _ticks(lo: int, hi: int, n: int = 5) -> list[int]:
    """Round tick values from ``lo`` to ``hi``: steps of 1, 2 or 5 times a power of ten."""
    span = max(1, hi - lo)
    raw = span / n
    power = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    return list(range(int(first), int(hi) + 1, int(step)))


def _age_marks(d: _Drawing, at: _Geometry, f: TraceFeatures, windows: Sequence[int]) -> None:
    """In the age strip: the trace's band edge (orange) and each policy's protected window (green)."""
    ages = at.ages
    per_age = at.age_w / ages
    marks = []
    if f.band_known and f.band <= ages:
        marks.append((f.band, BAND_COLOUR, "dot", f"band edge (age {f.band})", "band"))
    for w in sorted(set(w for w in windows if 0 < w <= ages)):
        marks.append((w, RECENT_COLOUR, "dash", f"protected window (age {w})", f"window{w}"))
    for age, colour, dash, name, group in marks:
        x = at.a0 + age * per_age
        # from the image's top down: through the header the line crossed the strip's name
        d.line(x, at.region.t0 - 0.5, x, at.region.t1 + 0.5, dict(color=colour, width=2.5, dash=dash), name, group)


def _strip_labels(d: _Drawing, f: TraceFeatures, at: _Geometry) -> None:
    """The strips' names, under them on the level of the axis's title, beside "position": clear of
    the tick labels, of every line (in the header the band's edge ran through "newest 128") and of
    the heavy hitters' marks and counts."""
    xref, yref = d.refs
    note = dict(showarrow=False, font=dict(size=11, color="#333"), xref=xref, yref=yref + " domain", y=0,
                yanchor="top", yshift=-36)
    if f.sinks:
        d.notes.append(dict(note, x=at.x_lo + at.sink_w / 2, text="sinks"))
    d.notes.append(dict(note, x=at.a0 + at.age_w / 2, text=f"newest {at.ages} →"))


def _refs(k: int) -> tuple[str, str]:
    """The axes of the ``k``-th subplot (from 1, row by row), as ``make_subplots`` numbers them."""
    n = "" if k == 1 else k
    return f"x{n}", f"y{n}"


#: a heavy hitter's mark (a 9 px triangle) takes about this share of a panel's width of positions:
#: heavy hitters closer than that are drawn as one mark, ×n above it (the canonical trace's 24 as 8 at
#: the whole run). Three panels across the app at 1280 x 800 give each main image about 155 px, a
#: triangle 6% of it: 2% a panel across (at 1.2%, set for wider panels, two marks could touch there)
MARK_SHARE = 0.02


def heavy_marks(positions: Sequence[int], span: int, panels: int = 1) -> list[list[int]]:
    """``positions`` (heavy hitters) grouped as a reader sees their marks over ``span`` positions in
    one of ``panels`` panels side by side: neighbours closer than a mark's width make one group."""
    near = max(1.0, span * MARK_SHARE * max(1, min(panels, 3)))
    groups: list[list[int]] = []
    for p in sorted(positions):
        if groups and p - groups[-1][-1] <= near:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def _heavy_heads(d: _Drawing, f: TraceFeatures, at: _Geometry, across: int = 1) -> None:
    """A red triangle above each heavy hitter's column, in the header: where to look. Neighbours
    closer than a triangle's width (``heavy_marks``, ``across`` panels side by side) share one, ×n
    written above it: the count the notes say is the count drawn (24 triangles drawn on one another
    read as 8, beside a note of 24)."""
    inside = [p for p, _, _ in f.heavy if at.region.p0 <= p <= at.region.p1]
    if not inside:
        return
    groups = heavy_marks(inside, at.region.p1 - at.region.p0 + 1, across)
    d.trace(type="scatter", x=[g[0] for g in groups], y=[at.y_top + at.header * 0.78] * len(groups),
            mode="markers+text", text=[f"×{len(g)}" if len(g) > 1 else "" for g in groups], textposition="top center",
            textfont=dict(size=10, color="#b01e1e"), customdata=[", ".join(map(str, g)) for g in groups],
            name="heavy hitter (×n: n side by side)", marker=dict(symbol="triangle-down", size=9, color=HEAVY_COLOUR),
            group="heavyhead", cliponaxis=False, hovertemplate="heavy hitters at positions %{customdata}<extra></extra>")


def _fates(d: _Drawing, fates: Sequence[HeavyFate], f: TraceFeatures, at: _Geometry) -> None:
    """Beside each heavy hitter's column (offset so the column itself stays visible): solid while
    the policy holds it and it is live, an x where it is evicted while live, dotted while missed."""
    region = at.region
    off = at.gap * 0.6
    held = "held while live" if f.live_known else "held"
    missed = "evicted, still live" if f.live_known else "evicted"
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


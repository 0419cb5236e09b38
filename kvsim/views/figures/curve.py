"""The recent_window curve: retained mass and top-k recall against recent_window for one policy's
sweep, other policies' sweeps beside it, and the figures that do not move with recent_window
(deployable policies, offline references, the upper bound) as horizontal lines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from ...analysis.features import curve_peak
from ...analysis.windows import WindowChoice, choose_window
from ...policies import POLICIES, Display
from ...policykit.base import WINDOW
from ...policykit.registry import display_of
from .common import CURRENT_COLOUR, subplots

#: the recommended window's mark (a colour no policy and no other mark has)
RECOMMENDED_COLOUR = "#111111"

#: one style per registered policy (its class's ``display``), whatever its role on the chart, so a series
#: is told apart by its colour and by its line (dash, width, marker) alike: the policies with a
#: recent_window are curves with a marker each (the primary curve marks every point, a companion a
#: few); the others are horizontal lines, deployable ones wide and dashed, the offline references (they
#: read the future) dotted and grey, the upper bound dotted black. No colour is the marks' (orange
#: default, cyan band, red current). The dashes are lengths in px, not Plotly's names: its named dashes
#: scale with the line's width, so "dash" and "longdash" are both even on-off at two sizes, and at width
#: 4 tova's and streaming_llm's looked alike (issue 31, item 5). Every line's pattern differs in its
#: proportions (``dash_pattern``), not only in size: a long dash, a dash-dot, a double dash, a
#: dash-dot-dot, sparse dots, dense dots, three dots and a gap.
Style = Display


class _PolicyStyles(Mapping):
    """The registered policies that declare a ``display``, name -> style: read off the registry each
    time, so a policy registered later is drawn in its own style."""

    def __getitem__(self, name: str) -> Style:
        display = display_of(name)
        if display is None:
            raise KeyError(name)
        return display

    def __iter__(self):
        return iter([name for name, cls in POLICIES.items() if cls.display is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


POLICY_STYLES: Mapping[str, Style] = _PolicyStyles()
#: the per-step upper bound: not a policy
BOUND_STYLE = Style("black", "2px,2px", 2)
#: a policy that declares no ``display``: these in turn, then these colours again
SPARE_STYLES = (Style("#393b79", "solid", 2, "pentagon"), Style("#637939", "dash", 3, "hexagon"),
                Style("#843c39", "longdash", 3, "star-triangle-up"), Style("#7b4173", "dashdot", 3, "hourglass"))
#: how many points of a companion curve carry its marker (all of them would hide the lines under it)
COMPANION_MARKERS = 14
#: how many of the primary curve's points carry its marker (every point is still hovered and clicked): two to
#: three pixels apart at 6 px across, its 1,023 markers a panel at budget 1024 drew as one thick band and took
#: Plotly 0.18 s of the figure's 0.29 s (``kvsim/bench/scripts/figure_draw.py``); at budget 256 every other one
PRIMARY_MARKERS = 128


def style_of(name: str | None, kind: str = "policy") -> Style:
    """The style of ``name``'s series (``kind`` "bound": the upper bound's)."""
    if kind == "bound":
        return BOUND_STYLE
    display = display_of(name or "")
    if display is not None:
        return display
    return SPARE_STYLES[sum(map(ord, name or "")) % len(SPARE_STYLES)]


def dash_pattern(style: Style) -> tuple[float, ...]:
    """The on-off lengths (px) the browser draws ``style``'s line with: () for a solid line; a named
    dash as plotly.js's ``Drawing.dashStyle`` makes it (scaled by the width, at least 3 px); a list of
    lengths as written."""
    dash, unit = style.dash, max(float(style.width), 3.0)
    named = {"solid": (), "dot": (1, 1), "dash": (3, 3), "longdash": (5, 5), "dashdot": (3, 1, 1, 1),
             "longdashdot": (5, 2, 1, 2)}
    if dash in named:
        return tuple(unit * k for k in named[dash])
    return tuple(float(part.strip().removesuffix("px")) for part in dash.replace("%", "").split(","))


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
    budget: int | None = None,
    plot_height: int | None = None,
) -> go.Figure:
    """Retained mass (top) and top-k recall (bottom) against recent_window.

    ``policy``'s sweep (``rows``) is the primary curve: it carries the markers at the shipped
    ``default`` and at the trace's ``band`` (labelled as assumed unless ``band_known``), the
    ``current`` recent_window, and the notes computed from the data. ``companions`` are other
    policies swept over the same recent_windows, drawn beside it without markers. ``lines`` are the
    horizontal ones (``Line``): deployable policies in the policies legend, offline references
    dotted under a legend of their own, the upper bound black and the others grey. Curve points
    carry their recent_window as ``customdata`` so a selection can set it. With ``budget``, the
    primary curve's best and recommended windows (``kvsim.analysis.windows``) are marked and named as
    such when ``rows`` hold every window 1 .. budget - 1; otherwise its peak is the peak so far, of
    the windows sampled (without ``budget``: its peak).
    """
    if not rows:
        raise ValueError("recent_window_curve needs at least one sweep row")
    df = _sweep_columns(rows)
    x = df[WINDOW]
    others = {name: _sweep_columns(r) for name, r in (companions or {}).items() if r}
    offline = [line for line in lines if line.offline]
    # streaming_llm is the line the story compares against: the boldest style goes to it
    references = sorted((line for line in lines if not line.offline), key=lambda line: line.policy != "streaming_llm")
    metrics = (("retained_mass", "retained mass"), ("top_k_recall", f"top-{top_k} recall"))
    fig = _Chart(subplots([m[1] for m in metrics], rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08))
    lo, hi = float(x.min()), float(x.max())
    choice = None if budget is None else choose_window(rows, budget=budget)
    for r, (key, label) in enumerate(metrics, start=1):
        y = df[key]
        # the lines first, so the curves and the markers lie on top of them
        _lines(fig, r, key, label, references, offline, lo, hi)
        _curves(fig, r, key, label, x, y, others, policy)
        # a trace without a band gets no band mark: there is no width to point at
        marks = [(default, f"shipped default ({default})", "#ff7f0e", "circle")]
        if band_known:
            marks.append((band, f"trace band ({band})", "#17becf", "square"))
        if choice is not None and choice.exact:
            marks = _with_recommended(marks, choice)
        _marks(fig, r, label, x, y, marks, current)
    # a dotted line down both panels at each mark
    fig.layout["shapes"] = [
        dict(type="line", x0=mark, x1=mark, xref=xref, y0=0, y1=1, yref=f"{yref} domain",
             line=dict(color=colour, width=1, dash="dot"))
        for mark, colour in ((default, "#ff7f0e"), *(((band, "#17becf"),) if band_known else ()))
        if x.min() <= mark <= x.max()
        for xref, yref in (("x", "y"), ("x2", "y2"))
    ]
    _annotate_story(fig, rows, references, default=default, band=band if band_known else None, policy=policy, choice=choice,
                    lines=lines, plot_height=PLOT_HEIGHT if plot_height is None else plot_height)
    fig.layout["xaxis2"]["title"] = dict(text=WINDOW)
    _legends(fig, policy, PLOT_HEIGHT if plot_height is None else plot_height)
    return fig.figure()


@dataclass
class _Chart:
    """The figure being drawn, as plain dicts: Plotly's objects validate every property as it is set,
    which was most of the chart's time (0.33 s of the curve view's 0.41 s at budget 1024, profiled);
    the figure is the same JSON, and the tests validate it once, so a misspelt property still fails."""

    frame: dict

    @property
    def layout(self) -> dict:
        return self.frame["layout"]

    @property
    def data(self) -> list[dict]:
        return self.frame["data"]

    def scatter(self, row: int, **props) -> None:
        """A scatter trace on panel ``row`` (1: the upper one)."""
        n = "" if row == 1 else row
        self.data.append(dict(type="scatter", **props, xaxis=f"x{n}", yaxis=f"y{n}"))

    def note(self, **props) -> None:
        self.layout.setdefault("annotations", []).append(props)

    def figure(self) -> go.Figure:
        return go.Figure(self.frame, _validate=False)


#: the chart's plotting height (two panels), and what a legend's row takes, title rows included (13 px
#: text): the legends are placed by these, in pixels, so none can run into another or off the figure
PLOT_HEIGHT = 580
LEGEND_ROW = 21
#: room under the lower panel for its tick labels and the axis title
AXIS_ROOM = 48
#: between the panels, around the legends: above them the upper panel's tick labels, below them the
#: lower panel's title
KEY_ABOVE, KEY_BELOW = 34, 40


def _legends(fig, policy: str, plot_height: int = PLOT_HEIGHT) -> None:
    """Three legends between the panels, one entry per row so each one's height is known: the policies
    on the left; the offline references, and under them the marks on ``policy``'s curve, on the right.
    Under the lower panel they were below the fold at 1280 x 800 (issue 56); between the panels they
    follow the retained mass, the panel the story reads, on the first screen. Each panel keeps its
    height (``plot_height`` shared as before); the gap between them is as tall as the taller column of
    legends needs, so no legend overlaps another, a panel or the figure's edge, whatever width the
    figure is drawn at (a label is never cut)."""
    entries = {"legend": 0, "legend2": 0, "legend3": 0}
    for t in fig.data:
        if t.get("showlegend") is not False:
            entries[t.get("legend") or "legend"] += 1
    left = (1 + entries["legend"]) * LEGEND_ROW
    right = (1 + entries["legend2"]) * LEGEND_ROW + LEGEND_ROW // 2
    block = max(left, right + (1 + entries["legend3"]) * LEGEND_ROW) + 12
    panel = plot_height * (1 - 0.08) / 2  # each panel's height, as ``_upper_panel`` has it
    plot = round(2 * panel + KEY_ABOVE + block + KEY_BELOW)
    top_margin = 40
    height = plot + top_margin + AXIS_ROOM
    layout = fig.layout
    layout["yaxis"] = {**layout.get("yaxis", {}), "domain": [1 - panel / plot, 1.0]}
    layout["yaxis2"] = {**layout.get("yaxis2", {}), "domain": [0.0, panel / plot]}
    layout["xaxis"] = {**layout.get("xaxis", {}), "showticklabels": True}  # the upper panel read on its own
    upper_title, lower_title = layout["annotations"][:2]  # ``subplots``' titles, first of the notes
    upper_title["y"], lower_title["y"] = 1.0, panel / plot
    top = 1 - (top_margin + panel + KEY_ABOVE) / height  # container coordinates: 0 at the figure's foot

    def legend(x: float, anchor: str, y: float, title: str) -> dict:
        # titles sized explicitly: a theme styles the first legend's title, never the extra legends'
        return dict(orientation="v", xref="container", yref="container", x=x, xanchor=anchor, y=y, yanchor="top",
                    font=dict(size=13), tracegroupgap=0, itemsizing="constant",
                    title=dict(text=title, side="top", font=dict(size=13)))

    layout.update(
        height=height, margin=dict(l=60, r=20, t=top_margin, b=AXIS_ROOM, autoexpand=False), hovermode="closest",
        legend=legend(0.01, "left", top, "<b>policies</b>"),
        legend2=legend(0.99, "right", top, OFFLINE_TITLE),
        legend3=legend(0.99, "right", top - right / height, f"<b>marks on {policy}</b>"),
    )


def _lines(fig, r: int, key: str, label: str, references: Sequence[Line], offline: Sequence[Line], lo: float,
           hi: float) -> None:
    """Panel ``r``'s horizontal lines, and a note where a policy's and an offline reference's are one.
    The policies' lines wide and pale under the offline references' thin dotted ones, so a policy
    that matches a reference (tova and the upper bound, on the canonical trace) shows as both."""
    for j, line in enumerate(references):
        _hline(fig, r, line, key, label, lo, hi, legend="legend", rank=100 + j)
    for j, line in enumerate(offline):
        _hline(fig, r, line, key, label, lo, hi, legend="legend2", rank=200 + j)
    for ref, off in coinciding(references, offline, key):
        fig.note(
            x=hi, y=getattr(off, key), xref=f"x{'' if r == 1 else r}", yref=f"y{'' if r == 1 else r}",
            text=f"{ref.label} {getattr(ref, key):.4f} and {off.label.split(' (')[0]} {getattr(off, key):.4f}: one line",
            showarrow=True, arrowhead=2, ax=-20, ay=28, xanchor="right", bgcolor="rgba(255,255,255,0.85)",
            font=dict(size=12, color="#222"),
        )


def _curves(fig, r: int, key: str, label: str, x: np.ndarray, y: np.ndarray, others: Mapping[str, dict],
            policy: str) -> None:
    """Panel ``r``'s curves: the companions', then the primary policy's on top, each point carrying
    its recent_window as ``customdata``."""
    for j, (name, other) in enumerate(others.items()):
        style = style_of(name)
        ox = other[WINDOW]
        fig.scatter(
            r, x=ox, y=other[key], mode="lines+markers" if style.symbol else "lines", name=name, legendgroup=name,
            showlegend=(r == 1), legendrank=10 + j, line=dict(color=style.colour, width=style.width, dash=style.dash),
            marker=dict(symbol=style.symbol, size=7, color=style.colour, maxdisplayed=COMPANION_MARKERS),
            customdata=ox, hovertemplate="recent_window %{x}<br>" + label + " %{y:.4f}<extra>" + name + "</extra>",
        )
    style = style_of(policy)
    fig.scatter(
        r, x=x, y=y, mode="lines+markers", name=policy, legendgroup=policy, showlegend=(r == 1), legendrank=1,
        line=dict(color=style.colour, width=style.width + 1, dash=style.dash),
        marker=dict(symbol=style.symbol or "circle", size=6, color=style.colour, maxdisplayed=PRIMARY_MARKERS),
        customdata=x, hovertemplate="recent_window %{x}<br>" + label + " %{y:.4f}<extra>" + policy + "</extra>",
    )


def _with_recommended(marks: list[tuple], choice: WindowChoice) -> list[tuple]:
    """The marks with the recommended window's: said on the mark already there (the band's, on the
    canonical trace) rather than drawn over it, else a ring of its own."""
    said = f"recommended: the smallest within {choice.tolerance:g} of the best"
    if any(mark == choice.recommended for mark, *_ in marks):
        return [(m, f"{text}, {said}" if m == choice.recommended else text, c, sym) for m, text, c, sym in marks]
    return [*marks, (choice.recommended, f"recommended ({choice.recommended}): the smallest within {choice.tolerance:g} "
                     "of the best", RECOMMENDED_COLOUR, "hexagon-open")]


def _marks(fig, r: int, label: str, x: np.ndarray, y: np.ndarray, marks: Sequence[tuple], current: int | None) -> None:
    """On panel ``r``'s primary curve: each of ``marks`` ``(recent_window, name, colour, symbol)``
    that the sweep reached, and the current recent_window as a star."""
    for mark, text, colour, symbol in marks:
        hit = x == mark
        if hit.any():
            # a mark at the current value would hide under its star: it rings the star instead
            ring = dict(size=28, symbol=f"{symbol.removesuffix('-open')}-open", line=dict(color=colour, width=3)) if mark == current else {}
            if symbol.endswith("-open") and not ring:  # an open mark rings its point: a mark under it stays seen
                ring = dict(size=22, line=dict(color=colour, width=2.5))
            fig.scatter(
                r, x=x[hit], y=y[hit], mode="markers", name=text, legendgroup=text, showlegend=(r == 1), legend="legend3",
                marker=dict(size=12, color=colour, symbol=symbol, line=dict(color="black", width=1)) | ring,
                hovertemplate=text + "<br>" + label + " %{y:.4f}<extra></extra>",
            )
    if current is not None and (x == current).any():
        fig.scatter(
            r, x=[current], y=y[x == current], mode="markers", name=f"current recent_window ({current})",
            legendgroup="current", showlegend=(r == 1), legend="legend3",
            marker=dict(size=18, color=CURRENT_COLOUR, symbol="star", line=dict(color="black", width=1)),
            hovertemplate="current recent_window %{x}<br>" + label + " %{y:.4f}<extra></extra>",
        )


#: two horizontal lines closer than this (in mass or recall) are drawn on top of each other
COINCIDE = 0.003


def coinciding(references: Sequence[Line], offline: Sequence[Line], key: str) -> list[tuple[Line, Line]]:
    """The pairs (policy's line, offline reference) that the chart would draw on top of each other."""
    return [(a, b) for a in references for b in offline if abs(getattr(a, key) - getattr(b, key)) < COINCIDE]


def _sweep_columns(rows: Sequence[Mapping]) -> dict[str, np.ndarray]:
    """The rows as columns sorted by recent_window (what the chart reads; no pandas on the way)."""
    rows = sorted(rows, key=lambda r: r[WINDOW])
    return {k: np.array([r[k] for r in rows]) for k in (WINDOW, "retained_mass", "top_k_recall")}


def _hline(fig, row, line: Line, key: str, label: str, lo: float, hi: float, *, legend: str, rank: int) -> None:
    """A line as a two-point line across the swept range, hoverable, listed in ``legend``, in its
    policy's style (a line without ``policy``: the one its label starts with)."""
    name, value = line.label, getattr(line, key)
    style = style_of(line.policy or line.label.split(" ")[0], line.kind)
    fig.scatter(
        row, x=[lo, hi], y=[value, value], mode="lines", name=name, legendgroup=name, showlegend=(row == 1),
        legend=legend, legendrank=rank, line=dict(color=style.colour, dash=style.dash, width=style.width),
        hovertemplate=f"{name}<br>{label} {value:.4f}<extra></extra>",
    )


#: what the notes' places are worked out at: the upper panel's plotting width at its narrowest in the
#: app (the chart column at 1500 x 1100 less the margins; wider only spreads the data under a note) and
#: a note's text (13 px): height, width per character, and the room kept around it
NOTE_PANEL_W = 640
NOTE_PX = (20, 7.2)
NOTE_ROOM = 4
#: how far above the panel a note may reach: into the figure's top margin (40 px), under its edge
NOTE_ABOVE = 30


@dataclass(frozen=True)
class _Panel:
    """The upper panel in pixels: the data ranges it shows and its size, to place a note by."""

    x_range: tuple[float, float]
    y_range: tuple[float, float]
    height: float

    def px(self, x: float, y: float) -> tuple[float, float]:
        """Screen offsets (right, down) of the point (x, y) from the panel's top left corner."""
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        return (x - x0) / max(x1 - x0, 1e-9) * NOTE_PANEL_W, (y1 - y) / max(y1 - y0, 1e-9) * self.height


def note_spot(panel: _Panel, x: float, y: float, text: str, rightwards: bool, lines: Sequence[float],
              points: Sequence[tuple[float, float]], taken: Sequence[tuple[float, float, float, float]] = (),
              dx: float = 30) -> tuple[float, tuple[float, float, float, float]]:
    """Where the note ``text`` (``<br>`` between its lines) on the point (x, y) goes: its ``ay`` (px, up
    negative) and its box (px, from the panel's corner), the nearest place where the box crosses none of
    the horizontal ``lines`` (their y), covers none of the ``points`` (the curves) and none of the
    ``taken`` boxes, its arrow crosses no taken box, and it stays in the panel; the one crossing fewest
    where none is clear. A note on a line read as that line's label."""
    px, py = panel.px(x, y)
    rows_of_text = text.split("<br>")
    w, h = NOTE_PX[1] * max(map(len, rows_of_text)) + 8, NOTE_PX[0] + (NOTE_PX[0] - 4) * (len(rows_of_text) - 1)
    left = px + dx if rightwards else px - dx - w
    rows = [panel.px(x, v)[1] for v in lines]
    dots = [panel.px(a, b) for a, b in points]
    best = None
    for ay in sorted([*range(-30, -241, -15), *range(30, 241, 15)], key=lambda a: (abs(a), a > 0)):
        box = (left, py + ay - h / 2, left + w, py + ay + h / 2)
        if box[1] < -NOTE_ABOVE or box[3] > panel.height:
            continue
        x0, y0, x1, y1 = (box[0] - NOTE_ROOM, box[1] - NOTE_ROOM, box[2] + NOTE_ROOM, box[3] + NOTE_ROOM)
        tail = (box[0] if rightwards else box[2], py + ay)
        arrow = [(px + (tail[0] - px) * k / 16, py + (tail[1] - py) * k / 16) for k in range(1, 16)]
        hits = (sum(y0 <= r <= y1 for r in rows) + sum(x0 <= a <= x1 and y0 <= b <= y1 for a, b in dots)
                + sum(x0 < t[2] and t[0] < x1 and y0 < t[3] and t[1] < y1 for t in taken)
                + sum(any(t[0] <= a <= t[2] and t[1] <= b <= t[3] for a, b in arrow) for t in taken[1:]))
        if best is None or hits < best[0]:
            best = (hits, ay, box)
        if hits == 0:
            break
    if best is None:  # a panel too short for any place: above, as before
        return -30, (left, py - 30 - h / 2, left + w, py - 30 + h / 2)
    return best[1], best[2]


def _upper_panel(fig, plot_height: int) -> _Panel:
    """The upper panel's ranges, set here (Plotly's own would be unknown to ``note_spot``): the data of
    every series on it, with a margin."""
    xs = [v for t in fig.data if t.get("yaxis") == "y" for v in t["x"] if v is not None]
    ys = [v for t in fig.data if t.get("yaxis") == "y" for v in t["y"] if v is not None]
    lo, hi = float(min(ys)), float(max(ys))
    pad = max(hi - lo, 0.02) * 0.06
    y_range = (lo - pad, hi + pad)
    fig.layout["yaxis"] = {**fig.layout.get("yaxis", {}), "range": list(y_range)}
    x_lo, x_hi = float(min(xs)), float(max(xs))
    x_pad = max(x_hi - x_lo, 1) * 0.03
    x_range = (x_lo - x_pad, x_hi + x_pad)
    for axis in ("xaxis", "xaxis2"):  # shared: both panels show the same windows
        fig.layout[axis] = {**fig.layout.get(axis, {}), "range": list(x_range)}
    # the two panels share the plotting height, less the gap between them (``subplots``' vertical_spacing)
    return _Panel(x_range, y_range, plot_height * (1 - 0.08) / 2)


def _annotate_story(fig, rows: Sequence[Mapping], references: Sequence[Line], *, default: int, band: int | None,
                    policy: str, choice: WindowChoice | None = None, lines: Sequence[Line] = (),
                    plot_height: int = PLOT_HEIGHT) -> None:
    """Say in words what the curve shows, computed from the data (never a fixed sentence): the best
    and recommended windows where ``choice`` is exact, the peak so far where it is of a sample. Each
    note is placed clear of the horizontal ``lines``, the curves and the notes before it (``note_spot``)."""
    panel = _upper_panel(fig, plot_height)
    levels = [line.retained_mass for line in lines]
    points = [(float(a), float(b)) for t in fig.data if t.get("yaxis") == "y" and len(t["x"]) > 2
              for a, b in zip(t["x"], t["y"], strict=True) if a is not None and b is not None]
    # the panel's title ("retained mass"), centred in the room above it
    title = (NOTE_PANEL_W / 2 - 60, -NOTE_ABOVE, NOTE_PANEL_W / 2 + 60, 0)
    taken: list[tuple[float, float, float, float]] = [title]
    for note in fig.layout.get("annotations", []):  # the notes already there (two lines drawn as one)
        if note.get("yref") == "y" and note.get("showarrow"):
            px, py = panel.px(note["x"], note["y"])
            w, h = NOTE_PX[1] * len(note["text"]) + 8, NOTE_PX[0]
            tail_x, tail_y = px + note.get("ax", 0), py + note.get("ay", 0)
            x0 = {"right": tail_x - w, "left": tail_x}.get(note.get("xanchor"), tail_x - w / 2)
            taken.append((x0, tail_y - h / 2, x0 + w, tail_y + h / 2))
    style = dict(showarrow=True, arrowhead=2, bgcolor="rgba(255,255,255,0.85)", font=dict(size=13, color="#222"))
    peak, top = curve_peak(rows)
    # on a line of its own: one long line had room nowhere between the lines and the curves
    where = "<br>= the trace's band: the gain saturates here" if peak == band else ""
    if choice is None:
        text = f"peak at {peak}: {top:.3f}{where}"
    elif not choice.exact:
        text = f"peak so far at {peak}: {top:.3f}{where} (of the windows sampled)"
    elif choice.recommended == choice.best:
        text = f"best and recommended {peak}: {top:.3f}{where}"
    else:
        text = f"best {peak}: {top:.3f}{where}"
        # the note reads away from the nearer edge: Plotly widens the axis to fit a note, and one at window
        # 63 of 1 .. 1023 reading leftwards stretched the axis to -600. Its rule is in the legend ("marks on")
        windows = [r[WINDOW] for r in rows]
        rightwards = choice.recommended - min(windows) < (max(windows) - min(windows)) / 2
        said = f"recommended {choice.recommended}: {choice.recommended_mass:.3f}"
        ay, box = note_spot(panel, choice.recommended, choice.recommended_mass, said, rightwards, levels, points, taken)
        taken.append(box)
        fig.note(x=choice.recommended, y=choice.recommended_mass, xref="x", yref="y", text=said,
                 ax=30 if rightwards else -30, ay=ay, xanchor="left" if rightwards else "right", **style)
    ay, box = note_spot(panel, peak, top, text, True, levels, points, taken, dx=60)
    taken.append(box)
    fig.note(x=peak, y=top, xref="x", yref="y", text=text, ax=60, ay=ay, xanchor="left", **style)
    # the comparison with streaming_llm last: it has the most room to give way to the windows' notes
    at_default = [r["retained_mass"] for r in rows if r[WINDOW] == default]
    streaming = next((line for line in references if line.policy == "streaming_llm"), None)
    if at_default and streaming is not None:
        v = float(at_default[0])
        s = streaming.retained_mass
        word = "less than" if v < s else "at least as much as"
        text = f"at {default}, {policy} keeps {word} streaming_llm ({v:.3f} vs {s:.3f})"
        ay, box = note_spot(panel, default, v, text, True, levels, points, taken, dx=40)
        fig.note(x=default, y=v, xref="x", yref="y", text=text, ax=40, ay=ay, xanchor="left", **style)

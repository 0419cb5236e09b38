"""The kept-positions view: each policy's cache over the whole run, pooled to the pixels on screen,
with a box select re-drawing a region at full resolution, and the notes on sinks, band and heavy hitters.
"""

from __future__ import annotations

import streamlit as st

import kvsim
from kvsim.policies import PolicySpec
from kvsim.policykit.layouts import Layout
from kvsim.views import figures, story, turns

from . import needle_kept
from .charts import selectable
from .controls import Settings
from .downloads import csv_button, html_button, stem
from .memo import BY_TRACE, TOP_K, cached_features, describe, kept_history, replays
from .state import KEPT_MODES, mirrored, zoom_reset

#: pixels across the kept images, shared among the panels of a row
KEPT_PIXELS = 1024
#: the session key of the zoom's expander: True while it is open
ZOOM_OPEN = "zoom_open"
#: the session key of the "how to read this picture" expander: True while it is open
HOW_OPEN = "kept_how_open"


@st.cache_resource(max_entries=64, show_spinner=False, hash_funcs=BY_TRACE)
def cached_fates(trace: kvsim.Trace, spec: PolicySpec, layout: Layout | None = None) -> list:
    """When the replay held and lost each heavy hitter of the trace (the kept view's notes)."""
    return figures.heavy_fates(kept_history(trace, spec, layout), cached_features(trace))


@st.cache_resource(max_entries=48, show_spinner="drawing the kept positions", hash_funcs=BY_TRACE)
def cached_layers(trace: kvsim.Trace, runs: tuple[PolicySpec, ...], region: tuple, ages: int, size: int,
                  layout: Layout | None = None) -> dict:
    """One panel's pooled images (``runs``: one run, or two for the difference), encoded once; under a
    layout with blocks, a cell is one block of the cache or several."""
    kept = [kept_history(trace, spec, layout) for spec in runs]
    return figures.panel_layers(kept, figures.Region(*region), cached_features(trace).sinks, ages, size,
                                block_size=1 if layout is None else layout.block_size)


def kept_layers(trace: kvsim.Trace, runs: tuple[PolicySpec, ...], region: tuple, ages: int, size: int,
                compare: bool, layout: Layout | None = None) -> list[dict]:
    """Each kept panel's pooled images: one panel per run, or one for the first two's difference."""
    panels = [tuple(runs[:2])] if compare else [(r,) for r in runs]
    return [cached_layers(trace, panel, region, ages, size, layout) for panel in panels]


@st.cache_resource(max_entries=32, show_spinner=False, hash_funcs=BY_TRACE)
def cached_kept_figure(trace: kvsim.Trace, runs: tuple[PolicySpec, ...], step: int, region: tuple, ages: int,
                       size: int, compare: bool, layout: Layout | None = None):
    """The kept view's figure, built once per server for these settings: a new session, or a view
    opened again, sends it without rebuilding (read-only: Streamlit copies it to send it)."""
    layers = kept_layers(trace, runs, region, ages, size, compare, layout)
    fates = None if compare else [cached_fates(trace, spec, layout) for spec in runs]
    return figures.kept_heatmap(replays(trace, runs, layout=layout), cached_features(trace), step=step,
                                region=figures.Region(*region), size=size, compare=compare, layers=layers, fates=fates)


@st.cache_resource(max_entries=8, show_spinner=False, hash_funcs=BY_TRACE)
def cached_difference(trace: kvsim.Trace, a: PolicySpec, b: PolicySpec, layout: Layout | None = None) -> tuple[float, float]:
    return figures.difference_counts(kept_history(trace, a, layout), kept_history(trace, b, layout))


def kept_view(trace: kvsim.Trace, settings: Settings) -> None:
    runs, layout = settings.laid_out, settings.layout
    if not runs:
        st.info("Choose at least one policy (with valid settings) in the sidebar.")
        return
    note = story.budget_note(trace.steps, settings.budget)
    if note:
        st.warning(note)
    features = cached_features(trace)
    T = trace.steps
    # the figure first, then what to look for in it (the sinks, the band, the heavy hitters), then its reading
    # and its controls: with the controls above it and the reading between, the notes began below the fold at
    # 1280 x 800 (issue 56). Drawn in that order into these places, filled in the order they are computed.
    zoomed_slot, figure_slot, notes_slot, intro_slot = st.container(), st.container(), st.container(), st.container()
    top = st.columns([2, 3])
    with top[0]:
        compare = _mode(len(runs))
    # the zoom's sliders are drawn only while its panel is open (a first paint draws less); the region
    # lives in the session, where the sliders, a box drawn on the chart and the resets all put it
    zoom = top[1].expander("zoom to single positions (re-drawn from the replay at full resolution)", key=ZOOM_OPEN,
                           on_change="rerun")
    region = zoom_region(T)
    if zoom.open:
        with zoom:
            zoom_controls(T)
    with zoomed_slot:  # above the figure whenever a zoom applies: the picture is a region
        _zoom_note(region, T)
    ages = figures.age_span(features, [spec.window or 0 for spec in runs], settings.budget)
    size = KEPT_PIXELS // (1 if compare else min(len(runs), 3))
    box = (region.p0, region.p1, region.t0, region.t1)
    layers = kept_layers(trace, runs, box, ages, size, compare, layout)
    intro, how = _intro(layers[0]["block"], compare, zoomed=region != figures.Region.whole(T), layout=layout)
    fig = cached_kept_figure(trace, runs, settings.step, box, ages, size, compare, layout)
    trial = needle_kept.key_positions(trace) is not None and not compare  # a pass-key trial: its key marked
    if trial:
        fig = figures.fit_key(needle_kept.marked(fig, trace, replays(trace, runs, layout=layout)))
    elif turns.turns_of(trace.meta, trace.steps) is not None:  # a conversation's trace: where each turn starts
        fig = figures.fit_key(turns.marked(fig, trace))
    # a box drawn with the select tool re-draws that region from the replay, at full resolution
    # once it is narrow enough; the zoom tool (the default) only magnifies the pooled picture
    figure_slot.plotly_chart(selectable(fig, "box"), key="kept_chart", config={"scrollZoom": True}, on_select=lambda: zoom_to_box(T),
                             selection_mode="box")
    # the reading under the figure and its notes (above it, it pushed the figure's bottom and key past the fold)
    intro_slot.markdown(intro)
    # its paragraph is built only while open, like the zoom's inputs (a first paint draws less)
    reading = st.expander("how to read this picture", key=HOW_OPEN, on_change="rerun")
    if reading.open:
        with reading:
            st.markdown(how)
    results = replays(trace, runs, layout=layout)
    if trial:
        needle_kept.note(trace, results)
    elif (spans := turns.turns_of(trace.meta, trace.steps)) is not None:
        st.caption(turns.caption(spans, results, figures.policy_label))
    with notes_slot:
        _notes(trace, runs, results, ages, compare, region, layout)
    st.caption(f"The dashed line is the sidebar's **step** ({settings.step}).")
    c1, c2 = st.columns(2)
    with c1:
        csv_button("per-step metrics (CSV)", lambda: figures.per_step_table(results), f"{stem(trace)}-per-step.csv",
                   "csv_steps")
    with c2:
        html_button("this figure (HTML)", fig, f"{stem(trace)}-kept.html", "html_kept")
    st.markdown(
        f"| policy | retained_mass | top_{TOP_K}_recall |\n| --- | ---: | ---: |\n"
        + "\n".join(f"| {figures.policy_label(r)} | {r.retained_mass:.4f} | {r.top_k_recall:.4f} |" for r in results)
    )


def _mode(runs: int) -> bool:
    """The mode's radio; True for the difference (which needs two policies: else each is shown)."""
    mirrored(st.radio, "show", list(KEPT_MODES), "kept_mode", "kept_mode_choice", format_func=KEPT_MODES.get,
             horizontal=True, help="the difference colours what the first two chosen policies keep differently")
    compare = st.session_state["kept_mode"] == "difference"
    if compare and runs < 2:
        st.info("The difference needs two policies: choose a second one in the sidebar. Showing each policy instead.")
        return False
    return compare


def _intro(block: tuple[int, int], compare: bool, zoomed: bool = False, layout: Layout | None = None) -> tuple[str, str]:
    """The figure's one-line reading, said above it, and the rest of how to read it, folded away
    below it: the four-line paragraph above the figure pushed its bottom and its key past the fold
    at 1280 x 800. Under a layout, what it is and, with blocks, that a cell is whole blocks."""
    intro, how = _plain_intro(block, compare, zoomed)
    if layout is None:
        return intro, how
    s = layout.block_size
    laid = f" Every panel runs under the serving layout **{layout.label}**"
    if s > 1:
        cells = ("one block of the cache" if block[1] == s else
                 f"{block[1] // s} blocks of the cache (zoom in for one block a cell)")
        laid += f": the cache is blocks of {s} positions that leave whole, and a cell across is {cells}"
    return intro + laid + ".", how


def _plain_intro(block: tuple[int, int], compare: bool, zoomed: bool = False) -> tuple[str, str]:
    how = (f"The picture is pooled to about the pixels on screen (blocks of {block[1]} positions x {block[0]} "
           "steps here): a block is dark when every position in it is kept, mid-grey when some are. For single "
           "positions, draw a box with the chart's **box select** tool (or set the ranges under *zoom*): that "
           "region is re-drawn from the replay, one pixel per position once it is narrow enough. The zoom tool "
           "(the default) only magnifies the pooled picture; double-click to reset it. The three notes below say "
           "what to look for in it.")
    if compare:
        return ("**One panel: what the first two chosen policies keep differently**, pooled so that a single "
                "differing column stays visible.", how)
    return (f"**Each panel is one policy's cache over {'the region zoomed to' if zoomed else 'the whole run'}.** "
            "Row *t* is the cache after decode step *t*: dark kept, mid-grey partly kept, white evicted, light "
            "grey not generated yet.", how)


def _notes(trace: kvsim.Trace, runs: tuple[PolicySpec, ...], results: list, ages: int, compare: bool,
           region: figures.Region | None = None, layout: Layout | None = None) -> None:
    """What to look for, under the picture: each note quotes this trace, or says it lacks the feature.
    The heavy hitters' count is told as the figure draws their marks: over the ``region`` shown, as
    many panels across as it draws."""
    features = cached_features(trace)
    info = describe(trace, features)
    sinks, band, heavy = st.columns(3)
    sinks.markdown(story.sink_text(features, info, difference=compare))
    windows = [w for spec in runs[: 2 if compare else None] if 0 < (w := spec.window or 0) <= ages]
    band.markdown(_as_drawn(story.band_text(features, info, ages), windows))
    if compare:  # the difference draws where heavy hitters are, not what each policy does with them
        heavy.markdown(_difference_heavy_text(features, region) if features.heavy else story.heavy_text(features, {}))
    else:
        fates = {figures.policy_label(r): cached_fates(trace, spec, layout) for r, spec in zip(results, runs, strict=True)}
        heavy.markdown(story.heavy_text(features, fates, region=region, panels=len(runs)))
    if compare:
        a, b = results[0], results[1]
        counts = cached_difference(trace, runs[0], runs[1], layout)
        st.markdown(story.difference_text(a.policy, b.policy, a.retained_mass, b.retained_mass, counts))


#: the band note's last sentence names a mark drawn only where a shown policy protects a window
GREEN_EDGE = ", its edge a dashed green line."


def _as_drawn(band_note: str, windows: list[int]) -> str:
    """The band note, naming the protected window's dashed green edge only where the figure draws
    one (a shown policy with a recent window inside the strip)."""
    if windows or GREEN_EDGE not in band_note:
        return band_note
    return band_note.replace(GREEN_EDGE, " (none of the policies shown protects one).")


def _difference_heavy_text(features, region: figures.Region | None = None) -> str:
    """The difference view's note on heavy hitters: it marks their columns (counted as its one
    panel draws them) and nothing more."""
    n, drawn = len(features.heavy), story.heavy_drawn(features, region, 1)
    return (f"**Heavy hitters** (red ▼ over their columns; {features.heavy_source}): {n} here{drawn}; older "
            "positions that draw a large share for a stretch. The difference marks only where they are; *a panel per policy* shows which "
            "each keeps, with a red "
            "line while it is held and an × where it is evicted while still wanted.")


def zoom_to_box(T: int) -> None:
    """Set the zoom ranges to the box drawn on the kept chart (clipped to the run)."""
    region = figures.selected_region(st.session_state.get("kept_chart"), T)
    if region is not None:
        st.session_state["zoom_positions"] = (region.p0, region.p1)
        st.session_state["zoom_steps"] = (region.t0, region.t1)


def _zoom_note(region: figures.Region, T: int) -> None:
    """Said above the figure whenever a zoom applies (the zoom's panel may be folded away), with the
    way back to the whole run."""
    if region == figures.Region.whole(T):
        return
    text, button = st.columns([7, 2])  # [5, 1] cut the button's label at 1280 x 800
    text.caption(f"**zoomed to positions {region.p0}..{region.p1}, steps {region.t0}..{region.t1} of {T}**: the "
                 "picture shows that region only; the masses in the titles are over the whole run.")
    button.button("reset: the whole run", key="zoom_note_reset", on_click=zoom_reset, args=(T,))


def zoom_region(T: int) -> figures.Region:
    """The region the kept view draws, from the session, each range clipped to a run of ``T`` steps
    (the last trace may have been longer). Written back, so the ranges outlive a run where the zoom's
    sliders are folded away (Streamlit drops a hidden slider's value)."""
    for key, low in (("zoom_positions", 0), ("zoom_steps", 1)):
        a, b = st.session_state.get(key, (low, T))
        st.session_state[key] = (min(max(low, a), T), min(max(low, b), T))
    (p0, p1), (t0, t1) = st.session_state["zoom_positions"], st.session_state["zoom_steps"]
    return figures.Region(p0, p1, t0, t1).clip(T)


def zoom_controls(T: int) -> None:
    """Two ranges: the positions and the steps the kept view draws (``zoom_region`` has clipped
    them to the run). Below KEPT_PIXELS positions across, every position has its own pixel column."""
    st.caption(f"At most {KEPT_PIXELS} positions across (fewer with several panels) show each position on its "
               "own; wider regions are pooled.")
    st.slider("positions", 0, T, key="zoom_positions")
    st.slider("steps", 1, T, key="zoom_steps")
    st.button("the whole run", key="zoom_reset", on_click=zoom_reset, args=(T,))

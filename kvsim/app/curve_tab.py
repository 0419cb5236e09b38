"""Choosing recent_window: every policy with a recent_window swept over 1 .. budget - 1 at the
sidebar's budget, beside the reference lines (the policies without one, the offline references, the
per-step upper bound), with a click on a point setting recent_window everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import streamlit as st

import kvsim
from kvsim.analysis.windows import sweep_coarse_to_fine
from kvsim.policies import PolicySpec, describe_policy
from kvsim.policykit import registry
from kvsim.policykit.base import WINDOW
from kvsim.sim import summaries
from kvsim.views import figures, story

from . import memo, services, state
from .charts import selectable
from .controls import Settings, spec_for
from .downloads import csv_button, html_button, stem
from .memo import TOP_K, cached_features, cached_summary, cached_upper_bound, describe
from .state import curve_policies, mirrored
from .truth_panel import truth_panel

#: the per-step upper bound's line on the curve: not a policy, so not in the registry
UPPER_BOUND = "upper bound (offline reference)"
#: the two panels' height on a tour step (580 elsewhere): the step's chart and its legends fit 1500 x 1100
TOUR_PLOT_HEIGHT = 470
#: above this cost of one replay (steps x budget; the shipped traces' at budget 256) a curve is drawn
#: from a coarse grid first, and the rest is replayed in the background while the page waits for it:
#: at budget 512 every window of snapkv took 5 s before the page drew anything
PROGRESSIVE_COST = 4096 * 256
#: windows on that first coarse grid (the marks besides)
COARSE_POINTS = 4
#: how often a page with replays in the background looks whether one has ended
REFRESH_S = 0.5
#: reference lines whose replay alone takes most of a minute on a 4096-step trace (expected_attention at its
#: default refresh of 1 rescores every held position at every step: 125 s on gemma3-270m-L11 at load 8, where
#: every curve took 7 s): replayed in the background, after the curves, and drawn when known
SLOW_LINES = ("expected_attention",)
#: after this long replaying (since the view began, or the last chart so far), the chart is drawn with what is known
#: so far before the next replay: each such chart costs a figure (0.1-0.3 s), so only a slow replay earns one
PAINT_AFTER_S = 1.0


class Live:
    """The chart's place while the view replays what it does not know yet: emptied at once, so nothing of the
    previous trace's chart stays on screen, then a progress bar that counts what is replayed and, once the
    replays have taken a moment, the chart of what is known so far with a line saying what it holds. The
    finished view replaces it all (``final``)."""

    def __init__(self, where) -> None:
        self.slot = where.empty()
        self.started = self.painted = time.monotonic()
        self.parts = None
        self.paints = 0

    def _parts(self):
        if self.parts is None:
            box = self.slot.container()
            self.parts = (box.empty(), box.empty(), box.empty())
        return self.parts

    def bar(self, text: str) -> Callable[[float, str], None]:
        """A progress bar under the note: ``tell(fraction, text)``."""
        _, bar, _ = self._parts()
        shown = bar.progress(0.0, text=text)
        return lambda fraction, words=text: shown.progress(min(1.0, max(0.0, fraction)), text=words)

    def paint(self, fig, note: str) -> None:
        """The chart of what is known so far (not clickable: the finished view's is), if replaying took a moment
        since the view began or the last such chart."""
        if time.monotonic() - self.painted < PAINT_AFTER_S:
            return
        words, bar, chart = self._parts()
        words.caption(note)
        bar.empty()
        self.paints += 1
        chart.plotly_chart(fig, key=f"curve_so_far_{self.paints}")
        self.painted = time.monotonic()

    def final(self):
        """The container the finished view is drawn in (in place of the progress and the chart so far)."""
        self.parts = None
        return self.slot.container()


def curve_points(budget: int) -> int:
    """Windows on a curve's even grid. A replay costs about the budget, so above 512 the grid is
    halved; the refinement around the peak (``sweep_coarse_to_fine``) finds a peak (on a flat top, not
    always the best: ``every_window`` says which curves have every window)."""
    return 32 if budget <= 512 else 16


def progressive(trace: kvsim.Trace, budget: int) -> bool:
    """Whether the curve at this budget is drawn coarse first (its replays are too slow to wait for)."""
    return trace.steps * budget > PROGRESSIVE_COST


@dataclass
class Pending:
    """What the curve view left to the background: names for the page, and checks that say when
    one has ended (then the page is drawn again)."""

    names: list[str] = field(default_factory=list)
    busy: list[Callable[[], bool]] = field(default_factory=list)

    def add(self, name: str, busy: Callable[[], bool]) -> None:
        self.names.append(name)
        self.busy.append(busy)


def every_window(trace: kvsim.Trace, budget: int, primary: bool) -> bool:
    """Whether the curve replays every window 1 .. budget - 1 (so its best and recommended windows are
    exact, ``kvsim.analysis.windows``): the primary curve where its replays are quick enough to wait
    for. The others, and every curve where that is slow, are a sample (refined around the peak)."""
    return primary and not progressive(trace, budget)


def sweep_curve(trace: kvsim.Trace, spec: PolicySpec, marks: tuple[int, ...], pending: Pending,
                primary: bool = True, live: Live | None = None, counted: str = "") -> services.Curve:
    """The policy's curve over recent_window 1 .. budget - 1 (``spec``: its other parameters), each
    window replayed once per server however many sessions ask. The primary curve, where it is quick
    (``every_window``), replays every window; otherwise an even grid refined around the peak, plus
    the marks (the default, the band, the current setting). Where that is slow (``progressive``) the
    primary curve is first a coarse grid and a companion is left out; the refined sweep runs in the
    background, then (the primary curve) every window, so that its exact best is marked once known;
    what is still running is said in ``pending``. ``live``: where the progress bar is drawn (``counted``: which
    curve of how many, said on it)."""
    name, budget = spec.name, spec.budget
    span = f"{name} over {WINDOW} 1 .. {budget - 1}"
    every = every_window(trace, budget, primary)
    store = memo.sweeps()
    key = (trace.fingerprint, spec.replace(recent_window=1), TOP_K, "every" if every else "sampled")

    def exact(progress=None) -> list[dict]:  # each sweep kept on disk beside the trace (summaries.sweep)
        if every:
            return summaries.sweep(trace, spec, None, WINDOW, range(1, budget), top_k=TOP_K, progress=progress)
        return sweep_coarse_to_fine(trace, spec, None, WINDOW, 1, budget - 1, marks=marks, points=curve_points(budget),
                                    top_k=TOP_K, progress=progress, run=summaries.sweep)

    def drawn() -> list[dict]:  # the exact sweep with its progress bar, drawn by the run that sweeps
        windows = budget - 1 if every else None
        first = f"replaying {span}" + (f" ({counted})" if counted else "")
        if live is None:
            shown = st.progress(0.0, text=first)
            tell = lambda f, words=first: shown.progress(min(1.0, f), text=words)  # noqa: E731
        else:
            tell = live.bar(first)

        def told(f: float) -> None:  # the windows counted where every one is replayed; else the share done
            tell(f, f"{first}: window {min(windows, int(f * windows))} of {windows}" if windows else first)

        rows = exact(told)
        if live is None:
            shown.empty()
        return rows

    def coarse() -> list[dict]:  # a companion is drawn once its exact sweep is known
        if not primary:
            return []
        return sweep_coarse_to_fine(trace, spec, None, WINDOW, 1, budget - 1, marks=marks, points=COARSE_POINTS,
                                    refine=False, top_k=TOP_K, run=summaries.sweep)

    def add(missing: list[int]) -> list[dict]:  # a mark the first sweep did not include (a new current setting)
        return summaries.sweep(trace, spec, None, WINDOW, missing, top_k=TOP_K)

    def kept(values: list[int] | None) -> list[dict] | None:  # what an earlier server swept: read, not replayed
        if values is not None:
            return memo.kept_sweep(trace, spec, values)
        return memo.kept_refined(trace, spec, marks, curve_points(budget))

    within = [m for m in marks if 1 <= m <= budget - 1]
    waiting = lambda: st.spinner(f"another session is replaying {span}")  # noqa: E731
    if not progressive(trace, budget):
        return store.curve(key, drawn, marks=within, add=add, waiting=waiting)
    curve = store.curve(key, exact, marks=within, add=add if primary or store.exact(key) else None, coarse=coarse,
                        every=range(1, budget) if primary else (), waiting=waiting, kept=kept)
    if not curve.exact:
        pending.add(f"{story.possessive(name)} curve", lambda: store.busy(key))
    elif not curve.complete:
        pending.add(f"every window of {story.possessive(name)} curve", lambda: store.busy(key))
    return curve


def background_summary(trace: kvsim.Trace, key: tuple, work: Callable[[], dict], label: str, pending: Pending) -> dict | None:
    """A line's summary from the background: None, said in ``pending``, until it is known."""
    status = memo.background().poll((trace.fingerprint, *key), lambda _progress: work())
    if not status.done:
        pending.add(label, lambda: memo.background().busy((trace.fingerprint, *key)))
    return status.value


def optimal_line(trace: kvsim.Trace, spec: PolicySpec) -> tuple[dict | None, services.Status]:
    """The optimum's summary when it is known (from the disk cache or a finished background solve),
    else ``(None, the solve's status)`` with the solve started in the background."""
    from kvsim.policies import optimal

    def needed() -> bool:
        return trace.steps >= optimal.CACHE_MIN_STEPS and optimal.cached(trace, spec.budget) is None

    kept = summaries.stored(trace, spec, TOP_K)  # its line kept (or shipped, kvsim.data.kept): no solve needed
    if kept is not None:
        return kept, services.Status(True, 1.0)
    try:
        solve = memo.solves().poll(
            (trace.fingerprint, spec.budget), lambda progress: optimal.optimal_schedule(trace, spec.budget, progress=progress),
            needed=needed)
    except Exception as e:  # said on the page in one line, and tried again the next time the view is drawn
        raise ValueError(f"the exact optimum could not be solved: {' '.join(str(e).split())}") from None
    if not solve.done:
        return None, solve
    return cached_summary(trace, spec), solve


def reference_lines(trace: kvsim.Trace, settings: Settings, pending: Pending, live: Live | None = None,
                    paint: Callable[[list], None] | None = None) -> list[figures.Line]:
    """The curve's horizontal lines: every registered policy without a recent_window (the ones that
    read the trace as offline references), plus the per-step upper bound. The exact optimum is
    solved in the background where that is slow, and so is every line where the curve is drawn
    coarse first (``progressive``) and a line slow to replay anywhere (``SLOW_LINES``); until one is
    known the page says so. The optimum, the slowest, is drawn last: its solve starts once every other
    line is known. ``live``: a progress bar counts the lines replayed now; ``paint(lines)``: the chart
    drawn with the lines known so far after each."""
    lines, order = [], list(kvsim.POLICIES)
    names = [n for n in order if not registry.is_optimum(n)] + [n for n in order if registry.is_optimum(n)]  # the slowest last
    names = [n for n in names if registry.window_param(n) is None and n not in settings.left_out]
    tell = None
    for i, name in enumerate(names):  # the sidebar says why the others are left out
        cls = kvsim.POLICIES[name]
        spec = settings.specs[name]
        if isinstance(spec, str):
            st.error(f"{spec}; its reference line is left out.")
            continue
        inner = ", ".join(f"{k}={v}" for k, v in spec.params)
        label = f"{name} ({inner})" if inner else name
        now = not registry.is_optimum(name) and name not in SLOW_LINES and not progressive(trace, settings.budget)
        if now and live is not None and not _known(trace, spec):
            words = f"replaying the reference lines: {name} ({i + 1} of {len(names)})"
            tell = tell or live.bar(words)
            tell(i / len(names), words)
        summary = _optimal_last(trace, spec, pending) if registry.is_optimum(name) else _summary(trace, spec, pending)
        if summary is None:
            continue
        if registry.is_offline(name):
            lines.append(figures.Line.of(summary, f"{label} (offline reference)", "offline", name, note=describe_policy(cls)))
        else:
            lines.append(figures.Line.of(summary, label, "policy", name))
        lines.sort(key=lambda line: order.index(line.policy) if line.policy in order else len(order))
        if paint is not None and tell is not None:
            paint(lines)
    budget = settings.budget
    if progressive(trace, budget):  # read where an earlier server kept it, else computed (and kept) in the background
        bound = memo.kept_upper_bound(trace, budget, TOP_K) or background_summary(
            trace, ("upper bound", budget, TOP_K), lambda: memo.kept_upper_bound(trace, budget, TOP_K, compute=True),
            "the upper bound", pending)
    else:
        bound = cached_upper_bound(trace, budget)
    if bound is not None:
        lines.append(figures.Line.of(bound, UPPER_BOUND, "bound"))
    return lines


def _known(trace: kvsim.Trace, spec: PolicySpec) -> bool:
    """Whether the line's summary is kept (on disk, or shipped): read, not replayed."""
    return summaries.stored(trace, spec, TOP_K) is not None


def _summary(trace: kvsim.Trace, spec: PolicySpec, pending: Pending) -> dict | None:
    if not progressive(trace, spec.budget) and spec.name not in SLOW_LINES:
        return cached_summary(trace, spec)
    kept = summaries.stored(trace, spec, TOP_K)  # measured by an earlier server: read, not replayed in the background
    if kept is not None:
        return kept
    return background_summary(trace, ("summary", spec, TOP_K), lambda: summaries.summary(trace, spec, TOP_K), spec.name,
                              pending)


def _optimal(trace: kvsim.Trace, spec: PolicySpec, pending: Pending) -> dict | None:
    """The optimum's line, or None with the page saying why (a failed solve, or one still running: then
    it joins ``pending``, so the page is drawn again when the solve ends and the line appears)."""
    try:
        summary, done = optimal_line(trace, spec)
    except (ValueError, MemoryError) as e:
        st.error(f"{e}; its line is left out.")
        return None
    if summary is None:
        pending.add("the exact optimum", lambda: memo.solves().busy((trace.fingerprint, spec.budget)))
        st.info(f"The exact optimum at budget {spec.budget} is being solved in the background: "
                f"{story.when_done(done.fraction, done.elapsed_s)} The page draws its line by itself when the solve ends.")
    return summary


def _optimal_last(trace: kvsim.Trace, spec: PolicySpec, pending: Pending) -> dict | None:
    """The optimum's line where it is kept; else, while other lines are still replayed in the background, None
    with the page saying that it is the slowest and comes last (its solve starts once they are known)."""
    from kvsim.policies import optimal

    slow = trace.steps >= optimal.CACHE_MIN_STEPS and not _known(trace, spec) and optimal.cached(trace, spec.budget) is None
    if pending.names and slow and not memo.solves().busy((trace.fingerprint, spec.budget)):
        st.info(f"The exact optimum at budget {spec.budget} costs the most (a solve over every step and position): "
                "it is solved once the other lines are known, and its line is drawn last.")
        return None
    return _optimal(trace, spec, pending)


def curve_figure(curves: dict[str, list[dict]], policy: str, lines: tuple, rw: int, features, budget: int,
                 keep: bool = True):
    """The recent_window chart of these curves and lines, built once per server for what it draws
    (read-only: Streamlit copies a figure to send it). Where the primary curve has every window its
    best and recommended windows are marked (``kvsim.analysis.windows``); otherwise its peak, as the
    peak so far of the windows sampled. ``keep=False``: a chart of what is known so far, built and not kept."""
    default = kvsim.policy_params(policy)[registry.window_param(policy)]
    # a tour step is a slide: its chart is shorter, so the figure and its legends fit one screen
    plot_height = TOUR_PLOT_HEIGHT if state.touring() else None
    key = (policy, rw, default, features.band, features.band_known, lines, budget, plot_height,
           tuple((n, tuple(tuple(sorted(r.items())) for r in rows)) for n, rows in curves.items()))  # flat rows
    store = memo.curve_figures()
    fig = store.get(key) if keep else None
    if fig is None:
        fig = figures.recent_window_curve(
            curves[policy], list(lines), current=rw, default=default, band=features.band, top_k=TOP_K, policy=policy,
            band_known=features.band_known, companions={n: r for n, r in curves.items() if n != policy}, budget=budget,
            plot_height=plot_height,
        )
        if keep:
            store.put(key, fig)
    return fig


def pick_from_curve() -> None:
    chosen = figures.selected_recent_window(st.session_state.get("curve"))
    if chosen is not None:
        st.session_state[WINDOW] = chosen


def sync_recent_window(source: str) -> None:
    st.session_state[WINDOW] = int(st.session_state[source])


def curve_view(trace: kvsim.Trace, settings: Settings) -> None:
    policies = curve_policies(trace)
    if not policies:
        st.info("No registered policy takes a recent_window.")
        return
    budget, rw = settings.budget, int(st.session_state[WINDOW])
    text, chart = st.columns([1, 3])
    live = Live(chart)  # the previous chart goes before anything is measured or replayed on this trace
    features = cached_features(trace)
    info = describe(trace, features)
    with text:
        policy = mirrored(
            st.selectbox, "policy the markers follow", policies, "curve_policy", "curve_policy_choice",
            help="every policy with a recent_window is drawn; this one carries the markers and the notes",
        )
        explain = st.empty()  # filled once the sweeps say what this trace does
        if not progressive(trace, budget):  # said while the sweep's progress bar runs (a coarse grid is quick)
            explain.markdown(story.window_text(policy, features.band, info["recent_share"], features.band_known))
        if budget >= 2:
            st.session_state["rw_curve"] = min(max(1, rw), budget - 1)
            st.number_input(WINDOW, min_value=1, max_value=budget - 1, step=1, key="rw_curve",
                            on_change=sync_recent_window, args=("rw_curve",))
    if budget < 2:
        st.error(f"the curve needs a budget of at least 2 (recent_window runs from 1 to budget - 1); budget is {budget}.")
        return
    pending = Pending()

    def so_far(rows: dict[str, list[dict]], lines: list, still: str) -> None:  # the chart of what is known, said
        fig = curve_figure(rows, policy, tuple(lines), rw, features, budget, keep=False)
        drawn = ", ".join(f"{story.possessive(n)} curve" for n in rows) + (f" and {len(lines)} reference lines" if lines else "")
        live.paint(fig, f"Drawn so far: {drawn}. Still replaying: {still}; each is drawn when known.")

    curves = _curves(trace, budget, policy, policies, rw, pending, live, so_far)
    if policy not in curves:
        return
    if not curves[policy].rows:  # chosen while its sweep waits behind the others' in the background
        with live.final():
            _waiting(pending, exact=False, complete=False)
        return
    exact, complete = curves[policy].exact, curves[policy].complete
    rows = {n: c.rows for n, c in curves.items() if c.rows}
    lines = reference_lines(trace, settings, pending, live, lambda known: so_far(rows, known, "the reference lines"))
    if not 1 <= rw <= budget - 1:
        st.error(f"recent_window {rw} is outside 1..{budget - 1} (it must be below the budget); no point is marked.")
    explain.markdown(
        story.window_text(policy, features.band, info["recent_share"], features.band_known)
        + "\n\n" + story.curve_verdict(rows[policy], features.band, features.band_known, budget=budget)
        + "\n\n" + _points_text(budget, policy, every_window(trace, budget, True) or complete)
    )
    fig = curve_figure(rows, policy, tuple(lines), rw, features, budget)
    with live.final():
        if pending.names:
            _waiting(pending, exact, complete)
        st.plotly_chart(selectable(fig, "points", "box"), key="curve", on_select=pick_from_curve, selection_mode=("points", "box"))
        if not exact:  # the notes, the truth and the downloads come with the refined curve: the first paint is the chart
            return
        st.markdown(story.lines_story(policy, rows, lines, budget))
        truth_panel(trace, policy, budget, rows[policy], exact)
        c1, c2 = st.columns(2)
        with c1:
            csv_button(f"sweep of {', '.join(rows)} (CSV)", lambda: figures.sweep_table(rows, top_k=TOP_K),
                       f"{stem(trace)}-budget{budget}-recent_window-sweep.csv", "csv_sweep")
        with c2:
            html_button("this figure (HTML)", fig, f"{stem(trace)}-budget{budget}-curve.html", "html_curve")


def _points_text(budget: int, policy: str, every: bool) -> str:
    """What the curves' points are: every window (``every``: the primary curve, where quick or once
    replayed in the background), or a sample."""
    sample = (f"about {curve_points(budget)} windows evenly spaced, every window next to the peak, and the marked ones "
              f"(with fewer than {curve_points(budget)} windows in all, every one)")
    if every:
        what = (f"{policy}'s curve has every window 1 .. {budget - 1}, so its best and recommended windows are exact; "
                f"the other curves are a sample: {sample}")
    else:
        what = f"{sample}; so the peak marked is the peak so far, of the windows sampled"
    return (f"Each point of a curve is a full replay at budget {budget}: {what}. The markers and notes follow {policy}. "
            "**Click a point** (or use the box below) to set recent_window everywhere.")


def _curves(trace: kvsim.Trace, budget: int, policy: str, policies: list[str], rw: int,
            pending: Pending, live: Live | None = None,
            so_far: Callable[[dict, list, str], None] | None = None) -> dict[str, services.Curve]:
    """Each policy's curve, the chosen one first (the primary curve; the others are drawn beside
    it). A policy whose other settings are refused is said in one line and left out. (The policies
    are swept one after another: each sweep already keeps every core busy.) ``live``: where each sweep's
    progress is drawn; ``so_far(rows, lines, still)``: the chart of the curves known, drawn after each."""
    band = cached_features(trace).band
    curves = {}
    names = [policy] + [n for n in policies if n != policy]
    for i, name in enumerate(names):
        spec = spec_for(name, budget, recent_window=1)
        if isinstance(spec, str):
            st.error(f"{spec}. Change the setting in the sidebar to draw {name}'s curve.")
            continue
        marks = (kvsim.policy_params(name)[registry.window_param(name)], band, rw)
        curves[name] = sweep_curve(trace, spec, marks, pending, primary=name == policy, live=live,
                                   counted=f"curve {i + 1} of {len(names)}")
        rest = names[i + 1:]
        if so_far is not None and rest and curves[policy].rows and not progressive(trace, budget):
            still = ", ".join(f"{story.possessive(n)} curve" for n in rest) + ", then the reference lines"
            so_far({n: c.rows for n, c in curves.items() if c.rows}, [], still)
    return curves


def _waiting(pending: Pending, exact: bool, complete: bool) -> None:
    """Say what is still replayed in the background, and draw the page again each time one ends."""
    if not exact:
        first = ("A coarse grid first: every window next to the peak is being replayed in the background, so the peak "
                 "marked is the **peak so far**; the refined one replaces it when known, with the notes and downloads. ")
    elif not complete:
        first = ("Refined around the peak: the peak marked is the **peak so far**, of the windows sampled; every window "
                 "is being replayed in the background, and the exact best and recommended windows replace it when known. ")
    else:
        first = ""
    st.caption(f"{first}Still replaying in the background: {', '.join(pending.names)}; each appears once known.")

    drawn = [False]  # the fragment's first call is this run's own: the page was just drawn, so it waits a tick

    @st.fragment(run_every=REFRESH_S)
    def watch() -> None:
        if drawn[0] and not all(busy() for busy in pending.busy):
            st.rerun()
        drawn[0] = True

    watch()

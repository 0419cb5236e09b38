"""Choosing recent_window: every policy with a recent_window swept over 1 .. budget - 1 at the
sidebar's budget, beside the reference lines (the policies without one, the offline references, the
per-step upper bound), with a click on a point setting recent_window everywhere.
"""

from __future__ import annotations

import streamlit as st

import kvsim
from kvsim.policies import PolicySpec, describe_policy
from kvsim.sim.simulate import sweep_coarse_to_fine
from kvsim.views import figures, story

from . import cache
from .cache import TOP_K, cached_features, cached_summary, cached_upper_bound, describe
from .controls import Settings, spec_for
from .downloads import csv_button, html_button, stem
from .state import curve_policies, mirrored

#: the per-step upper bound's line on the curve: not a policy, so not in the registry
UPPER_BOUND = "upper bound (offline reference)"


def curve_points(budget: int) -> int:
    """Windows on a curve's even grid. A replay costs about the budget, so above 512 the grid is
    halved; the refinement around the peak (``sweep_coarse_to_fine``) still finds it exactly."""
    return 32 if budget <= 512 else 16


def sweep_curve(trace: kvsim.Trace, spec: PolicySpec, marks: tuple[int, ...]) -> list[dict]:
    """The policy's curve over recent_window 1 .. budget - 1 (``spec``: its other parameters): an
    even grid refined around the peak (found exactly), plus the marks (the default, the band, the
    current setting), each window replayed once per server however many sessions ask."""
    name, budget = spec.name, spec.budget
    fixed = {k: v for k, v in spec.kwargs.items() if k != "recent_window"}
    span = f"{name} over recent_window 1 .. {budget - 1}"

    def full() -> list[dict]:
        bar = st.progress(0.0, text=f"replaying {span}")
        rows = sweep_coarse_to_fine(trace, name, budget, "recent_window", 1, budget - 1, marks=marks,
                                    points=curve_points(budget), top_k=TOP_K,
                                    progress=lambda f: bar.progress(min(1.0, f)), **fixed)
        bar.empty()
        return rows

    def add(missing: list[int]) -> list[dict]:  # a mark the first sweep did not include (a new current setting)
        return kvsim.sweep(trace, name, budget, "recent_window", missing, top_k=TOP_K, **fixed)

    key = (trace.fingerprint, spec.replace(recent_window=1), TOP_K)
    curve = cache.sweeps().curve(key, full, marks=[m for m in marks if 1 <= m <= budget - 1], add=add,
                                 waiting=lambda: st.spinner(f"another session is replaying {span}"))
    return curve.rows


def optimal_line(trace: kvsim.Trace, spec: PolicySpec) -> tuple[dict | None, float]:
    """The optimum's summary when it is known (from the disk cache or a finished background solve),
    else ``(None, fraction solved)`` with the solve started in the background."""
    from kvsim.policies import optimal

    def needed() -> bool:
        return trace.steps >= optimal.CACHE_MIN_STEPS and optimal.cached(trace, spec.budget) is None

    try:
        done, fraction = cache.solves().poll(
            (trace.fingerprint, spec.budget), lambda progress: optimal.optimal_schedule(trace, spec.budget, progress=progress),
            needed=needed)
    except Exception as e:  # said on the page in one line, and tried again on the next redraw
        raise ValueError(f"the exact optimum could not be solved: {' '.join(str(e).split())}") from None
    if not done:
        return None, fraction
    return cached_summary(trace, spec), 1.0


def reference_lines(trace: kvsim.Trace, settings: Settings) -> list[figures.Line]:
    """The curve's horizontal lines: every registered policy without a recent_window (the ones that
    read the trace as offline references), plus the per-step upper bound. The exact optimum is
    solved in the background where that is slow; until it is known the page says so."""
    lines = []
    for name, cls in kvsim.POLICIES.items():
        if "recent_window" in kvsim.policy_params(name):
            continue
        spec = settings.specs[name]
        if isinstance(spec, str):
            st.error(f"{spec}; its reference line is left out.")
            continue
        inner = ", ".join(f"{k}={v}" for k, v in spec.params)
        label = f"{name} ({inner})" if inner else name
        if name == "optimal":
            try:
                summary, done = optimal_line(trace, spec)
            except (ValueError, MemoryError) as e:
                st.error(f"{e}; its line is left out.")
                continue
            if summary is None:
                st.info(f"The exact optimum at budget {spec.budget} is being solved in the background ({done:.0%} done); "
                        "its line appears on the next redraw once it is known.")
                continue
        else:
            summary = cached_summary(trace, spec)
        if cls.needs_trace:
            lines.append(figures.Line.of(summary, f"{label} (offline reference)", "offline", name, note=describe_policy(cls)))
        else:
            lines.append(figures.Line.of(summary, label, "policy", name))
    lines.append(figures.Line.of(cached_upper_bound(trace, settings.budget), UPPER_BOUND, "bound"))
    return lines


def curve_figure(curves: dict[str, list[dict]], policy: str, lines: tuple, rw: int, features):
    """The recent_window chart of these curves and lines, built once per server for what it draws
    (read-only: Streamlit copies a figure to send it)."""
    default = kvsim.policy_params(policy)["recent_window"]
    key = (policy, rw, default, features.band, features.band_known, lines,
           tuple((n, tuple(tuple(sorted(r.items())) for r in rows)) for n, rows in curves.items()))  # flat rows
    store = cache.curve_figures()
    fig = store.get(key)
    if fig is None:
        fig = store.put(key, figures.recent_window_curve(
            curves[policy], list(lines), current=rw, default=default, band=features.band, top_k=TOP_K, policy=policy,
            band_known=features.band_known, companions={n: r for n, r in curves.items() if n != policy},
        ))
    return fig


def pick_from_curve() -> None:
    chosen = figures.selected_recent_window(st.session_state.get("curve"))
    if chosen is not None:
        st.session_state["recent_window"] = chosen


def sync_recent_window(source: str) -> None:
    st.session_state["recent_window"] = int(st.session_state[source])


def curve_view(trace: kvsim.Trace, settings: Settings) -> None:
    policies = curve_policies()
    if not policies:
        st.info("No registered policy takes a recent_window.")
        return
    features = cached_features(trace)
    info = describe(trace, features)
    budget, rw = settings.budget, int(st.session_state["recent_window"])
    text, chart = st.columns([1, 3])
    with text:
        policy = mirrored(
            st.selectbox, "policy the markers follow", policies, "curve_policy", "curve_policy_choice",
            help="every policy with a recent_window is drawn; this one carries the markers and the notes",
        )
        explain = st.empty()  # filled once the sweeps say what this trace does
        explain.markdown(story.window_text(policy, features.band, info["recent_share"], features.band_known))
        if budget >= 2:
            st.session_state["rw_curve"] = min(max(1, rw), budget - 1)
            st.number_input("recent_window", min_value=1, max_value=budget - 1, step=1, key="rw_curve",
                            on_change=sync_recent_window, args=("rw_curve",))
    if budget < 2:
        st.error(f"the curve needs a budget of at least 2 (recent_window runs from 1 to budget - 1); budget is {budget}.")
        return
    curves = _curves(trace, budget, policy, policies, rw)
    if policy not in curves:
        return
    rows = curves[policy]
    lines = reference_lines(trace, settings)
    if not 1 <= rw <= budget - 1:
        st.error(f"recent_window {rw} is outside 1..{budget - 1} (it must be below the budget); no point is marked.")
    explain.markdown(
        story.window_text(policy, features.band, info["recent_share"], features.band_known)
        + "\n\n" + story.curve_verdict(rows, features.band, features.band_known)
        + f"\n\nEach point of a curve is a full replay at budget {budget}: about {curve_points(budget)} windows evenly "
        "spaced, every window next to the peak, and the marked ones (with fewer than "
        f"{curve_points(budget)} windows in all, every one). The markers and notes follow {policy}. **Click a point** (or "
        "use the box below) to set recent_window everywhere."
    )
    fig = curve_figure(curves, policy, tuple(lines), rw, features)
    with chart:
        st.plotly_chart(fig, key="curve", on_select=pick_from_curve, selection_mode=("points", "box"))
        st.markdown(story.lines_story(policy, curves, lines, budget))
        c1, c2 = st.columns(2)
        with c1:
            csv_button(f"sweep of {', '.join(curves)} (CSV)", lambda: figures.sweep_table(curves, top_k=TOP_K),
                       f"{stem(trace)}-budget{budget}-recent_window-sweep.csv", "csv_sweep")
        with c2:
            html_button("this figure (HTML)", fig, f"{stem(trace)}-budget{budget}-curve.html", "html_curve")


def _curves(trace: kvsim.Trace, budget: int, policy: str, policies: list[str], rw: int) -> dict[str, list[dict]]:
    """Each policy's curve, the chosen one first (the primary curve; the others are drawn beside
    it). A policy whose other settings are refused is said in one line and left out. (The policies
    are swept one after another: each sweep already keeps every core busy.)"""
    band = cached_features(trace).band
    curves = {}
    for name in [policy] + [n for n in policies if n != policy]:
        spec = spec_for(name, budget, recent_window=1)
        if isinstance(spec, str):
            st.error(f"{spec}. Change the setting in the sidebar to draw {name}'s curve.")
            continue
        curves[name] = sweep_curve(trace, spec, (kvsim.policy_params(name)["recent_window"], band, rw))
    return curves

"""The sidebar: the controls, read once per run into ``Settings`` (each chosen policy a validated
``PolicySpec``), and the guided tour's box.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import streamlit as st

import kvsim
from kvsim.data import qk, vectors
from kvsim.policies import PolicySpec, all_tunables
from kvsim.policykit import registry
from kvsim.policykit.base import WINDOW
from kvsim.policykit.layouts import Layout
from kvsim.views import tour

from . import layout_control
from .state import MAX_VALUE, apply_tour, dense_only

#: the session key of the sidebar's "more policy parameters" expander: True while it is open
MORE_PARAMS = "more_params_open"


def params_for(name: str, **override) -> dict[str, int]:
    """The sidebar's value of each of the policy's parameters (``override`` replaces some)."""
    return {k: int(override.get(k, st.session_state[k])) for k in kvsim.policy_params(name)}


def spec_for(name: str, budget: int, **override) -> PolicySpec | str:
    """The policy at the sidebar's settings, validated; or, where they are refused (recent_window
    >= budget, ...), the one-line reason, ``"h2o: recent_window must be less than budget (256), got 300"``."""
    try:
        return PolicySpec.of(name, budget, **params_for(name, **override))
    except ValueError as e:
        return f"{name}: {e}"


@dataclass(frozen=True)
class Settings:
    """The sidebar's values for this run. ``specs``: every registered policy at the sidebar's
    settings (a spec, or why there is none); ``runs``: the chosen policies that have a spec."""

    budget: int
    step: int
    specs: dict[str, PolicySpec | str]
    chosen: tuple[str, ...]
    #: the policies this trace cannot take: those that read the whole matrix, on a trace too long to have it,
    #: and those that read keys, values, queries or output norms the trace was recorded without
    left_out: tuple[str, ...] = ()
    #: the serving layout the kept view replays under (None: none), and why it refuses a policy, by name
    layout: Layout | None = None
    refused: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, trace: kvsim.Trace) -> Settings:
        budget = int(st.session_state["budget"])
        left_out = () if trace.derived.no_matrix() is None else tuple(dense_only())
        specs = {name: spec_for(name, budget) for name in kvsim.POLICIES}
        for name in left_out:
            specs[name] = (f"{name} reads the whole attention matrix, which a trace of {trace.steps} steps stored as queries "
                           f"and keys does not have here (at most {qk.DENSE_LIMIT} steps); it is left out on this trace")
        for name, cls_ in kvsim.POLICIES.items():
            if lacking := vectors.missing(trace, cls_.reads, registry.reads_meta(name)):
                left_out += (name,)
                specs[name] = (f"{name} reads the {' and '.join(lacking)} of the attention's KV head, which the {trace.name} "
                               "trace was recorded without; it is left out on this trace (the shipped real trace and "
                               "query/key recordings carry them)")
        chosen = tuple(st.session_state["policies"])
        layout, refused = layout_control.chosen(), {}
        if layout is not None:  # the CLI's own check (``--block-size`` ...), for the policies shown
            for name in chosen:
                if isinstance(spec := specs[name], PolicySpec):
                    try:
                        layout.check(name, budget, spec.params, heads=1)
                    except ValueError as e:  # ParamError and LayoutError are ValueErrors
                        why = " ".join(str(e).split())
                        refused[name] = f"{name}: {why}" if layout.label in why else f"{name} under the layout {layout.label}: {why}"
        return cls(budget, int(st.session_state["step"]), specs, chosen, left_out, layout, refused)

    @property
    def runs(self) -> tuple[PolicySpec, ...]:
        return tuple(s for n in self.chosen if isinstance(s := self.specs[n], PolicySpec))

    @property
    def laid_out(self) -> tuple[PolicySpec, ...]:
        """The runs the layout takes (all of them without one): what the kept view and the plan download show."""
        return tuple(s for s in self.runs if s.name not in self.refused)

    @property
    def problems(self) -> list[str]:
        """A sentence for each chosen policy left out, saying why and what to do."""
        return [s + ("." if n in self.left_out else ". Change the setting in the sidebar; this policy is left out until then.")
                for n in self.chosen if isinstance(s := self.specs[n], str)] + [
            f"{why}. Change the layout or the setting in the sidebar; the kept view and the plan leave this policy out "
            "until then." for why in self.refused.values()]


def controls(trace: kvsim.Trace) -> None:
    side = st.sidebar
    side.multiselect(
        "policies", list(kvsim.POLICIES), key="policies",
        help="every policy in kvsim's registry; each gets a panel in the views that apply to it",
    )
    side.number_input("budget", min_value=1, max_value=MAX_VALUE, step=1, key="budget",
                      help="positions the cache holds after each eviction")
    extra = {k: p for k, p in all_tunables().items() if k not in (WINDOW, "sinks")}
    side.number_input(WINDOW, min_value=0, max_value=MAX_VALUE, step=1, key=WINDOW,
                      help="h2o (and its relatives) never evict the newest recent_window positions")
    side.number_input("sinks", min_value=0, max_value=MAX_VALUE, step=1, key="sinks",
                      help="streaming_llm pins the first sinks positions forever")
    if extra:
        # drawn only while open (a first paint draws less): the values live in the session, not in the inputs
        more = side.expander("more policy parameters", key=MORE_PARAMS, on_change="rerun")
        for k in extra:  # kept past a run where the inputs are folded away (Streamlit drops a hidden input's value)
            st.session_state[k] = st.session_state[k]
        if more.open:
            with more:
                for k, param in extra.items():
                    owners = ", ".join(n for n in kvsim.POLICIES if k in kvsim.policy_params(n))
                    st.number_input(k, min_value=0, max_value=MAX_VALUE, step=1, key=k, help=f"{param.help} ({owners})")
    layout_control.layout_control(int(st.session_state["budget"]))
    T = trace.steps
    step = st.session_state.get("step")
    st.session_state["step"] = T if step is None else min(max(1, int(step)), T)
    side.slider("step", min_value=1, max_value=T, key="step",
                help="the decode step the score view shows, drawn as a dashed line on the kept positions")


def tour_box() -> None:
    """The guided tour: a start button in the sidebar; while a step is open, its text and the way on."""
    side = st.sidebar
    key = st.session_state.get("tour")
    if key not in tour.BY_KEY:
        side.button("start the guided tour", on_click=apply_tour, args=(tour.TOUR[0].key,),
                    help="a few steps, each a link: sinks, heavy hitters, the recent window")
        return
    step = tour.BY_KEY[key]
    before, after = tour.neighbours(key)
    number = [s.key for s in tour.TOUR].index(key) + 1
    with st.container(border=True):
        # the heading shares its row with the way on, so the step's figure fits the screen below it
        head, *cols = st.columns([5, 2, 2, 1.6], vertical_alignment="center")
        head.markdown(f"**kvsim guided tour, step {number} of {len(tour.TOUR)}: {step.title}**")
        if before is not None:
            cols[0].button(f"← {before.title}", on_click=apply_tour, args=(before.key,), key="tour_back")
        if after is not None:
            cols[1].button(f"{after.title} →", on_click=apply_tour, args=(after.key,), key="tour_next")
        cols[2].button("leave the tour", on_click=lambda: st.session_state.update(tour=None), key="tour_leave")
        st.markdown(f"{step.look} :small[(view: *{step.view}* · link: `?tour={key}`)]")

"""The policy lab: two policies, one tiny editable trace, one step at a time."""

from __future__ import annotations

import numpy as np
import streamlit as st

import kvsim
from kvsim.analysis import lab
from kvsim.policykit import registry
from kvsim.policykit.base import WINDOW
from kvsim.views import lab as lab_figures

from .state import lab_reset, lasting


def lab_policy(side: str, preset: lab.Preset) -> lab.LabPolicy:
    spec = preset.left if side == "left" else preset.right
    # the lab's trace is attention alone: the scorers that read keys, values or queries have nothing to read
    options = [n for n, cls in kvsim.POLICIES.items() if not cls.reads]
    name = lasting(st.selectbox, f"{side} policy", f"lab_{side}", spec.name, options=options,
                   then=lambda: _switched(side))
    params = dict(spec.params) if name == spec.name else {}
    if registry.window_param(name) is not None:
        rw = int(lasting(st.number_input, WINDOW, f"lab_{side}_rw", spec.params.get(WINDOW, 0),
                         min_value=0, step=1, then=lambda: st.session_state.pop(f"_lab_{side}_rw_note", None)))
        params[WINDOW] = rw
        if note := st.session_state.get(f"_lab_{side}_rw_note"):
            st.caption(note)
        if rw == 0:
            st.caption(f":orange[With recent_window 0, {name} evicts each new position at once whenever its score is "
                       "the lowest, and a new position has scored nothing yet] (the preset *h2o recent_window 0 "
                       "pitfall* shows it).")
    return lab.LabPolicy(name, params)


def _switched(side: str) -> None:
    """A side's policy changed: its recent_window is the preset's where the preset has this policy
    on this side, else the registry's default, or half the budget where the default does not fit;
    the value set is said under the control (until the user sets one)."""
    preset = lab.PRESETS[st.session_state["_lab_preset"]]
    spec = preset.left if side == "left" else preset.right
    name, budget = st.session_state[f"lab_{side}"], int(st.session_state.get("_lab_budget", preset.budget))
    st.session_state.pop(f"_lab_{side}_rw_note", None)
    param = next((p for p in kvsim.tunables(name) if p.name == registry.window_param(name)), None)
    if name == spec.name:
        st.session_state[f"_lab_{side}_rw"] = spec.params.get(WINDOW, 0)
    elif param is not None:
        upper = param.upper(budget)
        fits = upper is None or param.default <= upper
        value = param.default if fits else max(0, budget // 2)
        st.session_state[f"_lab_{side}_rw"] = value
        st.session_state[f"_lab_{side}_rw_note"] = (
            f"recent_window set to {value} for {name}: "
            + ("its default." if fits else f"its default, {param.default}, does not fit the lab budget of {budget}, "
               "so half the budget."))


def _preset_note(slot, preset: lab.Preset, specs: list[lab.LabPolicy], budget: int, trace: kvsim.Trace) -> None:
    """The preset's note where its own pair, budget and trace are on screen; else what it was about
    and that it no longer applies."""
    changed = [what for what, same in (
        ("the left policy", specs[0] == preset.left), ("the right policy", specs[1] == preset.right),
        ("the budget", budget == preset.budget),
        ("the trace", np.allclose(trace.attention, preset.trace().attention)),
    ) if not same]
    if not changed:
        slot.info(preset.watch)
        return
    slot.caption(f"The preset's note is about {preset.left.label} vs {preset.right.label} at budget {preset.budget} "
                 f"on its own trace; {' and '.join(changed)} changed, so it no longer applies: read the bars and the "
                 "tables below.")


def lab_view() -> None:
    st.markdown(
        "**Two policies, one tiny trace, one step at a time.** The bars are what the query at this step "
        "wants, its attention over every earlier position; their colour is what each policy did with that "
        "position. Numbers above the bars are the policy's scores (h2o: attention summed; scissorhands: votes)."
    )
    names = list(lab.PRESETS)
    top = st.columns([3, 1])
    with top[0]:
        preset = lab.PRESETS[lasting(st.selectbox, "preset", "lab_preset", names[0], then=lab_reset, options=names)]
    with top[1]:
        budget = int(lasting(st.number_input, "lab budget", "lab_budget", preset.budget, min_value=1, step=1))
    note = st.empty()  # the preset's note, once the sides are read
    with st.expander("edit the trace (row t: the attention of step t over positions 0 .. t-1; rows are normalised)"):
        table = st.data_editor(lab.preset_table(preset.trace()), key=f"lab_table_{preset.title}")
    try:
        trace = lab.trace_from_table(table, name=preset.title)
    except kvsim.TraceError as e:
        st.error(str(e))
        return
    sides = st.columns(2)
    specs = []
    for col, side in zip(sides, ("left", "right"), strict=True):
        with col:
            specs.append(lab_policy(side, preset))
    _preset_note(note, preset, specs, budget, trace)
    try:
        steps = lab.side_by_side(trace, specs[0], specs[1], budget)
    except ValueError as e:
        st.error(f"{e}. Change the setting above.")
        return
    st.session_state["_lab_step"] = min(int(st.session_state.get("_lab_step", lab.first_divergence(steps))), len(steps))
    t = int(lasting(st.slider, "lab step", "lab_step", 1, min_value=1, max_value=len(steps)))
    for i, col in enumerate(st.columns(2)):
        with col:
            st.plotly_chart(lab_figures.step_figure(steps[t - 1], i), key=f"lab_step_{i}")
            st.plotly_chart(lab_figures.timeline_figure(steps, i, current=t), key=f"lab_timeline_{i}")
            # one table per side, under its own figures: the two side by side fit their columns
            st.dataframe(lab.step_table(steps[t - 1], side=i), hide_index=True, width="stretch")

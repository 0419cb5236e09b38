"""The policy lab: two policies, one tiny editable trace, one step at a time."""

from __future__ import annotations

import streamlit as st

import kvsim
from kvsim.analysis import lab
from kvsim.views import lab as lab_figures

from .state import lab_reset, lasting


def lab_policy(side: str, preset: lab.Preset) -> lab.LabPolicy:
    spec = preset.left if side == "left" else preset.right
    name = lasting(st.selectbox, f"{side} policy", f"lab_{side}", spec.name, options=list(kvsim.POLICIES))
    params = dict(spec.params) if name == spec.name else {}
    if "recent_window" in kvsim.policy_params(name):
        params["recent_window"] = int(lasting(st.number_input, "recent_window", f"lab_{side}_rw",
                                              spec.params.get("recent_window", 0), min_value=0, step=1))
    return lab.LabPolicy(name, params)


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
    st.info(preset.watch)
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

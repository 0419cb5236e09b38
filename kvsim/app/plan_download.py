"""The sidebar's "run it elsewhere": each chosen policy at the sidebar's settings as a run's plan
(``kvsim.policykit.plan``), to download and hand to ``--plan`` on the command line or to
``kvsim.hf.cache(plan=...)``: what was tuned here, run on a model with nothing retyped.

Drawn only while open, like the sidebar's other folded panels (a first paint draws less): its caption and
a download button per policy were built on every run of every session although the panel is folded.
"""

from __future__ import annotations

import streamlit as st

from kvsim.policies import PolicySpec
from kvsim.policykit import registry
from kvsim.policykit.plan import Plan

#: the session key of the panel's expander: True while it is open
PLAN_OPEN = "plan_open"
LABEL = "run these settings elsewhere"


def plans(specs, layout=None) -> dict[str, Plan]:
    """The plan of each online spec among ``specs`` (offline references read the future: no plan), under
    ``layout`` (the sidebar's serving layout, None for none)."""
    return {s.name: Plan(s, layout=layout) for s in specs
            if isinstance(s, PolicySpec) and not registry.is_offline(s.name)}


def plan_download(specs, layout=None) -> None:
    """Drawn in the sidebar: a download per chosen online policy and the commands that take the file."""
    made = plans(specs, layout)
    if not made:
        return
    panel = st.expander(LABEL, key=PLAN_OPEN, on_change="rerun")
    if not panel.open:
        return
    with panel:
        if layout is None:
            st.caption("Each policy at the sidebar's budget and parameters as a run's plan (JSON). Then "
                       "`python -m kvsim generate --plan FILE \"your prompt\"`, `python -m kvsim needle --plan FILE` "
                       "or, in Python, `kvsim.hf.cache(model, plan=FILE)`.")
        else:  # the commands that take a plan's layout (docs/serving.md); the others refuse it in one line
            st.caption(f"Each policy at the sidebar's budget and parameters, under the layout {layout.label}, as a "
                       "run's plan (JSON). Then `python -m kvsim replay --trace TRACE --plan FILE` (`sweep` and "
                       "`table` take it too); a command that takes no layout yet refuses the file in one line.")
        for name, plan in made.items():  # the file is written when it is asked for, not on every run of the page
            st.download_button(f"plan: {name}", plan.to_json, file_name=f"plan-{name}.json", mime="application/json",
                               key=f"plan_{name}", on_click="ignore")

"""Where to spend the memory: each allocator's split of a recorded model's cache over its layers and KV
heads at the sidebar's budget (the same memory as uniform's), the mass each reaches, and the share of the
gap from uniform to the exact optimum it closes (``kvsim.analysis.allocation``)."""

from __future__ import annotations

import streamlit as st

from kvsim.analysis import allocation as al
from kvsim.data.catalog import available_bundles
from kvsim.policies import POLICIES, PolicySpec
from kvsim.views.figures.allocation import budget_grids, mass_bars

from . import services
from .memo import cached_bundle
from .state import mirrored

#: the policies the view offers: the online ones (the offline references replay slowly at every budget)
ALLOCATION_POLICIES = [p for p in ("h2o", "tova", "snapkv", "scissorhands", "streaming_llm") if p in POLICIES]


@st.cache_resource
def comparisons() -> services.Shared:
    """Comparisons by (bundle, policy, budget), each computed once per server."""
    return services.Shared(bound=8)


def compared(name: str, spec: PolicySpec) -> list[dict]:
    def compute():
        bundle = cached_bundle(name)
        bar = st.progress(0.0, text=f"allocating {bundle.describe()} for {spec.name} at budget {spec.budget}")
        heads = al.load_heads(bundle)
        rows = al.compare(heads, spec, progress=lambda f, note="": bar.progress(min(f or 0.0, 1.0), text=note))
        bar.empty()
        return rows

    return comparisons().get((name, spec), compute,
                             waiting=lambda: st.spinner(f"another session is allocating {name} for {spec.name}"))


def allocation_view(budget: int) -> None:
    names = available_bundles()
    if not names:
        st.info("No recorded model is shipped here. Record one with `python -m kvsim record` into traces/<name>/.")
        return
    top = st.columns([2, 2, 3])
    with top[0]:
        name = mirrored(st.selectbox, "recorded model (bundle)", names, "bundle", "allocation_bundle")
    with top[1]:
        policy = mirrored(st.selectbox, "policy", ALLOCATION_POLICIES, "allocation_policy", "allocation_policy_choice")
    bundle = cached_bundle(name)
    n = len(bundle.traces)
    with top[2]:
        st.markdown(f"**{bundle.model}**, {bundle.describe()}. Budget {budget} (the sidebar's): "
                    f"{budget} x {n} = **{budget * n} positions** in all, for every allocator.")
    try:
        spec = PolicySpec.of(policy, budget)
        al.check("uniform", spec, [(t.layer, t.head) for t in bundle.traces], bundle.steps)
    except ValueError as e:  # a budget the policy or the trace refuses: said, not raised
        st.error(f"{policy} at budget {budget} on {name}: {' '.join(str(e).split())}")
        return
    rows = compared(name, spec)
    skipped = [a for a in al.ALLOCATORS if a not in {r["allocator"] for r in rows}]
    st.markdown(
        f"**Where should {policy}'s memory go?** Each panel is one allocator's split: a row per layer, a column per "
        f"KV head, colour the positions it holds (one scale for all). Over each panel: the bundle's mean retained "
        f"mass (each layer and KV head weighed equally) and the share of the gap from uniform to the exact optimum "
        f"it closes (below 0: worse than uniform at the same memory).")
    st.plotly_chart(budget_grids(rows, title=f"{policy} on {name}: budgets per layer and KV head at {budget * n} "
                                             f"positions"), key="allocation_grids")
    st.plotly_chart(mass_bars(rows, title="the same memory, split differently: bundle mean retained mass"),
                    key="allocation_mass")
    st.dataframe([{"allocator": r["allocator"], "retained mass": round(r["retained_mass"], 4),
                   "gap closed": None if r["gap_closed"] is None else f"{100 * r['gap_closed']:.0f}%",
                   "what it does": al.SUMMARIES[r["allocator"]]} for r in rows], hide_index=True)
    if skipped:
        why = []
        for a in skipped:
            try:
                al.check(a, spec, [(t.layer, t.head) for t in bundle.traces], bundle.steps)
            except al.AllocationError as e:
                why.append(f"**{a}**: {e}")
        st.caption("Not shown: " + "; ".join(why))
    st.caption("The optimum is exact: the best split of these positions into integer budgets per head, from each "
               "head's replay at every budget. The same from the command line: "
               f"`python -m kvsim replay --trace {name} --policy {policy} --budget {budget} --allocate optimal`.")

"""Where to spend the memory: each allocator's split of a recorded model's cache over its layers and KV
heads at the sidebar's budget (the same memory as uniform's), the mass each reaches, and the share of the
gap from uniform to the exact optimum it closes (``kvsim.allocation.allocators``); below, memory against KL
for policies x allocators at budgets 32-512 where the truth is measured (``frontier_view``)."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from kvsim.allocation import allocators as al
from kvsim.data.catalog import available_bundles
from kvsim.policies import PolicySpec
from kvsim.policykit import registry
from kvsim.views.figures.allocators import against_uniform, budget_grids, mass_bars

from . import services
from .memo import cached_bundle
from .state import mirrored

#: the policy the view opens on (its first default); the others are the registry's
FIRST_POLICY = "h2o"


def allocation_policies() -> list[str]:
    """The policies the view offers: the registry's deterministic online policies that read attention alone
    (``kvsim.policykit.registry.compared``: every bundle holds what they read; the offline references replay
    slowly at every budget), the first default first."""
    names = registry.compared()
    return sorted(names, key=lambda n: n != FIRST_POLICY)


@st.cache_resource
def comparisons() -> services.Shared:
    """Comparisons by (bundle, policy, budget), each computed once per server."""
    return services.Shared(bound=8)


def compared(name: str, spec: PolicySpec) -> list[dict]:
    def compute():
        bundle = cached_bundle(name)
        bar = st.progress(0.0, text=f"allocating {bundle.describe()} for {spec.name} at budget {spec.budget}")
        def told(f, note=""):  # the bar counts the whole comparison, and says so beside what is running
            share = min(f or 0.0, 1.0)
            bar.progress(share, text=f"{100 * share:.0f}% of the comparison of every allocator; now {note}")

        rows = al.compare_bundle(bundle, spec, progress=told)
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
        policy = mirrored(st.selectbox, "policy", allocation_policies(), "allocation_policy", "allocation_policy_choice")
    bundle = cached_bundle(name)
    n = len(bundle.traces)
    with top[2]:
        st.markdown(f"**{bundle.model}**, {bundle.describe()}. Budget {budget} (the sidebar's): "
                    f"{budget} x {n} = **{budget * n} positions** in all, for every allocator.")
    try:
        spec = PolicySpec.of(policy, budget)
    except ValueError as e:  # a budget the policy refuses: said, not raised
        st.error(f"{policy} at budget {budget} on {name}: {' '.join(str(e).split())}")
        return
    refused = al.refusals(spec, [(t.layer, t.head) for t in bundle.traces], bundle.steps)
    if "uniform" in refused:  # a budget below the policy's minimum or above the trace: no allocator runs
        st.error(f"{policy} at budget {budget} on {name}: {' '.join(refused['uniform'].split())}")
        return
    rows = compared(name, spec)
    st.markdown(
        f"**Where should {policy}'s memory go?** Each panel is one allocator's split: a row per layer, a column per "
        f"KV head, colour the positions it holds (one scale for all). Over each panel: the bundle's mean retained "
        f"mass (each layer and KV head weighed equally) and how it compares with uniform's at the same memory: "
        f"better or worse, by how much mass, and for a better split how much of the way to the exact optimum it goes.")
    st.plotly_chart(budget_grids(rows, title=f"{policy} on {name}: budgets per layer and KV head at {budget * n} "
                                             f"positions"), key="allocation_grids")
    st.plotly_chart(mass_bars(rows, title="the same memory, split differently: mass kept against uniform's"),
                    key="allocation_mass")
    uniform = next((r["retained_mass"] for r in rows if r["allocator"] == "uniform"), None)
    st.caption("Each bar is an allocator's bundle mean retained mass minus uniform's, from zero: up keeps more than "
               "uniform, down less, so the bars' lengths compare. The masses differ in the second or third decimal; "
               "the label on each bar gives the mass itself.")
    # a static table, whose cells wrap: in a data frame's grid the "what it does" column (up to 99 characters) was
    # cut at 1500 x 1100 and at 1280 x 800 alike
    st.table([{"allocator": r["allocator"], "retained mass": f"{r['retained_mass']:.4f}",
               "against uniform": against_uniform(r, uniform),
               "what it does": al.SUMMARIES[r["allocator"]]} for r in rows], hide_index=True)
    if refused:
        st.caption("Not shown: " + "; ".join(f"**{a}**: {why}" for a, why in refused.items()))
    st.caption("The optimum is exact: the best split of these positions into integer budgets per head, from each "
               "head's replay at every budget. The same from the command line: "
               f"`python -m kvsim replay --trace {name} --policy {policy} --budget {budget} --allocate optimal`.")
    frontier_view(name, bundle, {(policy, r["allocator"], budget): r["retained_mass"] for r in rows})


# --- memory against the truth: the frontier a user picks from ---------------------------------------

#: the frontier's grid (issue 33 item 3): the static splits the truth measures, four policies, budgets 32-512
#: the policies the frontier shows first (its defaults); any other offered policy joins where a cell of it is measured
FRONTIER_FIRST = ("h2o", "snapkv", "tova", "streaming_llm")


def frontier_policies(measured=()) -> list[str]:
    """The frontier's rows: its first defaults, then every other offered policy with a cell in ``measured``
    (the truth's rows: a user's own policy measured by ``quality --allocate`` joins with nothing edited)."""
    offered = allocation_policies()
    have = {r.get("policy") for r in measured}
    return [p for p in FRONTIER_FIRST if p in offered] + [p for p in offered if p not in FRONTIER_FIRST and p in have]
FRONTIER_ALLOCATORS = ["uniform", "pyramidkv", "cake", "optimal"]
FRONTIER_BUDGETS = [32, 64, 128, 256, 512]


def _source(bundle) -> tuple[str, str, str, str]:
    """(the quality command's TEXT and ``--model`` part, the text's sha256, the cache's model id, why not)
    of the bundle's recording; the last is empty when the truth can be looked up, else one line saying why."""
    from kvsim.models import quality as q
    from kvsim.models.errors import QualityError, RecordError
    from kvsim.models.loading import file_sha256
    from kvsim.models.texts import HEAPQ_SHA256
    from kvsim.models.truth import recording_source

    try:
        model, text, _ = recording_source(bundle.manifest)
        model_id = q.model_id_of(model)
    except (QualityError, RecordError, OSError) as e:
        return "", "", "", f"its truth cannot be looked up here: {' '.join(str(e).split())}"
    sha = file_sha256(text)
    if sha == HEAPQ_SHA256:
        shown = "heapq"  # the quality command's own name for the shipped traces' text
    else:
        try:
            shown = str(text.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            shown = str(text)
    model_part = "" if model in (None, "gemma3-270m") else f" --model {model}"
    return f"{shown}{model_part}", sha, model_id, ""


def _command(text: str, steps: int, policies, budgets, allocators) -> str:
    many = len(policies) > 1
    return (f"python -m kvsim quality {text} --steps {steps} --{'policies' if many else 'policy'} {','.join(policies)} "
            f"--budget {','.join(map(str, budgets))} --mode open --allocate {','.join(allocators)}")


def frontier_view(name: str, bundle, mass_here: dict) -> None:
    """Memory against KL for the frontier's policies x allocators at budgets 32-512, where measured (the
    truth's cells on disk, ``quality --allocate``); each cell not measured said, with the command that
    measures it; a cell no policy or trace allows said as such. ``mass_here``: {(policy, allocator, budget):
    retained mass} this view computed on the bundle, shown where the truth is not measured."""
    from kvsim.allocation.truth import documents_for
    from kvsim.views.figures.frontier import frontier_figure, pareto

    st.subheader("Memory against the truth: the frontier")
    text, sha, model_id, why = _source(bundle)
    if why:
        st.info(f"No frontier for {name}: {why}")
        return
    found = documents_for(model_id, sha)
    # first (the default) the bundle's own steps where cells are measured at them, else the steps with the most
    steps_options = sorted(set(found) | {bundle.steps},
                           key=lambda s: (s != bundle.steps if bundle.steps in found else -len(found.get(s, [])), s))
    top = st.columns([2, 5])
    with top[0]:
        steps = st.selectbox("truth measured over steps", steps_options, key="frontier_steps",
                             format_func=lambda s: f"{s} steps" + (" (the bundle's)" if s == bundle.steps else "")
                             + f": {len(found.get(s, []))} cells measured")
    with top[1]:
        st.markdown(f"KL and delta NLL with each layer and KV head at its allocator's budget, open loop (the policy "
                    f"replays each head's full-cache trace; the schedules mask one teacher-forced pass) on the bundle's "
                    f"model and text, first **{steps}** tokens. Memory is the positions held in all: budget x "
                    f"{len(bundle.traces)} heads, the same for every allocator at a budget.")
    policies = frontier_policies(found.get(steps, []))
    rows = {(r["policy"], r["allocate"], r["budget"]): r for r in found.get(steps, [])
            if r.get("policy") in policies and r.get("allocate") in FRONTIER_ALLOCATORS}
    shape = [(t.layer, t.head) for t in bundle.traces]
    table, missing, points, refused = [], [], [], set()
    for policy in policies:
        for allocate in FRONTIER_ALLOCATORS:
            line = {"policy": policy, "allocator": allocate}
            for budget in FRONTIER_BUDGETS:
                column = f"budget {budget}: {budget * len(bundle.traces)} positions"
                r = rows.get((policy, allocate, budget))
                if r is not None:
                    points.append(r)
                    line[column] = f"KL {r['kl']:.4f}, ΔNLL {r['delta_nll']:.4f}, mass {r['retained_mass']:.4f}"
                    continue
                loose = PolicySpec.of(policy, 10**9)  # the policy's defaults, whatever the budget
                if budget < al.minimum_budget(loose):
                    line[column] = f"cannot run: below {policy}'s minimum of {al.minimum_budget(loose)} per head"
                    refused.add(f"{policy} at {budget}: {al.minimum_why(PolicySpec(policy, budget, loose.params))}")
                    continue
                try:
                    al.check(allocate, PolicySpec.of(policy, budget), shape, steps)
                except ValueError as e:  # al.AllocationError is one
                    line[column] = "cannot run: see below the table"
                    refused.add(f"{policy} by {allocate} at {budget}: {_short(e)}")
                    continue
                mass = mass_here.get((policy, allocate, budget))
                line[column] = "KL not measured" + ("" if mass is None else f"; mass {mass:.4f} (the bundle's)")
                missing.append((policy, allocate, budget))
            table.append(line)
    if points:
        best = pareto(points)
        fig = frontier_figure(points, title=f"{name}, {steps} steps: memory against KL, {len(points)} cells measured",
                              ticks={b * len(bundle.traces): f"{b * len(bundle.traces)}<br>(budget {b})" for b in FRONTIER_BUDGETS})
        st.plotly_chart(fig, key="allocation_frontier")
        st.markdown("**Pareto-best** (ringed: no other measured cell has a lower KL with as few positions or fewer): "
                    + "; ".join(f"{p['policy']} by {p['allocate']} at {p['positions']} positions (KL {p['kl']:.4f})"
                                for p in best) + ".")
    else:
        st.info(f"No cell of the frontier is measured yet for {name} over {steps} steps, so nothing is drawn.")
    st.dataframe(table, hide_index=True)
    if refused:
        st.caption("Cannot run: " + "; ".join(sorted(refused)) + ".")
    if missing:
        policy, allocate, budget = missing[0]
        st.markdown(f"**{len(missing)} cells not measured** ({len(rows)} measured). Each is cached on disk when "
                    f"measured, and drawn here on the next run. All of them (a cell measured already is read, not "
                    f"measured again; an interrupted run resumes):")
        st.code(_command(text, steps, sorted({m[0] for m in missing}, key=policies.index),
                         sorted({m[2] for m in missing}), sorted({m[1] for m in missing}, key=FRONTIER_ALLOCATORS.index)),
                language="bash")
        st.markdown("One cell, e.g. the first missing one:")
        st.code(_command(text, steps, [policy], [budget], [allocate]), language="bash")


def _short(e: Exception) -> str:
    return " ".join(str(e).split())

"""Your model: recent_window tuned per layer of a recorded model (a bundle), and a layer opened in
the kept-position views with the window recommended for it."""

from __future__ import annotations

import streamlit as st

from kvsim.cluster import INSTALL_HINT
from kvsim.data.catalog import available_bundles
from kvsim.views import model_figures
from kvsim.views import support as views
from kvsim.views import window_truth as vt
from kvsim.views.deploy import deploy_snippets

from .charts import selectable
from .memo import cached_bundle, tuned
from .state import TABS, curve_policies, drop_upload, mirrored
from .truth_panel import model_answer


def open_layer(selector: str, recent_window: int, policy: str) -> None:
    """Open one layer's trace in the kept-position views, with the window recommended for it."""
    drop_upload()  # an upload would replace it
    st.session_state.update(trace=selector, recent_window=recent_window, curve_policy=policy, view=TABS[0])
    if policy not in st.session_state["policies"]:
        st.session_state["policies"] = [*st.session_state["policies"], policy]


def pick_layer(result) -> None:
    chosen = views.selected_row(st.session_state.get("tune_chart"), result)
    if chosen is not None:
        st.session_state["model_layer"] = chosen


def model_view(budget: int) -> None:
    names = available_bundles()
    if not names:
        st.info("No recorded model is shipped here. Record one with `python -m kvsim record` "
                f"(needs the record extra: `{INSTALL_HINT}`), into traces/<name>/.")
        return
    top = st.columns([2, 2, 3])
    with top[0]:
        name = mirrored(st.selectbox, "recorded model (bundle)", names, "bundle", "bundle_choice")
    with top[1]:
        policy = mirrored(st.selectbox, "policy (one with a recent_window)", curve_policies(), "curve_policy", "model_policy")
    bundle = cached_bundle(name)
    with top[2]:
        st.markdown(f"**{bundle.model}**, {bundle.describe()}. Budget {budget} (the sidebar's): every layer's cache "
                    f"holds {budget} positions.")
    if budget < 2:
        st.error(f"tuning needs a budget of at least 2 (recent_window runs from 1 to budget - 1); budget is {budget}.")
        return
    result = tuned(name, policy, budget)
    wide = result.model_wide()
    st.markdown(
        f"**Where should each layer's recent window be?** Each row is one layer's replay of {policy} at every "
        f"recent_window from 1 to {budget - 1}; colour is retained mass. The circle is the layer's *recommended* "
        f"window, the smallest within {result.tolerance} of its best (the cross): past it the curve is flat, and a "
        f"smaller window leaves more of the cache to the heavy hitters. One window for all layers: "
        f"**{wide['one_window']['recommended_window']}**. **Click a layer's circle or cross** (or choose the layer below) for its curve."
    )
    truth = vt.truth_for(bundle.manifest, policy, budget)  # the curve view's measurements, shipped or made here
    pick = None if truth is None else model_answer(truth)  # the curve view's answer to the same question
    if pick is not None:
        st.markdown(vt.sentence(truth, pick) + f" `python -m kvsim tune --trace {name} --policy {policy} --budget {budget} "
                    "--by kl` recommends by the truth itself.")
    fig = model_figures.tune_heatmap(result)
    st.plotly_chart(selectable(fig, "points"), key="tune_chart", on_select=lambda: pick_layer(result), selection_mode="points")
    one = len(result.traces) == len(bundle.layers)
    labels = {(t.layer, t.head): views.trace_selector(name, t.layer, t.head, one).split(":")[1] for t in result.traces}
    _layer(result, name, policy, labels, one)
    _table(result, labels)
    _deploy(result, name, bundle.model, truth)
    st.caption(f"Computed once per server ({result.run.get('seconds', 0):.0f} s). The same from the command line: "
               f"`python -m kvsim tune --trace {name} --policy {policy} --budget {budget} --serial`.")


def _layer(result, name: str, policy: str, labels: dict, one: bool) -> None:
    """The chosen layer: its figures, the button that opens it, and its curve."""
    rows = list(labels)
    if tuple(st.session_state.get("model_layer") or ()) not in labels:
        st.session_state["model_layer"] = rows[0]
    st.session_state["model_layer_choice"] = tuple(st.session_state["model_layer"])
    left, right = st.columns([1, 3])
    with left:
        layer, head = st.selectbox(
            "layer", rows, key="model_layer_choice", format_func=labels.get,
            on_change=lambda: st.session_state.update(model_layer=st.session_state["model_layer_choice"]))
        t = next(x for x in result.traces if (x.layer, x.head) == (layer, head))
        choice = result.choice(t)
        st.markdown(f"**{labels[(layer, head)]}** ({t.attention} attention): **recommended** recent_window "
                    f"**{choice.recommended}** (retained mass {choice.recommended_mass:.4f}), the smallest within "
                    f"{choice.tolerance:g} of the **best**, {choice.best} ({choice.best_mass:.4f}). "
                    + ", ".join(f"{p} {m:.4f}" for p, (m, _r) in t.baselines.items()) + " at the same budget.")
        selector = views.trace_selector(name, layer, head, one)
        st.button(f"open {labels[(layer, head)]} in the kept-position views", key="open_layer", on_click=open_layer,
                  args=(selector, t.recommended_window, policy),
                  help=f"sets the trace to {selector} and recent_window to {t.recommended_window}")
    with right:
        st.plotly_chart(model_figures.tune_curve(result, layer, head), key="tune_curve")


def _deploy(result, name: str, model: str, truth) -> None:
    """The recommended windows, deployed: the commands and the Python lines (docs/deploy.md), and what
    tune's default would deploy instead."""
    sentence, shell, python = deploy_snippets(result, name, model, truth)
    st.markdown(sentence)
    st.code(shell, language="bash")
    st.code(python, language="python")


def _table(result, labels: dict) -> None:
    st.dataframe(
        {"layer": [labels[(x.layer, x.head)] for x in result.traces],
         "attention": [x.attention for x in result.traces],
         "recommended recent_window": [x.recommended_window for x in result.traces],
         "retained mass there": [round(x.recommended_mass, 4) for x in result.traces],
         "best recent_window": [x.best_window for x in result.traces],
         "best retained mass": [round(x.best_mass, 4) for x in result.traces]},
        hide_index=True, key="tune_table", height=35 * (len(result.traces) + 1) + 3,
    )

"""Proxy against truth: what the model loses beside what the simulator measures."""

from __future__ import annotations

import streamlit as st

from kvsim.cluster import INSTALL_HINT
from kvsim.data import catalog
from kvsim.views import quality_figures
from kvsim.views import support as views


def quality_view(budget: int) -> None:
    """The proxy against the truth at the sidebar's ``budget``; where nothing is measured at it, the
    headline says so and which budget is shown instead (it showed budget 64 under a budget of 256,
    said only in the footer)."""
    found = _sets()
    if not found:
        st.info(
            "No quality results here yet. They need a real model run (torch and transformers: "
            f"`{INSTALL_HINT}`; a few minutes on two cores). Produce them with\n\n"
            f"`{views.QUALITY_COMMAND}`\n\nand save the printed JSON as `traces/{views.QUALITY_RESULTS.name}` "
            "(or leave them in the disk cache, which this view also reads)."
        )
        return
    results, meta, source, exact = views.measured_at(budget, found)
    shown, steps = results[0]["budget"], results[0]["steps"]
    modes = " and ".join(sorted({r["mode"] for r in results}))
    if exact:
        st.markdown(f"**At budget {budget}, the sidebar's:** {len(results)} measurements ({modes} loop), "
                    f"{steps} steps, from {source}.")
    else:
        measured = sorted({r["budget"] for s in found for r in s[0]})
        st.warning(f"**Budget {shown} shown, not the sidebar's {budget}:** nothing here is measured at budget {budget} "
                   f"(the model's own loss is measured at budget {', '.join(map(str, measured))} only). Shown instead: "
                   f"budget {shown}, {steps} steps ({modes} loop), from {source}. Set the sidebar's budget to {shown}, "
                   f"or measure budget {budget} with `{views.QUALITY_COMMAND.replace('--budget 64', f'--budget {budget}')}`.",
                   icon=":material/info:")
    st.markdown(
        "**Is retained mass a good proxy for what the model loses?** For a recording that carries its text (the "
        "shipped Gemma-3-270M bundle over CPython's heapq.py), `python -m kvsim quality` runs the model itself with "
        "every layer's cache evicted by a policy and measures the change in its next-token loss (delta NLL, nats per "
        "token) and how far its next-token distribution moves (KL), beside the simulator's retained mass. "
        "*closed*: decoding with the evicted cache (the truth); *open*: the simulator's schedule replayed as masks."
    )
    rhos = views.rank_correlations(results)
    cols = st.columns(max(1, len(rhos)))
    for col, (mode, (rho, n)) in zip(cols, rhos.items(), strict=False):
        col.metric(f"Spearman rank correlation, {mode} ({n} points)", views.rho_text(rho),
                   help="of delta NLL against retained mass across policies and windows: -1 means more mass "
                        "kept is always less loss")
        col.markdown(views.rho_reading(rho))
    st.plotly_chart(quality_figures.scatter_figure(results), key="quality_scatter")
    for policy in views.swept_policies(results):
        st.plotly_chart(quality_figures.curve_figure(results, policy=policy), key=f"quality_curve_{policy}")
    st.dataframe(
        {"policy": [r["policy"] for r in results], "params": [", ".join(f"{k}={v}" for k, v in r["params"].items())
                                                              for r in results],
         "budget": [r["budget"] for r in results], "mode": [r["mode"] for r in results],
         "delta NLL": [round(r["delta_nll"], 4) for r in results], "KL": [round(r["kl"], 4) for r in results],
         "retained mass": [round(r["retained_mass"], 4) for r in results]},
        hide_index=True, key="quality_table",
    )
    command = meta.get("command") if isinstance(meta, dict) else None
    st.caption(f"From {source}, {steps} steps" + (f"; produced by `{command}`" if command else "") + ".")


def _sets() -> list[tuple[list[dict], dict, str]]:
    """Every set of measurements of the proxy against the model's loss here, as ``(results, meta,
    source)``: the shipped quality results, those in the quality disk cache, and the truth documents'
    sweeps (open loop; ``kvsim.views.window_truth``). A damaged results file is said in one line."""
    from kvsim.models.truth import documents

    sets = []
    try:
        shipped = views.quality_results()
    except views.QualityResultsError as e:
        st.error(f"{e}. Produce it again with the command below.")
        shipped = None
    if shipped is not None:
        sets.append((*shipped, f"`{views.QUALITY_RESULTS.name}` (shipped)"))
    cached = views.cached_quality_results()
    if cached:
        sets.append((cached, {}, "the quality disk cache"))
    for path, doc in documents():
        where = "shipped" if path.parent == catalog.TRACES_DIR else "measured here"
        truth = views.truth_as_quality(doc, f"`{path.name}` (the truth's sweep, {where})")
        if truth is not None:
            sets.append(truth)
    return sets

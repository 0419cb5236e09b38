"""Proxy against truth: what the model loses beside what the simulator measures."""

from __future__ import annotations

import streamlit as st

from kvsim.views import quality_figures
from kvsim.views import support as views


def quality_view() -> None:
    st.markdown(
        "**Is retained mass a good proxy for what the model loses?** For a recording that carries its text (the "
        "shipped Gemma-3-270M bundle over CPython's heapq.py), `python -m kvsim quality` runs the model itself with "
        "every layer's cache evicted by a policy and measures the change in its next-token loss (delta NLL, nats per "
        "token) and how far its next-token distribution moves (KL), beside the simulator's retained mass. "
        "*closed*: decoding with the evicted cache (the truth); *open*: the simulator's schedule replayed as masks."
    )
    found, source = _results()
    if found is None:
        st.info(
            "No quality results here yet. They need a real model run (torch and transformers: "
            "`pip install -r requirements-record.txt`; a few minutes on two cores). Produce them with\n\n"
            f"`{views.QUALITY_COMMAND}`\n\nand save the printed JSON as `traces/{views.QUALITY_RESULTS.name}` "
            "(or leave them in the disk cache, which this view also reads)."
        )
        return
    results, meta = found
    rhos = views.rank_correlations(results)
    cols = st.columns(max(1, len(rhos)))
    for col, (mode, (rho, n)) in zip(cols, rhos.items(), strict=False):
        col.metric(f"Spearman rank correlation, {mode} ({n} points)", views.rho_text(rho),
                   help="of delta NLL against retained mass across policies and windows: -1 means more mass "
                        "kept is always less loss")
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
    st.caption(f"From {source}, {results[0]['steps']} steps" + (f"; produced by `{command}`" if command else "") + ".")


def _results() -> tuple[tuple[list[dict], dict] | None, str]:
    """The shipped results, else those in the quality disk cache; and where they came from. A
    damaged results file is said in one line."""
    try:
        found = views.quality_results()
    except views.QualityResultsError as e:
        st.error(f"{e}. Produce it again with the command below.")
        found = None
    source = f"`{views.QUALITY_RESULTS.name}` (shipped)"
    if found is None:
        cached = views.cached_quality_results()
        if cached:
            found, source = (cached, {}), "the quality disk cache"
    return found, source

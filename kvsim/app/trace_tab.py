"""The trace view: the attention matrix itself, and its statistics."""

from __future__ import annotations

import streamlit as st

import kvsim
from kvsim.analysis.metrics import repair_note
from kvsim.views import figures, story

from .downloads import html_button, stem
from .memo import BY_TRACE, cached_features, describe


@st.cache_resource(max_entries=4, show_spinner="drawing the attention matrix", hash_funcs=BY_TRACE)
def cached_trace_matrix(trace: kvsim.Trace):
    return figures.trace_matrix(trace, cached_features(trace))


def trace_view(trace: kvsim.Trace) -> None:
    features = cached_features(trace)
    info = describe(trace, features)
    chart, text = st.columns([3, 1])
    with chart:
        fig = cached_trace_matrix(trace)
        st.plotly_chart(fig, key="trace_chart")
        html_button("this figure (HTML)", fig, f"{stem(trace)}-attention.html", "html_trace")
    with text:
        st.markdown(story.trace_text(features, info))
        repaired = repair_note(trace)
        if repaired:
            st.warning(repaired)
        st.dataframe(
            {
                "figure": [
                    "decode steps",
                    "share on position 0" if info["sinks"] == 1 else f"share on the sinks (positions 0-{info['sinks'] - 1})",
                    f"share on the newest {info['band']} positions",
                    f"share on each row's top {info['top_k']}",
                    "effective positions per row",
                ],
                "value": [
                    f"{info['steps']}",
                    _fmt(info["sink_share"]),
                    _fmt(info["recent_share"]),
                    _fmt(info["top_k_share"]),
                    _fmt(info["effective_positions"], ".1f"),
                ],
            },
            hide_index=True,
        )
        st.caption(
            "Shares are means over rows. Effective positions is exp(entropy) of a row: how many positions "
            "its attention spreads over (uniform over n gives n)."
        )
        name = trace.meta.get("name", trace.name) if isinstance(trace.meta, dict) else trace.name
        st.caption(f"trace: {name}. Sinks: {features.sink_source}. Band: {features.band_source}. "
                   f"Heavy hitters: {features.heavy_source}.")


def _fmt(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)

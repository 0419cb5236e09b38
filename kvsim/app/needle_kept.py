"""A pass-key trial opened in the kept-positions view (issue 35): the trial's attention is a bundle
(``kvsim needle --attention``, ``kvsim.models.needle_traces``) whose traces carry the key's positions in
their meta; the kept view replays it like any trace, and this marks the key's columns on each panel, an x
where each key token left, and says the steps in a table. Replayed with the trial's own policy, budget and
parameters, the steps are the trial's own departures (tests/test_needle_traces.py)."""

from __future__ import annotations

import streamlit as st

import kvsim
from kvsim.models.needle_traces import departures_of
from kvsim.views import figures
from kvsim.views.figures.needle import KEY_COLOUR

from .state import TABS, drop_upload

#: the trace meta key that makes a trace a needle trial's
KEY = "key_positions"


def key_positions(trace: kvsim.Trace) -> list[int] | None:
    meta = trace.meta if isinstance(trace.meta, dict) else {}
    keys = meta.get(KEY)
    if not isinstance(keys, list) or not all(isinstance(p, int) and 0 <= p <= trace.steps for p in keys):
        return None
    return keys


def key_departures(trace: kvsim.Trace, results) -> dict[str, list[int]]:
    """Per replay (its label), each key token's departure step in that replay (-1: held to the end)."""
    keys = key_positions(trace) or []
    out = {}
    for r in results:
        left = departures_of(r.kept_history, trace.steps)
        out[figures.policy_label(r)] = [int(left[p]) for p in keys]
    return out


def marked(fig, trace: kvsim.Trace, results):
    """A copy of the kept figure with the key's columns shaded on each panel and an x where each key
    token left (a circle at the last step where it stayed)."""
    import plotly.graph_objects as go

    keys = key_positions(trace)
    if not keys:
        return fig
    fig = go.Figure(fig)
    panels = list(dict.fromkeys((t.xaxis or "x", t.yaxis or "y") for t in fig.data if t.type == "image"))
    steps = key_departures(trace, results)
    for i, ((xa, ya), (label, gone)) in enumerate(zip(panels, steps.items(), strict=False)):
        for p in keys:  # from the step the key token came (step p admits position p)
            fig.add_shape(type="rect", x0=p - 0.5, x1=p + 0.5, y0=p - 0.5, y1=trace.steps, xref=xa, yref=ya,
                          line_width=0, fillcolor=KEY_COLOUR, opacity=0.3)
        left = [(p, s) for p, s in zip(keys, gone, strict=True) if s >= 0]
        stayed = [p for p, s in zip(keys, gone, strict=True) if s < 0]
        if left:
            fig.add_trace(go.Scatter(x=[p for p, _ in left], y=[s for _, s in left], xaxis=xa, yaxis=ya, mode="markers",
                                     marker=dict(symbol="x", size=10, color=KEY_COLOUR, line=dict(width=2)),
                                     name=f"{label}: key token left", showlegend=i == 0, legendgroup="key",
                                     hovertemplate="key token at %{x} left at step %{y}<extra></extra>"))
        if stayed:
            fig.add_trace(go.Scatter(x=stayed, y=[trace.steps] * len(stayed), xaxis=xa, yaxis=ya, mode="markers",
                                     marker=dict(symbol="circle-open", size=9, color=KEY_COLOUR), showlegend=i == 0,
                                     legendgroup="key-held",
                                     name=f"{label}: key token held to the end",
                                     hovertemplate="key token at %{x} held to the end<extra></extra>"))
    return fig


def note(trace: kvsim.Trace, results) -> None:
    """The key's tokens and the step each replay let each go, under the figure."""
    keys = key_positions(trace)
    if not keys:
        return
    meta = trace.meta
    st.markdown(f"**A pass-key trial** ({meta.get('label', '')}, prompt {meta.get('prompt_length', '?')} tokens): the "
                f"attention each step of the trial showed its cache's policy, so a replay of that policy at the trial's "
                f"budget keeps what the trial's cache kept. The key's columns are shaded red, an x where a key token "
                f"left (a circle: held to the end).")
    rows = [{"policy": label, **{f"position {p}": ("held" if s < 0 else s) for p, s in zip(keys, gone, strict=True)}}
            for label, gone in key_departures(trace, results).items()]
    st.dataframe(rows, hide_index=True, key="needle_kept_steps")


def open_trial(selector: str, policy: str, budget: int, params: dict) -> None:
    """Open one layer of a trial's attention in the kept-positions view with the trial's policy, budget
    and parameters (the sidebar's), the zoom reset and the step the last."""
    drop_upload()  # an upload would replace it
    st.session_state.update(trace=selector, policies=[policy], budget=int(budget), view=TABS[0])
    for name, value in params.items():
        st.session_state[name] = value


__all__ = ["key_departures", "key_positions", "marked", "note", "open_trial"]

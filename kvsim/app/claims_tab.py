"""The claims ledger: every checkable claim of the two cards, measured on the trace on screen."""

from __future__ import annotations

import streamlit as st

import kvsim
from kvsim.analysis.claims import BUDGET as CLAIMS_BUDGET
from kvsim.analysis.claims import VERDICTS
from kvsim.analysis.claims.ledger import kept_ledger
from kvsim.views import support as views

from .memo import BY_TRACE
from .state import showing_upload


@st.cache_resource(max_entries=4, show_spinner="measuring every claim of the two cards on this trace",
                   hash_funcs=BY_TRACE)
def cached_ledger(trace: kvsim.Trace) -> list[dict]:
    return kept_ledger(trace)  # read from beside the trace where an earlier server measured it


def claims_view(trace: kvsim.Trace) -> None:
    records = cached_ledger(trace)
    counts = ", ".join(f"{views.VERDICT_MARKS[v]} {sum(r['verdict'] == v for r in records)} {v}" for v in VERDICTS)
    st.markdown(
        f"**Every checkable claim of the h2o and sliding_window cards, measured on {trace.name}** at budget "
        f"{CLAIMS_BUDGET}: {counts}. Each quotes the card's words, says what is measured and how that decides it, "
        "and links to the view and settings that show it (`python -m kvsim claims` prints the same ledger)."
    )
    st.plotly_chart(ledger_figure(records, trace.name), key="claims_ledger")
    present = [v for v in VERDICTS if any(r["verdict"] == v for r in records)]
    shown = st.multiselect("show the claims whose verdict is", present, default=present, key="claims_verdicts")
    upload = showing_upload()
    spec = None if upload else st.session_state.get("trace")
    if upload:
        st.caption("The links open the views on the shipped trace they name: an upload cannot travel in a link.")
    for r in records:
        if r["verdict"] in shown:
            _card(r, spec)


#: each verdict's bar colour (the text's colours, as hex)
VERDICT_HEX = {"holds": "#2e7d32", "fails": "#c62828", "not applicable": "#9e9e9e", "not measured": "#ef6c00"}


def ledger_figure(records: list[dict], trace: str):
    """The ledger at a glance: per card, how many of its claims hold, fail, do not apply or are not measured
    on this trace (a bar's length is the count, from zero), so a card whose claims fail here stands out."""
    import plotly.graph_objects as go

    cards = list(dict.fromkeys(r["card"] for r in records))
    fig = go.Figure()
    for v in VERDICTS:
        counts = [sum(r["card"] == c and r["verdict"] == v for r in records) for c in cards]
        if any(counts):
            fig.add_bar(y=[f"the {c} card" for c in cards], x=counts, name=v, orientation="h",
                        marker_color=VERDICT_HEX[v], text=[n or "" for n in counts], textposition="inside")
    fig.update_layout(barmode="stack", height=130 + 40 * len(cards), margin=dict(l=10, r=10, t=75, b=30),
                      title=dict(text=f"the cards' claims on {trace}, by verdict", font=dict(size=14), y=0.97),
                      xaxis=dict(title="claims", rangemode="tozero", dtick=1),
                      legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0, traceorder="normal"))
    return fig


def _card(r: dict, trace: str | None) -> None:
    with st.container(border=True):
        colour = views.VERDICT_COLOURS[r["verdict"]]
        st.markdown(f":{colour}[{views.VERDICT_MARKS[r['verdict']]} **{r['verdict']}**] · `{r['id']}` · "
                    f"the {r['card']} card · scope: {r['scope']}")
        st.markdown(f"> {r['words']}")
        st.markdown(f"**Measured:** {r['measurement']}")
        if r["figures"]:
            st.markdown("**Figures:** " + "; ".join(f"`{k}` = {v}" for k, v in r["figures"].items()))
        if r["note"]:
            st.caption(r["note"])
        link = views.claim_link(r["view"], trace)
        st.markdown(f"[open the view “{r['view']['view']}” with the settings that show it]({link})")

"""The claims ledger: every checkable claim of the two cards, measured on the trace on screen."""

from __future__ import annotations

import streamlit as st

import kvsim
from kvsim.analysis.claims import BUDGET as CLAIMS_BUDGET
from kvsim.analysis.claims import VERDICTS, ledger
from kvsim.views import support as views

from .memo import BY_TRACE
from .state import showing_upload


@st.cache_resource(max_entries=4, show_spinner="measuring every claim of the two cards on this trace",
                   hash_funcs=BY_TRACE)
def cached_ledger(trace: kvsim.Trace) -> list[dict]:
    return ledger(trace)


def claims_view(trace: kvsim.Trace) -> None:
    records = cached_ledger(trace)
    counts = ", ".join(f"{views.VERDICT_MARKS[v]} {sum(r['verdict'] == v for r in records)} {v}" for v in VERDICTS)
    st.markdown(
        f"**Every checkable claim of the h2o and sliding_window cards, measured on {trace.name}** at budget "
        f"{CLAIMS_BUDGET}: {counts}. Each quotes the card's words, says what is measured and how that decides it, "
        "and links to the view and settings that show it (`python -m kvsim claims` prints the same ledger)."
    )
    present = [v for v in VERDICTS if any(r["verdict"] == v for r in records)]
    shown = st.multiselect("show the claims whose verdict is", present, default=present, key="claims_verdicts")
    upload = showing_upload()
    spec = None if upload else st.session_state.get("trace")
    if upload:
        st.caption("The links open the views on the shipped trace they name: an upload cannot travel in a link.")
    for r in records:
        if r["verdict"] in shown:
            _card(r, spec)


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

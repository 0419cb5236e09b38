"""The Pass key view's conversation (issue 57, item 4): a pass key per turn (``kvsim needle --keys K``), turn by
turn: which key each turn asked for and whether the full cache and the policy found it, and per key where it
left each (layer, KV head)'s cache, beside the optimum over the whole conversation. A fresh install draws the
measurements docs/needle.md made (``traces/needle-conversation.json``); every grid ``kvsim needle --keys K``
saved here joins them (``kvsim.models.conversation_grid``). A file the view cannot draw is one warning line."""

from __future__ import annotations

import streamlit as st

from kvsim.models import conversation_grid as grid
from kvsim.views.figures import needle_turns as figures

COMMAND = "python -m kvsim needle --keys 2 --depths 0.3,0.7 --lengths 1024 --policy h2o,snapkv --budget 256 --optimum"


def _measurements() -> list[tuple[str, dict]]:
    """(how it is listed, its document): the shipped ones, then one's own, newest first."""
    out = []
    try:
        out += [("shipped", m) for m in grid.shipped()]
    except grid.ConversationGridError as e:
        st.warning(str(e))
    for path in grid.saved():
        try:
            out.append((f"yours, {path.name}", grid.read(path)))
        except grid.ConversationGridError as e:
            st.warning(str(e))
    return out


def _name(where: str, doc: dict) -> str:
    runs = ", ".join(dict.fromkeys(r["label"] for c in doc["cells"] for r in c["runs"]))
    lengths = ", ".join(map(str, doc.get("lengths") or sorted({c["length"] for c in doc["cells"]})))
    return f"{doc['model']}, {doc['keys']} keys, {lengths} tokens: {runs} ({where})"


def conversation_view() -> None:
    st.subheader("A conversation: a pass key per turn")
    docs = _measurements()
    if not docs:
        st.info("No conversation here: this install has no traces/needle-conversation.json and no conversation grid of "
                f"its own; measure one with `{COMMAND}`.")
        return
    i = st.selectbox("conversation", range(len(docs)), key="needle_conv_doc", format_func=lambda j: _name(*docs[j]))
    where, doc = docs[i]
    cells = doc["cells"]
    c1, c2 = st.columns(2)
    best = max(range(len(cells)), key=lambda n: (sum(cells[n]["control"]["found"]), -n))  # first where the full cache found most
    j = c1.selectbox("trial", range(len(cells)), index=best, key="needle_conv_trial",
                     format_func=lambda n: f"{cells[n]['length']} tokens, trial {cells[n]['trial'] + 1}: the full cache found "
                     f"{sum(cells[n]['control']['found'])} of {len(cells[n]['keys'])} keys")
    cell = cells[j if j < len(cells) else 0]
    labels = [r["label"] for r in cell["runs"]]
    label = c2.selectbox("policy", labels, key="needle_conv_policy")
    run = cell["runs"][labels.index(label) if label in labels else 0]
    depths = ", ".join(f"{d:g}" for d in cell["depths"])
    st.markdown(
        f"**{len(cell['keys'])} keys hidden in one context of {cell['context_tokens']} tokens** (depths {depths}, key i "
        f"at the i-th), then {len(cell['keys'])} turns on one cache that keeps evicting as it decodes: turn i asks for "
        f"key i and the model writes {doc.get('new_tokens', '?')} tokens greedily. The turns' questions start at "
        f"positions {', '.join(map(str, run['turn_starts']))} of {run['positions']}.")
    st.dataframe(figures.turn_rows(cell, run), hide_index=True, key="needle_conv_turns")
    missed = [n + 1 for n, ok in enumerate(cell["control"]["found"]) if not ok]
    if missed:
        which = f"turn {missed[0]}" if len(missed) == 1 else \
            f"turns {', '.join(map(str, missed[:-1]))} and {missed[-1]}"
        st.caption(f"The full cache missed {which} too: there the policy's answer says nothing about its cache; where "
                   "the key left (below) still does.")
    if run.get("key_left") is None:
        st.info(f"{label}: this run kept no key fates to draw.")
        return
    st.plotly_chart(figures.key_fates(cell, run), key="needle_conv_fates")
    optimum = " beside the optimum over the whole conversation at the same budgets (the full cache's attention " \
        "over every step it took, the best schedule for all turns at once)" if run.get("optimal_key_left") else ""
    st.caption(f"Per key, each layer's (and KV head's) cache under {label}{optimum}: the cell says the step at which "
               "the key's last token left, coloured by when that was (in the context, during a turn's question or "
               "answer), or held where a token of it stayed to the end. A key gone before its own turn cannot be found."
               + (" This prompt was compressed in one call: what it dropped left at that call's last step (turn 1's "
                  "question's last, query-aware; the context's last, query-agnostic)." if run.get("prefill") else ""))
    said = figures.summary(run)
    if said:
        st.markdown(said)
    if doc.get("command"):
        st.caption(f"Measured with `{doc['command']}`" + (f" ({doc['measured']})" if doc.get("measured") else "")
                   + "; docs/needle.md, \"A conversation: a pass key per turn\".")
    else:
        st.caption(f"Measured here ({where}).")


__all__ = ["conversation_view"]

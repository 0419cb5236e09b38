"""The sidebar's serving layout (``kvsim.policykit.layouts``; docs/serving.md): blocks, shared selection across
a layer's KV heads, decisions every K steps. Folded away on a first paint, like the more policy parameters:
its inputs are drawn only while open and its values live in the session (and in the link, when set).

The layout is checked by the simulator's own rules (``Layout.check``, what the CLI's flags run): a policy it
refuses is said in one line and left out (``Settings.read``), what is only worth saying (a budget rounded
down to whole blocks; shared selection on a trace of one KV head, which every trace here is) is one caption.
It applies to the kept view, the plan download and the memory panel; the other views replay without it.
Nothing here replays: with no layout set, the page computes nothing more than before.
"""

from __future__ import annotations

import streamlit as st

from kvsim.policykit.layouts import Layout

from .state import BLOCK_SIZES, LAYOUT_KEYS, MAX_VALUE

#: the session key of the layout's expander: True while it is open
LAYOUT_OPEN = "layout_open"
LABEL = "serving layout: blocks, shared selection, intervals"
#: what the layout changes in the app, said under the control
APPLIES = "applies to the kept view, the plan download and the memory panel; the other views replay without it"


def chosen() -> Layout | None:
    """The layout the session's controls state, or None for none (today's replays, untouched)."""
    s, shared, k = (st.session_state.get(key, default) for key, default in LAYOUT_KEYS.items())
    layout = Layout(int(s), bool(shared), int(k))
    return None if layout.plain else layout


def notes(layout: Layout, budget: int) -> list[str]:
    """What is only worth saying of ``layout`` at ``budget`` on a trace of one KV head: the budget rounded down
    to whole blocks, shared selection a no-op. A layout that cannot run is refused per policy, not here."""
    said = []
    try:
        said += [n for n in [layout.memory(budget)[1]] if n]
    except ValueError:  # a block larger than the budget: each policy's refusal says it
        pass
    if layout.shared_selection:
        said.append("shared selection on a trace with one KV head: a no-op (each trace here is one KV head of one layer)")
    return said


def layout_control(budget: int) -> None:
    """The expander in the sidebar; under it, while a layout is set, its label, where it applies and what is
    worth saying of it at ``budget`` (``notes``)."""
    side = st.sidebar
    panel = side.expander(LABEL, key=LAYOUT_OPEN, on_change="rerun")
    for key in LAYOUT_KEYS:  # kept past a run where the inputs are folded away (Streamlit drops a hidden input's value)
        st.session_state[key] = st.session_state.get(key, LAYOUT_KEYS[key])
    if panel.open:
        with panel:
            st.selectbox("block size", BLOCK_SIZES, key="block_size",
                         format_func=lambda s: "1 (no blocks)" if s == 1 else f"{s}" + (" (vLLM's page)" if s == 16 else ""),
                         help="the cache in blocks of this many positions; only whole, complete blocks leave, the "
                              "lowest summed score first; a budget that is no multiple is rounded down to whole blocks")
            st.checkbox("shared selection across a layer's KV heads", key="shared_selection",
                        help="a layer's KV heads hold the same positions, scored by their sum over the heads: a no-op "
                             "on a trace of one KV head (every trace here is one)")
            st.number_input("decide every K steps", min_value=1, max_value=MAX_VALUE, step=1, key="evict_every",
                            help="the policy decides only at steps that are multiples of K, evicting down to budget - "
                                 "K + 1; the cache grows in between, never past the budget")
    layout = chosen()
    if layout is not None:
        side.caption(f"**layout: {layout.label}**; {APPLIES}." + "".join(f" {n[0].upper()}{n[1:]}." for n in notes(layout, budget)))


__all__ = ["APPLIES", "LABEL", "LAYOUT_OPEN", "chosen", "layout_control", "notes"]

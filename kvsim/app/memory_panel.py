"""The sidebar's memory panel: how many bytes the cache on screen is (``kvsim.analysis.memory``), what the
budget holds against the full cache at the trace's length, the same for larger models at 32k and 128k
tokens, and where memory is only masked (the simulator) and where it is freed (the deployed cache).

Drawn only while open (a first paint draws less); the arithmetic is a few integer products.
"""

from __future__ import annotations

import streamlit as st

#: the session key of the panel's expander: True while it is open
MEMORY_OPEN = "memory_open"
LABEL = "memory: how many bytes is this?"


def memory_panel(meta: dict, steps: int, budget: int, layout=None) -> None:
    """The panel, in the sidebar, for a trace of ``steps`` steps with ``meta`` at ``budget``, under ``layout``
    (the sidebar's serving layout, None for none)."""
    panel = st.sidebar.expander(LABEL, key=MEMORY_OPEN, on_change="rerun")
    if panel.open:
        with panel:
            for block in memory_text(meta, steps, budget, layout):
                st.markdown(block)


def _share(kept: int, full: int) -> str:
    share = kept / full
    if share >= 1:
        return "all of it: the budget holds every position, nothing is evicted"
    return f"{100 * share:.3g}% of the full cache, {full / kept:.3g}x smaller"


def memory_text(meta: dict, steps: int, budget: int, layout=None) -> list[str]:
    """The panel's paragraphs, from the arithmetic alone (``AppTest`` and the user read the same words); under
    a serving layout, its memory beside the unconstrained one (``layout_text``) second."""
    from kvsim.analysis import memory

    out = _memory_text(meta, steps, budget)
    if layout is not None:
        shape = memory.model_of(meta)
        larger = next(i for i, p in enumerate(out) if p.startswith("**Larger models**"))  # after this trace's own
        out.insert(larger, layout_text(shape or memory.ONE_HEAD, steps + 1, budget, layout))
    return out


#: bytes of one entry of a block table or slot map (an int32 index, as vLLM's block tables are)
INDEX_BYTES = 4


def layout_text(shape, n: int, budget: int, layout) -> str:
    """What ``layout`` allocates for ``shape`` (``kvsim.analysis.memory.ModelShape``) after ``n`` positions at
    ``budget``, beside the unconstrained cache: whole blocks (the budget rounded down to them, as the simulator
    runs it), and the index that maps them, one per layer and KV head, or one per layer under shared selection."""
    from kvsim.analysis import memory

    s, k = layout.block_size, layout.evict_every
    head = f"**Under the layout {layout.label}**"
    try:
        held, note = layout.memory(budget)
    except ValueError as e:  # a block larger than the budget: the page's error says it for each policy
        return f"{head}: {' '.join(str(e).split())}."
    unconstrained, laid = shape.budget_bytes(budget, n), shape.budget_bytes(held, n)
    units = budget // s if s > 1 else budget  # the index's entries: a block each, or a position each
    what = f"block table of {units} entries" if s > 1 else f"slot map of {units} entries"
    tables = shape.layers if layout.shared_selection else shape.layers * shape.kv_heads
    per = ("one per layer, shared by its KV heads (shared selection)" if layout.shared_selection and shape.kv_heads > 1
           else "one per layer and KV head" + (" (one KV head: shared selection changes nothing)"
                                                if layout.shared_selection else ""))
    cache = (f"{units} whole blocks of {s} positions in every layer and KV head, {held} positions"
             + (f" (the budget {budget} rounded down to whole blocks)" if note else "") if s > 1
             else f"the budget, {budget} positions in every layer and KV head")
    beside = "the same as" if laid == unconstrained else "beside"
    text = (f"{head}: the engine allocates {cache}: **{memory.human(laid)}**, {beside} **{memory.human(unconstrained)}** "
            f"for budget {budget} with no layout. Its {what} ({INDEX_BYTES}-byte entries) is {per}: {tables:,} "
            f"table{'s' * (tables != 1)}, {memory.human(tables * units * INDEX_BYTES)}.")
    floor = layout.floor(budget)
    if floor < held:
        text += (f" Once full it holds {max(1, floor)} to {held} positions, fewer right after each decision"
                 + (f" (decisions every {k} steps)" if k > 1 else " (a whole block leaves at once)") + ".")
    return text


def _memory_text(meta: dict, steps: int, budget: int) -> list[str]:
    from kvsim.analysis import memory

    n = steps + 1  # positions 0 .. T exist at the run's end
    shape = memory.model_of(meta)
    out = []
    if shape is None:
        unit = memory.ONE_HEAD
        named = meta.get("model") if isinstance(meta, dict) else None
        head = (f"**This trace's model ({named}) is not one whose config kvsim knows**, so its bytes are not "
                "worked out here." if isinstance(named, str) and named else
                "**This trace names no model** (the canonical trace is synthetic), so it has no bytes of its own.")
        out.append(
            f"{head} The "
            f"simulator replays one KV head of one layer; at head_dim 128 in bf16 (an example: Llama-3's, Qwen3's "
            f"and Gemma-3-27B's head size) one position of it is 128 dims x 2 (K and V) x 2 bytes = "
            f"**{unit.per_position} bytes**. Its {n:,} positions: {memory.human(unit.full_bytes(n))}; budget {budget}: "
            f"**{memory.human(unit.budget_bytes(budget, n))}**, {_share(unit.budget_bytes(budget, n), unit.full_bytes(n))}. "
            "A whole model multiplies this by its layers x KV heads (the models below).")
    else:
        full, kept = shape.full_bytes(n), shape.budget_bytes(budget, n)
        out.append(
            f"**{shape.name}**, this trace's model: one position in every layer is {shape.arithmetic()} "
            f"(**{memory.human(shape.per_position)}**, bf16). At this trace's {n:,} positions the full cache is "
            f"**{memory.human(full)}**; budget {budget} in every layer and KV head holds **{memory.human(kept)}**, "
            f"{_share(kept, full)}.")
        if shape.sliding_layers and shape.window is not None and n > shape.window:
            out.append(f"The model itself keeps {shape.sliding_layers} of its {shape.layers} layers to a sliding window "
                       f"of {shape.window}, so its own full cache is {memory.human(shape.windowed_bytes(n))}.")
        out.append(f":small[Shape from the {shape.source}.]")
    # a line per model, not a table: the sidebar is too narrow for four columns
    rows = memory.table(memory.LARGER, budget)
    lines = []
    for shape in memory.LARGER:
        mine = [r for r in rows if r["model"] == shape.name]
        full = ", ".join(f"{memory.human(r['full cache'])} at {r['tokens'] // 1024}k" for r in mine)
        kept = ", ".join(f"{100 * r['share']:.2g}%" for r in mine)
        lines.append(f"- **{shape.name}**, {memory.human(shape.per_position)} a token: full cache {full}; budget {budget}: "
                     f"**{memory.human(mine[0][f'budget {budget}'])}** ({kept})")
    out.append("**Larger models**, bf16, every layer at the full length:\n\n" + "\n".join(lines))
    gemma = memory.LARGER[-1]
    out.append(":small[" + "; ".join(f"{s.name}: {s.source}" for s in memory.LARGER)
               + f". Gemma-3-27B's own sliding windows bring its 128k cache to {memory.human(gemma.windowed_bytes(131_072))}. "
               "kvsim's own CPU runs are float32: twice these.]")
    out.append(
        "**Masked or freed?** Here, in the simulator (and the truth's *open loop*), nothing is freed: every "
        "position's keys and values stay in memory and the evicted ones are only masked out of attention, so "
        "the budget's bytes are what a cache *would* hold. The deployed cache (`kvsim.hf`, "
        "`python -m kvsim generate`) really frees them: each layer allocates budget + 1 slots per KV head "
        "(one spare for the newest position), so its memory is the budget's figure, whatever the length.")
    return out


__all__ = ["LABEL", "MEMORY_OPEN", "layout_text", "memory_panel", "memory_text"]

"""The model's rotary embedding (RoPE) as a query/key trace's meta states it (``rope``), so that a policy
can turn a recorded post-RoPE query back and forward to other positions (expected_attention,
``kvsim.policies.expected_attention.Rope``).

``{"layout": "rotate_half", "theta": ..., "rope_type": ..., "inv_freq": [...]}``: the inverse frequencies
as the model's own rotary module holds them for the layer's kind (Gemma-3's local and global layers
differ), so linear, llama3 and yarn scalings are followed exactly; ``theta`` is the base, for the reader.
transformers' decoder families rotate pairs ``(i, i + r/2)`` (``rotate_half``) over the first
``r = 2 len(inv_freq)`` dimensions. A RoPE whose frequencies depend on the length (``dynamic``,
``longrope``) or a model without a rotary module gets no ``rope``: its traces are refused by the
policies that need it, in one line.

torch is imported by the caller; nothing here imports it.
"""

from __future__ import annotations

#: the RoPE types whose frequencies change with the sequence's length: not one set of constants
LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_meta(lm, layer: int) -> dict | None:
    """The ``rope`` meta of ``layer`` of the loaded model ``lm``, or None when it cannot be stated."""
    base = getattr(lm, "base_model", lm)
    rotary = getattr(base, "rotary_emb", None)
    config = getattr(base, "config", None) or getattr(lm, "config", None)
    if rotary is None or config is None:
        return None
    kinds = getattr(config, "layer_types", None)
    kind = kinds[layer] if kinds and layer < len(kinds) else None
    inv = getattr(rotary, f"{kind}_inv_freq", None) if kind else None
    if inv is None:
        inv = getattr(rotary, "inv_freq", None)
    if inv is None:
        return None
    params = getattr(config, "rope_parameters", None) or {}
    if kind and isinstance(params.get(kind), dict):
        params = params[kind]
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if rope_type in LENGTH_DEPENDENT:
        return None
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = getattr(config, "rope_theta", None) if theta is None else theta
    return {"layout": "rotate_half", "theta": None if theta is None else float(theta), "rope_type": str(rope_type),
            "inv_freq": [float(x) for x in inv.detach().float().cpu().tolist()]}

"""What the recorder stores of a layer besides its attention: the per-head output norms CriticalKV weighs
values by, and the rotary constants a query-aware scorer needs to move a query to a later position
(docs/domain.md, "Scorers beyond attention"; kvsim/data/vectors.py).

- ``output_norms``: for each query head h of a KV head's group and each position p, ``|W_O^h v_p|_2``,
  where ``W_O^h`` is the layer's output projection's columns for head h (``hidden x d_v``): the norm of
  position p's value once the output projection has mapped it for that head (its bias, shared by every
  head and position, left out);
- ``rope_meta``: the layer's rotary embedding as the model applies it: ``rope_theta`` (per layer: Gemma 3's
  sliding layers use 10,000, its global ones 1,000,000), ``rope_layout`` (``rotate_half``: dimension i
  pairs with i + r/2, transformers' layout; ``interleaved``: 2i with 2i + 1), ``rope_dim`` (how many of the
  head's dimensions rotate), ``rope_type`` and ``rope_parameters`` (the config's entry for the layer),
  ``rope_inv_freq`` (the frequencies the model's rotary module holds, so a scaled RoPE is stated exactly:
  position p's angle i is ``p * rope_inv_freq[i]``), ``rope_attention_scaling`` (what cos and sin are
  multiplied by; 1 for the default RoPE) and ``head_dim``. A model without a rotary module gets
  ``rope_theta`` and ``rope_layout`` null (its positions are not rotary).

torch is imported inside the functions, never at module level.
"""

from __future__ import annotations

import math
import sys

from .errors import RecordError

#: attribute names of an attention module's output projection, in the order they are looked for
OUTPUT_PROJECTIONS = ("o_proj", "out_proj")


def output_projection(module, layer: int):
    """The attention module's output projection weight ``(hidden, heads x d_v)`` (an ``nn.Linear``'s)."""
    for name in OUTPUT_PROJECTIONS:
        proj = getattr(module, name, None)
        weight = getattr(proj, "weight", None)
        if weight is not None and getattr(weight, "ndim", 0) == 2:
            return weight
    raise RecordError(f"layer {layer}: {type(module).__name__} has no linear output projection "
                      f"({' or '.join(OUTPUT_PROJECTIONS)}), so its per-head output norms cannot be recorded")


def output_norms(module, value, heads: int, layer: int):
    """``(kv_heads, n, G)`` float32 tensor: ``out[h, p, g] = |W_O^(h G + g) v_p^h|_2`` for the layer's values
    ``value`` ``(1, kv_heads, n, d_v)`` (query heads ``h G .. h G + G - 1`` read KV head h), computed in
    float64 from the float32 weights and values, so each stored float32 is within one rounding of exact."""
    from ..hf import eager

    weight = output_projection(module, layer)
    kv_heads, d_v = value.shape[1], value.shape[3]
    if weight.shape[1] != heads * d_v:
        raise RecordError(f"layer {layer}: the output projection takes {weight.shape[1]} inputs, not the "
                          f"{heads} heads x {d_v} value dimensions the attention produced")
    return eager.output_norms(weight, value[0], heads // kv_heads).to(value.device)


def _layer_type(config, layer: int) -> str | None:
    types = getattr(config, "layer_types", None)
    return str(types[layer]) if types and layer < len(types) else None


def _rope_parameters(config, layer_type: str | None) -> dict | None:
    """The config's RoPE entry for the layer: ``rope_parameters`` (per layer type, or one for every layer),
    else the older ``rope_theta`` / ``rope_scaling`` attributes."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            return dict(params[layer_type])
        if "rope_theta" in params or "rope_type" in params:
            return dict(params)
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        return None
    scaling = getattr(config, "rope_scaling", None)
    return {"rope_type": "default", **(scaling if isinstance(scaling, dict) else {}), "rope_theta": theta}


def _rotary_module(lm):
    base = getattr(lm, "base_model", lm)
    for name in ("rotary_emb", "rotary_embedding"):
        rot = getattr(base, name, None)
        if rot is not None:
            return rot
    return None


def rope_layout(lm) -> str | None:
    """How the model's modelling file rotates a vector: its ``rotate_half`` applied to ``0 .. 3`` gives
    ``(-2, -3, 0, 1)`` for the half-split layout and ``(-1, 0, -3, 2)`` for the interleaved one; None when
    the file has no ``rotate_half`` or it does neither."""
    import torch

    fn = getattr(sys.modules.get(type(getattr(lm, "base_model", lm)).__module__), "rotate_half", None)
    if fn is None:
        return None
    try:
        got = fn(torch.arange(4, dtype=torch.float32)).tolist()
    except Exception:  # noqa: BLE001  (a foreign function: any failure means "cannot tell")
        return None
    return {(-2.0, -3.0, 0.0, 1.0): "rotate_half", (-1.0, 0.0, -3.0, 2.0): "interleaved"}.get(tuple(got))


def rope_meta(lm, layer: int, head_dim: int) -> dict:
    """The layer's rotary constants for a trace's meta (module docstring)."""
    config = getattr(lm, "config", lm)
    layer_type = _layer_type(config, layer)
    params = _rope_parameters(config, layer_type)
    rot = _rotary_module(lm)
    inv_freq = scaling = None
    if rot is not None:
        suffix = f"{layer_type}_" if layer_type is not None and hasattr(rot, f"{layer_type}_inv_freq") else ""
        found = getattr(rot, f"{suffix}inv_freq", None)
        if found is not None:
            inv_freq = [float(x) for x in found.detach().to("cpu").double().tolist()]
            scaling = float(getattr(rot, f"{suffix}attention_scaling", 1.0))
    theta = params.get("rope_theta") if params else None
    if inv_freq is None and theta is None:
        return {"rope_theta": None, "rope_layout": None, "head_dim": head_dim}
    meta = {
        "rope_theta": None if theta is None else float(theta),
        "rope_layout": rope_layout(lm),
        "rope_dim": 2 * len(inv_freq) if inv_freq is not None else head_dim,
        "rope_type": (params or {}).get("rope_type", "default"),
        "rope_parameters": _jsonable(params),
        "rope_inv_freq": inv_freq,
        "rope_attention_scaling": scaling,
        "head_dim": head_dim,
    }
    return meta


def _jsonable(params: dict | None) -> dict | None:
    if params is None:
        return None
    out = {}
    for k, v in params.items():
        if isinstance(v, (bool, int, str)) or v is None:
            out[k] = v
        elif isinstance(v, float):
            out[k] = v if math.isfinite(v) else None
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
            out[k] = [float(x) for x in v]
    return out


__all__ = ["OUTPUT_PROJECTIONS", "output_norms", "output_projection", "rope_layout", "rope_meta"]

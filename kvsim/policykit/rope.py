"""A model's rotary embedding as a trace's meta states it (``rope_meta``): what a query-aware scorer
(``kvsim.policies.expected_attention``) needs to move a query to a later position. One function, called by
the recorder (``kvsim.models.record``, ``kvsim.models.quality``: the traces' meta) and by the deployed cache
(``kvsim.hf.cache``: the policies it builds), so the simulator and the deployed cache turn queries by the
same numbers.

- ``rope_theta`` (per layer: Gemma 3's sliding layers use 10,000, its global ones 1,000,000);
- ``rope_layout`` (``rotate_half``: dimension i pairs with i + r/2, transformers' layout; ``interleaved``:
  2i with 2i + 1), read from the model's own modelling file;
- ``rope_dim`` (how many of the head's dimensions rotate), ``rope_type`` and ``rope_parameters`` (the config's
  entry for the layer);
- ``rope_inv_freq`` (the frequencies the model's rotary module holds, so a scaled RoPE is stated exactly:
  position p's angle i is ``p * rope_inv_freq[i]``), ``rope_attention_scaling`` (what cos and sin are
  multiplied by; 1 for the default RoPE) and ``head_dim``.

A model without a rotary module gets ``rope_theta`` and ``rope_layout`` null (its positions are not rotary).
It lives here, below ``kvsim.hf`` and ``kvsim.models`` (docs/architecture.md), because both call it; it reads
the model duck-typed, and torch is imported inside ``rope_layout`` alone, never at module level.
"""

from __future__ import annotations

import math
import sys


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


__all__ = ["rope_layout", "rope_meta"]

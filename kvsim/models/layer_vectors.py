"""What the recorder stores of a layer besides its attention: the per-head output norms CriticalKV weighs
values by, and the rotary constants a query-aware scorer needs to move a query to a later position
(docs/domain.md, "Scorers beyond attention"; kvsim/data/vectors.py).

- ``output_norms``: for each query head h of a KV head's group and each position p, ``|W_O^h v_p|_2``,
  where ``W_O^h`` is the layer's output projection's columns for head h (``hidden x d_v``): the norm of
  position p's value once the output projection has mapped it for that head (its bias, shared by every
  head and position, left out);
- ``rope_meta``: the layer's rotary embedding as the model applies it (``rope_theta``, ``rope_layout``,
  ``rope_inv_freq`` ...), defined in ``kvsim.policykit.rope`` and named here too: the deployed cache
  (``kvsim.hf``, below this package) calls the same function, so both state a model's RoPE alike.

torch is imported inside the functions, never at module level.
"""

from __future__ import annotations

from ..data.gqa import group
from ..policykit.rope import rope_layout, rope_meta
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
    return eager.output_norms(weight, value[0], group(heads, kv_heads)).to(value.device)


__all__ = ["OUTPUT_PROJECTIONS", "output_norms", "output_projection", "rope_layout", "rope_meta"]

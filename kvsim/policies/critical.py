"""CriticalKV: h2o's accumulated attention times the norm of the position's value after the layer's
output projection, ``score(p) = A(p) x n_p``; the newest ``recent_window`` positions are kept.

Feng et al., "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective",
2025 (arXiv:2502.03805); NVIDIA kvpress's ``CriticalKVPress``. Evicting p perturbs the attention output
by about its attention times ``W_O^h v_p``, the value as the output projection of query head h sees it,
so a position whose value the projection shrinks matters less than its attention says. Here:

- ``A(p)`` is h2o's cumulative observed attention (float64 from the float32 weights shown,
  ``kvsim.policies.h2o``); the newcomer starts at 0, so the recent window protects it as in h2o;
- ``n_p`` is read from the trace's ``out_norms`` ``(T + 1, G)``: ``|W_O^h v_p|_2`` for each query head
  h of the KV head's group (the recorder writes them, ``kvsim.data.vectors``). **GQA**: the attention a
  policy is shown is already combined over the group (``kvsim.data.gqa``), so the norms are combined
  the same way, into one weight per position: their **group mean**, a float64 sum in head order divided
  by G (``gqa.combine(..., "mean")``; kvpress's ``vwl1norm`` also averages the heads' norms). With one
  query head per KV head it is that head's norm;
- eviction is repeated argmin of ``A(p) x n_p`` over ``kept[:len - recent_window]``, equal scores
  evicting the older position; victims come back in ascending order.

What differs from kvpress, said once: kvpress's norm is the L1 norm of ``W_O^h v_p`` where the trace
holds the L2 norm (the recorder's choice; the ranking is the same wherever the two are proportional),
and kvpress selects in two stages at the prompt's end (half the budget by the base score alone, then
``(score + 1e-4) x norm``), which a decode-time policy evicting one position a step does not model:
here every evictable position is ranked by the product.
"""

from __future__ import annotations

import numpy as np

from ..data.gqa import combine
from ..policykit.base import WINDOW, Display
from ..policykit.registry import register
from .vatp import ValueWeighted, value_weighted_tensor_step


def _out_norm_tensor(now):
    """``out_norm`` of t's ``out_norms`` ``(batch, heads, G)`` in torch: float64, added in head order, over G."""
    norms = now["out_norms"].double()
    total = norms[..., 0]
    for g in range(1, norms.shape[-1]):
        total = total + norms[..., g]
    return total / norms.shape[-1]


def out_norm(out_norms):
    """One weight per position from the ``(..., G)`` per-head norms: their group mean, float64, added in
    head order (``kvsim.data.gqa``'s rule), the same bits for one row or the whole array."""
    return combine(np.moveaxis(np.asarray(out_norms), -1, 0), "mean")


@register
class CriticalKV(ValueWeighted):
    name = "critical"
    order = 90
    table_rows = ({WINDOW: 32},)
    summary = "keep the newest recent_window positions and, of the rest, the largest cumulative attention x |W_O v|"
    display = Display("#000080", "4px,2px,10px,2px", 2.5, "pentagon", score_name="cumulative attention x |W_O v|_2")
    reads = ("out_norms",)
    tensor_step = value_weighted_tensor_step("critical", _out_norm_tensor)

    @classmethod
    def multipliers(cls, members):
        return out_norm(members["out_norms"])

"""Eager attention's weights, the one statement of them that kvsim's torch attention functions share:
``softmax(softcap(scale * q k^T))`` with the positions a mask hides at minus infinity, the softmax in
float32 and cast back to the query's dtype, as the model families' own eager attention computes it; and
the output projection's per-head norms of the values (``output_norms``), the one statement of those that
the recorder, the truth's full pass and the deployed cache share; and ``grouped``, the query heads laid
out by the KV head they read."""

from __future__ import annotations

import torch

from ..data.gqa import group


def weights(query, key, scale: float, softcap: float | None, mask=None):
    """The attention weights of ``query`` over ``key`` (any leading dimensions that broadcast; the last
    two are positions and head dim). ``mask``: a bool tensor, True where a key is visible, or an
    additive float mask (transformers' own), or None for every key."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)


def grouped(x, kv_heads: int):
    """``x`` ``(batch, query heads, ...)`` as ``(batch, kv heads, G, ...)``: the query heads that read each KV
    head together (``kvsim.data.gqa.group``)."""
    return x.reshape(x.shape[0], kv_heads, group(x.shape[1], kv_heads), *x.shape[2:])


def output_norms(weight, value, group: int, first_kv_head: int = 0):
    """``(kv heads, n, G)`` float32: ``|W_O^j v_p|_2`` for each query head j = (first_kv_head + h) G + g of
    each KV head h of ``value`` ``(kv heads, n, d_v)`` (query heads h G .. h G + G - 1 read KV head h),
    where ``W_O^j`` is the columns of the output projection ``weight`` ``(hidden, heads x d_v)`` that head
    j's output enters. Computed in float64 from the weights and values as given, so each float32 is within
    one rounding of the exact norm and the same whoever asks (kvsim.data.vectors, ``out_norms``)."""
    kv, n, d_v = value.shape
    w = weight.detach().to(torch.float64)
    lo = first_kv_head * group * d_v
    w = w[:, lo : lo + kv * group * d_v].reshape(w.shape[0], kv, group, d_v)  # (hidden, kv head, G, d_v)
    with torch.no_grad():
        projected = torch.einsum("hnd,ohgd->hngo", value.detach().to(torch.float64), w)  # (kv head, n, G, hidden)
        return torch.linalg.vector_norm(projected, dim=-1).to(torch.float32)

"""Eager attention's weights, the one statement of them that kvsim's torch attention functions share:
``softmax(softcap(scale * q k^T))`` with the positions a mask hides at minus infinity, the softmax in
float32 and cast back to the query's dtype, as the model families' own eager attention computes it."""

from __future__ import annotations

import torch


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

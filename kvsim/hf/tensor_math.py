"""The tensor path's arithmetic (``kvsim.hf.tensor``): the attention logits and softmax of the family's eager
function, what the reference path shows a policy, and position t's rows of the vectors a policy reads, each a
few tensor operations over every row and KV head of a layer at once."""

from __future__ import annotations

import math

import torch

from .eager import output_norms
from .refusal import HFError


def logits(q, keys, call):
    """``q`` ``(batch, heads, ..., G, d)`` against ``keys`` ``(batch, heads, width, d)``: scaled, soft-capped
    scores ``(batch, heads, ..., G, width)``, the arithmetic of ``kvsim.hf.eager.weights``."""
    shape = q.shape
    if q.dim() == 5:  # (batch, heads, m, G, d): one product per head, m x G rows against its keys
        q = q.reshape(shape[0], shape[1], shape[2] * shape[3], shape[4])
    if math.frexp(call.scale)[0] == 0.5:  # a power of two (1 / sqrt(64), 1 / 16): the queries scaled, not the logits,
        # the same bits (a product by a power of two is exact, and so is each term and partial sum of the product
        # scaled by it, short of the subnormals), at d multiplications per row of queries, not one per logit
        scores = torch.matmul(q * call.scale, keys.transpose(-1, -2)).reshape(*shape[:-1], keys.shape[2])
    else:  # scaled in place: the same rounding as a product by the scale, without a second array of every logit
        scores = torch.matmul(q, keys.transpose(-1, -2)).reshape(*shape[:-1], keys.shape[2]).mul_(call.scale)
    if call.softcap is not None:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    return scores


def softmax(logits, seen, dtype, spend: bool = False, lo: int = 0):
    """``logits`` ``(batch, heads, G, width)`` over the columns ``seen`` ``(batch, heads, width)`` marks, the
    family's eager softmax: float32, cast back to the query's dtype. ``spend``: the caller has no further use for
    ``logits``, which are masked in place. ``lo`` (``spend`` only): every row sees the columns before it, so only
    those from it on are masked: the same weights, a causal block's triangle the only part written."""
    hidden = ~seen[..., lo:].unsqueeze(-2)
    if spend:
        logits[..., lo:].masked_fill_(hidden, float("-inf"))
        scores = logits
    else:
        scores = logits.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)


def outputs(w, values):
    """The attention's outputs: weights ``w`` ``(batch, heads, rows, width)`` times ``values`` ``(batch, heads,
    width, d)``, one product per head."""
    return torch.matmul(w, values)


#: the smallest positive float64: a renormalising sum floored at it divides a row of zeros into zeros
_TINY = torch.finfo(torch.float64).tiny


def shown(w, before, order):
    """What the reference path shows each (row, KV head)'s policy: the group's weights ``w`` ``(batch, heads,
    [rows,] G, width)`` combined (their mean, folded in head order in float64), kept on the columns held
    ``before`` t was admitted, renormalised by their sum in position order (``order`` ``(batch, heads, width)``:
    the columns by position, any column not held anywhere), float32; zero where the sum is not positive and off
    ``before``."""
    wide = w.double()
    combined = wide[..., 0, :]
    for g in range(1, w.shape[-2]):
        combined = combined + wide[..., g, :]
    combined = (combined / w.shape[-2]) * before  # exact: a product by one or zero
    if combined.dim() > order.dim():
        order = order[:, :, None, :].expand_as(combined)
    total = combined.gather(-1, order).cumsum(-1)[..., -1:]  # the zeros of what is not held add nothing
    return (combined / total.clamp(min=_TINY)).float()


def vectors(name: str, reads, key, value, call, q) -> dict:
    """A call's rows of what a policy ``reads`` (``TensorState.now``, a position's slice of them), ``(batch, heads,
    n, ...)``: ``keys`` and ``values`` as the model stores them, ``queries`` ``(batch, heads, n, G, d)`` from the
    call's grouped queries ``q`` ``(batch, heads, G, n, d)``, ``out_norms`` ``(batch, heads, n, G)`` float32 from
    the attention module's ``o_proj`` (``kvsim.hf.eager.output_norms``, the reference path's float64 statement;
    one product for every row, where the reference makes one per row, so a norm may differ from the reference's
    within the float32 rounding it states)."""
    out, group = {}, q.shape[2]
    for member in reads:
        if member == "keys":
            out[member] = key
        elif member == "values":
            out[member] = value
        elif member == "queries":
            out[member] = q.transpose(2, 3)
        elif member == "out_norms":
            weight = getattr(getattr(call.module, "o_proj", None), "weight", None)
            if weight is None:
                raise HFError(f"{name}: out_norms need the attention module's o_proj, which "
                              f"{type(call.module).__name__} does not have")
            batch, heads, n, d = value.shape
            norms = output_norms(weight, value.transpose(0, 1).reshape(heads, batch * n, d), group)
            out[member] = norms.reshape(heads, batch, n, group).transpose(0, 1)
        else:
            raise HFError(f"{name}: the tensor path does not compute {member}")
    return out


__all__ = ["logits", "outputs", "shown", "softmax", "vectors"]

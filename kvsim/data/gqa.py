"""The combining rule: from the softmax weights of the query heads that share a KV head to the one row
per KV head that a trace holds and a policy is shown (docs/domain.md, "Traces" and "The deployed
cache"). Written here once; the recorder, the query/key rows and their kernels, the closed loop's
capture and the deployed cache all call it.

1. **combine** the group's query heads (grouped-query attention: heads ``h * g .. h * g + g - 1`` read
   KV head ``h``), folded in head order: their mean (a float64 sum, then divided by the group) or their
   maximum. One eviction decision serves every head of the group, since they read the same entries.
2. **drop** the query's own weight (and whatever it did not see): only the positions ``others`` stay;
3. **renormalise** over them: each divided by their float64 sum, added in position order (the order
   the harness's ``kept_sum`` adds in, and the kernels' loops), so a row comes out the same number
   whichever path computes it. A row with nothing left (its weight all on itself) stays zero; its
   total says so, and the caller names the error in its own terms.

``fold`` and ``finish`` are kernels so that numba code (``kvsim.data.qk_rows``) calls the very
function the NumPy path here calls on whole arrays (``np.maximum`` and ``+`` work on both).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel

#: how the query heads that share a KV head are combined, by the code the kernels take
GQA_CODES = {"mean": 0, "max": 1}
GQA = tuple(GQA_CODES)
MEAN, MAX = GQA_CODES["mean"], GQA_CODES["max"]


@kernel
def fold(combined, weight, gqa):
    """One query head's ``weight`` folded into its group's ``combined`` so far (mean: a sum, divided
    by ``finish``); scalars in a kernel, arrays in NumPy."""
    return np.maximum(combined, weight) if gqa == MAX else combined + weight


@kernel
def finish(combined, heads, gqa):
    """The group's combination once all ``heads`` are folded in."""
    return combined / heads if gqa == MEAN else combined


def _python(k):
    """The Python body of a kernel, which NumPy arrays go through (without numba ``kernel`` is it)."""
    return getattr(k, "py_func", k)


def group(query_heads: int, kv_heads: int) -> int:
    """Query heads per KV head (the group ``g`` of step 1: heads ``h * g .. h * g + g - 1`` read KV head
    ``h``, transformers' ``repeat_kv``); ValueError when the query heads do not divide into the KV heads.
    The one place kvsim computes it, for the recorder, the closed loop and the deployed cache alike."""
    if kv_heads < 1 or query_heads % kv_heads:
        raise ValueError(f"{query_heads} query heads cannot be shared evenly by {kv_heads} KV heads")
    return query_heads // kv_heads


def code(gqa: str) -> int:
    """The kernels' code of a GQA rule; ValueError naming the rules for any other."""
    if gqa not in GQA_CODES:
        raise ValueError(f"gqa must be one of {', '.join(GQA)}, got {gqa!r}")
    return GQA_CODES[gqa]


def combine(weights, gqa: str = "mean") -> np.ndarray:
    """Step 1: the weights of one KV head's query heads (first axis, in head order; any shape after it)
    combined into float64 ``weights.shape[1:]``."""
    rule, add, done = code(gqa), _python(fold), _python(finish)
    w = np.asarray(weights)
    combined = np.zeros(w.shape[1:], dtype=np.float64)
    for head in w:
        combined = add(combined, head.astype(np.float64, copy=False), rule)
    return done(combined, w.shape[0], rule)


def position_sum(weights) -> np.ndarray:
    """The float64 sum over the last axis, added strictly in position order (NumPy's own sum is
    pairwise): what the kernels' loops and the harness's ``kept_sum`` add."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape[-1] == 0:
        return np.zeros(w.shape[:-1])
    return np.cumsum(w, axis=-1)[..., -1]


def renormalise(combined, others=None, total=None) -> tuple[np.ndarray, np.ndarray]:
    """Steps 2 and 3: ``combined`` (float, positions on the last axis) kept where ``others`` (bool,
    broadcast to it; None: every position) and divided by its sum over them (``total``, when the caller
    has it already, else ``position_sum``). Returns ``(rows, totals)``, float64; a row whose total is
    not positive is left zero."""
    c = np.asarray(combined, dtype=np.float64)
    if others is not None:
        c = np.where(others, c, 0.0)
    totals = position_sum(c) if total is None else np.asarray(total, dtype=np.float64)
    if totals.ndim == 0:  # one row: the harness's and the deployed cache's every step, kept cheap
        return (c / totals if totals > 0 else np.zeros_like(c)), totals
    positive = totals > 0
    rows = np.where(positive[..., None], c / np.where(positive, totals, 1.0)[..., None], 0.0)
    return rows, totals


def kv_head_weights(weights, gqa: str = "mean", others=None) -> tuple[np.ndarray, np.ndarray]:
    """The whole rule: ``renormalise(combine(weights, gqa), others)``."""
    return renormalise(combine(weights, gqa), others)


__all__ = ["GQA", "GQA_CODES", "code", "combine", "finish", "fold", "group", "kv_head_weights", "position_sum", "renormalise"]

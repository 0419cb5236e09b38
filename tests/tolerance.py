"""Numeric tolerances from the arithmetic, not from one machine's result.

Every floating-point operation's result is within u = eps / 2 of the exact one, relatively. A sum or dot
product of n terms, in any order (pairwise, blocked, vectorised, with or without fused multiply-adds),
is within gamma_n = n u / (1 - n u) of the exact one relatively to the sum of the terms' absolute values
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1 and eq. 3.5). ``n * eps``
covers gamma_n with room to spare while n u < 1/2, and it does not depend on the order a library or a
machine picks, which is what differs between two machines.

A test states what its figure is computed from (how many terms, in which type, of what size) and asks
here for the bound; it never picks a number that happened to pass.
"""

from __future__ import annotations

import json

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7
EPS64 = float(np.finfo(np.float64).eps)  # 2.22e-16


def rounding(terms: int, magnitude: float = 1.0, dtype=np.float32) -> float:
    """The rounding error of a sum or dot product of ``terms`` terms computed in ``dtype``, whose absolute
    values add up to at most ``magnitude``: ``terms * eps * magnitude`` (gamma_n, see the module)."""
    return terms * float(np.finfo(dtype).eps) * magnitude


def logit_magnitude(q, k, scale: float) -> float:
    """The largest ``sum_i |q_i k_i| * scale`` over query heads ``q`` ``(G, T, d)``, rows and keys ``k``
    ``(T, d)``: the size the logits' rounding is relative to."""
    q, k = np.abs(np.asarray(q, dtype=np.float64)), np.abs(np.asarray(k, dtype=np.float64))
    return float(np.einsum("gtd,pd->gtp", q, k).max()) * scale


def attention_rows(head_dim: int, logit_magnitude: float, keys: int, group: int = 1, dtype=np.float32) -> float:
    """How far an attention row computed in ``dtype`` (a recorder's, an eager forward's) may be from the
    exact one, entry by entry, when both start from the same queries and keys: the weights are at most 1,
    so the relative error bounds the absolute one.

    - the logits: ``q . k`` over ``head_dim`` terms times the scale, whose absolute sum is at most
      ``logit_magnitude`` (``sum |q_i k_i| * scale``, the largest over the rows);
    - the softmax: a logit's error moves a weight by twice it, relatively (the numerator and the
      normaliser); then the subtraction of the row's maximum, the exponential, the sum of ``keys`` terms
      and the division, each within eps;
    - the ``group`` query heads that share a KV head, averaged: a sum of ``group`` terms;
    - the row renormalised over the earlier positions: each weight's error and the sum's add (twice),
      then that sum of ``keys`` terms, the division and the float32 store.
    """
    eps = float(np.finfo(dtype).eps)
    logits = rounding(head_dim + 1, logit_magnitude, dtype)
    softmax = 2 * logits + (keys + 4) * eps
    heads = softmax + group * eps
    return 2 * heads + (keys + 2) * eps


def rounded_queries_and_keys(logit_magnitude: float, stored=np.float16) -> float:
    """How far rows computed exactly from queries and keys rounded to ``stored`` may be from rows of the
    unrounded ones, relatively: each of q and k moves by half an ulp, a logit by at most ``eps *
    logit_magnitude``, a weight by twice that through the softmax and twice again through the
    renormalisation."""
    return 4 * float(np.finfo(stored).eps) * logit_magnitude


def rounding64(terms: int, magnitude: float = 1.0) -> float:
    """``rounding`` in float64, where the figures are sums and means of float32 weights taken in float64."""
    return rounding(terms, magnitude, np.float64)


def qk_file_rows(path) -> float:
    """How far a float32 computation of the rows of the query/key file at ``path`` (a recorder's, an eager
    forward's, kvsim's) may be from the exact rows of its queries and keys: ``attention_rows`` with the
    file's head size, query heads per KV head, length and logits, plus their rounding to the stored type
    when it is narrower than float32 (``rounded_queries_and_keys``)."""
    with np.load(path, allow_pickle=False) as z:
        q, k = z["q"], z["k"]
        meta = json.loads(bytes(z["meta"]).decode("utf-8"))
    magnitude = logit_magnitude(q, k, meta["scale"])
    stored = rounded_queries_and_keys(magnitude, k.dtype) if np.finfo(k.dtype).eps > EPS32 else 0.0
    return stored + attention_rows(head_dim=k.shape[1], logit_magnitude=magnitude, keys=k.shape[0], group=q.shape[0])


def forward_pass(config, keys: int, logit_magnitude: float, dtype=np.float32) -> float:
    """How far two passes of one model in ``dtype`` over the same tokens, that order their sums differently
    (token-by-token decoding against one teacher-forced pass, a batch against one row, blocks against the
    whole), may put a logit apart, to first order: each pass's roundings of every sum a layer takes (two
    norms and the output projection over the hidden size, the attention over ``keys`` and its head
    dimension, the MLP over the hidden and intermediate sizes) and of the output projection, relative to the
    largest logit. A model's layers may amplify a rounding as they would any change of input; this counts
    each once, as the float32 eps times the terms summed, which is what the comparisons here are held to."""
    hidden, inter = config.hidden_size, getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    head = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    per_layer = 4 * hidden + inter + head + keys
    return 2 * rounding(config.num_hidden_layers * per_layer + hidden, logit_magnitude, dtype)


def log_softmax(logit_error: float, vocab: int, logit_magnitude: float, dtype=np.float32) -> float:
    """How far a log-probability (an NLL) moves when every logit may move by ``logit_error``: twice that
    (its own logit and the log-sum-exp), plus the log-sum-exp's own rounding: a sum of ``vocab`` positive
    terms (relative, so absolute in its log), each an exponential of a logit less the largest (half an ulp
    of up to twice ``logit_magnitude``)."""
    return 2 * logit_error + rounding(vocab + 2, 1.0, dtype) + rounding(2, logit_magnitude, dtype)

"""The arithmetic of a query/key trace (``kvsim.data.qk``): its rows computed from the queries and keys.

Row t of the trace (docs/domain.md, "Query/key traces"): per query head g the logit
``s_g(t, p) = softcap(scale * q[g, t] . k[p])`` for every visible p (``p <= t``, inside the sliding
window), a softmax over those p (self included), then the combining rule of ``kvsim.data.gqa`` (the
heads combined by the GQA rule, their mean or maximum, the self weight dropped and the rest
renormalised over ``p < t``). ``reference_rows`` states that in NumPy, in float64, for the whole
matrix: the one statement of the definition, that tests hold the kernels to.

The kernels compute the same thing one weight at a time, so that any subset of a row (the positions a
cache holds) costs O(subset x heads x head_dim) and never the whole row:

- every logit is ``_logit`` of ``_dots``: a float32 dot product summed over the head dim in order (the
  same number whichever positions or heads are asked for together), times ``scale`` and soft-capped in
  float64;
- a row's normalisers (per head the log of its softmax's sum, and the sum over ``p < t`` of the
  combined weights) are computed once, for every row, by ``row_pass``, which also takes each row's
  top-k positions from the weights it has just formed (``kvsim.data.derived``'s rule, lower position
  first on ties);
- a weight is ``float32(combined / denominator)``, combined from ``exp(s_g - lse_g)`` in head order
  by the rule's own ``fold`` and ``finish`` (``kvsim.data.gqa``, jitted here):
  ``weights_block`` (a block of rows at chosen positions, for the engine and the dense matrix) and
  ``weights_at`` (one row at chosen positions, for the reference harness) share that expression, so
  the engine and the reference read the very same float32 weights.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .derived import _topk_row
from .gqa import combine, finish, fold, renormalise


def reference_rows(q: np.ndarray, k: np.ndarray, scale: float, softcap: float | None, window: int | None,
                   gqa: str) -> np.ndarray:
    """The dense ``(N, N)`` float64 matrix of a recording of N positions (``q``: ``(G, N, d)``, ``k``:
    ``(N, d)``), row t over ``p < t`` as the module docstring defines it; row 0 and everything on or
    above the diagonal zero. O(G N^2) memory: for tests and short traces."""
    q64, k64 = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    n = k64.shape[0]
    s = scale * np.einsum("gtd,pd->gtp", q64, k64)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    t, p = np.arange(n)[:, None], np.arange(n)[None, :]
    visible = (p <= t) & ((t - p < window) if window else True)
    s = np.where(visible[None], s, -np.inf)
    e = np.exp(s - s.max(axis=2, keepdims=True))
    e /= e.sum(axis=2, keepdims=True)
    return renormalise(combine(e, gqa), p < t)[0]


@kernel
def _dots(Q, g, t, Kc, m0, m1, acc, acc2, pair):
    """``acc[m] = Q[g, t] . Kc[:, m]`` for m in ``m0 .. m1-1`` (``Kc``: keys as columns, ``(d, M)``), and
    when ``pair`` the same for head ``g + 1`` into ``acc2``: each a float32 sum over the head dim in
    order (``((0 + q0 k0) + q1 k1) + ...``), so a logit is the same number whichever keys, or which
    head beside it, are computed with it. The loop over m runs in SIMD lanes; taking four dims and two
    heads per pass over it reads each key column once for two heads and writes the sums a quarter as
    often (1.8x faster at 1087 keys, the numbers bit for bit those of one dim and one head a pass)."""
    a, b = acc[m0:m1], acc2[m0:m1]  # through slices: numba then runs the loop over m in SIMD lanes
    a[:] = 0.0
    if pair:
        b[:] = 0.0
    d, h = Kc.shape[0], g + 1 if pair else g
    j = 0
    while j + 4 <= d:
        x0, x1, x2, x3 = Q[g, t, j], Q[g, t, j + 1], Q[g, t, j + 2], Q[g, t, j + 3]
        y0, y1, y2, y3 = Q[h, t, j], Q[h, t, j + 1], Q[h, t, j + 2], Q[h, t, j + 3]
        k0, k1, k2, k3 = Kc[j, m0:m1], Kc[j + 1, m0:m1], Kc[j + 2, m0:m1], Kc[j + 3, m0:m1]
        if pair:
            for m in range(a.shape[0]):
                c0, c1, c2, c3 = k0[m], k1[m], k2[m], k3[m]
                a[m] = (((a[m] + x0 * c0) + x1 * c1) + x2 * c2) + x3 * c3
                b[m] = (((b[m] + y0 * c0) + y1 * c1) + y2 * c2) + y3 * c3
        else:
            for m in range(a.shape[0]):
                a[m] = (((a[m] + x0 * k0[m]) + x1 * k1[m]) + x2 * k2[m]) + x3 * k3[m]
        j += 4
    while j < d:
        x, y, k = Q[g, t, j], Q[h, t, j], Kc[j, m0:m1]
        for m in range(a.shape[0]):
            a[m] += x * k[m]
        if pair:
            for m in range(a.shape[0]):
                b[m] += y * k[m]
        j += 1


@kernel
def _logit(dot, scale, softcap):
    s = np.float64(dot) * scale
    if softcap > 0.0:
        s = softcap * np.tanh(s / softcap)
    return s


@kernel
def _first_visible(t, window):
    return max(0, t - window + 1) if window > 0 else 0


#: key columns per tile: a tile's keys (head dim x TILE float32, 2 MB at 256 dims) stay in cache
#: while every row of a block and every query head is computed against them
TILE = 2048


@kernel
def _finish(comb, m0, m1, G, gqa):
    for m in range(m0, m1):
        comb[m] = finish(comb[m], G, gqa)


@kernel
def weights_block(Q, Kc, positions, lse, denom, scale, softcap, window, gqa, t0, t1, out):
    """``out[t - t0, p]`` = weight ``[t, p]`` of the trace for rows t0 .. t1-1 and every p of
    ``positions`` (ascending) below t, ``Kc`` holding their keys as columns (``QKStore.weights_block``
    gathers them): per head ``exp(logit - lse[g, t])`` combined in head order, then ``float32(combined / denom[t])``; 0 outside
    the sliding window (and not computed: a sliding layer costs its window, not its history). The other
    entries of ``out`` are left as they are."""
    G, n = Q.shape[0], positions.shape[0]
    acc, acc2 = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)
    comb = np.empty(n, dtype=np.float64)
    for m0 in range(0, n, TILE):
        m1 = min(n, m0 + TILE)
        first = m0  # the first column in the window (positions ascend): the ones before it are 0, not computed
        for t in range(t0, t1):
            lo = _first_visible(t, window)
            while first < m1 and positions[first] < lo:
                out[t - t0, positions[first]] = np.float32(0.0)
                first += 1
            for m in range(m0, first):
                if positions[m] < t:
                    out[t - t0, positions[m]] = np.float32(0.0)
            if first == m1:
                continue
            for m in range(first, m1):
                comb[m] = 0.0
            for g in range(0, G, 2):  # two heads a pass (the last alone when G is odd), mixed in head order
                pair = g + 1 < G
                _dots(Q, g, t, Kc, first, m1, acc, acc2, pair)
                for m in range(first, m1):
                    comb[m] = fold(comb[m], np.exp(_logit(acc[m], scale, softcap) - lse[g, t]), gqa)
                if pair:
                    for m in range(first, m1):
                        comb[m] = fold(comb[m], np.exp(_logit(acc2[m], scale, softcap) - lse[g + 1, t]), gqa)
            _finish(comb, first, m1, G, gqa)
            for m in range(first, m1):
                p = positions[m]
                if p < t:
                    out[t - t0, p] = np.float32(comb[m] / denom[t])


@kernel
def row_pass(Q, Kt, scale, softcap, window, gqa, k, t0, t1, lse, denom, topk, bad, S):
    """Rows t0 .. t1-1 over every visible key (``Kt``: all keys as columns; ``S``: float64 scratch of
    at least ``(t1 - t0, G, t1)``): per head ``lse[g, t]`` (log-sum-exp of the visible logits, self
    included), ``denom[t]`` (the sum, in position order, of the combined weights over visible ``p < t``)
    and the top-k positions of the row's float32 weights (``topk[t]``, -1 padded), with exactly
    ``weights_block``'s arithmetic. A row whose weight all sat on itself sets ``bad[0] = t`` and stops."""
    G, N = Q.shape[0], Q.shape[1]
    acc, acc2 = np.empty(N, dtype=np.float32), np.empty(N, dtype=np.float32)
    comb = np.empty(N, dtype=np.float64)
    w = np.zeros(N, dtype=np.float32)
    for m0 in range(0, t1, TILE):  # the logits, a tile of keys at a time
        for t in range(t0, t1):
            a, b = max(m0, _first_visible(t, window)), min(m0 + TILE, t + 1)
            for g in range(0, G, 2):
                pair = g + 1 < G
                if a < b:
                    _dots(Q, g, t, Kt, a, b, acc, acc2, pair)
                for m in range(a, b):
                    S[t - t0, g, m] = _logit(acc[m], scale, softcap)
                    if pair:
                        S[t - t0, g + 1, m] = _logit(acc2[m], scale, softcap)
    for t in range(t0, t1):
        lo = _first_visible(t, window)
        for g in range(G):
            top = -np.inf
            for p in range(lo, t + 1):
                top = max(top, S[t - t0, g, p])
            z = 0.0
            for p in range(lo, t + 1):
                z += np.exp(S[t - t0, g, p] - top)
            lse[g, t] = top + np.log(z)
        if t == 0:
            continue
        for p in range(lo, t):
            comb[p] = 0.0
        for g in range(G):
            for p in range(lo, t):
                comb[p] = fold(comb[p], np.exp(S[t - t0, g, p] - lse[g, t]), gqa)
        _finish(comb, lo, t, G, gqa)
        total = 0.0
        for p in range(lo, t):
            total += comb[p]
        if not total > 0.0:
            bad[0] = t
            return
        denom[t] = total
        for p in range(t):
            w[p] = np.float32(comb[p] / total) if p >= lo else np.float32(0.0)
        _topk_row(w[:t], k, topk[t])

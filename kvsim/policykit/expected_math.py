"""expected_attention's arithmetic that its engine hooks (``kvsim.policies.expected_attention``) and its tensor step's
walk (``kvsim.policykit.expected_tensor``) share: what the engine reads per position, the period a step scores by, and
a period's statistics from its window of queries. Plain loops, every sum in a stated order (the module docstring of
``kvsim.policies.expected_attention`` says which)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..jit import kernel


def per_position(policy, t0: int, vectors: Mapping[str, np.ndarray], n: int | None = None) -> dict:
    """What the engine reads per position of the first ``n`` (None: all) rows of ``vectors`` (positions ``t0 ..``): the
    key in float64, the value's norm, the queries turned back (``pre_rope``) and the position's turn (``turns``), made
    by the very calls the reference makes, a position at a time."""
    K = np.ascontiguousarray(vectors["keys"][:n], dtype=np.float64)
    rope = policy.rope(K.shape[1])
    Q, V = vectors["queries"], vectors["values"]
    n = K.shape[0]
    U = np.empty((n, *Q.shape[1:]), dtype=np.float64)
    cos = np.empty((n, rope.half))
    sin = np.empty((n, rope.half))
    vnorm = np.empty(n)
    for p in range(n):
        U[p] = rope.pre_rope(Q[p], t0 + p)
        cos[p], sin[p] = rope.turns(t0 + p)
        vnorm[p] = _norm(V[p])
    return {"keys": K, "vnorm": vnorm, "pre": U, "cos": cos, "sin": sin}


def _norm(v) -> float:
    """``|v|_2`` in float64, its squares added in order."""
    v = np.asarray(v, dtype=np.float64)
    return float(np.sqrt(np.cumsum(v * v)[-1]))


def period_of(t: int, refresh: int) -> int:
    """The step whose statistics step t scores by: the latest of 1, 1 + refresh, 1 + 2 refresh ... up to t."""
    return 1 + (t - 1) // refresh * refresh


@kernel
def window_stats(pre, first, count, modulo, cos_p, sin_p, cbar, sbar, adv, cols):
    """The future query's statistics at step t (turn ``cos_p``, ``sin_p``) from the window's pre-RoPE
    queries ``pre[(first + j) % modulo]``, j = 0 .. count-1, oldest first (the same order on every path,
    so every sum is the same float64 sum): ``adv[g]`` = ``Rbar_t mu_g`` and ``cols[g, :, j]`` =
    ``Rbar_t (u_j - mu_g)``, the centred queries as columns. ``Rbar_t`` turns pair f by ``(c, s) =
    (cos_p cbar - sin_p sbar, sin_p cbar + cos_p sbar)``: the mean over j = 1 .. n_future of turning by t + j."""
    G = pre.shape[1]
    d = pre.shape[2]
    h = cbar.shape[0]
    c = np.empty(h)
    s = np.empty(h)
    for f in range(h):
        c[f] = cos_p[f] * cbar[f] - sin_p[f] * sbar[f]
        s[f] = sin_p[f] * cbar[f] + cos_p[f] * sbar[f]
    mean = np.zeros((G, d))
    for j in range(count):
        u = pre[(first + j) % modulo]
        for g in range(G):
            for x in range(d):
                mean[g, x] += u[g, x]
    if count > 0:
        for g in range(G):
            for x in range(d):
                mean[g, x] /= count
    _turn(mean, c, s, h, adv)
    cent = np.empty((G, d))
    turned = np.empty((G, d))
    for j in range(count):
        u = pre[(first + j) % modulo]
        for g in range(G):
            for x in range(d):
                cent[g, x] = u[g, x] - mean[g, x]
        _turn(cent, c, s, h, turned)
        for g in range(G):
            for x in range(d):
                cols[g, x, j] = turned[g, x]



@kernel
def _window(state, c, per):
    """Configuration c's statistics of step ``per``: its window and turn, as the reference's ring held them then
    (``pre``, ``cos`` and ``sin`` hold position q at row ``q - base[0]``)."""
    pre, cos, sin, sinks, windows = state[2], state[3], state[4], state[5], state[6]
    b = state[21][0]
    lo = max(sinks[c], per - windows[c] + 1)
    count = per - lo + 1 if per >= sinks[c] else 0
    window_stats(pre, lo - b if count > 0 else 0, count, pre.shape[0], cos[per - b], sin[per - b], state[8][c],
                 state[9][c], state[12][c], state[13][c])
    state[16][c] = per
    state[17][c] = count


@kernel
def _turn(x, c, s, h, out):
    """``out`` = ``x`` (G, d) with pair f (f, f + h) of every row turned by (c[f], s[f]); the rest copied."""
    for g in range(x.shape[0]):
        for f in range(h):
            a = x[g, f]
            b = x[g, f + h]
            out[g, f] = a * c[f] - b * s[f]
            out[g, f + h] = b * c[f] + a * s[f]
        for f in range(2 * h, x.shape[1]):
            out[g, f] = x[g, f]

"""The fast engine's kernels for the policies that score by the keys (``kvsim.policies.knorm``,
``kvsim.policies.keydiff``): the one step loop (``kvsim.sim.kernels.slot_kernel``) with their hooks,
exactly the reference's arithmetic, which the policies' module docstrings state:

- knorm evicts the first maximum of the held positions' key norms over every slot (the newcomer
  included), read by position from ``norms`` (``KNorm.engine_inputs``: ``key_norms`` of every key,
  the reference's own function), so nothing per slot is kept; its score is ``1 / norm`` (``inf`` for 0);
- keydiff evicts the first maximum of the cosines to the sum of the held unit keys, ``units`` being
  ``unit_keys`` of every key: the sum added in kept order (the reference's ``position_sum`` over the
  slots, a cumulative sum: it starts from the first slot's row, not from 0.0), each dot product's
  terms added in dimension order from the first, ``||s||`` likewise, then one division per slot.

Neither reads attention, so the default ``measure`` only counts the kept mass and the top-k hits.
"""

from __future__ import annotations

import math

import numpy as np

from ..jit import kernel
from .kernels import Shape, slot_kernel

# --------------------------------------------------------------------------------------------
# knorm


@kernel
def _knorm_score(state, c, p_c, i):
    norm = state[0][p_c[i]]
    return 1.0 / norm if norm > 0 else np.inf


@kernel
def _knorm_pick(state, c, t, p_c, n, A, a0, scored):
    norms = state[0]
    best = 0
    high = norms[p_c[0]]
    for i in range(1, n):
        v = norms[p_c[i]]
        if v > high:  # strict: the first maximum, the lower position
            high = v
            best = i
    return best


def _knorm_state(shape: Shape, norms):
    return (np.ascontiguousarray(norms, dtype=np.float64),)


KNORM = slot_kernel("knorm_steps", _knorm_state, score=_knorm_score, pick=_knorm_pick)
knorm_steps = KNORM.steps


# --------------------------------------------------------------------------------------------
# keydiff: per step, the sum of the held unit keys and each slot's cosine to it, into ``cos``


@kernel
def _keydiff_cosines(units, p_c, n, s, cos):
    """``cos[:n]``: each held slot's cosine to ``s``, the sum of the held unit keys (filled here)."""
    d = units.shape[1]
    first = units[p_c[0]]
    for k in range(d):
        s[k] = first[k]
    for i in range(1, n):
        row = units[p_c[i]]
        for k in range(d):
            s[k] += row[k]
    ss = s[0] * s[0]
    for k in range(1, d):
        ss += s[k] * s[k]
    norm = math.sqrt(ss)
    if norm == 0.0:
        for i in range(n):
            cos[i] = 0.0
        return
    # four slots at a time: each dot product's terms still added in dimension order, but the four
    # chains are independent, so the additions' latency overlaps
    i = 0
    while i + 4 <= n:
        r0, r1, r2, r3 = units[p_c[i]], units[p_c[i + 1]], units[p_c[i + 2]], units[p_c[i + 3]]
        a0 = r0[0] * s[0]
        a1 = r1[0] * s[0]
        a2 = r2[0] * s[0]
        a3 = r3[0] * s[0]
        for k in range(1, d):
            sk = s[k]
            a0 += r0[k] * sk
            a1 += r1[k] * sk
            a2 += r2[k] * sk
            a3 += r3[k] * sk
        cos[i] = a0 / norm
        cos[i + 1] = a1 / norm
        cos[i + 2] = a2 / norm
        cos[i + 3] = a3 / norm
        i += 4
    while i < n:
        r = units[p_c[i]]
        a = r[0] * s[0]
        for k in range(1, d):
            a += r[k] * s[k]
        cos[i] = a / norm
        i += 1


@kernel
def _keydiff_admit(state, c, p_c, n):
    state[3][c] = n + 1  # held after admitting slot n: what ``score`` scores


@kernel
def _keydiff_score(state, c, p_c, i):
    """Slot i's ``1 - cos``; the cosines are computed once, when slot 0 is asked (``pick`` reads them back)."""
    units, s, cos, held = state
    if i == 0:
        _keydiff_cosines(units, p_c, held[c], s, cos)
    return 1.0 - cos[i]


@kernel
def _keydiff_pick(state, c, t, p_c, n, A, a0, scored):
    units, s, cos, held = state
    if not scored:  # else ``score`` has just computed them for these n slots
        _keydiff_cosines(units, p_c, n, s, cos)
    best = 0
    high = cos[0]
    for i in range(1, n):
        if cos[i] > high:  # strict: the first maximum, the lower position
            high = cos[i]
            best = i
    return best


def _keydiff_state(shape: Shape, units):
    units = np.ascontiguousarray(units, dtype=np.float64)
    return (units, np.empty(units.shape[1], dtype=np.float64), np.empty(shape.width, dtype=np.float64),
            np.zeros(shape.configs, dtype=np.int64))


KEYDIFF = slot_kernel("keydiff_steps", _keydiff_state, admit=_keydiff_admit, score=_keydiff_score,
                      pick=_keydiff_pick)
keydiff_steps = KEYDIFF.steps

"""The fast engine's kernels for the policies that score by the keys (``kvsim.policies.knorm``,
``kvsim.policies.keydiff``): the one step loop (``kvsim.sim.kernels.slot_kernel``) with their hooks,
exactly the reference's arithmetic, which the policies' module docstrings state:

- both take ``keys`` (``engine_inputs``: the trace's keys as float64, as
  ``kvsim.policies.knorm.kernel_keys`` hands them) and compute every norm or unit key once, with the
  reference's arithmetic;
- knorm evicts the first maximum of the held positions' key norms over every slot (the newcomer
  included), copied into a per-slot row as each position is admitted; its score is ``1 / norm``
  (``inf`` for 0);
- keydiff evicts the first maximum of the cosines to the sum of the held unit keys: the sum added in
  kept order (the reference's ``position_sum`` over the slots, a cumulative sum: it starts from the
  first slot's row, not from 0.0), each dot product's terms added in dimension order from the first,
  ``||s||`` likewise, then one division per slot. Its cost is O(budget x head dim) a step against
  h2o's O(budget): every step's newcomer moves the anchor, so every held key's dot product changes.

Neither reads attention, so the default ``measure`` only counts the kept mass and the top-k hits.
"""

from __future__ import annotations

import math

import numpy as np

from ..jit import kernel
from ..policies.slot_hooks import Shape, _drop
from .kernels import slot_kernel

# --------------------------------------------------------------------------------------------
# the keys as the hooks read them: ``key_norms`` and ``unit_keys`` of ``kvsim.policies.knorm`` /
# ``keydiff``, the same arithmetic (each key widened to float64, its squares added in dimension order
# from the first, ``sqrt``; a unit key is the key over its norm, zero for a zero key), in one compiled
# pass instead of NumPy's temporaries (about 50 ms for 4097 float16 keys of 256 dimensions, more than
# h2o's whole replay of a dense trace)


@kernel
def _key_norm(row):
    x = np.float64(row[0])
    acc = x * x
    for k in range(1, row.shape[0]):
        x = np.float64(row[k])
        acc += x * x
    return math.sqrt(acc)


@kernel
def _key_norms(keys, out):
    for p in range(keys.shape[0]):
        out[p] = _key_norm(keys[p])


@kernel
def _unit_keys(keys, out):
    for p in range(keys.shape[0]):
        row = keys[p]
        norm = _key_norm(row)
        o = out[p]
        for k in range(row.shape[0]):
            o[k] = np.float64(row[k]) / norm if norm > 0 else 0.0


def key_norms(keys: np.ndarray) -> np.ndarray:
    out = np.empty(keys.shape[0], dtype=np.float64)
    _key_norms(keys, out)
    return out


def unit_keys(keys: np.ndarray) -> np.ndarray:
    out = np.empty(keys.shape, dtype=np.float64)
    _unit_keys(keys, out)
    return out


# --------------------------------------------------------------------------------------------
# knorm: each slot's key norm, kept in kept order beside the slots (as h2o keeps its scores), so the
# pick reads one contiguous row


@kernel
def _knorm_admit(state, c, p_c, n):
    norms, slot_norm = state
    slot_norm[c, n] = norms[p_c[n]]


@kernel
def _knorm_score(state, c, p_c, i):
    norm = state[1][c, i]
    return 1.0 / norm if norm > 0 else np.inf


@kernel
def _knorm_pick(state, c, t, p_c, n, A, a0, scored):
    return _first_max(state[1][c], n)


@kernel
def _knorm_drop(state, c, best, n):
    _drop(state[1][c], best, n)


def _knorm_state(shape: Shape, keys):
    norms = key_norms(keys)
    slot_norm = np.zeros((shape.configs, shape.width), dtype=np.float64)
    slot_norm[:, 0] = norms[0]  # position 0, held from the start
    return norms, slot_norm


KNORM = slot_kernel("knorm_steps", _knorm_state, admit=_knorm_admit, score=_knorm_score, pick=_knorm_pick,
                    drop=_knorm_drop)
knorm_steps = KNORM.steps


# --------------------------------------------------------------------------------------------
# keydiff: each held slot's unit key is also a column of ``cols[c]`` (``(d, width)``; column
# ``col_of[c, slot]``; an eviction hands its column to the next newcomer, so columns never move), so
# the dot products run along a row of columns: every slot's product is still added in dimension order,
# and the additions of different slots, side by side, vectorise


@kernel
def _keydiff_cosines(state, c, p_c, n):
    """``cos[:n]``: each held slot's cosine to the sum of the held unit keys. Both long sums take four terms
    per pass (``((s + u_1) + u_2) + u_3 ...``, ``((dot + c_0 s_0) + c_1 s_1) + ...``): the same additions in
    the same order, so the same bits, with each partial sum loaded and stored once per four terms."""
    units, cols, col_of, s, dots, cos, held = state
    d = units.shape[1]
    first = units[p_c[0]]
    for k in range(d):
        s[k] = first[k]
    n4 = 1 + (n - 1) // 4 * 4
    for i in range(1, n4, 4):  # kept order, each dimension's sum in that order; side by side over k
        r1, r2, r3, r4 = units[p_c[i]], units[p_c[i + 1]], units[p_c[i + 2]], units[p_c[i + 3]]
        for k in range(d):
            s[k] = (((s[k] + r1[k]) + r2[k]) + r3[k]) + r4[k]
    for i in range(n4, n):
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
    c_cols = cols[c]
    w = c_cols.shape[1]
    col = c_cols[0]
    s0 = s[0]
    for j in range(w):
        dots[j] = col[j] * s0
    d4 = 1 + (d - 1) // 4 * 4
    for k in range(1, d4, 4):  # every column's dot product gains its k-th terms: dimension order, per column
        c1, c2, c3, c4 = c_cols[k], c_cols[k + 1], c_cols[k + 2], c_cols[k + 3]
        s1, s2, s3, s4 = s[k], s[k + 1], s[k + 2], s[k + 3]
        for j in range(w):
            dots[j] = (((dots[j] + c1[j] * s1) + c2[j] * s2) + c3[j] * s3) + c4[j] * s4
    for k in range(d4, d):
        col = c_cols[k]
        sk = s[k]
        for j in range(w):
            dots[j] += col[j] * sk
    o_c = col_of[c]
    for i in range(n):
        cos[i] = dots[o_c[i]] / norm


@kernel
def _keydiff_admit(state, c, p_c, n):
    units, cols, col_of, s, dots, cos, held = state
    j = col_of[c, n]
    row = units[p_c[n]]
    c_cols = cols[c]
    for k in range(row.shape[0]):
        c_cols[k, j] = row[k]
    held[c] = n + 1  # held after admitting slot n: what ``score`` scores


@kernel
def _keydiff_score(state, c, p_c, i):
    """Slot i's ``1 - cos``; the cosines are computed once, when slot 0 is asked (``pick`` reads them back)."""
    if i == 0:
        _keydiff_cosines(state, c, p_c, state[6][c])
    return 1.0 - state[5][i]


@kernel
def _keydiff_pick(state, c, t, p_c, n, A, a0, scored):
    if not scored:  # else ``score`` has just computed them for these n slots
        _keydiff_cosines(state, c, p_c, n)
    return _first_max(state[5], n)


@kernel
def _first_max(values, n):
    """The slot of the largest of ``values[:n]``; strict, so the first maximum: the lower position."""
    best = 0
    high = values[0]
    for i in range(1, n):
        if values[i] > high:
            high = values[i]
            best = i
    return best


@kernel
def _keydiff_drop(state, c, best, n):
    o_c = state[2][c]
    freed = o_c[best]
    _drop(o_c, best, n)
    o_c[n - 1] = freed  # the next newcomer's column


def _keydiff_state(shape: Shape, keys):
    units = unit_keys(keys)
    n_cfg, width, d = shape.configs, shape.width, units.shape[1]
    # O(configs x d x budget) float64: every held unit key once more, as a column
    cols = np.zeros((n_cfg, d, width), dtype=np.float64)
    cols[:, :, 0] = units[0]  # position 0, held from the start, in column 0
    col_of = np.tile(np.arange(width, dtype=np.int64), (n_cfg, 1))
    return (units, cols, col_of, np.empty(d, dtype=np.float64), np.empty(width, dtype=np.float64),
            np.empty(width, dtype=np.float64), np.zeros(n_cfg, dtype=np.int64))


KEYDIFF = slot_kernel("keydiff_steps", _keydiff_state, admit=_keydiff_admit, score=_keydiff_score,
                      pick=_keydiff_pick, drop=_keydiff_drop)
keydiff_steps = KEYDIFF.steps

"""KeyDiff: evict the held key most similar (cosine) to the mean of the held keys.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference", 2025
(arXiv:2504.15364): keys that point where most keys point add little that the others do not; the
distinctive ones are kept. NVIDIA kvpress's ``KeyDiffPress`` (kvpress/presses/keydiff_press.py) fixes
the two choices the one-line definition leaves open, and kvsim follows it:

- the anchor is the mean of the *unit-normalised* keys (``F.normalize(keys).mean(...)``), not of the
  raw keys, so a key with a large norm does not pull the anchor its way;
- the mean is over every key the press is scoring, the cache as it stands, so here: every held
  position *including the one just admitted* (the step's newcomer);
- the score is ``-cos(k, anchor)`` and the lowest scores go: the largest cosine is evicted.

What it reads: the KV head's keys (``reads = ("keys",)``), post-RoPE as stored, handed over by
``see`` before each position is admitted. No attention.

Arithmetic (the engine's, below, is held to it bit for bit), in float64:
``u_p = k_p / ||k_p||`` (``kvsim.policies.knorm.key_norms``; a zero key stays zero, as
``F.normalize`` leaves it); ``s = sum of u_p`` over the held slots, added in kept order, one
dimension at a time; ``cos_p = (u_p . s) / ||s||`` with the products added in dimension order and
``||s||`` as a key norm; every ``cos_p`` is 0 when ``s`` is zero. Summing instead of averaging changes
no cosine (the mean is ``s / n``; a cosine does not see the scale).

Which positions may go: every held one, the newest included (its key is there, so the definition
reaches it); no recent window (the paper and the press have none). Ties (equal cosines) evict the
older, lower position. Several victims at once (``evict`` to a budget more than one below what is held)
are the largest cosines of one scoring, as the press drops its lowest scores together, and come back in
ascending position order. Deterministic: ``rng`` is never used.

The score kept for the scores view is ``1 - cos`` (in 0 .. 2, the lowest goes, as for every policy);
eviction itself compares the cosines.

Its fast path is declared here too (``STEPS``): the hooks with which the engine's one step loop
(``kvsim.sim.kernels``) replays every configuration at once. Its state takes ``keys`` (``engine_inputs``,
as knorm's) and computes every unit key once (``compiled_unit_keys``); a step's cosines are the sum of the
held unit keys added in kept order (a cumulative sum: it starts from the first slot's row, not from 0.0),
each dot product's terms added in dimension order from the first, ``||s||`` likewise, then one division
per slot, and the victim is their first maximum. Its cost is O(budget x head dim) a step against h2o's
O(budget): every step's newcomer moves the anchor, so every held key's dot product changes. It reads no
attention, so the loop's default ``measure`` only counts the kept mass and the top-k hits.
"""

from __future__ import annotations

import math

import numpy as np

from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, Display, EngineBinding
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks, _drop, _first_max
from ..policykit.tensor_hooks import TensorHooks, TensorState, WalkMap, admitted, held_columns, in_order
from ..policykit.tensor_hooks import key_norms as tensor_key_norms
from .knorm import KeyedSlots, _key_norm, kernel_keys, key_norms


def unit_keys(keys) -> np.ndarray:
    """float64 ``k / ||k||`` of each key (the last axis), a zero key left zero: one key or a
    position-major array, row by row the same bits either way."""
    k = np.asarray(keys, dtype=np.float64)
    norms = key_norms(k)[..., None]
    return np.divide(k, norms, out=np.zeros_like(k), where=norms > 0)


def cosines(units: np.ndarray) -> np.ndarray:
    """The cosine of each of ``units`` (held keys, unit-normalised, in kept order, ``(n, d)``) to the
    sum of them all, with the module docstring's arithmetic (``_cosines``, a kernel: the deployed cache
    asks at every step of a prompt, and NumPy's cumulative sums of ``(d, n)`` were most of its time)."""
    units = np.ascontiguousarray(units, dtype=np.float64)
    out = np.zeros(units.shape[0])
    if units.shape[0]:
        _cosines(units, out)
    return out


@kernel
def _cosines(units, out):
    """``cosines`` into ``out``: every sum strictly in order, as ``position_sum`` adds (a cumulative sum
    from the first term), so the kernel and the plain function give the same bits."""
    n, d = units.shape
    s = np.empty(d)
    for k in range(d):
        s[k] = units[0, k]
    for i in range(1, n):  # per dimension, the held keys added in kept order
        for k in range(d):
            s[k] += units[i, k]
    ss = s[0] * s[0]
    for k in range(1, d):
        ss += s[k] * s[k]
    norm = np.sqrt(ss)
    if norm == 0.0:
        return
    for i in range(n):
        dot = units[i, 0] * s[0]
        for k in range(1, d):
            dot += units[i, k] * s[k]
        out[i] = dot / norm


@kernel
def _unit_keys(keys, out):
    for p in range(keys.shape[0]):
        row = keys[p]
        norm = _key_norm(row)
        o = out[p]
        for k in range(row.shape[0]):
            o[k] = np.float64(row[k]) / norm if norm > 0 else 0.0


def compiled_unit_keys(keys: np.ndarray) -> np.ndarray:
    """``unit_keys`` of a position-major array of keys, compiled in one pass: the same bits."""
    out = np.empty(keys.shape, dtype=np.float64)
    _unit_keys(keys, out)
    return out


# --------------------------------------------------------------------------------------------
# the fast path: each held slot's unit key is also a column of ``cols[c]`` (``(d, width)``; column
# ``col_of[c, slot]``; an eviction hands its column to the next newcomer, so columns never move), so
# the dot products run along a row of columns: every slot's product is still added in dimension order,
# and the additions of different slots, side by side, vectorise


@kernel
def _keydiff_cosines(state, c, p_c, n):
    """``cos[:n]``: each held slot's cosine to the sum of the held unit keys. Both long sums take four terms
    per pass (``((s + u_1) + u_2) + u_3 ...``, ``((dot + c_0 s_0) + c_1 s_1) + ...``): the same additions in
    the same order, so the same bits, with each partial sum loaded and stored once per four terms. The sum reads
    the held unit keys as rows (``rows[c, col_of[c, i]]``), the products as columns: the state holds nothing per
    position seen but the call's unit keys (``units``), read once, when a position is admitted."""
    units, cols, col_of, s, dots, cos, held, rows, base = state
    d = cols.shape[1]
    o_c = col_of[c]
    r_c = rows[c]
    first = r_c[o_c[0]]
    for k in range(d):
        s[k] = first[k]
    n4 = 1 + (n - 1) // 4 * 4
    for i in range(1, n4, 4):  # kept order, each dimension's sum in that order; side by side over k
        r1, r2, r3, r4 = r_c[o_c[i]], r_c[o_c[i + 1]], r_c[o_c[i + 2]], r_c[o_c[i + 3]]
        for k in range(d):
            s[k] = (((s[k] + r1[k]) + r2[k]) + r3[k]) + r4[k]
    for i in range(n4, n):
        row = r_c[o_c[i]]
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
    for i in range(n):
        cos[i] = dots[o_c[i]] / norm


@kernel
def _keydiff_admit(state, c, p_c, n):
    units, cols, col_of, s, dots, cos, held, rows, base = state
    j = col_of[c, n]
    row = units[p_c[n] - base[0]]
    c_cols = cols[c]
    r_cj = rows[c, j]
    for k in range(row.shape[0]):
        c_cols[k, j] = row[k]
        r_cj[k] = row[k]
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
def _keydiff_drop(state, c, best, n):
    o_c = state[2][c]
    freed = o_c[best]
    _drop(o_c, best, n)
    o_c[n - 1] = freed  # the next newcomer's column


def _keydiff_state(shape: Shape, keys):
    units = compiled_unit_keys(keys)
    n_cfg, width, d = shape.configs, shape.width, units.shape[1]
    # O(configs x d x budget) float64, twice: every held unit key as a column and as a row
    cols = np.zeros((n_cfg, d, width), dtype=np.float64)
    cols[:, :, 0] = units[0]  # position 0, held from the start, in column 0
    rows = np.zeros((n_cfg, width, d), dtype=np.float64)
    rows[:, 0] = units[0]
    col_of = np.tile(np.arange(width, dtype=np.int64), (n_cfg, 1))
    # ``units[t - base[0]]`` is position t's unit key: the whole trace's here (base 0), a call's in the walk
    return (units, cols, col_of, np.empty(d, dtype=np.float64), np.empty(width, dtype=np.float64),
            np.empty(width, dtype=np.float64), np.zeros(n_cfg, dtype=np.int64), rows, np.zeros(1, dtype=np.int64))


#: keydiff's hooks of the engine's step loop, which its ``engine_binding`` names
STEPS = SlotHooks("keydiff_steps", _keydiff_state, admit=_keydiff_admit, score=_keydiff_score, pick=_keydiff_pick,
                  drop=_keydiff_drop)


# --------------------------------------------------------------------------------------------
# the tensor step (the deployed cache's, ``kvsim.hf.tensor``): each column's unit key (``unit_keys``'s arithmetic in
# torch), set as its position is admitted, a slot of ``(batch, heads, width, d)`` made at the first key (its d);
# a step's cosines as ``_cosines`` adds them: the held unit keys summed in kept order (a cumulative sum over the
# held columns gathered in position order, at most a budget's worth of them), each product's terms in dimension
# order, ``||s||`` as a key norm, then one division per column


def _keydiff_tensor_state(policies, batch, heads, width, device):
    return TensorState()


def _keydiff_tensor_admit(state, new, before):
    import torch

    key = state.now["keys"].double()
    norm = tensor_key_norms(key)[..., None]
    unit = torch.where(norm > 0, key / norm, 0.0)  # a zero key stays zero, as ``unit_keys`` leaves it
    if "unit" not in state.slots:
        state.slots["unit"] = torch.zeros(*new.shape, key.shape[-1], dtype=torch.float64, device=key.device)
    state.slots["unit"] = admitted(state.slots["unit"], new, unit)


def _keydiff_tensor_rank(state, cols):
    import torch

    held = cols.held
    at = held_columns(state, cols)
    slot = state.slots["unit"]
    units = slot.gather(2, at[..., None].expand(-1, -1, -1, slot.shape[-1])) * held.gather(-1, at)[..., None]
    total = units.cumsum(2)[:, :, -1]  # (batch, heads, d): kept order, the columns not held adding zeros after
    norm = tensor_key_norms(total)[..., None]
    dots = -torch.where(norm > 0, in_order(units * total[:, :, None, :]) / norm, 0.0)
    return torch.zeros_like(held, dtype=dots.dtype).scatter(-1, at, dots), held


def _keydiff_walk_rows(policy, engine, t0, rows):
    """One configuration's engine state (the compiled walk, ``kvsim.hf.walk``) with a call's unit keys
    (``unit_keys``' arithmetic, compiled), positions ``t0 ..``, in place of the last call's: the state keeps nothing
    per position seen."""
    units, *rest, base = engine
    base[0] = t0
    return (compiled_unit_keys(kernel_keys(rows["keys"])), *rest, base)


def _keydiff_walk_read(engine, c, held, slots, params):
    """Configuration c's held unit keys into the engine's columns and rows 0 .. n-1 in position order (the column
    map the identity)."""
    units, cols, col_of, s, dots, cos, count, rows, base = engine
    n = len(held)
    col_of[c] = np.arange(col_of.shape[1])
    rows[c, :n] = slots["unit"][c, held]
    cols[c, :, :n] = rows[c, :n].T
    count[c] = n


def _keydiff_walk_prepare(state, slots, shapes, size):
    """The unit key slot, where the tensor step has not made it yet (it does at its first key)."""
    import torch

    if "unit" not in slots:
        slots["unit"] = torch.zeros(*size, *shapes["keys"], dtype=torch.float64)


def _keydiff_walk_write(engine, p, col, length, slots, params):
    """Every configuration's held unit keys from the engine's rows into the tensor state's."""
    units, cols, col_of, s, dots, cos, count, rows, base = engine
    held = np.arange(p.shape[1])[None, :] < length[:, None]
    c, i = np.nonzero(held)
    slots["unit"][c, col[held]] = rows[c, col_of[c, i]]


#: keydiff's tensor step, which its ``tensor_step`` names; its walk keeps the held unit keys and the call's
TENSOR = TensorHooks("keydiff", _keydiff_tensor_state, _keydiff_tensor_rank, admit=_keydiff_tensor_admit,
                     walk=WalkMap(_keydiff_walk_read, _keydiff_walk_write, prepare=_keydiff_walk_prepare),
                     walk_rows=_keydiff_walk_rows, per_call=True)


@register
class KeyDiff(KeyedSlots):
    name = "keydiff"
    order = 110
    summary = "evict the held key most similar (cosine) to the mean of the held unit keys, the newest included"
    display = Display("#b15928", "6px,6px,2px,6px", 3, score_name="1 - cosine to the mean key")
    engine_binding = EngineBinding(STEPS)
    tensor_step = TENSOR
    keeps_scores = True

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        super().__init__(budget, rng)
        self._unit: np.ndarray | None = None  # (budget + 1, d), allocated with the first key's d

    @classmethod
    def engine_inputs(cls, policies, steps, vectors=None):
        return {"keys": kernel_keys(vectors["keys"])}

    def _slot_arrays(self) -> list[np.ndarray]:
        return [] if self._unit is None else [self._unit]

    def _seen(self, key: np.ndarray) -> np.ndarray:
        if self._unit is None:
            self._unit = np.zeros((self.budget + 1, key.size), dtype=np.float64)
        elif key.size != self._unit.shape[1]:
            raise ValueError(f"{self.name}: a key of {key.size} dimensions after keys of {self._unit.shape[1]}")
        return unit_keys(key)

    def _store(self, slot: int, state) -> None:
        self._unit[slot] = state

    @property
    def cosines(self) -> np.ndarray:
        """The cosine of each held key to the mean of the held unit keys, aligned with ``kept``."""
        return cosines(self._unit[: self._len])

    @property
    def scores(self) -> np.ndarray:
        """``1 - cos`` of each held position, aligned with ``kept``: the lowest goes."""
        return 1.0 - self.cosines

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        self._step_attention(None)  # the free-slot check only: attention is never read
        self._admit_keyed(pos)

    def evict(self, budget: int) -> list[int]:
        if self._len <= budget:
            return []
        # the first minimum of -cos is the first maximum of cos: the lower position on ties
        return self._evict_lowest(budget, -self.cosines)

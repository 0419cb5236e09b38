"""Knorm: evict the held key with the largest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024
(arXiv:2406.11430): keys with a low norm draw high attention, so the keys with the largest norm are the
ones to drop. NVIDIA kvpress's ``KnormPress`` scores a position by ``-||k||`` and keeps the highest
scores; here, at each decode step, the held position whose key has the largest norm goes.

What it reads: the KV head's keys (``reads = ("keys",)``), post-RoPE as the model stores them: each
position's key is handed over by ``see`` right before the position is admitted (position 0's before
the first step). It reads no attention.

Arithmetic (the engine's, below, is held to it bit for bit): the key as float64, its squares added
strictly in dimension order (``position_sum``), then ``sqrt``.

Which positions may go: every held one, the newest included. The newest position has its key as soon
as it is admitted, so the definition reaches it; a newcomer whose key is the largest held leaves at
once (the cache does not advance past it), as the press would drop it. No recent window: the paper
and the press have none. Ties (equal norms) evict the older, lower position; several victims at once
are the largest norms, chosen together, and come back in ascending position order. Deterministic:
``rng`` is never used.

The score kept for the scores view is ``1 / ||k||`` (``inf`` for a zero key), so that, as for every
policy, the lowest score goes; eviction itself compares the norms.

Its fast path is declared here too (``STEPS``): the hooks with which the engine's one step loop
(``kvsim.sim.kernels``) replays every configuration at once. Its state takes ``keys`` (``engine_inputs``:
the trace's keys as float64, ``kernel_keys``) and computes every norm once, with the reference's
arithmetic (``compiled_key_norms``); each slot's norm is copied into a per-slot row as its position is
admitted, and the victim is the first maximum over every slot, the newcomer included. It reads no
attention, so the loop's default ``measure`` only counts the kept mass and the top-k hits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ..data.gqa import position_sum
from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, Display, EngineBinding, SlotPolicy
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks, _drop, _first_max
from ..policykit.tensor_hooks import TensorHooks, TensorState, admitted, slots
from ..policykit.tensor_hooks import key_norms as tensor_key_norms


def key_norms(keys) -> np.ndarray:
    """float64 ``||k||_2`` of each key (the last axis): squares added in dimension order, then ``sqrt``.
    One key or a position-major array of them: row by row the same bits either way."""
    k = np.asarray(keys, dtype=np.float64)
    return np.sqrt(position_sum(k * k))


def kernel_keys(keys) -> np.ndarray:
    """The keys as the engine's kernels take them: float64, C-contiguous (float16 and float32 widen exactly),
    so one compiled signature serves every trace, the one ``kvsim.sim.engine.prepare`` compiles."""
    return np.ascontiguousarray(keys, dtype=np.float64)


def inverse(norms: np.ndarray) -> np.ndarray:
    """``1 / norm`` per position, ``inf`` for a zero norm: the score the view shows (lowest goes)."""
    norms = np.asarray(norms, dtype=np.float64)
    out = np.full(norms.shape, np.inf)
    np.divide(1.0, norms, out=out, where=norms > 0)
    return out


def one_key(policy: str, pos: int, vectors: Mapping[str, np.ndarray]) -> np.ndarray:
    """Position ``pos``'s key from what ``see`` was handed: a 1-D row, else a ValueError naming the policy."""
    if "keys" not in vectors:
        raise ValueError(f"{policy}: position {pos} was shown no key (it reads keys)")
    key = np.asarray(vectors["keys"])
    if key.ndim != 1 or key.size == 0:
        raise ValueError(f"{policy}: the key of position {pos} has shape {key.shape}, expected one row (d,)")
    return key


# --------------------------------------------------------------------------------------------
# the keys as the engine's hooks read them (knorm's here, keydiff's unit keys from ``_key_norm``): the
# arithmetic of ``key_norms`` (each key widened to float64, its squares added in dimension order from the
# first, ``sqrt``) in one compiled pass instead of NumPy's temporaries (about 50 ms for 4097 float16 keys
# of 256 dimensions, more than h2o's whole replay of a dense trace)


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


def compiled_key_norms(keys: np.ndarray) -> np.ndarray:
    """``key_norms`` of a position-major array of keys, compiled: the same bits."""
    out = np.empty(keys.shape[0], dtype=np.float64)
    _key_norms(keys, out)
    return out


# --------------------------------------------------------------------------------------------
# the fast path: each slot's key norm (``state[1]``), kept in kept order beside the slots (as h2o keeps
# its scores), so the pick reads one contiguous row; ``state[0]``: every position's norm


@kernel
def _knorm_admit(state, c, p_c, n):
    norms, slot_norm, base = state
    slot_norm[c, n] = norms[p_c[n] - base[0]]


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
    norms = compiled_key_norms(keys)
    slot_norm = np.zeros((shape.configs, shape.width), dtype=np.float64)
    slot_norm[:, 0] = norms[0]  # position 0, held from the start
    # ``norms[t - base[0]]`` is position t's: the whole trace's here (base 0), a call's in the deployed cache's walk
    return norms, slot_norm, np.zeros(1, dtype=np.int64)


#: knorm's hooks of the engine's step loop, which its ``engine_binding`` names
STEPS = SlotHooks("knorm_steps", _knorm_state, admit=_knorm_admit, score=_knorm_score, pick=_knorm_pick,
                  drop=_knorm_drop)


# --------------------------------------------------------------------------------------------
# the tensor step (the deployed cache's, ``kvsim.hf.tensor``): each column's key norm, ``key_norms``'s arithmetic
# in torch (the same bits), set as its position is admitted; the victim the first maximum over every held column,
# the newest included


def _knorm_tensor_state(policies, batch, heads, width, device):
    return TensorState(slots={"norm": slots(batch, heads, width, device)})


def _knorm_tensor_admit(state, new, before):
    state.slots["norm"] = admitted(state.slots["norm"], new, tensor_key_norms(state.now["keys"]))


def _knorm_tensor_rank(state, cols):
    return -state.slots["norm"], cols.held


def _knorm_walk_rows(policy, engine, t0, rows):
    """One configuration's engine state (the compiled walk, ``kvsim.hf.walk``) with a call's key norms, positions
    ``t0 ..``, in place of the last call's: the state keeps nothing per position seen."""
    norms, slot_norm, base = engine
    base[0] = t0
    return compiled_key_norms(kernel_keys(rows["keys"])), slot_norm, base


#: knorm's tensor step, which its ``tensor_step`` names; its walk keeps the held key norms (the engine's array 1, in
#: held order) and the call's
TENSOR = TensorHooks("knorm", _knorm_tensor_state, _knorm_tensor_rank, admit=_knorm_tensor_admit,
                     walk=(("norm", 1),), walk_rows=_knorm_walk_rows, per_call=True)


class KeyedSlots(SlotPolicy):
    """Mechanics shared by the policies that read one key per position: ``see`` hands over the key of
    the position about to be admitted (position 0's while it is the only one held), ``_seen`` turns it
    into the per-slot state, ``_take`` stores it in the admitted slot. Admitting a position whose key
    was not seen is refused, naming the policy and the position."""

    reads = ("keys",)

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        super().__init__(budget, rng)
        self._pending: tuple[int, object] | None = None
        self._first_seen = False  # position 0's key, held from the start

    def _seen(self, key: np.ndarray):  # pragma: no cover - abstract
        raise NotImplementedError

    def _store(self, slot: int, state) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def see(self, pos: int, vectors: Mapping[str, np.ndarray]) -> None:
        state = self._seen(one_key(self.name, pos, vectors))
        if pos == 0 and self._len == 1 and self._pos[0] == 0 and not self._first_seen:
            self._store(0, state)
            self._first_seen = True
        else:
            self._pending = (pos, state)

    def _admit_keyed(self, pos: int) -> None:
        if not self._first_seen:
            raise ValueError(f"{self.name}: position 0's key was never seen (Policy.see before the first step)")
        if self._pending is None or self._pending[0] != pos:
            raise ValueError(f"{self.name}: position {pos} admitted before its key was seen (Policy.see)")
        self._store(self._admit(pos), self._pending[1])
        self._pending = None


@register
class KNorm(KeyedSlots):
    name = "knorm"
    order = 100
    summary = "evict the held key with the largest L2 norm (the newest included)"
    display = Display("#c51b7d", "2px,2px,2px,2px,2px,2px,12px,4px", 3, score_name="1 / key norm")
    engine_binding = EngineBinding(STEPS)
    tensor_step = TENSOR
    keeps_scores = True

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        super().__init__(budget, rng)
        self._norm = np.zeros(self.budget + 1, dtype=np.float64)

    @classmethod
    def engine_inputs(cls, policies, steps, vectors=None):
        return {"keys": kernel_keys(vectors["keys"])}

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._norm]

    def _seen(self, key: np.ndarray) -> float:
        return float(key_norms(key))

    def _store(self, slot: int, state) -> None:
        self._norm[slot] = state

    @property
    def norms(self) -> np.ndarray:
        """The key norm of each held position, aligned with ``kept``."""
        return self._norm[: self._len].copy()

    @property
    def scores(self) -> np.ndarray:
        """``1 / ||k||`` of each held position, aligned with ``kept``: the lowest goes."""
        return inverse(self._norm[: self._len])

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        self._step_attention(None)  # the free-slot check only: attention is never read
        self._admit_keyed(pos)

    def evict(self, budget: int) -> list[int]:
        # the first minimum of -norm is the first maximum of norm: the largest norm, the lower position on ties
        return self._evict_lowest(budget, -self._norm[: self._len])

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

Arithmetic (the engine's kernel, ``kvsim.sim.kernels_keys``, is held to it bit for bit), in float64:
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
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .base import DEFAULT_BUDGET, Display, EngineBinding
from .knorm import KeyedSlots, kernel_keys, key_norms
from .registry import register


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


@register
class KeyDiff(KeyedSlots):
    name = "keydiff"
    order = 110
    summary = "evict the held key most similar (cosine) to the mean of the held unit keys, the newest included"
    display = Display("#b15928", "6px,6px,2px,6px", 3, score_name="1 - cosine to the mean key")
    engine_binding = EngineBinding("kvsim.sim.kernels_keys:KEYDIFF")
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

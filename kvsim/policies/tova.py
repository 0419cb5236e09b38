"""TOVA, token omission via attention: evict the kept position with the lowest weight in the
latest attention row.

Oren et al., "Transformers are Multi-State RNNs", 2024 (arXiv:2401.06104).

No history at all: only the latest row decides, so a position that was central a step ago and
is ignored now is the next to go. The position admitted this step has no weight yet (its query
has not been attended to by anyone), so it is never the victim; without that rule a policy
that ranks by weight would evict every newcomer at once and the cache would never advance.

``attn=None`` ("no information this step"): every weight stays as it was, the weight each
position had in the latest row it was shown. Positions admitted since the latest shown row have
no weight and rank above every weighted position (no evidence against them); among themselves
the lower position goes first. Equal weights evict the lower position; victims come back in
ascending position order. Deterministic: ``rng`` is never used.
"""

from __future__ import annotations

import numpy as np

from .base import DEFAULT_BUDGET, Display, EngineBinding, SlotPolicy
from .registry import register

#: the weight of a position no row has shown yet: above any real weight (at most 1), below the
#: +inf that marks a chosen victim during eviction
UNSEEN = np.finfo(np.float64).max


@register
class TOVA(SlotPolicy):
    name = "tova"
    order = 50
    summary = "evict the lowest weight in the latest attention row, never the newest position"
    display = Display("#00796b", "8px,3px,8px,9px", 4, score_name="latest weight")
    engine_binding = EngineBinding("kvsim.sim.kernels_attention:TOVA")
    reads_attention = True

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        super().__init__(budget, rng)
        # latest weight per kept position; UNSEEN until a row has shown it (see module docstring)
        self._weight = np.full(self.budget + 1, UNSEEN, dtype=np.float64)

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._weight]

    @property
    def weights(self) -> np.ndarray:
        """Latest observed weight of each kept position, aligned with ``kept``; NaN where no row
        has shown it yet."""
        w = self._weight[: self._len].copy()
        w[w == UNSEEN] = np.nan
        return w

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        attn = self._step_attention(attn)
        if attn is not None:
            self._weight[: self._len] = attn.astype(np.float64)
        self._weight[self._admit(pos)] = UNSEEN

    def evict(self, budget: int) -> list[int]:
        # the newest position (the last in kept order) is never a candidate; unseen positions rank
        # above every weight (finite, at most 1) and, among themselves, lower position first
        return self._evict_lowest(budget, self._weight[: self._len - 1])

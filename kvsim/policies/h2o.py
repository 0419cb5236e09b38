"""H2O, the heavy-hitter oracle: keep the positions with the largest cumulative attention,
plus the ``recent_window`` newest positions, which are never evicted.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023 (arXiv:2306.14048).

Per step every kept position's score gains the attention it just received, accumulated in
float64 from float32 weights (four thousand float32 additions would lose the low-order bits the
eviction comparison depends on). ``attn=None`` means "no information": scores stay as they are.
Eviction is repeated argmin over ``kept[:len - recent_window]``; equal scores evict the lower
position; victims come back in ascending position order, not in the order they were chosen.
"""

from __future__ import annotations

import numpy as np

from .base import DEFAULT_BUDGET, Display, EngineBinding, Param, SlotPolicy, per_config
from .registry import register

#: shared with the policies that protect the newest positions the same way (scissorhands)
RECENT_WINDOW = Param(
    "recent_window", 32, "the newest recent_window positions are never evicted", below_budget=True
)


@register
class H2O(SlotPolicy):
    name = "h2o"
    order = 30
    table_rows = ({"recent_window": 32}, {"recent_window": 64})
    summary = "keep the newest recent_window positions and, of the rest, the largest cumulative attention"
    display = Display("#1f77b4", "solid", 2, "circle")
    engine_binding = EngineBinding("kvsim.sim.kernels:H2O")
    reads_attention = True
    keeps_scores = True
    tunables = (RECENT_WINDOW,)

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        rng: np.random.Generator | None = None,
        recent_window: int = RECENT_WINDOW.default,
    ) -> None:
        super().__init__(budget, rng)
        self.recent_window = RECENT_WINDOW.check(recent_window, self.budget)
        self._score = np.zeros(self.budget + 1, dtype=np.float64)  # position 0 starts at 0

    @classmethod
    def engine_inputs(cls, policies, steps):
        return {"windows": per_config(p.recent_window for p in policies)}

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._score]

    @property
    def scores(self) -> np.ndarray:
        """Cumulative score of each kept position, aligned with ``kept``."""
        return self._score[: self._len].copy()

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        attn = self._step_attention(attn)
        if attn is not None:
            self._score[: self._len] += attn.astype(np.float64)
        self._score[self._admit(pos)] = 0.0

    def evict(self, budget: int) -> list[int]:
        return self._evict_lowest(budget, self._score[: max(self._len - self.recent_window, 0)])

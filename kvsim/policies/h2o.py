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

from .base import DEFAULT_BUDGET, Policy, check_param


class H2O(Policy):
    name = "h2o"
    reads_attention = True
    keeps_scores = True

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        rng: np.random.Generator | None = None,
        recent_window: int = 32,
    ) -> None:
        super().__init__(budget, rng)
        self.recent_window = check_param("recent_window", recent_window, below=self.budget)
        # parallel arrays in kept order (ascending position), budget + 1 slots
        self._pos = np.zeros(self.budget + 1, dtype=np.int64)
        self._score = np.zeros(self.budget + 1, dtype=np.float64)
        self._len = 1  # position 0, score 0

    @property
    def params(self) -> dict[str, int]:
        return {"recent_window": self.recent_window}

    @property
    def kept(self) -> np.ndarray:
        return self._pos[: self._len].copy()

    @property
    def scores(self) -> np.ndarray:
        """Cumulative score of each kept position, aligned with ``kept``."""
        return self._score[: self._len].copy()

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        n = self._len
        if n == self._pos.size:
            raise RuntimeError(f"{self.name}: cache full ({n}); evict before the next step")
        if attn is not None:
            attn = np.asarray(attn)
            if attn.shape != (n,):
                raise ValueError(f"{self.name}: attn has shape {attn.shape}, expected ({n},)")
            self._score[:n] += attn.astype(np.float64)
        self._pos[n] = pos
        self._score[n] = 0.0
        self._len = n + 1

    def evict(self, budget: int) -> list[int]:
        n_evict = self._len - budget
        if n_evict <= 0:
            return []
        evictable = self._len - self.recent_window
        if evictable < n_evict:
            raise ValueError(
                f"{self.name}: cannot evict to budget {budget} with recent_window {self.recent_window}"
            )
        scores = self._score[:evictable].copy()
        chosen = np.zeros(evictable, dtype=bool)
        for _ in range(n_evict):
            i = int(np.argmin(scores))  # first minimum: the lower position on ties
            chosen[i] = True
            scores[i] = np.inf
        victims = self._pos[:evictable][chosen].tolist()
        keep = np.concatenate([~chosen, np.ones(self._len - evictable, dtype=bool)])
        m = self._len - n_evict
        self._pos[:m] = self._pos[: self._len][keep]
        self._score[:m] = self._score[: self._len][keep]
        self._len = m
        return victims

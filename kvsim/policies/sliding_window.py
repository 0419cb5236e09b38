"""Sliding window: keep the most recent ``budget`` positions (folklore; the recency baseline).

A ring buffer of exactly ``budget + 1`` slots, the most the cache ever holds (right after the
new position is admitted). Victims come back oldest first; positions only increase, so that is
also ascending position order and the domain's "lower position first" tie rule holds trivially.
Attention is never read.
"""

from __future__ import annotations

import numpy as np

from .base import DEFAULT_BUDGET, Policy


class SlidingWindow(Policy):
    name = "sliding_window"

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        super().__init__(budget, rng)
        self._slots = np.zeros(self.budget + 1, dtype=np.int64)
        self._head = 0  # slot of the oldest position
        self._len = 1  # the cache starts holding position 0

    @property
    def kept(self) -> np.ndarray:
        idx = (self._head + np.arange(self._len)) % self._slots.size
        return self._slots[idx]

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        if self._len == self._slots.size:
            raise RuntimeError(f"{self.name}: cache full ({self._len}); evict before the next step")
        self._slots[(self._head + self._len) % self._slots.size] = pos
        self._len += 1

    def evict(self, budget: int) -> list[int]:
        victims = []
        while self._len > budget:
            victims.append(int(self._slots[self._head]))
            self._head = (self._head + 1) % self._slots.size
            self._len -= 1
        return victims

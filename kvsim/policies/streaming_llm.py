"""StreamingLLM: pin the first ``sinks`` positions forever, slide a window over the rest.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024
(arXiv:2309.17453). Trained transformers park attention on the first few tokens (attention
sinks); a window that throws them away degrades sharply. Tie rule: victims are the oldest
unpinned positions, oldest first, which is ascending position order. Attention is never read.
"""

from __future__ import annotations

import numpy as np

from .base import DEFAULT_BUDGET, Policy, check_param


class StreamingLLM(Policy):
    name = "streaming_llm"

    def __init__(
        self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None, sinks: int = 4
    ) -> None:
        super().__init__(budget, rng)
        self.sinks = check_param("sinks", sinks, below=self.budget)
        self._sink_positions: list[int] = []
        # ring buffer for the unpinned part: at most budget + 1 - sinks positions at once
        self._slots = np.zeros(self.budget + 1 - self.sinks, dtype=np.int64)
        self._head = 0
        self._len = 0
        self._admit(0)

    @property
    def params(self) -> dict[str, int]:
        return {"sinks": self.sinks}

    def _admit(self, pos: int) -> None:
        if len(self._sink_positions) < self.sinks:
            self._sink_positions.append(pos)
            return
        if self._len == self._slots.size:
            raise RuntimeError(f"{self.name}: cache full; evict before the next step")
        self._slots[(self._head + self._len) % self._slots.size] = pos
        self._len += 1

    @property
    def kept(self) -> np.ndarray:
        idx = (self._head + np.arange(self._len)) % self._slots.size
        return np.concatenate([np.asarray(self._sink_positions, dtype=np.int64), self._slots[idx]])

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        self._admit(pos)

    def evict(self, budget: int) -> list[int]:
        victims = []
        while len(self._sink_positions) + self._len > budget:
            if self._len == 0:
                raise ValueError(f"{self.name}: budget {budget} is below sinks ({self.sinks})")
            victims.append(int(self._slots[self._head]))
            self._head = (self._head + 1) % self._slots.size
            self._len -= 1
        return victims

"""``greedy_future``, an OFFLINE REFERENCE: a greedy heuristic with future knowledge, NOT the optimum.

It is given the whole trace (``trace=``, future rows included) and evicts the kept position with
the least attention still to come: the sum of the full trace's weights on it over every later row.
Equal future attention evicts the lower position; victims come back in ascending position order.
It reads the trace, never the observed attention.

Why it is kept, under this name: it shows that knowing the future is not enough. Ranking by the
total attention still to come favours long-lived, thinly attended positions over the recency band
that the next rows want, so online policies that know nothing of the future (tova, h2o with a
fitting recent_window) beat it on the canonical trace (0.7937 against tova's 0.9684 at budget 256),
while the exact optimum (``optimal``) with the same knowledge all but reaches the per-step upper
bound there (0.96854 against 0.96858). The distance between this line and ``optimal`` is what a
schedule adds over a ranking (0.04-0.05 on the shipped gemma3 traces). It was called ``oracle`` before; the name said
"the best", which it is not.
"""

from __future__ import annotations

import numpy as np

from ..data.trace import Trace
from .base import DEFAULT_BUDGET, Display, EngineBinding, SlotPolicy
from .registry import register

#: rows per block of the precomputed suffix sums (memory ~ (T / BLOCK) * T * 8 bytes)
BLOCK = 64


@register
class GreedyFuture(SlotPolicy):
    name = "greedy_future"
    order = 140
    summary = "evicts the position with the least attention still to come: greedy with future knowledge, not the optimum"
    display = Display("#b0b0b0", "2px,6px", 3)
    engine_binding = EngineBinding("kvsim.sim.kernels_unobserved:GREEDY_FUTURE")
    needs_trace = True

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        rng: np.random.Generator | None = None,
        trace: Trace | None = None,
    ) -> None:
        super().__init__(budget, rng)
        if not isinstance(trace, Trace):
            raise ValueError("trace: greedy_future is an offline reference and needs the whole trace (trace=...)")
        self._rows = trace.derived  # whole rows a block at a time (a query/key trace computes them)
        self._steps = T = trace.steps
        # _suffix[c] = sum of rows c*BLOCK+1 .. T in float64, added from the last block back, so
        # the attention still to come after step t is _suffix[ceil(t / BLOCK)] plus fewer than
        # BLOCK rows: O(T^2 / BLOCK) memory instead of the full (T+1)^2 suffix matrix
        n_blocks = -(-T // BLOCK)
        self._suffix = np.zeros((n_blocks + 1, T + 1), dtype=np.float64)
        for c in range(n_blocks - 1, -1, -1):
            rows = self._rows.rows(c * BLOCK + 1, min(T, (c + 1) * BLOCK) + 1).astype(np.float64)
            self._suffix[c] = self._suffix[c + 1]
            self._suffix[c, : rows.shape[1]] += rows.sum(axis=0)  # the rows' width: at least the positions they reach
        self._step = 0

    @classmethod
    def engine_inputs(cls, policies, steps):
        """The block suffix sums: one trace, so the first configuration's serve them all."""
        return {"suffix": np.ascontiguousarray(policies[0]._suffix)}

    def future_attention(self, positions: np.ndarray, after: int) -> np.ndarray:
        """Sum of the trace's weights on ``positions`` over rows ``after + 1 .. T`` (float64)."""
        positions = np.asarray(positions, dtype=np.int64)
        c = -(-after // BLOCK)
        rows = self._rows.weights_at(after + 1, min(c * BLOCK, self._steps) + 1, positions).astype(np.float64)
        return self._suffix[c, positions] + rows.sum(axis=0)

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        self._step_attention(None)  # the free-slot check; greedy_future reads the trace, not attn
        if not self._pos[self._len - 1] < pos <= self._steps:
            raise ValueError(f"{self.name}: position {pos} is not a step of the trace after {self._pos[self._len - 1]}")
        self._admit(pos)
        self._step = pos

    def evict(self, budget: int) -> list[int]:
        if self._len <= budget:
            return []
        return self._evict_lowest(budget, self.future_attention(self._pos[: self._len], self._step))

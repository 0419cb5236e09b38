"""Offline references: a policy that reads the future, and the per-step bound no policy can pass.

Neither can run in a serving stack. They are here so that every other policy's number has
something to be measured against.

- ``OfflineOracle`` (registry name ``oracle``), an OFFLINE REFERENCE: it is given the whole trace
  (``trace=``, future rows included) and evicts the kept position with the least attention still
  to come, the sum of the full trace's weights on it over every later row. Equal future
  attention evicts the lower position; victims come back in ascending position order. It reads
  the trace, never the observed attention. It is greedy, not optimal: keeping the positions
  with the most attention *in total* still to come is not the same as keeping, at each step, the
  ones that row wants, so a policy can beat it on some traces (tests/test_family.py pins what
  does hold).
- ``upper_bound_series(trace, budget)``, not a policy: per step t, the sum of the ``budget``
  largest weights of row t. The cache query t sees holds at most ``budget`` positions, so no
  policy's retained mass at step t can exceed it.
"""

from __future__ import annotations

import numpy as np

from ..trace import Trace
from .base import DEFAULT_BUDGET, SlotPolicy, check_budget

#: rows per block of the precomputed suffix sums (memory ~ (T / BLOCK) * T * 8 bytes)
BLOCK = 64


class OfflineOracle(SlotPolicy):
    name = "oracle"
    summary = "evicts the position with the least attention still to come, greedy rather than optimal"
    needs_trace = True

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        rng: np.random.Generator | None = None,
        trace: Trace | None = None,
    ) -> None:
        super().__init__(budget, rng)
        if not isinstance(trace, Trace):
            raise ValueError("trace: the oracle is an offline reference and needs the whole trace (trace=...)")
        self._attention = trace.attention
        self._steps = trace.steps
        # _suffix[c] = sum of rows c*BLOCK+1 .. T in float64, added from the last block back, so
        # the attention still to come after step t is _suffix[ceil(t / BLOCK)] plus fewer than
        # BLOCK rows: O(T^2 / BLOCK) memory instead of the full (T+1)^2 suffix matrix
        n_blocks = -(-self._steps // BLOCK)
        self._suffix = np.zeros((n_blocks + 1, self._steps + 1), dtype=np.float64)
        for c in range(n_blocks - 1, -1, -1):
            rows = self._attention[c * BLOCK + 1 : (c + 1) * BLOCK + 1].astype(np.float64)
            self._suffix[c] = self._suffix[c + 1] + rows.sum(axis=0)
        self._step = 0

    def future_attention(self, positions: np.ndarray, after: int) -> np.ndarray:
        """Sum of the trace's weights on ``positions`` over rows ``after + 1 .. T`` (float64)."""
        positions = np.asarray(positions, dtype=np.int64)
        c = -(-after // BLOCK)
        rows = self._attention[after + 1 : c * BLOCK + 1][:, positions].astype(np.float64)
        return self._suffix[c, positions] + rows.sum(axis=0)

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        self._step_attention(None)  # the free-slot check; the oracle reads the trace, not attn
        if not self._pos[self._len - 1] < pos <= self._steps:
            raise ValueError(f"{self.name}: position {pos} is not a step of the trace after {self._pos[self._len - 1]}")
        self._admit(pos)
        self._step = pos

    def evict(self, budget: int) -> list[int]:
        if self._len <= budget:
            return []
        return self._evict_lowest(budget, self.future_attention(self._pos[: self._len], self._step))


def upper_bound_series(trace: Trace, budget: int) -> np.ndarray:
    """Per step t = 1..T (float64): the sum of the ``budget`` largest weights of row t.

    Not a policy: an offline reference. The cache query t sees holds at most ``budget``
    positions, so no policy's retained mass at step t exceeds this.
    """
    budget = check_budget(budget)
    A = trace.attention
    T = trace.steps
    out = np.empty(T, dtype=np.float64)
    for t in range(1, T + 1):
        row = A[t, :t].astype(np.float64)
        if t > budget:
            # the top set, summed in position order like the harness's kept_sum, so a policy
            # that holds exactly this set scores exactly this number
            row = row[np.sort(np.argpartition(row, t - budget)[t - budget :])]
        out[t - 1] = np.cumsum(row)[-1]
    return out


def upper_bound_summary(trace: Trace, budget: int, top_k: int) -> dict:
    """The upper bound as a table row: mean retained mass, and the top-k recall of the same cache
    (the ``budget`` largest weights hold all of the top k when ``budget >= k``)."""
    steps = np.arange(1, trace.steps + 1)
    wanted = np.minimum(top_k, steps)
    return {
        "retained_mass": float(upper_bound_series(trace, budget).mean()),
        "top_k_recall": float((np.minimum(budget, wanted) / wanted).mean()),
    }

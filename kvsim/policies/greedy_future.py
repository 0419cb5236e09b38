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

Its fast path is declared here too (``STEPS``): the hook with which the engine's one step loop
(``kvsim.sim.kernels``) replays every configuration at once, one victim a step from step ``budget`` on: the
first minimum, over every slot (the newcomer's included), of the attention still to come, from the policy's
own block suffix sums plus the rows up to the next block, added in numpy's order (``future_attention``'s).
"""

from __future__ import annotations

import numpy as np

from ..data.trace import Trace
from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, Display, EngineBinding, SlotPolicy
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks, _first_min

#: rows per block of the precomputed suffix sums (memory ~ (T / BLOCK) * T * 8 bytes)
BLOCK = 64


# --------------------------------------------------------------------------------------------
# the fast path: nothing per slot but the positions; ``state``: the block suffix sums (one trace: one
# array for every configuration) and a row to add the attention still to come into


@kernel
def _future_attention(A, a0, suffix, block, t, p_c, n, out):
    """``GreedyFuture.future_attention`` of the n slots after step t, into ``out[:n]``, bit for bit:
    the rows t+1 .. min(c * block, T) (c = ceil(t / block)) added one after another from 0.0 (numpy's
    ``sum(axis=0)`` over a (rows, n >= 2) array adds its rows in order), then added to the block
    suffix ``suffix[c, p]``. Rows outer, slots inner: the same per-slot order, read along rows. ``A``'s
    first row is step ``a0`` (a query/key trace's chunk, which holds the whole block: chunks and blocks
    are both 64 steps from step 1)."""
    T = suffix.shape[1] - 1
    c = (t + block - 1) // block
    for i in range(n):
        out[i] = 0.0
    for r in range(t + 1, min(c * block, T) + 1):
        row = A[r - a0]
        for i in range(n):
            out[i] += np.float64(row[p_c[i]])
    for i in range(n):
        out[i] = suffix[c, p_c[i]] + out[i]


@kernel
def _greedy_future_pick(state, c, t, p_c, n, A, a0, scored):
    """The first minimum of the attention still to come over every slot, the newcomer's included (the
    reference's ``_evict_lowest`` over all ``_len`` slots)."""
    suffix, future = state
    _future_attention(A, a0, suffix, BLOCK, t, p_c, n, future)
    return _first_min(future, n)


def _greedy_future_state(shape: Shape, suffix):
    return suffix, np.empty(shape.width, dtype=np.float64)


#: greedy_future's hooks of the engine's step loop, which its ``engine_binding`` names
STEPS = SlotHooks("greedy_future_steps", _greedy_future_state, pick=_greedy_future_pick)


@register
class GreedyFuture(SlotPolicy):
    name = "greedy_future"
    order = 140
    summary = "evicts the position with the least attention still to come: greedy with future knowledge, not the optimum"
    display = Display("#b0b0b0", "2px,6px", 3)
    engine_binding = EngineBinding(STEPS)
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

"""The fast engine's kernels for the policies that read no observed attention: streaming_llm and
sliding_window (a closed form of the window held), and random, greedy_future and optimal (one victim a
step from step ``budget`` on), each the one step loop of ``kvsim.sim.kernels`` with its hooks.

Exactness, the reference's rules restated where the hooks rely on them:

- streaming_llm and sliding_window evict the oldest unpinned position, slot ``sinks`` in kept order,
  once the cache is over its budget;
- random, greedy_future and optimal evict exactly one position per step from step ``budget`` on:
  random the slot (kept order) its generator draws, greedy_future the first minimum of the attention
  still to come (the policy's own block suffix sums plus the rows up to the next block, added in numpy's
  order), optimal the solver's schedule. The three differ only in how the victim is picked, so one
  specialisation replays them all (``one_victim_steps``).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policies.greedy_future import BLOCK as GREEDY_BLOCK
from ..policies.slot_hooks import Shape, _first_min
from .kernels import SlotKernel, slot_kernel

# --------------------------------------------------------------------------------------------
# streaming_llm and sliding_window (``sinks == 0``): the oldest unpinned position, slot ``sinks`` in
# kept order, leaves once the cache is over its budget


@kernel
def _window_measure(state, c, t, row, p_c, n, stamp, gather):
    """The closed form of what is held before step t (the slots hold the same, in the same order):
    everything when t <= budget, else positions ``0 .. sinks-1`` and the newest ``budget - sinks``.
    Read along the row, not through the slots: nothing to gather, since nothing is observed."""
    sinks, budgets = state
    b = budgets[c]
    s = sinks[c] if t > b else t
    lo = t - (b - s) if t > b else t
    total = 0.0
    hits = 0
    for p in range(s):
        total += np.float64(row[p])
        if stamp[p] == t:
            hits += 1
    for p in range(lo, t):
        total += np.float64(row[p])
        if stamp[p] == t:
            hits += 1
    return total, hits


@kernel
def _window_pick(state, c, t, p_c, n, A, a0, scored):
    return state[0][c]


def _window_state(shape: Shape, sinks, budgets):
    return sinks, budgets


WINDOW = slot_kernel("window_steps", _window_state, measure=_window_measure, pick=_window_pick)
window_steps = WINDOW.steps


# --------------------------------------------------------------------------------------------
# random, greedy_future, optimal: nothing per slot but the positions, one victim per step from step
# ``budget`` on


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


#: how ``one_victim_steps`` picks a victim: the slot the plan names (random's draws), the position
#: it names (optimal's schedule), or the least attention still to come (greedy_future)
PLAN_SLOT, PLAN_POSITION, LEAST_FUTURE = 0, 1, 2


@kernel
def _one_victim_pick(state, c, t, p_c, n, A, a0, scored):
    """PLAN_SLOT: ``plan[c, t - 1]`` is a slot in kept order after admitting t; PLAN_POSITION: a
    position held; LEAST_FUTURE: the first minimum of the attention still to come over every slot, the
    newcomer's included (the reference's ``_evict_lowest`` over all ``_len`` slots), from ``suffix``,
    the policy's own block suffix sums (one trace: one array for every configuration). The plan is only
    read at the steps that evict."""
    how, plan, suffix, future = state
    if how == LEAST_FUTURE:
        _future_attention(A, a0, suffix, GREEDY_BLOCK, t, p_c, n, future)
        return _first_min(future, n)
    if how == PLAN_SLOT:
        return plan[c, t - 1]
    return np.searchsorted(p_c[:n], plan[c, t - 1])  # kept is ascending


#: what a pick that reads no plan or no suffix sums is given in their place
_NO_PLAN = np.zeros((0, 0), dtype=np.int64)
_NO_SUFFIX = np.zeros((0, 0), dtype=np.float64)


def _one_victim_state(how: int, shape: Shape, plan=_NO_PLAN, suffix=_NO_SUFFIX):
    return how, plan, suffix, np.empty(shape.width, dtype=np.float64)


def _random_state(shape: Shape, plan):
    return _one_victim_state(PLAN_SLOT, shape, plan=plan)


def _greedy_future_state(shape: Shape, suffix):
    return _one_victim_state(LEAST_FUTURE, shape, suffix=suffix)


def _optimal_state(shape: Shape, plan):
    return _one_victim_state(PLAN_POSITION, shape, plan=plan)


#: one specialisation for the three: what differs is their state's ``how``
RANDOM = slot_kernel("one_victim_steps", _random_state, pick=_one_victim_pick)
one_victim_steps = RANDOM.steps
GREEDY_FUTURE = SlotKernel(one_victim_steps, _greedy_future_state)
OPTIMAL = SlotKernel(one_victim_steps, _optimal_state)

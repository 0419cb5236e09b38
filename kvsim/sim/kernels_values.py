"""The fast engine's kernel for the value-weighted policies, vatp and critical
(``kvsim.policies.vatp.ValueWeighted``): h2o's accumulated attention per slot, times a fixed float64
multiplier per position (vatp: ``|v_p|_1``; critical: the group mean of ``|W_O^h v_p|_2``), which the
policy's ``engine_inputs`` computes once for the whole trace with the very function its ``see`` calls
on one row, so the products are the reference's bit for bit.

The reference's rules, restated where the hooks rely on them:

- a slot's accumulated attention gains ``float64(float32(w / mass))`` (h2o's, ``kvsim.policies.h2o``);
  the newcomer starts at 0;
- its score is ``accumulated x multipliers[position]``, one float64 product;
- the victim (one per step under the harness) is the first minimum of the scores over
  ``kept[:len - recent_window]`` leaving out the positions below ``sinks`` (held sinks are a prefix of
  kept order, which is ascending); when only sinks are left to choose from, the oldest (slot 0).

Editing a hook here compiles afresh: ``slot_kernel`` names the specialisation after a digest of this file
and every other its hooks reach (numba alone keys it by ``kernels.py``'s time stamp, and once ran a changed
tie rule as the old cached code; tests/test_kernel_cache_names.py).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policies.slot_hooks import Shape, _drop, _slots
from .kernels import slot_kernel


@kernel
def _observe(state, c, p_c, n, gather, total):
    s_c = state[3][c]
    if total > 0:
        for i in range(n):
            s_c[i] += np.float64(np.float32(gather[i] / total))


@kernel
def _admit(state, c, p_c, n):
    state[3][c, n] = 0.0  # the newcomer starts with no attention


@kernel
def _score(state, c, p_c, i):
    return state[3][c, i] * state[2][p_c[i]]


@kernel
def _pick(state, c, t, p_c, n, A, a0, scored):
    windows, sinks, mult, acc = state
    count = n - windows[c]
    first = 0
    while first < count and p_c[first] < sinks[c]:  # the held sinks: a prefix of kept order
        first += 1
    if first == count:
        return 0  # nothing but sinks to choose from: the oldest goes
    a_c = acc[c]
    best = first
    low = a_c[first] * mult[p_c[first]]
    for i in range(first + 1, count):
        s = a_c[i] * mult[p_c[i]]
        if s < low:  # strict: the first minimum, the older position
            low = s
            best = i
    return best


@kernel
def _drop_slot(state, c, best, n):
    _drop(state[3][c], best, n)


def _state(shape: Shape, windows, sinks, multipliers):
    if multipliers.shape != (shape.steps + 1,):
        raise ValueError(f"multipliers has shape {multipliers.shape}, expected ({shape.steps + 1},): one per position")
    return windows, sinks, multipliers, _slots(shape, 0.0, np.float64)


VALUE_WEIGHTED = slot_kernel("value_weighted_steps", _state, observe=_observe, admit=_admit, score=_score, pick=_pick,
                             drop=_drop_slot)
value_weighted_steps = VALUE_WEIGHTED.steps

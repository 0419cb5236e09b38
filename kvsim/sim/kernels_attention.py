"""The fast engine's kernels for the policies that score each held position by the attention it is shown
(``kvsim.policies.tova``, ``scissorhands``, ``h2o_normalized``; h2o's own hooks sit beside it, in
``kvsim.policies.h2o``): the one step loop of ``kvsim.sim.kernels`` with their hooks.

Exactness, the reference's rules restated where the hooks rely on them (the loop's own in ``kvsim.sim.kernels``):

- observed attention is ``float32(float64(A[t, p]) / mass)``, zeros when the mass is 0;
- tova keeps each slot's latest observed weight (a newcomer's ``UNSEEN``) and never evicts the newest;
- a scissorhands vote is ``float32(observed) > float32(1 / n)`` (n = positions held before the
  step); a row of zeros gives no vote but still advances its history window;
- h2o_normalized adds ``float64(observed)`` as h2o does and counts the steps shown (a row of zeros
  counts), evicting by ``sum / count`` (0 while the count is 0);
- eviction is the first minimum over ``kept[:len - recent_window]``, so equal scores evict the lower position.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policies.slot_hooks import Shape, _drop, _first_min, _slots
from ..policies.tova import UNSEEN
from .kernels import slot_kernel

# --------------------------------------------------------------------------------------------
# tova: each slot's weight in the latest row (a newcomer's UNSEEN), never evicting the newest


@kernel
def _tova_observe(state, c, p_c, n, gather, total):
    w_c = state[0][c]
    for i in range(n):
        w_c[i] = np.float64(np.float32(gather[i] / total)) if total > 0 else 0.0


@kernel
def _tova_admit(state, c, p_c, n):
    state[0][c, n] = UNSEEN


@kernel
def _tova_pick(state, c, t, p_c, n, A, a0, scored):
    return _first_min(state[0][c], n - 1)  # the newest is never a candidate


@kernel
def _tova_drop(state, c, best, n):
    _drop(state[0][c], best, n)


def _tova_state(shape: Shape):
    return (_slots(shape, UNSEEN, np.float64),)  # position 0: no row has shown it yet


TOVA = slot_kernel("tova_steps", _tova_state, observe=_tova_observe, admit=_tova_admit, pick=_tova_pick,
                   drop=_tova_drop)
tova_steps = TOVA.steps


# --------------------------------------------------------------------------------------------
# scissorhands: votes by position (eviction moves positions only); with a history window,
# ``ring[c, j]`` lists the voters of the j-th observed step (mod the window), so the vote that leaves
# the window is taken back in O(voters)


@kernel
def _scissorhands_observe(state, c, p_c, n, gather, total):
    windows, histories, votes, observed, ring, ring_len = state
    v_c = votes[c]
    h = histories[c]
    col = 0
    if h > 0:  # the oldest observed step in the window takes its votes back
        col = observed[c] % h
        for j in range(ring_len[c, col]):
            v_c[ring[c, col, j]] -= 1
        ring_len[c, col] = 0
    if total > 0:  # a row of zeros is shown as zeros: nobody beats the fair share
        share = np.float32(1.0 / n)
        for i in range(n):
            if np.float32(gather[i] / total) > share:
                p = p_c[i]
                v_c[p] += 1
                if h > 0:
                    ring[c, col, ring_len[c, col]] = p
                    ring_len[c, col] += 1
    observed[c] += 1


@kernel
def _scissorhands_admit(state, c, p_c, n):
    state[2][c, p_c[n]] = 0


@kernel
def _scissorhands_score(state, c, p_c, i):
    return state[2][c, p_c[i]]


@kernel
def _scissorhands_pick(state, c, t, p_c, n, A, a0, scored):
    windows, histories, votes, observed, ring, ring_len = state
    v_c = votes[c]
    best = 0
    low = v_c[p_c[0]]
    for i in range(1, n - windows[c]):
        if v_c[p_c[i]] < low:  # strict: the first minimum, the lower position
            low = v_c[p_c[i]]
            best = i
    return best


def _scissorhands_state(shape: Shape, windows, histories):
    # voters of each observed step in the window, O(configs x history_window x budget) int32; a step's
    # voters are among the n <= budget positions held, so `width` entries suffice
    h = int(histories.max())
    ring = np.zeros((shape.configs, max(1, h), shape.width if h else 1), dtype=np.int32)
    return (windows, histories, np.zeros((shape.configs, shape.steps + 1), dtype=np.int64),
            np.zeros(shape.configs, dtype=np.int64), ring, np.zeros(ring.shape[:2], dtype=np.int64))


SCISSORHANDS = slot_kernel("scissorhands_steps", _scissorhands_state, observe=_scissorhands_observe,
                           admit=_scissorhands_admit, score=_scissorhands_score, pick=_scissorhands_pick)
scissorhands_steps = SCISSORHANDS.steps


# --------------------------------------------------------------------------------------------
# h2o_normalized: h2o's sum with a count of the steps shown (a row of zeros counts: it was shown),
# evicting by ``sum / count`` (0 while the count is 0), the reference's ``np.divide``


@kernel
def _normalized_observe(state, c, p_c, n, gather, total):
    s_c = state[1][c]
    k_c = state[2][c]
    for i in range(n):
        if total > 0:
            s_c[i] += np.float64(np.float32(gather[i] / total))
        k_c[i] += 1


@kernel
def _normalized_admit(state, c, p_c, n):
    state[1][c, n] = 0.0
    state[2][c, n] = 0


@kernel
def _normalized_score(state, c, p_c, i):
    s = state[1][c, i]
    k = state[2][c, i]
    return s / k if k > 0 else 0.0


@kernel
def _normalized_pick(state, c, t, p_c, n, A, a0, scored):
    best = 0
    low = _normalized_score(state, c, p_c, 0)
    for i in range(1, n - state[0][c]):
        v = _normalized_score(state, c, p_c, i)
        if v < low:  # strict: the first minimum, the lower position
            low = v
            best = i
    return best


@kernel
def _normalized_drop(state, c, best, n):
    _drop(state[1][c], best, n)
    _drop(state[2][c], best, n)


def _normalized_state(shape: Shape, windows):
    return windows, _slots(shape, 0.0, np.float64), _slots(shape, 0, np.int64)


H2O_NORMALIZED = slot_kernel("h2o_normalized_steps", _normalized_state, observe=_normalized_observe,
                             admit=_normalized_admit, score=_normalized_score, pick=_normalized_pick,
                             drop=_normalized_drop)
h2o_normalized_steps = H2O_NORMALIZED.steps

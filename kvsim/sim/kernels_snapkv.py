"""The fast engine's kernel of snapkv (``kvsim.policies.snapkv``): the one step loop of ``kvsim.sim.kernels``
with hooks that score each held slot by the attention it was shown in the last ``observation_window``
observed rows (or, with a window of 0, the whole run, as h2o does), the reference's arithmetic: each
observed weight ``float32(float64(A[t, p]) / mass)`` widened to float64, a window's sum added oldest to
newest, the victim the first minimum over ``kept[:len - recent_window]``.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policies.slot_hooks import Shape, _drop, _first_min, _slots
from .kernels import slot_kernel

# --------------------------------------------------------------------------------------------
# snapkv: with ``obs_windows[c] == w > 0`` each slot keeps its last w observed weights in ring row
# ``row_of[c, slot]`` (``ring[c, row, :w]``; a row of zeros is written too: it was shown) and the score
# is their chronological sum; with w == 0, a running sum as h2o keeps it. An eviction closes the gap
# in ``row_of`` and hands the freed row to the next newcomer: ring rows never move. Summing every
# window is budget x w work a step, so the victim is found through ``approx``, a running sum of each
# ring row (off the exact sum by at most ``tols[c]``): only the slots it cannot rule out are summed
# exactly (``_window_first_min``).


@kernel
def _window_sum(ring_c, r, w, start):
    """Ring row r's weights over the last w observed rows, added oldest to newest (the reference's
    cumsum over the ring in chronological order): columns start .. w-1, then 0 .. start-1."""
    acc = 0.0
    for j in range(start, w):
        acc += ring_c[r, j]
    for j in range(start):
        acc += ring_c[r, j]
    return acc


@kernel
def _window_first_min(ring_c, row_c, approx_c, count, w, start, tol):
    """``_first_min`` over the exact window sums of slots ``0 .. count-1``, computing an exact sum
    only for a slot whose running sum (``approx_c``, within ``tol`` of the exact sum) says it could
    be the smallest: the same slot as summing every window, at a fraction of the cost."""
    reach = approx_c[0]
    for i in range(1, count):
        reach = min(reach, approx_c[i])
    reach += 2.0 * tol
    best = 0
    low = np.inf
    for i in range(count):
        a = approx_c[i]
        if a <= reach and a <= low + tol:
            exact = _window_sum(ring_c, row_c[i], w, start)
            if exact < low:  # strict: the first minimum, the lower position
                low = exact
                best = i
                if low == 0.0:  # weights are non-negative: no later sum is smaller
                    break
    return best


@kernel
def _snapkv_observe(state, c, p_c, n, gather, total):
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = state
    w = obs_windows[c]
    if w > 0:
        r_c = ring[c]
        o_c = row_of[c]
        a_c = approx[c]
        col = observed[c] % w
        for i in range(n):
            v = np.float64(np.float32(gather[i] / total)) if total > 0 else 0.0
            a_c[i] = (a_c[i] - r_c[o_c[i], col]) + v
            r_c[o_c[i], col] = v
    elif total > 0:
        run_c = running[c]
        for i in range(n):
            run_c[i] += np.float64(np.float32(gather[i] / total))
    observed[c] += 1


@kernel
def _snapkv_admit(state, c, p_c, n):
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = state
    w = obs_windows[c]
    if w > 0:
        r = row_of[c, n]
        for j in range(w):
            ring[c, r, j] = 0.0
        approx[c, n] = 0.0
    else:
        running[c, n] = 0.0


@kernel
def _snapkv_score(state, c, p_c, i):
    """Slot i's exact score, kept in ``scores`` too: ``pick`` reads it back on a recorded step."""
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = state
    w = obs_windows[c]
    scores[i] = _window_sum(ring[c], row_of[c, i], w, observed[c] % w) if w > 0 else running[c, i]
    return scores[i]


@kernel
def _snapkv_pick(state, c, t, p_c, n, A, a0, scored):
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = state
    w = obs_windows[c]
    if scored:
        return _first_min(scores, n - windows[c])
    if w > 0:
        return _window_first_min(ring[c], row_of[c], approx[c], n - windows[c], w, observed[c] % w, tols[c])
    return _first_min(running[c], n - windows[c])


@kernel
def _snapkv_drop(state, c, best, n):
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = state
    if obs_windows[c] > 0:
        o_c = row_of[c]
        freed = o_c[best]
        _drop(o_c, best, n)
        o_c[n - 1] = freed  # the next newcomer's ring row
        _drop(approx[c], best, n)
    else:
        _drop(running[c], best, n)


def _snapkv_state(shape: Shape, windows, obs_windows):
    n_cfg, width = shape.configs, shape.width
    # O(configs x budget x observation_window) float64: the weights each slot still counts
    ring = np.zeros((n_cfg, width, max(1, int(obs_windows.max()))), dtype=np.float64)
    row_of = np.tile(np.arange(width, dtype=np.int64), (n_cfg, 1))  # slot -> its ring row
    # |approx - the exact window sum| <= u (w + 1) (2T + w) (u = 2^-53: at most 2T updates of a sum
    # of at most w + 1 weights in [0, 1], against a w-term sequential sum); twice that, for margin
    tols = 2.3e-16 * (obs_windows + 1) * (2 * shape.steps + obs_windows + 2)
    return (windows, obs_windows, tols, ring, row_of, _slots(shape, 0.0, np.float64),
            _slots(shape, 0.0, np.float64),  # observation_window 0: the whole run
            np.zeros(n_cfg, dtype=np.int64), np.empty(width, dtype=np.float64))


SNAPKV = slot_kernel("snapkv_steps", _snapkv_state, observe=_snapkv_observe, admit=_snapkv_admit,
                     score=_snapkv_score, pick=_snapkv_pick, drop=_snapkv_drop)
snapkv_steps = SNAPKV.steps

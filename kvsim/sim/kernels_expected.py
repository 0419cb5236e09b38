"""The fast engine's kernel of expected_attention (``kvsim.policies.expected_attention``): the step loop of
``kvsim.sim.kernels`` with hooks that score the held slots by the policy's own kernels, the very
kernels its reference calls (``window_stats``, ``key_logits``, ``combine``), so the two agree bit for bit
(tests/test_scorers_queries.py).

The state holds what ``ExpectedAttention.engine_inputs`` made a position at a time with the reference's
own calls (keys in float64, value norms, the queries turned back before RoPE, each position's turn) and,
per configuration, its sinks, query window, refresh and future average, with the statistics of its current
period and each slot's logits against them (stamped with the period). A step's scores are computed when
the loop first asks for them (the scores record, or the pick once the cache is over its budget): the
statistics of the period's first step (``period_of``; its window the positions ``max(sinks, p - window + 1)
.. p``, oldest first, as the reference's ring held them), the logits of the slots not stamped with it, the
softmax over the held. Skipping a step changes nothing: what is computed depends on the step, not on when.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policies.expected_attention import combine, key_logits, window_stats
from ..policies.slot_hooks import Shape, _first_min, _slots
from .kernels import slot_kernel


@kernel
def _fresh(state, c, p_c):
    """Configuration c's scores, computed once per step (``due[c]``: how many slots are held, newest last,
    while the step's scores are still to compute; 0 once they are)."""
    (keys, vnorm, pre, cos, sin, sinks, windows, refresh, cbar, sbar, scores, due, adv, cols, logits, stamp, period,
     counts) = state
    n = due[c]
    if n > 0:
        t = p_c[n - 1]
        s = sinks[c]
        per = 1 + (t - 1) // refresh[c] * refresh[c]  # ``period_of``
        if per != period[c]:  # the window and turn of step ``per``, as the reference's ring held them then
            lo = max(s, per - windows[c] + 1)
            count = per - lo + 1 if per >= s else 0
            window_stats(pre, lo if count > 0 else 0, count, pre.shape[0], cos[per], sin[per], cbar[c], sbar[c], adv[c],
                         cols[c])
            period[c] = per
            counts[c] = count
        held_sinks = min(s, n)
        key_logits(keys, p_c, n, held_sinks, adv[c], cols[c], counts[c], logits[c], stamp[c], per)
        combine(logits[c], p_c, vnorm, n, held_sinks, scores[c])
        due[c] = 0
    return scores[c]


@kernel
def _expected_admit(state, c, p_c, n):
    state[11][c] = n + 1  # slot n is the newcomer: the n + 1 held are to be scored
    state[15][c, n] = -1  # its logits are not taken yet


@kernel
def _expected_score(state, c, p_c, i):
    return _fresh(state, c, p_c)[i]


@kernel
def _expected_pick(state, c, t, p_c, n, A, a0, scored):
    return _first_min(_fresh(state, c, p_c), n)


@kernel
def _expected_drop(state, c, best, n):
    """Slot ``best`` leaves: the later slots' logits and stamps move up with their positions."""
    logits = state[14][c]
    stamp = state[15][c]
    for i in range(best, n - 1):
        stamp[i] = stamp[i + 1]
        for g in range(logits.shape[1]):
            logits[i, g] = logits[i + 1, g]


def _expected_state(shape: Shape, keys, vnorm, pre, cos, sin, sinks, windows, refresh, cbar, sbar):
    G, d = pre.shape[1:]
    return (keys, vnorm, pre, cos, sin, sinks, windows, refresh, cbar, sbar, _slots(shape, 0.0, np.float64),
            np.zeros(shape.configs, dtype=np.int64), np.zeros((shape.configs, G, d)),
            np.zeros((shape.configs, G, d, int(windows.max()))), np.zeros((shape.configs, shape.width, G)),
            _slots(shape, -1, np.int64), np.full(shape.configs, -1, dtype=np.int64), np.zeros(shape.configs, dtype=np.int64))


EXPECTED_ATTENTION = slot_kernel("expected_attention_steps", _expected_state, admit=_expected_admit,
                                 score=_expected_score, pick=_expected_pick, drop=_expected_drop)
expected_attention_steps = EXPECTED_ATTENTION.steps

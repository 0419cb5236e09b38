"""The fast engine's kernel of expected_attention (``kvsim.policies.expected_attention``): the step loop of
``kvsim.sim.kernels`` with hooks that score the held slots by the policy's own ``step_scores``, the very
kernel its reference calls, so the two agree bit for bit (tests/test_scorers_queries.py).

The state holds what ``ExpectedAttention.engine_inputs`` made a position at a time with the reference's
own calls (keys in float64, value norms, the queries turned back before RoPE, each position's turn) and,
per configuration, its sinks, query window and future average. A step's scores are computed when the
loop first asks for them (the scores record, or the pick once the cache is over its budget), from the
slots held then: the window is the positions ``max(sinks, t - window + 1) .. t``, oldest first, as the
reference's ring holds them.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policies.expected_attention import step_scores
from .kernels import Shape, _first_min, _slots, slot_kernel


@kernel
def _fresh(state, c, p_c):
    """Configuration c's scores, computed once per step (``due[c]``: how many slots are held, newest last,
    while the step's scores are still to compute; 0 once they are)."""
    keys, vnorm, pre, cos, sin, sinks, windows, cbar, sbar, scores, due = state
    n = due[c]
    if n > 0:
        t = p_c[n - 1]
        s = sinks[c]
        lo = max(s, t - windows[c] + 1)
        count = t - lo + 1 if t >= s else 0
        step_scores(keys, p_c, vnorm, n, min(s, n), pre, lo if count > 0 else 0, count, pre.shape[0], cos[t], sin[t],
                    cbar[c], sbar[c], scores[c])
        due[c] = 0
    return scores[c]


@kernel
def _expected_admit(state, c, p_c, n):
    state[10][c] = n + 1  # slot n is the newcomer: the n + 1 held are to be scored


@kernel
def _expected_score(state, c, p_c, i):
    return _fresh(state, c, p_c)[i]


@kernel
def _expected_pick(state, c, t, p_c, n, A, a0, scored):
    return _first_min(_fresh(state, c, p_c), n)


def _expected_state(shape: Shape, keys, vnorm, pre, cos, sin, sinks, windows, cbar, sbar):
    return (keys, vnorm, pre, cos, sin, sinks, windows, cbar, sbar, _slots(shape, 0.0, np.float64),
            np.zeros(shape.configs, dtype=np.int64))


EXPECTED_ATTENTION = slot_kernel("expected_attention_steps", _expected_state, admit=_expected_admit,
                                 score=_expected_score, pick=_expected_pick)
expected_attention_steps = EXPECTED_ATTENTION.steps

"""The per-step upper bound: not a policy, an offline reference computed from the trace alone.

Per step t, the sum of the ``budget`` largest weights of row t. The cache query t sees holds at
most ``budget`` positions, so no policy's retained mass at step t can exceed it. A cache cannot
reach it in general, because holding each row's best set would need evicted positions back;
``optimal`` is the best a cache can do under its rules.
"""

from __future__ import annotations

import numpy as np

from ..data.trace import Trace
from .base import check_budget

#: rows read per block
ROWS = 256


def upper_bound_series(trace: Trace, budget: int) -> np.ndarray:
    """Per step t = 1..T (float64): the sum of the ``budget`` largest weights of row t.

    Not a policy: an offline reference. The cache query t sees holds at most ``budget``
    positions, so no policy's retained mass at step t exceeds this.
    """
    budget = check_budget(budget)
    T = trace.steps
    out = np.empty(T, dtype=np.float64)
    for t in range(1, T + 1):
        if (t - 1) % ROWS == 0:  # whole rows a block at a time (a query/key trace computes them)
            A, a0 = trace.derived.rows(t, min(T + 1, t + ROWS)), t
        row = A[t - a0, :t].astype(np.float64)
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

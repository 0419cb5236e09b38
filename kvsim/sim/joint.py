"""The joint replay of a layer's KV heads sharing one pool: Ada-KV's allocation (Feng et al., "Ada-KV:
Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference", arXiv:2407.11550)
with h2o's score.

Each head of the layer is an h2o cache (docs/domain.md, "The harness": score the row over what is
held, show the head its observed attention, admit the new position) but none has a budget of its
own: the layer holds ``pool`` positions in all. After every step, while the layer holds more than
``pool``, the one position with the lowest cumulative score among every head's evictable part goes
(the newest ``recent_window`` of each head are protected, as in h2o), except that a head already at
``floor`` positions loses none. Ties: the lowest score of a head is its first in kept order (the lower
position, as h2o), and between heads the lower head wins (evicts first).

Each head's arithmetic is the harness's (``kept_sum`` in kept order, the observed row as float32, its
float64 sum into the scores), so with ``floor`` equal to the share (``pool / heads``) every head
loses exactly its own argmin each step and the joint replay is h2o's replay of each head alone, bit
for bit (tests/test_allocation.py holds both that and the engine path equal to this reference).
Only retained mass is measured here; top-k recall is not.
"""

from __future__ import annotations

import numpy as np

from .. import jit
from ..data.gqa import position_sum
from ..data.trace import Trace
from ..progress import Progress
from .harness import observe


def _check(traces: list[Trace], pool: int, floor: int, recent_window: int) -> int:
    if not traces:
        raise ValueError("a joint replay needs at least one head")
    steps = {t.steps for t in traces}
    if len(steps) != 1:
        raise ValueError(f"a layer's heads must have one length; got {sorted(steps)} steps")
    if floor <= recent_window:
        raise ValueError(f"floor {floor} must be above recent_window {recent_window}, or a head at its floor "
                         "could have nothing to evict")
    if pool < floor * len(traces):
        raise ValueError(f"pool {pool} is below {len(traces)} heads x floor {floor}")
    return steps.pop()


class Pool:
    """One row of a layer's heads sharing ``pool`` positions: the step both the reference replay and the
    deployed cache (``kvsim.hf.pooled``) take, so the two cannot part. Each head holds ``kept[h]``
    (ascending positions) with h2o's cumulative scores beside them; position 0 is held from the start."""

    def __init__(self, heads: int, pool: int, floor: int, recent_window: int):
        self.pool, self.floor, self.recent_window = pool, floor, recent_window
        self.kept = [[0] for _ in range(heads)]
        self.scores = [[0.0] for _ in range(heads)]

    @property
    def held(self) -> int:
        return sum(len(k) for k in self.kept)

    def step(self, t: int, attention: list[np.ndarray]) -> tuple[list[float], list[list[int]]]:
        """Step t: ``attention[h]`` is query t's weight on each of head h's held positions (aligned with
        ``kept[h]``, not yet renormalised). Each head is shown it renormalised (float32, the harness's
        ``observe``), adds it to its scores in float64 and admits t; then, while the layer holds more than
        the pool, the lowest score among every head's evictable part goes. Returns each head's summed
        weight on what it held (its retained mass on a full row) and each head's victims."""
        H = len(self.kept)
        totals = []
        for h in range(H):
            row = np.asarray(attention[h])
            if row.shape != (len(self.kept[h]),):
                raise ValueError(f"step {t}: head {h} holds {len(self.kept[h])} positions, its attention has "
                                 f"{row.shape} weights")
            total = float(position_sum(row))
            totals.append(total)
            seen = observe(row, total).astype(np.float64)
            self.scores[h] = [s + float(o) for s, o in zip(self.scores[h], seen, strict=True)]
            self.kept[h].append(t)
            self.scores[h].append(0.0)
        victims: list[list[int]] = [[] for _ in range(H)]
        held = self.held
        while held > self.pool:
            best_h, best_i, best_s = -1, -1, np.inf
            for h in range(H):
                if len(self.kept[h]) <= self.floor:
                    continue
                scores = self.scores[h]
                for i in range(len(scores) - self.recent_window):
                    if scores[i] < best_s:
                        best_h, best_i, best_s = h, i, scores[i]
            victims[best_h].append(self.kept[best_h].pop(best_i))
            del self.scores[best_h][best_i]
            held -= 1
        return totals, victims


def joint_reference(traces: list[Trace], pool: int, floor: int, recent_window: int) -> np.ndarray:
    """float64 ``(heads, T)``: each head's retained mass per step, the readable loop (``Pool``)."""
    T = _check(traces, pool, floor, recent_window)
    H = len(traces)
    state = Pool(H, pool, floor, recent_window)
    mass = np.empty((H, T), dtype=np.float64)
    for t in range(1, T + 1):
        rows = []
        for h, trace in enumerate(traces):
            k = np.asarray(state.kept[h], dtype=np.int64)
            rows.append(trace.derived.row(t, k)[k])
        totals, _ = state.step(t, rows)
        mass[:, t - 1] = totals
    return mass


@jit.kernel
def _joint_h2o(A, pool, floor, window, mass, pos, score, length, t0, t1):  # pragma: no cover - compiled
    H = A.shape[0]
    for t in range(t0, t1):
        held = 0
        for h in range(H):
            n = length[h]
            total = 0.0
            for i in range(n):
                total += np.float64(A[h, t, pos[h, i]])
            mass[h, t - 1] = total
            if total > 0:
                for i in range(n):
                    score[h, i] += np.float64(np.float32(np.float64(A[h, t, pos[h, i]]) / total))
            pos[h, n] = t
            score[h, n] = 0.0
            length[h] = n + 1
            held += n + 1
        while held > pool:
            best_h, best_i, best_s = -1, -1, np.inf
            for h in range(H):
                if length[h] <= floor:
                    continue
                for i in range(length[h] - window):
                    if score[h, i] < best_s:
                        best_h, best_i, best_s = h, i, score[h, i]
            for i in range(best_i, length[best_h] - 1):
                pos[best_h, i] = pos[best_h, i + 1]
                score[best_h, i] = score[best_h, i + 1]
            length[best_h] -= 1
            held -= 1


def _matrix(trace: Trace) -> np.ndarray:
    """The whole ``(T + 1, T + 1)`` attention as the harness reads its rows (a query/key trace's computed
    with the engine's arithmetic)."""
    return np.asarray(trace.derived.every_row())


def joint_replay(traces: list[Trace], pool: int, floor: int, recent_window: int, *, reference: bool = False,
                 progress: Progress | None = None) -> np.ndarray:
    """float64 ``(heads, T)``: each head's retained mass per step under one shared pool; the compiled
    loop where numba is installed (``reference=True``: ``joint_reference``), the same numbers."""
    T = _check(traces, pool, floor, recent_window)
    if reference or not jit.AVAILABLE:
        out = joint_reference(traces, pool, floor, recent_window)
        if progress is not None:
            progress(1.0)
        return out
    H = len(traces)
    A = np.ascontiguousarray(np.stack([_matrix(t) for t in traces]))
    mass = np.empty((H, T), dtype=np.float64)
    width = pool + 2
    pos = np.zeros((H, width), dtype=np.int64)
    score = np.zeros((H, width), dtype=np.float64)
    length = np.ones(H, dtype=np.int64)
    chunk = 128
    for t0 in range(1, T + 1, chunk):
        t1 = min(t0 + chunk, T + 1)
        _joint_h2o(A, pool, floor, recent_window, mass, pos, score, length, t0, t1)
        if progress is not None:
            progress((t1 - 1) / T)
    return mass


__all__ = ["Pool", "joint_reference", "joint_replay"]

"""The fast engine: replays many configurations of one trace at once, with exactly the results of
the reference policies (``kvsim.replay``), which stay the readable, authoritative implementation.

Why numba: the h2o loop is a sequential float64 sum over the kept set (kept order, bit for bit the
reference's ``kept_sum``), a float32 renormalisation, a score update and one argmin per step. Those
are short dependent loops over ~budget elements; a JIT runs them at machine speed with one pass of
the trace row shared by every configuration. A batched-NumPy version (one array op per step over all
configurations) was measured against it: see the commit that introduced this file and
``python -m kvsim bench``.

Exactness, the reference's rules restated where the engine relies on them:

- kept is ascending by position (a new position is admitted last; eviction keeps the order);
- retained mass is ``sum(float64(A[t, kept]))`` added strictly in kept order;
- observed attention is ``float32(float64(A[t, p]) / mass)``, zeros when the mass is 0;
- an h2o score gains ``float64(observed)``; the new position is admitted with score 0;
- eviction (at most one victim per step under the harness) is the first minimum over
  ``kept[:len - recent_window]``, so equal scores evict the lower position;
- a scissorhands vote is ``float32(observed) > float32(1 / n)`` (n = positions held before the
  step); a row of zeros gives no vote but still advances its history window;
- random, greedy_future and optimal evict exactly one position per step from step ``budget`` on,
  and read no observed attention: random the slot (kept order) its generator draws, greedy_future
  the first minimum of the attention still to come (the policy's own block suffix sums plus the
  rows up to the next block, added in numpy's order), optimal the solver's schedule (solved or read
  from the disk cache, as the reference does). The three differ only in how the victim is picked,
  so one kernel replays them all (``_one_victim_steps``);
- top-k recall counts ``kept`` against the k largest weights of the row (lower position first on
  ties, ``TraceStore.topk``) and divides by ``min(k, t)``; the means are numpy's, over the series.

``FAST``, next to the kernels, is the one table of the policies the engine replays; ``kvsim.replay``
and ``kvsim.sweep`` use it when ``covers`` says so and the reference harness otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np

from ..data.trace import Trace, from_array
from ..jit import AVAILABLE, kernel
from ..policies import Policy, PolicySpec, tunables
from ..policies.greedy_future import BLOCK as GREEDY_BLOCK
from ..policies.tova import UNSEEN
from ..progress import Progress
from .harness import ContractError, ReplayResult

#: threads a sweep runs its batches on: one per core
_WORKERS = os.cpu_count() or 1
#: steps per kernel call: the granularity of ``progress`` reports
_CHUNK = 256
#: configurations per pass of a sweep. The per-step series (16 bytes per configuration and step)
#: are kept only for one batch, so a sweep holds the trace, O(configurations x budget) of cache
#: state and O(_BATCH x steps) of series, whatever the number of values; a pass re-reads only the
#: kept entries of each row, so batching costs next to nothing.
_BATCH = 64


# --------------------------------------------------------------------------------------------
# kernels


@kernel
def _mark_topk(topk, t, stamp):
    for j in range(topk.shape[1]):
        p = topk[t, j]
        if p >= 0:
            stamp[p] = t


@kernel
def _measure(row, p_c, n, stamp, t, gather):
    """One configuration's view of row t: the kept weights as float64 into ``gather``, their sum
    added strictly in kept order (the reference's ``kept_sum``), and how many are in the row's top k
    (``stamp[p] == t``)."""
    total = 0.0
    hits = 0
    for i in range(n):
        p = p_c[i]
        w = np.float64(row[p])
        gather[i] = w
        total += w
        if stamp[p] == t:
            hits += 1
    return total, hits


@kernel
def _first_min(values, count):
    """The slot of the smallest of ``values[:count]``, the first one on ties: the lower position,
    since slots are in kept order (the reference's repeated argmin, one victim per step)."""
    best = 0
    low = values[0]
    for i in range(1, count):
        if values[i] < low:  # strict: the first minimum, the lower position
            low = values[i]
            best = i
    return best


@kernel
def _drop(slots, best, n):
    """Close the gap that evicting slot ``best`` of the ``n`` in use leaves (kept order is kept)."""
    for i in range(best, n - 1):
        slots[i] = slots[i + 1]


@kernel
def _evict(p_c, n, best, t, record, victims):
    """Evict slot ``best`` of the ``n`` held (the new length); ``victims[t - 1]`` gets its position
    when ``record``."""
    if record:
        victims[t - 1] = p_c[best]
    _drop(p_c, best, n)
    return n - 1


@kernel
def _h2o_steps(A, topk, t0, t1, budgets, windows, pos, score, length, mass, recall, stamp, gather,
               kept_hist, score_hist, score_pos, victims):
    """Steps t0 .. t1-1 of h2o for every configuration c (budget ``budgets[c]``, recent window
    ``windows[c]``), state in ``pos``/``score``/``length``. The record arrays are filled for
    configuration 0 only, and only when they are not empty."""
    k = topk.shape[1]
    n_cfg = budgets.shape[0]
    rec_kept = kept_hist.shape[0] > 0
    rec_scores = score_hist.shape[0] > 0
    rec_victims = victims.shape[0] > 0
    for t in range(t0, t1):
        _mark_topk(topk, t, stamp)
        denom = min(k, t)
        row = A[t]
        for c in range(n_cfg):
            n = length[c]
            p_c = pos[c]
            s_c = score[c]
            total, hits = _measure(row, p_c, n, stamp, t, gather)
            mass[c, t - 1] = total
            recall[c, t - 1] = hits / denom
            if total > 0:
                for i in range(n):
                    s_c[i] += np.float64(np.float32(gather[i] / total))
            p_c[n] = t
            s_c[n] = 0.0
            n += 1
            if c == 0 and rec_scores:
                for i in range(n):
                    score_hist[t - 1, i] = s_c[i]
                    score_pos[t - 1, i] = p_c[i]
            if n > budgets[c]:
                best = _first_min(s_c, n - windows[c])
                _drop(s_c, best, n)
                n = _evict(p_c, n, best, t, c == 0 and rec_victims, victims)
            length[c] = n
            if c == 0 and rec_kept:
                kept_hist[t - 1, :n] = p_c[:n]


@kernel
def _tova_steps(A, topk, t0, t1, budgets, pos, weight, length, mass, recall, stamp, gather, kept_hist, victims):
    """Steps t0 .. t1-1 of tova for every configuration c (budget ``budgets[c]``): each kept
    position's weight is its observed weight in the latest row (zeros when the kept part of the row
    is all zeros), a newcomer's is ``UNSEEN``, and the victim is the first minimum over every slot
    but the newest."""
    k = topk.shape[1]
    n_cfg = budgets.shape[0]
    rec_kept = kept_hist.shape[0] > 0
    rec_victims = victims.shape[0] > 0
    for t in range(t0, t1):
        _mark_topk(topk, t, stamp)
        denom = min(k, t)
        row = A[t]
        for c in range(n_cfg):
            n = length[c]
            p_c = pos[c]
            w_c = weight[c]
            total, hits = _measure(row, p_c, n, stamp, t, gather)
            mass[c, t - 1] = total
            recall[c, t - 1] = hits / denom
            for i in range(n):
                w_c[i] = np.float64(np.float32(gather[i] / total)) if total > 0 else 0.0
            p_c[n] = t
            w_c[n] = UNSEEN
            n += 1
            if n > budgets[c]:
                best = _first_min(w_c, n - 1)  # the newest is never a candidate
                _drop(w_c, best, n)
                n = _evict(p_c, n, best, t, c == 0 and rec_victims, victims)
            length[c] = n
            if c == 0 and rec_kept:
                kept_hist[t - 1, :n] = p_c[:n]


@kernel
def _scissorhands_steps(A, topk, t0, t1, budgets, windows, histories, pos, votes, length, observed,
                        ring, ring_len, mass, recall, stamp, gather, kept_hist, score_hist, score_pos, victims):
    """Steps t0 .. t1-1 of scissorhands for every configuration c (budget ``budgets[c]``, recent
    window ``windows[c]``, history window ``histories[c]``, 0 for the whole run). Vote counts live
    by position (``votes[c, p]``), so eviction shifts positions only; with a history window,
    ``ring[c, j]`` lists the voters of the j-th observed step (mod the window), so the vote that
    leaves the window is taken back in O(voters)."""
    k = topk.shape[1]
    n_cfg = budgets.shape[0]
    rec_kept = kept_hist.shape[0] > 0
    rec_scores = score_hist.shape[0] > 0
    rec_victims = victims.shape[0] > 0
    for t in range(t0, t1):
        _mark_topk(topk, t, stamp)
        denom = min(k, t)
        row = A[t]
        for c in range(n_cfg):
            n = length[c]
            p_c = pos[c]
            v_c = votes[c]
            total, hits = _measure(row, p_c, n, stamp, t, gather)
            mass[c, t - 1] = total
            recall[c, t - 1] = hits / denom
            h = histories[c]
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
            p_c[n] = t
            v_c[t] = 0
            n += 1
            if c == 0 and rec_scores:
                for i in range(n):
                    score_hist[t - 1, i] = v_c[p_c[i]]
                    score_pos[t - 1, i] = p_c[i]
            if n > budgets[c]:
                evictable = n - windows[c]
                best = 0
                low = v_c[p_c[0]]
                for i in range(1, evictable):
                    if v_c[p_c[i]] < low:  # strict: the first minimum, the lower position
                        low = v_c[p_c[i]]
                        best = i
                n = _evict(p_c, n, best, t, c == 0 and rec_victims, victims)
            length[c] = n
            if c == 0 and rec_kept:
                kept_hist[t - 1, :n] = p_c[:n]


@kernel
def _h2o_normalized_steps(A, topk, t0, t1, budgets, windows, pos, total_, count, length, mass, recall, stamp, gather,
                          kept_hist, score_hist, score_pos, victims):
    """Steps t0 .. t1-1 of h2o_normalized: h2o's loop, with a per-slot count of the steps shown
    (a row of zeros counts: it was shown) and eviction by ``sum / count`` (0 while the count is 0),
    the reference's ``np.divide``."""
    k = topk.shape[1]
    n_cfg = budgets.shape[0]
    rec_kept = kept_hist.shape[0] > 0
    rec_scores = score_hist.shape[0] > 0
    rec_victims = victims.shape[0] > 0
    for t in range(t0, t1):
        _mark_topk(topk, t, stamp)
        denom = min(k, t)
        row = A[t]
        for c in range(n_cfg):
            n = length[c]
            p_c = pos[c]
            s_c = total_[c]
            k_c = count[c]
            total, hits = _measure(row, p_c, n, stamp, t, gather)
            mass[c, t - 1] = total
            recall[c, t - 1] = hits / denom
            for i in range(n):
                if total > 0:
                    s_c[i] += np.float64(np.float32(gather[i] / total))
                k_c[i] += 1
            p_c[n] = t
            s_c[n] = 0.0
            k_c[n] = 0
            n += 1
            if c == 0 and rec_scores:
                for i in range(n):
                    score_hist[t - 1, i] = s_c[i] / k_c[i] if k_c[i] > 0 else 0.0
                    score_pos[t - 1, i] = p_c[i]
            if n > budgets[c]:
                evictable = n - windows[c]
                best = 0
                low = s_c[0] / k_c[0] if k_c[0] > 0 else 0.0
                for i in range(1, evictable):
                    v = s_c[i] / k_c[i] if k_c[i] > 0 else 0.0
                    if v < low:  # strict: the first minimum, the lower position
                        low = v
                        best = i
                _drop(s_c, best, n)
                _drop(k_c, best, n)
                n = _evict(p_c, n, best, t, c == 0 and rec_victims, victims)
            length[c] = n
            if c == 0 and rec_kept:
                kept_hist[t - 1, :n] = p_c[:n]


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
def _snapkv_steps(A, topk, t0, t1, budgets, windows, obs_windows, tols, pos, ring, row_of, approx, running, length,
                  observed, mass, recall, stamp, gather, scores, kept_hist, score_hist, score_pos, victims):
    """Steps t0 .. t1-1 of snapkv. With ``obs_windows[c] == w > 0`` each slot keeps its last w
    observed weights in ring row ``row_of[c, slot]`` (``ring[c, row, :w]``; a row of zeros is
    written too: it was shown) and the score is their chronological sum; with w == 0, a running
    sum as h2o keeps it. An eviction closes the gap in ``row_of`` and hands the freed row to the
    next newcomer: ring rows never move.

    Summing every window is budget x w work a step, so the victim is found through ``approx``, a
    running sum of each ring row (off the exact sum by at most ``tols[c]``): only the slots it
    cannot rule out are summed exactly (``_window_first_min``)."""
    k = topk.shape[1]
    n_cfg = budgets.shape[0]
    rec_kept = kept_hist.shape[0] > 0
    rec_scores = score_hist.shape[0] > 0
    rec_victims = victims.shape[0] > 0
    for t in range(t0, t1):
        _mark_topk(topk, t, stamp)
        denom = min(k, t)
        row = A[t]
        for c in range(n_cfg):
            n = length[c]
            p_c = pos[c]
            w = obs_windows[c]
            r_c = ring[c]
            o_c = row_of[c]
            a_c = approx[c]
            run_c = running[c]
            total, hits = _measure(row, p_c, n, stamp, t, gather)
            mass[c, t - 1] = total
            recall[c, t - 1] = hits / denom
            if w > 0:
                col = observed[c] % w
                for i in range(n):
                    v = np.float64(np.float32(gather[i] / total)) if total > 0 else 0.0
                    a_c[i] = (a_c[i] - r_c[o_c[i], col]) + v
                    r_c[o_c[i], col] = v
            elif total > 0:
                for i in range(n):
                    run_c[i] += np.float64(np.float32(gather[i] / total))
            observed[c] += 1
            p_c[n] = t
            if w > 0:
                for j in range(w):
                    r_c[o_c[n], j] = 0.0
                a_c[n] = 0.0
            else:
                run_c[n] = 0.0
            n += 1
            start = observed[c] % w if w > 0 else 0
            record = c == 0 and rec_scores
            if record:  # every slot's exact score, recorded
                for i in range(n):
                    scores[i] = _window_sum(r_c, o_c[i], w, start) if w > 0 else run_c[i]
                    score_hist[t - 1, i] = scores[i]
                    score_pos[t - 1, i] = p_c[i]
            if n > budgets[c]:
                if record:
                    best = _first_min(scores, n - windows[c])
                elif w > 0:
                    best = _window_first_min(r_c, o_c, a_c, n - windows[c], w, start, tols[c])
                else:
                    best = _first_min(run_c, n - windows[c])
                if w > 0:
                    freed = o_c[best]
                    _drop(o_c, best, n)
                    o_c[n - 1] = freed  # the next newcomer's ring row
                    _drop(a_c, best, n)
                else:
                    _drop(run_c, best, n)
                n = _evict(p_c, n, best, t, c == 0 and rec_victims, victims)
            length[c] = n
            if c == 0 and rec_kept:
                kept_hist[t - 1, :n] = p_c[:n]


@kernel
def _window_steps(A, topk, t0, t1, budgets, sinks, mass, recall, stamp, kept_hist):
    """Steps t0 .. t1-1 of streaming_llm (``sinks[c]`` pinned positions) and sliding_window
    (``sinks[c] == 0``), closed form: before step t the cache holds everything when t <= budget,
    else positions ``0 .. sinks-1`` and the newest ``budget - sinks`` ones."""
    k = topk.shape[1]
    rec_kept = kept_hist.shape[0] > 0
    for t in range(t0, t1):
        _mark_topk(topk, t, stamp)
        denom = min(k, t)
        row = A[t]
        for c in range(budgets.shape[0]):
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
            mass[c, t - 1] = total
            recall[c, t - 1] = hits / denom
            if c == 0 and rec_kept:  # after step t: the same rule one position later
                s = sinks[c] if t + 1 > b else t + 1
                lo = t + 1 - (b - s) if t + 1 > b else t + 1
                j = 0
                for p in range(s):
                    kept_hist[t - 1, j] = p
                    j += 1
                for p in range(lo, t + 1):
                    kept_hist[t - 1, j] = p
                    j += 1


@kernel
def _future_attention(A, suffix, block, t, p_c, n, out):
    """``GreedyFuture.future_attention`` of the n slots after step t, into ``out[:n]``, bit for bit:
    the rows t+1 .. min(c * block, T) (c = ceil(t / block)) added one after another from 0.0 (numpy's
    ``sum(axis=0)`` over a (rows, n >= 2) array adds its rows in order), then added to the block
    suffix ``suffix[c, p]``. Rows outer, slots inner: the same per-slot order, read along rows."""
    T = A.shape[0] - 1
    c = (t + block - 1) // block
    for i in range(n):
        out[i] = 0.0
    for r in range(t + 1, min(c * block, T) + 1):
        row = A[r]
        for i in range(n):
            out[i] += np.float64(row[p_c[i]])
    for i in range(n):
        out[i] = suffix[c, p_c[i]] + out[i]


#: how ``_one_victim_steps`` picks a victim: the slot the plan names (random's draws), the position
#: it names (optimal's schedule), or the least attention still to come (greedy_future)
PLAN_SLOT, PLAN_POSITION, LEAST_FUTURE = 0, 1, 2


@kernel
def _one_victim_steps(A, topk, t0, t1, budgets, pick, plan, suffix, block, pos, length, mass, recall, stamp, gather,
                      future, kept_hist, victims):
    """Steps t0 .. t1-1 of a policy that holds nothing per slot but its positions and evicts one
    whenever admitting t puts the cache over its budget, for every configuration c (budget
    ``budgets[c]``). ``pick``: PLAN_SLOT, ``plan[c, t - 1]`` is a slot in kept order after admitting
    t; PLAN_POSITION, it is a position held; LEAST_FUTURE, the first minimum of the attention still
    to come over every slot, the newcomer's included (the reference's ``_evict_lowest`` over all
    ``_len`` slots), from ``suffix``, the policy's own block suffix sums (one trace: one array for
    every configuration). The plan is only read at the steps that evict."""
    k = topk.shape[1]
    rec_kept = kept_hist.shape[0] > 0
    rec_victims = victims.shape[0] > 0
    for t in range(t0, t1):
        _mark_topk(topk, t, stamp)
        denom = min(k, t)
        row = A[t]
        for c in range(budgets.shape[0]):
            n = length[c]
            p_c = pos[c]
            total, hits = _measure(row, p_c, n, stamp, t, gather)
            mass[c, t - 1] = total
            recall[c, t - 1] = hits / denom
            p_c[n] = t
            n += 1
            if n > budgets[c]:
                if pick == LEAST_FUTURE:
                    _future_attention(A, suffix, block, t, p_c, n, future)
                    best = _first_min(future, n)
                elif pick == PLAN_SLOT:
                    best = plan[c, t - 1]
                else:
                    best = np.searchsorted(p_c[:n], plan[c, t - 1])  # kept is ascending
                n = _evict(p_c, n, best, t, c == 0 and rec_victims, victims)
            length[c] = n
            if c == 0 and rec_kept:
                kept_hist[t - 1, :n] = p_c[:n]


# --------------------------------------------------------------------------------------------
# drivers: state and outputs live in NumPy arrays; the kernels run a chunk of steps at a time so
# that ``progress`` can be told between chunks


def _chunks(T: int, progress: Callable[[float], None] | None):
    for t0 in range(1, T + 1, _CHUNK):
        t1 = min(t0 + _CHUNK, T + 1)
        yield t0, t1
        if progress is not None:
            progress((t1 - 1) / T)


def _none(dtype, ndim: int) -> np.ndarray:
    """An empty record array: the kernels skip recording when given one."""
    return np.zeros((0,) * ndim, dtype=dtype)


@dataclass
class _Run:
    """What every runner allocates for a pass over the trace: the per-step series of every
    configuration, the top-k stamp, the slot arrays (positions in kept order, how many are held, a
    gather scratch), and the records of configuration 0 (empty arrays when not recording)."""

    mass: np.ndarray
    recall: np.ndarray
    stamp: np.ndarray  # stamp[p] == t: p is in row t's top k
    pos: np.ndarray
    length: np.ndarray  # every cache starts holding position 0
    gather: np.ndarray
    score_hist: np.ndarray
    score_pos: np.ndarray
    victims: np.ndarray

    @classmethod
    def alloc(cls, T: int, budgets: np.ndarray, record: frozenset, b0: int) -> _Run:
        n_cfg, width = budgets.size, int(budgets.max()) + 1
        scores, victims = "scores" in record, "victims" in record
        return cls(
            mass=np.empty((n_cfg, T), dtype=np.float64),
            recall=np.empty((n_cfg, T), dtype=np.float64),
            stamp=np.zeros(T + 1, dtype=np.int64),
            pos=np.zeros((n_cfg, width), dtype=np.int32),
            length=np.ones(n_cfg, dtype=np.int64),
            gather=np.empty(width, dtype=np.float64),
            score_hist=np.full((T, b0 + 1), np.nan) if scores else _none(np.float64, 2),
            score_pos=np.full((T, b0 + 1), -1, dtype=np.int32) if scores else _none(np.int32, 2),
            victims=np.full(T, -1, dtype=np.int64) if victims else _none(np.int64, 1),
        )

    def result(self, scores: bool = True):
        records = {"victims": self.victims}
        if scores:
            records.update(score_history=self.score_hist, score_positions=self.score_pos)
        return self.mass, self.recall, records


def _param(policies, name: str) -> np.ndarray:
    return np.array([p.params[name] for p in policies], dtype=np.int64)


def _run_h2o(A, topk, T, budgets, policies, progress, record, b0, kept_hist):
    r = _Run.alloc(T, budgets, record, b0)
    windows = _param(policies, "recent_window")
    score = np.zeros(r.pos.shape, dtype=np.float64)  # position 0 starts with score 0
    for t0, t1 in _chunks(T, progress):
        _h2o_steps(A, topk, t0, t1, budgets, windows, r.pos, score, r.length, r.mass, r.recall, r.stamp, r.gather,
                   kept_hist, r.score_hist, r.score_pos, r.victims)
    return r.result()


def _run_scissorhands(A, topk, T, budgets, policies, progress, record, b0, kept_hist):
    r = _Run.alloc(T, budgets, record, b0)
    windows, histories = _param(policies, "recent_window"), _param(policies, "history_window")
    n_cfg, width = r.pos.shape
    votes = np.zeros((n_cfg, T + 1), dtype=np.int64)  # by position: eviction moves positions only
    observed = np.zeros(n_cfg, dtype=np.int64)  # steps with attention: the history window's clock
    # voters of each observed step in the window, O(configs x history_window x budget) int32;
    # a step's voters are among the n <= budget positions held, so `width` entries suffice
    h = int(histories.max())
    ring = np.zeros((n_cfg, max(1, h), width if h else 1), dtype=np.int32)
    ring_len = np.zeros(ring.shape[:2], dtype=np.int64)
    for t0, t1 in _chunks(T, progress):
        _scissorhands_steps(A, topk, t0, t1, budgets, windows, histories, r.pos, votes, r.length, observed,
                            ring, ring_len, r.mass, r.recall, r.stamp, r.gather, kept_hist, r.score_hist, r.score_pos,
                            r.victims)
    return r.result()


def _run_h2o_normalized(A, topk, T, budgets, policies, progress, record, b0, kept_hist):
    r = _Run.alloc(T, budgets, record, b0)
    windows = _param(policies, "recent_window")
    total_ = np.zeros(r.pos.shape, dtype=np.float64)
    count = np.zeros(r.pos.shape, dtype=np.int64)
    for t0, t1 in _chunks(T, progress):
        _h2o_normalized_steps(A, topk, t0, t1, budgets, windows, r.pos, total_, count, r.length, r.mass, r.recall,
                              r.stamp, r.gather, kept_hist, r.score_hist, r.score_pos, r.victims)
    return r.result()


def _run_snapkv(A, topk, T, budgets, policies, progress, record, b0, kept_hist):
    r = _Run.alloc(T, budgets, record, b0)
    windows, obs_windows = _param(policies, "recent_window"), _param(policies, "observation_window")
    n_cfg, width = r.pos.shape
    # O(configs x budget x observation_window) float64: the weights each slot still counts
    ring = np.zeros((n_cfg, width, max(1, int(obs_windows.max()))), dtype=np.float64)
    row_of = np.tile(np.arange(width, dtype=np.int64), (n_cfg, 1))  # slot -> its ring row
    approx = np.zeros((n_cfg, width), dtype=np.float64)  # a running sum of each slot's ring row
    # |approx - the exact window sum| <= u (w + 1) (2T + w) (u = 2^-53: at most 2T updates of a sum
    # of at most w + 1 weights in [0, 1], against a w-term sequential sum); twice that, for margin
    tols = 2.3e-16 * (obs_windows + 1) * (2 * T + obs_windows + 2)
    running = np.zeros((n_cfg, width), dtype=np.float64)  # observation_window 0: the whole run
    observed = np.zeros(n_cfg, dtype=np.int64)
    scores = np.empty(width, dtype=np.float64)
    for t0, t1 in _chunks(T, progress):
        _snapkv_steps(A, topk, t0, t1, budgets, windows, obs_windows, tols, r.pos, ring, row_of, approx, running, r.length,
                      observed, r.mass, r.recall, r.stamp, r.gather, scores, kept_hist, r.score_hist, r.score_pos,
                      r.victims)
    return r.result()


def _run_tova(A, topk, T, budgets, policies, progress, record, b0, kept_hist):
    r = _Run.alloc(T, budgets, record, b0)
    weight = np.full(r.pos.shape, UNSEEN, dtype=np.float64)  # position 0: no row has shown it yet
    for t0, t1 in _chunks(T, progress):
        _tova_steps(A, topk, t0, t1, budgets, r.pos, weight, r.length, r.mass, r.recall, r.stamp, r.gather, kept_hist,
                    r.victims)
    return r.result(scores=False)


def _run_window(A, topk, T, budgets, policies, progress, record, b0, kept_hist):
    r = _Run.alloc(T, budgets, frozenset(), b0)
    sinks = np.array([p.params.get("sinks", 0) for p in policies], dtype=np.int64)  # sliding_window: no sinks
    for t0, t1 in _chunks(T, progress):
        _window_steps(A, topk, t0, t1, budgets, sinks, r.mass, r.recall, r.stamp, kept_hist)
    # the oldest unpinned position leaves once the cache is full: t - (budget - sinks)
    t = np.arange(1, T + 1)
    return r.mass, r.recall, {"victims": np.where(t >= b0, t - (b0 - int(sinks[0])), -1)}


def _run_one_victim(A, topk, T, budgets, pick, plan, suffix, progress, record, b0, kept_hist):
    r = _Run.alloc(T, budgets, record, b0)
    future = np.empty(r.pos.shape[1], dtype=np.float64)
    for t0, t1 in _chunks(T, progress):
        _one_victim_steps(A, topk, t0, t1, budgets, pick, plan, suffix, GREEDY_BLOCK, r.pos, r.length, r.mass,
                          r.recall, r.stamp, r.gather, future, kept_hist, r.victims)
    return r.result(scores=False)


#: what a pick that reads no plan or no suffix sums is given in their place
_NO_PLAN = np.zeros((0, 0), dtype=np.int64)
_NO_SUFFIX = np.zeros((0, 0), dtype=np.float64)


def _run_greedy_future(A, topk, T, budgets, policies, progress, record, b0, kept_hist):
    # the block suffix sums the policy built from the trace (one trace: the first policy's serve all)
    suffix = np.ascontiguousarray(policies[0]._suffix)
    return _run_one_victim(A, topk, T, budgets, LEAST_FUTURE, _NO_PLAN, suffix, progress, record, b0, kept_hist)


def _run_random(A, topk, T, budgets, policies, progress, record, b0, kept_hist):
    """random's victims, drawn before the replay with the very calls its ``evict`` makes, in the
    same order: the draws depend on the cache's length only, which is ``min(t, budget) + 1`` after
    admitting t, so step t >= budget draws one slot of ``budget + 1`` (kept order, as SlotPolicy
    holds them) from the policy's own generator, which is left where the reference leaves it."""
    plan = np.full((budgets.size, T), -1, dtype=np.int64)
    for c, p in enumerate(policies):
        b = p.budget
        for t in range(b, T + 1):
            plan[c, t - 1] = p.rng.choice(b + 1, size=1, replace=False)[0]
    return _run_one_victim(A, topk, T, budgets, PLAN_SLOT, plan, _NO_SUFFIX, progress, record, b0, kept_hist)


def _run_optimal(A, topk, T, budgets, policies, progress, record, b0, kept_hist):
    """optimal's schedule (solved, or read from the disk cache, as the reference does on its first
    eviction) replayed: step ``budget + i`` evicts ``victims[i]``. A schedule that is not legal
    (a victim after its step, or one evicted twice: only a damaged cache could hold one) is
    refused as the reference's victims check would refuse it."""
    plan = np.full((budgets.size, T), -1, dtype=np.int64)
    for c, p in enumerate(policies):
        if p.budget > T:  # never evicts: the reference never asks for the schedule either
            continue
        v = p.schedule.victims
        steps = np.arange(p.budget, T + 1)
        if v.shape != steps.shape or (v.size and (v.min() < 0 or np.any(v > steps) or np.unique(v).size != v.size)):
            raise ContractError(f"{p!r}: its schedule is not a legal eviction schedule for this trace")
        plan[c, p.budget - 1 :] = v
    return _run_one_victim(A, topk, T, budgets, PLAN_POSITION, plan, _NO_SUFFIX, progress, record, b0, kept_hist)


#: the policies the engine replays itself, each with its runner; every other registered policy is
#: replayed by the reference harness. A runner takes every configuration of one policy at once.
FAST = {
    "sliding_window": _run_window,
    "streaming_llm": _run_window,
    "h2o": _run_h2o,
    "scissorhands": _run_scissorhands,
    "h2o_normalized": _run_h2o_normalized,
    "snapkv": _run_snapkv,
    "tova": _run_tova,
    "random": _run_random,
    "greedy_future": _run_greedy_future,
    "optimal": _run_optimal,
}


def covers(trace: Trace, name: str) -> bool:
    """Whether the engine replays policy ``name`` on ``trace`` (else the reference harness does)."""
    return AVAILABLE and name in FAST and trace.attention.dtype in (np.float32, np.float64) and trace.steps >= 1


def _run(trace: Trace, policies: list[Policy], top_k: int, progress=None, record: frozenset = frozenset()):
    """Replay the configurations ``policies`` (built, all of one registered name) in one pass.

    Returns ``(mass, recall, records)``: float64 ``(configs, T)`` series and, with ``record``, the
    kept/score/victim histories of configuration 0."""
    A = trace.derived.kernel_attention()
    topk = trace.derived.topk(top_k)
    T = trace.steps
    budgets = np.array([p.budget for p in policies], dtype=np.int64)
    b0 = int(budgets[0])
    kept_hist = np.full((T, b0), -1, dtype=np.int32) if "kept" in record else _none(np.int32, 2)
    runner = FAST[policies[0].name]
    mass, recall, records = runner(A, topk, T, budgets, policies, progress, record, b0, kept_hist)
    records["kept_history"] = kept_hist
    return mass, recall, records


def replay(
    trace: Trace,
    policy: Policy,
    *,
    top_k: int,
    record_kept: bool = False,
    record_scores: bool = False,
    record_victims: bool = False,
    progress: Callable[[float], None] | None = None,
) -> ReplayResult:
    """The reference's ``ReplayResult`` for a freshly built ``policy`` whose name ``covers``."""
    record = frozenset(name for name, on in (("kept", record_kept), ("scores", record_scores), ("victims", record_victims))
                       if on)
    mass, recall, rec = _run(trace, [policy], top_k, progress=progress, record=record)
    keeps_scores = record_scores and policy.keeps_scores
    victims = [[int(v)] if v >= 0 else [] for v in rec["victims"]] if record_victims else []
    return ReplayResult(
        policy=policy.name,
        budget=policy.budget,
        params=dict(policy.params),
        steps=trace.steps,
        top_k=top_k,
        retained_mass_series=mass[0],
        top_k_recall_series=recall[0],
        kept_history=rec["kept_history"] if record_kept else None,
        score_history=rec["score_history"] if keeps_scores else None,
        score_positions=rec["score_positions"] if keeps_scores else None,
        victims_history=victims,
    )


def sweep(
    trace: Trace, policies: list[Policy], *, top_k: int, progress: Callable[[float], None] | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (mass, recall) series of each freshly built configuration in ``policies`` (all of one
    name that ``covers``), in batches of at most ``_BATCH`` configurations per pass over the trace.

    The batches are independent, so they run on one thread per core (the kernels release the GIL):
    each configuration's arithmetic is the same sequence whichever thread runs it, so the results
    are the serial run's bit for bit. ``progress`` is called from the calling thread only (a
    Streamlit progress bar must be), after each chunk when one thread works and after each batch
    when several do. The trace's top-k positions are computed once, by whichever thread asks
    first (the trace's store holds the others until they are there)."""
    workers = max(1, min(_WORKERS, -(-len(policies) // 8)))  # a thread earns its start-up from ~8 configs
    size = min(_BATCH, -(-len(policies) // workers))
    batches = [policies[i : i + size] for i in range(0, len(policies), size)]
    if len(batches) == 1 or workers == 1:
        out = []
        for j, batch in enumerate(batches):
            report = None if progress is None else (lambda f, j=j: progress((j + f) / len(batches)))
            mass, recall, _ = _run(trace, batch, top_k, report)
            out += list(zip(mass, recall, strict=True))
        return out
    results: list = [None] * len(batches)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(_run, trace, batch, top_k): j for j, batch in enumerate(batches)}
        for done, future in enumerate(as_completed(futures), start=1):
            mass, recall, _ = future.result()
            results[futures[future]] = list(zip(mass, recall, strict=True))
            if progress is not None:
                progress(done / len(batches))
    return [pair for part in results for pair in part]


#: roughly how long numba takes to compile one policy's kernels from nothing (two shared cores),
#: what ``prepare`` tells the user to expect
_COMPILE_SECONDS = 15


def prepare(name: str, progress: Progress | None = None) -> None:
    """Compile the kernels policy ``name`` replays with (or load them from numba's disk cache), by
    replaying it once on a tiny trace, so that the first real replay starts at once and a first run
    after an install is never silent. ``progress(None, note)`` is called, once, only when numba
    actually compiles (a cache miss: numba's ``numba:compile`` event), not when the kernels load
    from disk. A policy the engine does not replay, or no numba: nothing to do."""
    if not AVAILABLE or name not in FAST:
        return
    from numba.core import event

    note = f"compiling the {name} engine (once per install, ~{_COMPILE_SECONDS} s)"
    listener = _first_compile(None if progress is None else (lambda: progress(None, note)))
    trace = from_array(np.tril(np.ones((9, 9)), -1), name="prepare")
    # every tunable at 1 (below the budget of 4): the kernels' windowed paths are taken too
    spec = PolicySpec.of(name, 4, **{p.name: 1 for p in tunables(name)})
    with event.install_listener("numba:compile", listener):
        replay(trace, spec.build(trace), top_k=2, record_kept=True, record_scores=True, record_victims=True)
        replay(trace, spec.build(trace), top_k=2)  # snapkv's unrecorded path finds victims another way


def _first_compile(report: Callable[[], None] | None):
    """A numba event listener that calls ``report`` at the start of the first compilation it sees
    (the kernel a replay calls first; the ones it calls inside are compiled with it)."""
    from numba.core import event

    class FirstCompile(event.Listener):
        fired = False

        def on_start(self, ev) -> None:
            if not self.fired:
                self.fired = True
                if report is not None:
                    report()

        def on_end(self, ev) -> None:
            pass

    return FirstCompile()

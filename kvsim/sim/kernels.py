"""The fast engine's kernels: one step loop per policy, over every configuration of it at once, with
exactly the arithmetic of the reference policies (``kvsim.sim.harness`` and ``kvsim.policies``).
``kvsim.sim.engine`` allocates their state and calls them a chunk of steps at a time.

Why numba: the h2o loop is a sequential float64 sum over the kept set (kept order, bit for bit the
reference's ``kept_sum``), a float32 renormalisation, a score update and one argmin per step. Those
are short dependent loops over ~budget elements; a JIT runs them at machine speed with one pass of
the trace row shared by every configuration. A batched-NumPy version (one array op per step over all
configurations) was measured against it: see ``python -m kvsim bench``.

Exactness, the reference's rules restated where the kernels rely on them:

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
  rows up to the next block, added in numpy's order), optimal the solver's schedule. The three
  differ only in how the victim is picked, so one kernel replays them all (``one_victim_steps``);
- top-k recall counts ``kept`` against the k largest weights of the row (lower position first on
  ties, ``TraceStore.topk``) and divides by ``min(k, t)``; the means are numpy's, over the series.

Every step kernel takes the attention and the step its first row stands for (``A[t - a0]`` is row t:
0 for a dense trace's whole matrix, ``t0`` for a block of rows computed for these steps from a
query/key trace), the top-k positions, the step range ``t0 .. t1-1``, one budget per configuration,
its state arrays and the per-step outputs; the record arrays (kept, scores, victims) are filled for
configuration 0 only, and only when they are not empty.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policies.tova import UNSEEN


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
def h2o_steps(A, a0, topk, t0, t1, budgets, windows, pos, score, length, mass, recall, stamp, gather,
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
        row = A[t - a0]
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
def tova_steps(A, a0, topk, t0, t1, budgets, pos, weight, length, mass, recall, stamp, gather, kept_hist, victims):
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
        row = A[t - a0]
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
def scissorhands_steps(A, a0, topk, t0, t1, budgets, windows, histories, pos, votes, length, observed,
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
        row = A[t - a0]
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
def h2o_normalized_steps(A, a0, topk, t0, t1, budgets, windows, pos, total_, count, length, mass, recall, stamp, gather,
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
        row = A[t - a0]
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
def snapkv_steps(A, a0, topk, t0, t1, budgets, windows, obs_windows, tols, pos, ring, row_of, approx, running, length,
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
        row = A[t - a0]
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
def window_steps(A, a0, topk, t0, t1, budgets, sinks, mass, recall, stamp, kept_hist):
    """Steps t0 .. t1-1 of streaming_llm (``sinks[c]`` pinned positions) and sliding_window
    (``sinks[c] == 0``), closed form: before step t the cache holds everything when t <= budget,
    else positions ``0 .. sinks-1`` and the newest ``budget - sinks`` ones."""
    k = topk.shape[1]
    rec_kept = kept_hist.shape[0] > 0
    for t in range(t0, t1):
        _mark_topk(topk, t, stamp)
        denom = min(k, t)
        row = A[t - a0]
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
def one_victim_steps(A, a0, topk, t0, t1, budgets, pick, plan, suffix, block, pos, length, mass, recall, stamp, gather,
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
        row = A[t - a0]
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
                    _future_attention(A, a0, suffix, block, t, p_c, n, future)
                    best = _first_min(future, n)
                elif pick == PLAN_SLOT:
                    best = plan[c, t - 1]
                else:
                    best = np.searchsorted(p_c[:n], plan[c, t - 1])  # kept is ascending
                n = _evict(p_c, n, best, t, c == 0 and rec_victims, victims)
            length[c] = n
            if c == 0 and rec_kept:
                kept_hist[t - 1, :n] = p_c[:n]

"""The fast engine's kernels: one step loop (``_slot_steps``: measure, observe, admit, record, evict)
over every configuration of a policy at once, specialised per policy by the few hooks in which
policies differ, with exactly the arithmetic of the reference policies (``kvsim.sim.harness`` and
``kvsim.policies``). ``kvsim.sim.engine`` allocates the shared arrays, asks a policy's ``SlotKernel``
for its own state and calls its specialised loop a chunk of steps at a time.

Why a specialisation per policy rather than hooks passed as arguments: numba compiles a jitted
function taken as an argument into its caller, but keys its disk cache by the argument's type, which
differs in every process, so every process compiled again (tried on numba 0.68). ``slot_kernel``
instead makes, from the one loop's code, a function whose globals name the policy's hooks, under the
policy's own name (``h2o_steps``): numba inlines the hooks as it does any kernel's callees, and caches
each specialisation beside this file under that name.

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
  differ only in how the victim is picked, so one specialisation replays them all (``one_victim_steps``);
- streaming_llm and sliding_window evict the oldest unpinned position, slot ``sinks`` in kept order,
  once the cache is over its budget;
- top-k recall counts ``kept`` against the k largest weights of the row (lower position first on
  ties, ``TraceStore.topk``) and divides by ``min(k, t)``; the means are numpy's, over the series.

Every specialisation takes the attention and the step its first row stands for (``A[t - a0]`` is row t:
0 for a dense trace's whole matrix, ``t0`` for a block of rows computed for these steps from a
query/key trace), the top-k positions, the step range ``t0 .. t1-1``, one budget per configuration,
the slot arrays, the per-step outputs, the record arrays (kept, scores, victims: filled for
configuration 0 only, and only when they are not empty) and the policy's state, a tuple its hooks
unpack.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..jit import kernel
from ..policies.greedy_future import BLOCK as GREEDY_BLOCK
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
    """Close the gap that evicting slot ``best`` of the ``n`` in use leaves (kept order is kept).
    Copied between two views rather than ``slots[i] = slots[i + 1]``: LLVM vectorises this form, and the
    window policies, whose step is little more than this shift, ran 1.7-1.8x slower than their old closed form
    with the other."""
    src = slots[best + 1 : n]
    dst = slots[best : n - 1]
    for i in range(n - 1 - best):
        dst[i] = src[i]


@kernel
def _evict(p_c, n, best, t, record, victims):
    """Evict slot ``best`` of the ``n`` held (the new length); ``victims[t - 1]`` gets its position
    when ``record``."""
    if record:
        victims[t - 1] = p_c[best]
    _drop(p_c, best, n)
    return n - 1


def _slot_steps(A, a0, topk, t0, t1, budgets, pos, length, mass, recall, stamp, gather, kept_hist, score_hist,
                score_pos, victims, state):
    """Steps t0 .. t1-1 of one policy for every configuration c (budget ``budgets[c]``), the positions
    held in ``pos[c, :length[c]]`` (kept order), the policy's own per-slot state in ``state``. The one
    step loop: each specialisation (``slot_kernel``) runs this code with its policy's hooks as the
    globals ``measure``, ``observe``, ``admit``, ``score``, ``pick`` and ``drop``."""
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
            total, hits = measure(state, c, t, row, p_c, n, stamp, gather)  # noqa: F821 - a specialisation's global
            mass[c, t - 1] = total
            recall[c, t - 1] = hits / denom
            observe(state, c, p_c, n, gather, total)  # noqa: F821
            p_c[n] = t
            admit(state, c, p_c, n)  # noqa: F821
            n += 1
            scored = c == 0 and rec_scores
            if scored:
                for i in range(n):
                    score_hist[t - 1, i] = score(state, c, p_c, i)  # noqa: F821
                    score_pos[t - 1, i] = p_c[i]
            if n > budgets[c]:
                best = pick(state, c, t, p_c, n, A, a0, scored)  # noqa: F821
                drop(state, c, best, n)  # noqa: F821
                n = _evict(p_c, n, best, t, c == 0 and rec_victims, victims)
            length[c] = n
            if c == 0 and rec_kept:
                kept_hist[t - 1, :n] = p_c[:n]


class Shape(NamedTuple):
    """What a policy's state is sized by: configurations, slots per configuration (the largest budget
    plus one) and steps of the trace."""

    configs: int
    width: int
    steps: int


@dataclass(frozen=True)
class SlotKernel:
    """A policy's fast replay: the step loop specialised with its hooks, and how to allocate the state
    those hooks read. What a policy's ``EngineBinding`` names ("kvsim.sim.kernels:H2O")."""

    #: the specialised step loop (``kvsim.jit.kernel``), the signature of ``_slot_steps``
    steps: Callable
    #: ``state(shape, **engine_inputs)``: the tuple the hooks unpack; its keyword arguments are exactly
    #: what the policy's ``engine_inputs`` gives
    state: Callable[..., tuple]


_TEMPLATE_GLOBALS = {name: _slot_steps.__globals__[name] for name in _slot_steps.__code__.co_names
                     if name in _slot_steps.__globals__}
_SPECIALISED: set[str] = set()


def slot_kernel(name: str, state: Callable[..., tuple], *, measure=None, observe=None, admit=None, score=None,
                pick, drop=None) -> SlotKernel:
    """The step loop specialised for one policy, compiled (and cached on disk) as ``name``. Hooks,
    each a ``kvsim.jit.kernel`` taking the state tuple and configuration ``c``:

    - ``measure(state, c, t, row, p_c, n, stamp, gather)``: ``(total, hits)``, the kept mass of row t and
      how many of the ``n`` held are in its top k (``stamp[p] == t``); by default ``_measure``, which
      also gathers their weights for ``observe``;
    - ``observe(state, c, p_c, n, gather, total)``: the row seen by the ``n`` slots held, ``gather[:n]``
      their float64 weights, ``total`` their sum (0: a row of zeros);
    - ``admit(state, c, p_c, n)``: slot ``n`` is the newcomer (``p_c[n]`` its position);
    - ``score(state, c, p_c, i)``: slot i's score, for the scores record (configuration 0 of a policy
      that ``keeps_scores`` only);
    - ``pick(state, c, t, p_c, n, A, a0, scored)``: the slot to evict of the ``n`` held after admitting
      t (``scored``: ``score`` was just asked of every slot this step);
    - ``drop(state, c, best, n)``: close slot ``best``'s gap in the policy's per-slot state.

    Left out: nothing to do (``score``: 0). ``name`` is the file numba caches it under: one per
    specialisation."""
    if name in _SPECIALISED:
        raise ValueError(f"a step loop named {name!r} exists already: numba's disk cache would mix the two")
    _SPECIALISED.add(name)
    hooks = {"measure": measure or _measure_held, "observe": observe or _nothing_observed, "admit": admit or _nothing_admitted,
             "score": score or _no_score, "pick": pick, "drop": drop or _nothing_dropped}
    name = f"{name}_{_sources_digest([*hooks.values(), *_TEMPLATE_GLOBALS.values()])}"
    fn = types.FunctionType(_slot_steps.__code__, {**_TEMPLATE_GLOBALS, **hooks}, name)
    fn.__qualname__ = name
    fn.__module__ = __name__
    fn.__doc__ = f"{name}: ``_slot_steps`` with the hooks of ``slot_kernel``."
    return SlotKernel(kernel(fn), state)


def _sources_digest(fns) -> str:
    """A digest of the source files of ``fns`` and of every function or kernel they name, transitively,
    this file included: part of a specialisation's name, so its numba cache entry is another one when any
    of them changes. numba keys a cached function by its own file's time stamp alone (this file, for
    every specialisation), so a hook edited in a policy's module, or a helper it calls, would otherwise
    run as its old compiled code."""
    seen, files, todo = set(), set(), list(fns)
    while todo:
        f = todo.pop()
        f = getattr(f, "py_func", f)  # a kvsim kernel: the function numba compiles
        if not isinstance(f, types.FunctionType) or f in seen:
            continue
        seen.add(f)
        files.add(f.__code__.co_filename)
        names = [n for code in (f.__code__, *(c for c in f.__code__.co_consts if isinstance(c, types.CodeType)))
                 for n in code.co_names]
        todo += [g for n in names if callable(g := f.__globals__.get(n))]
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:10]


@kernel
def _measure_held(state, c, t, row, p_c, n, stamp, gather):
    return _measure(row, p_c, n, stamp, t, gather)


@kernel
def _nothing_observed(state, c, p_c, n, gather, total):
    pass


@kernel
def _nothing_admitted(state, c, p_c, n):
    pass


@kernel
def _no_score(state, c, p_c, i):
    return 0.0


@kernel
def _nothing_dropped(state, c, best, n):
    pass


def _slots(shape: Shape, fill, dtype) -> np.ndarray:
    return np.full((shape.configs, shape.width), fill, dtype=dtype)


# --------------------------------------------------------------------------------------------
# h2o: a cumulative score per slot, evicting the first minimum outside the recent window


@kernel
def _h2o_observe(state, c, p_c, n, gather, total):
    s_c = state[1][c]
    if total > 0:
        for i in range(n):
            s_c[i] += np.float64(np.float32(gather[i] / total))


@kernel
def _h2o_admit(state, c, p_c, n):
    state[1][c, n] = 0.0  # the newcomer starts with score 0


@kernel
def _h2o_score(state, c, p_c, i):
    return state[1][c, i]


@kernel
def _h2o_pick(state, c, t, p_c, n, A, a0, scored):
    windows, score = state
    return _first_min(score[c], n - windows[c])


@kernel
def _h2o_drop(state, c, best, n):
    _drop(state[1][c], best, n)


def _h2o_state(shape: Shape, windows):
    return windows, _slots(shape, 0.0, np.float64)


H2O = slot_kernel("h2o_steps", _h2o_state, observe=_h2o_observe, admit=_h2o_admit, score=_h2o_score, pick=_h2o_pick,
                  drop=_h2o_drop)
h2o_steps = H2O.steps


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

"""The fast engine's step loop: one loop (``_slot_steps``: measure, observe, admit, record, evict)
over every configuration of a policy at once, specialised per policy by the few hooks in which
policies differ, with exactly the arithmetic of the reference policies (``kvsim.sim.harness`` and
``kvsim.policies``). ``kvsim.sim.engine`` allocates the shared arrays, asks a policy's ``SlotKernel``
for its own state and calls its specialised loop a chunk of steps at a time.

This module holds the loop and the machinery that specialises it; what a policy's hooks are made of (its
``SlotHooks``, the ``Shape`` its state is sized by, the helpers hooks share: ``_first_min``, ``_first_max``, ``_drop``,
``_slots``) is in ``kvsim.policykit.slot_hooks``, so that a policy declares its hooks beside it without
importing the simulator. Each policy's hooks sit beside it, in its own module of ``kvsim.policies``
(h2o's in ``kvsim.policies.h2o``, declared as its ``SlotHooks``, ``STEPS``; streaming_llm's serve
sliding_window too, vatp's critical), and its docstring states the rules its hooks keep.

Why a specialisation per policy rather than hooks passed as arguments: numba compiles a jitted
function taken as an argument into its caller, but keys its disk cache by the argument's type, which
differs in every process, so every process compiled again (tried on numba 0.68). ``slot_kernel``
instead makes, from the one loop's code, a function whose globals name the policy's hooks, under the
policy's own name and a digest of every file the hooks reach (``h2o_steps_<digest>``): numba inlines
the hooks as it does any kernel's callees, and caches each specialisation beside this file under that
name, so editing a hook's module compiles that policy's loop afresh and no other.

Why numba: the h2o loop is a sequential float64 sum over the kept set (kept order, bit for bit the
reference's ``kept_sum``), a float32 renormalisation, a score update and one argmin per step. Those
are short dependent loops over ~budget elements; a JIT runs them at machine speed with one pass of
the trace row shared by every configuration. A batched-NumPy version (one array op per step over all
configurations) was measured against it: see ``python -m kvsim bench``.

Exactness, the reference's rules the loop keeps (each hook module states its policies' own):

- kept is ascending by position (a new position is admitted last; eviction keeps the order);
- retained mass is ``sum(float64(A[t, kept]))`` added strictly in kept order;
- eviction (at most one victim per step under the harness) is a first minimum (``_first_min``), so
  equal scores evict the lower position;
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

import threading
import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..jit import kernel, sources_digest
from ..policykit.slot_hooks import Shape as Shape
from ..policykit.slot_hooks import SlotHooks, _drop, _nothing_admitted, _nothing_dropped, _nothing_observed


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


@dataclass(frozen=True)
class SlotKernel:
    """A policy's fast replay: the step loop specialised with its hooks, and how to allocate the state
    those hooks read. What a policy's ``EngineBinding`` gives the engine, made from its ``SlotHooks``."""

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
    specialisation, with a digest of every file the hooks reach (``h2o_steps_<digest>``), the name it has
    in this module too, where its ``__module__`` and ``__qualname__`` say it is."""
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
    steps = globals()[name] = kernel(fn)
    return SlotKernel(steps, state)


#: a digest of the source files of the hooks and every function or kernel they name, transitively, this
#: file included: part of a specialisation's name, so its numba cache entry is another one when any of them
#: changes. numba keys a cached function by its own file's time stamp (this file, for every specialisation)
#: and its bytecode (the one loop's), so a hook edited in its module, or a helper it calls, would otherwise
#: run as its old compiled code
_sources_digest = sources_digest


@kernel
def _measure_held(state, c, t, row, p_c, n, stamp, gather):
    return _measure(row, p_c, n, stamp, t, gather)


@kernel
def _no_score(state, c, p_c, i):
    return 0.0


_MADE: dict[SlotHooks, SlotKernel] = {}
_made_lock = threading.Lock()


def specialise(hooks: SlotHooks) -> SlotKernel:
    """The step loop specialised with a policy's ``SlotHooks`` (``slot_kernel``, the same arguments), made
    once in a process: what the engine replays a policy whose ``EngineBinding`` declares its hooks with."""
    with _made_lock:
        if hooks not in _MADE:
            _MADE[hooks] = slot_kernel(hooks.name, hooks.state, measure=hooks.measure, observe=hooks.observe,
                                       admit=hooks.admit, score=hooks.score, pick=hooks.pick, drop=hooks.drop)
        return _MADE[hooks]

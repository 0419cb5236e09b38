"""The exact offline optimum: the eviction schedule with the largest retained mass any policy could
reach under the cache's rules (docs/domain.md), found exactly, with a certificate.

An OFFLINE REFERENCE (registry name ``optimal``): it is given the whole trace (``trace=``, future
rows included), solves for the schedule once, and replays it through the normal harness. No serving
stack can run it; it is the ceiling every other policy's number is measured against.

The formulation, and why it is exact
------------------------------------
The cache starts holding [0], admits position t at step t, evicts down to ``min(t + 1, budget)``
after each step and never re-admits. So from step ``budget`` on, every step evicts exactly one
position (B + 1 held after admitting t, B after eviction), and before it none. A schedule is
therefore nothing but a choice, for each step ``t = budget .. T``, of a victim ``p <= t`` that no
earlier step chose; and *every* such choice is a legal schedule (t + 1 admitted so far, t - budget
evicted before, so exactly B + 1 candidates, the victim among them). Evicting p at step t forfeits
``R[t, p]``, the attention rows t + 1 .. T still put on p; everything else is kept. Hence

    total retained mass = sum_p R[p, p]  -  sum_t R[t, victim(t)]

and the best schedule is a minimum-cost assignment of steps to victims: rows ``t = budget .. T``,
columns ``p = 0 .. T``, an edge when ``p <= t`` (each row matched once, each column at most once).
That is the issue's min-cost flow with the chains contracted: a position's chain can only be left
once, so its whole contribution is decided by the step it leaves at.

The solver: the Hungarian method with shortest augmenting paths (Dijkstra on reduced costs),
adding the rows in step order and stopping each search at the first free column. Row t can reach
only columns ``p <= t``, and the rows already matched are earlier steps, so the search for step t
stays inside positions ``0 .. t``; a free column is a position still held. After each row the
partial assignment is optimal for the steps so far (the standard invariant), so the final one is
optimal for the trace.

The certificate: dual potentials ``u[t]`` (per step) and ``w[p] <= 0`` (per position) with
``R[t, p] - u[t] - w[p] >= 0`` on every edge. For any legal schedule, its forfeited attention is
``sum_t R[t, victim(t)] >= sum_t u[t] + sum_p w[p]`` (weak duality), so the schedule found, whose
cost equals that sum, is optimal. ``certify`` recomputes every reduced cost from the trace and
returns the proven gap (0 up to rounding); tests check it and compare with exhaustive search.

Cost: O(T^2) memory for ``R`` (float64, packed lower triangle of the evicting rows; 67 MB at 4096
steps and budget 256), and per step a Dijkstra search
of O(k * t) for the k columns it visits (evicted positions it reconsiders). Worst case O(T^3) like
any assignment solver. Measured at budget 256 and 4096 steps: k is about 25 on the canonical trace
(0.4 s) and about T / 7 on the gemma3 traces (8-10 s of CPU); a general min-cost-flow solver took
120 s at 2048 steps.

Ties: among optimal schedules, the one this solver finds (the search takes the lowest position
among equal distances); the policy's victims come back in ascending order (one per step).

Results are cached on disk (``kvsim.data.store.cache_dir()``), keyed by a hash of the attention's bytes,
the budget and ``SOLVER_VERSION``, so the app and the CLI solve a trace at a budget once.

Its fast path is declared here too (``STEPS``, just above the policy): the hook with which the
engine's one step loop (``kvsim.sim.kernels``) replays the schedule, the position each step evicts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.files import atomic_write
from ..data.store import cache_dir
from ..data.trace import Trace
from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, ContractError, Display, EngineBinding, Policy, check_budget
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks

#: bump when the solver's output for a given trace and budget could change (invalidates the cache)
SOLVER_VERSION = 1
#: steps per kernel call: the granularity of ``progress`` reports
_CHUNK = 64
#: traces shorter than this are solved in milliseconds and never written to the disk cache (the
#: contract tests would otherwise leave a file per random trace)
CACHE_MIN_STEPS = 512


def _row_offsets(first: int, n: int) -> np.ndarray:
    """Where row s (``first <= s < n``) of the packed cost triangle starts: row s holds ``s + 1``
    entries (positions 0 .. s), so ``off[s] = sum(r + 1 for r in first .. s - 1)``. Rows before the
    first evicting step are never read and not stored: (T^2 - B^2) / 2 float64 in all."""
    off = np.zeros(n + 1, dtype=np.int64)
    sizes = np.arange(n, dtype=np.int64) + 1
    sizes[:first] = 0
    np.cumsum(sizes, out=off[1:])
    return off


@kernel
def _suffix_costs(A, first, off, R, diag):
    """Row s of ``R`` (packed, for s >= first): ``R[s, p] = sum(A[s + 1 .. T, p])`` in float64 for
    ``p <= s``, the attention still to come on p after step s, which evicting p at step s forfeits;
    ``diag[p] = R[p, p]`` for every p, all the attention p can ever receive. One running column sum
    added from the last row back, so every entry is the same float64 sum however it is stored."""
    n = A.shape[0]
    cur = np.zeros(n)
    for s in range(n - 1, -1, -1):
        if s < n - 1:
            for p in range(s + 1):
                cur[p] += np.float64(A[s + 1, p])
        diag[s] = cur[s]
        if s >= first:
            o = off[s]
            for p in range(s + 1):
                R[o + p] = cur[p]


@kernel
def _augment(R, off, t0, t1, match_col, match_row, u, w, dist, pred, todo):
    """Add steps t0 .. t1-1 (each evicts one position) to the optimal assignment, one shortest
    augmenting path each. ``match_row[t]``: the victim of step t; ``match_col[p]``: the step that
    evicts p, or -1 while p is held. Returns the number of columns the searches finalized.

    Dense Dijkstra: ``todo[:n_todo]`` are the columns not yet finalized; one pass over them both
    relaxes the edges of the row just reached and finds the next nearest column (the lowest
    position on ties)."""
    visited_total = 0
    for t in range(t0, t1):
        n = t + 1  # columns 0 .. t
        bd = np.inf
        bi = -1
        for p in range(n):
            d = R[off[t] + p] - w[p]  # u[t] starts at 0
            dist[p] = d
            pred[p] = t
            todo[p] = p
            if d < bd:
                bd = d
                bi = p
        n_todo = n
        while True:
            j = todo[bi]
            n_todo -= 1
            todo[bi] = todo[n_todo]
            todo[n_todo] = j  # finalized columns collect at the tail
            if match_col[j] < 0:
                break
            s = match_col[j]
            base = dist[j] - u[s]
            o = off[s]
            bd = np.inf
            bi = -1
            bp = n
            for i in range(n_todo):
                q = todo[i]
                d = dist[q]
                if q <= s:
                    nd = base + R[o + q] - w[q]
                    if nd < d:
                        d = nd
                        dist[q] = nd
                        pred[q] = s
                if d < bd or (d == bd and q < bp):
                    bd = d
                    bi = i
                    bp = q
        end = j
        D = dist[end]
        n_done = n - n_todo
        visited_total += n_done
        # potentials: every finalized column j drops by D - dist[j], its row rises by as much,
        # which keeps matched edges tight and every reduced cost non-negative
        u[t] += D
        for i in range(n_todo, n):
            j = todo[i]
            if j != end:
                delta = D - dist[j]
                w[j] -= delta
                u[match_col[j]] += delta
        # flip the path: end <- pred[end] (a row) <- its old column <- ... <- t
        j = end
        while True:
            s = pred[j]
            prev = match_row[s]
            match_row[s] = j
            match_col[j] = s
            if s == t:
                break
            j = prev
    return visited_total


@dataclass(frozen=True)
class OptimalSchedule:
    """The solver's answer for one trace and budget.

    ``victims[i]`` is the position evicted at step ``budget + i`` (empty when nothing is ever
    evicted); ``objective`` the total retained mass summed over the T steps (float64), so the mean
    retained mass is ``objective / steps``; ``u`` and ``w`` the dual potentials (the certificate)."""

    steps: int
    budget: int
    victims: np.ndarray  # int64, one per step budget .. T
    objective: float
    u: np.ndarray  # float64, one per step budget .. T
    w: np.ndarray  # float64, one per position 0 .. T, all <= 0
    seconds: float = 0.0  # time the solve took (0 when read from the cache)
    visited: int = 0  # columns the Dijkstra searches visited, a measure of the work done

    @property
    def retained_mass(self) -> float:
        return self.objective / self.steps if self.steps else 0.0

    def evicted_at(self) -> np.ndarray:
        """int64 per position 0 .. T: the step that evicts it, or T + 1 if it is never evicted."""
        out = np.full(self.steps + 1, self.steps + 1, dtype=np.int64)
        out[self.victims] = np.arange(self.budget, self.budget + self.victims.size)
        return out


def solve(trace: Trace, budget: int, progress: Callable[[float], None] | None = None) -> OptimalSchedule:
    """The optimal schedule of ``trace`` at ``budget``, computed now (no cache). ``progress(fraction)``
    is called with the share of the evicting steps done, between chunks of steps (the package's one
    progress signature)."""
    budget = check_budget(budget)
    start = time.perf_counter()
    A = trace.derived.kernel_attention()
    T = trace.steps
    n = T + 1
    first = budget  # the first step that evicts
    total = max(0, T - first + 1)
    if total == 0:  # nothing is ever evicted: every position is held for every later step
        objective = float(_column_totals(A).sum())
        return OptimalSchedule(T, budget, np.zeros(0, np.int64), objective, np.zeros(0), np.zeros(n),
                               time.perf_counter() - start)
    off = _row_offsets(first, n)
    R = np.empty(int(off[n]), dtype=np.float64)
    diag = np.empty(n, dtype=np.float64)
    _suffix_costs(A, first, off, R, diag)
    match_col = np.full(n, -1, dtype=np.int64)
    match_row = np.full(n, -1, dtype=np.int64)
    u = np.zeros(n, dtype=np.float64)
    w = np.zeros(n, dtype=np.float64)
    dist = np.empty(n, dtype=np.float64)
    pred = np.empty(n, dtype=np.int64)
    todo = np.empty(n, dtype=np.int64)
    visited = 0
    if progress is not None:
        progress(0.0)
    for t0 in range(first, T + 1, _CHUNK):
        t1 = min(t0 + _CHUNK, T + 1)
        visited += int(_augment(R, off, t0, t1, match_col, match_row, u, w, dist, pred, todo))
        if progress is not None:
            progress((t1 - first) / total)
    victims = match_row[first:].copy()
    forfeited = float(R[off[first:n] + victims].sum())
    objective = float(diag.sum()) - forfeited
    return OptimalSchedule(T, budget, victims, objective, u[first:].copy(), w.copy(),
                           time.perf_counter() - start, visited)


def _legal(victims: np.ndarray, budget: int) -> bool:
    """Whether ``victims`` (one per step ``budget ..``) is a legal schedule: each victim a position
    already admitted at its step, none evicted twice."""
    steps = np.arange(budget, budget + victims.size)
    return not victims.size or bool(victims.min() >= 0 and np.all(victims <= steps) and np.unique(victims).size == victims.size)


def _column_totals(A: np.ndarray) -> np.ndarray:
    """Per position p, the attention rows p + 1 .. T put on it (float64)."""
    return np.tril(A.astype(np.float64), -1).sum(axis=0)


def certify(trace: Trace, schedule: OptimalSchedule) -> float:
    """Check the schedule and its dual certificate against the trace; the proven gap in retained
    mass (mean over the steps): the schedule is within this of the best legal schedule.

    Checks that the victims form a legal schedule (victim of step t is <= t, none twice), that its
    forfeited attention gives ``objective``, and that the duals are feasible: ``w <= 0`` and every
    reduced cost ``R[t, p] - u[t] - w[p]`` is non-negative up to rounding. By weak duality every
    legal schedule forfeits at least ``sum(u) + sum(w) - rows * max(0, -min reduced cost)``.
    Raises ``ValueError`` naming what fails."""
    A = trace.derived.kernel_attention()
    T, B = trace.steps, schedule.budget
    if schedule.steps != T:
        raise ValueError(f"certificate: schedule is for {schedule.steps} steps, trace has {T}")
    steps = np.arange(B, T + 1)
    v = np.asarray(schedule.victims, dtype=np.int64)
    if v.shape != steps.shape:
        raise ValueError(f"certificate: {v.size} victims for {steps.size} evicting steps")
    if not _legal(v, B):
        raise ValueError("certificate: victims are not a legal schedule (a victim after its step, or evicted twice)")
    n = T + 1
    first = min(B, n)
    off = _row_offsets(first, n)
    R = np.empty(int(off[n]), dtype=np.float64)
    diag = np.empty(n, dtype=np.float64)
    _suffix_costs(A, first, off, R, diag)
    cost = float(R[off[steps] + v].sum()) if v.size else 0.0
    objective = float(diag.sum()) - cost
    if not np.isclose(objective, schedule.objective, rtol=0, atol=1e-9 * max(1, T)):
        raise ValueError(f"certificate: the victims give {objective!r}, the schedule says {schedule.objective!r}")
    if v.size == 0:
        return 0.0
    u, w = np.asarray(schedule.u, np.float64), np.asarray(schedule.w, np.float64)
    if u.shape != steps.shape or w.shape != (T + 1,):
        raise ValueError("certificate: dual potentials have the wrong shape")
    if w.max() > 1e-12:
        raise ValueError(f"certificate: a position potential is positive ({w.max()!r})")
    worst = 0.0
    for i, t in enumerate(steps):  # row by row: O(T) memory beyond R
        worst = max(worst, float(-(R[off[t] : off[t] + t + 1] - u[i] - w[: t + 1]).min()))
    lower = float(u.sum() + np.minimum(w, 0).sum()) - steps.size * worst
    return max(0.0, cost - lower) / T


# --------------------------------------------------------------------------------------------
# the disk cache


def cache_file(trace: Trace, budget: int) -> Path:
    return cache_dir() / f"optimal-v{SOLVER_VERSION}-{trace.fingerprint}-b{budget}.npz"


def cached(trace: Trace, budget: int) -> OptimalSchedule | None:
    """The schedule from the disk cache, or None when it is not (yet) known: lets a caller show
    "not yet known" without blocking on a solve. Always None below ``CACHE_MIN_STEPS`` steps, where
    solving takes milliseconds and nothing is written."""
    return _load(cache_file(trace, check_budget(budget)), trace.steps, budget)


def _load(path: Path, steps: int, budget: int) -> OptimalSchedule | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            victims, u, w = z["victims"].astype(np.int64), z["u"].astype(np.float64), z["w"].astype(np.float64)
            objective = float(z["objective"])
            if int(z["steps"]) != steps or int(z["budget"]) != budget:
                return None
    except (OSError, EOFError, ValueError, KeyError, TypeError):  # missing or damaged: solve again
        return None
    evicting = max(0, steps - budget + 1)
    if victims.shape != (evicting,) or u.shape != (evicting,) or w.shape != (steps + 1,):
        return None
    if evicting and (victims.min() < 0 or np.any(victims > np.arange(budget, steps + 1))):
        return None
    return OptimalSchedule(steps, budget, victims, objective, u, w)


def _save(path: Path, s: OptimalSchedule) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: np.savez(f, victims=s.victims, u=s.u, w=s.w, objective=np.float64(s.objective),
                                               steps=np.int64(s.steps), budget=np.int64(s.budget)))
    except OSError:  # an unwritable cache costs a re-solve next time, nothing else
        pass


def optimal_schedule(
    trace: Trace, budget: int, progress: Callable[[float], None] | None = None, use_cache: bool = True
) -> OptimalSchedule:
    """The optimal schedule, from the disk cache when it is there, else solved (and cached)."""
    budget = check_budget(budget)
    use_cache = use_cache and trace.steps >= CACHE_MIN_STEPS
    if use_cache:
        path = cache_file(trace, budget)
        hit = _load(path, trace.steps, budget)
        if hit is not None:
            if progress is not None:
                progress(1.0)
            return hit
    schedule = solve(trace, budget, progress)
    if use_cache:
        _save(path, schedule)
    return schedule


# --------------------------------------------------------------------------------------------
# the policy


# --------------------------------------------------------------------------------------------
# the fast path: nothing per slot but the positions; ``state[0]``: the schedules, ``plan[c, t - 1]`` the
# position step t evicts (``Optimal.engine_inputs``), one victim per step from step ``budget`` on


@kernel
def _optimal_pick(state, c, t, p_c, n, A, a0, scored):
    """The slot of the position the schedule evicts at step t: a position held (kept is ascending)."""
    return np.searchsorted(p_c[:n], state[0][c, t - 1])


def _optimal_state(shape: Shape, plan):
    return (plan,)


#: optimal's hooks of the engine's step loop, which its ``engine_binding`` names
STEPS = SlotHooks("optimal_steps", _optimal_state, pick=_optimal_pick)


@register
class Optimal(Policy):
    """Replays the optimal schedule (see the module docstring) through the harness: at step t it
    admits t and, from step ``budget`` on, evicts the one position the schedule evicts at t.

    The schedule is solved (or read from the disk cache) on first use, not at construction, so
    building the policy to validate its settings costs nothing; ``schedule`` forces it."""

    name = "optimal"
    order = 150
    summary = "the best eviction schedule under the cache's rules, solved exactly from the whole trace: the ceiling for any policy"
    display = Display("#4d4d4d", "2px,3px,2px,3px,2px,8px", 3)
    engine_binding = EngineBinding(STEPS)
    needs_trace = True
    optimum = True
    needs_matrix = True  # the solver's suffix costs are O(T^2): 4 GB of float64 at 32k steps

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        rng: np.random.Generator | None = None,
        trace: Trace | None = None,
    ) -> None:
        super().__init__(budget, rng)
        if not isinstance(trace, Trace):
            raise ValueError("trace: optimal is an offline reference and needs the whole trace (trace=...)")
        self._trace = trace
        self._schedule: OptimalSchedule | None = None
        self._evicted_at: np.ndarray | None = None
        self._steps = trace.steps
        self._kept = np.zeros(1, dtype=np.int64)
        self._step = 0

    @classmethod
    def engine_inputs(cls, policies, steps):
        """The schedules, as ``plan[c, t - 1]``: the position step t evicts (-1 before ``budget``),
        solved or read from the disk cache as the reference does on its first eviction. A schedule
        that is not legal (only a damaged cache could hold one) is refused as the reference's
        victims check would refuse it."""
        plan = np.full((len(policies), steps), -1, dtype=np.int64)
        for c, p in enumerate(policies):
            if p.budget > steps:  # never evicts: the reference never asks for the schedule either
                continue
            v = p.schedule.victims
            if v.shape != (steps - p.budget + 1,) or not _legal(v, p.budget):
                raise ContractError(f"{p!r}: its schedule is not a legal eviction schedule for this trace")
            plan[c, p.budget - 1 :] = v
        return {"plan": plan}

    @property
    def schedule(self) -> OptimalSchedule:
        """The schedule this policy replays, solved (or read from the disk cache) on first use."""
        if self._schedule is None:
            self._schedule = optimal_schedule(self._trace, self.budget)
            self._evicted_at = self._schedule.evicted_at()
        return self._schedule

    @property
    def kept(self) -> np.ndarray:
        return self._kept.copy()

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        if self._kept.size == self.budget + 1:
            raise RuntimeError(f"{self.name}: cache full ({self._kept.size}); evict before the next step")
        if pos != self._step + 1 or pos > self._steps:
            raise ValueError(f"{self.name}: position {pos} is not step {self._step + 1} of the {self._steps}-step trace")
        self._kept = np.append(self._kept, pos)
        self._step = pos

    def evict(self, budget: int) -> list[int]:
        if budget != self.budget:
            raise ValueError(f"{self.name}: the schedule was solved for budget {self.budget}, not {budget}")
        if self._kept.size <= budget:
            return []
        _ = self.schedule  # solved (or read from the cache) at the first eviction, not before
        gone = self._evicted_at[self._kept] <= self._step
        victims = self._kept[gone].tolist()
        self._kept = self._kept[~gone]
        return victims

"""The exact offline optimum under blocks (issue 45, item 3): the best schedule of whole-block
evictions, found exactly by the same assignment solver as ``optimal``, with a certificate.

Not a registered policy: an offline reference, like ``upper_bound``. ``block_schedule(trace, budget,
block_size)`` returns the schedule (which block each evicting step evicts) and its retained mass,
measured as the harness measures any kept set, so it stands beside every policy's figure. Its gap to
``optimal`` at the same budget is what the page layout itself costs, whatever the policy.

The layout (docs/domain.md, "What a serving engine allows")
----------------------------------------------------------
Block size ``s``: positions ``[j s, (j + 1) s)`` form block ``j``. The cache is ``nb = budget // s``
blocks (a budget that is no multiple of ``s`` is rounded down to ``nb s`` positions, and the returned
``note`` says so; a block larger than the budget is refused). The newest block is the one filling:
it holds fewer than ``s`` admitted positions and is never evicted. A block is *complete* once its
``s``-th position is admitted; only complete blocks are evicted, whole.

The timing, in the harness's order (docs/domain.md, "The harness"; ``kvsim.sim.harness.steps``):
at step ``t`` (1) query ``t`` sees the held positions, all ``< t``, and is scored on them; (2)
position ``t`` is admitted into block ``t // s``; (3) if ``t`` opens a block (``t = j s``, ``j >=
1``) and the cache already holds ``nb`` blocks, one complete block is evicted. Position 0 opens block
0 before decoding. So an eviction at step ``t`` is felt from query ``t + 1`` on, as every eviction
in the harness.

The correspondence, and why it is exact
---------------------------------------
Nothing is re-admitted and attention is non-negative, so evicting only when forced loses nothing.
Blocks ``0 .. j - 1`` exist when block ``j`` opens, so the cache is first full when block ``nb``
opens, and from then on every opening evicts exactly one block and none other does: the evicting
steps are ``t = j s`` for ``j = nb .. J``, ``J = T // s``, one row each. At row ``j`` the candidates
are the held complete blocks: with ``s > 1``, the held ones among ``0 .. j - 1`` (block ``j`` holds
only ``t``: filling); with ``s = 1`` every block is complete on admission, so among ``0 .. j``, the
newly admitted position included, exactly the rules without blocks. Write ``lag = 1`` if ``s > 1``
else 0. Then ``j - nb`` blocks were evicted before row ``j`` and ``j + 1 - lag`` blocks are eligible,
so exactly ``nb + 1 - lag`` candidates are held: *every* choice of distinct victims with
``victim(j) <= j - lag`` is a legal schedule, and every legal schedule is one. Evicting block ``b``
at step ``j s`` forfeits ``C[j, b]``, the attention rows ``j s + 1 .. T`` put on the block's
positions (all admitted by then); everything else is kept. Hence

    total retained mass = sum_p R[p, p]  -  sum_j C[j, victim(j)],
    C[j, b] = sum over p in block b of R[j s, p],   R[t, p] = sum(A[t + 1 .. T, p])

(``R`` as in ``optimal``), and the best schedule is a minimum-cost assignment of rows to blocks with
the staircase shape ``optimal`` solves: index the rows by ``r = j - lag`` and row ``r`` may take the
columns ``0 .. r``. The same Hungarian kernel (``optimal._augment``) solves it on the packed block
costs, with the same dual certificate (``certify``). At ``s = 1``, ``C`` is ``R`` entry for entry
(the same float64 running sums), the rows are ``budget .. T`` and the solver makes the same moves, so
the schedule and the objective are ``optimal``'s bit for bit.

Held positions: before the cache is full, ``t + 1`` after step ``t``; once full, ``(nb - 1) s + 1``
right after an eviction, growing by one a step to ``nb s``. So between ``budget - s + 1`` and
``budget`` when ``s`` divides the budget, never more than the budget. Any block schedule's kept sets
can be grown, step by step, into a legal schedule without blocks at the same budget (evict at each
step one position the block schedule no longer holds: there is one, since it holds at most
``budget`` of the ``budget + 1``), so the block optimum is never above ``optimal``.

Cost: the block costs are ``(T / s)^2 / 2`` float64 (0.26 MB at 4096 steps, ``s`` 16), one pass over
the trace's lower triangle to build them; the assignment has ``T / s`` columns. Measured at 4096
steps, budget 256, ``s`` 16 (solve and harness-measured mass, no cache): 0.07 s on
``gemma3-270m-L05`` (``optimal``: 15.8 s) and 0.15 s on the canonical trace (``optimal``: 0.9 s).
Results are cached on disk like ``optimal``'s, keyed by the trace's fingerprint, the blocks, the block
size and ``SOLVER_VERSION``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.files import atomic_write
from ..data.store import cache_dir
from ..data.trace import Trace
from ..jit import kernel
from ..policies.optimal import CACHE_MIN_STEPS, _augment, _column_totals, _row_offsets
from .base import ParamError, check_budget, check_param

#: bump when the schedule or the mass for a given trace, blocks and block size could change
SOLVER_VERSION = 1
#: rows per kernel call: the granularity of ``progress`` reports
_CHUNK = 16


def check_block_size(block_size: int, budget: int) -> tuple[int, int, str | None]:
    """``(block_size, blocks, note)``: the block size checked (a positive integer, at most the
    budget), the cache in whole blocks, and a note when the budget is no multiple of the block size
    (None otherwise). A ``ParamError`` (a ``ValueError``) in one line names what is wrong."""
    budget = check_budget(budget)
    s = check_param("block_size", block_size, minimum=1)
    if s > budget:
        raise ParamError(f"block_size {s} is larger than the budget ({budget}): the cache would hold no whole block",
                         param="block_size", value=s, problem="above budget", limit=budget, limit_name="budget")
    blocks = budget // s
    note = None
    if budget % s:
        note = (f"budget {budget} is no multiple of block_size {s}: rounded down to {blocks} whole blocks "
                f"({blocks * s} positions)")
    return s, blocks, note


@kernel
def _block_costs(A, s, blocks, lag, first, off, C, diag):
    """Row r (``first <= r``, eviction step ``t = (r + lag) s``) of the packed block costs:
    ``C[off[r] + b]`` = sum over the positions p of block b (b <= r, p <= t) of the attention rows
    ``t + 1 .. T`` put on p, added in position order; ``diag[p]`` all the attention p ever gets. The
    per-position sums are ``optimal._suffix_costs``'s running column sums, the same float64 values."""
    n = A.shape[0]
    cur = np.zeros(n)
    for t in range(n - 1, -1, -1):
        if t < n - 1:
            for p in range(t + 1):
                cur[p] += np.float64(A[t + 1, p])
        diag[t] = cur[t]
        if t % s == 0 and t // s >= blocks and t >= 1:
            r = t // s - lag
            if r >= first:
                o = off[r]
                for b in range(r + 1):
                    acc = 0.0
                    for p in range(b * s, min(b * s + s, t + 1)):
                        acc += cur[p]
                    C[o + b] = acc


@dataclass(frozen=True)
class BlockSchedule:
    """The block optimum for one trace, budget and block size.

    ``evict_steps[i]`` is the i-th evicting step, ``(blocks + i) * block_size``, and ``victims[i]``
    the block it evicts (positions ``[b s, (b + 1) s)``); ``objective`` the total retained mass over
    the T steps by the assignment's arithmetic; ``retained_mass_series`` the mass of each step's
    kept set as the harness measures it (``kvsim.sim.harness.kept_sum`` on ``trace.derived.row``),
    whose mean is ``retained_mass``; ``u`` (per row) and ``w`` (per block, <= 0) the dual
    certificate; ``note`` says how a budget that is no multiple of the block size was rounded."""

    steps: int
    budget: int  # as asked
    block_size: int
    blocks: int  # budget // block_size: the cache, in whole blocks
    evict_steps: np.ndarray  # int64
    victims: np.ndarray  # int64, block indices
    objective: float
    retained_mass_series: np.ndarray  # float64, per step t = 1 .. T
    u: np.ndarray
    w: np.ndarray
    note: str | None = None
    seconds: float = 0.0  # the solve's time (0 when read from the cache)

    @property
    def retained_mass(self) -> float:
        return float(self.retained_mass_series.mean()) if self.steps else 0.0

    @property
    def capacity(self) -> int:
        """The most positions the cache holds: ``blocks * block_size``."""
        return self.blocks * self.block_size

    def block_evicted_at(self) -> np.ndarray:
        """int64 per block 0 .. T // s: the step that evicts it, or T + 1 if none does."""
        out = np.full(self.steps // self.block_size + 1, self.steps + 1, dtype=np.int64)
        out[self.victims] = self.evict_steps
        return out

    def evicted_at(self) -> np.ndarray:
        """int64 per position 0 .. T: the step that evicts it (its block's), or T + 1."""
        return self.block_evicted_at()[np.arange(self.steps + 1) // self.block_size]

    def kept_history(self) -> np.ndarray:
        """int32 ``(T, capacity)``: the positions held after step t (row t - 1), ascending, -1 padded,
        as ``ReplayResult.kept_history`` (``kvsim.sim.harness.kept_mask_of`` reads it)."""
        T = self.steps
        gone = self.evicted_at()
        out = np.full((T, self.capacity), -1, dtype=np.int32)
        for t in range(1, T + 1):
            held = np.flatnonzero(gone[: t + 1] > t)
            out[t - 1, : held.size] = held
        return out

    def summary(self) -> dict:
        return {"policy": "optimal", "budget": self.budget, "block_size": self.block_size, "blocks": self.blocks,
                "retained_mass": self.retained_mass, "steps": self.steps, "note": self.note}


def kept_masses(trace: Trace, evicted_at: np.ndarray) -> np.ndarray:
    """float64 per step t = 1 .. T: the retained mass of the kept sets a schedule implies, measured as
    the harness measures it (``kvsim.sim.harness.steps``): the held positions ``p < t`` (those whose
    eviction step is ``>= t``) in ascending order, summed as the harness's ``kept_sum`` sums them
    (``position_sum`` of the row at the kept positions, added in kept order)."""
    from ..data.gqa import position_sum  # the harness's kept_sum is this very sum (sim sits above policies)

    store = trace.derived
    out_row = store.row_scratch()
    T = trace.steps
    series = np.empty(T, dtype=np.float64)
    for t in range(1, T + 1):
        kept = np.flatnonzero(evicted_at[:t] >= t)
        series[t - 1] = float(position_sum(store.row(t, kept, out_row)[kept]))
    return series


def solve(trace: Trace, budget: int, block_size: int,
          progress: Callable[[float], None] | None = None) -> BlockSchedule:
    """The block optimum of ``trace`` at ``budget`` and ``block_size``, computed now (no cache)."""
    s, blocks, note = check_block_size(block_size, budget)
    start = time.perf_counter()
    A = trace.derived.kernel_attention()
    T = trace.steps
    J = T // s  # the block of position T
    lag = 1 if s > 1 else 0
    first, n = blocks - lag, J - lag + 1  # rows first .. n - 1, columns (blocks) 0 .. n - 1
    if progress is not None:
        progress(0.0)
    if n <= first:  # the cache never fills: nothing is evicted
        diag_total = float(_column_totals(A).sum())
        steps_ = victims = np.zeros(0, np.int64)
        u = np.zeros(0)
        w = np.zeros(max(n, 0))
    else:
        off = _row_offsets(first, n)
        C = np.empty(int(off[n]), dtype=np.float64)
        diag = np.empty(T + 1, dtype=np.float64)
        _block_costs(A, s, blocks, lag, first, off, C, diag)
        match_col = np.full(n, -1, dtype=np.int64)
        match_row = np.full(n, -1, dtype=np.int64)
        u_all = np.zeros(n, dtype=np.float64)
        w = np.zeros(n, dtype=np.float64)
        dist = np.empty(n, dtype=np.float64)
        pred = np.empty(n, dtype=np.int64)
        todo = np.empty(n, dtype=np.int64)
        for r0 in range(first, n, _CHUNK):
            r1 = min(r0 + _CHUNK, n)
            _augment(C, off, r0, r1, match_col, match_row, u_all, w, dist, pred, todo)
            if progress is not None:
                progress((r1 - first) / (n - first))
        victims = match_row[first:].copy()
        forfeited = float(C[off[first:n] + victims].sum())
        diag_total = float(diag.sum()) - forfeited
        steps_ = (np.arange(first, n, dtype=np.int64) + lag) * s
        u = u_all[first:].copy()
    schedule = BlockSchedule(T, budget, s, blocks, steps_, victims, diag_total, np.zeros(0), u, w, note)
    series = kept_masses(trace, schedule.evicted_at())
    return dataclasses.replace(schedule, retained_mass_series=series, seconds=time.perf_counter() - start)


def certify(trace: Trace, schedule: BlockSchedule) -> float:
    """Check a block schedule and its dual certificate against the trace; the proven gap in mean
    retained mass (0 up to rounding): no schedule of whole-block evictions does better by more.

    Checks the schedule is legal under the block rules (one victim per evicting step, a complete held
    block, none twice), that its forfeited attention gives ``objective``, that its kept sets give
    ``retained_mass_series`` by the harness's arithmetic, and that the duals are feasible up to
    rounding (weak duality, as ``optimal.certify``). Raises ``ValueError`` naming what fails."""
    s, blocks, _ = check_block_size(schedule.block_size, schedule.budget)
    A = trace.derived.kernel_attention()
    T = trace.steps
    if schedule.steps != T:
        raise ValueError(f"block certificate: schedule is for {schedule.steps} steps, trace has {T}")
    J, lag = T // s, (1 if s > 1 else 0)
    first, n = blocks - lag, J - lag + 1
    rows = np.arange(first, max(n, first), dtype=np.int64)
    v = np.asarray(schedule.victims, dtype=np.int64)
    if v.shape != rows.shape or not np.array_equal(schedule.evict_steps, (rows + lag) * s):
        raise ValueError(f"block certificate: {v.size} victims for {rows.size} evicting steps")
    if v.size and (v.min() < 0 or np.any(v > rows) or np.unique(v).size != v.size):
        raise ValueError("block certificate: victims are not a legal schedule (a filling block, or one evicted twice)")
    series = kept_masses(trace, schedule.evicted_at())
    if not np.array_equal(series, schedule.retained_mass_series):
        raise ValueError("block certificate: the kept sets do not give the schedule's retained mass")
    if not v.size:
        return 0.0
    off = _row_offsets(first, n)
    C = np.empty(int(off[n]), dtype=np.float64)
    diag = np.empty(T + 1, dtype=np.float64)
    _block_costs(A, s, blocks, lag, first, off, C, diag)
    cost = float(C[off[rows] + v].sum())
    if not np.isclose(float(diag.sum()) - cost, schedule.objective, rtol=0, atol=1e-9 * max(1, T)):
        raise ValueError("block certificate: the victims do not give the schedule's objective")
    u, w = np.asarray(schedule.u, np.float64), np.asarray(schedule.w, np.float64)
    if u.shape != rows.shape or w.shape != (n,):
        raise ValueError("block certificate: dual potentials have the wrong shape")
    if w.max() > 1e-12:
        raise ValueError(f"block certificate: a block potential is positive ({w.max()!r})")
    worst = 0.0
    for i, r in enumerate(rows):
        worst = max(worst, float(-(C[off[r] : off[r] + r + 1] - u[i] - w[: r + 1]).min()))
    lower = float(u.sum() + np.minimum(w, 0).sum()) - rows.size * worst
    return max(0.0, cost - lower) / T


# --------------------------------------------------------------------------------------------
# the disk cache


def cache_file(trace: Trace, blocks: int, block_size: int) -> Path:
    return cache_dir() / f"optimal-blocks-v{SOLVER_VERSION}-{trace.fingerprint}-n{blocks}-s{block_size}.npz"


def _load(path: Path, trace: Trace, budget: int, s: int, blocks: int, note: str | None) -> BlockSchedule | None:
    T = trace.steps
    try:
        with np.load(path, allow_pickle=False) as z:
            fields = {k: z[k] for k in ("evict_steps", "victims", "u", "w", "series")}
            objective = float(z["objective"])
            if int(z["steps"]) != T or int(z["blocks"]) != blocks or int(z["block_size"]) != s:
                return None
    except (OSError, EOFError, ValueError, KeyError, TypeError):  # missing or damaged: solve again
        return None
    lag = 1 if s > 1 else 0
    rows = np.arange(blocks - lag, max(T // s - lag + 1, blocks - lag), dtype=np.int64)
    v = fields["victims"].astype(np.int64)
    if (v.shape != rows.shape or fields["series"].shape != (T,) or fields["u"].shape != rows.shape
            or not np.array_equal(fields["evict_steps"], (rows + lag) * s)
            or (v.size and (v.min() < 0 or np.any(v > rows) or np.unique(v).size != v.size))):
        return None
    return BlockSchedule(T, budget, s, blocks, fields["evict_steps"].astype(np.int64), v, objective,
                         fields["series"].astype(np.float64), fields["u"].astype(np.float64),
                         fields["w"].astype(np.float64), note)


def _save(path: Path, x: BlockSchedule) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: np.savez(
            f, evict_steps=x.evict_steps, victims=x.victims, u=x.u, w=x.w, series=x.retained_mass_series,
            objective=np.float64(x.objective), steps=np.int64(x.steps), blocks=np.int64(x.blocks),
            block_size=np.int64(x.block_size)))
    except OSError:  # an unwritable cache costs a re-solve next time, nothing else
        pass


def block_schedule(trace: Trace, budget: int, block_size: int, progress: Callable[[float], None] | None = None,
                   use_cache: bool = True) -> BlockSchedule:
    """The best schedule of whole-block evictions (see the module docstring), from the disk cache when
    it is there, else solved (and cached; never below ``optimal.CACHE_MIN_STEPS`` steps)."""
    s, blocks, note = check_block_size(block_size, budget)
    use_cache = use_cache and trace.steps >= CACHE_MIN_STEPS
    if use_cache:
        path = cache_file(trace, blocks, s)
        hit = _load(path, trace, int(budget), s, blocks, note)
        if hit is not None:
            if progress is not None:
                progress(1.0)
            return hit
    schedule = solve(trace, budget, block_size, progress)
    if use_cache:
        _save(path, schedule)
    return schedule

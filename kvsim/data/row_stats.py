"""What the trace's analyses read of its whole rows, gathered in one pass a block of rows at a time:
for a query/key trace too long for its dense matrix (``qk.DENSE_LIMIT`` steps), whose features
(sinks, band, heavy hitters), statistics (``describe``) and pooled image (the trace view) would
otherwise read a T x T matrix (4 GB of float32 at 32k steps).

The pass reads each row once, ``ROW_BLOCK`` rows at a time (memory: one block of float32 rows), and
keeps sums that every such analysis can be finished from exactly, up to the order of float64
additions: the column sums over all rows and over the late rows, the sums along each diagonal up to
``MAX_AGE``, the top-left ``CORNER`` x ``CORNER`` corner of the matrix itself (what the first rows
add to those sums, so any row range can be subtracted back out), each row's ``TOP`` largest weights
and its entropy, and the block sums of the trace view's image. A second, cheap pass reads whole
columns of the few positions with the largest sums (the heavy-hitter candidates).

Kept beside the trace's cache entry (``<stem>-rowstats-<version>.npz``, keyed by this module's
source), so the pass runs once per trace and machine: about a minute for a global layer of
Gemma-3-270M at 32k steps on two cores.
"""

from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from ..jit import kernel
from ..progress import Progress
from .files import atomic_write
from .store import source_version

#: rows read at a time
ROW_BLOCK = 64
#: the largest age whose diagonal is summed, and the corner kept whole (rows and positions 0 .. CORNER-1)
MAX_AGE = 544
CORNER = MAX_AGE + 1
#: each row's largest weights kept (a top-k share for any k up to it)
TOP = 64
#: how many positions with the largest column sums have their whole columns read
CANDIDATES = 64
#: the trace view's image: at most IMAGE x IMAGE blocks
IMAGE = 1024


@dataclass(frozen=True)
class RowStats:
    """The sums of one pass over a trace's rows 0..T (row t: its weights over positions 0..t-1)."""

    steps: int  # T
    column: np.ndarray  # (T + 1,) float64: the sum of each position's weights over every row
    late: np.ndarray  # (T // 2,) float64: the same over rows T // 2 + 1 .. T, positions 0 .. T // 2 - 1
    diagonal: np.ndarray  # (MAX_AGE + 1,) float64: [a] the sum of the weights at age a (row t, position t - a)
    corner: np.ndarray  # (min(T + 1, CORNER),) * 2 float32: the matrix's top-left corner as it is
    top: np.ndarray  # (T + 1, TOP) float32: each row's largest weights, largest first, 0-padded
    effective: np.ndarray  # (T + 1,) float64: exp(entropy) of each row (row 0: 1)
    image: np.ndarray  # (n, n) float64: sums of ``image_block`` x ``image_block`` blocks of rows 1..T, positions 0..T-1
    image_block: int
    candidates: np.ndarray  # (c,) int64: the positions with the largest column sums, largest first (stable)
    candidate_columns: np.ndarray  # (T + 1, c) float32: their weights in every row

    # ---- the analyses' inputs, finished from the sums

    def diagonal_from(self, age: int, first_row: int) -> float:
        """The sum of the weights at ``age`` over rows ``first_row`` .. T (``first_row`` <= CORNER)."""
        _within("age", age, MAX_AGE)
        _within("first row", first_row, self.corner.shape[0])
        head = sum(float(self.corner[t, t - age]) for t in range(age, first_row))
        return float(self.diagonal[age]) - head

    def columns_from(self, first_row: int, positions: int) -> np.ndarray:
        """The sums of positions 0 .. ``positions``-1 over rows ``first_row`` .. T (both <= CORNER)."""
        _within("first row", first_row, self.corner.shape[0])
        _within("positions", positions, self.corner.shape[0])
        return self.column[:positions] - self.corner[:first_row, :positions].astype(np.float64).sum(axis=0)

    def column_of(self, p: int) -> np.ndarray:
        """Position ``p``'s weight in every row, ``(T + 1,)`` float32 (``p`` a candidate)."""
        at = np.flatnonzero(self.candidates == p)
        if not at.size:
            raise ValueError(f"position {p} is not one of the {self.candidates.size} whose columns were read")
        return self.candidate_columns[:, int(at[0])]

    def block_means(self) -> np.ndarray:
        return self.image / float(self.image_block * self.image_block)


def _within(name: str, value: int, most: int) -> None:
    if not 0 <= value <= most:
        raise ValueError(f"{name} {value} is beyond what the row pass keeps (at most {most})")


def compute(store, progress: Progress | None = None) -> RowStats:
    """One pass over ``store``'s rows (a ``TraceStore``: ``rows(t0, t1)`` gives rows t0..t1-1 over
    positions 0..t1-1), then one over the candidates' columns."""
    T = store.steps
    N = T + 1
    block = max(1, math.ceil(T / IMAGE))
    n = math.ceil(T / block) if T else 0
    column, late = np.zeros(N), np.zeros(T // 2)
    diagonal = np.zeros(MAX_AGE + 1)
    c = min(N, CORNER)
    corner = np.zeros((c, c), dtype=np.float32)
    top = np.zeros((N, TOP), dtype=np.float32)
    effective = np.ones(N)
    image = np.zeros((n, n))
    for t0 in range(0, N, ROW_BLOCK):
        t1 = min(N, t0 + ROW_BLOCK)
        R = np.ascontiguousarray(store.rows(t0, t1), dtype=np.float32)
        _accumulate(R, t0, T, block, column, late, diagonal, corner, top, effective, image)
        if progress is not None:
            progress(0.95 * t1 / N, "reading every row once")
    candidates = np.argsort(-column, kind="stable")[: min(CANDIDATES, N)].astype(np.int64)
    cols = _columns(store, candidates)
    if progress is not None:
        progress(1.0, "rows read")
    return RowStats(T, column, late, diagonal, corner, top, effective, image, block, candidates, cols)


def _columns(store, positions: np.ndarray) -> np.ndarray:
    """``(T + 1, len(positions))`` float32: the weights of ``positions`` in every row."""
    N = store.steps + 1
    width = int(positions.max()) + 1 if positions.size else 1
    step = max(1, (1 << 24) // width)  # rows of ``width`` float32 at a time: 64 MB
    parts = [store.weights_at(t0, min(N, t0 + step), positions) for t0 in range(0, N, step)]
    return np.concatenate(parts).astype(np.float32, copy=False)


@kernel
def _accumulate(R, t0, T, block, column, late, diagonal, corner, top, effective, image):
    """Add rows ``t0 .. t0 + len(R) - 1`` (row t's weights over positions 0..t-1 in ``R[t - t0]``)."""
    half = T // 2
    k = top.shape[1]
    c = corner.shape[0]
    for i in range(R.shape[0]):
        t = t0 + i
        entropy = 0.0
        heap = top[t]  # a min-heap of the row's k largest so far (0-padded), sorted at the end
        for p in range(t):
            w = R[i, p]
            wd = np.float64(w)
            column[p] += wd
            a = t - p
            if a <= diagonal.shape[0] - 1:
                diagonal[a] += wd
            if t > half and p < half:
                late[p] += wd
            if t < c and p < c:
                corner[t, p] = w
            if w > 0:
                entropy += wd * np.log(wd)
            if t >= 1 and p <= T - 1:
                image[(t - 1) // block, p // block] += wd
            if w > heap[0]:
                _replace_min(heap, w, k)
        if t >= 1:
            effective[t] = np.exp(-entropy)
        heap[:] = -np.sort(-heap)


@kernel
def _replace_min(heap, w, k):
    """Put ``w`` in place of the heap's least element and sift it down."""
    i = 0
    while True:
        left = 2 * i + 1
        if left >= k:
            break
        child = left + 1 if left + 1 < k and heap[left + 1] < heap[left] else left
        if heap[child] >= w:
            break
        heap[i] = heap[child]
        i = child
    heap[i] = w


# --------------------------------------------------------------------------------------------
# on disk

def kept(store, progress: Progress | None = None) -> RowStats:
    """``compute(store)``, read from beside the store's disk entry when kept there, else computed and
    kept there (a store without an entry: computed)."""
    path = None if store.disk_stem is None else path_for(store.disk_stem)
    found = None if path is None else read(path, store.steps)
    if found is None:
        found = compute(store, progress)
        if path is not None:
            write(path, found)
    return found


def version() -> str:
    """What the stored sums depend on besides the trace: this module's source."""
    return source_version(__file__)


def path_for(stem: Path) -> Path:
    return stem.with_name(f"{stem.name}-rowstats-{version()}.npz")


def read(path: Path, steps: int) -> RowStats | None:
    """The sums kept at ``path`` for a trace of ``steps`` steps, or None (absent, damaged or another trace's)."""
    names = [f.name for f in fields(RowStats)]
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:  # the file closed even when np.load refuses it
            got = {name: z[name] for name in names}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile):
        return None
    if got["steps"].shape != () or got["image_block"].shape != () or int(got["steps"]) != steps:
        return None
    got["steps"], got["image_block"] = steps, int(got["image_block"])
    return RowStats(**got) if {k: got[k].shape for k in _SHAPED} == _shapes(steps, got["candidates"].size) else None


#: the arrays whose shapes follow from the steps (``_shapes``)
_SHAPED = ("column", "late", "diagonal", "corner", "top", "effective", "image", "candidates", "candidate_columns")


def _shapes(steps: int, candidates: int) -> dict:
    N, c = steps + 1, min(steps + 1, CORNER)
    block = max(1, math.ceil(steps / IMAGE))
    n = math.ceil(steps / block) if steps else 0
    return {"column": (N,), "late": (steps // 2,), "diagonal": (MAX_AGE + 1,), "corner": (c, c), "top": (N, TOP),
            "effective": (N,), "image": (n, n), "candidates": (min(CANDIDATES, N),), "candidate_columns": (N, candidates)}


def write(path: Path, stats: RowStats) -> None:
    """Kept atomically; an unwritable cache costs the pass next time, nothing else."""
    arrays = {f.name: np.asarray(getattr(stats, f.name)) for f in fields(RowStats)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: np.savez(f, **arrays))
    except OSError:
        pass


__all__ = ["CANDIDATES", "CORNER", "IMAGE", "MAX_AGE", "TOP", "RowStats", "compute", "kept", "path_for", "read", "write"]

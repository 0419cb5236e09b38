"""``TraceStore``: what is derived from one trace's attention alone, kept with the trace (``trace.derived``).

Four things depend on the attention and nothing else, cost real time, and are asked for again and
again: its ``fingerprint`` (what the caches key a trace by), the attention as the kernels take it
(``kernel_attention``), each row's top-k positions (``topk``, the engine's recall) and the top-k
mask (``topk_mask``, the reference's). Each is computed once per trace, on first use, under the
store's lock: a sweep's threads and the app's background replays share one trace.

``disk_stem`` says where the trace's disk cache entry is, when it has one (set by
``kvsim.data.store``): analyses of the trace are kept beside it under that stem, so a fresh process
reads them back (the top-k positions here, features and ``describe`` through ``store.derived``).
"""

from __future__ import annotations

import hashlib
import math
import threading
from pathlib import Path

import numpy as np

from ..jit import kernel
from ..progress import Progress
from .files import atomic_write


class TraceStore:
    def __init__(self, attention: np.ndarray) -> None:
        self._attention = attention
        self._lock = threading.RLock()
        #: the trace's disk cache entry without its suffix (None: the trace is not on disk)
        self.disk_stem: Path | None = None
        self._fingerprint: str | None = None
        self._kernel_attention: np.ndarray | None = None
        self._topk: dict[int, np.ndarray] = {}
        self._masks: dict[int, np.ndarray] = {}

    #: whether the dense matrix can be had here (what whole-row readers need: the offline references,
    #: the features, the value proxies, export); a query/key trace's only up to ``qk.DENSE_LIMIT`` steps.
    #: Read by the data layer alone: the layers above ask the store for what they need (``no_matrix``,
    #: ``whole``, ``prepare_whole``, ``row_scratch``, ``kernel_view``) and never which kind it is.
    dense_at_hand = True

    def no_matrix(self) -> str | None:
        """Why the dense matrix cannot be had here, in words that name the trace's steps and the limit
        (what a whole-matrix reader says when it is refused); None when it can."""
        return None

    def whole(self, matrix, sums, progress: Progress | None = None):
        """What a reader of every weight finishes from: ``matrix(A)`` of the dense matrix where it can be
        had, else ``sums(stats)`` of one pass over every row (``kvsim.data.row_stats``, ``progress``
        told during it). The reader says what it does with each; the store which one it has."""
        return matrix(self._attention)

    def prepare_whole(self, progress: Progress | None = None) -> None:
        """Do now, telling ``progress``, the slow part of what ``whole`` reads (the pass over every row
        of a trace past its dense length, kept on disk); nothing where the matrix is at hand."""

    def row_scratch(self) -> np.ndarray | None:
        """The ``out`` that ``row`` writes into, made once per replay (None: rows are read, not made)."""
        return None

    def kernel_view(self, steps_per_call: int) -> KernelView:
        """The attention as the engine's kernels read it, a call's steps at a time (``KernelView``)."""
        return KernelView(self.kernel_attention())

    def every_row(self) -> np.ndarray:
        """The whole ``(T + 1, T + 1)`` attention as the kernels take it, for a reader that needs every row
        at once (a joint replay of a layer's heads): the matrix itself, or a query/key trace's rows computed
        now with the kernels' arithmetic, whatever its length."""
        return self.kernel_attention()

    @property
    def steps(self) -> int:
        return self._attention.shape[0] - 1

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the weights the kernels read."""
        return self._attention.dtype

    def row(self, t: int, positions: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Row t, indexable by position: the reference harness reads ``row[kept]`` (a query/key trace
        fills only ``positions``, into ``out``, ``(1, T + 1)`` float32)."""
        return self._attention[t]

    def rows(self, t0: int, t1: int) -> np.ndarray:
        """Rows ``t0 .. t1-1`` over positions ``0 .. t1-2`` (at least), float32: whole rows a block at
        a time, for the references that read every weight (a query/key trace computes them now)."""
        return self._attention[t0:t1]

    def weights_at(self, t0: int, t1: int, positions: np.ndarray) -> np.ndarray:
        """``(t1 - t0, len(positions))``: rows ``t0 .. t1-1`` at ``positions`` (a query/key trace
        computes only those weights)."""
        return self._attention[t0:t1][:, positions]

    def topk_row(self, t: int, k: int) -> np.ndarray:
        """uint8, 1 at row t's top-k positions (``topk_mask(k)[t]``)."""
        return self.topk_mask(k)[t]

    def __getstate__(self) -> dict:  # a trace sent to another process (a Dask worker): the lock stays here
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.RLock())

    @property
    def fingerprint(self) -> str:
        """A digest of the attention's bytes (equal data, equal key), computed once (about 0.1 s
        for 4096 steps) unless the store read it from beside the trace."""
        with self._lock:
            if self._fingerprint is None:
                A = np.ascontiguousarray(self._attention)
                digest = hashlib.blake2b(str((A.shape, A.dtype.str)).encode(), digest_size=16)
                digest.update(A.data)
                self._fingerprint = digest.hexdigest()
            return self._fingerprint

    @property
    def has_fingerprint(self) -> bool:
        """Whether the fingerprint is known already (asking for it would not hash the attention)."""
        return self._fingerprint is not None

    def set_fingerprint(self, digest: str) -> None:
        """The fingerprint of these very bytes, known otherwise (read from a checked sidecar, or
        hashed while the store wrote them): it is not hashed again."""
        self._fingerprint = digest

    def kernel_attention(self) -> np.ndarray:
        """The attention as the kernels take it: float32 or float64 (anything else as float32),
        C-contiguous and read-only, so that a trace read from the memory-mapped cache and one built
        in memory share one compiled signature per dtype."""
        with self._lock:
            if self._kernel_attention is None:
                A = self._attention
                A = np.ascontiguousarray(A if A.dtype in (np.float32, np.float64) else A.astype(np.float32)).view()
                A.flags.writeable = False
                self._kernel_attention = A
            return self._kernel_attention

    def topk(self, k: int) -> np.ndarray:
        """int32 ``(T + 1, k)``, -1 padded: the positions of the k largest weights of every row,
        lower position first on ties (the set ``topk_mask`` marks, in O(T * k) memory). Read from
        beside the trace's disk entry when it has one (the canonical trace: about 0.2 s saved per
        process), else computed, and written there for next time."""
        _check_k(k)
        with self._lock:
            if k not in self._topk:
                self._topk[k] = self._topk_on_disk(k) if self.disk_stem is not None else self._compute_topk(k)
            return self._topk[k]

    def topk_mask(self, k: int) -> np.ndarray:
        """uint8 ``(T + 1, T + 1)``: 1 where p is among the k largest weights of row t (lower
        position first on ties)."""
        _check_k(k)
        with self._lock:
            if k not in self._masks:
                self._masks[k] = topk_mask(self._attention, k)
            return self._masks[k]

    def _compute_topk(self, k: int) -> np.ndarray:
        return _topk_positions(self.kernel_attention(), k)

    def _topk_on_disk(self, k: int) -> np.ndarray:
        path = self.disk_stem.with_name(f"{self.disk_stem.name}-topk{k}.npy")
        T = self.steps
        try:
            top = np.load(path, allow_pickle=False)
            if top.shape == (T + 1, k) and top.dtype == np.int32 and top.min() >= -1 and top.max() <= T:
                return top
        except (OSError, EOFError, ValueError):
            pass  # missing or damaged: computed again and rewritten
        top = self._compute_topk(k)
        try:
            atomic_write(path, lambda f: np.save(f, top, allow_pickle=False))
        except OSError:  # an unwritable cache costs the computation next time, nothing else
            pass
        return top


class KernelView:
    """The rows the engine's kernels read: ``A`` (row ``t`` at ``A[t - offset]``), ready for the steps
    of one kernel call once ``fill`` has run. Here the whole matrix, so ``fill`` has nothing to do and
    the engine chooses how many steps a call takes (``steps_per_call`` None)."""

    steps_per_call: int | None = None

    def __init__(self, A: np.ndarray) -> None:
        self.A = A

    def fill(self, t0: int, t1: int, positions) -> int:
        """Make rows ``t0 .. t1-1`` readable in ``A`` at least at ``positions()`` (called only where
        rows are computed); returns the offset of row ``t0``'s slot (the kernels' ``a0``)."""
        return 0


def block_means(attention: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """The means of ``block`` x ``block`` blocks of rows 1..T over positions 0..T-1 (zero-padded past
    T), at most ``size`` x ``size`` of them, and ``block``: the trace view's picture of a matrix."""
    A = np.asarray(attention)[1:, :-1]
    T = A.shape[0]
    block = max(1, math.ceil(T / size))
    n = math.ceil(T / block)
    padded = np.zeros((n * block, n * block), dtype=np.float64)
    padded[:T, :T] = A
    return padded.reshape(n, block, n, block).mean(axis=(1, 3)), block


def _check_k(k: int) -> None:
    if k < 1:
        raise ValueError(f"top_k must be at least 1, got {k}")


def topk_mask(attention: np.ndarray, k: int) -> np.ndarray:
    """``TraceStore.topk_mask`` of an attention matrix, computed now."""
    _check_k(k)
    n = attention.shape[0]
    mask = np.zeros((n, n), dtype=np.uint8)
    for t in range(1, n):
        row = attention[t, :t]
        if t <= k:
            mask[t, :t] = 1
            continue
        # k-th largest value; everything above it is in, ties at it fill up from the lowest position
        kth = np.partition(row, t - k)[t - k]
        above = row > kth
        need = k - int(above.sum())
        tied = np.flatnonzero(row == kth)[:need]
        mask[t, :t] = above
        mask[t, tied] = 1
    return mask


@kernel
def _topk_positions(A, k):
    """``TraceStore.topk`` of the kernels' attention ``A``, computed now."""
    n = A.shape[0]
    out = np.full((n, k), -1, dtype=np.int32)
    for t in range(1, n):
        _topk_row(A[t, :t], k, out[t])
    return out


@kernel
def _topk_row(row, k, out):
    """The positions of the k largest of ``row`` (row t's weights on ``0 .. t-1``) into ``out``
    (``-1`` left where the row is shorter than k), lower position first on ties."""
    t = row.shape[0]
    if t <= k:
        for p in range(t):
            out[p] = p
        return
    kth = np.partition(row, t - k)[t - k]  # the k-th largest value, whatever the algorithm
    j = 0
    for p in range(t):
        if row[p] > kth:
            out[j] = p
            j += 1
    for p in range(t):  # ties at the k-th value fill up from the lowest position
        if j == k:
            break
        if row[p] == kth:
            out[j] = p
            j += 1

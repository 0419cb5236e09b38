"""Query/key traces: a trace stored as what the model computes (queries, keys, values and the attention's
constants) instead of the dense ``(T + 1, T + 1)`` matrix, its rows computed on demand.

A dense trace costs O(T^2) (64 MB at 4096 steps as float32, 4 GB at 32k); a query/key trace O(T x head
dim) (about 100 MB at 32k steps for Gemma-3-270M's 4 query heads of 256 dims, float16). A policy reads
at most ``budget`` weights a step, and those cost O(budget x heads x head dim) from the queries and keys
(``kvsim.data.qk_rows``); only the references that need whole rows (top-k recall, the upper bound, the
optimum, greedy_future) and the trace view read whole rows, computed a block at a time.

The file (traces/README.md, "Query/key traces", format ``kvsim-qk`` version 1): one uncompressed ``.npz`` per
(layer, KV head), named ``*.qk.npz``, holding ``q`` ``(G, N, d)``, ``k`` ``(N, d)``, ``v`` ``(N, d_v)``
(float16 or float32; N = steps + 1 positions, 0 .. T, so the trace has the dense recording's steps),
optionally ``out_norms`` ``(N, G)`` (each query head's ``|W_O^h v_p|``, ``kvsim.data.vectors``; files
recorded before it existed have none and load as they did) and ``meta`` (UTF-8 JSON bytes: format,
version, steps, layer, head, query_heads, scale, softcap, sliding_window, gqa, model, text, dtype, the
rotary constants rope_theta, rope_layout, head_dim ...). ``load_qk`` checks every header before reading data and
refuses anything inconsistent with one line naming the file, the member or field and the problem.

``QKTrace`` is a ``Trace``: every consumer takes it where it takes a trace. Its ``attention`` (the dense
matrix) is formed on first use, a block of rows at a time, for traces up to ``DENSE_LIMIT`` steps, and
refused beyond; the engine and the reference harness never ask for it (``QKStore.row`` gives the kept
weights of a row, ``weights_block`` a block of rows at chosen positions). The per-row normalisers and
top-k positions (``QKStore.normalisers``, ``topk``) are computed once, for every row, and kept on disk
beside the file's cache entry (``kvsim.data.store.cache_dir()``), keyed by the file's path, size and
modification time and this arithmetic's source, so a second process reads them in milliseconds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..jit import kernel
from . import jsontext, qk_rows, row_stats
from .derived import KernelView, TraceStore, _check_k
from .files import atomic_write, settled, stamp
from .gqa import GQA_CODES
from .store import cache_dir, source_version
from .trace import MAX_META_BYTES, RENORMALISED_KEY, Trace, TraceError, _npy_header, open_npz

FORMAT, VERSION, SUFFIX = "kvsim-qk", 1, ".qk.npz"
#: the dense matrix of a query/key trace is formed only up to this many steps (256 MB as float32):
#: what ``export`` writes and the references that read the whole matrix (optimal) can take
DENSE_LIMIT = 8192
#: refuse query/key files longer than this before reading their data (1M positions)
MAX_POSITIONS = 1 << 20
#: dtypes the queries, keys and values may be stored in
QK_DTYPES = (np.float16, np.float32)
#: rows per block of the normaliser pass, whose logits it holds (float64: 64 MB at 32k positions and
#: 4 query heads); progress is told between blocks
ROW_BLOCK = 64
#: the top-k the normaliser pass takes along (the harness's default, ``kvsim.sim.harness.DEFAULT_TOP_K``)
PASS_TOP_K = 32
#: threads a block of rows is split over (one per core)
_WORKERS = os.cpu_count() or 1
#: the optional member holding each query head's output norms ``(N, G)`` (``kvsim.data.vectors``)
OUT_NORMS = "out_norms"
_META_FIELDS = ("format", "version", "steps", "layer", "head", "query_heads", "scale", "gqa")


def is_qk_path(path) -> bool:
    """Whether a file name names a query/key trace (``*.qk.npz``)."""
    return str(path).endswith(SUFFIX)


class QKData:
    """The arrays and constants of one (layer, KV head): ``Q`` float32 ``(G, N, d)``, ``K`` float32
    ``(N, d)`` and ``Kt`` ``(d, N)`` (the keys as rows and as columns) as the kernels take them, the values ``v`` as stored,
    the output norms ``out_norms`` ``(N, G)`` as stored (or None), and ``scale``, ``softcap`` (0: none),
    ``window`` (0: none), ``gqa``."""

    def __init__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float, softcap: float | None,
                 window: int | None, gqa: str, out_norms: np.ndarray | None = None) -> None:
        self.Q = np.ascontiguousarray(q, dtype=np.float32)
        self.K = np.ascontiguousarray(k, dtype=np.float32)  # a key per row: what a gather of held positions reads
        self.v = v
        self.out_norms = out_norms
        self.scale, self.softcap, self.window, self.gqa = float(scale), float(softcap or 0.0), int(window or 0), gqa
        self._Kt: np.ndarray | None = None
        for a in (self.Q, self.K):
            a.flags.writeable = False

    @property
    def Kt(self) -> np.ndarray:
        """The keys as columns: what whole rows read (the normaliser pass, the fingerprint). Made on
        first use, since a replay whose pass is on disk reads keys by row only (issue 36)."""
        if self._Kt is None:
            Kt = np.ascontiguousarray(self.K.T)
            Kt.flags.writeable = False
            self._Kt = Kt  # two threads may both make it: the same values, one kept
        return self._Kt

    @property
    def positions(self) -> int:
        return self.K.shape[0]

    @property
    def head_dim(self) -> int:
        return self.K.shape[1]

    @property
    def constants(self) -> tuple:
        """``(scale, softcap, window, gqa code)``: the kernels' trailing constants, in their order."""
        return self.scale, self.softcap, self.window, GQA_CODES[self.gqa]

    def digest(self) -> str:
        """A hash of the queries, keys, values and constants: the trace's fingerprint."""
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps(["kvsim-qk", list(self.Q.shape), self.constants]).encode())
        for a in (self.Q, self.Kt, np.ascontiguousarray(self.v)):
            h.update(str((a.shape, a.dtype.str)).encode())
            h.update(a.data)
        return h.hexdigest()


class QKStore(TraceStore):
    """``TraceStore`` for a query/key trace: normalisers, top-k and the dense matrix from the queries
    and keys, each computed once under the store's lock."""

    def __init__(self, data: QKData, name: str) -> None:
        super().__init__(None)
        self.data, self.name = data, name
        self._norm: tuple[np.ndarray, np.ndarray] | None = None
        self._dense: np.ndarray | None = None
        self._stats: row_stats.RowStats | None = None

    dtype = np.dtype(np.float32)

    @property
    def steps(self) -> int:
        return self.data.positions - 1

    @property
    def fingerprint(self) -> str:
        with self._lock:
            if self._fingerprint is None:
                self._fingerprint = self.data.digest()
            return self._fingerprint

    @property
    def dense_at_hand(self) -> bool:
        return self.steps <= DENSE_LIMIT

    def no_matrix(self) -> str | None:
        if self.dense_at_hand:
            return None
        return (f"{self.name}: a query/key trace of {self.steps} steps has no dense matrix here "
                f"(at most {DENSE_LIMIT} steps; its rows are computed on demand)")

    def whole(self, matrix, sums, progress=None):
        return matrix(self.dense()) if self.dense_at_hand else sums(self.row_stats(progress))

    def prepare_whole(self, progress=None) -> None:
        if not self.dense_at_hand:
            self.row_stats(progress)

    def row_scratch(self) -> np.ndarray:
        return np.zeros((1, self.data.positions), dtype=np.float32)

    def kernel_view(self, steps_per_call: int) -> _RowsView:
        return _RowsView(self, steps_per_call)

    def every_row(self) -> np.ndarray:
        if self.dense_at_hand:
            return self.dense()
        return self.rows(0, self.steps + 1)[:, : self.steps + 1]

    def normalisers(self, progress=None) -> tuple[np.ndarray, np.ndarray]:
        """``(lse, denom)``: float64 ``(G, N)`` and ``(N,)``, every row's, from disk when kept there."""
        with self._lock:
            if self._norm is None:
                self._norm = self._pass(PASS_TOP_K, progress)[:2]
            return self._norm

    def topk(self, k: int) -> np.ndarray:
        """The top-k positions of every row, from the normaliser pass (kept on disk with it)."""
        _check_k(k)
        with self._lock:
            if k not in self._topk:
                self._topk[k] = self._pass(k)[2]
            return self._topk[k]

    def _pass(self, k: int, progress=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The normalisers and the top-k positions, from beside the disk entry when they are there,
        else by ``qk_rows.row_pass`` over every row (and kept there)."""
        path = None if self.disk_stem is None else self.disk_stem.with_name(f"{self.disk_stem.name}-rows-k{k}.npz")
        found = _read_pass(path, self.data, k)
        if found is not None:
            if self._norm is None:
                self._norm = found[:2]
            return found
        d, N = self.data, self.data.positions
        lse = np.zeros((d.Q.shape[0], N), dtype=np.float64)
        denom = np.ones(N, dtype=np.float64)
        top = np.full((N, k), -1, dtype=np.int32)
        bad = np.zeros(_WORKERS, dtype=np.int64)
        blocks = list(range(0, N, ROW_BLOCK))

        def worker(w: int) -> None:  # every _WORKERS-th block, with its own scratch: each row is computed alone
            S = np.empty((ROW_BLOCK, d.Q.shape[0], N), dtype=np.float64)
            for t0 in blocks[w::_WORKERS]:
                qk_rows.row_pass(d.Q, d.Kt, *d.constants, k, t0, min(N, t0 + ROW_BLOCK), lse, denom, top, bad[w:], S)
                if bad[w]:
                    return

        futures = [_pool().submit(worker, w) for w in range(_WORKERS)]
        for f in futures:
            f.result()
        if bad.any():
            raise TraceError(f"{self.name}: step {int(bad[bad > 0].min())} puts all its attention on itself (nothing left "
                             "to renormalise over the earlier positions)")
        if progress is not None:
            progress(1.0, "normalisers")
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, lambda f: np.savez(f, lse=lse, denom=denom, topk=top))
            except OSError:  # an unwritable cache costs the pass next time, nothing else
                pass
        return lse, denom, top

    def row_stats(self, progress=None) -> row_stats.RowStats:
        """The sums of one pass over every row (``kvsim.data.row_stats``): what the features, ``describe``
        and the trace view read of a trace too long for its dense matrix. Kept beside the disk entry."""
        with self._lock:
            if self._stats is None:
                self._stats = row_stats.kept(self, progress)
            return self._stats

    def weights_block(self, t0: int, t1: int, positions: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out[t - t0, p]`` = weight ``[t, p]`` for rows ``t0 .. t1-1`` at ``positions`` (the rest of
        ``out`` untouched): the keys of ``positions`` gathered once, then every row against them."""
        if not 0 <= t0 < t1 <= self.data.positions:
            raise TraceError(f"{self.name}: step {t1 - 1 if t1 > self.data.positions else t0} is beyond the recording "
                             f"({self.steps} steps)")
        lse, denom = self.normalisers()
        d = self.data
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        Kc = np.empty((d.head_dim, positions.size), dtype=np.float32)
        _gather(d.K, positions, Kc)
        parts = min(_WORKERS, max(1, (t1 - t0) // 16))  # the kernel releases the GIL: rows split over the cores
        cuts = np.linspace(t0, t1, parts + 1).astype(int)
        jobs = [(a, b, out[a - t0 :]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        run = lambda job: qk_rows.weights_block(d.Q, Kc, positions, lse, denom, *d.constants, *job)  # noqa: E731
        if parts == 1:
            run(jobs[0])
        else:
            list(_pool().map(run, jobs))
        return out

    def row(self, t: int, positions: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """A length-N float32 row holding row t's weights at ``positions`` (the rest stale): what the
        reference harness indexes by its kept positions; ``out`` ``(1, N)`` is written (a new one
        when None)."""
        out = np.zeros((1, self.data.positions), dtype=np.float32) if out is None else out
        return self.weights_block(t, t + 1, positions, out)[0]

    def rows(self, t0: int, t1: int) -> np.ndarray:
        out = np.zeros((t1 - t0, t1), dtype=np.float32)
        return self.weights_block(t0, t1, np.arange(t1 - 1, dtype=np.int64), out)

    def weights_at(self, t0: int, t1: int, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if t1 <= t0 or not positions.size:
            return np.zeros((max(0, t1 - t0), positions.size), dtype=np.float32)
        out = np.zeros((t1 - t0, int(positions.max()) + 1), dtype=np.float32)
        return self.weights_block(t0, t1, np.unique(positions), out)[:, positions]

    def topk_row(self, t: int, k: int) -> np.ndarray:
        mask = np.zeros(self.data.positions, dtype=np.uint8)
        top = self.topk(k)[t]
        mask[top[top >= 0]] = 1
        return mask

    def dense(self) -> np.ndarray:
        """The dense ``(N, N)`` float32 matrix, formed a block of rows at a time (refused beyond
        ``DENSE_LIMIT`` steps)."""
        with self._lock:
            if self._dense is None:
                if not self.dense_at_hand:
                    raise TraceError(self.no_matrix())
                N = self.data.positions
                A = np.zeros((N, N), dtype=np.float32)
                every = np.arange(N, dtype=np.int64)
                for t0 in range(0, N, ROW_BLOCK):
                    self.weights_block(t0, min(N, t0 + ROW_BLOCK), every, A[t0:])
                A.flags.writeable = False
                self._dense = A
            return self._dense

    def kernel_attention(self) -> np.ndarray:
        return self.dense()

    def topk_mask(self, k: int) -> np.ndarray:
        _check_k(k)
        with self._lock:
            if k not in self._masks:
                N = self.data.positions
                mask = np.zeros((N, N), dtype=np.uint8)
                top = self.topk(k)
                rows = np.repeat(np.arange(N), k)[top.reshape(-1) >= 0]
                mask[rows, top[top >= 0]] = 1
                self._masks[k] = mask
            return self._masks[k]


class _RowsView(KernelView):
    """``KernelView`` of a query/key trace: a call's rows computed into ``A`` (``steps_per_call`` rows,
    read-only to the kernels, so that they take it with the dense matrix's type: one compiled signature
    for both kinds of trace) at the positions the engine says it may read in them."""

    def __init__(self, store: QKStore, steps_per_call: int) -> None:
        self.store, self.steps_per_call = store, steps_per_call
        self.rows = np.zeros((steps_per_call, store.data.positions), dtype=np.float32)
        view = self.rows.view()
        view.flags.writeable = False
        super().__init__(view)

    def fill(self, t0: int, t1: int, positions) -> int:
        self.store.weights_block(t0, t1, np.asarray(positions(), dtype=np.int64), self.rows)
        return t0


@kernel
def _gather(K, positions, out):
    """``out[:, i] = K[positions[i]]``: the keys of ``positions`` as columns, read a whole key at a time
    (from the transposed keys these reads were scattered over the head dim's rows: 3x slower at 32k)."""
    for i in range(positions.shape[0]):
        p = positions[i]
        for j in range(K.shape[1]):
            out[j, i] = K[p, j]


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="kvsim-qk")


def _read_pass(path: Path | None, data: QKData, k: int):
    if path is None:
        return None
    G, N = data.Q.shape[:2]
    try:
        with np.load(path, allow_pickle=False) as z:
            lse, denom, top = z["lse"], z["denom"], z["topk"]
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile):
        return None
    if lse.shape != (G, N) or denom.shape != (N,) or top.shape != (N, k) or top.dtype != np.int32:
        return None
    if not (np.isfinite(lse).all() and (denom > 0).all() and top.min() >= -1 and top.max() < N):
        return None
    return lse, denom, top


class QKTrace(Trace):
    """A trace stored as queries and keys: a ``Trace`` whose ``attention`` is formed on demand."""

    def __init__(self, data: QKData, name: str = "trace", meta: dict | None = None) -> None:
        self.name, self.meta = name, dict(meta or {})
        self.meta.pop(RENORMALISED_KEY, None)  # rows are softmaxes by construction: nothing is repaired
        self.derived = QKStore(data, name)

    @property
    def qk(self) -> QKData:
        return self.derived.data

    @property
    def attention(self) -> np.ndarray:
        return self.derived.dense()

    @property
    def steps(self) -> int:
        return self.derived.steps

    @property
    def values(self) -> np.ndarray:
        """The values ``v`` ``(N, d_v)`` as stored: what value-aware measures read."""
        return self.qk.v

    @property
    def keys(self) -> np.ndarray:
        """The keys ``(N, d)`` float32, a row per position (``kvsim.data.vectors``)."""
        return self.qk.K

    @property
    def queries(self) -> np.ndarray:
        """The queries ``(N, G, d)`` float32, position-major (a view of ``Q``, ``kvsim.data.vectors``)."""
        return self.qk.Q.swapaxes(0, 1)

    @property
    def out_norms(self) -> np.ndarray | None:
        """Each query head's ``|W_O^h v_p|`` ``(N, G)`` as stored, or None for a file without them
        (``kvsim.data.vectors``)."""
        return self.qk.out_norms

    def prefix(self, steps: int) -> QKTrace:
        """The first ``steps`` steps of the recording, as a trace of its own. Rows 0 .. steps read only
        positions 0 .. steps, so the normalisers and top-k positions computed for this trace are the
        prefix's too, and are handed over rather than computed again. All of the steps: this trace."""
        if not 1 <= steps <= self.steps:
            raise TraceError(f"{self.name}: step {steps} is beyond the recording ({self.steps} steps)")
        if steps == self.steps:
            return self
        d, n = self.qk, steps + 1
        data = QKData(d.Q[:, :n], d.K[:n], d.v[:n], scale=d.scale, softcap=d.softcap, window=d.window, gqa=d.gqa,
                      out_norms=None if d.out_norms is None else d.out_norms[:n])
        recorded = self.meta.get("recorded_steps", self.steps)
        out = QKTrace(data, name=f"{self.name}[:{steps}]", meta={**self.meta, "steps": steps, "recorded_steps": recorded})
        src = self.derived
        with src._lock:
            if src._norm is not None:
                out.derived._norm = (src._norm[0][:, :n].copy(), src._norm[1][:n].copy())
            out.derived._topk = {k: top[:n].copy() for k, top in src._topk.items()}
        return out

    def __reduce__(self):  # to a Dask worker: the arrays and constants, not the caches
        d = self.qk
        return (_rebuild, (d.Q, d.K, d.v, d.scale, d.softcap, d.window, d.gqa,
                           self.name, self.meta, self.derived.disk_stem, d.out_norms))


def _rebuild(q, k, v, scale, softcap, window, gqa, name, meta, stem, out_norms=None) -> QKTrace:
    trace = QKTrace(QKData(q, k, v, scale=scale, softcap=softcap, window=window, gqa=gqa, out_norms=out_norms), name, meta)
    trace.derived.disk_stem = stem
    return trace


def from_qk(q, k, v, *, scale: float, softcap: float | None = None, sliding_window: int | None = None,
            gqa: str = "mean", name: str = "trace", meta: dict | None = None, out_norms=None) -> QKTrace:
    """A query/key trace from arrays (``q`` ``(G, N, d)``, ``k`` ``(N, d)``, ``v`` ``(N, d_v)``, and
    optionally ``out_norms`` ``(N, G)``)."""
    data = QKData(np.asarray(q), np.asarray(k), np.asarray(v), scale=scale, softcap=softcap, window=sliding_window,
                  gqa=gqa, out_norms=None if out_norms is None else np.asarray(out_norms))
    return QKTrace(data, name=name, meta=meta)


def save_qk(path, q, k, v, meta: dict, *, out_norms=None) -> None:
    """Write a query/key trace file atomically (uncompressed ``np.savez``; nothing half-written).
    ``meta`` must carry the contract's fields (``steps`` is set from the arrays); they, the arrays'
    shapes and ``out_norms`` (optional, ``(N, G)``) are checked as ``load_qk`` checks them, before
    anything is written."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    meta = {"format": FORMAT, "version": VERSION, **meta, "steps": int(k.shape[0]) - 1, "dtype": str(q.dtype)}
    src = str(path)
    _check_shapes(src, q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype)
    _check_meta(src, meta, q.shape)
    extra = {}
    if out_norms is not None:
        out_norms = np.asarray(out_norms)
        _check_out_norms(src, out_norms.shape, out_norms.dtype, q.shape)
        _check_finite(src, OUT_NORMS, out_norms)
        extra[OUT_NORMS] = out_norms
    raw = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    atomic_write(Path(path), lambda f: np.savez(f, q=q, k=k, v=v, **extra, meta=raw))


def load_qk(path, *, expect: dict | None = None, source: str | None = None) -> QKTrace:
    """Load a query/key trace file, validated (``allow_pickle=False``; every header and the meta checked
    before any array data is read). ``path`` may be a binary file object (a Dask worker's bytes;
    ``source`` names it). ``expect``: fields the caller knows (a bundle's manifest entry: ``layer``,
    ``head``, ``query_heads``, ``sliding_window``) that the file must agree with. The trace's
    normalisers are kept in the cache directory under a digest of the file's bytes, so a second load of
    the same recording (from any path, or as bytes) reads them back. Raises TraceError, one line."""
    path, src = open_npz(path, source)
    try:
        meta, arrays = _read_qk(path, src, expect)
    except TraceError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:  # short data, a damaged member
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TraceError(f"{src}: unreadable or truncated ({msg})") from None
    name = str(meta.get("name") or _stem(Path(src)))
    trace = from_qk(arrays["q"], arrays["k"], arrays["v"], scale=meta["scale"], softcap=meta.get("softcap"),
                    sliding_window=meta.get("sliding_window"), gqa=meta["gqa"], name=name, meta=meta,
                    out_norms=arrays.get(OUT_NORMS))
    for key, a in (("q", trace.qk.Q), ("k", trace.qk.K), ("v", arrays["v"]), (OUT_NORMS, arrays.get(OUT_NORMS))):
        if a is not None:
            _check_finite(src, key, a)
    trace.derived.disk_stem = cache_dir() / f"qk-{name}-{_file_digest(path, name)}"
    return trace


def _file_digest(path, name: str) -> str:
    """A digest of the file's bytes and of ``qk_rows``' source (the key of the normalisers kept on
    disk). Hashing a whole file costs a process 0.03-0.05 s at 7600 steps (issue 36), so for a path the
    digest is kept beside the cache entries under the file's resolved path and ``stamp``, once the file
    has ``settled``, and read back while the stamp holds; a file object (a Dask worker's bytes) is hashed."""
    version = source_version(qk_rows.__file__)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(version.encode())
    if hasattr(path, "read"):
        path.seek(0)
        digest.update(path.read())
        return digest.hexdigest()
    resolved = Path(path).resolve()
    now = [str(resolved), *stamp(resolved), version]
    kept = cache_dir() / f"qk-{name}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:16]}.digest.json"
    try:
        record = json.loads(kept.read_text(encoding="utf-8"))
        if record["stamp"] == now and isinstance(record["digest"], str):
            return record["digest"]
    except (OSError, ValueError, KeyError, TypeError):  # none kept, or damaged: hashed again
        pass
    with open(resolved, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    if settled(now[1:5]):
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(kept, lambda f: f.write(json.dumps({"stamp": now, "digest": digest.hexdigest()}).encode()))
        except OSError:  # an unwritable cache costs the hash next time, nothing else
            pass
    return digest.hexdigest()


def _read_qk(path, src: str, expect: dict | None) -> tuple[dict, dict]:
    with np.load(path, allow_pickle=False) as z:
        members = set(z.zip.namelist())
        for key in ("q", "k", "v", "meta"):
            if f"{key}.npy" not in members:
                raise TraceError(f"{src}: missing key '{key}' of a {FORMAT} file; found: {', '.join(sorted(z.files))}")
        keys = ("q", "k", "v", "meta", *((OUT_NORMS,) if f"{OUT_NORMS}.npy" in members else ()))
        headers = {key: _npy_header(z, members, key, src) for key in keys}
        _check_shapes(src, *headers["q"], *headers["k"], *headers["v"])
        if OUT_NORMS in headers:
            _check_out_norms(src, *headers[OUT_NORMS], headers["q"][0])
        meta = _read_meta_bytes(z, headers["meta"], src)
        _check_meta(src, meta, headers["q"][0])
        for key, want in (expect or {}).items():
            if meta.get(key) != want:
                raise TraceError(f"{src}: meta '{key}' is {meta.get(key)!r} but the bundle's manifest says {want!r}")
        return meta, {key: z[key] for key in keys if key != "meta"}


def _stem(path: Path) -> str:
    return path.name[: -len(SUFFIX)] if is_qk_path(path) else path.stem


def _read_meta_bytes(z, header, src: str) -> dict:
    shape, dtype = header
    if dtype == np.uint8 and len(shape) == 1:
        if shape[0] > MAX_META_BYTES:
            raise TraceError(f"{src}: meta declares {shape[0]} bytes, more than the limit of {MAX_META_BYTES}")
        text = z["meta"].tobytes().decode("utf-8", errors="replace")
    elif shape == () and dtype.kind in "US":  # the dense trace's way
        if dtype.itemsize > MAX_META_BYTES:
            raise TraceError(f"{src}: meta declares {dtype.itemsize} bytes, more than the limit of {MAX_META_BYTES}")
        text = str(z["meta"][()])
    else:
        raise TraceError(f"{src}: meta must be uint8 bytes (or a 0-d string) holding JSON, got shape {shape} dtype {dtype}")
    try:
        meta = jsontext.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{src}: meta is not valid JSON ({e.msg})") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{src}: meta JSON must be an object")
    return meta


def _check_shapes(src: str, q_shape, q_dtype, k_shape, k_dtype, v_shape, v_dtype) -> None:
    for key, dtype in (("q", q_dtype), ("k", k_dtype), ("v", v_dtype)):
        if dtype.type not in QK_DTYPES:
            raise TraceError(f"{src}: '{key}' dtype {dtype} is not float16 or float32")
    if len(q_shape) != 3 or len(k_shape) != 2 or len(v_shape) != 2:
        raise TraceError(f"{src}: 'q' must be (G, N, d), 'k' (N, d) and 'v' (N, d_v); got {q_shape}, {k_shape}, {v_shape}")
    G, N, d = q_shape
    if G < 1 or d < 1:
        raise TraceError(f"{src}: 'q' has shape {q_shape}; it needs at least one query head and one dimension")
    if k_shape != (N, d):
        raise TraceError(f"{src}: 'k' has shape {k_shape}, but 'q' {q_shape} needs ({N}, {d})")
    if v_shape[0] != N or v_shape[1] < 1:
        raise TraceError(f"{src}: 'v' has shape {v_shape}, but 'q' {q_shape} needs ({N}, d_v)")
    if N < 2:
        raise TraceError(f"{src}: holds {N} positions; a trace needs at least 2 (one step)")
    if N > MAX_POSITIONS:
        raise TraceError(f"{src}: declares {N} positions, more than the limit of {MAX_POSITIONS}")


def _check_out_norms(src: str, shape, dtype, q_shape) -> None:
    """The optional ``out_norms`` member: ``(N, G)`` float16 or float32, one row per position, one column
    per query head of ``q`` ``(G, N, d)``."""
    G, N = q_shape[0], q_shape[1]
    if dtype.type not in QK_DTYPES:
        raise TraceError(f"{src}: '{OUT_NORMS}' dtype {dtype} is not float16 or float32")
    if tuple(shape) != (N, G):
        raise TraceError(f"{src}: '{OUT_NORMS}' has shape {tuple(shape)}, but 'q' {tuple(q_shape)} needs ({N}, {G})")


def _check_finite(src: str, key: str, a: np.ndarray) -> None:
    # checked as the kernels hold them: float16 -> float32 keeps every NaN and infinity, and NumPy checks
    # float32 about 15x faster than float16 (41 ms against 3 for a 7600-step Gemma-3 layer's queries)
    if not np.isfinite(a if a.dtype == np.float32 else a.astype(np.float32)).all():
        raise TraceError(f"{src}: '{key}' has NaN or infinite values")


def _check_meta(src: str, meta: dict, q_shape) -> None:
    missing = [f for f in _META_FIELDS if f not in meta]
    if missing:
        raise TraceError(f"{src}: meta is missing {', '.join(repr(f) for f in missing)}")
    if meta["format"] != FORMAT:
        raise TraceError(f"{src}: meta 'format' must be {FORMAT!r}, got {meta['format']!r}")
    if meta["version"] != VERSION:
        raise TraceError(f"{src}: meta 'version' {meta['version']!r} is not supported (this kvsim reads {VERSION})")
    G, N = q_shape[0], q_shape[1]
    if not _is_int(meta["steps"]) or meta["steps"] != N - 1:
        raise TraceError(f"{src}: meta 'steps' is {meta['steps']!r} but the arrays hold {N} positions ({N - 1} steps)")
    for key in ("layer", "head"):
        if not _is_int(meta[key]) or meta[key] < 0:
            raise TraceError(f"{src}: meta '{key}' must be a non-negative integer, got {meta[key]!r}")
    qh = meta["query_heads"]
    if not isinstance(qh, list) or not all(_is_int(x) and x >= 0 for x in qh):
        raise TraceError(f"{src}: meta 'query_heads' must be a list of non-negative integers")
    if len(qh) != G:
        raise TraceError(f"{src}: meta 'query_heads' names {len(qh)} query heads but 'q' holds {G}")
    if not _is_number(meta["scale"]) or not meta["scale"] > 0:
        raise TraceError(f"{src}: meta 'scale' must be a positive number, got {meta['scale']!r}")
    softcap, window = meta.get("softcap"), meta.get("sliding_window")
    if softcap is not None and (not _is_number(softcap) or not softcap > 0):
        raise TraceError(f"{src}: meta 'softcap' must be a positive number or null, got {softcap!r}")
    if window is not None and (not _is_int(window) or window < 1):
        raise TraceError(f"{src}: meta 'sliding_window' must be a positive integer or null, got {window!r}")
    if meta["gqa"] not in GQA_CODES:
        raise TraceError(f"{src}: meta 'gqa' must be one of {', '.join(GQA_CODES)}, got {meta['gqa']!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)


__all__ = ["DENSE_LIMIT", "FORMAT", "SUFFIX", "VERSION", "QKData", "QKStore", "QKTrace", "from_qk", "is_qk_path",
           "load_qk", "save_qk"]

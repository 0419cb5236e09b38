"""Attention traces: the ``Trace`` type, the interchange ``.npz`` format and its validation.

A trace of T decode steps is a lower-triangular ``(T + 1, T + 1)`` matrix: row ``t`` (1..T) is
the attention of the query at position ``t`` over positions ``0 .. t-1`` with the full cache,
non-negative, finite and summing to 1 (docs/domain.md, "Traces"). Row 0 and everything on or above
the diagonal are ignored on load and stored as zeros.
"""

from __future__ import annotations

import functools
import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import jsontext
from .derived import TraceStore
from .files import atomic_write

#: dtypes the interchange format may carry the attention in
ATTENTION_DTYPES = (np.float16, np.float32, np.float64)
#: refuse traces longer than this before reading their data (the header declares the shape)
MAX_STEPS = 16384
#: the interchange layout's key, the packed layout's two keys, and the optional metadata
FULL_KEY, PACKED_KEY, STEPS_KEY, META_KEY = "attention", "attention_packed", "steps", "meta"
#: the optional member holding the KV head's value vectors, ``(T + 1, d)`` float16 or float32
VALUES_KEY = "values"
#: the optional per-position members the scorers beyond attention read (``kvsim.data.vectors``), with
#: their shapes after the position: keys ``(T + 1, d)``, queries ``(T + 1, G, d)``, out_norms ``(T + 1, G)``
VECTOR_KEYS = {"keys": "d", VALUES_KEY: "d", "queries": "G, d", "out_norms": "G"}
#: refuse a ``meta`` string longer than this before reading it (token lists for 16k steps fit well inside)
MAX_META_BYTES = 8 * 1024 * 1024
#: a row whose sum is further than this from 1 counts as repaired (``meta["renormalised"]``): twice the
#: worst a float16 rounding can move a row that summed to 1 (each weight by at most 2^-11 of itself), so
#: a faithfully stored trace never counts; the shipped real traces sit below 3.4e-4
ROW_SUM_TOLERANCE = 1e-3
#: the meta key the loader owns: what it renormalised, or absent when every row already summed to 1
RENORMALISED_KEY = "renormalised"


class TraceError(ValueError):
    """A trace file or array that cannot be used; the message is one line naming the problem."""


@dataclass(eq=False)
class Trace:
    """T decode steps of attention. ``attention[t, p]`` for ``p < t`` is row t, float32."""

    attention: np.ndarray
    name: str = "trace"
    meta: dict = field(default_factory=dict)
    #: optional ``(T + 1, d)`` value vectors of the KV head, row p for position p (the value-aware
    #: proxies read them, ``kvsim.analysis.proxies``); None for a trace recorded without them
    values: np.ndarray | None = None
    #: optional ``(T + 1, d)`` keys, ``(T + 1, G, d)`` queries and ``(T + 1, G)`` output norms of the KV
    #: head (``kvsim.data.vectors``: what the key-, query- and output-aware policies read)
    keys: np.ndarray | None = None
    queries: np.ndarray | None = None
    out_norms: np.ndarray | None = None
    #: what is derived from the attention alone, computed once (``kvsim.data.derived``)
    derived: TraceStore = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.derived = TraceStore(self.attention)

    @property
    def steps(self) -> int:
        return self.attention.shape[0] - 1

    @property
    def fingerprint(self) -> str:
        """A digest of the attention's bytes: what caches key a trace by (``TraceStore.fingerprint``)."""
        return self.derived.fingerprint

    def topk_mask(self, k: int) -> np.ndarray:
        """uint8 ``(T + 1, T + 1)``: 1 where p is among the k largest weights of row t
        (``TraceStore.topk_mask``)."""
        return self.derived.topk_mask(k)


def from_array(attention: np.ndarray, name: str = "trace", meta: dict | None = None, *, source: str = "array") -> Trace:
    """Validate and normalise a ``(T + 1, T + 1)`` attention matrix into a Trace.

    Every row is divided by its sum. When some row's sum was further than ``ROW_SUM_TOLERANCE`` from 1
    (a file that was not a softmax, or was scaled), ``meta["renormalised"]`` says so:
    ``{"rows": n, "min_sum": a, "max_sum": b, "tolerance": ROW_SUM_TOLERANCE}``, over those rows
    only (``kvsim.analysis.metrics.repair_note`` words it). The loader owns that key: it is set or
    removed on every load, so a file saved after a repair (now clean) never claims one.

    Raises TraceError with one line naming ``source``, the step and the problem.
    """
    a = np.asarray(attention)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise TraceError(f"{source}: attention must be a square (T + 1, T + 1) matrix, got shape {a.shape}")
    if a.dtype.type not in ATTENTION_DTYPES:
        raise TraceError(f"{source}: attention dtype {a.dtype} is not float16, float32 or float64")
    n = a.shape[0]
    if n < 2:
        raise TraceError(f"{source}: attention has {n - 1} steps; a trace needs at least 1")
    if n - 1 > MAX_STEPS:
        raise TraceError(f"{source}: attention has {n - 1} steps, more than the limit of {MAX_STEPS}")
    out = np.zeros((n, n), dtype=np.float32)
    off = []  # per block, the sums of the rows that were not within the tolerance of 1
    for t0 in range(1, n, _CHUNK):
        t1 = min(t0 + _CHUNK, n)
        sums = _normalise_rows(a, out, t0, t1, source)
        off.append(sums[np.abs(sums - 1.0) > ROW_SUM_TOLERANCE])
    meta = dict(meta or {})
    meta.pop(RENORMALISED_KEY, None)
    repaired = np.concatenate(off)
    if repaired.size:
        meta[RENORMALISED_KEY] = {"rows": int(repaired.size), "min_sum": float(repaired.min()),
                                  "max_sum": float(repaired.max()), "tolerance": ROW_SUM_TOLERANCE}
    return Trace(out, name=name, meta=meta)


#: rows validated and normalised per block: a few ``_CHUNK x T`` float64 temporaries, not one per row
_CHUNK = 256


def _float64(block: np.ndarray) -> np.ndarray:
    """``block.astype(float64)``, exactly; float16 through a 65536-entry table, which NumPy reads
    several times faster than it converts half floats."""
    if block.dtype != np.float16 or block.strides[-1] != block.itemsize:  # big-endian or strided: NumPy's cast
        return block.astype(np.float64, order="C")
    return _float16_table()[block.view(np.uint16)]


@functools.cache
def _float16_table() -> np.ndarray:
    """Every float16 bit pattern as float64, built on first use."""
    with np.errstate(invalid="ignore"):
        return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)


def _normalise_rows(a: np.ndarray, out: np.ndarray, t0: int, t1: int, source: str) -> np.ndarray:
    """Rows ``t0 .. t1 - 1`` of ``from_array``: each row ``[t, :t]`` in float64 must be finite, then
    non-negative, then sum (``row.sum()``, NumPy's pairwise order) above zero; the first row that
    fails names its step. ``out[t, :t]`` is ``float32(row / sum)``. One block of rows at a time:
    the checks are whole-block operations, only the sums go row by row (their order is NumPy's
    1-D pairwise sum, which a sum over a longer padded row would not reproduce bit for bit).
    Returns the rows' sums (float64), for ``from_array`` to tell which were repaired."""
    w = t1 - 1  # rows t0 .. t1-1 reach at most position t1-2
    block = _float64(a[t0:t1, :w])
    upper = np.arange(w)[None, :] >= np.arange(t0, t1)[:, None]
    block[upper] = 0.0  # on and above the diagonal: not part of the trace
    finite = np.isfinite(block).all(axis=1)
    negative = (block < 0).any(axis=1)
    bad = np.flatnonzero(~finite | negative)
    stop = int(bad[0]) if bad.size else t1 - t0
    sums = np.array([block[i, : t0 + i].sum() for i in range(stop)], dtype=np.float64)
    zero = np.flatnonzero(sums <= 0)
    if zero.size:
        raise TraceError(f"{source}: step {t0 + int(zero[0])}: attention row sums to zero")
    if stop < t1 - t0:
        problem = "has NaN or infinite weights" if not finite[stop] else "has negative weights"
        raise TraceError(f"{source}: step {t0 + stop}: attention {problem}")
    np.divide(block, sums[:, None], out=out[t0:t1, :w], casting="same_kind")
    return sums


def open_npz(path, source: str | None = None):
    """``(path, name)`` of an ``.npz`` about to be read: a path (made a ``Path``) or a binary file
    object (rewound), and the name errors give it (``source``, the object's name, or the path).
    Raises TraceError, one line, for a folder, a missing file, or what is not a zip archive."""
    is_file_object = hasattr(path, "read")
    src = source or (getattr(path, "name", None) if is_file_object else None) or str(path)
    if not is_file_object:
        path = Path(path)
        if path.is_dir():
            raise TraceError(f"{src}: is a folder, not a trace file")
        if not path.is_file():
            raise TraceError(f"{src}: no such file")
    if not zipfile.is_zipfile(path):
        raise TraceError(f"{src}: not a .npz file (no zip directory: not a zip archive, or truncated)")
    if is_file_object:
        path.seek(0)
    return path, src


def load_npz(path, *, source: str | None = None) -> Trace:
    """Load a ``.npz`` trace (``allow_pickle=False``), validated and normalised.

    Reads the interchange layout (``attention``, ``(T + 1, T + 1)``) and the packed layout
    (``attention_packed``, the rows ``t = 1 .. T`` concatenated, plus ``steps``). ``path`` may also
    be a binary file object (an upload); ``source`` is then the name the error messages give it.
    Every shape, dtype and size is checked from the ``.npy`` headers before any array data is read,
    so a file that declares something absurd costs nothing. Raises TraceError, one line.
    """
    path, src = open_npz(path, source)
    try:
        with np.load(path, allow_pickle=False) as z:
            members = set(z.zip.namelist())
            has_full, has_packed = _has(members, FULL_KEY), _has(members, PACKED_KEY)
            if has_full and has_packed:
                raise TraceError(f"{src}: holds both '{FULL_KEY}' and '{PACKED_KEY}'; a trace file has one layout")
            if not has_full and not has_packed:
                found = ", ".join(sorted(z.files)) or "nothing"
                wanted = f"'{FULL_KEY}' (or '{PACKED_KEY}' and '{STEPS_KEY}')"
                raise TraceError(f"{src}: missing key {wanted}; found: {found}")
            meta_header = _npy_header(z, members, META_KEY, src) if _has(members, META_KEY) else None
            if meta_header is not None:
                _check_meta_header(meta_header, src)
            if has_full:
                shape, dtype = _npy_header(z, members, FULL_KEY, src)
                _check_attention_header(shape, dtype, src)
                attention = _read(z, members, FULL_KEY, src)
            else:
                steps = _read_steps(z, members, src)
                shape, dtype = _npy_header(z, members, PACKED_KEY, src)
                _check_packed_header(shape, dtype, steps, src)
                attention = unpack_lower(_read(z, members, PACKED_KEY, src), steps)
            meta = _read_meta(_read(z, members, META_KEY, src), src) if meta_header is not None else {}
            vectors = {name: _read_vectors(z, members, name, attention.shape[0], src)
                       for name in VECTOR_KEYS if _has(members, name)}
    except TraceError:
        raise
    except ValueError as e:  # malformed headers and short data land here; pickles are refused above
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "pickle" in msg.lower():
            msg = "holds pickled objects, which are refused"
        raise TraceError(f"{src}: {msg}") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        detail = str(e).splitlines()[0] if str(e) else ""
        kind = "corrupt compressed data" if isinstance(e, zlib.error) else type(e).__name__
        raise TraceError(f"{src}: unreadable or truncated ({kind}: {detail})") from None
    stem = Path(src).stem
    name = str(meta.get("name") or stem)
    trace = from_array(attention, name=name, meta=meta, source=src)
    for name, array in vectors.items():
        setattr(trace, name, array)
    return trace


def _read_vectors(z, members: set[str], name: str, rows: int, src: str) -> np.ndarray:
    """An optional per-position member (``VECTOR_KEYS``): float16/32/64, one row per position, every
    other dimension in 1 .. 4096."""
    ndim = VECTOR_KEYS[name].count(",") + 2
    shape, dtype = _npy_header(z, members, name, src)
    if len(shape) != ndim or shape[0] != rows or dtype.type not in ATTENTION_DTYPES or not all(0 < n <= 4096 for n in shape[1:]):
        raise TraceError(f"{src}: {name} must be ({rows}, {VECTOR_KEYS[name]}) float16/32/64 (a row per position) "
                         f"with every size after the first in 1..4096, got shape {shape} {dtype}")
    array = _read(z, members, name, src)
    if not np.isfinite(array).all():
        raise TraceError(f"{src}: {name} holds NaN or infinite numbers")
    return array



def _has(members: set[str], key: str) -> bool:
    return f"{key}.npy" in members or key in members


def _member(members: set[str], key: str) -> str:
    return f"{key}.npy" if f"{key}.npy" in members else key


def _read(z, members: set[str], key: str, src: str) -> np.ndarray:
    # by member name, so a member stored without ".npy" cannot come back as raw bytes
    with z.zip.open(_member(members, key)) as f:
        try:
            return np.lib.format.read_array(f, allow_pickle=False)
        except ValueError as e:  # the data stops before the header's shape is filled
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TraceError(f"{src}: '{key}' is truncated ({msg})") from None


def _npy_header(z, members: set[str], key: str, src: str) -> tuple[tuple, np.dtype]:
    """Shape and dtype of one member from its ``.npy`` header alone: no array data is read."""
    from numpy.lib import format as npformat

    with z.zip.open(_member(members, key)) as f:
        try:
            version = npformat.read_magic(f)
        except ValueError:
            raise TraceError(f"{src}: '{key}' is not a NumPy .npy array") from None
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise TraceError(f"{src}: '{key}' has an unknown .npy format version {version}")
        read_header = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
        shape, _, dtype = read_header(f)
    if dtype.hasobject:
        raise TraceError(f"{src}: '{key}' holds pickled objects, which are refused")
    return shape, dtype


def _check_attention_header(shape: tuple, dtype: np.dtype, src: str) -> None:
    """Refuse absurd shapes and wrong dtypes from the .npy header before reading the data."""
    if dtype.type not in ATTENTION_DTYPES:
        raise TraceError(f"{src}: attention dtype {dtype} is not float16, float32 or float64")
    if len(shape) != 2 or shape[0] != shape[1]:
        raise TraceError(f"{src}: attention must be a square (T + 1, T + 1) matrix, got shape {shape}")
    if shape[0] - 1 > MAX_STEPS:
        raise TraceError(f"{src}: attention declares {shape[0] - 1} steps, more than the limit of {MAX_STEPS}")


def _read_steps(z, members: set[str], src: str) -> int:
    if not _has(members, STEPS_KEY):
        raise TraceError(f"{src}: '{PACKED_KEY}' needs the key '{STEPS_KEY}', which is missing")
    shape, dtype = _npy_header(z, members, STEPS_KEY, src)
    if shape != () or dtype.kind not in "iu":
        raise TraceError(f"{src}: '{STEPS_KEY}' must be a 0-d integer array, got shape {shape} dtype {dtype}")
    steps = int(_read(z, members, STEPS_KEY, src)[()])
    if steps < 1:
        raise TraceError(f"{src}: '{STEPS_KEY}' is {steps}; a trace needs at least 1 step")
    if steps > MAX_STEPS:
        raise TraceError(f"{src}: '{STEPS_KEY}' declares {steps} steps, more than the limit of {MAX_STEPS}")
    return steps


def _check_packed_header(shape: tuple, dtype: np.dtype, steps: int, src: str) -> None:
    if dtype.type not in ATTENTION_DTYPES:
        raise TraceError(f"{src}: {PACKED_KEY} dtype {dtype} is not float16, float32 or float64")
    need = steps * (steps + 1) // 2
    if shape != (need,):
        raise TraceError(f"{src}: {PACKED_KEY} must be 1-D with {need} values for {steps} steps, got shape {shape}")


def _check_meta_header(header: tuple[tuple, np.dtype], src: str) -> None:
    shape, dtype = header
    if shape != () or dtype.kind not in "US":
        raise TraceError(f"{src}: meta must be a 0-d string array holding JSON")
    if dtype.itemsize > MAX_META_BYTES:
        raise TraceError(f"{src}: meta declares {dtype.itemsize} bytes, more than the limit of {MAX_META_BYTES}")


def _read_meta(m: np.ndarray, src: str) -> dict:
    try:
        meta = jsontext.loads(str(m[()]))
    except json.JSONDecodeError as e:
        raise TraceError(f"{src}: meta is not valid JSON ({e.msg})") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{src}: meta JSON must be an object")
    return meta


def pack_lower(attention: np.ndarray) -> np.ndarray:
    """Rows ``t = 1 .. T`` of a ``(T + 1, T + 1)`` matrix, each ``[t, :t]``, concatenated: the
    ``T (T + 1) / 2`` weights a trace has, half the full matrix (row t starts at ``t (t - 1) / 2``)."""
    n = attention.shape[0]
    return np.concatenate([attention[t, :t] for t in range(1, n)]) if n > 1 else attention[:0, 0]


def unpack_lower(packed: np.ndarray, steps: int) -> np.ndarray:
    """The inverse of ``pack_lower``: a ``(steps + 1, steps + 1)`` matrix in the packed dtype, zeros
    on and above the diagonal."""
    n = steps + 1
    out = np.zeros((n, n), dtype=packed.dtype)
    start = 0
    for t in range(1, n):
        out[t, :t] = packed[start : start + t]
        start += t
    return out


def save_npz(trace: Trace, path: str | Path, dtype=np.float32, *, packed: bool = False) -> None:
    """Write a trace; written to a temporary file first so nothing is half-written.

    ``packed=False`` writes the interchange layout; ``packed=True`` the packed lower triangle
    (``attention_packed`` + ``steps``), which with ``dtype=np.float16`` is a quarter of the float32
    interchange file before compression. Both load with ``load_npz``.
    """
    meta = {"name": trace.name, **trace.meta}
    if packed:
        arrays = {
            PACKED_KEY: pack_lower(trace.attention).astype(dtype),
            STEPS_KEY: np.array(trace.steps, dtype=np.int64),
        }
    else:
        arrays = {FULL_KEY: trace.attention.astype(dtype)}
    for name in VECTOR_KEYS:
        if getattr(trace, name, None) is not None:
            arrays[name] = np.asarray(getattr(trace, name))
    atomic_write(Path(path), lambda f: np.savez_compressed(f, **arrays, meta=np.array(json.dumps(meta))))

"""Attention traces: the ``Trace`` type, the interchange ``.npz`` format and its validation.

A trace of T decode steps is a lower-triangular ``(T + 1, T + 1)`` matrix: row ``t`` (1..T) is
the attention of the query at position ``t`` over positions ``0 .. t-1`` with the full cache,
non-negative, finite and summing to 1 (DOMAIN.md section 3). Row 0 and everything on or above
the diagonal are ignored on load and stored as zeros.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: dtypes the interchange format may carry the attention in
ATTENTION_DTYPES = (np.float16, np.float32, np.float64)
#: refuse traces longer than this before reading their data (the header declares the shape)
MAX_STEPS = 16384


class TraceError(ValueError):
    """A trace file or array that cannot be used; the message is one line naming the problem."""


@dataclass(eq=False)
class Trace:
    """T decode steps of attention. ``attention[t, p]`` for ``p < t`` is row t, float32."""

    attention: np.ndarray
    name: str = "trace"
    meta: dict = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def steps(self) -> int:
        return self.attention.shape[0] - 1

    def row(self, t: int) -> np.ndarray:
        """Row t: attention of the query at position t over positions 0 .. t-1."""
        return self.attention[t, :t]

    def topk_mask(self, k: int) -> np.ndarray:
        """uint8 ``(T + 1, T + 1)``: 1 where p is among the k largest weights of row t (lower
        position first on ties). Depends on the trace alone, so computed once and cached."""
        key = ("topk", k)
        if key not in self._cache:
            self._cache[key] = topk_mask(self.attention, k)
        return self._cache[key]


def topk_mask(attention: np.ndarray, k: int) -> np.ndarray:
    if k < 1:
        raise ValueError(f"top_k must be at least 1, got {k}")
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


def from_array(attention: np.ndarray, name: str = "trace", meta: dict | None = None, *, source: str = "array") -> Trace:
    """Validate and normalise a ``(T + 1, T + 1)`` attention matrix into a Trace.

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
    for t in range(1, n):
        row = a[t, :t].astype(np.float64)
        if not np.all(np.isfinite(row)):
            raise TraceError(f"{source}: step {t}: attention has NaN or infinite weights")
        if np.any(row < 0):
            raise TraceError(f"{source}: step {t}: attention has negative weights")
        s = row.sum()
        if s <= 0:
            raise TraceError(f"{source}: step {t}: attention row sums to zero")
        out[t, :t] = row / s
    return Trace(out, name=name, meta=dict(meta or {}))


def load_npz(path: str | Path) -> Trace:
    """Load an interchange ``.npz`` trace (``allow_pickle=False``), validated and normalised."""
    path = Path(path)
    src = str(path)
    if not path.is_file():
        raise TraceError(f"{src}: no such file")
    if not zipfile.is_zipfile(path):
        raise TraceError(f"{src}: not a .npz (zip) file")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "attention" not in z.files:
                raise TraceError(f"{src}: missing key 'attention' (found: {', '.join(z.files) or 'nothing'})")
            _check_header(z, src)
            attention = z["attention"]
            meta = _read_meta(z, src) if "meta" in z.files else {}
    except TraceError:
        raise
    except ValueError as e:  # pickled object arrays and malformed headers land here
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "pickle" in msg.lower():
            msg = "holds pickled objects, which are refused"
        raise TraceError(f"{src}: {msg}") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise TraceError(f"{src}: unreadable or truncated ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    name = str(meta.get("name") or path.stem)
    return from_array(attention, name=name, meta=meta, source=src)


def _check_header(z, src: str) -> None:
    """Refuse absurd shapes from the .npy header before reading the data."""
    from numpy.lib import format as npformat

    with z.zip.open("attention.npy") as f:
        version = npformat.read_magic(f)
        read_header = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
        shape, _, dtype = read_header(f)  # the header only, no data
    if dtype.hasobject:
        raise TraceError(f"{src}: attention holds pickled objects, which are refused")
    if len(shape) != 2 or shape[0] != shape[1]:
        raise TraceError(f"{src}: attention must be a square (T + 1, T + 1) matrix, got shape {shape}")
    if shape[0] - 1 > MAX_STEPS:
        raise TraceError(f"{src}: attention declares {shape[0] - 1} steps, more than the limit of {MAX_STEPS}")


def _read_meta(z, src: str) -> dict:
    m = z["meta"]
    if m.shape != () or m.dtype.kind not in "US":
        raise TraceError(f"{src}: meta must be a 0-d string array holding JSON")
    try:
        meta = json.loads(str(m[()]))
    except json.JSONDecodeError as e:
        raise TraceError(f"{src}: meta is not valid JSON ({e.msg})") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{src}: meta JSON must be an object")
    return meta


def save_npz(trace: Trace, path: str | Path, dtype=np.float32) -> None:
    """Write the interchange format; written to a temporary file first so nothing is half-written."""
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    meta = {"name": trace.name, **trace.meta}
    with open(tmp, "wb") as f:
        np.savez_compressed(f, attention=trace.attention.astype(dtype), meta=np.array(json.dumps(meta)))
    tmp.replace(path)

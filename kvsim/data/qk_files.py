"""The query/key trace file (traces/README.md, "Query/key traces", format ``kvsim-qk`` version 1): one
uncompressed ``.npz`` per (layer, KV head), ``*.qk.npz``, holding ``q``, ``k``, ``v``, optionally
``out_norms``, and ``meta`` (UTF-8 JSON). ``save_qk`` writes one atomically; ``load_qk`` checks every
header before reading data, refuses anything inconsistent with one line naming the file, the member or
field and the problem, and hands the arrays to ``kvsim.data.qk.from_qk``, keying the rows' cache entry
by a digest of the file. What a loaded trace is and computes is ``kvsim.data.qk``'s."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np

from . import jsontext, qk_rows
from .files import atomic_write, settled, stamp
from .gqa import GQA_CODES
from .qk import QKTrace, from_qk
from .store import cache_dir, source_version
from .trace import MAX_META_BYTES, TraceError, _npy_header, open_npz

FORMAT, VERSION, SUFFIX = "kvsim-qk", 1, ".qk.npz"
#: refuse query/key files longer than this before reading their data (1M positions)
MAX_POSITIONS = 1 << 20
#: dtypes the queries, keys and values may be stored in
QK_DTYPES = (np.float16, np.float32)
#: the optional member holding each query head's output norms ``(N, G)`` (``kvsim.data.vectors``)
OUT_NORMS = "out_norms"
_META_FIELDS = ("format", "version", "steps", "layer", "head", "query_heads", "scale", "gqa")


def is_qk_path(path) -> bool:
    """Whether a file name names a query/key trace (``*.qk.npz``)."""
    return str(path).endswith(SUFFIX)


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


__all__ = ["FORMAT", "SUFFIX", "VERSION", "is_qk_path", "load_qk", "save_qk"]

"""The canonical trace, generated once and then read from a user cache directory.

Generating it costs about half a second; reading it back costs about ten milliseconds, because the
attention is stored as a plain ``.npy`` and memory-mapped (read-only, shared between processes
through the page cache) instead of copied. Every start-up after the first (the CLI, the app, the
benchmark) reads it.

Where: ``$KVSIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvsim``, else ``~/.cache/kvsim``. Two files per
trace, both named by the generator's ``VERSION`` and a hash of the config, so a changed generator
or config never reads a stale file: ``<key>.npy`` (the attention, float32) and ``<key>.json`` (the
trace's meta, a CRC-32 of the attention and the trace's ``fingerprint``, which the optimum's disk
cache is keyed by: read back once the CRC holds, it spares every process that asks for it a hash
of the whole attention, about 0.1 s at 4096 steps). Each is written to a temporary file in the same
directory and renamed into place, the ``.json`` last, so a reader never sees half a file. A file
that does not load with ``allow_pickle=False``, has the wrong shape or dtype, or fails its CRC is
regenerated; if the directory cannot be written the trace is generated in memory and nothing fails.
Once a file has checked out and is a few seconds old (``kvsim.data.files.settled``), its ``stamp`` joins
the ``.json``, and a read that finds the file as stamped skips the CRC.

Analyses of a trace alone are kept beside its entry, under its stem: its top-k positions
(``<key>-topk<k>.npy``) and, through ``derived``, its features and ``describe``
(``<key>-<name>-<digest>.json``, the digest covering the arguments and a hash of the analysing
module's source, so an edited analysis is computed afresh).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zlib
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

import numpy as np

from . import canonical
from .files import atomic_write, settled, stamp
from .trace import VECTOR_KEYS, Trace

V = TypeVar("V")


def cache_dir() -> Path:
    """The directory the cache lives in (it may not exist yet)."""
    if os.environ.get("KVSIM_CACHE_DIR"):
        return Path(os.environ["KVSIM_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "kvsim"
    return Path.home() / ".cache" / "kvsim"


def cache_path(config: canonical.CanonicalConfig | None = None) -> Path:
    """The attention file of the trace built from ``config``; its meta sits beside it as ``.json``."""
    config = canonical.CanonicalConfig() if config is None else config
    digest = hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"canonical-v{canonical.VERSION}-{digest}.npy"


def canonical_trace(config: canonical.CanonicalConfig | None = None) -> Trace:
    """The canonical trace (``kvsim.data.canonical.generate(config)``), from the disk cache when it is
    there and intact. Its attention is then a read-only memory map."""
    config = canonical.CanonicalConfig() if config is None else config
    path = cache_path(config)
    trace = _read(path, config)
    if trace is None:
        trace = canonical.generate(config)
        _write(trace, path)
    elif not trace.derived.has_fingerprint:  # a sidecar from before it held one: add it, once
        _write(trace, path, meta_only=True)
    # per-trace figures that depend on the trace alone (the engine's top-k positions) may be kept on
    # disk beside it, under this stem: the trace's file name is its version and config
    trace.derived.disk_stem = path.with_suffix("")
    return trace


def _read(path: Path, config: canonical.CanonicalConfig) -> Trace | None:
    """The cached trace, or None when it is missing or damaged in any way."""
    n = config.steps + 1

    def same(record: dict, attention: np.ndarray) -> bool:
        meta = record["meta"]
        return (attention.shape == (n, n) and meta.get("generator_version") == canonical.VERSION
                and meta.get("config") == _jsonable(asdict(config)))

    trace = _read_checked(path, same)
    if trace is not None:
        trace.meta["config"] = asdict(config)  # as the generator gives it (JSON turned its tuples into lists)
        trace.name = str(trace.meta.get("name", "canonical"))
    return trace


def _read_checked(path: Path, same) -> Trace | None:
    """A cached attention file and its ``.json``, when both load, the record is what ``same`` expects
    and the CRC holds; else None."""
    try:
        record = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
        before = stamp(path)
        attention = np.load(path, mmap_mode="r", allow_pickle=False)
        mapped = stamp(path)  # as before: the file mapped is the file stamped
    except (OSError, EOFError, ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        return None
    if not isinstance(record, dict) or not isinstance(record.get("meta"), dict):
        return None
    if attention.ndim != 2 or attention.dtype != np.float32 or not same(record, attention):
        return None
    attention = np.asarray(attention)  # a plain read-only ndarray view of the map
    if record.get("stamp") != mapped or before != mapped:
        if record.get("crc32") != zlib.crc32(attention):
            return None
        if before == mapped and settled(mapped):  # checked once: its stamp spares the next process the CRC
            _keep_stamp(path, {**record, "stamp": mapped})
    trace = Trace(attention, name=str(record.get("name") or "trace"), meta=record["meta"])
    if isinstance(record.get("fingerprint"), str):  # of these very bytes (the CRC says so); else hashed on demand
        trace.derived.set_fingerprint(record["fingerprint"])
    return trace


def _keep_stamp(path: Path, record: dict) -> None:
    """Rewrite an entry's ``.json`` with the ``stamp`` of its attention file, whose CRC was just checked:
    a later read that finds the same stamp skips the CRC (0.03-0.1 s of every process at 4096 steps,
    issue 36). A writer that replaced the entry meanwhile leaves a stamp that matches nothing, so its
    file is checked by its CRC and, if this record is not its own, written again."""
    try:
        atomic_write(path.with_suffix(".json"), lambda f: f.write(json.dumps(record).encode("utf-8")))
    except OSError:  # an unwritable cache costs the CRC next time, nothing else
        pass


def file_trace(path: Path, load) -> Trace:
    """The trace in the file ``path`` (a shipped ``.npz``: compressed, packed, float16), read by
    ``load`` once and then from the cache, where its validated float32 attention is kept as a plain
    ``.npy`` beside a ``.json``, like the canonical trace's. The cache entry is named by the file's
    resolved path, size and modification time, so a changed file is read afresh; a damaged entry is
    rewritten. Decoding and validating a 4096-step shipped trace costs about 0.3 s; this, ~0.03 s.

    The file's per-position members (values, keys, queries, out_norms: ``VECTOR_KEYS``) are kept beside
    the entry as they were stored (``<entry>-<member>.npy``), each with its shape, dtype and CRC in the
    ``.json``, and come back with the attention; an entry that does not list its members (written before
    they were kept) or whose member files do not match is read afresh."""
    path = Path(path)
    st = path.stat()
    source = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    where = cache_dir() / f"file-{path.stem}-{key}.npy"
    seen: dict = {}

    def same(record: dict, attention: np.ndarray) -> bool:
        seen["members"] = record.get("members")
        return record.get("source") == source and isinstance(record.get("members"), dict)

    trace = _read_checked(where, same)
    if trace is not None and not _read_members(where, trace, seen["members"]):
        trace = None
    if trace is None:
        trace = load(path)
        _write(trace, where, extra={"source": source, "name": trace.name, "members": _write_members(trace, where)})
    trace.derived.disk_stem = where.with_suffix("")
    return trace


def _member_path(entry: Path, name: str) -> Path:
    return entry.with_name(f"{entry.stem}-{name}.npy")


def _write_members(trace: Trace, entry: Path) -> dict:
    """Write ``trace``'s per-position members beside the cache entry; their shape, dtype and CRC (what the
    entry's ``.json`` lists). A member that cannot be written is left out of the list (and so read
    afresh next time)."""
    listed = {}
    for name in VECTOR_KEYS:
        array = getattr(trace, name, None)
        if array is None:
            continue
        array = np.ascontiguousarray(array)
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(_member_path(entry, name), lambda f, a=array: np.save(f, a, allow_pickle=False))
        except OSError:  # an unwritable cache costs the decoding next time, nothing else
            return {}
        listed[name] = {"shape": list(array.shape), "dtype": array.dtype.str, "crc32": zlib.crc32(array)}
    return listed


def _read_members(entry: Path, trace: Trace, listed: dict) -> bool:
    """Set the members the entry lists on ``trace``, read-only memory maps checked against the listing
    (shape, dtype, CRC); False when any is missing or does not match."""
    found = {}
    for name, want in listed.items():
        if name not in VECTOR_KEYS or not isinstance(want, dict):
            return False
        try:
            array = np.load(_member_path(entry, name), mmap_mode="r", allow_pickle=False)
        except (OSError, EOFError, ValueError):
            return False
        if (list(array.shape) != want.get("shape") or array.dtype.str != want.get("dtype") or array.shape[0] != trace.steps + 1
                or zlib.crc32(array) != want.get("crc32")):
            return False
        found[name] = np.asarray(array)
    for name, array in found.items():
        setattr(trace, name, array)
    return True


def derived(
    trace: Trace,
    name: str,
    params: dict,
    version: str,
    compute: Callable[[], V],
    encode: Callable[[V], dict] = lambda value: value,
    decode: Callable[[dict], V] = lambda record: record,
) -> V:
    """``compute()``, kept on disk beside the trace's cache entry when it has one, the way the engine
    keeps each trace's top-k positions: for analyses that depend on the trace alone (its features,
    its ``describe``), so that a fresh process (a new app server) reads them instead of recomputing.

    What ships with the repo for the trace's content (``kvsim.data.kept``: the shipped traces, and an
    upload that is a copy of one) is read where the disk holds nothing, under the same name. Else a trace
    without a ``disk_stem`` (an upload, a generated trace) gets ``compute()`` and the disk is never
    touched. Otherwise the value is read from ``{stem}-{name}-{digest}.json``, ``digest`` a hash
    of ``params`` (the analysis's arguments, JSON) and ``version``. ``version`` says which code made
    the value: callers pass a hash of the source of the module that defines the analysis (see
    ``source_version``), so any edit of that module reads as a different file and the value is
    computed afresh; the trace's own changes are already in its stem.

    ``encode`` turns the value into a JSON record (a dict), ``decode`` turns a record back and raises
    ``ValueError`` (or ``TypeError``/``KeyError``) on anything that is not one. A missing, truncated,
    damaged or wrong-typed file is computed again and rewritten; a value whose record does not decode
    back to an equal value is returned but never written; an unwritable cache only costs the
    computation next time (writes are atomic, errors ignored)."""
    stem = trace.derived.disk_stem
    head, path = _derived_at(stem, name, params, version)
    found = None if path is None else _read_derived(path, head, decode)
    if found is None:
        found = _read_shipped(trace, head, decode)
    if found is not None:
        return found
    value = compute()
    if path is None:
        return value
    try:
        record = encode(value)
        text = json.dumps({**head, "record": record}, allow_nan=False)
        if decode(json.loads(text)["record"]) != value:  # only what reads back exactly is kept
            return value
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    except (OSError, ValueError, TypeError, KeyError):
        pass  # unwritable, or not a JSON record: computed again next time
    return value


def derived_stored(trace: Trace, name: str, params: dict, version: str,
                   decode: Callable[[dict], V] = lambda record: record) -> V | None:
    """What ``derived`` would read for these arguments, or None when nothing is kept (nothing is computed)."""
    head, path = _derived_at(trace.derived.disk_stem, name, params, version)
    found = None if path is None else _read_derived(path, head, decode)
    return found if found is not None else _read_shipped(trace, head, decode)


def derived_name(name: str, params: dict, version: str) -> tuple[dict, str]:
    """The head of a derived file and its name after the entry's stem (``<name>-<digest>.json``): the one
    key function of the cache and of what ships with the repo (``kvsim.data.kept``)."""
    head = {"name": name, "params": _jsonable(params), "version": version}
    digest = hashlib.sha256(json.dumps(head, sort_keys=True).encode()).hexdigest()[:16]
    return head, f"{name}-{digest}.json"


def _derived_at(stem, name: str, params: dict, version: str) -> tuple[dict, Path | None]:
    head, file_name = derived_name(name, params, version)
    return head, None if stem is None else Path(stem).with_name(f"{Path(stem).name}-{file_name}")


def _read_derived(path: Path, head: dict, decode: Callable[[dict], V]) -> V | None:
    try:
        return _decoded(json.loads(path.read_text(encoding="utf-8")), head, decode)
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # missing or damaged: computed again and rewritten


def _decoded(stored, head: dict, decode: Callable[[dict], V]) -> V | None:
    try:
        if isinstance(stored, dict) and {k: stored.get(k) for k in head} == head and isinstance(stored.get("record"), dict):
            return decode(stored["record"])
    except (ValueError, TypeError, KeyError, RecursionError):
        pass
    return None


def _read_shipped(trace: Trace, head: dict, decode: Callable[[dict], V]) -> V | None:
    """The value as shipped with the repo for this trace's content (``kvsim.data.kept``), or None. Not written
    to the cache: reading the shipped file is as quick, and an edit of the code finds neither."""
    from . import kept

    _, file_name = derived_name(head["name"], head["params"], head["version"])
    stored = kept.derived(trace, file_name)
    return None if stored is None else _decoded(stored, head, decode)


@functools.cache
def source_version(module_file: str) -> str:
    """A hash of a module's source file, read once per process: the ``version`` of the analyses that
    module defines, so an edited module never reads a value its old code stored."""
    return hashlib.sha256(Path(module_file).read_bytes()).hexdigest()[:16]


def _write(trace: Trace, path: Path, meta_only: bool = False, extra: dict | None = None) -> None:
    """Write atomically (temporary file, then rename); an unwritable cache is silently skipped.
    ``meta_only``: the attention file is already there and intact; rewrite the ``.json`` alone.
    ``extra``: more fields for the ``.json`` (what the entry was made from)."""
    attention = np.ascontiguousarray(trace.attention, dtype=np.float32)
    fingerprint = Trace(attention).fingerprint  # of the float32 bytes stored, whatever dtype the trace had
    if trace.attention.dtype == np.float32:  # the very bytes stored: no second hash when it is asked for
        trace.derived.set_fingerprint(fingerprint)
    record = {"meta": trace.meta, "crc32": zlib.crc32(attention), "fingerprint": fingerprint, **(extra or {})}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not meta_only:
            atomic_write(path, lambda f: np.save(f, attention, allow_pickle=False))
        atomic_write(path.with_suffix(".json"), lambda f: f.write(json.dumps(record).encode("utf-8")))
    except OSError:
        pass


def _jsonable(value):
    """What ``value`` reads back as after a JSON round trip (tuples become lists)."""
    return json.loads(json.dumps(value))

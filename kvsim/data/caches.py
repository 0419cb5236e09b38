"""What kvsim keeps in its cache directory, by kind, and clearing it: ``kvsim cache list`` / ``clear``.

Every entry is named by a pattern its writer uses (docs/caches.md says which writer, and how big):

- ``traces``: decoded traces and what is derived from them alone (``kvsim.data.store``): the canonical
  trace (``canonical-v*``), shipped ``.npz`` files decoded to float32 (``file-*``), each with its
  ``.json`` and its analyses (``<stem>-topk<k>.npy``, ``<stem>-<analysis>-<digest>.json``);
- ``optimal``: solved offline-optimal schedules (``kvsim.policies.optimal``, ``optimal-v*.npz``);
- ``quality``: ``kvsim quality`` results (``quality/*.json``);
- ``models``: the dequantised Gemma-3-270M (``kvsim.models.loading``, ``models/<key>/``, about 1.1 GB; older
  versions put it at the top as ``gemma3-270m-<sha>-transformers-<version>/``).
- ``recordings``: bundles ``kvsim record`` wrote without ``--out`` (``kvsim.models.record_cache``,
  ``recordings/<prefix>-<steps>-<store>-<key>/``; the long bundle is about 2 GB).
- ``allocation``: the app's allocation comparisons (``kvsim.allocation.allocators.compare_bundle``,
  ``allocation/compare-v*.json``, a few kB each);
- ``tuning``: the app's per-trace recent_window sweeps of a bundle (``kvsim.analysis.tune_sweep.kept_unit``,
  ``tuning/unit-*.json``, a few kB each);
- ``needle``: ``kvsim needle``'s trials and grids (``kvsim.models.needle``, ``needle/trial-*.json`` with each
  policy run's departures as ``.npz``, ``needle/grid-*.json``).

Anything else in the directory is listed as ``other`` and never deleted: ``KVSIM_CACHE_DIR`` may name
a folder that holds other things too. Clearing deletes only entries directly inside the cache directory
that one of the patterns names; a symbolic link is removed as a link, never followed. A cache directory
that is the file system's root or the home directory itself is refused.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .store import cache_dir

#: kind -> the glob patterns of its top-level entries, in the order ``list`` shows them
KINDS: dict[str, tuple[str, ...]] = {
    "traces": ("canonical-v*", "file-*", "qk-*"),
    "optimal": ("optimal-v*",),
    "quality": ("quality",),
    "models": ("models", "gemma3-270m-*"),
    "recordings": ("recordings",),
    "needle": ("needle",),
    "allocation": ("allocation",),
    "tuning": ("tuning",),
}
OTHER = "other"


class CacheError(ValueError):
    """A cache directory that must not be listed or cleared; one line."""


@dataclass(frozen=True)
class Usage:
    kind: str
    entries: int  # files (a folder's files counted one by one)
    bytes: int

    def to_dict(self) -> dict:
        return {"kind": self.kind, "entries": self.entries, "bytes": self.bytes}


def checked_dir(path: Path | None = None) -> Path:
    """The cache directory (``cache_dir()`` unless given), refused when it is ``/`` or the home
    directory itself, where "clear" would mean something no one asked for."""
    path = Path(cache_dir() if path is None else path).expanduser()
    resolved = path.resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
        raise CacheError(f"the cache directory {path} is {'the root' if resolved == Path(resolved.anchor) else 'your home'} "
                         "folder itself; set KVSIM_CACHE_DIR to a folder of its own")
    return resolved


def kind_of(name: str) -> str:
    """The kind of the top-level entry called ``name``, or ``other``."""
    for kind, patterns in KINDS.items():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return kind
    return OTHER


def _size(entry: Path) -> tuple[int, int]:
    """(files, bytes) under ``entry``, links not followed."""
    if entry.is_symlink() or not entry.is_dir():
        try:
            return 1, entry.lstat().st_size
        except OSError:
            return 0, 0
    files = total = 0
    for root, _dirs, names in os.walk(entry):  # os.walk does not follow links to folders
        for n in names:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
                files += 1
            except OSError:
                pass
    return files, total


def usage(path: Path | None = None) -> tuple[Path, list[Usage]]:
    """The cache directory and, for each kind (``other`` last), how many files it holds and their size."""
    root = checked_dir(path)
    counts = {kind: [0, 0] for kind in (*KINDS, OTHER)}
    if root.is_dir():
        for entry in root.iterdir():
            files, size = _size(entry)
            c = counts[kind_of(entry.name)]
            c[0] += files
            c[1] += size
    return root, [Usage(kind, n, b) for kind, (n, b) in counts.items()]


def clear(kind: str = "all", path: Path | None = None) -> tuple[Path, list[Usage]]:
    """Delete every entry of ``kind`` (one of ``KINDS`` or ``all``: every kind, never ``other``) from the
    cache directory; returns what was deleted, per kind. Only the directory's own entries are touched:
    a link is unlinked, a folder removed with what it holds (links inside it unlinked, not followed)."""
    if kind != "all" and kind not in KINDS:
        raise CacheError(f"unknown cache kind {kind!r}; known: {', '.join(KINDS)}, all")
    root = checked_dir(path)
    wanted = set(KINDS) if kind == "all" else {kind}
    removed = {k: [0, 0] for k in KINDS if k in wanted}
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            k = kind_of(entry.name)
            if k not in wanted or entry.parent != root:
                continue
            files, size = _size(entry)
            _remove(entry)
            removed[k][0] += files
            removed[k][1] += size
    return root, [Usage(k, n, b) for k, (n, b) in removed.items()]


def _remove(entry: Path) -> None:
    if entry.is_symlink() or not entry.is_dir():
        entry.unlink(missing_ok=True)
    else:
        shutil.rmtree(entry)  # refuses to start on a link; inside, links are removed, not followed


def human(n: int) -> str:
    """Bytes as a person reads them: 0 B, 812 KB, 64.0 MB, 1.1 GB."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"

"""The one way kvsim compiles a kernel: ``@kernel`` (numba's ``njit``, cached on disk, releasing the
GIL) where numba is installed, the plain Python function where it is not, so every caller still
works (slower) without it. ``AVAILABLE`` says which.

``nogil``: a sweep runs its batches on several threads at once, and the app's solves and replays run
in background threads while the UI thread draws; ``cache``: the compiled code is kept beside the
module (``__pycache__``, or under ``NUMBA_CACHE_DIR``), so only the first process after an install
pays for compiling.

Compiling is what a brand-new install waits for (seconds per kernel family), so a caller that must
not wait (the app's page) can ask for the compiled paths only: inside ``compiled_only()``, ``use(group)``
is true only for a group of kernels ``mark_compiled`` has named (compiled, or loaded from numba's disk
cache, in this process); elsewhere it is simply ``AVAILABLE``. A caller that gets False takes its
reference or NumPy path, which gives the same results.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager

try:
    from numba import njit
except ImportError:  # numba is in requirements.txt; without it every kernel runs as Python
    njit = None

#: True when kernels are compiled; False means the reference paths run instead (identical results)
AVAILABLE = njit is not None


def kernel(fn):
    return njit(cache=True, nogil=True)(fn) if AVAILABLE else fn


_compiled: set[str] = set()
_lock = threading.Lock()
_only_compiled = contextvars.ContextVar("kvsim_only_compiled", default=False)


def mark_compiled(group: str) -> None:
    """Say that the kernels of ``group`` are compiled in this process: calling them costs no compiling."""
    with _lock:
        _compiled.add(group)


def compiled(group: str) -> bool:
    """Whether ``mark_compiled(group)`` was called in this process."""
    with _lock:
        return group in _compiled


@contextmanager
def compiled_only() -> Iterator[None]:
    """Within this block (in this thread or task only) ``use`` is true only for compiled groups."""
    token = _only_compiled.set(True)
    try:
        yield
    finally:
        _only_compiled.reset(token)


def use(group: str) -> bool:
    """Whether a caller should take the kernels of ``group`` now: numba is there, and either they are
    compiled or this caller is not inside ``compiled_only()`` (it may wait for a compile)."""
    return AVAILABLE and (not _only_compiled.get() or compiled(group))


def on_disk(*kernels) -> bool:
    """Whether numba's disk cache holds compiled code, fresh for the source as it is now, for every
    one of ``kernels`` (so that a first call loads it rather than compiling): one small index file
    read per kernel. True without numba (nothing to compile); False where numba's cache cannot be
    read this way (the cautious answer)."""
    if not AVAILABLE:
        return True
    try:
        return all(bool(k._cache._cache_file._load_index()) for k in kernels)
    except Exception:  # another numba's internals, an unreadable index: assume a compile
        return False

"""``atomic_write``: the one way kvsim writes a file that another process may be reading (a trace,
a cache entry, a solved schedule), below every module that writes one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, write: Callable) -> None:
    """``write(f)`` into a temporary file beside ``path``, then renamed onto it: a reader sees the old
    file or the whole new one, never half of one. The temporary file is removed on any failure."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

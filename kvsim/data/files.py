"""``atomic_write``: the one way kvsim writes a file that another process may be reading (a trace,
a cache entry, a solved schedule), below every module that writes one; ``stamp`` and ``settled``:
how a reader knows a file it checked once is still that file, without reading it again."""

from __future__ import annotations

import os
import tempfile
import time
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


#: a file is trusted by its stamp only once it is older than this: a file rewritten within the file
#: system's timestamp tick (4 ms where that is the kernel's coarse clock) could keep its size and times,
#: so a stamp taken at that very moment is not trusted later (as git treats its index's "racy" files)
SETTLED_NS = 2_000_000_000


def stamp(path) -> list[int]:
    """What changes whenever a file's bytes do: size, inode, modification and change times (the change
    time cannot be set back by a program; a rename onto the path brings another inode)."""
    st = os.stat(path)
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def settled(file_stamp: list[int]) -> bool:
    """Whether a file of this ``stamp`` was last written long enough ago for the stamp to be kept."""
    return time.time_ns() - max(file_stamp[2], file_stamp[3]) > SETTLED_NS

"""The work the app's sessions share, with no Streamlit in it (so it is tested without widgets):

- ``BoundedStore``: a dict of at most ``bound`` entries, the oldest dropped first, behind one lock.
  The sweeps, the tunings, the background jobs and the built curve figures are each held in one.
- ``Shared``: results by key, each computed once however many sessions ask at once (a session that
  asks while another computes waits for it, told so through ``waiting``).
- ``SweepStore``: the recent_window curves, by key: rows that grow as views ask for more windows,
  and that can be drawn from a coarse grid first while the refinement runs in the background.
- ``Background``: jobs by key on a small thread pool, polled by the page, so a slow solve never
  blocks a redraw and is done once per server.

A session's run may be ended at any Streamlit call (a rerun): every lock here is released whatever
happens, and the background threads never call Streamlit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

Rows = dict[int, dict]


class BoundedStore:
    """A dict of at most ``bound`` entries: past it the oldest (first put) is dropped. Every method
    holds the store's lock, so threads may share one."""

    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError(f"a store holds at least one entry, got bound {bound}")
        self.bound = bound
        self._items: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            return self._items.get(key, default)

    def put(self, key: Hashable, value: Any) -> Any:
        with self._lock:
            self._put(key, value)
            return value

    def setdefault(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The entry under ``key``, made by ``make()`` (under the lock: keep it quick) when absent."""
        with self._lock:
            if key not in self._items:
                self._put(key, make())
            return self._items[key]

    def pop(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            return self._items.pop(key, default)

    def keys(self) -> list:
        with self._lock:
            return list(self._items)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _put(self, key: Hashable, value: Any) -> None:
        self._items.pop(key, None)  # a key put again counts as new
        while len(self._items) >= self.bound:
            self._items.pop(next(iter(self._items)))
        self._items[key] = value


@dataclass
class Entry:
    """One key's result, and the lock its computing session holds."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    value: Any = None


Waiting = Callable[[], AbstractContextManager]


class Shared:
    """Results by key, at most ``bound`` of them, each computed once however many threads ask."""

    def __init__(self, bound: int) -> None:
        self._entries = BoundedStore(bound)

    @contextmanager
    def holding(self, key: Hashable, waiting: Waiting | None = None) -> Iterator[Entry]:
        """The key's entry with its lock held: a thread that finds it held by another waits, inside
        ``waiting()`` (a spinner), and then finds the other's result in ``entry.value``."""
        entry = self._entries.setdefault(key, Entry)
        held = entry.lock.acquire(blocking=False)
        try:
            if not held:
                with (waiting or nullcontext)():
                    held = entry.lock.acquire()
            yield entry
        finally:
            if held:
                entry.lock.release()

    def get(self, key: Hashable, compute: Callable[[], Any], waiting: Waiting | None = None) -> Any:
        """The key's result, from ``compute()`` the first time."""
        with self.holding(key, waiting) as entry:
            if entry.value is None:
                entry.value = compute()
            return entry.value


@dataclass(frozen=True)
class Status:
    """A background job as the page sees it: whether it is done, how far it got, its result."""

    done: bool
    fraction: float
    value: Any = None


class Background:
    """Jobs by key on a pool of ``workers`` threads; at most ``bound`` remembered (with their results)."""

    def __init__(self, workers: int = 1, bound: int = 64, name: str = "kvsim-background") -> None:
        self._jobs = BoundedStore(bound)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def poll(self, key: Hashable, work: Callable[[Callable[[float], None]], Any],
             needed: Callable[[], bool] = lambda: True) -> Status:
        """The key's job, started as ``work(progress)`` the first time it is asked for and
        ``needed()`` (a job not needed is done, with no result). A job that failed raises its
        exception here, once: the next poll starts it again."""
        def start():
            if not needed():
                return None
            progress = [0.0]
            return self._pool.submit(work, lambda f: progress.__setitem__(0, f)), progress

        job = self._jobs.setdefault(key, start)
        if job is None:
            self._jobs.pop(key)
            return Status(True, 1.0)
        future, progress = job
        if not future.done():
            return Status(False, progress[0])
        if future.exception() is not None:
            self._jobs.pop(key)
            raise future.exception()
        return Status(True, 1.0, future.result())

    def busy(self, key: Hashable) -> bool:
        """Whether the key's job is running (False once it has ended, or when there is none)."""
        job = self._jobs.get(key)
        return job is not None and not job[0].done()

    def submit(self, work: Callable[[], Any]) -> Future:
        return self._pool.submit(work)


@dataclass
class Curve:
    """What ``SweepStore.curve`` hands back: the rows by window, and whether the refinement around
    the peak is in them (``exact``: the peak is the sweep's own; else it is the peak so far)."""

    rows: list[dict]
    exact: bool


class SweepStore:
    """Curves over one parameter by key: ``{value: row}`` that grows as views ask for more values."""

    def __init__(self, bound: int = 64, param: str = "recent_window", background: Background | None = None) -> None:
        self.param = param
        self._shared = Shared(bound)
        self._background = background or Background(name="kvsim-sweeps")

    def curve(self, key: Hashable, full: Callable[[], list[dict]], *, marks: Iterable[int] = (),
              add: Callable[[list[int]], list[dict]] | None = None, coarse: Callable[[], list[dict]] | None = None,
              waiting: Waiting | None = None) -> Curve:
        """The key's rows. ``full()``: the whole sweep, run once per key. With ``coarse``, a key
        not swept yet is first drawn from ``coarse()`` and ``full()`` runs in the background (the
        rows are then the coarse ones until it ends). ``marks``: values that must be in the rows;
        any missing is computed by ``add(missing)``."""
        with self._shared.holding(key, waiting) as entry:
            state = entry.value = entry.value or _Sweep()
            if not state.exact and state.refining is None:
                if coarse is None:
                    state.merge(full(), self.param, exact=True)
                else:
                    state.merge(coarse(), self.param)
                    state.refining = self._background.submit(lambda: self._refine(key, state, full))
            wanted = [m for m in marks if m not in state.rows]
            if wanted and add is not None:
                state.merge(add(wanted), self.param)
            return Curve([state.rows[v] for v in sorted(state.rows)], state.exact)

    def _refine(self, key: Hashable, state: _Sweep, full: Callable[[], list[dict]]) -> None:
        try:
            rows = full()
        except BaseException:
            with self._shared.holding(key):
                state.refining = None  # the next ask starts it again
            raise
        with self._shared.holding(key):
            state.merge(rows, self.param, exact=True)
            state.refining = None

    def exact(self, key: Hashable) -> bool:
        """Whether the key's rows hold the whole sweep (False while it is refined or not begun)."""
        with self._shared.holding(key) as entry:
            return entry.value is not None and entry.value.exact

    def busy(self, key: Hashable) -> bool:
        """Whether the key's refinement is running in the background."""
        with self._shared.holding(key) as entry:
            return entry.value is not None and entry.value.refining is not None


@dataclass
class _Sweep:
    rows: Rows = field(default_factory=dict)
    exact: bool = False
    refining: Future | None = None

    def merge(self, rows: list[dict], param: str, exact: bool = False) -> None:
        self.rows.update({int(r[param]): r for r in rows})
        self.exact = self.exact or exact

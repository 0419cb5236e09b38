"""The work the app's sessions share, with no Streamlit in it (so it is tested without widgets):

- ``BoundedStore``: a dict of at most ``bound`` entries, the oldest dropped first, behind one lock.
  The sweeps, the tunings, the background jobs and the built curve figures are each held in one.
- ``Shared``: results by key, each computed once however many sessions ask at once (a session that
  asks while another computes waits for it, told so through ``waiting``).
- ``SweepStore``: the recent_window curves, by key: rows that grow as views ask for more windows,
  and that can be drawn from a coarse grid first while the refinement, and then every window,
  are replayed in the background.
- ``Background``: jobs by key on a small thread pool, polled by the page, so a slow solve never
  blocks a redraw and is done once per server; at a lower priority than the pages, and, asked for
  inside ``starting_after()`` (a page's run), started once that run has drawn its page.
- ``Warmup``: the compiling of the fast engine's kernels, once per server, in order of need on one
  thread, so that a brand-new install draws its page on the reference path meanwhile.

A session's run may be ended at any Streamlit call (a rerun): every lock here is released whatever
happens, and the background threads never call Streamlit.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from ..policykit.base import WINDOW

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


#: the longest a job asked for inside ``starting_after()`` waits for that block to end (a run that
#: hangs must not keep its background work, or another session's behind it, from ever starting)
HOLD_S = 5.0
#: and how long after that end it waits still: the server sends what the run drew and the page draws
#: it meanwhile. On the two-core machine the curve at budget 1024 is sent and drawn in about 0.5 s
#: after its run; with the refinement replaying on both cores from the run's end that took 0.6-0.8 s,
#: and the refined curve's rerun often began before the first paint was done
SETTLE_S = 0.5
_held = threading.local()


class _Gate:
    """When a run's block ended (None until it has), for the jobs it asked for."""

    def __init__(self) -> None:
        self._ended = threading.Event()
        self.ended_at = 0.0

    def end(self) -> None:
        self.ended_at = time.monotonic()
        self._ended.set()

    def wait(self) -> None:
        """Until the block ended and ``SETTLE_S`` more have passed (one wait for all its jobs, not one each)."""
        if self._ended.wait(HOLD_S):
            time.sleep(max(0.0, self.ended_at + SETTLE_S - time.monotonic()))


@contextmanager
def starting_after() -> Iterator[None]:
    """Background jobs asked for by this thread inside the block start once it ends and
    ``SETTLE_S`` more have passed (at most ``HOLD_S`` after they were asked for, should it not end):
    a page's run sends what it has drawn, and the page draws it, before its background work takes the
    cores. (The curve at budget 1024 drew its coarse grid while its refinement was already replaying
    on both cores of the machine, beside the run's own reference lines and figure.)"""
    gate, previous = _Gate(), getattr(_held, "gate", None)
    _held.gate = gate
    try:
        yield
    finally:
        _held.gate = previous
        gate.end()


def _after_the_run(work: Callable) -> Callable:
    """``work``, waiting first for the ``starting_after()`` block it was asked for in (if any)."""
    gate = getattr(_held, "gate", None)
    if gate is None:
        return work

    def held(*args):
        gate.wait()
        return work(*args)

    return held


def lower_priority(nice: int) -> None:
    """Lower this thread's scheduling priority by ``nice`` (and so that of the threads it starts,
    which inherit it): on Linux each thread has a nice value of its own. Elsewhere, nothing."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


@dataclass(frozen=True)
class Status:
    """A background job as the page sees it: whether it is done, how far it got, its result."""

    done: bool
    fraction: float
    value: Any = None
    #: seconds since the job began its work; None while it waits for a worker (or once done)
    elapsed_s: float | None = None


class Background:
    """Jobs by key on a pool of ``workers`` threads; at most ``bound`` remembered (with their results).
    ``nice``: how much lower than the caller's the pool's threads (and the threads their jobs start)
    are scheduled, so that the pages' runs and the server's own thread come first."""

    def __init__(self, workers: int = 1, bound: int = 64, name: str = "kvsim-background", nice: int = 0) -> None:
        self._jobs = BoundedStore(bound)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=lower_priority,
                                        initargs=(nice,))

    def poll(self, key: Hashable, work: Callable[[Callable[[float], None]], Any],
             needed: Callable[[], bool] = lambda: True) -> Status:
        """The key's job, started as ``work(progress)`` the first time it is asked for and
        ``needed()`` (a job not needed is done, with no result). A job that failed raises its
        exception here, once: the next poll starts it again."""
        def start():
            if not needed():
                return None
            progress = [0.0, None]  # the fraction done, and when the work began (the page says when it ends)

            def timed(report):
                progress[1] = time.monotonic()
                return work(report)

            return self._pool.submit(_after_the_run(timed), lambda f: progress.__setitem__(0, f)), progress

        job = self._jobs.setdefault(key, start)
        if job is None:
            self._jobs.pop(key)
            return Status(True, 1.0)
        future, progress = job
        if not future.done():
            began = progress[1]
            return Status(False, progress[0], elapsed_s=None if began is None else time.monotonic() - began)
        if future.exception() is not None:
            self._jobs.pop(key)
            raise future.exception()
        return Status(True, 1.0, future.result())

    def busy(self, key: Hashable) -> bool:
        """Whether the key's job is running (False once it has ended, or when there is none)."""
        job = self._jobs.get(key)
        return job is not None and not job[0].done()

    def submit(self, work: Callable[[], Any]) -> Future:
        return self._pool.submit(_after_the_run(work))


@dataclass
class Curve:
    """What ``SweepStore.curve`` hands back: the rows by window, whether the refinement around the
    peak is in them (``exact``: the peak is the sweep's own; else it is the peak so far), and whether
    every value asked for is (``complete``: then the best is known, not only a peak)."""

    rows: list[dict]
    exact: bool
    complete: bool = False


class SweepStore:
    """Curves over one parameter by key: ``{value: row}`` that grows as views ask for more values."""

    def __init__(self, bound: int = 64, param: str = WINDOW, background: Background | None = None) -> None:
        self.param = param
        self._shared = Shared(bound)
        self._background = background or Background(name="kvsim-sweeps")

    def curve(self, key: Hashable, full: Callable[[], list[dict]], *, marks: Iterable[int] = (),
              add: Callable[[list[int]], list[dict]] | None = None, coarse: Callable[[], list[dict]] | None = None,
              every: Sequence[int] = (), waiting: Waiting | None = None,
              kept: Callable[[list[int] | None], list[dict] | None] | None = None) -> Curve:
        """The key's rows. ``full()``: the whole sweep, run once per key. With ``coarse``, a key
        not swept yet is first drawn from ``coarse()`` and ``full()`` runs in the background (the
        rows are then the coarse ones until it ends); once it has, the next ask starts ``add`` of
        whichever of ``every`` the rows still miss in the background, behind the jobs asked for
        meanwhile (``Curve.complete`` once it has ended). ``marks``: values that must be in the rows;
        any missing is computed by ``add(missing)``. ``kept(None)``: ``full()``'s rows where an
        earlier server kept them on disk, else None (nothing computed); ``kept(values)`` the same for
        ``add(values)``: what is kept is read at once, in this run, not left to the background (a
        fresh server drew a shipped trace's curve coarse, then ran the page twice more as each
        refinement, read from the disk in a moment, ended)."""
        with self._shared.holding(key, waiting) as entry:
            state = entry.value = entry.value or _Sweep()
            if state.refining is None and not state.exact:
                known = None if kept is None or coarse is None else kept(None)
                if coarse is None:
                    state.merge(full(), self.param, exact=True)
                elif known is not None:
                    state.merge(known, self.param, exact=True)
                else:
                    state.merge(coarse(), self.param)
                    state.refining = self._background.submit(lambda: self._refine(key, state, full))
            if state.refining is None and state.exact and coarse is not None and add is not None:
                fill = [v for v in every if v not in state.rows]
                known = None if not fill or kept is None else kept(fill)
                if known is not None:
                    state.merge(known, self.param)
                elif fill:
                    state.refining = self._background.submit(lambda: self._refine(key, state, lambda: add(fill)))
            wanted = [m for m in marks if m not in state.rows]
            if wanted and add is not None:
                state.merge(add(wanted), self.param)
            complete = state.exact and all(v in state.rows for v in every)
            return Curve([state.rows[v] for v in sorted(state.rows)], state.exact, complete)

    def _refine(self, key: Hashable, state: _Sweep, work: Callable[[], list[dict]]) -> None:
        """``work()`` merged into the rows, which are then refined; on a failure the next ask starts again."""
        try:
            rows = work()
            with self._shared.holding(key):
                state.merge(rows, self.param, exact=True)
        finally:
            with self._shared.holding(key):
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


@dataclass(frozen=True)
class Job:
    """One family of kernels: ``prepare(progress)`` compiles or loads them (``progress(None, note)``
    when numba really compiles), ``cached()`` says cheaply whether numba's disk cache holds them
    (then ``prepare`` only loads them, a fraction of a second), ``estimate_s`` how long its own
    compile takes; ``shared``: it also compiles what the warm-up's ``shared_s`` stands for (code
    that every such job calls, compiled by whichever runs first)."""

    prepare: Callable[[Callable], None]
    cached: Callable[[], bool]
    estimate_s: float
    shared: bool = False


class Warmup:
    """Jobs by name, each run once per server: loaded at once in the page's thread when numba's disk
    cache holds them (``load``), else compiled on one daemon thread in the order asked for (``want``)
    while the pages take the reference paths, and said in one line (``note``). A job that fails is
    remembered in ``failed``: its callers keep the reference path, which gives the same results.

    ``elsewhere(names)``, when given, compiles the jobs not on disk first in another process (into
    numba's disk cache), so that the server's threads keep the interpreter while numba works: the
    job then only loads them here. Should it fail, the job compiles them here."""

    def __init__(self, jobs: dict[str, Job], shared_s: float = 0.0, name: str = "kvsim-warmup",
                 elsewhere: Callable[[list[str]], None] | None = None) -> None:
        self._jobs, self._shared_s, self._name, self._elsewhere = jobs, shared_s, name, elsewhere
        self._queue: list[str] = []
        self._done: set[str] = set()
        self._asked: set[str] = set()  # queued once, whether run, running or waiting
        self._lock = threading.Lock()
        self._running = False  # a thread is on the queue (set and cleared under the lock)
        self.compiling_since: float | None = None  # when the thread began (None: it has not)
        self.failed: dict[str, str] = {}

    def pending(self, names: Iterable[str]) -> list[str]:
        """The jobs among ``names`` not run yet, in order, once each."""
        with self._lock:
            return list(dict.fromkeys(n for n in names if n in self._jobs and n not in self._done and n not in self.failed))

    def cached(self, names: Iterable[str]) -> bool:
        """Whether every pending job among ``names`` is in numba's disk cache (loading, not compiling)."""
        return all(self._jobs[n].cached() for n in self.pending(names))

    def load(self, names: Iterable[str]) -> None:
        """Run the pending jobs among ``names`` in this thread: for jobs ``cached`` says are on disk."""
        for n in self.pending(names):
            self._run_one(n)

    def want(self, names: Iterable[str]) -> None:
        """Queue the pending jobs among ``names`` for the thread, and start it."""
        with self._lock:
            new = [n for n in dict.fromkeys(names) if n in self._jobs and n not in self._done and n not in self._asked]
            self._asked.update(new)
            self._queue += new
            if new and not self._running:
                self._running = True
                self.compiling_since = self.compiling_since or time.monotonic()
                threading.Thread(target=self._run, name=self._name, daemon=True).start()

    def busy(self) -> bool:
        with self._lock:
            return self._running

    def note(self, names: Iterable[str]) -> str | None:
        """One line while jobs among ``names`` are compiling or about to (none on disk), else None."""
        compiling = [n for n in self.pending(names) if not self._jobs[n].cached()]
        if not compiling:
            return None
        spent = 0.0 if self.compiling_since is None else time.monotonic() - self.compiling_since
        total = sum(self._jobs[n].estimate_s for n in compiling)
        if any(self._jobs[n].shared for n in compiling) and not any(self._jobs[n].shared for n in self._done):
            total += self._shared_s
        how = (f"about {max(5, 5 * round((total - spent) / 5))} s" if spent < total - 2.5 else
               f"{spent:.0f} s so far; what is left takes about {total:.0f} s on two idle cores, longer on a busy machine")
        return (f"Compiling the fast engine once for this install ({how}); the views drawn meanwhile use the "
                "reference path, with the same results, and the page is drawn again on the engine when it ends.")

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                names, self._queue = self._queue, []
            todo = [n for n in names if not self._jobs[n].cached()]
            if todo and self._elsewhere is not None:
                try:
                    self._elsewhere(todo)
                except Exception:  # noqa: S110 -- then each job compiles here instead
                    pass
            for name in names:
                self._run_one(name)

    def _run_one(self, name: str) -> None:
        try:
            self._jobs[name].prepare(lambda fraction, note="": None)
        except Exception as e:  # kept for the page; the reference path stays in use
            with self._lock:
                self.failed[name] = f"{type(e).__name__}: {e}"
            return
        with self._lock:
            self._done.add(name)

"""Progress on stderr for the CLI's long steps, through ``kvsim.progress.stderr``, and the engine's
compile announced when a replay of the step compiles.

A step reports only to a person: when stderr is a terminal (a script that captures stderr reads an
empty one after a success, however loaded the machine), and only once it has run ``PATIENCE`` seconds,
so a quick command stays quiet. Past that its latest note shows, and every report after it; the note
shows even when nothing reports meanwhile, as the engine's first compile is one call that says nothing
for seconds.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .. import progress as protocol
from ..sim import engine

PATIENCE = 2.0

#: the compile listeners ``prepare`` installed in the steps now open, removed as each step ends
_listening: list = []


@contextmanager
def step(prefix: str, note: str, quiet: bool | None = None, after: float = PATIENCE) -> Iterator[protocol.Progress | None]:
    """A ``progress(fraction, note)`` for one step, None when ``quiet`` (by default: when stderr is not a
    terminal). A report without a note keeps the step's latest one, so the engine's bare fractions read
    ``replay: replaying h2o on canonical 40%``."""
    if quiet is None:
        quiet = not sys.stderr.isatty()
    if quiet:
        yield None
        return
    out = protocol.stderr(prefix)
    lock = threading.Lock()
    state = {"shown": False, "done": False, "last": (None, note)}

    def report(fraction: float | None, note: str = "") -> None:
        with lock:
            state["last"] = (fraction, note or state["last"][1])
            if state["shown"] and not state["done"]:
                out(*state["last"])

    def wake() -> None:
        with lock:
            if not state["done"]:
                state["shown"] = True
                out(*state["last"])

    timer = threading.Timer(after, wake)
    timer.daemon = True
    timer.start()
    opened = len(_listening)
    try:
        yield report
    finally:
        with lock:
            state["done"] = True
        timer.cancel()
        while len(_listening) > opened:
            engine.stop_announcing(_listening.pop())


def prepare(policies, progress: protocol.Progress | None) -> None:
    """Say so on stderr when a replay of the step compiles kernels (the first run after an install, or
    the first of a trace kind), instead of sitting silent inside it (``kvsim.sim.engine.announce_compile``).
    Nothing is replayed ahead: a command loads only the kernels its replays run, from numba's disk cache
    when they are there (issue 36). A policy with no kernel (a plugin's, say) is said to run on the
    reference harness, the step's note while it is slow."""
    slow = [name for name in policies if name not in engine.FAST]
    if progress is not None and slow:  # shown only past PATIENCE, i.e. where the speed matters
        one = len(slow) == 1
        progress(None, f"{', '.join(slow)} {'has' if one else 'have'} no kernel: the reference harness replays "
                       f"{'it' if one else 'them'} (slower; the same figures)")
    names = [name for name in policies if name in engine.FAST]
    if progress is None or not names or not engine.AVAILABLE:
        return
    what = f"the {names[0]} engine" if len(names) == 1 else "the engine's kernels"
    note = f"compiling {what} (once per install, ~{engine.COMPILE_SECONDS * len(names)} s)"
    _listening.append(engine.announce_compile(lambda: progress(None, note)))

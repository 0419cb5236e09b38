"""Progress on stderr for the CLI's long steps, through ``kvsim.progress.stderr``, and the engine's
first compile announced before a replay.

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
    try:
        yield report
    finally:
        with lock:
            state["done"] = True
        timer.cancel()


def prepare(policies, progress: protocol.Progress | None) -> None:
    """Compile the engine's kernels for each policy now (``kvsim.sim.engine.prepare``), so the first
    run after installing says so instead of sitting silent inside the first replay."""
    for name in policies:
        engine.prepare(name, progress)

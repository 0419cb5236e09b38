"""Sweeps: one replay per value of one parameter (``recent_window``, ``sinks``, ... or ``budget``).

The CLI's ``sweep`` and ``table``, and the app's curves, all go through ``sweep`` so that a faster
engine only has to be wired in here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from . import engine
from .replay import DEFAULT_TOP_K
from .trace import Trace


def sweep(
    trace: Trace,
    policy: str,
    budget: int,
    param: str,
    values: Iterable[int],
    top_k: int = DEFAULT_TOP_K,
    progress: Callable[[int, int], None] | None = None,
    **params,
) -> list[dict]:
    """Replay ``trace`` through ``policy`` once per value of ``param``; one ``summary()`` dict each,
    in the order of ``values``. ``param="budget"`` varies the budget itself; ``params`` fixes the
    policy's other parameters. ``progress(done, total)`` reports how many replays' worth of work is
    done (the engine advances every configuration together, so ``done`` climbs in fractions of
    the whole and reaches ``total`` at the end).

    Every value is checked (by building its policy) before the first replay, so a bad value fails
    at once rather than after minutes of work. The work is done by ``kvsim.engine.sweep``: one pass
    for the policies it covers, the reference ``replay`` per value for the rest; same results.
    """
    values = list(values)
    total = len(values)
    report = None if progress is None else (lambda fraction: progress(min(total, int(fraction * total)), total))
    return engine.sweep(trace, policy, budget, param, values, top_k=top_k, progress=report, **params)


def best(rows: list[dict], metric: str = "retained_mass") -> dict:
    """The row with the largest ``metric``; the first such row on ties (the smallest swept value
    when the values ascend)."""
    if not rows:
        raise ValueError("no rows")
    return max(rows, key=lambda r: r[metric])  # max keeps the first of equal keys

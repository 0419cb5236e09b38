"""Sweeps: one replay per value of one parameter (``recent_window``, ``sinks``, ... or ``budget``).

The CLI's ``sweep`` and ``table``, and the app's curves, all go through ``sweep`` so that a faster
engine only has to be wired in here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .policies import POLICIES, make_policy
from .replay import DEFAULT_TOP_K, replay
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
    policy's other parameters. ``progress(done, total)`` is called after each replay.

    Every value is checked (by building its policy) before the first replay, so a bad value fails
    at once rather than after minutes of work.
    """
    values = [int(v) for v in values]
    if not values:
        raise ValueError(f"sweep over {param} needs at least one value")
    if param in params:
        raise ValueError(f"{param} is both swept and fixed")
    runs = [{"budget": v, **params} if param == "budget" else {"budget": budget, **params, param: v} for v in values]
    extra = {"trace": trace} if policy in POLICIES and POLICIES[policy].needs_trace else {}
    for run in runs:
        make_policy(policy, **run, **extra)  # raises ValueError naming the parameter
    rows = []
    for i, run in enumerate(runs):
        rows.append(replay(trace, policy, top_k=top_k, **run).summary())
        if progress is not None:
            progress(i + 1, len(runs))
    return rows


def best(rows: list[dict], metric: str = "retained_mass") -> dict:
    """The row with the largest ``metric``; the first such row on ties (the smallest swept value
    when the values ascend)."""
    if not rows:
        raise ValueError("no rows")
    return max(rows, key=lambda r: r[metric])  # max keeps the first of equal keys

"""Decisions at intervals (``evict_every`` k; docs/domain.md, "What a serving engine allows"): the policy
decides only at steps that are multiples of k and then evicts down to what the next k - 1 admissions leave
room for (``budget - k + 1`` positions without blocks); in between the cache grows, never past the budget.
With blocks the room is counted in blocks: the blocks the steps up to the next decision will open."""

from __future__ import annotations


def decides(t: int, k: int) -> bool:
    """Whether step ``t`` is a decision step."""
    return t % k == 0


def to_open(t: int, k: int, s: int) -> int:
    """How many blocks of ``s`` the steps ``t + 1 .. t + k - 1`` (those before the next decision) open: the
    multiples of ``s`` among them (``k - 1`` positions when ``s`` is 1)."""
    return (t + k - 1) // s - t // s


def held_bounds(t: int, memory: int, floor: int) -> tuple[int, int]:
    """The positions held after step ``t`` under a layout: the cache grows by one a step until it is full,
    then stays between ``floor`` (right after a decision) and ``memory``: ``(min(t + 1, floor), min(t + 1,
    memory))``, what the harness checks."""
    return min(t + 1, floor), min(t + 1, memory)

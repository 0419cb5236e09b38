"""Shared selection (``shared_selection``; docs/domain.md, "What a serving engine allows"): a layer's KV heads
hold the same positions, chosen once for all of them; a position's score is the sum of its scores over the
heads, added in head order, while each head's policy still accumulates its own state from its own attention.
Without it each head scores, and chooses, alone."""

from __future__ import annotations

import numpy as np

from ..base import Policy
from .priorities import LayoutError, priorities


def scores(heads: list[Policy], shared: bool) -> list[np.ndarray]:
    """Each head's scores aligned with its kept set: its own, or (shared) the heads' sum, the same array for
    every head. The heads must hold the same positions to share."""
    own = [priorities(h) for h in heads]
    if not shared or len(heads) == 1:
        return own
    kept = heads[0].kept
    for i, h in enumerate(heads[1:], start=1):
        if not np.array_equal(h.kept, kept):
            raise LayoutError(f"shared selection: KV head {i} holds other positions than head 0")
    total = np.zeros(kept.size)
    for s in own:  # head order, one float64 addition each
        total = total + s
    return [total] * len(heads)

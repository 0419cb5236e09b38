"""Blocks (``block_size`` s; docs/domain.md, "What a serving engine allows"): positions ``[j s, (j + 1) s)``
are block j; the cache is ``budget // s`` blocks, the newest one filling. Only complete blocks leave (a
block is complete once its s-th position is admitted; with s = 1 every block is), whole, the lowest block
score first: the sum of its positions' scores under the policy's own rule (``priorities``), added in
position order; the older block on ties. A block holding a position the policy never evicts (its recent
window, its sinks, the newest) has score ``inf`` and is not chosen."""

from __future__ import annotations

import numpy as np

from ...data.gqa import position_sum
from .priorities import LayoutError


def held_blocks(kept: np.ndarray, s: int) -> int:
    """How many blocks ``kept`` (ascending positions) occupies, the filling one included."""
    if kept.size == 0:
        return 0
    b = kept // s
    return int(1 + np.count_nonzero(np.diff(b)))


def choose(kept: np.ndarray, scores: np.ndarray, t: int, s: int, n: int, who: str = "the policy") -> np.ndarray:
    """The positions of the ``n`` complete blocks with the lowest scores (``scores`` aligned with ``kept``,
    ascending positions; ``t`` the newest admitted), ascending; the older block first on ties. LayoutError
    when fewer than ``n`` complete blocks may leave (every one of them holds a protected position)."""
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    block = kept // s
    ids, starts = np.unique(block, return_index=True)
    bounds = np.append(starts, kept.size)
    complete = (ids < t // s) | ((t + 1) % s == 0)  # the block of t is complete once its s-th position is in
    total = np.array([float(position_sum(scores[a:b])) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    total[~complete] = np.inf
    order = np.argsort(total, kind="stable")[:n]  # stable: equal scores take the older (lower) block first
    if order.size < n or not np.all(np.isfinite(total[order])):
        raise LayoutError(f"{who} at step {t}: {n} whole block(s) of {s} must leave, but only "
                          f"{int(np.isfinite(total).sum())} complete block(s) hold no position it protects "
                          "(its recent window or sinks cover the rest): a larger budget or a smaller window")
    chosen = np.isin(block, ids[order])
    return kept[chosen].astype(np.int64)

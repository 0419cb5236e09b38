"""The cache under a layout: ``LayoutCache`` wraps one online policy per KV head of a layer (one, for a
single trace) and applies blocks (``paged``), shared selection (``shared``) and decisions at intervals
(``intervals``) to them, in any combination; ``LayoutPolicy`` is one head of it as a ``Policy``, which the
reference harness steps like any other (``kvsim.sim.harness.step``) and whose held count it checks against
``held_bounds`` instead of ``min(t + 1, budget)``.

Each step the heads' policies see and admit position t as they would alone; then, at a decision step
(``t`` a multiple of k), the cache evicts until the blocks it holds and those the steps before the next
decision will open fit the memory (``budget // s`` blocks): the lowest complete blocks by each head's own
scores, or by their sum under shared selection, removed from every head's state (``priorities.drop``).
With s = 1 and one head unshared, the interval decision is the policy's own ``evict`` to ``budget - k + 1``,
its own rule exactly (its draws, its ranks). With no constraint at all no wrapper is built
(``wrap``): the bare policy, today's replay bit for bit.
"""

from __future__ import annotations

import numpy as np

from ..base import Policy
from . import Layout, intervals, paged, shared
from .priorities import LayoutError, drop


class LayoutCache:
    """The heads' policies (built at the layout's memory) under ``layout`` at ``budget`` (as asked)."""

    def __init__(self, heads: list[Policy], layout: Layout, budget: int) -> None:
        if not heads:
            raise LayoutError("a layout needs at least one head's policy")
        self.heads, self.layout = heads, layout
        self.memory, self.note = layout.memory(budget)
        self.floor = layout.floor(budget)
        if self.floor < 1:
            raise LayoutError(f"{layout.label} does not fit budget {budget}")
        self.blocks = self.memory // layout.block_size

    @property
    def name(self) -> str:
        return self.heads[0].name

    def evict(self, t: int) -> list[np.ndarray]:
        """Step ``t``'s eviction (every head has admitted t): each head's victims, ascending."""
        s, k = self.layout.block_size, self.layout.evict_every
        none = [np.zeros(0, dtype=np.int64) for _ in self.heads]
        if not intervals.decides(t, k):
            return none
        opening = intervals.to_open(t, k, s)
        if s == 1 and len(self.heads) == 1:  # one head, positions: the policy's own rule, to budget - k + 1
            head = self.heads[0]
            if head.kept.size + opening <= self.memory:
                return none
            return [np.asarray(head.evict(self.memory - opening), dtype=np.int64)]
        if not self.layout.shared_selection and len(self.heads) > 1:
            return [self._one(t, [h], s, opening)[0] for h in self.heads]
        return self._one(t, self.heads, s, opening)

    def _one(self, t: int, heads: list[Policy], s: int, opening: int) -> list[np.ndarray]:
        """The heads ``heads`` (several only when shared) choosing together."""
        kept = heads[0].kept
        n = paged.held_blocks(kept, s) + opening - self.blocks
        if n <= 0:
            return [np.zeros(0, dtype=np.int64) for _ in heads]
        scores = shared.scores(heads, self.layout.shared_selection)
        victims = paged.choose(kept, scores[0], t, s, n, f"{self.name} ({self.layout.label})")
        for h in heads:
            drop(h, victims)
        return [victims] * len(heads)

    def held_bounds(self, t: int) -> tuple[int, int]:
        return intervals.held_bounds(t, self.memory, self.floor)


class LayoutPolicy(Policy):
    """One head under a layout, as a ``Policy``: ``kept``, ``see`` and ``on_decode_step`` are the wrapped
    policy's; ``evict`` is the layout's (whatever budget it is handed: the layout's memory is the budget)."""

    def __init__(self, inner: Policy, layout: Layout, budget: int) -> None:
        self.cache = LayoutCache([inner], layout, budget)
        super().__init__(self.cache.memory, inner.rng)
        self.inner, self.layout, self.asked = inner, layout, budget
        self.name = inner.name
        self.reads_attention, self.keeps_scores, self.reads = inner.reads_attention, inner.keeps_scores, inner.reads
        self.tunables, self.needs_trace = inner.tunables, inner.needs_trace
        self._t = 0

    @property
    def params(self) -> dict[str, int]:
        return self.inner.params

    @property
    def kept(self) -> np.ndarray:
        return self.inner.kept

    @property
    def scores(self) -> np.ndarray:
        return self.inner.scores

    def see(self, pos, vectors) -> None:
        self.inner.see(pos, vectors)

    def on_decode_step(self, pos: int, attn) -> None:
        self.inner.on_decode_step(pos, attn)
        self._t = pos

    def evict(self, budget: int) -> list[int]:
        return [int(v) for v in self.cache.evict(self._t)[0]]

    def held_bounds(self, t: int, budget: int) -> tuple[int, int]:
        return self.cache.held_bounds(t)

    def __repr__(self) -> str:
        return f"{self.inner!r} under {self.layout.label}"


def wrap(policy: Policy, layout: Layout | None, budget: int) -> Policy:
    """``policy`` (built at the layout's memory) under ``layout``; the bare policy when there is no constraint."""
    if layout is None or layout.plain:
        return policy
    return LayoutPolicy(policy, layout, budget)

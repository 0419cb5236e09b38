"""The deployed cache under a serving layout (docs/serving.md, "The deployed cache under a layout"):
``kvsim.hf.cache(model, policy, budget, block_size=S, shared_selection=True, evict_every=K)`` or a plan's
``layout``.

The same ``EvictingLayer`` over another store and other steps. Its store is ``kvsim.hf.paging.Paged``: the
layout's memory (``Layout.memory``: the budget rounded down to whole blocks) as physical blocks of S slots
per KV head, one block table per row for all of a layer's KV heads under shared selection. Its steps are the
simulator's: the decision is ``kvsim.policykit.layouts.held.LayoutCache``'s, the code ``replay_layout`` (one
KV head) and ``replay_layer`` (a layer's heads) run, with no second copy of the rule here. Each step every
KV head's policy (built at the layout's memory) is shown its row over what it holds (the combining rule
of ``kvsim.data.gqa``, renormalised, as ``kvsim.sim.harness.step`` shows it) and admits t; then, per row,
one ``LayoutCache`` over all the layer's heads (shared selection) or one per head decides at the steps
that are multiples of K, whole complete blocks leaving, and the store frees their blocks. What each head
holds is checked against the layout's bounds every step (``ContractError``), as the harness checks a
replay's.

With no layout at all (block size 1, no shared selection, an interval of 1) ``kvsim.hf.cache`` builds
today's layer: the same tokens, the same bytes.
"""

from __future__ import annotations

import numpy as np

from ..policies import Policy, PolicySpec
from ..policykit.base import ContractError
from ..policykit.layouts import Layout
from ..policykit.layouts.held import LayoutCache
from ..sim.harness import observe
from .cache import EvictingLayer, HFError
from .paging import Paged


class LayoutSteps:
    """``policies[row][kv head]`` (each built at the layout's memory) under ``layout`` at the asked ``budgets``
    (``[row][kv head]``): per row, one ``LayoutCache`` per group of heads choosing together (``groups``)."""

    resumed = None  # no compressed prompt under a layout

    def __init__(self, policies: list[list[Policy]], budgets: list[list[int]], layout: Layout, groups: list[list[int]]):
        self.policies, self.layout, self.groups = policies, layout, groups
        self.caches = [[LayoutCache([row[h] for h in g], layout, budgets[b][g[0]]) for g in groups]
                       for b, row in enumerate(policies)]

    def reader(self, b: int, h: int) -> Policy:
        return self.policies[b][h]

    def readers(self) -> list[type]:
        return [type(p) for row in self.policies for p in row]

    def step(self, layer, b: int, t: int, shown: list, key, value, q) -> None:
        """Row b's step t: every KV head shown ``shown[h]`` (its weights on what it holds, ascending; None at
        t = 0) and t's vectors, t admitted; then each group's decision, checked, and its blocks settled.
        ``key``, ``value`` ``(kv heads, d)`` and ``q`` ``(kv heads, G, d)`` are t's own."""
        for g, heads in enumerate(self.groups):
            for h in heads:
                policy = self.policies[b][h]
                vectors = layer.vectors.of(policy, b, h, t, key[h], value[h], q[h])
                if vectors is not None:
                    policy.see(t, vectors)
                if t:
                    policy.on_decode_step(t, observe(shown[h]) if policy.reads_attention else None)
            victims = [np.zeros(0, dtype=np.int64)] * len(heads)
            if t:
                cache = self.caches[b][g]
                before = [self.policies[b][h].kept for h in heads]
                victims = cache.evict(t)
                for i, h in enumerate(heads):
                    _check(self.policies[b][h], cache, t, before[i], victims[i], f"{layer.name} KV head {h}")
            layer.store.settle(b, g, t, victims[0])

    def after(self, layer, t: int, rows: list, key, value, q) -> None:
        """Step t, attended (``rows[h]``: KV head h's combined weights over its span, None at t = 0)."""
        store = layer.store
        for b in range(store.batch):
            shown = [None if rows[h] is None else rows[h][b, store.order[b][h] - store.span(h).start]
                     for h in range(store.kv_heads)]
            layer._decide(b, t, shown, key[b], value[b], q[b])

    def chunk(self, layer, found, block, starts, key, value, q) -> None:
        """A chunk attended at once (``kvsim.hf.modes.fast``), stepped position by position: every head's rows
        of a block of queries first, then per position and row every head's row, t put in each head's staging
        slot, and the row's step."""
        store, t0 = layer.store, found.t0
        for a in starts:
            blocks = [block(h, a) for h in range(store.kv_heads)]
            for i, t in enumerate(blocks[0][0].tolist()):
                p = t - t0
                for b in range(store.batch):
                    shown = [found.row(b, h, rows[b, i]) if t else None for h, (_, rows) in enumerate(blocks)]
                    for h in range(store.kv_heads):
                        store.put(b, h, t, key[b, h, p], value[b, h, p])
                    layer._decide(b, t, shown, key[b, :, p], value[b, :, p], q[b, :, :, p])


def _check(policy: Policy, cache: LayoutCache, t: int, before: np.ndarray, victims: np.ndarray, where: str) -> None:
    """The harness's victims contract under a layout: held victims, ascending, the rest kept, and the count
    within the layout's bounds (``LayoutCache.held_bounds``)."""
    after = policy.kept
    low, high = cache.held_bounds(t)
    who = f"{where}: {policy.name} ({cache.layout.label}) step {t}"
    if victims.size and (np.any(np.diff(victims) <= 0) or not np.isin(victims, before).all()):
        raise ContractError(f"{who}: victims {victims.tolist()} not ascending or not held")
    if not low <= after.size <= high or after.size + victims.size != before.size or np.isin(victims, after).any():
        raise ContractError(f"{who}: holds {after.size} positions after eviction, expected {low} to {high}, "
                            f"the victims gone")


class LayoutLayer(EvictingLayer):
    """One decoder layer's cache under ``layout``: ``specs`` (one per KV head, at the asked budget) built at the
    layout's memory when the first keys tell the batch, or ``policies`` (``[row][kv head]``, built by the caller
    at the layout's memory: the closed loop's configurations, ``kvsim.models.quality_layout``), held in blocks
    (``Paged``), decided by ``LayoutCache``."""

    def __init__(self, specs: list[PolicySpec] | None, layout: Layout, *, policies: list[list[Policy]] | None = None,
                 prefill: str = "exact", rng_seed: int | None = None, meta: dict | None = None):
        if prefill == "compress":
            raise HFError("a serving layout holds the cache while decoding; prefill='compress' chooses each head's "
                          "positions once, alone: use prefill='exact' or 'fast'")
        if layout.plain:
            raise HFError("no layout to hold (block size 1, no shared selection, an interval of 1): an EvictingLayer")
        super().__init__(specs, policies=policies, prefill=prefill, rng_seed=rng_seed, meta=meta)
        self.layout = layout
        budgets = [s.budget for s in specs] if specs is not None else [p.budget for row in policies for p in row]
        memories = {layout.memory(b)[0] for b in budgets}
        if policies is not None and memories != set(budgets):
            raise HFError(f"policies under {layout.label} are built at its memory (whole blocks): got budgets {sorted(set(budgets))}")
        if len(memories) != 1:
            raise HFError("a layout holds a layer's KV heads in blocks of one size: give them one budget")
        self.memory = memories.pop()
        self.block_count = self.memory // layout.block_size

    def _layout(self, key_states, value_states):
        batch, hkv = key_states.shape[:2]
        if self.specs is not None and len(self.specs) != hkv:
            raise HFError(f"the cache was built for {len(self.specs)} KV head(s), the model gives {hkv}")
        if self.specs is not None:
            rng = None if self.rng_seed is None else np.random.default_rng(self.rng_seed)
            self.policies = [[s.replace(budget=self.memory).build(self.trace, rng=rng) for s in self.specs]
                             for _ in range(batch)]
            asked = [[int(s.budget) for s in self.specs] for _ in range(batch)]
        else:  # built at the memory, which the layout holds as asked (a whole number of blocks)
            asked = [[self.memory] * hkv for _ in range(batch)]
        if len(self.policies) != batch or any(len(row) != hkv for row in self.policies):
            raise HFError(f"the cache was built for {len(self.policies)} row(s) x {len(self.policies[0])} KV head(s), "
                          f"the model gives {batch} x {hkv}")
        self.budgets = [[self.memory] * hkv for _ in range(batch)]
        store = Paged(batch, hkv, self.block_count, self.layout.block_size, self.layout.shared_selection,
                      key_states, value_states)
        return store, LayoutSteps(self.policies, asked, self.layout, store.groups)

    def _decide(self, b: int, t: int, shown: list, key, value, q) -> None:
        """Row b's step t (``LayoutSteps.step``): what a listener wraps to hear each row's step, as it wraps
        ``_admit`` on a layer without a layout (``kvsim.models.needle_runs``)."""
        self.steps.step(self, b, t, shown, key, value, q)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def block_tables(self) -> int:
        """Block tables per row: one for the layer under shared selection, one per KV head else."""
        return 1 if self.layout.shared_selection else len(self.specs or self.policies[0])

    @property
    def block_peak(self) -> int:
        """The most physical blocks one row's block table held after a step."""
        return 0 if self.store is None else self.store.block_peak

    def held_blocks(self, row: int = 0, head: int = 0) -> list[int]:
        """The logical blocks (positions ``[j s, (j + 1) s)``) KV head ``head`` of ``row`` holds, ascending."""
        if self.store is None:
            return []
        return self.store.held_blocks(row, 0 if self.layout.shared_selection else head)


def memory(cache) -> dict | None:
    """What a deployed cache under a layout allocates per decoder layer and row, in whole blocks: ``blocks``
    physical blocks in each of ``block_tables`` tables (one under shared selection, one per KV head else), a
    block ``block_bytes`` (``block_size`` positions of every KV head of its table, keys and values), and one
    staging position (``staging_bytes``, every KV head's); ``block_peak``, the most blocks a table held. So
    ``cache.nbytes`` is layers x rows x (blocks x block_tables x block_bytes + staging_bytes). None for a cache
    without a layout."""
    layers = [x for x in cache.layers if isinstance(x, LayoutLayer)]
    if not layers:
        return None
    x = layers[0]
    out = {"layout": x.layout.label, **x.layout.to_dict(), "memory_positions": x.memory, "blocks": x.block_count,
           "block_tables": x.block_tables}
    if x.store is not None:
        k, v = x.store.keys, x.store.values
        position = (k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size()) * x.store.kv_heads
        out.update(block_bytes=position * x.block_size // x.block_tables, staging_bytes=position,
                   block_peak=max(y.block_peak for y in layers))
    return out


__all__ = ["LayoutLayer", "LayoutSteps", "memory"]

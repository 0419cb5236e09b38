"""adakv deployed: a decoder layer whose KV heads share one pool of positions in one store
(docs/allocation.md, docs/deploy.md, "adakv: one pool per layer").

The same ``EvictingLayer`` over another layout: its store is ``kvsim.hf.storage.Shared``, ``pool +
KV heads`` slots per row (``pool``: ``budget x KV heads``, uniform's memory), a slot belonging to
whichever head's position it holds; its steps are ``kvsim.hf.stepping.PoolSteps``. Each step every
head's new key takes a free slot (a layer holds at most ``pool`` between steps, so there are always ``KV
heads`` free), each head's queries attend over its own slots (the store's mask, the model's own window
applied too), and then ``kvsim.sim.joint.Pool`` takes the step the simulator's joint replay takes: every
head is shown its attention (the combining rule of ``kvsim.data.gqa``, the query's own weight dropped,
renormalised over what the head holds), admits the position, and while the layer holds more than the
pool the lowest h2o score among the heads' evictable positions goes, a head at its floor losing none.
The victims' slots are freed. So the bytes are the pool's positions plus one spare slot per head, x head
dim x 2 x the dtype's size, and the kept sets are the joint replay's on the attention the model computed
(tests/test_hf_pooled.py).

``prefill="exact"`` steps a prompt one position at a time; ``prefill="fast"`` attends over the whole
prompt with nothing evicted and steps the pool through those rows afterwards (the simulator's open loop).
``prefill="compress"`` is refused (its one-time choice is per head, not a pool's).
"""

from __future__ import annotations

from ..policies import PolicySpec
from ..policykit import registry
from .cache import EvictingLayer, HFError
from .stepping import PoolSteps
from .storage import Shared


class PooledLayer(EvictingLayer):
    """One decoder layer's KV heads sharing ``pool`` positions, each keeping at least ``floor``; ``specs``
    (one h2o spec per KV head, at the head's share of the pool) give the window every head protects."""

    def __init__(self, specs: list[PolicySpec], pool: int, floor: int, *, prefill: str = "exact"):
        if prefill == "compress":
            raise HFError("allocate='adakv' pools a layer's heads while decoding; prefill='compress' chooses each "
                          "head's positions once, alone: use prefill='exact' or 'fast'")
        if lacking := next((s.name for s in specs if not registry.can_pool(s.name)), None):
            raise HFError(registry.missing(lacking, "pools_heads", "adakv"))
        windows = {s.window for s in specs}
        if len(windows) != 1:
            raise HFError(f"adakv pools a layer's heads with one recent_window; this layer's heads have {sorted(windows)}")
        super().__init__(specs, prefill=prefill)
        self.pool, self.floor, self.window = int(pool), int(floor), windows.pop()
        if self.floor <= self.window or self.pool < self.floor * len(specs):
            raise HFError(f"adakv: pool {self.pool} and floor {self.floor} do not fit {len(specs)} heads with "
                          f"recent_window {self.window}")

    def _layout(self, key_states, value_states):
        """One shared store and one pool per row (no policy per head: the pool scores them)."""
        batch, hkv = key_states.shape[:2]
        if len(self.specs) != hkv:
            raise HFError(f"the cache was built for {len(self.specs)} KV head(s), the model gives {hkv}")
        self.budgets = [[int(s.budget) for s in self.specs] for _ in range(batch)]  # each head's share
        return (Shared(batch, hkv, self.pool, key_states, value_states),
                PoolSteps(batch, hkv, self.pool, self.floor, self.window))

    @property
    def pools(self) -> list:
        """Per row, its ``kvsim.sim.joint.Pool``."""
        return [] if self.steps is None else self.steps.pools

    @property
    def pool_peak(self) -> int:
        """The most positions any row of the layer held after a step, all heads together."""
        return 0 if self.store is None else self.store.pool_peak


__all__ = ["PooledLayer"]

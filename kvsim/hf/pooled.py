"""adakv deployed: a decoder layer whose KV heads share one pool of positions in ONE flattened store
(docs/allocation.md, docs/deploy.md, "adakv: one pool per layer").

The layer holds ``pool`` positions in all (``budget x KV heads``, uniform's memory) in one key tensor and
one value tensor of ``pool + KV heads`` slots per row; a slot belongs to whichever head's position it
holds (``owner``). Each step every head's new key takes a free slot (a layer holds at most ``pool``
between steps, so there are always ``KV heads`` free), each head's queries attend over its own slots
(a mask over the store, the model's own window applied too), and then ``kvsim.sim.joint.Pool`` takes the
step the simulator's joint replay takes: every head is shown its attention (the combining rule of
``kvsim.data.gqa``, the query's own weight dropped, renormalised over what the head holds), admits the
position, and while the layer holds more than the pool the lowest h2o score among the heads' evictable
positions goes, a head at its floor losing none. The victims' slots are freed. So the bytes are the
pool's positions plus one spare slot per head, x head dim x 2 x the dtype's size, and the kept sets are
the joint replay's on the attention the model computed (tests/test_hf_pooled.py).

``prefill="exact"`` steps a prompt one position at a time; ``prefill="fast"`` attends over the whole
prompt with nothing evicted and steps the pool through those rows afterwards (the simulator's open loop).
``prefill="compress"`` is refused (its one-time choice is per head, not a pool's).
"""

from __future__ import annotations

import numpy as np
import torch

from ..data.gqa import combine
from ..policies import PolicySpec
from ..sim.joint import Pool
from . import eager
from .cache import EvictingLayer, HFError


class PooledLayer(EvictingLayer):
    """One decoder layer's KV heads sharing ``pool`` positions, each keeping at least ``floor``; ``specs``
    (one h2o spec per KV head, at the head's share of the pool) give the window every head protects."""

    def __init__(self, specs: list[PolicySpec], pool: int, floor: int, *, prefill: str = "exact"):
        if prefill == "compress":
            raise HFError("allocate='adakv' pools a layer's heads while decoding; prefill='compress' chooses each "
                          "head's positions once, alone: use prefill='exact' or 'fast'")
        if any(s.name != "h2o" for s in specs):
            raise HFError(f"adakv pools h2o's scores across a layer's heads; {specs[0].name} is not h2o")
        windows = {s["recent_window"] for s in specs}
        if len(windows) != 1:
            raise HFError(f"adakv pools a layer's heads with one recent_window; this layer's heads have {sorted(windows)}")
        super().__init__(specs, prefill=prefill)
        self.pool, self.floor, self.window = int(pool), int(floor), windows.pop()
        if self.floor <= self.window or self.pool < self.floor * len(specs):
            raise HFError(f"adakv: pool {self.pool} and floor {self.floor} do not fit {len(specs)} heads with "
                          f"recent_window {self.window}")
        self.pools: list[Pool] = []
        self.pool_peak = 0  # the most positions any row of the layer held after a step, all heads together

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, hkv, _, head_dim = key_states.shape
        if len(self.specs) != hkv:
            raise HFError(f"the cache was built for {len(self.specs)} KV head(s), the model gives {hkv}")
        self.pools = [Pool(hkv, self.pool, self.floor, self.window) for _ in range(batch)]
        self.budgets = [[int(s.budget) for s in self.specs] for _ in range(batch)]  # each head's share
        self.device = key_states.device
        slots = self.pool + hkv  # the pool, and one slot per head for the position being admitted
        self.keys = torch.zeros(batch, slots, head_dim, dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(batch, slots, head_dim, dtype=value_states.dtype, device=self.device)
        self.pos = np.full((batch, slots), -1, dtype=np.int64)  # the position in each slot, -1 free
        self.owner = np.full((batch, slots), -1, dtype=np.int64)  # the KV head whose position it holds
        self.order = [[np.zeros(0, dtype=np.int64) for _ in range(hkv)] for _ in range(batch)]  # slots, ascending position
        self.free = [list(range(slots - 1, -1, -1)) for _ in range(batch)]
        self.head_peaks = [0] * hkv
        self.is_initialized = True

    # --- what it holds ------------------------------------------------------------------------------

    def held(self, row: int = 0, head: int = 0) -> np.ndarray:
        """Positions held by (row, KV head), ascending, read from the store."""
        if not self.is_initialized:
            return np.zeros(0, dtype=np.int64)
        return np.sort(self.pos[row, self.owner[row] == head])

    @property
    def nbytes(self) -> int:
        """Bytes of the layer's one key and one value store: the pool plus one spare slot per KV head."""
        return 0 if not self.is_initialized else self.keys.nbytes + self.values.nbytes

    # --- the step -----------------------------------------------------------------------------------

    def _put(self, b: int, h: int, t: int, key, value) -> int:
        s = self.free[b].pop()
        self.keys[b, s] = key
        self.values[b, s] = value
        self.pos[b, s], self.owner[b, s] = t, h
        return s

    def _settle(self, b: int, t: int, victims: list[list[int]], new: list[int]) -> None:
        """Put t's slot (``new[h]``) last in each head's order, then free the victims' slots (t's among them, if evicted)."""
        for h, gone in enumerate(victims):
            order = self.order[b][h]
            order = np.append(order, new[h])
            if gone:
                keep = ~np.isin(self.pos[b, order], gone)
                for s in order[~keep].tolist():
                    self.pos[b, s], self.owner[b, s] = -1, -1
                    self.free[b].append(s)
                order = order[keep]
            self.order[b][h] = order
            self.head_peaks[h] = max(self.head_peaks[h], order.size)
            self.peak = max(self.peak, order.size)
        self.pool_peak = max(self.pool_peak, sum(o.size for o in self.order[b]))

    def _step(self, query, key, value, scale, softcap, window):
        """One position: each head's key in a free slot, each head's queries over its slots, then the pool's step."""
        t = self.seen
        batch, hq, _, head_dim = query.shape
        hkv = key.shape[1]
        q = query.reshape(batch, hkv, hq // hkv, head_dim)
        new = [[self._put(b, h, t, key[b, h, 0], value[b, h, 0]) for h in range(hkv)] for b in range(batch)]
        outs, rows = [], []
        for h in range(hkv):
            visible = self.owner == h
            if window is not None:
                visible &= self.pos > t - window
            weights = eager.weights(q[:, h], self.keys, scale, softcap, torch.from_numpy(visible)[:, None, :])
            outs.append(torch.matmul(weights, self.values))
            rows.append(combine(np.moveaxis(weights.double().numpy(), 1, 0)) if t else None)  # (batch, slots)
        for b in range(batch):
            victims = [[] for _ in range(hkv)]
            if t:  # each head's weights on what it held, in position order (t's own weight dropped)
                _, victims = self.pools[b].step(t, [rows[h][b, self.order[b][h]] for h in range(hkv)])
            self._settle(b, t, victims, new[b])
        self.seen = t + 1
        return torch.stack(outs, dim=1).reshape(batch, hq, head_dim), None

    def _attend_fast(self, query, key, value, scale, softcap, window):
        """Prefill-then-evict: the chunk's queries attend causally over the store as it was when the chunk
        came and the chunk itself; then the pool steps through those rows, position by position, and only
        what it keeps is stored."""
        t0, n = self.seen, query.shape[2]
        batch, hq, _, head_dim = query.shape
        hkv = key.shape[1]
        group = hq // hkv
        q = query.reshape(batch, hkv, group, n, head_dim)
        out = torch.empty(batch, hkv, group, n, head_dim, dtype=query.dtype)
        slots = self.pos.shape[1]
        # the store as the chunk found it (a slot freed and filled during the chunk is read in the chunk's column)
        pos0, owner0 = self.pos.copy(), self.owner.copy()
        cols = np.concatenate([pos0, np.broadcast_to(t0 + np.arange(n), (batch, n))], axis=1)
        keys = [torch.cat([self.keys, key[:, h]], dim=1)[:, None] for h in range(hkv)]  # (batch, 1, slots + n, d)
        values = [torch.cat([self.values, value[:, h]], dim=1)[:, None] for h in range(hkv)]
        for a in range(0, n, 256):
            ts = t0 + np.arange(a, min(a + 256, n))
            shown = []
            for h in range(hkv):
                mine = np.concatenate([owner0 == h, np.ones((batch, n), dtype=bool)], axis=1)
                visible = mine[:, None, :] & (cols[:, None, :] >= 0) & (cols[:, None, :] <= ts[None, :, None])
                if window is not None:
                    visible &= cols[:, None, :] > ts[None, :, None] - window
                weights = eager.weights(q[:, h, :, a : a + ts.size], keys[h], scale, softcap, torch.from_numpy(visible)[:, None])
                out[:, h, :, a : a + ts.size] = torch.matmul(weights, values[h])
                shown.append(combine(np.moveaxis(weights.double().numpy(), 1, 0)))  # (batch, block, slots + n)
            for i, t in enumerate(ts.tolist()):
                for b in range(batch):
                    rows = []
                    for h in range(hkv):
                        held = self.pos[b, self.order[b][h]]
                        rows.append(shown[h][b, i, np.where(held >= t0, slots + held - t0, self.order[b][h])])
                    victims = self.pools[b].step(t, rows)[1] if t else [[] for _ in range(hkv)]
                    new = [self._put(b, h, t, key[b, h, t - t0], value[b, h, t - t0]) for h in range(hkv)]
                    self._settle(b, t, victims, new)
        self.seen = t0 + n
        return out.reshape(batch, hq, n, head_dim).transpose(1, 2)


__all__ = ["PooledLayer"]

"""Where a deployed layer under a serving layout keeps its keys and values (``kvsim.hf.layout``): memory as a
paged engine allocates it (docs/serving.md, "The deployed cache under a layout").

Each KV head owns a run of ``blocks x block_size`` slots plus one staging slot (the last), the same
``(batch, slots, head_dim)`` tensors and slot map as ``kvsim.hf.storage``. A run is ``blocks`` physical
blocks of ``block_size`` slots; a block table maps a logical block (positions ``[j s, (j + 1) s)``) to a
physical one, and position p sits at slot ``physical x s + p mod s`` of its head's run. Under shared
selection a layer has one block table per row for all its KV heads (the heads hold the same positions, so
a physical block holds every head's keys of those positions, at the same offset of each head's run);
without it, each KV head has its own. A physical block goes back to the free list when the layout evicts
its logical block, and the next logical block opened takes a free one.

The staging slot is the engine's room for the token being decoded: query t attends over what the head
holds and its own key, which is written there (``put``); once the layout has decided, t, if it stays, is
copied into its block (a new one when t opens a block) and the staging slot is cleared. So the bytes are
``(blocks x block_size + 1) x KV heads x head_dim x 2 x the dtype's size`` per layer, whatever the length,
and the positions held never pass ``blocks x block_size``, the layout's memory (``Layout.memory``).
"""

from __future__ import annotations

import numpy as np

from .refusal import HFError
from .storage import Store


class Paged(Store):
    """``blocks`` physical blocks of ``block_size`` slots per KV head and one staging slot; one block table per
    row and per group of KV heads choosing together (all of them under shared selection, each alone else)."""

    def __init__(self, batch: int, kv_heads: int, blocks: int, block_size: int, shared: bool, like_keys, like_values):
        run = blocks * block_size + 1
        super().__init__(batch, kv_heads, kv_heads * run, like_keys, like_values)
        self.blocks, self.block_size, self.run = blocks, block_size, run
        #: the KV heads that hold the same positions, each group under one block table
        self.groups = [list(range(kv_heads))] if shared else [[h] for h in range(kv_heads)]
        for h in range(kv_heads):
            self.owner[:, h * run : (h + 1) * run] = h
        #: per row and group: logical block -> physical block, the physical blocks free, the positions held
        self.table = [[{} for _ in self.groups] for _ in range(batch)]
        self.free = [[list(range(blocks - 1, -1, -1)) for _ in self.groups] for _ in range(batch)]
        self.kept = [[np.zeros(0, dtype=np.int64) for _ in self.groups] for _ in range(batch)]
        self.block_peak = 0  # the most physical blocks one row's group held after a step

    def span(self, h: int) -> slice:
        return slice(h * self.run, (h + 1) * self.run)

    def spare(self, h: int) -> int:
        return (h + 1) * self.run - 1

    def put(self, b: int, h: int, t: int, key, value) -> int:
        """Position t's key and value into KV head h's staging slot (row b); the slot."""
        s = self.spare(h)
        self.write(b, s, h, t, key, value)
        return s

    def slots(self, b: int, g: int, h: int, held: np.ndarray) -> np.ndarray:
        """The slots of KV head h (of group g) holding positions ``held``, through row b's block table."""
        s, table = self.block_size, self.table[b][g]
        phys = np.fromiter((table[j] for j in (held // s).tolist()), dtype=np.int64, count=held.size)
        return h * self.run + phys * s + held % s

    def settle(self, b: int, g: int, t: int, victims) -> None:
        """After step t of row b's group g (its heads decided together, ``victims`` ascending): the victims'
        slots cleared, the blocks none of them still holds freed, and t, if it stays, copied from the staging
        slot into its block (a free one taken when t opens it). HFError when t needs a block and none is free:
        the layout's decision left more blocks than the memory (never, when ``LayoutCache`` decided)."""
        s, table = self.block_size, self.table[b][g]
        held = self.kept[b][g]
        gone = np.asarray(victims, dtype=np.int64)
        stays = not np.isin(t, gone)
        old = gone[gone != t]
        if old.size:
            for h in self.groups[g]:
                self.pos[b, self.slots(b, g, h, old)] = -1
            held = held[~np.isin(held, old)]
        live = set((held // s).tolist())
        if stays:
            live.add(t // s)
        for j in [j for j in table if j not in live]:
            self.free[b][g].append(table.pop(j))
        if stays:
            if t // s not in table:
                if not self.free[b][g]:
                    raise HFError(f"step {t}: position {t} opens block {t // s}, and all {self.blocks} blocks are held")
                table[t // s] = self.free[b][g].pop()
            held = np.append(held, t)
        self.kept[b][g] = held
        for h in self.groups[g]:
            order = self.slots(b, g, h, held)
            spare = self.spare(h)
            if stays:
                slot = int(order[-1])
                self.keys[b, slot] = self.keys[b, spare]
                self.values[b, slot] = self.values[b, spare]
                self.pos[b, slot] = t
            self.pos[b, spare] = -1
            self.order[b][h] = order
            self.noted(h, held.size)
        self.block_peak = max(self.block_peak, len(table))

    def held_blocks(self, b: int, g: int) -> list[int]:
        """Row b's group g's logical blocks held, ascending."""
        return sorted(self.table[b][g])


__all__ = ["Paged"]

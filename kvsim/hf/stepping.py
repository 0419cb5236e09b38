"""What a deployed layer's policies decide, apart from where the keys are kept (``kvsim.hf.storage``): after
query t has attended, each policy is shown that attention and names its victims, and the store frees them.

- ``HeadSteps``: one policy per (row, KV head), each at its own budget, stepped as the harness steps it
  (``kvsim.sim.harness.step``: observe, admit t, evict down to the budget, the victims checked), or, after a
  compressed prompt, resumed from the kept set (``kvsim.sim.prefill.Resumed``). The policy starts holding
  ``[0]``, so position 0 is only seen. A row's policies are its own: a quality batch's rows are its
  configurations.
- ``PoolSteps``: adakv, a layer's KV heads sharing one pool (``kvsim.sim.joint.Pool``, the simulator's joint
  replay), one pool per row.

What a policy is shown is a row over the positions it holds, ascending (the combining rule of
``kvsim.data.gqa`` over the query heads that share the KV head; the query's own weight dropped; the
harness renormalises). ``Vectors`` hands the policies that read vectors (``Policy.reads``) position t's key
(post-RoPE, as stored), value, the KV head's group of queries ``(G, d)`` and ``out_norms``, ``|W_O^h v|``
for each query head h of the group (the slice of the layer's ``o_proj`` that head's output goes through),
as the harness hands a trace's rows.
"""

from __future__ import annotations

import numpy as np
import torch

from ..policies import Policy
from ..sim.harness import step
from ..sim.joint import Pool
from . import eager
from .refusal import HFError


class HeadSteps:
    """``policies[row][kv head]`` at ``budgets[row][kv head]``; ``resumed`` (``[row][kv head]`` ``Resumed``)
    once a compressed prompt has chosen what each head keeps."""

    def __init__(self, policies: list[list[Policy | None]], budgets: list[list[int]]):
        self.policies, self.budgets = policies, budgets
        self.resumed = None

    def reader(self, b: int, h: int) -> Policy | None:
        """The policy that decides for (row b, KV head h): its own, or the one resumed after a compressed prompt."""
        return self.resumed[b][h].policy if self.resumed is not None else self.policies[b][h]

    def step(self, b: int, h: int, t: int, row: np.ndarray | None, vectors: dict | None) -> list:
        """(row b, KV head h)'s victims at step t, shown ``row`` (its weights on what it holds, ascending)."""
        policy = self.reader(b, h)
        if self.resumed is not None:
            return self.resumed[b][h].step(t, row if policy is not None and policy.reads_attention else None, None,
                                           vectors)
        if t:
            return step(policy, t, row if policy.reads_attention else None, self.budgets[b][h], vectors=vectors).victims
        if vectors is not None:  # position 0, held from the start: never admitted, but seen (as the harness does)
            policy.see(0, vectors)
        return []

    def readers(self) -> list[type]:
        return [type(p) for row in self.policies for p in row if p is not None]

    def after(self, layer, t: int, rows: list, key, value, q) -> None:
        """Step t, attended (``rows[h]``: KV head h's combined weights over its span, None at t = 0): every
        (row, KV head) through the layer's ``_admit``, head by head. ``key``, ``value`` ``(batch, kv heads,
        d)`` and ``q`` ``(batch, kv heads, G, d)`` are t's own."""
        store = layer.store
        for h in range(store.kv_heads):
            start = store.span(h).start
            # each row's views in one call apiece (indexing a tensor row by row costs more than a step's policy)
            keys, values, queries = key[:, h].unbind(0), value[:, h].unbind(0), q[:, h].unbind(0)
            for b in range(store.batch):
                row = None if rows[h] is None else rows[h][b, store.order[b][h] - start]
                layer._admit(b, h, t, row, keys[b], values[b], queries[b])

    def chunk(self, layer, found, block, starts, key, value, q) -> None:
        """A chunk attended at once (``kvsim.hf.modes.fast``), stepped head by head: ``block(h, a)`` attends
        KV head h's queries from ``a`` and gives their positions and rows; ``found.row`` reads a row where
        what the head holds now sits."""
        store, t0 = layer.store, found.t0
        for h in range(store.kv_heads):
            for a in starts:
                ts, shown = block(h, a)
                for i, t in enumerate(ts.tolist()):
                    for b in range(store.batch):
                        p = t - t0
                        row = found.row(b, h, shown[b, i]) if t else None
                        store.put(b, h, t, key[b, h, p], value[b, h, p])
                        layer._admit(b, h, t, row, key[b, h, p], value[b, h, p], q[b, h, :, p])


class PoolSteps:
    """adakv: per row, one ``Pool`` of ``pool`` positions for ``kv_heads`` heads, each keeping ``floor``,
    every head protecting ``window`` (h2o's scores, pooled)."""

    def __init__(self, batch: int, kv_heads: int, pool: int, floor: int, window: int):
        self.pools = [Pool(kv_heads, pool, floor, window) for _ in range(batch)]

    def step(self, b: int, t: int, rows: list[np.ndarray]) -> list[list[int]]:
        """Row b's victims per KV head at step t, each head shown ``rows[h]`` (its weights on what it holds)."""
        if not t:
            return [[] for _ in rows]
        return self.pools[b].step(t, rows)[1]

    def readers(self) -> list[type]:
        return []

    def after(self, layer, t: int, rows: list, key, value, q) -> None:
        """Step t, attended: per row, every head shown its weights on what it holds, the pool's victims freed."""
        store = layer.store
        for b in range(store.batch):
            shown = [rows[h][b, store.order[b][h]] for h in range(store.kv_heads)] if t else None
            store.settle(b, self.step(b, t, shown) if t else [[] for _ in range(store.kv_heads)])

    def chunk(self, layer, found, block, starts, key, value, q) -> None:
        """A chunk attended at once, stepped position by position: every head's rows of a block first, then
        per position and row the pool's step, t's keys put and the victims freed."""
        store, t0 = layer.store, found.t0
        for a in starts:
            blocks = [block(h, a) for h in range(store.kv_heads)]
            for i, t in enumerate(blocks[0][0].tolist()):
                for b in range(store.batch):
                    rows = [found.row(b, h, shown[b, i]) for h, (_, shown) in enumerate(blocks)]
                    victims = self.step(b, t, rows)
                    for h in range(store.kv_heads):
                        store.put(b, h, t, key[b, h, t - t0], value[b, h, t - t0])
                    store.settle(b, victims)


class Vectors:
    """Position t's rows of what a policy reads, for one layer: the attention module of the call (its
    ``o_proj`` gives ``out_norms``) and, while a chunk of several positions is stepped, every position's
    ``out_norms`` ``(kv heads, n, G)`` from one product per row (``chunk``), made for a row when one of its
    policies first asks: a batch whose rows are a cell's policies has one row that reads them (vatp), and
    the product is float64 over the whole chunk (a tenth of a 13-row needle cell's time when made for
    every row)."""

    def __init__(self, name: str):
        self.name = name
        self.module = None
        #: while a chunk is stepped: (its first position, its values, the group, each row's norms once asked)
        self.norms: tuple[int, object, int, dict[int, np.ndarray]] | None = None

    def of(self, policy: Policy | None, b: int, h: int, t: int, key, value, queries) -> dict | None:
        """``policy``'s rows at position t of (row b, KV head h): its key and value as stored, the group's
        queries ``(G, d)`` and ``out_norms`` ``(G,)``; None when it reads nothing."""
        if policy is None or not policy.reads:
            return None
        out = {}
        for name in policy.reads:
            if name == "keys":
                out[name] = array(key)
            elif name == "values":
                out[name] = array(value)
            elif name == "queries":
                out[name] = array(queries)
            elif name == "out_norms":
                chunk = self.norms
                if chunk is not None and 0 <= t - chunk[0] < chunk[1].shape[2]:
                    first, values, group, rows = chunk
                    if b not in rows:
                        rows[b] = array(eager.output_norms(self.o_proj(), values[b], group))
                    out[name] = rows[b][h, t - first]
                else:
                    out[name] = array(eager.output_norms(self.o_proj(), value.reshape(1, 1, -1), queries.shape[0], h)[0, 0])
            else:
                raise HFError(f"{self.name}: {policy.name} reads {name}, which the deployed cache does not compute")
        return out

    def o_proj(self):
        weight = getattr(getattr(self.module, "o_proj", None), "weight", None)
        if weight is None:
            raise HFError(f"{self.name}: out_norms need the attention module's o_proj, which "
                          f"{type(self.module).__name__} does not have")
        return weight

    def chunk(self, first: int, value, group: int, readers: list[type]) -> None:
        """Before a chunk of ``value`` ``(batch, kv heads, n, d)`` from position ``first`` is stepped: every
        position's ``out_norms`` in one product per row (the row's first ask, ``of``) when some of ``readers``
        reads them. The same float64 statement as one position's (``eager.output_norms``), so each float32
        is within one rounding of the exact norm either way; the recorder computes a whole recording's in
        one product too."""
        self.norms = None
        if value.shape[2] < 2 or not any("out_norms" in r.reads for r in readers):
            return
        self.o_proj()  # said before the chunk is stepped, not at its first reader
        self.norms = first, value, group, {}


def array(x) -> np.ndarray:
    """A tensor's values as a float32 array of its own (a policy may keep what it is handed)."""
    return x.detach().to(torch.float32).cpu().numpy().copy()


__all__ = ["HeadSteps", "PoolSteps", "Vectors", "array"]

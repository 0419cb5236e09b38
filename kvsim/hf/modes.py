"""How a deployed layer takes new positions (``EvictingLayer(prefill=...)``): its attention over the store
``update`` filled (``kvsim.hf.storage``), then its policies stepped (``kvsim.hf.stepping``).

- ``one``: one position t, already in the store: each KV head's queries attend over that head's span
  (what it holds, and t), then every policy is shown its row and t is admitted or dropped. Decoding is
  this; a prompt under ``exact`` is this once per position, so a prompt longer than the budget is seen by
  the policy exactly as decoding would show it.
- ``fast`` (prefill-then-evict): a chunk's queries attend causally over the store as the chunk found it
  and the chunk itself (the prompt's outputs are then the full cache's), and the policies step through
  those rows afterwards, position by position; only what they keep is stored. Blocks of 256 queries
  bound the score matrix.
- ``compress``: the prompt, in one pass, attends in full; then per (row, KV head)
  ``kvsim.sim.prefill.choose`` picks the kept positions from those rows (a scorer's one-time choice) and
  ``Resumed`` resumes the decode policy from them (or the cache grows, with no policy), so the kept sets
  are the simulator's on the same rows. Holds each head's ``n x n`` combined rows (float64) meanwhile. A scorer
  that needs the model (``reconstruction``) is shown the scores the layer was handed (``prefill_scores``) in place
  of vectors; the choice is the same ``choose``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..data.gqa import combine
from ..policykit import registry
from ..sim.prefill import Prefill, PrefillError, Resumed, choose
from . import eager
from .eager import grouped
from .refusal import HFError

#: queries per block of a chunk's attention
BLOCK = 256


def one(layer, query, key, value, scale, softcap, window):
    """Position ``layer.seen``, in the store already: ``(out (batch, query heads, d), weights (batch, query
    heads, 1, slots) when every KV head reads as many slots, else None)``; ``key`` and ``value`` ``(batch, kv
    heads, d)`` are its own, for the policies that read them."""
    store, t = layer.store, layer.seen
    q = grouped(query[:, :, 0], store.kv_heads)  # (batch, kv heads, G, d)
    # one row taken by every row (``EvictingLayer.shared_start``): every row holds the same slots, so row 0
    # attends for all, and each row's policy is shown row 0's weights
    att = slice(0, 1) if layer.shared else slice(None)
    outs, per_head, rows = [], [], []
    for h in range(store.kv_heads):  # each head over its own span: the heads' spans differ when their budgets do
        span = store.span(h)
        visible = torch.from_numpy(store.visible(h, t, window)[att])[:, None, :]
        weights = eager.weights(q[att, h], store.keys[att, span], scale, softcap, visible)
        outs.append(torch.matmul(weights, store.values[att, span]))
        per_head.append(weights)
        row = combine(np.moveaxis(weights.double().numpy(), 1, 0)) if t else None  # (batch, span)
        rows.append(np.broadcast_to(row, (store.batch, row.shape[1])) if layer.shared and t else row)
    layer.steps.after(layer, t, rows, key, value, q)
    layer.seen = t + 1
    _, hq, _, head_dim = query.shape
    batch = outs[0].shape[0]
    same = len({w.shape[-1] for w in per_head}) == 1
    return (torch.stack(outs, dim=1).reshape(batch, hq, head_dim),
            torch.stack(per_head, dim=1).reshape(batch, hq, 1, -1) if same else None)


def exact(layer, query, key, value, scale, softcap, window):
    """A chunk of ``n`` positions, each put in the store in turn and taken by ``one``: ``(batch, n, query
    heads, d)``, and the last step's weights when ``n`` is 1."""
    outs, weights = [], None
    for i in range(query.shape[2]):
        layer.put(key[:, :, i], value[:, :, i])
        out, weights = one(layer, query[:, :, i : i + 1], key[:, :, i], value[:, :, i], scale, softcap, window)
        outs.append(out)
    return torch.stack(outs, dim=1), weights


class Found:
    """The store as a chunk found it, and the chunk, per KV head (taken when the head first attends: a
    head's span is only changed by that head's steps, a shared store's by every head's, so each layout's
    steps take its heads' before stepping any)."""

    def __init__(self, store, key, value, t0: int):
        self.store, self.key, self.value, self.t0 = store, key, value, t0
        self.heads: dict[int, tuple] = {}
        self.width = {}

    def __call__(self, h: int) -> tuple:
        if h not in self.heads:
            s, n, batch = self.store, self.key.shape[2], self.key.shape[0]
            span = s.span(h)
            keys = torch.cat([s.keys[:, span], self.key[:, h]], dim=1)[:, None]  # (batch, 1, span + n, d)
            values = torch.cat([s.values[:, span], self.value[:, h]], dim=1)[:, None]
            cols = np.concatenate([s.pos[:, span], np.broadcast_to(self.t0 + np.arange(n), (batch, n))], axis=1)
            mine = np.concatenate([s.owner[:, span] == h, np.ones((batch, n), dtype=bool)], axis=1)
            self.heads[h] = keys, values, cols, mine
            self.width[h] = span.stop - span.start
        return self.heads[h]

    def row(self, b: int, h: int, shown: np.ndarray) -> np.ndarray:
        """(row b, KV head h)'s weights on what it holds now, ascending, from ``shown`` (a row over the span as
        the chunk found it, then the chunk): a position from the chunk finds its weight in the chunk's column,
        one held from before in its slot's (a slot keeps its position until that position is evicted)."""
        s = self.store
        order = s.order[b][h]
        held = s.pos[b, order]
        return shown[np.where(held >= self.t0, self.width[h] + held - self.t0, order - s.span(h).start)]


def fast(layer, query, key, value, scale, softcap, window):
    """A chunk, attended over at once, then stepped: ``(batch, n, query heads, d)``."""
    t0, n = layer.seen, query.shape[2]
    batch, hq, _, head_dim = query.shape
    q = grouped(query, layer.store.kv_heads)  # (batch, kv heads, G, n, d)
    out = torch.empty(q.shape, dtype=query.dtype)
    found = Found(layer.store, key, value, t0)

    def block(h: int, a: int) -> tuple[np.ndarray, np.ndarray]:
        """Queries ``a`` .. of KV head h over what the chunk found and the chunk: their positions and combined
        rows ``(batch, block, span + n)``."""
        keys, values, cols, mine = found(h)
        ts = t0 + np.arange(a, min(a + BLOCK, n))
        visible = mine[:, None, :] & (cols[:, None, :] >= 0) & (cols[:, None, :] <= ts[None, :, None])
        if window is not None:
            visible &= cols[:, None, :] > ts[None, :, None] - window
        weights = eager.weights(q[:, h, :, a : a + ts.size], keys, scale, softcap, torch.from_numpy(visible)[:, None])
        out[:, h, :, a : a + ts.size] = torch.matmul(weights, values)
        return ts, combine(np.moveaxis(weights.double().numpy(), 1, 0))

    layer.steps.chunk(layer, found, block, range(0, n, BLOCK), key, value, q)
    layer.seen = t0 + n
    return out.reshape(batch, hq, n, head_dim).transpose(1, 2)


def compress(layer, query, key, value, scale, softcap, window):
    """The prompt in one pass, each head's kept set chosen once from it: ``(batch, n, query heads, d)``."""
    if layer.seen:
        raise HFError(f"{layer.name}: prefill='compress' takes the prompt in one forward pass (a first pass of "
                      f"the prompt's tokens); this one came after {layer.seen} positions")
    n = query.shape[2]
    batch, hq, _, head_dim = query.shape
    hkv = layer.store.kv_heads
    try:
        prefill = Prefill.of(n, layer.prefill_budget, layer.prefill_policy)
    except PrefillError as e:
        raise HFError(f"{layer.name}: a prompt of {n} tokens: {e}") from None
    q = grouped(query, hkv)
    out = torch.empty(q.shape, dtype=query.dtype)
    cols = np.arange(n)
    steps, vectors = layer.steps, layer.vectors
    scored = _given(layer, batch, hkv, n) if registry.needs_model(prefill.scorer.name) else None  # the model's pass
    resumed = steps.resumed = [[None] * hkv for _ in range(batch)]
    for h in range(hkv):
        rows = np.empty((batch, n, n))
        for a in range(0, n, BLOCK):
            ts = np.arange(a, min(a + BLOCK, n))
            visible = cols[None, :] <= ts[:, None]
            if window is not None:
                visible &= cols[None, :] > ts[:, None] - window
            weights = eager.weights(q[:, h, :, a : a + ts.size], key[:, h][:, None], scale, softcap,
                                    torch.from_numpy(visible))
            out[:, h, :, a : a + ts.size] = torch.matmul(weights, value[:, h][:, None])
            rows[:, a : a + ts.size] = combine(np.moveaxis(weights.double().numpy(), 1, 0))
        for b in range(batch):
            row = rows[b]

            def weights_of(t, held, row=row):
                return row[t, held]

            def vectors_of(policy, b=b, h=h):
                return lambda p: vectors.of(policy, b, h, p, key[b, h, p], value[b, h, p], q[b, h, :, p])

            scorer = prefill.scorer.build(layer.trace)
            shown = vectors_of(scorer) if scored is None else _scores_of(scorer, scored[b, h])
            kept = choose(prefill, weights_of, shown, layer.trace)
            policy = steps.policies[b][h]
            resumed[b][h] = Resumed(policy, kept, n, weights_of, vectors_of(policy))
            layer._store(b, h, resumed[b][h].kept, key[b, h], value[b, h])
    layer.seen = n
    return out.reshape(batch, hq, n, head_dim).transpose(1, 2)


def _given(layer, batch: int, heads: int, n: int):
    """The scores of a model scorer (``kvsim.hf.reconstruction``) that ``layer`` holds for a prompt of ``n``
    positions, ``(batch, heads, n)``; HFError, one line, when it holds none or scores of another shape."""
    scores = layer.prefill_scores
    name = layer.prefill_policy.name
    if scores is None:
        raise HFError(f"{layer.name}: prefill_policy={name!r} chooses from the model's scores of the prompt, and none were "
                      "handed over: kvsim.hf.cache(..., prefill_scores=kvsim.hf.reconstruction_scores(model, ids, "
                      "tokenizer)), or feed the prompt with kvsim.hf.decoding.prefill")
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 3 or scores.shape[0] not in (1, batch) or scores.shape[1:] != (heads, n):
        raise HFError(f"{layer.name}: prefill_scores have shape {scores.shape}, expected ({batch}, {heads}, {n}) for a "
                      f"prompt of {n} tokens")
    return np.broadcast_to(scores, (batch, heads, n))


def _scores_of(scorer, scores: np.ndarray):
    """Position p's row of what ``scorer`` reads, each member the model's score of p (``prefill_scores``)."""
    return lambda p: {name: scores[p] for name in scorer.reads}


__all__ = ["BLOCK", "compress", "exact", "fast", "one"]

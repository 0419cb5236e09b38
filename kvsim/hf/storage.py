"""Where a deployed layer keeps its keys and values: one key tensor and one value tensor per decoder layer,
``(batch, slots, head_dim)``, beside a map of what each slot holds (``pos``: the position, -1 for a free
slot; ``owner``: the KV head it belongs to) and, per (row, KV head), the slots it holds in position order
(``order``). Nothing here decides what stays: the layer's stepping (``kvsim.hf.stepping``) names the
victims and the store frees their slots.

Two layouts, the same map:

- ``Blocks``: each KV head owns a fixed run of ``budget + 1`` slots (``span(h)``, at that head's budget, so
  the bytes follow an allocation's split rather than the largest head). The run's last slot is the spare:
  the new position is written there (``put``), its queries attend over the run, and if the position stays
  ``settle`` moves it into the slot a victim left, so a step writes two keys per head and moves nothing
  else. A head without a policy (the cache growing after a compressed prompt) has its run doubled when
  it fills (``grow``).
- ``Shared``: the KV heads of a layer share one pool (adakv): ``pool + KV heads`` slots, a slot belonging
  to whichever head's position it holds; the new position takes any free slot.

Attention reads a head's span of the tensors with ``visible``, its validity mask: the slots the head holds
(and the new position), inside the model's sliding window if the layer has one.
"""

from __future__ import annotations

import numpy as np
import torch


class Store:
    """The tensors and the slot map; the layouts below say which slots a head may use."""

    def __init__(self, batch: int, kv_heads: int, slots: int, like_keys: torch.Tensor, like_values: torch.Tensor):
        head_dim = like_keys.shape[-1]
        self.kv_heads = kv_heads
        self.keys = torch.zeros(batch, slots, head_dim, dtype=like_keys.dtype, device=like_keys.device)
        self.values = torch.zeros(batch, slots, like_values.shape[-1], dtype=like_values.dtype, device=like_values.device)
        self.pos = np.full((batch, slots), -1, dtype=np.int64)  # the position in each slot, -1 free
        self.owner = np.full((batch, slots), -1, dtype=np.int64)  # the KV head whose position it holds
        #: per (row, KV head), the slots it holds, ascending position
        self.order = [[np.zeros(0, dtype=np.int64) for _ in range(kv_heads)] for _ in range(batch)]
        self.peak = 0  # the most positions any (row, KV head) held after a step
        self.head_peaks = [0] * kv_heads  # per KV head, the most positions any row held after a step
        self._arrays = None  # ``arrays``: (keys, values, their NumPy views or None)

    @property
    def batch(self) -> int:
        return self.pos.shape[0]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def held(self, b: int, h: int) -> np.ndarray:
        """Positions held by (row b, KV head h), ascending."""
        return self.pos[b, self.order[b][h]]

    def span(self, h: int) -> slice:
        """The slots KV head h's queries read: its own run, or the whole store when the heads share it."""
        return slice(0, self.pos.shape[1])

    def visible(self, h: int, t: int, window: int | None) -> np.ndarray:
        """``(batch, slots of span(h))``, True where query t of KV head h sees the slot: one of h's positions,
        the new one included, inside the model's ``window`` when it has one."""
        span = self.span(h)
        pos = self.pos[:, span]
        seen = (pos >= 0) & (self.owner[:, span] == h)
        if window is not None:
            seen &= pos > t - window
        return seen

    def write(self, b: int, s: int, h: int, t: int, key, value) -> None:
        self.keys[b, s] = key
        self.values[b, s] = value
        self.pos[b, s], self.owner[b, s] = t, h

    def put_rows(self, t: int, key, value) -> None:
        """Position t's key and value ``(batch, kv heads, d)`` into every (row, KV head)'s slot for it."""
        for b in range(key.shape[0]):
            for h in range(key.shape[1]):
                self.put(b, h, t, key[b, h], value[b, h])

    def arrays(self) -> tuple | None:
        """``keys`` and ``values`` as NumPy arrays sharing their memory (a slot's row copied there costs a
        fifteenth of torch's indexing, and a step copies several per row), or None where they cannot
        (another device, a dtype NumPy lacks): the callers copy through torch then. Remade whenever
        ``keys`` or ``values`` is another tensor (``grow``, the layer's setters)."""
        views = self._arrays
        if views is None or views[0] is not self.keys or views[1] is not self.values:
            k, v = self.keys, self.values
            plain = k.device.type == "cpu" and v.device.type == "cpu" and not (k.requires_grad or v.requires_grad)
            try:
                self._arrays = views = (k, v, k.numpy(), v.numpy()) if plain else (k, v, None, None)
            except (TypeError, RuntimeError):  # bfloat16 and the like: no NumPy dtype
                self._arrays = views = (k, v, None, None)
        return None if views[2] is None else views[2:]

    def copy_slot(self, b: int, to: int, source: int) -> None:
        """Row b's key and value in slot ``source`` copied into slot ``to``."""
        views = self.arrays()
        if views is None:
            self.keys[b, to] = self.keys[b, source]
            self.values[b, to] = self.values[b, source]
        else:
            views[0][b, to] = views[0][b, source]
            views[1][b, to] = views[1][b, source]

    def noted(self, h: int, held: int) -> None:
        self.peak = max(self.peak, held)
        self.head_peaks[h] = max(self.head_peaks[h], held)


class Blocks(Store):
    """One run of ``caps[h] + 1`` slots per KV head, its last the spare where the new position goes."""

    def __init__(self, batch: int, caps: list[int], like_keys, like_values):
        super().__init__(batch, len(caps), sum(c + 1 for c in caps), like_keys, like_values)
        self.lo = np.concatenate([[0], np.cumsum([c + 1 for c in caps])]).astype(np.int64)
        for h in range(len(caps)):
            self.owner[:, self.lo[h] : self.lo[h + 1]] = h
        self.free = [[list(range(self.lo[h + 1] - 2, self.lo[h] - 1, -1)) for h in range(len(caps))]
                     for _ in range(batch)]

    def span(self, h: int) -> slice:
        return slice(int(self.lo[h]), int(self.lo[h + 1]))

    def spare(self, h: int) -> int:
        return int(self.lo[h + 1]) - 1

    def put(self, b: int, h: int, t: int, key, value) -> int:
        """Position t's key and value into KV head h's spare slot (row b); the slot."""
        s = self.spare(h)
        self.write(b, s, h, t, key, value)
        return s

    def put_rows(self, t: int, key, value) -> None:
        """Every row's KV head h takes t in the same spare slot: one copy per head for all the rows."""
        for h in range(key.shape[1]):
            s = self.spare(h)
            self.keys[:, s] = key[:, h]
            self.values[:, s] = value[:, h]
            self.pos[:, s], self.owner[:, s] = t, h

    def settle(self, b: int, h: int, t: int, victims) -> None:
        """After step t of (row b, KV head h): the victims' slots freed (in the victims' order, the order
        later steps take free slots back in), and t, if it stays, moved from the spare into a free slot (the
        run doubled first if it has none: a head without a policy). The victims are held positions or t
        (the harness checked them)."""
        order = self.order[b][h]
        stays = True
        if len(victims):
            held = self.pos[b, order]  # ascending
            keep = None
            for v in victims:
                if v == t:
                    stays = False
                    continue
                i = int(held.searchsorted(v))
                s = int(order[i])
                self.pos[b, s] = -1
                self.free[b][h].append(s)
                if keep is None:
                    keep = np.ones(order.size, dtype=bool)
                keep[i] = False
            if keep is not None:
                order = order[keep]
        spare = self.spare(h)
        if stays:
            if not self.free[b][h]:
                order = self.grow(h, order)
                spare = self.spare(h)
            s = self.free[b][h].pop()
            self.copy_slot(b, s, spare)
            self.pos[b, s] = t
            order = np.append(order, s)
        self.pos[b, spare] = -1
        self.order[b][h] = order
        self.noted(h, order.size)

    def keep(self, b: int, h: int, held: np.ndarray, keys, values) -> None:
        """Positions ``held`` (ascending) of a prompt that started at position 0 into free slots of (row b,
        KV head h): ``keys`` and ``values`` are that head's ``(n, d)`` rows of the prompt."""
        while len(self.free[b][h]) < held.size:
            self.grow(h)
        slots = []
        for p in held.tolist():
            s = self.free[b][h].pop()
            self.write(b, s, h, p, keys[p], values[p])
            slots.append(s)
        self.order[b][h] = np.asarray(slots, dtype=np.int64)
        self.noted(h, held.size)

    def grow(self, h: int, extra: np.ndarray | None = None) -> np.ndarray | None:
        """Double KV head h's run (its spare stays last): the slots after the insertion move up, in every
        row's ``order`` and ``free`` (and ``extra``, returned moved). A head without a policy holds every
        position after a compressed prompt."""
        cap = int(self.lo[h + 1] - self.lo[h]) - 1
        more = max(cap, 1)
        at = int(self.lo[h]) + cap  # the new slots go before h's spare

        def pad(x):
            return torch.cat([x[:, :at], x.new_zeros(x.shape[0], more, x.shape[-1]), x[:, at:]], dim=1)

        def moved(slots):
            slots = np.asarray(slots, dtype=np.int64)
            return slots + more * (slots >= at)

        batch = self.batch
        self.keys, self.values = pad(self.keys), pad(self.values)
        self.pos = np.concatenate([self.pos[:, :at], np.full((batch, more), -1, dtype=np.int64), self.pos[:, at:]], axis=1)
        self.owner = np.concatenate([self.owner[:, :at], np.full((batch, more), h, dtype=np.int64), self.owner[:, at:]],
                                    axis=1)
        self.lo[h + 1 :] += more
        for b in range(batch):
            self.order[b] = [moved(o) for o in self.order[b]]
            self.free[b] = [moved(f).tolist() for f in self.free[b]]
            self.free[b][h] = list(range(at + more - 1, at - 1, -1)) + self.free[b][h]
        return None if extra is None else moved(extra)


class Shared(Store):
    """One pool of ``pool`` positions for all of a layer's KV heads, and one slot per head for the position
    being admitted: ``pool + KV heads`` slots per row, each owned by whichever head's position it holds."""

    def __init__(self, batch: int, kv_heads: int, pool: int, like_keys, like_values):
        super().__init__(batch, kv_heads, pool + kv_heads, like_keys, like_values)
        self.free = [list(range(pool + kv_heads - 1, -1, -1)) for _ in range(batch)]
        self.new = [[-1] * kv_heads for _ in range(batch)]  # each head's slot for the position being admitted
        self.pool_peak = 0  # the most positions any row held after a step, all heads together

    def put(self, b: int, h: int, t: int, key, value) -> int:
        """Position t's key and value for (row b, KV head h) into a free slot; the slot."""
        s = self.free[b].pop()
        self.write(b, s, h, t, key, value)
        self.new[b][h] = s
        return s

    def settle(self, b: int, victims: list) -> None:
        """After a step of row b: each head's new slot (``put``'s) last in its order, then the victims'
        slots freed (the new position's among them, if it was evicted)."""
        for h, gone in enumerate(victims):
            order = np.append(self.order[b][h], self.new[b][h])
            if len(gone):
                keep = ~np.isin(self.pos[b, order], gone)
                for s in order[~keep].tolist():
                    self.pos[b, s], self.owner[b, s] = -1, -1
                    self.free[b].append(s)
                order = order[keep]
            self.order[b][h] = order
            self.noted(h, order.size)
        self.pool_peak = max(self.pool_peak, sum(o.size for o in self.order[b]))


__all__ = ["Blocks", "Shared", "Store"]

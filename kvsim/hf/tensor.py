"""The deployed cache's tensor path: every row and KV head of a decoder layer stepped at once, as tensor
operations on the model's device, with nothing read back to the host (docs/deploy.md, "The tensor path").

The reference path (``kvsim.hf.cache.EvictingLayer`` over ``kvsim.hf.storage`` and ``kvsim.hf.stepping``)
keeps the slot map in NumPy and steps one Python policy per (row, KV head). Here the layer's keys and values
are transformers' own shape, ``(batch, KV heads, slots, head_dim)`` with ``slots = budget + 1`` (the largest
head's, when an allocation gives the heads different budgets), beside a map of the position each slot holds
(``pos``, -1 free) and the policy's state (``kvsim.policykit.tensor_hooks``), all tensors on the model's device.
A decode step of position t:

1. ``update`` writes t's key and value into each (row, KV head)'s first free slot (there is always one: a
   head holds at most its budget between steps) and returns the layer's keys and values whole;
2. the attention (kvsim's, reached through the call's keyword arguments as on the reference path) computes
   every query head's weights over its KV head's slots, those it holds and t, inside the model's sliding
   window if the layer has one: the family's eager arithmetic (``kvsim.hf.eager.weights``);
3. the policy is shown what the reference shows it (the combining rule, ``kvsim.data.gqa``: the group's
   mean folded in head order in float64, the query's own weight dropped, renormalised over what the head
   holds by a sum in position order, float32), admits t (with t's key, value or ``out_norms`` where the policy
   reads them, ``kvsim.hf.tensor_math.vectors``), and where a head is over its budget its victim is
   the first minimum of the policy's values over its candidates, the lower position on ties: the cards'
   rule, which is the reference's repeated argmin over kept order.

A prompt chunk of n positions (``prefill="exact"``) is the same step n times over one product: the chunk's
queries against the held keys and the chunk's in one matmul, then position by position each query's softmax
over what it still sees (held before it, the chunk's positions up to it, less what an earlier position of
the chunk evicted), the policy stepped on that row, and the chunk's outputs from the same rows. Memory is
``O(budget + chunk)`` per head, never the prompt squared. ``prefill="fast"`` attends over what the chunk
found and the chunk causally (the full cache's outputs) and steps the policies through those rows after.
After a chunk, the positions of the chunk that stayed move into the free slots.

The products here are batched over the heads where the reference multiplies head by head, so a weight may
differ from the reference's in its last float32 bit; the held sets and tokens are the reference's on every
model the tests run (tests/test_hf_tensor.py), and docs/deploy.md states the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..policies import Policy
from ..policykit.tensor_hooks import Columns, TensorHooks, TensorState
from . import rollback as _rollback
from . import walk as _walk
from .cache import LAYER, EvictingLayer, real_positions
from .eager import grouped
from .refusal import HFError
from .tensor_math import logits as _logits
from .tensor_math import outputs as _outputs
from .tensor_math import shown as _shown
from .tensor_math import softmax as _softmax
from .tensor_math import vectors as _vectors
from .tensor_rules import _runs, hooks_of, refusal

#: the largest position any sort key can hold: where a column that holds none sorts
_LAST = torch.iinfo(torch.int64).max
#: positions of a prompt stepped per chunk by ``prefill="exact"``, when the cache is not told otherwise
CHUNK = 512


@dataclass
class Group:
    """The rows of a layer that one policy class steps (``rows``, a run of them: each hook sees views of the layer's
    tensors, no copy): its tensor step and its state, which holds those rows only."""

    rows: slice
    hooks: TensorHooks
    state: TensorState
    observes: bool  # the class reads attention and its step observes it


class TensorLayer(EvictingLayer):
    """One decoder layer of the deployed cache on the tensor path: one policy class in every KV head of a row,
    each at its own parameters and budget (``EvictingLayer``'s ``specs`` or ``policies``); rows of other classes
    step in the same operations but their policies' own hooks (``groups``: a run of rows per class, as the needle's
    cells batch their policies)."""

    def __init__(self, *args, chunk: int = CHUNK, **kwargs):
        super().__init__(*args, **kwargs)
        if self.prefill == "compress":
            raise HFError("the tensor path steps prompts exactly or fast; prefill='compress' runs on the reference path")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise HFError(f"chunk must be an integer of at least 1, got {chunk!r}")
        self.chunk = chunk
        self.groups: list[Group] | None = None  # the runs of rows of one policy class, each with its state
        self.pos = None  # (batch, heads, slots) int64, the position in each slot, -1 free
        self.budget = None  # (batch, heads) int64
        self.broken = None  # (batch, heads) bool: a head over its budget with no candidate (a policy's bug)
        self._count = None  # (batch, heads) int64, the positions each head holds
        self._least = 0  # the smallest budget: no step before it fills evicts
        self._aranges = {}  # 0, 1, 2, ... on the device, by length: the ranks a sort hands out
        #: ``watch``: the positions whose departures are kept, and per (row, KV head, position) the step at which
        #: each left (-1: never), int64 on the device
        self._watched = 0
        self.left = None
        self._keys = self._values = None
        self._col = None  # decoding: the slot t was written to (batch, heads)
        self._padded = False  # a prompt of this layer had padding: decode steps read their masks too
        self._walkers = None  # the compiled walk's state between calls on a CPU (kvsim.hf.walk); None: read anew
        #: transformers' ``activate_past_recording``: each call's state before it is kept, so ``crop`` can take back
        #: its last positions (``kvsim.hf.rollback``); ``_past``: that copy and the call
        self.record_past = False
        self._past = None

    @property
    def is_croppable(self) -> bool:
        """Whether ``crop`` can take back the last call's positions: while the layer records (``rollback``)."""
        return self.record_past

    def activate_past_recording(self) -> None:
        """transformers asks this before assisted generation: keep each call's state before it, for ``crop``."""
        self.record_past = True

    # --- set-up ---------------------------------------------------------------------------------------

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        batch, heads = key_states.shape[:2]
        if self.policies is None:
            if len(self.specs) != heads:
                raise HFError(f"the cache was built for {len(self.specs)} KV head(s), the model gives {heads}")
            # a seed: one generator for the layer, as the reference path builds it (``EvictingLayer``)
            rng = None if self.rng_seed is None else np.random.default_rng(self.rng_seed)
            self.policies = [[spec.build(self.trace, rng=rng) for spec in self.specs] for _ in range(batch)]
        if len(self.policies) != batch or any(len(row) != heads for row in self.policies):
            raise HFError(f"the cache was built for {len(self.policies)} row(s) x {len(self.policies[0])} KV head(s), "
                          f"the model gives {batch} x {heads}")
        runs = _runs(self.name, self.policies)
        if self._row_budgets is not None:
            self.budgets = [[int(b)] * heads for b in self._row_budgets]
        else:
            self.budgets = [[int(p.budget) for p in row] for row in self.policies]
        width = max(max(row) for row in self.budgets) + 1
        dev = key_states.device
        self.budget = torch.tensor(self.budgets, dtype=torch.int64, device=dev)
        self._keys = key_states.new_zeros(batch, heads, width, key_states.shape[-1])
        self._values = value_states.new_zeros(batch, heads, width, value_states.shape[-1])
        self.pos = torch.full((batch, heads, width), -1, dtype=torch.int64, device=dev)
        self.groups = []
        for lo, hi, cls in runs:
            hooks = hooks_of(cls)
            state = hooks.state(self.policies[lo:hi], hi - lo, heads, width, dev)
            state.host.update(policies=self.policies[lo:hi], budgets=self.budgets[lo:hi])
            self.groups.append(Group(slice(lo, hi), hooks, state, cls.reads_attention and hooks.observe is not None))
        self.broken = torch.zeros(batch, heads, dtype=torch.bool, device=dev)
        self._count = torch.zeros(batch, heads, dtype=torch.int64, device=dev)
        self._least = min(min(row) for row in self.budgets)
        # what the policies read: a class's, or an instance's where its parameters say (learned's weights)
        self.reads_attention = any(type(row[0]).reads_attention for row in self.policies)
        self.reads = sorted({r for row in self.policies for p in row for r in p.reads})
        if self._watched:
            self.left = torch.full((batch, heads, self._watched), -1, dtype=torch.int64, device=dev)
        self.is_initialized = True

    def watch(self, positions: int) -> None:
        """Keep, on the device, the step at which each of the first ``positions`` positions left each (row, KV
        head) (``left``; -1 while held or never seen): what the pass-key test asks of every key token, heard
        without reading anything back while decoding (the observer ``kvsim.models.needle_runs`` uses)."""
        if self.is_initialized:
            raise HFError(f"{self.name}: watch before the first token")
        self._watched = int(positions)

    # --- transformers' layer API --------------------------------------------------------------------

    def update(self, key_states, value_states, *args, **kwargs):
        """Store a decode step's key and value in each head's free slot and return the layer's keys and values
        ``(batch, KV heads, slots, head_dim)``; a prompt chunk comes back as given and is stepped in by the
        attention. The attention call is reached through its keyword arguments, as on the reference path."""
        call = self.link(kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.pos.shape[0]:
            raise HFError(f"{self.name}: a call of {key_states.shape[0]} row(s) for a cache of {self.pos.shape[0]}; "
                          "feed every row (the tensor path shares no prompt start between rows)")
        self.pending = (key_states, value_states)
        self._past = {"state": _rollback.save(self)} if self.record_past else None
        if key_states.shape[2] == 1:
            self._col = self._free_slot()
            self._write(self._col, key_states, value_states)
            keys, values = self._keys, self._values
        else:
            keys, values = key_states, value_states
        self.handed = keys
        call[LAYER] = self
        return keys, values

    # --- transformers' batch and lifetime API: beam search, batch selection, reset ------------------------

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row i becomes row ``beam_idx[i]`` in everything kept per row (keys, values, the slot map,
        the policy's state and parameters, budgets, counts (the peaks), ``broken``, ``left``), on the device; the rows'
        Python lists (policies, budgets) are read back to reorder only where the rows differ."""
        self._rows(lambda x: x.index_select(0, beam_idx.to(x.device)), lambda: beam_idx.tolist())

    def batch_select_indices(self, indices) -> None:
        """Keep the rows ``indices`` (transformers' ``Cache.batch_select_indices``)."""
        at = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices)
        if at.dtype == torch.bool:
            at = at.nonzero()[:, 0]
        self._rows(lambda x: x.index_select(0, at.to(x.device)), lambda: at.tolist(), resized=True)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in place (transformers' ``Cache.batch_repeat_interleave``)."""
        rows = None if self.pos is None else self.pos.shape[0]
        self._rows(lambda x: x.repeat_interleave(repeats, dim=0),
                   lambda: [r for r in range(rows if rows is not None else self._python_rows()) for _ in range(repeats)],
                   resized=True)

    def _python_rows(self) -> int:
        return len(self.policies) if self.policies is not None else len(self._row_budgets)

    def _rows(self, tensors, rows, resized: bool = False) -> None:
        """One selection of rows applied to every per-row tensor (``tensors``) and, where the batch changes size
        or the rows differ, to the per-row lists (``rows()``: the old row of each new one)."""
        if self.handed is not None:
            raise HFError(self.lost())
        if self.groups is not None and len(self.groups) > 1:  # refused before anything moves
            raise HFError(f"{self.name}: a layer of several policy classes keeps each class's rows in its own state; it "
                          "cannot select or reorder rows (beam search, batch selection)")
        lists = [name for name in ("policies", "_row_budgets", "budgets") if getattr(self, name) is not None
                 and (name != "policies" or self.is_initialized or self.specs is None)]
        if not self.is_initialized and not lists:
            return  # built from specs and empty: the first call makes every row
        if resized or any(_differ(getattr(self, name)) for name in lists):
            at = rows()
            for name in lists:
                old = list(getattr(self, name))
                setattr(self, name, [old[i] for i in at])
        if not self.is_initialized:
            return
        group = self.groups[0]
        state = group.state
        self._walkers = self._past = None  # a crop after it would put the old rows back
        self._keys, self._values, self.pos = tensors(self._keys), tensors(self._values), tensors(self.pos)
        group.rows = slice(0, self.pos.shape[0])
        state.slots = {name: tensors(x) for name, x in state.slots.items()}
        state.params = {name: tensors(x) for name, x in state.params.items()}
        state.host.update(policies=self.policies, budgets=self.budgets)
        self.budget, self._count, self.broken = (tensors(x) for x in (self.budget, self._count, self.broken))
        if self.left is not None:
            self.left = tensors(self.left)

    def reset(self) -> None:
        """Back to empty (transformers' ``reset``): nothing held, no position seen, the policies' state gone; the
        next call starts again from position 0, at any batch size when the layer was built from specs. What
        ``watch`` asked stays asked."""
        if self.specs is not None:
            self.policies = None
        self.budgets = self.groups = self.pos = self.budget = None
        self.broken = self._count = self.left = self._keys = self._values = self._col = self._walkers = None
        self._past = None
        self.seen, self._least, self._padded = 0, 0, False
        self.handed = self.pending = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' ``crop`` (assisted generation's rollback): the last call's last ``-tokens_to_remove``
        positions taken back, exactly, while the layer records (``kvsim.hf.rollback``); refused otherwise."""
        _rollback.crop(self, tokens_to_remove)

    def _free_slot(self):
        """``(batch, heads)``: each head's first free slot."""
        return (self.pos < 0).to(torch.uint8).argmax(-1)

    def _write(self, col, key, value) -> None:
        """Position ``seen``'s key and value ``(batch, heads, 1, d)`` into slot ``col`` of each head."""
        at = col[..., None, None]
        self._keys.scatter_(2, at.expand(-1, -1, 1, key.shape[-1]), key)
        self._values.scatter_(2, at.expand(-1, -1, 1, value.shape[-1]), value)
        self.pos.scatter_(2, col[..., None], self.seen)

    @property
    def keys(self):
        return self._keys

    @keys.setter
    def keys(self, keys) -> None:
        if keys is not None:
            self._keys = keys

    @property
    def values(self):
        return self._values

    @values.setter
    def values(self, values) -> None:
        if values is not None:
            self._values = values

    def shared_start(self) -> int:
        return 0

    @property
    def _compressing(self) -> bool:
        return False

    # --- what it holds (read back on request, never on the decode path) --------------------------------

    def held(self, row: int = 0, head: int = 0):
        if not self.is_initialized:
            return np.zeros(0, dtype=np.int64)
        self.check()
        p = self.pos[row, head]
        return torch.sort(p[p >= 0]).values.cpu().numpy()

    def check(self) -> None:
        """HFError when a head went over its budget with no candidate to evict (a tensor step's bug: the
        reference path's ``ContractError``), found at the first read rather than on the decode path."""
        if self.broken is not None and bool(self.broken.any()):
            b, h = (int(i) for i in self.broken.nonzero()[0])
            name = next(g.hooks.name for g in self.groups if g.rows.start <= b < g.rows.stop)
            raise HFError(f"{self.name}: {name} named no victim for row {b} KV head {h} over its "
                          f"budget {self.budgets[b][h]}")

    @property
    def peak(self) -> int:
        """The most positions any (row, KV head) held after a step: what it holds now, since a head's count
        never falls (one position in each step, one out once it is over its budget)."""
        return 0 if self._count is None else int(self._count.max())

    @property
    def head_peaks(self) -> list[int]:
        return [] if self._count is None else [int(x) for x in self._count.amax(0).tolist()]

    @property
    def kv_heads(self):
        return None if self.pos is None else self.pos.shape[1]

    @property
    def nbytes(self) -> int:
        return 0 if not self.is_initialized else self._keys.nbytes + self._values.nbytes

    @property
    def resumed(self):
        return None

    # --- attention and the step -------------------------------------------------------------------------

    def attend(self, call):
        if self.handed is None or call.key is not self.handed:
            raise HFError(f"{self.name}: the attention call got keys this cache did not return for it; the call and "
                          "the cache are out of step")
        key, value = self.pending
        self.handed = self.pending = None
        heads = self.pos.shape[1]
        q = grouped(call.query, heads)  # (batch, heads, G, n, d)
        real = self._real(call.mask, q.shape[3], q.shape[0])
        if self._past is not None:
            self._past.update(q=q, key=key, value=value, call=call, real=real)
        out = self._step_call(q, key, value, call, real)
        if q.shape[3] > 1 and self.prefilled is not None:
            self.prefilled(q.shape[3])
        return out

    def _step_call(self, q, key, value, call, real):
        """A call's positions ``q`` ``(batch, heads, G, n, d)`` stepped in: ``(out, weights or None)``."""
        if q.shape[3] == 1:
            if _walk.fits(self, q, real):  # on a CPU: one compiled call per group between two products
                return _walk.decode(self, q, key, value, call)
            now = _vectors(self.name, self.reads, key, value, call, q)
            now = {k: x[:, :, 0] for k, x in now.items()}
            out, weights = self._decode(q[:, :, :, 0], call, now, None if real is None else real[:, 0])
            return out, weights
        return self._chunk(q, key, value, call, real), None

    def _real(self, mask, n: int, batch: int):
        """``(batch, n)``: which of the call's positions its mask leaves unpadded (``real_positions``), or None
        where the layer need not tell. A call of several positions (a prompt) reads its mask back once and
        gives None when nothing is padded, so an unpadded prompt steps as before; a decode step reads nothing
        back and looks at its mask only once a prompt of this layer was padded (transformers' generate pads
        only the prompt), so an unpadded run pays nothing for padding on the decode path."""
        if n == 1 and not self._padded:
            return None
        real = real_positions(mask, n, batch)
        if n > 1 and real is not None:
            if bool(real.all()):
                return None
            self._pads()
        return real

    def _pads(self) -> None:
        """A prompt of this layer had padding: its decode steps read their masks from now on."""
        self._padded = True
        for group in self.groups:
            group.state.host["padded"] = True

    def _decode(self, q, call, now, real=None):
        """Position ``seen``, written to slot ``_col`` by ``update``: ``(out (batch, 1, query heads, d), weights
        (batch, query heads, 1, slots))``. ``real`` ``(batch,)``: False where the call's mask pads the position
        (``real_positions``), which is then neither shown to, admitted by nor held in that row."""
        t, pos = self.seen, self.pos
        self._walkers = None  # these operations step the layer: a walk after them reads it anew
        new = self._arange(pos.shape[-1]) == self._col[..., None]
        before = (pos >= 0) & ~new
        held = before | new
        seen = held if call.window is None else held & (pos > t - call.window)
        w = _softmax(_logits(q, self._keys, call), seen, q.dtype)  # (batch, heads, G, slots)
        out = _outputs(w, self._values)  # (batch, heads, G, d)
        observing = t and self._observes
        order = None  # held first, ascending position: for the renormalising sum, the ranks and the tie rule
        if observing or t + 1 > self._least:
            order = torch.where(held, pos, _LAST).argsort(-1)
        shown = _shown(w, before, order) if observing else None
        self._count = self._step(t, pos, before, new, held, self._count, shown, [g.state.slots for g in self.groups],
                                 order, now, real)
        self.seen = t + 1
        batch, heads, g, d = out.shape
        return out.reshape(batch, 1, heads * g, d), w.reshape(batch, heads * g, 1, -1)

    @property
    def _observes(self) -> bool:
        return any(group.observes for group in self.groups)

    def _chunk(self, q, key, value, call, real=None):
        """A prompt chunk ``(batch, heads, G, n, d)``: ``(batch, n, query heads, d)``. ``exact`` steps it
        ``self.chunk`` positions at a time, compacting after each; ``fast`` attends every query over what the
        whole call found and the call's positions before it (the full cache's rows), ``self.chunk`` queries'
        logits at a time, and compacts once."""
        n = q.shape[3]
        if _walk.fits(self, q, real):  # on a CPU: one compiled loop per block of positions (kvsim.hf.walk)
            out = _walk.run(self, q, key, value, call)
        elif self.prefill == "fast":
            out = self._part(q, key, value, call, real)
        else:
            out = torch.cat([self._part(q[:, :, :, a : a + self.chunk], key[:, :, a : a + self.chunk],
                                        value[:, :, a : a + self.chunk], call,
                                        None if real is None else real[:, a : a + self.chunk])
                             for a in range(0, n, self.chunk)], dim=3)
        batch, heads, g, _, d = out.shape
        return out.permute(0, 3, 1, 2, 4).reshape(batch, n, heads * g, d)

    def _part(self, q, key, value, call, real=None):
        """Up to ``self.chunk`` positions from ``seen`` (all of a call's, ``fast``): their outputs ``(batch,
        heads, G, n, d)``. What does not depend on what the policy evicts is computed once per block of queries:
        the logits; every row's softmax under ``fast`` (over what the call found and the call up to the query),
        and under ``exact`` the rows of the positions before the smallest budget fills (nothing can have been
        evicted yet), with what the policy is shown on those; the columns' position order (a column's position
        never changes inside a part: an evicted one only stops counting). The policy then steps position by
        position, and the outputs are one product per block. ``real`` ``(batch, n)``: False at a padded
        position, which no other query sees (it attends over what it can, itself included, so its row stays
        finite) and no row holds after its step; a padded part computes every row of ``exact`` one by one."""
        t0, n = self.seen, q.shape[3]
        batch, heads, width = self.pos.shape
        dev = self.pos.device
        self._walkers = None
        keys = torch.cat([self._keys, key], dim=2)
        values = torch.cat([self._values, value], dim=2)
        pos = torch.cat([self.pos, torch.full((batch, heads, n), -1, dtype=torch.int64, device=dev)], dim=2)
        slots = [{name: torch.cat([s, s.new_zeros(s.shape[0], heads, n, *s.shape[3:])], dim=2)
                  for name, s in group.state.slots.items()} for group in self.groups]
        now = _vectors(self.name, self.reads, key, value, call, q)
        fast, window, g = self.prefill == "fast", call.window, q.shape[2]
        cols = self._arange(width + n)
        # each column's position as the part found it (an evicted one keeps it): what the model's window reads in
        # fast mode, where the queries attend over columns the policy has since evicted; and the columns' order
        posf = torch.where(cols >= width, t0 - width + cols, pos)
        order = torch.where(posf >= 0, posf, _LAST).argsort(-1)
        found = pos >= 0
        count = self._count
        out = q.new_empty(batch, heads, g, n, value.shape[-1])
        for a in range(0, n, self.chunk):
            m = min(a + self.chunk, n) - a
            ts = t0 + torch.arange(a, a + m, device=dev)
            logits = _logits(q[:, :, :, a : a + m].transpose(2, 3), keys, call)  # (batch, heads, m, G, columns)
            mine = cols[None, :] - width  # a chunk column's index in the part, negative for the found ones
            earlier = found[:, :, None, :] | ((mine >= 0) & (mine < (a + torch.arange(m, device=dev))[:, None]))
            sees = earlier | (mine == (a + torch.arange(m, device=dev))[:, None])  # (batch, heads, m, columns)
            if window is not None:
                sees = sees & (posf[:, :, None, :] > (ts[:, None] - window))
            if fast and real is not None:  # a padded column is seen by its own query alone
                pad = torch.cat([real.new_zeros(batch, width), ~real], dim=-1)  # (batch, columns)
                sees = sees & ~(pad[:, None, None, :] & (mine != (a + torch.arange(m, device=dev))[:, None]))
            steady = 0 if real is not None else max(0, min(m, self._least - (t0 + a)))  # rows before any eviction
            pre = m if fast else steady  # rows whose softmax is known now
            ws = torch.empty(batch, heads, m, g, width + n, dtype=q.dtype, device=dev)
            if pre:
                ws[:, :, :pre] = _softmax(logits[:, :, :pre], sees[:, :, :pre], q.dtype)
            shown = _shown(ws[:, :, :steady], earlier[:, :, :steady], order) if steady and self._observes else None
            for j in range(m):
                i = a + j
                t, new = t0 + i, cols == width + i
                before = pos >= 0
                pos[..., width + i] = t
                held = before | new
                if j >= pre:
                    ws[:, :, j] = _softmax(logits[:, :, j], held & sees[:, :, j], q.dtype)
                row, at = None, {k: x[:, :, i] for k, x in now.items()}
                if t and self._observes:
                    row = shown[:, :, j] if j < steady else _shown(ws[:, :, j], before, order)
                count = self._step(t, pos, before, new, held, count, row, slots, order, at,
                                   None if real is None else real[:, i])
            rows = _outputs(ws.reshape(batch, heads, m * g, width + n), values)  # one product per head
            out[:, :, :, a : a + m] = rows.reshape(batch, heads, m, g, -1).transpose(2, 3)
        self._count = count
        self._compact(width, keys, values, pos, slots)
        self.seen = t0 + n
        return out

    def _step(self, t: int, pos, before, new, held, count, shown, slots, order, now, real=None):
        """Step t of every (row, KV head): ``shown`` (what the policy sees, ``_shown``; None before step 1 or for a
        policy that reads no attention), admit t (its column ``new``), evict where over budget. ``order``: the
        columns in position order (held ones ascending, the rest anywhere), for the ranks and the tie rule.
        ``slots``: each group's slot tensors; ``now``: t's rows of what the policies read, every row's.
        ``pos`` and ``slots`` are changed in place; the held counts after the step come back.

        ``real`` ``(batch,)`` bool, where the call's mask pads some rows (None: none): in a row where t is padding
        the policy is shown nothing (no column held before, which every ``observe`` leaves unchanged), admits
        nothing and evicts nothing, and t's column is freed, so the row steps as if t never came."""
        new = new.expand(pos.shape)  # a chunk's column is one for every (row, KV head)
        if real is None:
            count = count + 1
        else:
            pad = ~real[:, None, None]  # (batch, 1, 1)
            padded = new & pad  # t's column in the rows where t is padding
            before, new = before & ~pad, new & ~pad
            held = before | new
            count = count + real[:, None].to(count.dtype)
            if shown is not None:
                shown = shown * real[:, None, None]  # nothing to see in a padded row (exact: a product by 0 or 1)
        for group, slot in zip(self.groups, slots, strict=True):
            r, state = group.rows, group.state
            state.slots, state.t, state.now = slot, t, {k: x[r] for k, x in now.items()}
            if shown is not None and group.observes:
                group.hooks.observe(state, shown[r], before[r])
            if group.hooks.admit is not None:
                group.hooks.admit(state, new[r], before[r])
        if t + 1 > self._least:  # no head can be over its budget before the smallest budget fills
            ranks = held.gather(-1, order).cumsum(-1) - 1  # each held column's rank, in position order
            older = torch.empty_like(order).scatter_(-1, order, ranks)
            values, candidates = self._rank(Columns(t, pos, held, count[..., None] - 1 - older, older, order))
            # in position order, so that the first minimum is the lower position (the cards' tie rule)
            ranked = torch.where(candidates & held, values, torch.inf).gather(-1, order)
            first = ranked.argmin(-1, keepdim=True)
            victim = order.gather(-1, first)
            over = count > self.budget
            gone = pos.gather(-1, victim)
            if self.left is not None:  # the victim's departure, where a head evicted one
                at = gone.clamp(0, self._watched - 1)
                self.left.scatter_(-1, at, torch.where(over[..., None] & (gone < self._watched), t, self.left.gather(-1, at)))
            pos.scatter_(-1, victim, torch.where(over[..., None], -1, gone))
            self.broken |= over & ranked.gather(-1, first)[..., 0].isinf()  # over its budget with no candidate
            count = count - over.to(count.dtype)
        if real is not None:  # a padded t leaves its column at once
            pos.masked_fill_(padded, -1)
        return count

    def _rank(self, cols: Columns):
        """Each group's ``rank`` over its rows' views of ``cols``: ``(values, candidates)`` for every row (float64 where
        the classes differ: a float32 value widens exactly)."""
        if len(self.groups) == 1:
            group = self.groups[0]
            return group.hooks.rank(group.state, cols)
        parts = [group.hooks.rank(group.state, Columns(cols.t, *(x[group.rows] for x in (cols.pos, cols.held, cols.newer,
                                                                                          cols.older, cols.order))))
                 for group in self.groups]
        return torch.cat([v.double() for v, _ in parts]), torch.cat([c for _, c in parts])

    def _arange(self, n: int):
        if n not in self._aranges:
            self._aranges[n] = torch.arange(n, device=self.pos.device)
        return self._aranges[n]

    def _compact(self, width: int, keys, values, pos, slots) -> None:
        """After a chunk: the chunk's positions that stayed moved into the free slots (lowest first), the rest of
        the columns dropped; ``width`` slots again."""
        free = pos[..., :width] < 0
        stayed = pos[..., width:] >= 0  # (batch, heads, n)
        ar = torch.arange(width, device=pos.device)
        free_slots = torch.sort(torch.where(free, ar, width + ar), dim=-1).indices  # free slots first, ascending
        rank = (stayed.cumsum(-1) - 1).clamp(0, width - 1)
        target = torch.where(stayed, free_slots.gather(-1, rank), width)  # width: a column that is dropped
        source = torch.cat([ar.expand(*free.shape), torch.zeros_like(free[..., :1], dtype=torch.int64)], dim=-1)
        source.scatter_(-1, target, (width + torch.arange(stayed.shape[-1], device=pos.device)).expand(*stayed.shape))
        source = source[..., :width]
        self._keys = keys.gather(2, source[..., None].expand(-1, -1, -1, keys.shape[-1]))
        self._values = values.gather(2, source[..., None].expand(-1, -1, -1, values.shape[-1]))
        self.pos = pos.gather(-1, source)
        for group, slot in zip(self.groups, slots, strict=True):
            at = source[group.rows]
            group.state.slots = {name: s.gather(2, at.reshape(*at.shape, *[1] * (s.dim() - 3)).expand(
                *at.shape, *s.shape[3:])) for name, s in slot.items()}


def _differ(rows) -> bool:
    """Whether a per-row list's rows are not all alike (policies: at the same class and parameters)."""
    first = rows[0] if rows else None
    if isinstance(first, list) and first and isinstance(first[0], Policy):
        return any([(type(p), p.budget, p.params) for p in row] != [(type(p), p.budget, p.params) for p in first] for row in rows)
    return any(row != first for row in rows)


__all__ = ["CHUNK", "Group", "TensorLayer", "hooks_of", "refusal"]

"""A transformers ``Cache`` that really evicts: each decoder layer holds at most ``budget`` positions
per KV head, and a kvsim policy decides which (docs/deploy.md, docs/domain.md, "The deployed cache").

The order is the harness's, and so is the step: the query at position t attends to the positions
its layer holds (those inside the layer's own sliding window, if it has one) and to itself; then, for
t >= 1, ``kvsim.sim.harness.step`` shows the policy that attention, admits t and evicts down to the
budget, and checks the victims as the harness does (``ContractError``). The policy starts holding
``[0]``, so position 0 is simply stored. What it is shown is the combining rule of
``kvsim.data.gqa`` (the recorder's): per KV head, the mean in float64 of the weights of the query
heads sharing it, the query's own weight dropped, renormalised over the held set, float32.

``update`` takes the new keys and values and returns them (each head's block of slots has its own
size, so no one tensor holds what the queries may see; ``attend`` stores them and reads each block);
it hands the layer to that attention call in the call's own keyword arguments (``kvsim_layer``, which
``kvsim.hf.attention`` reads), and a layer whose keys were not taken by an attention call refuses the
next update (HFError): a lost link is said, never decoded through.

Storage is one block per KV head of ``budget + 1`` slots per row, each head at its own budget (an
allocation, ``kvsim.hf.cache(..., allocate=...)``; the largest row's, when a batch's rows differ), so
the layer's bytes follow the split rather than its largest head: each step puts the new position's
key into each head's spare last slot (the query attends to it there), and the step moves it into the
slot its victim left, so a step writes two keys per head and moves nothing else. Per (row, KV head)
the layer keeps the positions held (``pos``, ``order``) beside their keys and values and steps that
head's own policy at that head's budget (``budgets[row][head]``). Keys keep the rotary positions they
were encoded at. A chunk of several tokens (a prompt) is taken one position at a time through the same
step, so a prompt longer than the budget is seen by the policy exactly as decoding would show it
(``prefill="exact"``); ``prefill="fast"`` attends over the whole chunk at once and steps the policy
through those rows afterwards (the prompt's own outputs are then the full cache's). ``prefill="compress"``
attends over the whole prompt too, then each head keeps the positions ``kvsim.sim.prefill.choose`` picks
from that attention (a scorer's one-time choice: SnapKV's by default) and decoding goes on from them as
``kvsim.sim.prefill.Resumed`` says: the cache growing (no policy: a head's block doubles when it fills)
or a decode-time policy resumed from the kept set, so the kept sets are the simulator's on the same rows.

Policies that read vectors (``Policy.reads``) are handed, before each position is admitted, that
position's key (post-RoPE, as stored), value, the KV head's group of queries ``(G, d)`` and
``out_norms``, ``|W_O^h v|`` for each query head h of the group (the slice of the layer's ``o_proj``
that head's output goes through), as the harness hands a trace's rows. A policy that also reads its
trace's meta (``reads_meta``: expected_attention's RoPE) is built with the layer's ``meta``, the fields a
recording of that layer states (``kvsim.policies.rope.rope_meta``, which ``kvsim.hf.cache`` calls on the
model), handed over as ``LayerMeta`` where a replay hands the trace.

torch and transformers are imported here at module level: ``kvsim.hf`` is the optional torch extra.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..data.gqa import combine
from ..policies import Policy, PolicySpec, policy_class
from ..progress import Progress
from ..sim.harness import step
from ..sim.prefill import Prefill, PrefillError, Resumed, choose
from . import eager

PREFILL = ("exact", "fast", "compress")
#: the attention call keyword through which ``update`` hands the layer to its attention call
LAYER = "kvsim_layer"


class HFError(ValueError):
    """kvsim.hf cannot run as asked; one line, said before any generation starts."""


class LayerMeta(NamedTuple):
    """What a policy that ``reads_meta`` reads of a trace (``name``, for its messages, and ``meta``), for one
    decoder layer of a deployed model: the meta a recording of that layer would carry (its RoPE)."""

    name: str
    meta: dict


class EvictingLayer(CacheLayerMixin):
    """One decoder layer's cache: ``budget + 1`` slots per (row, KV head), one policy each.

    Either ``specs`` (one per KV head, each at that head's budget: every row gets fresh policies built
    from them when the first tokens arrive and the batch size is known) or ``policies`` (``[row][kv
    head]``, built by the caller, with ``budgets`` per row, or each policy's own budget when None: the
    quality measurement's batch of configurations). ``budgets`` becomes ``[row][kv head]``."""

    is_sliding = False  # a model's own window is applied in ``attend``; the policy decides what is held
    is_croppable = False
    is_compileable = False
    supports_early_init = False

    def __init__(self, specs: list[PolicySpec | None] | None = None, *, policies: list[list[Policy]] | None = None,
                 budgets: list[int] | None = None, prefill: str = "exact", rng_seed: int | None = None,
                 prefill_budget=None, prefill_policy: PolicySpec | None = None, meta: dict | None = None):
        super().__init__()
        if (specs is None) == (policies is None):
            raise HFError("an evicting layer takes policy specs or built policies, not both or neither")
        if prefill not in PREFILL:
            raise HFError(f"prefill must be one of {', '.join(PREFILL)}, got {prefill!r}")
        self.specs = specs
        self.policies = policies
        #: [row][kv head], set once the batch is known (``lazy_initialization``)
        self.budgets = None
        self._row_budgets = budgets
        self.prefill = prefill
        self.rng_seed = rng_seed
        if prefill == "compress" and (prefill_budget is None or prefill_policy is None):
            raise HFError("prefill='compress' needs a prefill_budget and a prefill_policy")
        if prefill != "compress" and specs is not None and any(s is None for s in specs):
            raise HFError("a KV head without a policy (the cache growing) is only for prefill='compress'")
        #: compress: the positions each head keeps (an integer or a ratio of the prompt) and the scorer
        self.prefill_budget, self.prefill_policy = prefill_budget, prefill_policy
        #: the layer's meta as a recording states it (``rope_meta``), for the policies that ``reads_meta``
        self.meta = dict(meta or {})
        #: compress: ``[row][kv head]`` ``kvsim.sim.prefill.Resumed``, set by the prompt
        self.resumed: list[list[Resumed]] | None = None
        self._module = None  # the attention module of the last call: its o_proj gives out_norms
        #: the chunk's ``out_norms`` ``(batch, kv heads, n, G)`` and its first position, while a chunk is
        #: stepped: one batched product for the chunk instead of one per position (``_chunk_norms``)
        self._norms: tuple[int, np.ndarray] | None = None
        self.seen = 0  # positions processed: the next one's position
        self.index: int | None = None  # the decoder layer it serves (``EvictingCache`` sets it), for messages
        #: what ``update`` returned and stored until the attention call takes it: (keys returned, the new keys,
        #: the new values); None between steps
        self.handed: tuple | None = None
        self.peak = 0  # the most positions any (row, KV head) held after a step
        self.head_peaks: list[int] = []  # per KV head, the most positions any row held after a step
        #: told when this layer has stepped through a prompt (``EvictingCache(progress=...)``): an exact
        #: prefill is a minute or more of Python per long prompt, and it must not look hung
        self.prefilled: Callable[[int], None] | None = None

    # --- transformers' layer API --------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, hkv, _, head_dim = key_states.shape
        if self.policies is None:
            if len(self.specs) != hkv:
                raise HFError(f"the cache was built for {len(self.specs)} KV head(s), the model gives {hkv}")
            rng = None if self.rng_seed is None else np.random.default_rng(self.rng_seed)
            self.policies = [[None if spec is None else spec.build(self._trace, rng=rng) for spec in self.specs]
                             for _ in range(batch)]
        if len(self.policies) != batch or any(len(row) != hkv for row in self.policies):
            raise HFError(f"the cache was built for {len(self.policies)} row(s) x {len(self.policies[0])} KV head(s), "
                          f"the model gives {batch} x {hkv}")
        if self._row_budgets is not None:
            self.budgets = [[int(b)] * hkv for b in self._row_budgets]
        else:  # a head without a policy grows: it starts with room for the prompt
            self.budgets = [[key_states.shape[2] if policy is None else int(policy.budget) for policy in row]
                            for row in self.policies]
        self.device = key_states.device
        # per KV head: its held slots (the largest row's budget) and one more, the last, for the new position
        caps = [max(row[h] for row in self.budgets) for h in range(hkv)]
        self.keys = [torch.zeros(batch, cap + 1, head_dim, dtype=key_states.dtype, device=self.device) for cap in caps]
        self.values = [torch.zeros(batch, cap + 1, head_dim, dtype=value_states.dtype, device=self.device) for cap in caps]
        self.pos = [np.full((batch, cap + 1), -1, dtype=np.int64) for cap in caps]  # position in each slot, -1 free
        self.order = [[np.zeros(0, dtype=np.int64) for _ in range(hkv)] for _ in range(batch)]  # slots, ascending position
        self.free = [[list(range(caps[h] - 1, -1, -1)) for h in range(hkv)] for _ in range(batch)]
        self.head_peaks = [0] * hkv
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Take the new keys and values and hand the attention call what its queries may see: the new
        keys and values themselves, which ``attend`` stores (a new position in each head's spare slot)
        and reads beside each head's block of slots, whose sizes differ per head when the budgets do.
        The policies decide in the attention call what stays (``attend``), which finds this layer in its
        keyword arguments: transformers' model families pass theirs to the cache (``update(...,
        kwargs=kwargs)``) and then to the attention function."""
        call = kwargs.get("kwargs")
        if not isinstance(call, dict):
            raise HFError(f"{self._name}: the model does not pass its attention call's keyword arguments to the cache "
                          "(update(..., kwargs=kwargs), as transformers' model families do), so the evicting cache "
                          "cannot reach the attention that must step it")
        if self.handed is not None:
            raise HFError(self._lost())
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.handed = (key_states, key_states, value_states)
        call[LAYER] = self
        return key_states, value_states

    @property
    def _name(self) -> str:
        return "an evicting layer" if self.index is None else f"layer {self.index}"

    @property
    def _trace(self) -> LayerMeta:
        """What ``PolicySpec.build`` hands a policy that reads its trace's meta, in the trace's place."""
        return LayerMeta(self._name, self.meta)

    def _lost(self) -> str:
        return (f"{self._name}: the keys this cache returned for position {self.seen} never reached kvsim's attention "
                "(the model's attention was changed after kvsim.hf.cache attached it, or the family drops the call's "
                "keyword arguments); nothing was evicted for them")

    def get_seq_length(self) -> int:
        """Positions processed (not held): the model derives the next token's position from it."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the mask transformers builds is not read (``attend`` builds its own from the held positions);
        # keep it the size of the new tokens alone
        return query_length, self.seen

    def reset(self) -> None:
        raise HFError("an evicting cache cannot be reset; build a new one with kvsim.hf.cache")

    def reorder_cache(self, beam_idx) -> None:
        raise HFError("an evicting cache does not support beam search")

    # --- what it holds ------------------------------------------------------------------------------

    def held(self, row: int = 0, head: int = 0) -> np.ndarray:
        """Positions held by (row, KV head), ascending."""
        return self.pos[head][row, self.order[row][head]] if self.is_initialized else np.zeros(0, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value storage (allocated once, each KV head at its budget plus one spare slot)."""
        return 0 if not self.is_initialized else sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    # --- attention ----------------------------------------------------------------------------------

    def attend(self, call):
        """The attention output ``(batch, n, query heads, head_dim)`` for the ``n`` new tokens ``update``
        stored, the cache stepped through each; the weights of the last step (``(batch, query heads, 1,
        slots + 1)``, the own key last) when ``n`` is 1 and every KV head holds as many slots, else None.
        ``call``: ``kvsim.hf.attention.Call``, whose keys must be those ``update`` returned (HFError otherwise)."""
        if self.handed is None or call.key is not self.handed[0]:
            raise HFError(f"{self._name}: the attention call got keys this cache did not return for it; the call and "
                          "the cache are out of step")
        _, key, value = self.handed
        self.handed = None
        query, scale, softcap, window = call.query, call.scale, call.softcap, call.window
        self._module = call.module
        self._norms = self._chunk_norms(value, query.shape[1] // key.shape[1])
        try:
            return self._attend(query, key, value, scale, softcap, window)
        finally:
            self._norms = None

    def _attend(self, query, key, value, scale, softcap, window):
        """``attend``'s work, by the prefill: compressed, fast, or each position stepped."""
        n = query.shape[2]
        if self.prefill == "compress" and self.resumed is None:
            return self._attend_compress(query, key, value, scale, softcap, window), None
        if n > 1 and self.prefill == "fast":
            return self._attend_fast(query, key, value, scale, softcap, window), None
        outs, weights = [], None
        for i in range(n):
            out, weights = self._step(query[:, :, i : i + 1], key[:, :, i : i + 1], value[:, :, i : i + 1],
                                      scale, softcap, window)
            outs.append(out)
        if n > 1 and self.prefilled is not None:
            self.prefilled(n)
        return torch.stack(outs, dim=1), (weights if n == 1 else None)

    def _step(self, query, key, value, scale, softcap, window):
        """One position: its key goes into each head's spare last slot, the query attends over the held
        slots and that one, then every policy is stepped and the key moves to a free slot if it stays."""
        t = self.seen
        batch, hq, _, head_dim = query.shape
        hkv = key.shape[1]
        q = query.reshape(batch, hkv, hq // hkv, head_dim)
        outs, per_head = [], []
        for h in range(hkv):  # one block per head: the heads' slot counts differ when their budgets do
            keys, values, pos = self.keys[h], self.values[h], self.pos[h]
            keys[:, -1] = key[:, h, 0]
            values[:, -1] = value[:, h, 0]
            visible = pos >= 0
            if window is not None:
                visible &= pos > t - window
            visible[:, -1] = True
            weights = eager.weights(q[:, h], keys, scale, softcap, torch.from_numpy(visible)[:, None, :])
            outs.append(torch.matmul(weights, values))
            per_head.append(weights)
            # (batch, slots): the own key's weight (the last slot) dropped here, the rest in ``_admit``
            shown = combine(np.moveaxis(weights[..., :-1].double().numpy(), 1, 0)) if t else None
            for b in range(batch):
                self._admit(b, h, t, None if shown is None else shown[b], key[b, h, 0], value[b, h, 0], q[b, h])
        self.seen = t + 1
        same = len({w.shape[-1] for w in per_head}) == 1
        return (torch.stack(outs, dim=1).reshape(batch, hq, head_dim),
                torch.stack(per_head, dim=1).reshape(batch, hq, 1, -1) if same else None)

    def _reader(self, b: int, h: int) -> Policy | None:
        """The policy that decides for (row b, KV head h): its own, or the one resumed after a compressed prompt."""
        return self.resumed[b][h].policy if self.resumed is not None else self.policies[b][h]

    def _vectors(self, policy: Policy | None, h: int, key, value, queries, b: int = 0, t: int = -1) -> dict | None:
        """Position t's rows of what ``policy`` reads (``kvsim.data.vectors``): its key and value as stored, the
        group's queries ``(G, d)``, and ``out_norms`` ``(G,)`` through the layer's ``o_proj`` (row b's, from the
        chunk's when it has them); None if it reads nothing."""
        if policy is None or not policy.reads:
            return None
        out = {}
        for name in policy.reads:
            if name == "keys":
                out[name] = _array(key)
            elif name == "values":
                out[name] = _array(value)
            elif name == "queries":
                out[name] = _array(queries)
            elif name == "out_norms":
                chunk = self._norms
                if chunk is not None and 0 <= t - chunk[0] < chunk[1].shape[2]:
                    out[name] = chunk[1][b, h, t - chunk[0]]
                else:
                    out[name] = self._out_norms(h, value, queries.shape[0])
            else:
                raise HFError(f"{self._name}: {policy.name} reads {name}, which the deployed cache does not compute")
        return out

    def _out_norms(self, h: int, value, group: int) -> np.ndarray:
        """``|W_O^j v|_2`` for each query head j of KV head h's group: the columns of ``o_proj`` its output enters."""
        return _array(eager.output_norms(self._o_proj(), value.reshape(1, 1, -1), group, h)[0, 0])

    def _o_proj(self):
        proj = getattr(self._module, "o_proj", None)
        weight = getattr(proj, "weight", None)
        if weight is None:
            raise HFError(f"{self._name}: out_norms need the attention module's o_proj, which "
                          f"{type(self._module).__name__} does not have")
        return weight

    def _chunk_norms(self, value, group: int) -> tuple[int, np.ndarray] | None:
        """``(first position, (batch, kv heads, n, G))``: every new position's ``out_norms`` in one product per
        row, when a chunk of several positions comes and some policy reads them (None otherwise). The same
        float64 statement as one position's (``eager.output_norms``), so each float32 is within one rounding of
        the exact norm either way; the recorder computes a whole recording's in one product too."""
        if value.shape[2] < 2 or self.policies is None:
            return None
        readers = [type(p) for row in self.policies for p in row if p is not None]
        if self.prefill == "compress" and self.resumed is None:  # the prompt's scorer reads them too
            readers.append(policy_class(self.prefill_policy.name))
        if not any("out_norms" in r.reads for r in readers):
            return None
        weight = self._o_proj()
        norms = np.stack([_array(eager.output_norms(weight, value[b], group)) for b in range(value.shape[0])])
        return self.seen, norms

    def _admit(self, b: int, h: int, t: int, shown, key, value, queries=None) -> None:
        """Show (row b, KV head h)'s policy the attention of step t (and t's vectors, if it reads any), let it
        admit t and evict, and store t's key in a free slot if it stays."""
        policy, order, pos = self._reader(b, h), self.order[b][h], self.pos[h]
        held = pos[b, order]
        vectors = self._vectors(policy, h, key, value, queries, b, t)
        victims = []
        if self.resumed is not None:
            victims = self.resumed[b][h].step(t, shown[order] if policy is not None and policy.reads_attention else None,
                                              None, vectors)
        elif t:  # the held slots in position order: the harness renormalises over them
            victims = step(policy, t, shown[order] if policy.reads_attention else None, self.budgets[b][h],
                           vectors=vectors).victims
        elif vectors is not None:  # position 0, held from the start: never admitted, but seen (as the harness does)
            policy.see(0, vectors)
        slots = np.append(order, -1)  # -1 stands for t, not stored yet
        if len(victims):
            at = np.searchsorted(np.append(held, t), np.asarray(victims, dtype=np.int64))
            for s in slots[at].tolist():
                if s >= 0:
                    pos[b, s] = -1
                    self.free[b][h].append(s)
            slots = np.delete(slots, at)
        if slots.size and slots[-1] == -1:
            if not self.free[b][h]:  # only a head without a policy fills up: the cache grows
                self._grow(h)
                pos = self.pos[h]
            s = self.free[b][h].pop()
            self.keys[h][b, s] = key
            self.values[h][b, s] = value
            pos[b, s] = t
            slots[-1] = s
        self.order[b][h] = slots
        self.peak = max(self.peak, slots.size)
        self.head_peaks[h] = max(self.head_peaks[h], slots.size)

    def _attend_fast(self, query, key, value, scale, softcap, window):
        """Prefill-then-evict: every query of the chunk attends causally over the held slots and the
        chunk (as a full cache would), then each policy is stepped through those rows, position by
        position, and only what it keeps is stored. Blocks of 256 queries bound the score matrix."""
        t0, n = self.seen, query.shape[2]
        batch, hq, _, head_dim = query.shape
        hkv = key.shape[1]
        q = query.reshape(batch, hkv, hq // hkv, n, head_dim)
        out = torch.empty(batch, hkv, hq // hkv, n, head_dim, dtype=query.dtype)
        for h in range(hkv):
            keys = torch.cat([self.keys[h], key[:, h]], dim=1)[:, None]  # (batch, 1, slots + n, d)
            values = torch.cat([self.values[h], value[:, h]], dim=1)[:, None]
            cols = np.concatenate([self.pos[h], np.broadcast_to(t0 + np.arange(n), (batch, n))], axis=1)
            for a in range(0, n, 256):
                ts = t0 + np.arange(a, min(a + 256, n))
                visible = (cols[:, None, :] >= 0) & (cols[:, None, :] <= ts[None, :, None])
                if window is not None:
                    visible &= cols[:, None, :] > ts[None, :, None] - window
                weights = eager.weights(q[:, h, :, a : a + ts.size], keys, scale, softcap, torch.from_numpy(visible)[:, None])
                out[:, h, :, a : a + ts.size] = torch.matmul(weights, values)
                shown = combine(np.moveaxis(weights.double().numpy(), 1, 0))  # (batch, block, slots + n)
                for i, t in enumerate(ts.tolist()):
                    for b in range(batch):
                        self._admit_fast(b, h, t, t0, shown[b, i], key[b, h, t - t0], value[b, h, t - t0],
                                         q[b, h, :, t - t0])
        self.seen = t0 + n
        return out.reshape(batch, hq, n, head_dim).transpose(1, 2)

    def _admit_fast(self, b, h, t, t0, row, key, value, queries) -> None:
        """``_admit`` for a row over (the slots as they were when the chunk starting at ``t0`` came, the
        chunk): a held position from the chunk finds its weight in the chunk's columns, one held from
        before in its slot's (a slot keeps its position until that position is evicted)."""
        order = self.order[b][h]
        slots = self.pos[h].shape[1]
        held = self.pos[h][b, order]
        shown = np.zeros(slots)
        if t and held.size:
            shown[order] = row[np.where(held >= t0, slots + held - t0, order)]
        self._admit(b, h, t, shown, key, value, queries)

    def _attend_compress(self, query, key, value, scale, softcap, window):
        """The prompt, in one pass: every query attends causally over the whole prompt (nothing evicted, as
        ``fast``), then per (row, KV head) ``kvsim.sim.prefill.choose`` picks the kept positions from those
        rows (combined over the group as the recorder combines them) and ``Resumed`` resumes the decode policy
        from them; only what it holds is stored. Holds each head's ``n x n`` combined rows (float64) meanwhile."""
        if self.seen:
            raise HFError(f"{self._name}: prefill='compress' takes the prompt in one forward pass (a first pass of "
                          f"the prompt's tokens); this one came after {self.seen} positions")
        n = query.shape[2]
        batch, hq, _, head_dim = query.shape
        hkv = key.shape[1]
        group = hq // hkv
        try:
            prefill = Prefill.of(n, self.prefill_budget, self.prefill_policy)
        except PrefillError as e:
            raise HFError(f"{self._name}: a prompt of {n} tokens: {e}") from None
        q = query.reshape(batch, hkv, group, n, head_dim)
        out = torch.empty(batch, hkv, group, n, head_dim, dtype=query.dtype)
        cols = np.arange(n)
        self.resumed = [[None] * hkv for _ in range(batch)]
        for h in range(hkv):
            rows = np.empty((batch, n, n))
            for a in range(0, n, 256):
                ts = np.arange(a, min(a + 256, n))
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
                    return lambda p: self._vectors(policy, h, key[b, h, p], value[b, h, p], q[b, h, :, p], b, p)

                kept = choose(prefill, weights_of, vectors_of(prefill.scorer.build(self._trace)), self._trace)
                policy = self.policies[b][h]
                resumed = Resumed(policy, kept, n, weights_of, vectors_of(policy))
                self.resumed[b][h] = resumed
                self._store(b, h, resumed.kept, key[b, h], value[b, h])
        self.seen = n
        return out.reshape(batch, hq, n, head_dim).transpose(1, 2)

    def _store(self, b: int, h: int, held: np.ndarray, keys, values) -> None:
        """Store positions ``held`` (ascending) of a chunk that started at position 0 in free slots."""
        while len(self.free[b][h]) < held.size:
            self._grow(h)
        slots = []
        for p in held.tolist():
            s = self.free[b][h].pop()
            self.keys[h][b, s] = keys[p]
            self.values[h][b, s] = values[p]
            self.pos[h][b, s] = p
            slots.append(s)
        self.order[b][h] = np.asarray(slots, dtype=np.int64)
        self.peak = max(self.peak, held.size)
        self.head_peaks[h] = max(self.head_peaks[h], held.size)

    def _grow(self, h: int) -> None:
        """Double KV head h's block of held slots (its spare last slot stays last): a head without a policy
        holds every position after the compressed prompt."""
        keys, values, pos = self.keys[h], self.values[h], self.pos[h]
        cap = pos.shape[1] - 1
        more = max(cap, 1)
        batch = pos.shape[0]
        def pad(x):
            return torch.cat([x[:, :cap], x.new_zeros(batch, more, x.shape[-1]), x[:, cap:]], dim=1)

        self.keys[h], self.values[h] = pad(keys), pad(values)
        self.pos[h] = np.concatenate([pos[:, :cap], np.full((batch, more), -1, dtype=np.int64), pos[:, cap:]], axis=1)
        for b in range(batch):
            self.free[b][h] = list(range(cap + more - 1, cap - 1, -1)) + self.free[b][h]


def _array(x) -> np.ndarray:
    """A tensor's values as a float32 array of its own (a policy may keep what it is handed)."""
    return x.detach().to(torch.float32).cpu().numpy().copy()


class EvictingCache(Cache):
    """One ``EvictingLayer`` per decoder layer. ``model.generate(..., cache=cache)`` and a plain forward
    loop (``model(ids, cache=cache, use_cache=True)``) both step it (``past_key_values=``, the name
    transformers 5.24 still accepts with a deprecation warning, too)."""

    def __init__(self, layers: list[EvictingLayer], progress: Progress | None = None):
        super().__init__(layers=layers)
        for i, layer in enumerate(layers):
            layer.index = i
        if progress is not None:
            for i, layer in enumerate(layers):
                layer.prefilled = _prefill_note(progress, i, len(layers), layer.prefill)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``, refusing (HFError) while any layer holds keys its attention never
        took: the layers step in turn, so a lost link is said at the next layer, not decoded through."""
        for layer in self.layers:
            if layer.handed is not None:
                raise HFError(layer._lost())
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def peak_positions(self) -> list[int]:
        """Per layer, the most positions one (row, KV head) held after any step."""
        return [layer.peak for layer in self.layers]

    @property
    def head_peaks(self) -> dict[tuple[int, int], int]:
        """Per (layer, KV head), the most positions one row held after any step."""
        return {(x, h): p for x, layer in enumerate(self.layers) for h, p in enumerate(layer.head_peaks)}

    @property
    def budgets(self) -> dict[tuple[int, int], int]:
        """Per (layer, KV head), the budget it holds (the largest row's); empty before the first token."""
        return {(x, h): max(row[h] for row in layer.budgets) for x, layer in enumerate(self.layers)
                if layer.budgets is not None for h in range(len(layer.budgets[0]))}

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's key and value storage: fixed by the budget, whatever the length."""
        return sum(layer.nbytes for layer in self.layers)


def _prefill_note(progress: Progress, index: int, layers: int, how: str) -> Callable[[int], None]:
    def note(n: int) -> None:
        progress((index + 1) / layers, f"{how} prefill: layer {index + 1}/{layers} has stepped through the prompt's "
                                       f"{n} positions")

    return note

"""A transformers ``Cache`` that really evicts: each decoder layer holds at most ``budget`` positions
per KV head, and a kvsim policy decides which (docs/deploy.md, docs/domain.md, "The deployed cache").

The order is the harness's, and so is the step: the query at position t attends to the positions
its layer holds (those inside the layer's own sliding window, if it has one) and to itself; then, for
t >= 1, ``kvsim.sim.harness.step`` shows the policy that attention, admits t and evicts down to the
budget, and checks the victims as the harness does (``ContractError``). What it is shown is the
combining rule of ``kvsim.data.gqa`` (the recorder's): per KV head, the mean in float64 of the weights of
the query heads sharing it, the query's own weight dropped, renormalised over the held set, float32.

A layer is three parts, on transformers' split between a cache layer and the attention function:

- its store (``kvsim.hf.storage``): ``keys`` and ``values``, one tensor each ``(batch, slots, head_dim)``,
  per KV head a run of ``budget + 1`` slots (each head at its own budget: an allocation,
  ``kvsim.hf.cache(..., allocate=...)``; the largest row's, when a batch's rows differ) with a map of
  the position in each slot. ``update`` stores the new position's key and value in each head's spare
  slot and returns the two tensors; the attention reads them through the store's validity mask. A chunk
  of several positions (a prompt) is returned as it came and waits beside the store until the attention
  steps it in, by the layer's prompt mode (``kvsim.hf.modes``: ``exact`` one position at a time through the same step, ``fast``
  attended at once and stepped after, ``compress`` attended at once and chosen from once);
- its steps (``kvsim.hf.stepping``): per (row, KV head) its own policy at its own budget, shown the row
  and naming the victims, whose slots the store frees (t, if it stays, moves from the spare to one);
- the link: ``update`` hands the layer to the attention call in the call's own keyword arguments
  (``kvsim_layer``, which ``kvsim.hf.attention`` reads, because the policy needs the new query's weights,
  which transformers' attention functions never return), and a layer whose keys were not taken by an
  attention call refuses the next update (HFError): a lost link is said, never decoded through.

adakv (``kvsim.hf.pooled``) is the same layer over another store: a layer's KV heads share one pool of
slots, and one joint step per row decides for all of them.

A policy that reads its trace's meta (``reads_meta``: expected_attention's RoPE) is built with the
layer's ``meta``, the fields a recording of that layer states (``kvsim.policykit.rope.rope_meta``, which
``kvsim.hf.cache`` calls on the model), handed over as ``LayerMeta`` where a replay hands the trace.

torch and transformers are imported here at module level: ``kvsim.hf`` is the optional torch extra.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..data.gqa import group
from ..policies import Policy, PolicySpec, policy_class
from ..progress import Progress
from . import modes
from .refusal import HFError
from .stepping import HeadSteps, Vectors
from .storage import Blocks

PREFILL = ("exact", "fast", "compress")
#: the attention call keyword through which ``update`` hands the layer to its attention call
LAYER = "kvsim_layer"


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

    is_sliding = False  # a model's own window is applied in the attention; the policy decides what is held
    is_croppable = False
    is_compileable = False
    supports_early_init = False

    def __init__(self, specs: list[PolicySpec | None] | None = None, *, policies: list[list[Policy]] | None = None,
                 budgets: list[int] | None = None, prefill: str = "exact", rng_seed: int | None = None,
                 prefill_budget=None, prefill_policy: PolicySpec | None = None, meta: dict | None = None):
        self.store = None  # ``kvsim.hf.storage``, made when the first keys tell the batch and the heads
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
        #: compress with a scorer that needs the model: its scores of the prompt ``(batch or 1, kv heads, n)``
        #: (``kvsim.hf.reconstruction``), None until handed over
        self.prefill_scores = None
        #: the layer's meta as a recording states it (``rope_meta``), for the policies that ``reads_meta``
        self.meta = dict(meta or {})
        self.steps = None  # ``kvsim.hf.stepping``, made with the store
        self.vectors = Vectors("an evicting layer")
        self.seen = 0  # positions processed: the next one's position
        self._index: int | None = None
        #: the keys ``update`` returned until the attention call takes them, and the new keys and values
        #: beside them; None between steps
        self.handed: torch.Tensor | None = None
        self.pending: tuple | None = None
        #: the current call is one row taken by every row (``shared_start``): attended once, stepped per row
        self.shared = False
        #: told when this layer has stepped through a prompt (``EvictingCache(progress=...)``): an exact
        #: prefill is a minute or more of Python per long prompt, and it must not look hung
        self.prefilled: Callable[[int], None] | None = None

    # --- transformers' layer API --------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.store, self.steps = self._layout(key_states, value_states)
        self.is_initialized = True

    def _layout(self, key_states, value_states):
        """The store and the steps for a batch of these keys: per (row, KV head) a policy and a run of slots."""
        batch, hkv = key_states.shape[:2]
        if self.policies is None:
            if len(self.specs) != hkv:
                raise HFError(f"the cache was built for {len(self.specs)} KV head(s), the model gives {hkv}")
            rng = None if self.rng_seed is None else np.random.default_rng(self.rng_seed)
            self.policies = [[None if spec is None else spec.build(self.trace, rng=rng) for spec in self.specs]
                             for _ in range(batch)]
        if len(self.policies) != batch or any(len(row) != hkv for row in self.policies):
            raise HFError(f"the cache was built for {len(self.policies)} row(s) x {len(self.policies[0])} KV head(s), "
                          f"the model gives {batch} x {hkv}")
        if self._row_budgets is not None:
            self.budgets = [[int(b)] * hkv for b in self._row_budgets]
        else:  # a head without a policy grows: it starts with room for the prompt
            self.budgets = [[key_states.shape[2] if policy is None else int(policy.budget) for policy in row]
                            for row in self.policies]
        caps = [max(row[h] for row in self.budgets) for h in range(hkv)]  # each head's run: the largest row's
        return Blocks(batch, caps, key_states, value_states), HeadSteps(self.policies, self.budgets)

    def update(self, key_states, value_states, *args, **kwargs):
        """Store the new keys and values and return what the attention reads. One new position (decoding) goes
        into each KV head's free slot here, and the layer's ``keys`` and ``values`` come back as ``(batch, 1,
        slots, head_dim)``: one run of slots that every query head reads through the store's mask (``visible``:
        its own KV head's slots, the new one among them). A chunk of several positions (a prompt) is more than
        the ``budget + 1`` slots hold: it comes back as given and waits beside the store until the attention
        steps it in by the prompt mode. The layer reaches that attention call through its keyword arguments:
        transformers' model families pass theirs to the cache (``update(..., kwargs=kwargs)``) and then to
        the attention function."""
        call = self.link(kwargs)
        rows = len(self.policies) if self.policies is not None else None if self.store is None else self.store.batch
        self.shared = key_states.shape[0] == 1 and rows is not None and rows > 1
        if self.shared:  # one row of a prompt's start for all the rows (``shared_start``): seen as every row's
            key_states = key_states.expand(rows, -1, -1, -1)
            value_states = value_states.expand(rows, -1, -1, -1)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.shared and self.seen + key_states.shape[2] > self.shared_start():
            raise HFError(f"{self.name}: one row of positions {self.seen} to {self.seen + key_states.shape[2] - 1} "
                          f"for {rows} rows, where the rows attend alike only over the first {self.shared_start()} "
                          "positions (EvictingLayer.shared_start); feed every row")
        self.pending = (key_states, value_states)
        if key_states.shape[2] == 1 and not self._compressing:
            self.put(key_states[:, :, 0], value_states[:, :, 0])
            keys, values = self.store.keys[:, None], self.store.values[:, None]  # one run of slots, masked per head
        else:  # a chunk is more than the store holds: it passes through the attention, which steps it in
            keys, values = key_states, value_states
        self.handed = keys
        call[LAYER] = self
        return keys, values

    def link(self, kwargs: dict) -> dict:
        """The attention call's keyword arguments, which ``update`` hands the layer through; HFError when the model
        passes none, or when the keys this layer last returned never reached kvsim's attention."""
        call = kwargs.get("kwargs")
        if not isinstance(call, dict):
            raise HFError(f"{self.name}: the model does not pass its attention call's keyword arguments to the cache "
                          "(update(..., kwargs=kwargs), as transformers' model families do), so the evicting cache "
                          "cannot reach the attention that must step it")
        if self.handed is not None:
            raise HFError(self.lost())
        return call

    def put(self, key, value) -> None:
        """Position ``seen``'s key and value ``(batch, kv heads, d)`` into the store, a slot per (row, KV head)."""
        self.store.put_rows(self.seen, key, value)

    def shared_start(self) -> int:
        """How many of a prompt's first positions every row of this layer attends over in full, and so takes
        as one row (``update`` with a batch of one; 0: none): an exact prefill's plain steps hold every
        position until the smallest budget is passed (the harness holds each policy to exactly ``min(t + 1,
        budget)`` positions), so up to that budget every row's queries attend over the same keys and the
        rows' hidden states stay one; the policies still step per row. A layout (whole blocks), a pool
        (adakv) or a compressed prompt decides otherwise: none."""
        if type(self) is not EvictingLayer or self.prefill != "exact":
            return 0
        if self.budgets is not None:
            return min(min(row) for row in self.budgets) + 1
        if self._row_budgets is not None:
            return min(int(b) for b in self._row_budgets) + 1
        budgets = [int(p.budget) for row in self.policies for p in row] if self.policies is not None else \
            [int(spec.budget) for spec in self.specs]
        return min(budgets) + 1

    @property
    def _compressing(self) -> bool:
        return self.prefill == "compress" and self.steps.resumed is None

    @property
    def keys(self) -> torch.Tensor | None:
        """``(batch, slots, head_dim)``: every KV head's run of slots (``store.span(h)``), None before the first keys."""
        return None if self.store is None else self.store.keys

    @keys.setter
    def keys(self, keys) -> None:
        if self.store is not None:
            self.store.keys = keys

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.store is None else self.store.values

    @values.setter
    def values(self, values) -> None:
        if self.store is not None:
            self.store.values = values

    @property
    def index(self) -> int | None:
        """The decoder layer it serves (``EvictingCache`` sets it), for messages."""
        return self._index

    @index.setter
    def index(self, index: int | None) -> None:
        self._index = index
        self.vectors.name = self.name

    @property
    def name(self) -> str:
        return "an evicting layer" if self.index is None else f"layer {self.index}"

    @property
    def trace(self) -> LayerMeta:
        """What ``PolicySpec.build`` hands a policy that reads its trace's meta, in the trace's place."""
        return LayerMeta(self.name, self.meta)

    def lost(self) -> str:
        return (f"{self.name}: the keys this cache returned for position {self.seen} never reached kvsim's attention "
                "(the model's attention was changed after kvsim.hf.cache attached it, or the family drops the call's "
                "keyword arguments); nothing was evicted for them")

    def get_seq_length(self) -> int:
        """Positions processed (not held): the model derives the next token's position from it."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the mask transformers builds is not read (the attention builds its own from the store's map);
        # keep it the size of the new tokens alone
        return query_length, self.seen

    def reset(self) -> None:
        raise HFError("an evicting cache on the reference path cannot be reset; build a new one with kvsim.hf.cache "
                      "(the tensor path's resets)")

    def reorder_cache(self, beam_idx) -> None:
        raise HFError("an evicting cache on the reference path does not support beam search (the tensor path's does: "
                      "a policy with a tensor step, kvsim.hf.cache(..., tensor=True))")

    def batch_select_indices(self, indices) -> None:
        raise HFError("an evicting cache on the reference path keeps its rows (the tensor path's selects them)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise HFError("an evicting cache on the reference path keeps its rows (the tensor path's repeats them)")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise HFError(f"{self.name}: an evicting cache cannot crop (assisted generation's rollback): its policy has "
                          "already heard the positions to remove, and what they evicted is gone")

    # --- what it holds ------------------------------------------------------------------------------

    def held(self, row: int = 0, head: int = 0) -> np.ndarray:
        """Positions held by (row, KV head), ascending."""
        return self.store.held(row, head) if self.is_initialized else np.zeros(0, dtype=np.int64)

    @property
    def kv_heads(self) -> int | None:
        return None if self.store is None else self.store.kv_heads

    @property
    def resumed(self):
        """compress: ``[row][kv head]`` ``kvsim.sim.prefill.Resumed``, set by the prompt."""
        return None if self.steps is None else getattr(self.steps, "resumed", None)

    @property
    def peak(self) -> int:
        """The most positions any (row, KV head) held after a step."""
        return 0 if self.store is None else self.store.peak

    @property
    def head_peaks(self) -> list[int]:
        """Per KV head, the most positions any row held after a step."""
        return [] if self.store is None else self.store.head_peaks

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value storage (allocated once, each KV head at its budget plus one spare slot)."""
        return 0 if not self.is_initialized else self.store.nbytes

    # --- attention ----------------------------------------------------------------------------------

    def attend(self, call):
        """The attention output ``(batch, n, query heads, head_dim)`` for the ``n`` new tokens ``update``
        took, the cache stepped through each; the weights of the last step (``(batch, query heads, 1,
        slots)``, over each head's span, its own key last) when ``n`` is 1 and every KV head reads as many
        slots, else None. ``call``: ``kvsim.hf.attention.Call``, whose keys must be those ``update`` returned
        (HFError otherwise)."""
        if self.handed is None or call.key is not self.handed:
            raise HFError(f"{self.name}: the attention call got keys this cache did not return for it; the call and "
                          "the cache are out of step")
        key, value = self.pending
        self.handed = self.pending = None
        real = real_positions(call.mask, call.query.shape[2], call.query.shape[0])
        if real is not None and not bool(real.all()):
            raise HFError(f"{self.name}: a padded batch (zeros in attention_mask) runs on the tensor path only; this "
                          "layer (the reference path) would attend over the padding: feed its rows one at a time")
        query, scale, softcap, window = call.query, call.scale, call.softcap, call.window
        if self.shared:  # every row's queries are row 0's; modes.one attends with row 0 alone
            query = query.expand(key.shape[0], -1, -1, -1)
        n, compressing = query.shape[2], self._compressing
        self.vectors.module = call.module
        readers = self.steps.readers()
        if compressing:  # the prompt's scorer reads them too
            readers.append(policy_class(self.prefill_policy.name))
        self.vectors.chunk(self.seen, value, group(query.shape[1], self.store.kv_heads), readers)
        try:
            if compressing:
                return modes.compress(self, query, key, value, scale, softcap, window), None
            if n == 1:
                out, weights = modes.one(self, query, key[:, :, 0], value[:, :, 0], scale, softcap, window)
                return out.unsqueeze(1), weights
            if self.prefill == "fast":
                return modes.fast(self, query, key, value, scale, softcap, window), None
            out, _ = modes.exact(self, query, key, value, scale, softcap, window)
            if self.prefilled is not None:
                self.prefilled(n)
            return out, None
        finally:
            self.vectors.norms = None
            self.shared = False

    # --- the step of one (row, KV head), and a compressed prompt's kept set: what needle listens to -----

    def _admit(self, b: int, h: int, t: int, row, key, value, queries=None) -> None:
        """Show (row b, KV head h)'s policy ``row`` (step t's weights on what it holds, ascending; None at t = 0)
        and t's vectors if it reads any, let it admit t and evict, and free the victims' slots (t, in the
        spare, moved into one if it stays)."""
        vectors = self.vectors.of(self.steps.reader(b, h), b, h, t, key, value, queries)
        self.store.settle(b, h, t, self.steps.step(b, h, t, row, vectors))

    def _store(self, b: int, h: int, held: np.ndarray, keys, values) -> None:
        """Store positions ``held`` (ascending) of a prompt that started at position 0 in free slots."""
        self.store.keep(b, h, held, keys, values)


def real_positions(mask, n: int, batch: int):
    """``(batch, n)`` bool: which of a call's ``n`` new positions the mask transformers built for it lets be
    attended (False: padding, a zero in the call's ``attention_mask``), read off the mask's diagonal (a
    position's own key, which only padding hides from its query); None when the call has no 4-D mask. Read
    on the device, nothing brought back to the host."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] < n or mask.shape[-2] < n:
        return None
    diagonal = mask[:, 0, -n:, -n:].diagonal(dim1=-2, dim2=-1)  # (batch or 1, n)
    real = diagonal if diagonal.dtype == torch.bool else diagonal > torch.finfo(diagonal.dtype).min / 2
    return real.expand(batch, n)


class EvictingCache(Cache):
    """One ``EvictingLayer`` per decoder layer. ``model.generate(..., cache=cache)`` and a plain forward
    loop (``model(ids, cache=cache, use_cache=True)``) both step it (``past_key_values=``, the name
    transformers 5.24 still accepts with a deprecation warning, too)."""

    def __init__(self, layers: list[EvictingLayer], progress: Progress | None = None):
        super().__init__(layers=layers)
        #: what the cache's construction only says (a serving layout's budget rounded to whole blocks, shared
        #: selection on one KV head): one line each
        self.notes: list[str] = []
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
                raise HFError(layer.lost())
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

"""The recorder's attention capture: every layer's softmax from one teacher-forced pass, reduced as it
is produced, so no layer's full ``(heads, n, n)`` softmax, let alone every layer's, is ever held.

One teacher-forced pass gives every layer's softmax; that equals what each query sees when decoding
token by token with nothing evicted, which is what a trace is (docs/domain.md, "Traces"). The pass runs
through an attention function registered with transformers (``ATTN_IMPLEMENTATION``) that calls the
model family's own eager attention a block of query rows at a time and reduces each block at once. For
each (layer, KV head):

1. the query heads that share that KV head are combined (``gqa``: their mean by default, since they
   read the same cache entries and one eviction decision serves them all; or their maximum);
2. the diagonal (the query's weight on its own, just-written key) is dropped and every row
   ``t >= 1`` is renormalised over positions ``0 .. t-1``, as docs/domain.md ("Traces") defines.

torch and transformers are imported inside the functions, never at module level.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

from .errors import RecordError

#: how the query heads that share a KV head are combined
GQA = ("mean", "max")
#: the attention implementation the recorder registers with transformers: eager attention, computed a
#: block of query rows at a time, each block reduced to its KV heads' rows as soon as it is produced
ATTN_IMPLEMENTATION = "kvsim_record"
#: float32 attention weights one block may hold (heads x rows x keys): 16M = 64 MB, so at 8192 tokens
#: a 4-head layer is done in blocks of 512 rows instead of one 1 GB matrix (and its copies)
CHUNK_ELEMENTS = 1 << 24
#: where a finished layer's rows go: (layer, rows per KV head as packed float32 lower triangles, the
#: layer's values per KV head ``(kv heads, n, d)`` float32, what the value-aware proxies read)
LayerSink = Callable[[int, np.ndarray, np.ndarray], None]


def kv_head_rows(softmax: np.ndarray, kv_heads: int, gqa: str = "mean") -> list[np.ndarray]:
    """One ``(n, n)`` float64 matrix per KV head from a layer's softmax ``(query heads, n, n)``.

    The query heads sharing a KV head are combined by ``gqa`` (``mean``, or ``max`` per position;
    grouped-query attention: heads ``h * g .. h * g + g - 1`` read KV head ``h``); then the diagonal
    is dropped and each row ``t >= 1`` renormalised over ``0 .. t-1``. Row 0 and everything on or
    above the diagonal are zero. Raises RecordError if a row put all its weight on itself (nothing is
    left to renormalise). The NumPy statement of what ``record_attention`` computes block by block.
    """
    heads, n, _ = softmax.shape
    if gqa not in GQA:
        raise RecordError(f"gqa must be one of {', '.join(GQA)}, got {gqa!r}")
    if kv_heads < 1 or heads % kv_heads:
        raise RecordError(f"{heads} query heads cannot be shared evenly by {kv_heads} KV heads")
    group = heads // kv_heads
    out = []
    for h in range(kv_heads):
        block = softmax[h * group : (h + 1) * group].astype(np.float64)
        rows = np.tril(block.mean(axis=0) if gqa == "mean" else block.max(axis=0), k=-1)
        sums = rows.sum(axis=1)
        empty = np.flatnonzero(sums[1:] <= 0)
        if empty.size:
            raise RecordError(f"KV head {h}: step {int(empty[0]) + 1} puts all its attention on itself")
        rows[1:] /= sums[1:, None]
        out.append(rows)
    return out


def record_attention(lm, ids, layers: list[int], gqa: str, chunk_elements: int, sink: LayerSink) -> None:
    """One teacher-forced pass of ``ids`` through ``lm``'s decoder stack, handing each of ``layers`` to
    ``sink`` as soon as it is recorded. The pass stops after the last recorded layer, and the model's
    attention setting is restored whatever happens."""
    import torch

    recorder = _Recorder(layers, gqa, chunk_elements, sink)
    decoder = lm.base_model  # the decoder stack alone: the output layer (262k words for Gemma) changes no attention
    stack = getattr(decoder, "layers", None)
    hooks = []
    if stack is not None and len(stack) == lm.config.num_hidden_layers and max(layers) < len(stack) - 1:
        def stop(*_a):
            raise _StopForward
        hooks.append(stack[max(layers)].register_forward_hook(stop))
    previous = lm.config._attn_implementation
    _register_attention(recorder)
    try:
        if not lm._can_set_attn_implementation():
            raise RecordError(f"{type(lm).__name__} does not route its attention through transformers' "
                              "AttentionInterface, so its eager attention cannot be recorded layer by layer")
        lm.set_attn_implementation(ATTN_IMPLEMENTATION)
        with torch.no_grad():
            try:
                decoder(input_ids=ids, use_cache=False)
            except _StopForward:
                pass
    finally:
        for h in hooks:
            h.remove()
        _register_attention(None)
        try:
            lm.set_attn_implementation(previous)
        except Exception:  # noqa: BLE001 - best effort: restoring must not hide the real error
            lm.config._attn_implementation = previous
    missing = [x for x in layers if x not in recorder.done]
    if missing:
        raise RecordError(f"layer {missing[0]}'s attention never reached the recorder: the model does not compute "
                          "it through transformers' attention interface (no eager weights to record)")


def _eager_function(module):
    """The eager attention function of the module's own modelling file (each family has its own:
    softcapping, attention sinks, scaling)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RecordError(f"{type(module).__name__} has no eager_attention_forward in {type(module).__module__}: "
                          "its attention weights cannot be recorded")
    return fn


class _Recorder:
    """Computes eager attention a block of query rows at a time (the same function, the same numbers,
    since each query row's softmax is independent) and reduces each block of weights at once to one
    row per KV head: combined over the query heads that share it, the diagonal dropped, renormalised
    over the earlier positions. Per recorded layer it holds only the packed rows of its KV heads; a
    finished layer goes to ``sink`` and is freed, so peak memory is one block plus one layer."""

    def __init__(self, layers: list[int], gqa: str, chunk_elements: int, sink: LayerSink):
        self.layers, self.gqa, self.chunk_elements, self.sink = set(layers), gqa, chunk_elements, sink
        self.buffers: dict[int, np.ndarray] = {}
        self.done: set[int] = set()

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        import torch

        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise RecordError(f"{type(module).__name__} does not say which layer it is (no layer_idx)")
        eager = _eager_function(module)
        _, heads, q_len, _ = query.shape
        k_len = key.shape[2]
        recorded = layer in self.layers
        if recorded and (query.shape[0] != 1 or q_len != k_len):
            raise RecordError(f"layer {layer}: expected one sequence attending to itself, got query {tuple(query.shape)}")
        if recorded and attention_mask is None and q_len > 1:
            raise RecordError(f"layer {layer}: no causal mask reached the attention; cannot record it")
        rows = max(1, self.chunk_elements // (heads * k_len))
        outputs = []
        for i in range(0, q_len, rows):
            j = min(q_len, i + rows)
            mask = attention_mask
            if mask is not None and mask.shape[-2] == q_len:
                mask = mask[..., i:j, :]
            out, weights = eager(module, query[:, :, i:j], key, value, mask, **kwargs)
            outputs.append(out)
            if recorded:
                if weights is None:
                    raise RecordError(f"layer {layer}: the eager attention returned no weights")
                self._reduce(layer, i, weights, key.shape[1])
            del weights
        if recorded:
            self.sink(layer, self.buffers.pop(layer), value[0].to(torch.float32).cpu().numpy())
            self.done.add(layer)
        return torch.cat(outputs, dim=1), None

    def _reduce(self, layer: int, i: int, weights, kv_heads: int) -> None:
        import torch

        w = weights[0].to(torch.float64)  # (heads, rows, keys)
        heads, rows, n = w.shape
        if heads % kv_heads:
            raise RecordError(f"layer {layer}: {heads} query heads cannot be shared evenly by {kv_heads} KV heads")
        grouped = w.reshape(kv_heads, heads // kv_heads, rows, n)
        comb = grouped.mean(dim=1) if self.gqa == "mean" else grouped.amax(dim=1)  # (kv, rows, n)
        t = torch.arange(i, i + rows, device=w.device).unsqueeze(1)
        below = torch.arange(n, device=w.device).unsqueeze(0) < t  # p < t: what the trace keeps of row t
        bad = (~torch.isfinite(comb)) & below
        if bool(bad.any()):
            h, r, _ = (int(x) for x in torch.nonzero(bad)[0])
            raise RecordError(f"layer {layer} KV head {h}: step {i + r} has NaN or infinite attention")
        comb = comb.masked_fill(~below, 0.0)
        sums = comb.sum(dim=-1)  # (kv, rows)
        empty = (sums <= 0) & (t.squeeze(1) >= 1)
        if bool(empty.any()):
            h, r = (int(x) for x in torch.nonzero(empty)[0])
            raise RecordError(f"layer {layer} KV head {h}: step {i + r} puts all its attention on itself")
        comb = comb / sums.clamp_min(torch.finfo(torch.float64).tiny).unsqueeze(-1)
        values = comb[:, below].to(torch.float32).cpu().numpy()  # rows i .. i+rows-1, each [:t], concatenated
        buf = self.buffers.get(layer)
        if buf is None:
            buf = self.buffers[layer] = np.zeros((kv_heads, n * (n - 1) // 2), dtype=np.float32)
        start = i * (i - 1) // 2 if i > 0 else 0
        buf[:, start : start + values.shape[1]] = values


class _StopForward(Exception):
    """Raised after the last recorded layer: the layers above it cannot change what was recorded."""


#: the recorder the registered attention function serves; set only for the duration of a pass
_ACTIVE: _Recorder | None = None


def _dispatch(module, query, key, value, attention_mask, **kwargs):
    if _ACTIVE is None:
        raise RecordError(f"the {ATTN_IMPLEMENTATION!r} attention runs only inside kvsim.models.recorder")
    return _ACTIVE(module, query, key, value, attention_mask, **kwargs)


def _register_attention(recorder: _Recorder | None) -> None:
    """Point the registered attention at ``recorder`` (registering it with transformers on first use:
    the eager mask, and ``_dispatch`` as the attention function)."""
    global _ACTIVE
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask

    if ATTN_IMPLEMENTATION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ATTN_IMPLEMENTATION, _dispatch)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)
    _ACTIVE = recorder


__all__ = ["ATTN_IMPLEMENTATION", "CHUNK_ELEMENTS", "GQA", "LayerSink", "kv_head_rows", "record_attention"]

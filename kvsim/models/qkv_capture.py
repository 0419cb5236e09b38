"""One teacher-forced pass through a causal LM's decoder stack with memory bounded at any length: each
chosen layer's attention inputs go to a handler as the layer is reached, and no ``(n, n)`` mask or
weight matrix is ever built.

Both stores share it. ``kvsim.models.recorder`` (the dense trace) reduces each block of attention
weights to rows as it is produced; ``capture_qkv`` (the query/key trace, docs/domain.md, "Query/key traces") hands on
each layer's post-norm, post-RoPE queries, keys and values with the attention function's constants
(scale, softcap, sliding window, GQA grouping), from which every row can be computed again on demand.

How: kvsim's one attention function (``kvsim.hf.attention``) is registered with transformers under
``ATTN_IMPLEMENTATION`` with a mask function of our own, and the pass hands it its state (a ``_Pass``) in
the forward's keyword arguments, which transformers passes on to every attention call. The mask function
keeps only what the model's mask builder asked for (``LazyMask``: its index-based mask function, lengths
and offsets), and the pass calls the model family's own ``eager_attention_forward`` a block of query rows at a time, over only the keys the
block can see (the causal prefix, or the sliding window), with that block's mask built by
transformers' own ``sdpa_mask``. A masked key gets ``exp(min - max) = 0`` in the full eager softmax, so
leaving it out changes nothing but the order of a sum: the pass's outputs stay the model's own, and a
sliding-window layer costs O(n x window) instead of O(n^2).

torch and transformers are imported inside the functions, never at module level.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..data.gqa import group
from .errors import RecordError
from .layer_vectors import output_norms

#: the implementation name registered with transformers (attention and mask): eager attention, computed a
#: block of query rows at a time over the keys the block can see
ATTN_IMPLEMENTATION = "kvsim_record"
#: float32 attention weights one block may hold (heads x rows x keys): 16M = 64 MB, so at 8192 tokens
#: a 4-head global layer is done in blocks of 512 rows instead of one 1 GB matrix (and its copies)
CHUNK_ELEMENTS = 1 << 24
#: how far the eager weights of a layer's first block may differ from softmax(softcap(scale q.k)) over
#: the mask before the layer is refused for the query/key store (float32 rounding is ~1e-7)
CONSTANTS_TOLERANCE = 1e-5


class LazyMask:
    """What one of transformers' mask builders (``create_causal_mask``, ``create_sliding_window_causal_mask``)
    asked the mask interface for, kept as its arguments: ``stripe(i, j, lo, hi)`` is the boolean mask of
    query rows ``i .. j-1`` over keys ``lo .. hi-1``, made by transformers' own ``sdpa_mask``, so whatever
    the pattern (causal, sliding, chunked, padded) the blocks see exactly what the eager mask would hold.

    ``candidates(i, j)`` bounds the keys those rows can see without evaluating the rest. When the builder
    made the mask from its own pattern alone (``use_vmap`` false: no custom ``or``/``and`` mask function),
    that pattern is causal, within ``local_size`` for the sliding builder, and anything else it holds
    (padding, packed sequences) is AND-ed onto it, so nothing outside ``[i - local_size + 1, j)`` (or
    ``[0, j)``) is visible; otherwise every key is a candidate. This keeps a sliding layer's mask work
    O(n x window) too; ``capture_qkv`` still checks the first and last blocks at full width."""

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs
        self.q_length, self.kv_length = int(kwargs["q_length"]), int(kwargs["kv_length"])
        self.q_offset, self.kv_offset = int(kwargs.get("q_offset", 0)), int(kwargs.get("kv_offset", 0))
        self.local_size = kwargs.get("local_size")  # the sliding window, when a sliding-window builder made it
        self.dtype = kwargs.get("dtype")

    def stripe(self, i: int, j: int, lo: int = 0, hi: int | None = None):
        """``(j - i, hi - lo)`` bool: True where query row ``t`` (``i <= t < j``) may see key ``p`` (``lo <= p < hi``)."""
        from transformers.masking_utils import sdpa_mask

        hi = self.kv_length if hi is None else hi
        skip = ("q_length", "q_offset", "kv_length", "kv_offset", "dtype", "allow_is_causal_skip")
        args = {k: v for k, v in self.kwargs.items() if k not in skip}
        mask = sdpa_mask(q_length=j - i, q_offset=self.q_offset + i, kv_length=hi - lo, kv_offset=self.kv_offset + lo,
                         allow_is_causal_skip=False, **args)
        if mask is None:  # a bidirectional mask with nothing to hide
            import torch

            return torch.ones((j - i, hi - lo), dtype=torch.bool, device=args.get("device", "cpu"))
        return mask[0, 0]

    def candidates(self, i: int, j: int) -> tuple[int, int]:
        """Keys ``lo .. hi-1`` that rows ``i .. j-1`` may see, at most (class docstring)."""
        if self.kwargs.get("use_vmap", True) or self.q_offset or self.kv_offset:
            return 0, self.kv_length
        lo = 0 if self.local_size is None else max(0, i - int(self.local_size) + 1)
        return lo, min(self.kv_length, j)


def _lazy_mask(**kwargs) -> LazyMask:
    """The mask function registered with transformers: nothing is built until a block asks."""
    if int(kwargs.get("batch_size", 1)) != 1:
        raise RecordError(f"the recorder reads one sequence at a time, got a batch of {kwargs.get('batch_size')}")
    return LazyMask(kwargs)


def eager_function(module):
    """The eager attention function of the module's own modelling file (each family has its own:
    softcapping, attention sinks, scaling)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RecordError(f"{type(module).__name__} has no eager_attention_forward in {type(module).__module__}: "
                          "its attention cannot be recorded")
    return fn


def block_rows(heads: int, kv_length: int, window: int | None, chunk_elements: int) -> int:
    """Query rows per block so that one block's weights (heads x rows x keys seen) stay within
    ``chunk_elements``: a block of ``r`` rows sees at most ``kv_length`` keys, or ``r + window - 1``
    under a sliding window (then no more than ``window`` rows, so the scores computed and masked away
    are at most as many as those kept)."""
    budget = max(1, chunk_elements // heads)
    full = max(1, budget // kv_length)
    if window is None or window >= kv_length:
        return full
    sliding = int((-(window - 1) + math.sqrt((window - 1) ** 2 + 4 * budget)) / 2)  # r (r + window - 1) <= budget
    # at most a window's worth of rows: a block then computes at most twice the scores its rows need
    return max(1, full, min(sliding, window, kv_length))


@dataclass(frozen=True)
class Block:
    """Query rows ``i .. j-1`` of one layer over keys ``lo .. hi-1`` (every key they see): the eager
    ``output`` ``(1, j - i, heads, d)`` and ``weights`` ``(1, heads, j - i, hi - lo)``, and the boolean
    ``stripe`` ``(j - i, hi - lo)`` they were masked by."""

    i: int
    j: int
    lo: int
    hi: int
    stripe: object
    output: object
    weights: object


def stripes(mask: LazyMask, q_length: int, rows: int) -> Iterator[tuple[int, int, object, int, int]]:
    """``(i, j, stripe, lo, hi)`` per block of ``rows`` query rows: the keys ``lo .. hi-1`` the block
    sees (the first to the last seen of its candidates) and its mask over them."""
    import torch

    for i in range(0, q_length, rows):
        j = min(q_length, i + rows)
        first, last = mask.candidates(i, j)
        stripe = mask.stripe(i, j, first, last)
        seen = torch.nonzero(stripe.any(dim=0)).flatten()  # relative to first
        lo, hi = (int(seen[0]), int(seen[-1]) + 1) if seen.numel() else (0, 1)
        yield i, j, stripe[:, lo:hi], first + lo, first + hi


def attention_blocks(module, query, key, value, mask: LazyMask, kwargs: dict, rows: int) -> Iterator[Block]:
    """The module's own eager attention, a block of ``rows`` query rows at a time over only the keys the
    block sees, each block's float mask built from its stripe as transformers' ``eager_mask`` builds it
    (0 where seen, the dtype's minimum elsewhere)."""
    import torch

    eager = eager_function(module)
    for i, j, stripe, lo, hi in stripes(mask, query.shape[2], rows):
        floor = torch.finfo(query.dtype).min
        block_mask = torch.where(stripe, torch.zeros((), dtype=query.dtype, device=query.device), floor)
        out, weights = eager(module, query[:, :, i:j], key[:, :, lo:hi], value[:, :, lo:hi], block_mask[None, None],
                             **kwargs)
        yield Block(i, j, lo, hi, stripe, out, weights)


def eager_output(module, query, key, value, mask: LazyMask, kwargs: dict, chunk_elements: int):
    """The layer's attention output ``(1, n, heads, d)``, blockwise: what eager attention returns."""
    import torch

    rows = block_rows(query.shape[1], key.shape[2], mask.local_size, chunk_elements)
    return torch.cat([b.output for b in attention_blocks(module, query, key, value, mask, kwargs, rows)], dim=1)


#: a recorded layer's handler: (layer, module, query, key, value, mask, eager kwargs, whether the output is
#: needed) -> the attention output (or None when it is not needed: the pass stops after the last layer)
LayerHandler = Callable[..., object]


def run_pass(lm, ids, layers: list[int], handler: LayerHandler, chunk_elements: int = CHUNK_ELEMENTS) -> None:
    """One teacher-forced pass of ``ids`` ``(1, n)`` through ``lm``'s decoder stack (its output layer,
    262k words for Gemma, changes no attention and is skipped). Each of ``layers`` goes to ``handler``;
    the others are computed blockwise by ``eager_output``. The pass stops inside the last recorded
    layer, and the model's attention setting is restored whatever happens."""
    import torch

    from ..hf.attention import SERVING, attending, register

    state = _Pass(sorted(set(layers)), handler, chunk_elements)
    if not lm._can_set_attn_implementation():
        raise RecordError(f"{type(lm).__name__} does not route its attention through transformers' "
                          "AttentionInterface, so its eager attention cannot be recorded layer by layer")
    register(ATTN_IMPLEMENTATION, _lazy_mask)
    with attending(lm, ATTN_IMPLEMENTATION, error=RecordError), torch.no_grad():
        try:
            lm.base_model(input_ids=ids, use_cache=False, **{SERVING: state})
        except _StopPass:
            pass
    missing = [x for x in state.layers if x not in state.done]
    if missing:
        raise RecordError(f"layer {missing[0]}'s attention never reached the recorder: the model does not compute "
                          "it through transformers' attention interface (no eager attention to record)")


class _Pass:
    """What the attention serves for one pass: which layers go to the handler, which are done."""

    def __init__(self, layers: list[int], handler: LayerHandler, chunk_elements: int):
        self.layers, self.handler, self.chunk_elements = layers, handler, chunk_elements
        self.done: set[int] = set()

    def __call__(self, call):
        """One attention call (``kvsim.hf.attention.Call``)."""
        module, query, key, value, attention_mask, kwargs = call.module, call.query, call.key, call.value, call.mask, call.kwargs
        layer = call.layer
        if layer is None:
            raise RecordError(f"{type(module).__name__} does not say which layer it is (no layer_idx)")
        if not isinstance(attention_mask, LazyMask):
            what = "no mask" if attention_mask is None else f"a {type(attention_mask).__name__} it built itself"
            raise RecordError(f"layer {layer}: the attention got {what}, not one from transformers' mask interface; "
                              "cannot record it blockwise")
        if layer not in self.layers:
            return eager_output(module, query, key, value, attention_mask, kwargs, self.chunk_elements), None
        if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
            raise RecordError(f"layer {layer}: expected one sequence attending to itself, got query {tuple(query.shape)}")
        last = layer == self.layers[-1]
        out = self.handler(layer, module, query, key, value, attention_mask, kwargs, not last)
        self.done.add(layer)
        if last:
            raise _StopPass
        return out, None


class _StopPass(Exception):
    """Raised in the last recorded layer: the layers above it cannot change what was recorded."""


@dataclass(frozen=True)
class LayerQKV:
    """What the query/key trace stores of one layer: the post-norm, post-RoPE ``query`` ``(heads, n, d)``,
    ``key`` and ``value`` ``(kv_heads, n, d)`` (float32 tensors), and the attention's constants: score
    ``softcap(scale * q . k)`` with ``softcap(s) = softcap * tanh(s / softcap)`` (none when ``None``),
    key ``p`` visible to query ``t`` iff ``t - sliding_window < p <= t`` (``None``: every ``p <= t``);
    query heads ``h * group .. h * group + group - 1`` read KV head ``h``. ``out_norms`` ``(kv_heads, n,
    group)`` float32: ``|W_O^h v_p|`` per query head of each KV head's group (``layer_vectors.output_norms``),
    or None when the layer has no linear output projection."""

    layer: int
    query: object
    key: object
    value: object
    scale: float
    softcap: float | None
    sliding_window: int | None
    out_norms: object = None

    @property
    def group(self) -> int:
        return group(self.query.shape[0], self.key.shape[0])


def capture_qkv(lm, ids, layers: list[int], sink: Callable[[LayerQKV], None], chunk_elements: int = CHUNK_ELEMENTS) -> None:
    """One pass of ``ids`` through ``lm``, handing each of ``layers`` to ``sink`` as a ``LayerQKV``.

    The layer is checked to be what the query/key trace can state: every block's mask is causal (within
    the sliding window the mask builder declared) over the keys it may see, the first and last blocks'
    over every key, and the eager weights of the first block equal
    ``softmax(softcap(scale q.k))`` computed from the constants within ``CONSTANTS_TOLERANCE``; a layer
    that is not (attention sinks, a bias, another pattern) is refused in one line, since its rows could
    not be computed again from what is stored (``--store dense`` records it).
    """

    def handle(layer, module, query, key, value, mask, kwargs, need_output):
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads % kv_heads:
            raise RecordError(f"layer {layer}: {heads} query heads cannot be shared evenly by {kv_heads} KV heads")
        window = mask.local_size
        constants = {"scale": _scale(module, kwargs), "softcap": kwargs.get("softcap"), "sliding_window": window}
        rows = block_rows(heads, key.shape[2], window, chunk_elements)
        n = query.shape[2]
        for i in sorted({0, (n - 1) // rows * rows}):  # the first and last blocks over every key
            _check_pattern(layer, mask.stripe(i, min(n, i + rows)), i, 0, window)
        outputs = []
        if need_output:
            for b in attention_blocks(module, query, key, value, mask, kwargs, rows):
                _check_pattern(layer, b.stripe, b.i, b.lo, window)
                if b.i == 0:
                    _check_constants(layer, query, key, b, constants)
                outputs.append(b.output)
        else:  # the last layer: its output is never read, so only its masks and first block are checked
            for i, _, stripe, lo, _ in stripes(mask, n, rows):
                _check_pattern(layer, stripe, i, lo, window)
            first = next(attention_blocks(module, query, key, value, mask, kwargs, rows))
            _check_constants(layer, query, key, first, constants)
        try:
            norms = output_norms(module, value, heads, layer)
        except RecordError:  # no linear output projection: the file goes without the optional member
            norms = None
        sink(LayerQKV(layer, query[0], key[0], value[0], **constants, out_norms=norms))
        if need_output:
            import torch

            return torch.cat(outputs, dim=1)
        return None

    run_pass(lm, ids, layers, handle, chunk_elements)


def _scale(module, kwargs: dict) -> float:
    """The scaling the eager function applies: its ``scaling`` argument, or ``head_dim ** -0.5`` where
    the family's eager function defaults to it (Gemma's)."""
    scaling = kwargs.get("scaling")
    return float(module.head_dim ** -0.5 if scaling is None else scaling)


def _check_pattern(layer: int, stripe, i: int, lo: int, window: int | None) -> None:
    """Refuse a block (rows from ``i``, keys from ``lo``) whose mask is not causal (within ``window``):
    the trace states only that pattern."""
    import torch

    t = torch.arange(i, i + stripe.shape[0], device=stripe.device)[:, None]
    p = torch.arange(lo, lo + stripe.shape[1], device=stripe.device)[None, :]
    expected = (p <= t) if window is None else ((p <= t) & (p > t - window))
    if not torch.equal(stripe, expected):
        what = "causal" if window is None else f"causal within a sliding window of {window}"
        raise RecordError(f"layer {layer}: the model's mask is not {what}, which the query/key store cannot state; "
                          "record it with --store dense")


def _check_constants(layer: int, query, key, block: Block, constants: dict) -> None:
    """Refuse a layer whose eager weights are not softmax(softcap(scale q.k)) over the mask."""
    import torch

    k = key[0, :, block.lo : block.hi].repeat_interleave(group(query.shape[1], key.shape[1]), dim=0)  # (heads, keys, d)
    s = torch.matmul(query[0, :, block.i : block.j], k.transpose(1, 2)) * constants["scale"]
    if constants["softcap"] is not None:
        s = torch.tanh(s / constants["softcap"]) * constants["softcap"]
    s = s.masked_fill(~block.stripe, float("-inf"))
    gap = float((torch.softmax(s, dim=-1) - block.weights[0].to(s.dtype)).abs().max())
    if not gap <= CONSTANTS_TOLERANCE:
        raise RecordError(f"layer {layer}: the model's eager attention is not softmax(softcap(scale q.k)) over its mask "
                          f"(differs by {gap:.2g}; attention sinks or a bias?), which the query/key store cannot state; "
                          "record it with --store dense")


__all__ = [
    "ATTN_IMPLEMENTATION",
    "CHUNK_ELEMENTS",
    "Block",
    "LayerQKV",
    "LazyMask",
    "attention_blocks",
    "block_rows",
    "capture_qkv",
    "eager_function",
    "eager_output",
    "run_pass",
]

"""The recorder's attention capture: every layer's softmax from one teacher-forced pass, reduced as it
is produced, so no layer's full ``(heads, n, n)`` softmax, let alone every layer's, is ever held.

One teacher-forced pass gives every layer's softmax; that equals what each query sees when decoding
token by token with nothing evicted, which is what a trace is (docs/domain.md, "Traces"). The pass is
``kvsim.models.qkv_capture.run_pass`` (shared with the query/key store): the model family's own eager
attention a block of query rows at a time, no ``(n, n)`` mask ever built; each block of weights is
reduced at once. For each (layer, KV head):

1. the query heads that share that KV head are combined (``gqa``: their mean by default, since they
   read the same cache entries and one eviction decision serves them all; or their maximum);
2. the diagonal (the query's weight on its own, just-written key) is dropped and every row
   ``t >= 1`` is renormalised over positions ``0 .. t-1``, as docs/domain.md ("Traces") defines.

Both are ``kvsim.data.gqa``'s combining rule, the one every other path (the query/key rows, the closed
loop, the deployed cache) calls too; what is here is only which positions a row keeps and the errors.

torch and transformers are imported inside the functions, never at module level.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..data.gqa import GQA, combine, group, renormalise
from .errors import RecordError
from .layer_vectors import output_norms
from .qkv_capture import CHUNK_ELEMENTS, attention_blocks, block_rows, run_pass

#: where a finished layer's rows go: (layer, rows per KV head as packed float32 lower triangles, the
#: layer's values per KV head ``(kv heads, n, d)`` float32, what the value-aware proxies read, and with
#: ``vectors`` the per-position members the key-, query- and output-aware policies read, per KV head,
#: float32 and position-major (``kvsim.data.vectors``): ``keys`` ``(kv heads, n, d)``, ``queries``
#: ``(kv heads, n, G, d)``, ``out_norms`` ``(kv heads, n, G)``; else None)
LayerSink = Callable[[int, np.ndarray, np.ndarray, dict | None], None]


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
    try:
        g = group(heads, kv_heads)
    except ValueError as e:
        raise RecordError(str(e)) from None
    below = np.tri(n, k=-1, dtype=bool)  # p < t: what the trace keeps of row t
    out = []
    for h in range(kv_heads):
        rows, sums = renormalise(combine(softmax[h * g : (h + 1) * g], gqa), below)
        empty = np.flatnonzero(sums[1:] <= 0)
        if empty.size:
            raise RecordError(f"KV head {h}: step {int(empty[0]) + 1} puts all its attention on itself")
        out.append(rows)
    return out


def record_attention(lm, ids, layers: list[int], gqa: str, chunk_elements: int, sink: LayerSink, *,
                     vectors: bool = False) -> None:
    """One teacher-forced pass of ``ids`` through ``lm``'s decoder stack (``qkv_capture.run_pass``),
    handing each of ``layers`` to ``sink`` as soon as it is recorded (with its keys, queries and output
    norms when ``vectors``). The pass stops inside the last recorded layer, and the model's attention
    setting is restored whatever happens."""
    run_pass(lm, ids, layers, _Recorder(gqa, chunk_elements, sink, vectors), chunk_elements)


class _Recorder:
    """A ``run_pass`` handler: the layer's eager attention a block of query rows at a time
    (``qkv_capture.attention_blocks``: the same function, the same numbers, since each query row's
    softmax is independent), each block of weights reduced at once to one row per KV head: combined
    over the query heads that share it, the diagonal dropped, renormalised over the earlier positions.
    It holds only the packed rows of the layer's KV heads; a finished layer goes to ``sink`` and is
    freed, so peak memory is one block plus one layer."""

    def __init__(self, gqa: str, chunk_elements: int, sink: LayerSink, vectors: bool = False):
        self.gqa, self.chunk_elements, self.sink, self.vectors = gqa, chunk_elements, sink, vectors

    def __call__(self, layer, module, query, key, value, mask, kwargs, need_output):
        import torch

        heads, n = query.shape[1], key.shape[2]
        # blocks as wide as the whole row, whatever the window: each block's weights are placed in full rows
        rows = block_rows(heads, n, None, self.chunk_elements)
        buf = np.zeros((key.shape[1], n * (n - 1) // 2), dtype=np.float32)
        outputs = []
        for b in attention_blocks(module, query, key, value, mask, kwargs, rows):
            if b.weights is None:
                raise RecordError(f"layer {layer}: the eager attention returned no weights")
            self._reduce(layer, b, key.shape[1], n, buf)
            if need_output:
                outputs.append(b.output)
        self.sink(layer, buf, value[0].to(torch.float32).cpu().numpy(),
                  self._vectors(layer, module, query, key, value) if self.vectors else None)
        return torch.cat(outputs, dim=1) if need_output else None

    @staticmethod
    def _vectors(layer: int, module, query, key, value) -> dict:
        """The layer's keys, queries (position-major, grouped by KV head) and output norms, float32 NumPy."""
        import torch

        heads, kv_heads, n = query.shape[1], key.shape[1], query.shape[2]
        q = query[0].to(torch.float32).reshape(kv_heads, group(heads, kv_heads), n, -1).permute(0, 2, 1, 3)
        return {"keys": key[0].to(torch.float32).cpu().numpy(), "queries": q.cpu().numpy(),
                "out_norms": output_norms(module, value, heads, layer).cpu().numpy()}

    def _reduce(self, layer: int, b, kv_heads: int, n: int, buf: np.ndarray) -> None:
        import torch

        w = b.weights[0].to(torch.float64).cpu().numpy()  # (heads, rows, keys lo .. hi-1)
        heads, rows, _ = w.shape
        try:
            i, g = b.i, group(heads, kv_heads)
        except ValueError as e:
            raise RecordError(f"layer {layer}: {e}") from None
        t = np.arange(i, i + rows)[:, None]
        below = np.arange(b.lo, b.hi)[None, :] < t  # p < t: what the trace keeps of row t
        for h in range(kv_heads):
            comb = combine(w[h * g : (h + 1) * g], self.gqa)  # (rows, keys)
            bad = ~np.isfinite(comb) & below
            if bad.any():
                raise RecordError(f"layer {layer} KV head {h}: step {i + int(np.nonzero(bad)[0][0])} has NaN or "
                                  "infinite attention")
            kept, sums = renormalise(comb, below)
            empty = (sums <= 0) & (t[:, 0] >= 1)
            if empty.any():
                raise RecordError(f"layer {layer} KV head {h}: step {i + int(np.flatnonzero(empty)[0])} puts all its "
                                  "attention on itself")
            full = np.zeros((rows, n), dtype=np.float32)
            full[:, b.lo : b.hi] = kept
            values = full[np.arange(n)[None, :] < t]  # rows i .. i+rows-1, each [:t], concatenated
            start = i * (i - 1) // 2 if i > 0 else 0
            buf[h, start : start + values.size] = values


__all__ = ["CHUNK_ELEMENTS", "GQA", "LayerSink", "kv_head_rows", "record_attention"]

"""A plain forward loop over a cache: the prompt in chunks, then one token per pass, timed apart.

``model.generate`` works with an ``EvictingCache`` too; this loop is what ``python -m kvsim generate``
and the benchmark run, because it times the prompt and the decoding separately and reads nothing but
the logits of the last position (an 8k prompt's full logits would be 8 GB for Gemma's 262k words).
"""

from __future__ import annotations

import time

#: prompt tokens per forward pass (transformers' own cache, with eager attention, holds a chunk x
#: context weight matrix per layer: 1024 x 8192 x 4 heads is 128 MB)
CHUNK = 1024


def prefill(model, ids, cache, chunk: int = CHUNK):
    """Feed ``ids`` (``(batch, n)``) into ``cache``; the last forward pass's output. A cache that compresses
    at the prompt's end (``prefill="compress"``) takes the prompt in one pass, after the scoring pass of a scorer
    that needs the model (``kvsim.hf.reconstruction.supply``)."""
    import torch

    if any(getattr(layer, "prefill", None) == "compress" for layer in getattr(cache, "layers", ())):
        chunk = max(chunk, ids.shape[1])
        from .reconstruction import supply

        supply(model, ids, cache)  # a scorer that needs the model: its pass over this prompt, when not handed yet
    out = None
    with torch.no_grad():
        for a in range(0, ids.shape[1], chunk):
            out = model(ids[:, a : a + chunk], cache=cache, use_cache=True, logits_to_keep=1)
    return out


def greedy(model, ids, cache, max_new_tokens: int, eos_token_id=None) -> dict:
    """Greedy decoding of batch row 0's continuation: ``tokens`` (the new ids), ``prefill_seconds``,
    ``decode_seconds`` (the passes after the prompt's), stopping early at ``eos_token_id``."""
    import torch

    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    t0 = time.perf_counter()
    out = prefill(model, ids, cache)
    prefill_s = time.perf_counter() - t0
    tokens = []
    t0 = time.perf_counter()
    with torch.no_grad():
        while True:
            nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens.append(int(nxt[0, 0]))
            if len(tokens) == max_new_tokens or tokens[-1] in eos:
                break
            out = model(nxt, cache=cache, use_cache=True)
    return {"tokens": tokens, "prefill_seconds": prefill_s, "decode_seconds": time.perf_counter() - t0}

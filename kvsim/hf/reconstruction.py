"""KVzip's context reconstruction as the scores of a compressed prompt (``prefill_policy="reconstruction"``,
``kvsim.policies.reconstruction``; docs/scorers.md, "reconstruction").

``reconstruction_scores(model, ids, repeat)``: the context ``ids`` is fed once (``DynamicCache`` with every layer
held in full), then the model is teacher-forced to repeat it: for each chunk of the context (``CHUNK`` positions,
KVzip's 2,000), a pass of the repeat prompt then the chunk over (a copy of) the context's cache.
Each chunk's prompt is KVzip's: "Repeat the previous context exactly." for the first, "Repeat the part of the
previous context exactly, starting with " and the previous chunk's last ``OVERLAP`` (8) tokens for the others; the
chat template KVzip puts after it is left out (kvsim's models are run on plain text). A context position's score
per (layer, KV head) is the largest weight it draws from any query of its chunk's pass, in any query head of the
KV head's group, the softmax taken over the chunk's positions and the pass's own (KVzip's: the other chunks are
outside the score's softmax, not outside the model's attention, which sees the whole context). Layers with a
sliding window attend within it as the model does, so a position the window hides from every repeat query scores 0.

The arithmetic is kvsim's eager attention (``kvsim.hf.eager.weights``: the softmax in float32), served through
``kvsim_serving`` as the quality's masked passes are; nothing of the model's own attention function is used.

``supply(model, ids, cache)``: a cache whose compressed prompt is scored by a model scorer and was handed no
scores is handed them here, from the prompt about to be fed (``kvsim.hf.decoding.prefill`` calls it), the repeat
prompt tokenized by the model's own tokenizer (saved beside it, ``model.name_or_path``).
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import torch

from ..data.gqa import group as gqa_group
from ..policykit import registry
from . import eager
from .refusal import HFError

#: context positions scored per repeat pass (KVzip's ``chunk_size``)
CHUNK = 2000
#: tokens of the previous chunk that the next chunk's repeat prompt starts from (KVzip's ``prev_postfix_size``)
OVERLAP = 8
#: the repeat prompts (KVzip's, without a chat template)
FIRST = "\n\nRepeat the previous context exactly.\n"
LATER = "\n\nRepeat the part of the previous context exactly, starting with "
#: queries per block of a pass's attention
BLOCK = 256
#: what the scores depend on beyond the model and the prompt (a cached measurement's key, ``kvsim.models.needle``)
RECIPE = {"first": FIRST, "later": LATER, "chunk": CHUNK, "overlap": OVERLAP, "softmax": "float32 eager"}


def repeat_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The two repeat prompts as ``tokenizer``'s ids, no special tokens: (the first chunk's, the later chunks')."""
    return (list(tokenizer.encode(FIRST, add_special_tokens=False)),
            list(tokenizer.encode(LATER, add_special_tokens=False)))


class _Pass:
    """``kvsim_serving`` for one forward: eager attention over every key the cache returned (causal, the layer's
    window), and, when ``span`` is set, each layer's scores of context positions ``span`` from this pass's queries."""

    def __init__(self, layers: int, batch: int, kv_heads: int, n: int):
        self.scores = np.zeros((layers, batch, kv_heads, n), dtype=np.float32)
        self.span: tuple[int, int] | None = None
        self.served: set[int] = set()

    def __call__(self, call):
        layer = call.layer
        if layer is None:
            raise HFError(f"{type(call.module).__name__} does not say which layer it is (no layer_idx)")
        self.served.add(layer)
        query, key, value = call.query, call.key, call.value
        batch, hq, q_len, d = query.shape
        hkv, k_len = key.shape[1], key.shape[2]
        g = gqa_group(hq, hkv)
        key_r, value_r = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
        cols = torch.arange(k_len)
        out = torch.empty(batch, hq, q_len, value.shape[-1], dtype=query.dtype)
        for a in range(0, q_len, BLOCK):
            rows = torch.arange(a, min(a + BLOCK, q_len)) + (k_len - q_len)  # the queries' positions
            visible = cols[None, :] <= rows[:, None]
            if call.window is not None:
                visible &= cols[None, :] > rows[:, None] - call.window
            w = eager.weights(query[:, :, a : a + rows.numel()], key_r, call.scale, call.softcap, visible)
            out[:, :, a : a + rows.numel()] = torch.matmul(w, value_r)
            if self.span is not None:
                self._score(layer, query[:, :, a : a + rows.numel()], key_r, call, visible, w, k_len - q_len, g)
        return out.transpose(1, 2).contiguous(), None

    def _score(self, layer, query, key, call, visible, w, context: int, g: int) -> None:
        """Max over the block's queries and the group's heads of the weights on ``span``, the softmax over ``span``
        and the pass's own positions (the whole context's when ``span`` is all of it: the pass's weights)."""
        lo, hi = self.span
        if lo > 0 or hi < context:
            cols = torch.arange(visible.shape[1])
            visible = visible & (((cols >= lo) & (cols < hi)) | (cols >= context))[None, :]
            w = eager.weights(query, key, call.scale, call.softcap, visible)
        batch, hq = w.shape[:2]
        part = w[..., lo:hi].reshape(batch, hq // g, g, w.shape[2], hi - lo).amax(dim=(2, 3))
        best = self.scores[layer, :, :, lo:hi]
        np.maximum(best, part.float().numpy(), out=best)


def reconstruction_scores(model, ids, repeat, *, chunk: int = CHUNK) -> np.ndarray:
    """``(layers, batch, kv heads, n)`` float32: each context position's reconstruction score (the module's doc)
    for the context ``ids`` ``(batch, n)`` (a tensor or a list of ids), with the repeat prompts ``repeat``: a
    tokenizer, or ``repeat_ids``' pair of id lists. One pass over the context, then one per chunk of ``chunk``
    positions over a copy of the context's cache."""
    from transformers import DynamicCache

    from .attention import PLAIN, SERVING, attending

    ids = torch.as_tensor(ids, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise HFError(f"reconstruction scores need a context of at least 2 tokens, got ids of shape {tuple(ids.shape)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise HFError(f"chunk must be an integer of at least 1, got {chunk!r}")
    first, later = repeat if isinstance(repeat, tuple) else repeat_ids(repeat)
    if not first or not later:
        raise HFError("the repeat prompts tokenize to nothing")
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    batch, n = ids.shape
    serving = _Pass(layers, batch, int(kv_heads), n)
    cache = DynamicCache()  # no config: every layer holds every key, the window applied by position in _Pass
    with attending(model, PLAIN), torch.no_grad():
        model.base_model(input_ids=ids, use_cache=True, cache=cache, **{SERVING: serving})
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            prompt = first if lo == 0 else later + ids[0, max(lo - OVERLAP, 0) : lo].tolist()
            head = torch.tensor(prompt, dtype=torch.long)[None].expand(batch, -1)
            serving.span = (lo, hi)
            serving.served.clear()
            past = cache if hi == n else copy.deepcopy(cache)  # each chunk's pass over the context alone
            model.base_model(input_ids=torch.cat([head, ids[:, lo:hi]], dim=1), use_cache=True, cache=past,
                             **{SERVING: serving})
            if len(serving.served) != layers:
                missing = sorted(set(range(layers)) - serving.served)[0]
                raise HFError(f"layer {missing}'s attention never reached the scoring pass: {type(model).__name__} does "
                              "not hand the forward's keyword arguments to its attention function")
    return serving.scores


@functools.lru_cache(maxsize=4)
def _saved_repeat_ids(path: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from transformers import AutoTokenizer

    first, later = repeat_ids(AutoTokenizer.from_pretrained(path))
    return tuple(first), tuple(later)


def model_repeat_ids(model) -> tuple[list[int], list[int]]:
    """The repeat prompts in the ids of the tokenizer saved beside ``model`` (``name_or_path``); HFError, one line,
    when there is none."""
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    try:
        first, later = _saved_repeat_ids(str(path))
    except Exception as e:  # noqa: BLE001 - any failure to find the tokenizer is the same refusal
        raise HFError(f"prefill_policy='reconstruction' tokenizes its repeat prompt with the model's tokenizer, and none "
                      f"loads from {path!r} ({type(e).__name__}); hand kvsim.hf.cache prefill_scores="
                      "kvsim.hf.reconstruction_scores(model, ids, tokenizer)") from None
    return list(first), list(later)


def wanting(cache) -> list:
    """The layers of ``cache`` whose compressed prompt a model scorer chooses and which hold no scores yet."""
    return [layer for layer in getattr(cache, "layers", ())
            if getattr(layer, "prefill", None) == "compress" and getattr(layer, "prefill_scores", 0) is None
            and layer.prefill_policy is not None and registry.needs_model(layer.prefill_policy.name)
            and getattr(layer, "seen", 0) == 0]


def supply(model, ids, cache, repeat=None) -> None:
    """Hand every layer of ``cache`` that ``wanting`` names its scores of the prompt ``ids`` (``(batch, n)``): one
    scoring for the batch when its rows are one prompt."""
    layers = wanting(cache)
    if not layers:
        return
    ids = torch.as_tensor(ids, dtype=torch.long)
    same = ids.shape[0] > 1 and bool((ids == ids[:1]).all())
    scores = reconstruction_scores(model, ids[:1] if same else ids, repeat or model_repeat_ids(model))
    if len(cache.layers) != scores.shape[0]:
        raise HFError(f"the cache has {len(cache.layers)} layers and the model {scores.shape[0]}")
    for x, layer in enumerate(cache.layers):
        if layer in layers:
            layer.prefill_scores = scores[x]


__all__ = ["CHUNK", "RECIPE", "reconstruction_scores", "repeat_ids", "supply"]

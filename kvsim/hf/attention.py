"""The attention function kvsim.hf registers with transformers' ``AttentionInterface``.

It computes what a model family's eager attention computes (scaling, optional logit soft-capping, the
layer's sliding window: key p visible to query t when ``t - window < p <= t``), and keeps the weights,
which SDPA and flash attention never expose and every attention-reading policy needs. Given keys from
an ``EvictingLayer`` it attends over what that layer holds and steps its policies; given any other
keys (the model run with transformers' own caches, or none) it is plain eager attention with the mask
transformers built, so a model left on this function still works as before.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .cache import HFError
from .eager import weights

#: the name under which the function (and eager's mask builder) is registered
ATTN = "kvsim_evict"


def evicting_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                       sliding_window=None, **kwargs):
    """transformers' attention-function signature: ``(output (batch, n, heads, head_dim), weights)``."""
    scale = module.head_dim ** -0.5 if scaling is None else scaling
    layer = getattr(key, "kvsim_layer", None)
    if layer is not None:
        return layer.attend(query, key, value, scale, softcap, sliding_window)
    return eager(query, key, value, attention_mask, scale, softcap)


def eager(query, key, value, attention_mask, scale: float, softcap: float | None):
    """Eager attention over keys a standard cache returned (``repeat_kv``, scores, soft-cap, mask, softmax)."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]
    w = weights(query, key, scale, softcap, mask)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


def attach(model) -> None:
    """Put ``model`` on the kvsim attention function; HFError (one line) when it cannot take it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(ATTN, evicting_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN, eager_mask)
    name = type(model).__name__
    try:
        model.set_attn_implementation(ATTN)
    except (ValueError, AttributeError, NotImplementedError) as e:
        raise HFError(f"{name} has no eager-compatible attention (transformers' AttentionInterface refused: "
                      f"{str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if getattr(model.config, "_attn_implementation", None) != ATTN:
        raise HFError(f"{name} has no eager-compatible attention: it does not take an attention function from "
                      "transformers' AttentionInterface")


@contextmanager
def attention_of(model):
    """``attach`` for the duration of a block, the model's own attention setting restored after."""
    previous = model.config._attn_implementation
    attach(model)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)

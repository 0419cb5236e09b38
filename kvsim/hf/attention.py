"""kvsim's one attention function for transformers' ``AttentionInterface``, and its one attach/restore.

``kvsim_attention`` computes what a model family's eager attention computes (scaling, optional logit
soft-capping, the layer's sliding window: key p visible to query t when ``t - window < p <= t``) and
keeps the weights, which SDPA and flash attention never expose. What it serves arrives with the call,
in the keyword arguments transformers hands every attention function, never through a module global:

- ``kvsim_layer``: put there by an ``EvictingLayer``'s ``update`` (the deployed cache, the closed loop):
  the layer attends over what it holds and steps its policies;
- ``kvsim_serving``: passed by whoever runs the forward (``model(..., kvsim_serving=s)``; transformers
  forwards it to every attention call): a callable taking the ``Call``, as the closed loop's masked
  passes (``kvsim.models.decode``) and the recorder's blockwise pass (``kvsim.models.qkv_capture``) do;
- neither: plain eager attention with the mask transformers built, so a model left on this function
  still runs with transformers' own caches or none.

The function is registered under one name per mask transformers should build for it (``USES``):
``kvsim_evict`` builds the eager mask (the plain path needs it), ``kvsim_quality`` none (the masked
pass builds its own), ``kvsim_record`` the recorder's lazy mask. ``attending`` puts a model on one of
them for a block and restores its own setting after; ``attach`` leaves it there (``kvsim.hf.cache``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.masking_utils import eager_mask

from ..data.gqa import group as gqa_group
from .cache import LAYER, HFError
from .eager import weights

#: the deployed cache's name (its eager mask serves a model left on it with transformers' own caches)
ATTN = "kvsim_evict"
#: the name that builds no mask: the caller's serving applies its own
PLAIN = "kvsim_quality"
#: the call keyword that carries what a forward pass serves
SERVING = "kvsim_serving"


@dataclass(frozen=True)
class Call:
    """One attention call as transformers makes it: the module, the post-RoPE ``query`` ``(batch, heads,
    n, d)``, the ``key`` and ``value`` the cache returned ``(batch, kv heads, keys, d)``, the ``mask``
    transformers built (or None), and the rest of its keyword arguments (``scaling``, ``dropout``,
    ``softcap``, ``sliding_window``, ...) as the family's own eager function takes them."""

    module: object
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: object
    kwargs: dict

    @property
    def layer(self) -> int | None:
        """The decoder layer's index (``module.layer_idx``), None when the module does not say."""
        return getattr(self.module, "layer_idx", None)

    @property
    def scale(self) -> float:
        scaling = self.kwargs.get("scaling")
        return self.module.head_dim ** -0.5 if scaling is None else scaling

    @property
    def softcap(self) -> float | None:
        return self.kwargs.get("softcap")

    @property
    def window(self) -> int | None:
        return self.kwargs.get("sliding_window")


def kvsim_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function signature: ``(output (batch, n, heads, head_dim), weights)``."""
    layer, serving = kwargs.pop(LAYER, None), kwargs.pop(SERVING, None)
    call = Call(module, query, key, value, attention_mask, kwargs)
    if layer is not None:
        if serving is not None:
            raise HFError(f"layer {call.layer}: an evicting cache and a {type(serving).__name__} both reached one "
                          "attention call; run a masked pass without a cache")
        return layer.attend(call)
    if serving is not None:
        return serving(call)
    return eager(call)


def eager(call: Call):
    """Eager attention over keys a standard cache returned (``repeat_kv``, scores, soft-cap, mask, softmax)."""
    group = gqa_group(call.query.shape[1], call.key.shape[1])
    key = call.key.repeat_interleave(group, dim=1)
    value = call.value.repeat_interleave(group, dim=1)
    mask = None if call.mask is None else call.mask[:, :, :, : key.shape[-2]]
    w = weights(call.query, key, call.scale, call.softcap, mask)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


#: the names kvsim_attention is registered under, and the mask function each makes transformers build
#: (None: no mask; ``kvsim.models.qkv_capture`` registers ``kvsim_record`` with its own)
USES: dict[str, Callable | None] = {ATTN: eager_mask, PLAIN: None}


def register(name: str, mask: Callable | None = None) -> None:
    """Register ``kvsim_attention`` under ``name``, with ``mask`` as the mask transformers builds for it
    (None: it builds none)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    USES[name] = mask
    AttentionInterface.register(name, kvsim_attention)
    if mask is not None and ALL_MASK_ATTENTION_FUNCTIONS.get(name) is not mask:
        AttentionMaskInterface.register(name, mask)


def attach(model, name: str = ATTN, error: type[Exception] = HFError) -> None:
    """Put ``model`` on ``kvsim_attention`` (under ``name``); ``error`` (one line) when it cannot take it."""
    register(name, USES.get(name))
    kind = type(model).__name__
    try:
        model.set_attn_implementation(name)
    except (ValueError, AttributeError, NotImplementedError) as e:
        raise error(f"{kind} has no eager-compatible attention (transformers' AttentionInterface refused: "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if getattr(model.config, "_attn_implementation", None) != name:
        raise error(f"{kind} has no eager-compatible attention: it does not take an attention function from "
                    "transformers' AttentionInterface")


@contextmanager
def attending(model, name: str = ATTN, error: type[Exception] = HFError) -> Iterator[None]:
    """``attach`` for the duration of a block, the model's own attention setting restored after,
    whatever happens inside."""
    previous = model.config._attn_implementation
    attach(model, name, error)
    try:
        yield
    finally:
        try:
            model.set_attn_implementation(previous)
        except Exception:  # noqa: BLE001 - best effort: restoring must not hide the real error
            model.config._attn_implementation = previous


__all__ = ["ATTN", "PLAIN", "SERVING", "USES", "Call", "attach", "attending", "eager", "kvsim_attention", "register"]

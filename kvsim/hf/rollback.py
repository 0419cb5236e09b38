"""Taking back a call's last positions on the tensor path (transformers' ``crop``, which assisted generation calls
after each verification pass to drop the draft tokens the model rejected).

An evicting cache cannot give back what it evicted, and its policies have already heard the positions to remove. So
once transformers asks for it (``activate_past_recording``, before assisted generation's first pass), a layer keeps,
at the start of every call, a copy of everything the call changes (the slot map, keys and values, counts, the
policies' state and the built policies themselves, a seeded generator's too) and the call's own queries, keys and
values. ``crop(-k)`` puts the copy back and steps the call's first ``n - k`` positions again, as the call would have
had it been that long: each position's step reads only positions before it, so the held sets, the policies' state
and the departures are those of a run that never saw the removed positions. Only the last call can be taken back,
and only while recording; anything else is refused in one line (``HFError``).
"""

from __future__ import annotations

import copy

from .refusal import HFError

#: what a call of the tensor path changes on its layer (``TensorLayer``): the copy ``save`` keeps
FIELDS = ("pos", "_keys", "_values", "seen", "_count", "broken", "left", "_col", "_padded", "policies", "budgets",
          "budget", "groups", "_least", "is_initialized", "reads", "reads_attention", "_walkers")


def save(layer) -> dict:
    """A copy of the layer as it is before a call (one ``deepcopy``: what several fields share, such as the built
    policies the groups' state lists and the compiled walk's state, stays shared in the copy; the walk's compiled
    kernels and hooks are code, shared with the layer's)."""
    code = {}
    for walker in layer._walkers or ():
        for part in (walker.step, walker.hooks, walker.walk):
            code[id(part)] = part
    return copy.deepcopy({name: getattr(layer, name) for name in FIELDS}, code)


def restore(layer, saved: dict) -> None:
    """The layer put back as ``save`` found it, the compiled walk's state (and so how far a random policy has
    drawn) included."""
    for name, value in saved.items():
        setattr(layer, name, value)


def crop(layer, tokens_to_remove: int) -> None:
    """``layer.crop``: remove the last ``-tokens_to_remove`` positions (transformers' sign: a positive count is its
    legacy absolute length, refused there too), which must all come from the layer's last call while it records."""
    if not tokens_to_remove:
        return
    if tokens_to_remove > 0:
        raise HFError(f"{layer.name}: crop takes the number of positions to remove as a negative count (transformers' "
                      f"contract), got {tokens_to_remove}")
    drop = -tokens_to_remove
    if not layer.record_past:
        raise HFError(f"{layer.name}: an evicting cache cannot crop unless it recorded the call before it "
                      "(activate_past_recording, which assisted generation asks for): its policy has already heard "
                      "the positions to remove, and what they evicted is gone")
    past = layer._past
    if past is None or "q" not in past:
        raise HFError(f"{layer.name}: crop of {drop} position(s) with no call recorded since the last crop or reset")
    n = past["q"].shape[3]
    if drop > n:
        raise HFError(f"{layer.name}: crop of {drop} position(s) reaches before the last call ({n} position(s)); an "
                      "evicting cache keeps the state before its last call only")
    layer._past = None
    restore(layer, past["state"])
    keep = n - drop
    if keep:
        real = past["real"]
        replay(layer, past["q"][:, :, :, :keep], past["key"][:, :, :keep], past["value"][:, :, :keep], past["call"],
               None if real is None else real[:, :keep])


def replay(layer, q, key, value, call, real) -> None:
    """A call's first positions stepped again from the state before it, as the layer's ``update`` and ``attend`` step
    a call (its outputs unused)."""
    if q.shape[3] == 1:
        layer._col = layer._free_slot()
        layer._write(layer._col, key, value)
    elif real is not None:  # as ``_real`` marks a padded prompt
        layer._pads()
    layer._step_call(q, key, value, call, real)

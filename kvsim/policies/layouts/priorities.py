"""What a layout reads from the policy it wraps, and what it does to it: each held position's score under
the policy's own rule (``priorities``: lower goes first, ``inf`` never goes by that rule), and the removal
of positions the layout chose (``drop``). Written once here for every policy, so that a layout wraps any
online policy, a plugin's included, without the policy knowing of layouts:

- a ``SlotPolicy`` (h2o, tova, snapkv, scissorhands, the key and value scorers ...) ranks in its ``evict``
  by one call to ``_evict_lowest(budget, values)``: ``values`` are its scores of the evictable slots (a
  prefix of kept order: the newest ``recent_window``, or the newest position, are not in it). The layout
  calls that ``evict`` with ``_evict_lowest`` replaced for the call by one that records ``values`` and
  evicts nothing, so the scores are the policy's own, computed by its own code. The slots beyond the
  prefix are protected (``inf``). Removal compacts the slot arrays as ``_evict_lowest`` does.
- a policy whose evict does not rank that way defines ``layout_priorities()`` (aligned with ``kept``) and,
  if it is no SlotPolicy, ``layout_drop(victims)`` beside its own rule, in its own module: vatp (it ranks its
  pinned sinks last rather than scoring them), random (a draw from its own generator), streaming_llm and
  sliding_window (a ring after the pinned sinks: the oldest goes first). One with neither is refused in one
  line (``LayoutError``).
"""

from __future__ import annotations

import numpy as np

from ..base import Policy, SlotPolicy


class LayoutError(ValueError):
    """A layout that cannot run as asked: one line naming the policy, the layout and the problem."""


def _capture(policy: SlotPolicy) -> np.ndarray:
    """The values ``policy.evict`` hands ``_evict_lowest`` (its scores of the evictable prefix), nothing evicted."""
    seen: list[np.ndarray] = []

    def record(budget: int, values: np.ndarray) -> list[int]:
        seen.append(np.asarray(values, dtype=np.float64).copy())
        return []

    policy._evict_lowest = record  # an instance attribute, shadowing the method for this one call
    try:
        policy.evict(0)
    finally:
        del policy._evict_lowest
    if len(seen) != 1:
        raise LayoutError(f"{policy.name}: its evict did not rank its positions in one _evict_lowest call; "
                          "a layout needs layout_priorities() on it")
    return seen[0]


def priorities(policy: Policy) -> np.ndarray:
    """float64, aligned with ``policy.kept``: each held position's score under the policy's own rule, the
    lowest going first; ``inf`` where the rule never evicts it (a recent window, sinks, the newest)."""
    own = getattr(policy, "layout_priorities", None)
    if own is not None:
        return np.asarray(own(), dtype=np.float64)
    if isinstance(policy, SlotPolicy):
        out = np.full(policy.kept.size, np.inf)
        values = _capture(policy)
        out[: values.size] = values
        return out
    raise LayoutError(f"{policy.name} exposes no per-position score a layout can sum (a SlotPolicy, or "
                      "layout_priorities() and layout_drop())")


def drop(policy: Policy, victims: np.ndarray) -> None:
    """Remove ``victims`` (held positions, ascending) from ``policy``, its per-position state with them."""
    if victims.size == 0:
        return
    own = getattr(policy, "layout_drop", None)
    if own is not None:
        own(victims)
        return
    if isinstance(policy, SlotPolicy):
        n = policy._len
        keep = ~np.isin(policy._pos[:n], victims)
        m = int(keep.sum())
        if n - m != victims.size:
            raise LayoutError(f"{policy.name}: asked to drop {victims.tolist()}, not all held")
        for arr in (policy._pos, *policy._slot_arrays()):
            arr[:m] = arr[:n][keep]
        policy._len = m
        return
    raise LayoutError(f"{policy.name} cannot have positions removed by a layout (it needs layout_drop())")

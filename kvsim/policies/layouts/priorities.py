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
- vatp ranks rather than scores (its pinned sinks after every other position): its score is its own
  product, cumulative attention x |v|_1, the sinks and the recent window protected.
- random draws its victims: its scores are one uniform draw per held position from its own generator.
- streaming_llm and sliding_window (a ring of positions after the pinned sinks): the score is the
  position (the oldest goes first), the sinks protected.
- any other policy may define ``layout_priorities()`` (aligned with ``kept``) and ``layout_drop(victims)``;
  one with neither is refused in one line (``LayoutError``).
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
    from ..random_eviction import RandomEviction
    from ..streaming_llm import StreamingLLM
    from ..vatp import VATP

    kept = policy.kept
    out = np.full(kept.size, np.inf)
    if isinstance(policy, StreamingLLM):
        sinks = len(policy._sink_positions)
        out[sinks:] = kept[sinks:]
        return out
    if isinstance(policy, RandomEviction):
        return policy.rng.random(kept.size)
    if isinstance(policy, VATP):
        n = max(policy._len - policy.recent_window, 0)
        product = policy._score[:n] * policy._mult[:n]
        out[:n] = np.where(policy._pos[:n] < policy._sinks, np.inf, product)
        return out
    if isinstance(policy, SlotPolicy):
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
    from ..streaming_llm import StreamingLLM

    if isinstance(policy, StreamingLLM):
        ring = policy.kept[len(policy._sink_positions):]
        if np.isin(victims, policy._sink_positions).any():
            raise LayoutError(f"{policy.name}: its sinks are pinned; a layout cannot evict them")
        left = ring[~np.isin(ring, victims)]
        policy._slots[: left.size] = left
        policy._head, policy._len = 0, left.size
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

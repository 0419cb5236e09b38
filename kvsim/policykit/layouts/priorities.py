"""What a layout reads from the policy it wraps, and what it does to it: each held position's score under
the policy's own rule (``priorities``: lower goes first, ``inf`` never goes by that rule), and the removal
of positions the layout chose (``drop``). Written once here for every policy, so that a layout wraps any
online policy, a plugin's included, without the policy knowing of layouts:

- a ``SlotPolicy`` (h2o, tova, snapkv, scissorhands, the key and value scorers ...) ranks in its ``evict``
  by one call to ``_evict_lowest(budget, values)``: ``values`` are its scores of the evictable slots (a
  prefix of kept order: the newest ``recent_window``, or the newest position, are not in it). Its
  ``layout_priorities`` (``kvsim/policykit/base.py``) calls that ``evict`` with ``_evict_lowest`` replaced for
  the call by one that records ``values`` and evicts nothing, so the scores are the policy's own, computed by
  its own code. The slots beyond the prefix are protected (``inf``). Its ``layout_drop`` compacts the slot
  arrays as ``_evict_lowest`` does.
- a policy whose evict does not rank that way overrides ``layout_priorities()`` (aligned with ``kept``) and,
  if it is no SlotPolicy, ``layout_drop(victims)`` beside its own rule, in its own module: vatp (it ranks its
  pinned sinks last rather than scoring them), random (a draw from its own generator), streaming_llm and
  sliding_window (a ring after the pinned sinks: the oldest goes first).

Each declares it (``layout_score``, a capability: ``registry.layout_ready``); ``Layout.check`` refuses one that
does not in one line, before any trace or model loads.
"""

from __future__ import annotations

import numpy as np

from ..base import LayoutError, Policy


def priorities(policy: Policy) -> np.ndarray:
    """float64, aligned with ``policy.kept``: each held position's score under the policy's own rule, the
    lowest going first; ``inf`` where the rule never evicts it (a recent window, sinks, the newest)."""
    if not policy.layout_score:
        raise LayoutError(f"{policy.name} declares no layout score (layout_score): a layout cannot sum its scores")
    return np.asarray(policy.layout_priorities(), dtype=np.float64)


def drop(policy: Policy, victims: np.ndarray) -> None:
    """Remove ``victims`` (held positions, ascending) from ``policy``, its per-position state with them."""
    if victims.size == 0:
        return
    if not policy.layout_score:
        raise LayoutError(f"{policy.name} declares no layout score (layout_score): a layout cannot remove positions")
    policy.layout_drop(victims)


__all__ = ["LayoutError", "drop", "priorities"]

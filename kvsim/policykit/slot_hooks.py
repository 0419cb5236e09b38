"""What a policy's fast path is made of, declared beside the policy (h2o's: ``kvsim.policies.h2o``): its
``SlotHooks``, the hooks of the engine's one step loop (``kvsim.sim.kernels``, which states the loop's rules
and each hook's arguments), the ``Shape`` its state is sized by, and the helpers hooks share: ``_first_min``
(the victim among equal scores: the first, the lower position; ``_first_max`` likewise, for the policies that
evict the largest), ``_drop`` (a slot's gap closed, kept order kept), ``_slots`` (a per-slot array for every
configuration), and the stand-ins of a hook left out (``_nothing_observed``, ``_nothing_admitted``,
``_nothing_dropped``), which every step loop shares. Here, in the policies layer, so that a policy module
declares its hooks without importing the simulator; they are ``kvsim.jit`` kernels, stand-ins until the
engine's first call compiles them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..jit import kernel


class Shape(NamedTuple):
    """What a policy's state is sized by: configurations, slots per configuration (the largest budget
    plus one) and steps of the trace."""

    configs: int
    width: int
    steps: int


@dataclass(frozen=True)
class SlotHooks:
    """A policy's hooks of the engine's step loop, declared beside it and given to its ``EngineBinding``:
    the engine specialises the loop with them (``kvsim.sim.kernels.slot_kernel``, the same arguments) on
    the first fast replay, so declaring them compiles nothing, imports no numba and reads no file.
    ``name``: the specialisation's, one per set of hooks (``"h2o_steps"``); ``state(shape,
    **engine_inputs)``, the tuple the hooks unpack; each hook a ``kvsim.jit.kernel``, left out: nothing
    to do (``pick`` is the one every policy has)."""

    name: str
    state: Callable[..., tuple]
    pick: Callable
    measure: Callable | None = None
    observe: Callable | None = None
    admit: Callable | None = None
    score: Callable | None = None
    drop: Callable | None = None


@kernel
def _first_min(values, count):
    """The slot of the smallest of ``values[:count]``, the first one on ties: the lower position,
    since slots are in kept order (the reference's repeated argmin, one victim per step)."""
    best = 0
    low = values[0]
    for i in range(1, count):
        if values[i] < low:  # strict: the first minimum, the lower position
            low = values[i]
            best = i
    return best


@kernel
def _first_max(values, n):
    """The slot of the largest of ``values[:n]``; strict, so the first maximum: the lower position."""
    best = 0
    high = values[0]
    for i in range(1, n):
        if values[i] > high:
            high = values[i]
            best = i
    return best


@kernel
def _drop(slots, best, n):
    """Close the gap that evicting slot ``best`` of the ``n`` in use leaves (kept order is kept).
    Copied between two views rather than ``slots[i] = slots[i + 1]``: LLVM vectorises this form, and the
    window policies, whose step is little more than this shift, ran 1.7-1.8x slower than their old closed form
    with the other."""
    src = slots[best + 1 : n]
    dst = slots[best : n - 1]
    for i in range(n - 1 - best):
        dst[i] = src[i]


@kernel
def _nothing_observed(state, c, p_c, n, gather, total):
    """A left-out ``observe``: the step loops' (the engine's and the deployed walk's) stand-in."""


@kernel
def _nothing_admitted(state, c, p_c, n):
    """A left-out ``admit``."""


@kernel
def _nothing_dropped(state, c, best, n):
    """A left-out ``drop``."""


def _slots(shape: Shape, fill, dtype) -> np.ndarray:
    return np.full((shape.configs, shape.width), fill, dtype=dtype)

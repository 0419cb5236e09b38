"""StreamingLLM: pin the first ``sinks`` positions forever, slide a window over the rest.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024
(arXiv:2309.17453). Trained transformers park attention on the first few tokens (attention
sinks); a window that throws them away degrades sharply. Tie rule: victims are the oldest
unpinned positions, oldest first, which is ascending position order. Attention is never read.

With ``sinks = 0`` this is the sliding window (``sliding_window.py`` is exactly that).

Its fast path, sliding_window's too, is declared here (``STEPS``): the hooks with which the engine's one
step loop (``kvsim.sim.kernels``) replays every configuration at once. The victim is the oldest unpinned
position, slot ``sinks`` in kept order, once the cache is over its budget; what is held before step t is a
closed form of the budget and the sinks, so the kept mass and the top-k hits are read along the row.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, Display, EngineBinding, Param, Policy, per_config
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks
from ..policykit.tensor_hooks import TensorHooks, TensorState, param

SINKS = Param("sinks", 4, "the first sinks positions are pinned forever", below_budget=True)


# --------------------------------------------------------------------------------------------
# the fast path (sliding_window's with ``sinks == 0``): the oldest unpinned position, slot ``sinks`` in
# kept order, leaves once the cache is over its budget; ``state``: each configuration's sinks and budget


@kernel
def _window_measure(state, c, t, row, p_c, n, stamp, gather):
    """The closed form of what is held before step t (the slots hold the same, in the same order):
    everything when t <= budget, else positions ``0 .. sinks-1`` and the newest ``budget - sinks``.
    Read along the row, not through the slots: nothing to gather, since nothing is observed."""
    sinks, budgets = state
    b = budgets[c]
    s = sinks[c] if t > b else t
    lo = t - (b - s) if t > b else t
    total = 0.0
    hits = 0
    for p in range(s):
        total += np.float64(row[p])
        if stamp[p] == t:
            hits += 1
    for p in range(lo, t):
        total += np.float64(row[p])
        if stamp[p] == t:
            hits += 1
    return total, hits


@kernel
def _window_pick(state, c, t, p_c, n, A, a0, scored):
    return state[0][c]


def _window_state(shape: Shape, sinks, budgets):
    return sinks, budgets


#: streaming_llm's and sliding_window's hooks of the engine's step loop, which their ``engine_binding`` names
STEPS = SlotHooks("window_steps", _window_state, measure=_window_measure, pick=_window_pick)


# the tensor step (``kvsim.hf.tensor``), sliding_window's too: the oldest held position that is not among
# the ``sinks`` oldest


def _window_tensor_state(policies, batch, heads, width, device):
    return TensorState({"sinks": param(policies, "sinks", device)}, {})


def _window_tensor_rank(state, cols):
    return cols.pos.double(), cols.older >= state.params["sinks"][..., None]


#: streaming_llm's and sliding_window's tensor step, which their ``tensor_step`` names
TENSOR = TensorHooks("streaming_llm", _window_tensor_state, _window_tensor_rank, walk=())


@register
class StreamingLLM(Policy):
    name = "streaming_llm"
    order = 20
    table_rows = ({"sinks": 4},)
    summary = "pin the first sinks positions and keep the newest of the rest"
    display = Display("#2ca02c", "12px,4px", 4)
    engine_binding = EngineBinding(STEPS, compile_s=1)
    tensor_step = TENSOR
    tunables = (SINKS,)
    #: a ring after the pinned sinks: ``layout_priorities`` and ``layout_drop`` below
    layout_score = True

    def __init__(
        self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None, sinks: int = SINKS.default
    ) -> None:
        super().__init__(budget, rng)
        self._init_ring(SINKS.check(sinks, self.budget))

    @classmethod
    def engine_inputs(cls, policies, steps):
        # sliding_window's sinks are 0; the budgets too, since what is held is a closed form of both
        return {"sinks": per_config(p.sinks for p in policies), "budgets": per_config(p.budget for p in policies)}

    def _init_ring(self, sinks: int) -> None:
        self.sinks = sinks
        self._sink_positions: list[int] = []
        # ring buffer for the unpinned part: at most budget + 1 - sinks positions at once
        self._slots = np.zeros(self.budget + 1 - sinks, dtype=np.int64)
        self._head = 0
        self._len = 0
        self._admit(0)  # the cache starts holding position 0

    def _admit(self, pos: int) -> None:
        if len(self._sink_positions) < self.sinks:
            self._sink_positions.append(pos)
            return
        if self._len == self._slots.size:
            raise RuntimeError(f"{self.name}: cache full ({self.budget + 1}); evict before the next step")
        self._slots[(self._head + self._len) % self._slots.size] = pos
        self._len += 1

    @property
    def kept(self) -> np.ndarray:
        idx = (self._head + np.arange(self._len)) % self._slots.size
        return np.concatenate([np.asarray(self._sink_positions, dtype=np.int64), self._slots[idx]])

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        self._admit(pos)

    def layout_priorities(self) -> np.ndarray:
        """A serving layout's per-position score (kvsim.policykit.layouts): the position itself, so the oldest
        of the ring goes first; the sinks never go (``inf``)."""
        kept = self.kept
        out = np.full(kept.size, np.inf)
        sinks = len(self._sink_positions)
        out[sinks:] = kept[sinks:]
        return out

    def layout_drop(self, victims: np.ndarray) -> None:
        """Remove ``victims`` (ring positions, ascending) that a layout chose; the ring keeps its order."""
        if np.isin(victims, self._sink_positions).any():
            from ..policykit.layouts.priorities import LayoutError

            raise LayoutError(f"{self.name}: its sinks are pinned; a layout cannot evict them")
        ring = self.kept[len(self._sink_positions):]
        left = ring[~np.isin(ring, victims)]
        self._slots[: left.size] = left
        self._head, self._len = 0, left.size

    def evict(self, budget: int) -> list[int]:
        victims = []
        while len(self._sink_positions) + self._len > budget:
            if self._len == 0:
                raise ValueError(f"{self.name}: budget {budget} is below sinks ({self.sinks})")
            victims.append(int(self._slots[self._head]))
            self._head = (self._head + 1) % self._slots.size
            self._len -= 1
        return victims

"""H2O, the heavy-hitter oracle: keep the positions with the largest cumulative attention,
plus the ``recent_window`` newest positions, which are never evicted.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023 (arXiv:2306.14048).

Per step every kept position's score gains the attention it just received, accumulated in
float64 from float32 weights (four thousand float32 additions would lose the low-order bits the
eviction comparison depends on). ``attn=None`` means "no information": scores stay as they are.
Eviction is repeated argmin over ``kept[:len - recent_window]``; equal scores evict the lower
position; victims come back in ascending position order, not in the order they were chosen.

Its fast path is declared here too (``STEPS``): the hooks with which the engine's one step loop
(``kvsim.sim.kernels``) replays every configuration at once, the same arithmetic. A score gains
``float64(float32(float64(A[t, p]) / mass))`` (nothing when the mass is 0), the newcomer starts at 0, the
victim is the first minimum over ``kept[:len - recent_window]``. Declaring them compiles nothing: the
engine specialises the loop with them on the first fast replay.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, RECENT_WINDOW, WINDOW, Display, EngineBinding, SlotPolicy, per_config
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks, _drop, _first_min, _slots
from ..policykit.tensor_hooks import TensorHooks, TensorState, param, slots

# --------------------------------------------------------------------------------------------
# the fast path: a cumulative score per slot (``state[1]``), evicting the first minimum outside the
# recent window (``state[0]``: one per configuration, ``engine_inputs``'s ``windows``)


@kernel
def _h2o_observe(state, c, p_c, n, gather, total):
    s_c = state[1][c]
    if total > 0:
        for i in range(n):
            s_c[i] += np.float64(np.float32(gather[i] / total))


@kernel
def _h2o_admit(state, c, p_c, n):
    state[1][c, n] = 0.0  # the newcomer starts with score 0


@kernel
def _h2o_score(state, c, p_c, i):
    return state[1][c, i]


@kernel
def _h2o_pick(state, c, t, p_c, n, A, a0, scored):
    windows, score = state
    return _first_min(score[c], n - windows[c])


@kernel
def _h2o_drop(state, c, best, n):
    _drop(state[1][c], best, n)


def _h2o_state(shape: Shape, windows):
    return windows, _slots(shape, 0.0, np.float64)


#: h2o's hooks of the engine's step loop, which its ``engine_binding`` names
STEPS = SlotHooks("h2o_steps", _h2o_state, observe=_h2o_observe, admit=_h2o_admit, score=_h2o_score, pick=_h2o_pick,
                  drop=_h2o_drop)


# --------------------------------------------------------------------------------------------
# the tensor step (the deployed cache's, ``kvsim.hf.tensor``): the same arithmetic on every (row, KV head) at
# once, a float64 score per column gaining the float32 row shown, the victim the first minimum outside the window


def _h2o_tensor_state(policies, batch, heads, width, device):
    return TensorState({WINDOW: param(policies, WINDOW, device)},
                       {"score": slots(batch, heads, width, device)})


def _h2o_tensor_observe(state, shown, before):
    state.slots["score"] += shown.double()  # zero off the held columns


def _h2o_tensor_admit(state, new, before):
    state.slots["score"].masked_fill_(new, 0.0)


def _h2o_tensor_rank(state, cols):
    return state.slots["score"], cols.newer >= state.params[WINDOW][..., None]


#: h2o's tensor step, which its ``tensor_step`` names
TENSOR = TensorHooks("h2o", _h2o_tensor_state, _h2o_tensor_rank, observe=_h2o_tensor_observe, admit=_h2o_tensor_admit,
                     walk=(("score", 1),))


@register
class H2O(SlotPolicy):
    name = "h2o"
    order = 30
    table_rows = ({WINDOW: 32}, {WINDOW: 64})
    summary = "keep the newest recent_window positions and, of the rest, the largest cumulative attention"
    display = Display("#1f77b4", "solid", 2, "circle")
    engine_binding = EngineBinding(STEPS)
    tensor_step = TENSOR
    reads_attention = True
    keeps_scores = True
    tunables = (RECENT_WINDOW,)
    window = RECENT_WINDOW.name
    #: adakv pools a layer's KV heads by this score (cumulative attention, comparable across heads)
    pools_heads = True

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        rng: np.random.Generator | None = None,
        recent_window: int = RECENT_WINDOW.default,
    ) -> None:
        super().__init__(budget, rng)
        self.recent_window = RECENT_WINDOW.check(recent_window, self.budget)
        self._score = np.zeros(self.budget + 1, dtype=np.float64)  # position 0 starts at 0

    @classmethod
    def engine_inputs(cls, policies, steps):
        return {"windows": per_config(p.recent_window for p in policies)}

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._score]

    @property
    def scores(self) -> np.ndarray:
        """Cumulative score of each kept position, aligned with ``kept``."""
        return self._score[: self._len].copy()

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        attn = self._step_attention(attn)
        if attn is not None:
            self._score[: self._len] += attn.astype(np.float64)
        self._score[self._admit(pos)] = 0.0

    def evict(self, budget: int) -> list[int]:
        return self._evict_lowest(budget, self._score[: max(self._len - self.recent_window, 0)])

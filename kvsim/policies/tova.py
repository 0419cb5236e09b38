"""TOVA, token omission via attention: evict the kept position with the lowest weight in the
latest attention row.

Oren et al., "Transformers are Multi-State RNNs", 2024 (arXiv:2401.06104).

No history at all: only the latest row decides, so a position that was central a step ago and
is ignored now is the next to go. The position admitted this step has no weight yet (its query
has not been attended to by anyone), so it is never the victim; without that rule a policy
that ranks by weight would evict every newcomer at once and the cache would never advance.

``attn=None`` ("no information this step"): every weight stays as it was, the weight each
position had in the latest row it was shown. Positions admitted since the latest shown row have
no weight and rank above every weighted position (no evidence against them); among themselves
the lower position goes first. Equal weights evict the lower position; victims come back in
ascending position order. Deterministic: ``rng`` is never used.

Its fast path is declared here too (``STEPS``): the hooks with which the engine's one step loop
(``kvsim.sim.kernels``) replays every configuration at once, the same arithmetic. A slot's weight is
``float64(float32(float64(A[t, p]) / mass))`` of the latest row (zeros when the mass is 0), the
newcomer's ``UNSEEN``; the victim is the first minimum over every slot but the newest.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, Display, EngineBinding, SlotPolicy
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks, _drop, _first_min, _slots
from ..policykit.tensor_hooks import TensorHooks, TensorState, slots

#: the weight of a position no row has shown yet: above any real weight (at most 1), below the
#: +inf that marks a chosen victim during eviction
UNSEEN = np.finfo(np.float64).max


# --------------------------------------------------------------------------------------------
# the fast path: each slot's weight in the latest row (``state[0]``; a newcomer's UNSEEN), never
# evicting the newest


@kernel
def _tova_observe(state, c, p_c, n, gather, total):
    w_c = state[0][c]
    for i in range(n):
        w_c[i] = np.float64(np.float32(gather[i] / total)) if total > 0 else 0.0


@kernel
def _tova_admit(state, c, p_c, n):
    state[0][c, n] = UNSEEN


@kernel
def _tova_pick(state, c, t, p_c, n, A, a0, scored):
    return _first_min(state[0][c], n - 1)  # the newest is never a candidate


@kernel
def _tova_drop(state, c, best, n):
    _drop(state[0][c], best, n)


def _tova_state(shape: Shape):
    return (_slots(shape, UNSEEN, np.float64),)  # position 0: no row has shown it yet


#: tova's hooks of the engine's step loop, which its ``engine_binding`` names
STEPS = SlotHooks("tova_steps", _tova_state, observe=_tova_observe, admit=_tova_admit, pick=_tova_pick, drop=_tova_drop)


# the tensor step (``kvsim.hf.tensor``): each column's weight in the latest row shown, UNSEEN for a newcomer,
# the newest never a candidate


def _tova_tensor_state(policies, batch, heads, width, device):
    return TensorState({}, {"weight": slots(batch, heads, width, device, UNSEEN)})


def _tova_tensor_observe(state, shown, before):
    state.slots["weight"] = shown.double().where(before, state.slots["weight"])  # float32 widened exactly


def _tova_tensor_admit(state, new, before):
    state.slots["weight"].masked_fill_(new, UNSEEN)


def _tova_tensor_rank(state, cols):
    return state.slots["weight"], cols.newer >= 1


#: tova's tensor step, which its ``tensor_step`` names
TENSOR = TensorHooks("tova", _tova_tensor_state, _tova_tensor_rank, observe=_tova_tensor_observe, admit=_tova_tensor_admit,
                     walk=(("weight", 0),))


@register
class TOVA(SlotPolicy):
    name = "tova"
    order = 50
    summary = "evict the lowest weight in the latest attention row, never the newest position"
    display = Display("#00796b", "8px,3px,8px,9px", 4, score_name="latest weight")
    engine_binding = EngineBinding(STEPS)
    tensor_step = TENSOR
    reads_attention = True

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        super().__init__(budget, rng)
        # latest weight per kept position; UNSEEN until a row has shown it (see module docstring)
        self._weight = np.full(self.budget + 1, UNSEEN, dtype=np.float64)

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._weight]

    @property
    def weights(self) -> np.ndarray:
        """Latest observed weight of each kept position, aligned with ``kept``; NaN where no row
        has shown it yet."""
        w = self._weight[: self._len].copy()
        w[w == UNSEEN] = np.nan
        return w

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        attn = self._step_attention(attn)
        if attn is not None:
            self._weight[: self._len] = attn.astype(np.float64)
        self._weight[self._admit(pos)] = UNSEEN

    def evict(self, budget: int) -> list[int]:
        # the newest position (the last in kept order) is never a candidate; unseen positions rank
        # above every weight (finite, at most 1) and, among themselves, lower position first
        return self._evict_lowest(budget, self._weight[: self._len - 1])

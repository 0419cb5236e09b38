"""H2O with observed-attention normalisation: a position's score is its cumulative attention
divided by the number of steps it has been shown to a query, so old positions do not win by age
alone. The ``recent_window`` newest positions are never evicted, as in h2o.

The normalisation serving stacks use when they rank cached tokens by the attention observed
while they were held (H2O's accumulated score, Zhang et al., NeurIPS 2023, arXiv:2306.14048,
made an average): a position admitted 3000 steps ago has had 3000 rows to collect attention, a
position admitted 40 steps ago 40; the plain sum compares their totals, this policy their rates.

The sum is accumulated in float64 from the float32 weights, like h2o's; the count is the number
of steps with attention since admission. ``attn=None`` ("no information") changes neither, so
every score stays exactly as it was. A position no row has shown yet has score 0 (it has
collected nothing; the recent window is what protects it, as in h2o). Eviction is repeated argmin
of the score over ``kept[:len - recent_window]``; equal scores evict the lower position; victims
come back in ascending position order.

Its fast path is declared here too (``STEPS``): the hooks with which the engine's one step loop
(``kvsim.sim.kernels``) replays every configuration at once, the same arithmetic. A sum gains
``float64(float32(float64(A[t, p]) / mass))`` as h2o's does (nothing when the mass is 0) and the count
gains one for every row shown (a row of zeros counts); the score is ``sum / count`` (0 while the count
is 0), the victim its first minimum over ``kept[:len - recent_window]``.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, RECENT_WINDOW, WINDOW, Display, EngineBinding, SlotPolicy, per_config
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks, _drop, _slots
from ..policykit.tensor_hooks import TensorHooks, TensorState, param, slots

# --------------------------------------------------------------------------------------------
# the fast path: h2o's sum (``state[1]``) with a count of the steps shown (``state[2]``), evicting by
# ``sum / count`` (0 while the count is 0), the reference's ``np.divide``, outside the recent window
# (``state[0]``)


@kernel
def _normalized_observe(state, c, p_c, n, gather, total):
    s_c = state[1][c]
    k_c = state[2][c]
    for i in range(n):
        if total > 0:
            s_c[i] += np.float64(np.float32(gather[i] / total))
        k_c[i] += 1


@kernel
def _normalized_admit(state, c, p_c, n):
    state[1][c, n] = 0.0
    state[2][c, n] = 0


@kernel
def _normalized_score(state, c, p_c, i):
    s = state[1][c, i]
    k = state[2][c, i]
    return s / k if k > 0 else 0.0


@kernel
def _normalized_pick(state, c, t, p_c, n, A, a0, scored):
    best = 0
    low = _normalized_score(state, c, p_c, 0)
    for i in range(1, n - state[0][c]):
        v = _normalized_score(state, c, p_c, i)
        if v < low:  # strict: the first minimum, the lower position
            low = v
            best = i
    return best


@kernel
def _normalized_drop(state, c, best, n):
    _drop(state[1][c], best, n)
    _drop(state[2][c], best, n)


def _normalized_state(shape: Shape, windows):
    return windows, _slots(shape, 0.0, np.float64), _slots(shape, 0, np.int64)


#: h2o_normalized's hooks of the engine's step loop, which its ``engine_binding`` names
STEPS = SlotHooks("h2o_normalized_steps", _normalized_state, observe=_normalized_observe, admit=_normalized_admit,
                  score=_normalized_score, pick=_normalized_pick, drop=_normalized_drop)



# the tensor step (``kvsim.hf.tensor``): a float64 sum and a count of rows shown per column, the score their
# quotient (0 while the count is 0), the victim its first minimum outside the window


def _normalized_tensor_state(policies, batch, heads, width, device):
    return TensorState({WINDOW: param(policies, WINDOW, device)},
                       {"sum": slots(batch, heads, width, device), "count": slots(batch, heads, width, device)})


def _normalized_tensor_observe(state, shown, before):
    state.slots["sum"] += shown.double()
    state.slots["count"] += before.double()


def _normalized_tensor_admit(state, new, before):
    state.slots["sum"].masked_fill_(new, 0.0)
    state.slots["count"].masked_fill_(new, 0.0)


def _normalized_tensor_rank(state, cols):
    count = state.slots["count"]
    score = (state.slots["sum"] / count.clamp(min=1.0)).where(count > 0, 0.0)
    return score, cols.newer >= state.params[WINDOW][..., None]


#: h2o_normalized's tensor step, which its ``tensor_step`` names
TENSOR = TensorHooks("h2o_normalized", _normalized_tensor_state, _normalized_tensor_rank,
                     observe=_normalized_tensor_observe, admit=_normalized_tensor_admit,
                     walk=(("sum", 1), ("count", 2)))


@register
class H2ONormalized(SlotPolicy):
    name = "h2o_normalized"
    order = 60
    table_rows = ({WINDOW: 32},)
    summary = "h2o with each cumulative score divided by the steps the position has been held, so age alone does not win"
    display = Display("#8c564b", "solid", 2, "triangle-up")
    engine_binding = EngineBinding(STEPS)
    tensor_step = TENSOR
    reads_attention = True
    keeps_scores = True
    tunables = (RECENT_WINDOW,)
    window = RECENT_WINDOW.name

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        rng: np.random.Generator | None = None,
        recent_window: int = RECENT_WINDOW.default,
    ) -> None:
        super().__init__(budget, rng)
        self.recent_window = RECENT_WINDOW.check(recent_window, self.budget)
        self._sum = np.zeros(self.budget + 1, dtype=np.float64)
        self._count = np.zeros(self.budget + 1, dtype=np.int64)  # steps shown to a query since admission

    @classmethod
    def engine_inputs(cls, policies, steps):
        return {"windows": per_config(p.recent_window for p in policies)}

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._sum, self._count]

    def _normalized(self, n: int) -> np.ndarray:
        count = self._count[:n]
        return np.divide(self._sum[:n], count, out=np.zeros(n), where=count > 0)

    @property
    def scores(self) -> np.ndarray:
        """Mean observed attention per step held, of each kept position, aligned with ``kept``."""
        return self._normalized(self._len)

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        attn = self._step_attention(attn)
        if attn is not None:
            self._sum[: self._len] += attn.astype(np.float64)
            self._count[: self._len] += 1
        i = self._admit(pos)
        self._sum[i] = 0.0
        self._count[i] = 0

    def evict(self, budget: int) -> list[int]:
        return self._evict_lowest(budget, self._normalized(max(self._len - self.recent_window, 0)))

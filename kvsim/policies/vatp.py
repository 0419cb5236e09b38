"""VATP, value-aware token pruning: h2o's accumulated attention times the L1 norm of the position's
value, ``score(p) = A(p) x |v_p|_1``; the newest ``recent_window`` positions and the first ``sinks``
positions are kept.

Guo, Kamigaito and Watanabe, "Attention Score is not All You Need for Token Importance Indicator in KV
Cache Reduction: Value Also Matters", EMNLP 2024 (arXiv:2406.12335; code github.com/guozhiyu/vatp).
Attention sinks draw much attention but carry values of small norm, so the product ranks them low; the
paper applies VATP on top of H2O (and Scissorhands) with their recent window, and keeps the sink tokens
(its code gives the first ``sink_len`` positions the largest score there is). Here:

- ``A(p)`` is h2o's cumulative observed attention, accumulated in float64 from the float32 weights the
  harness shows (``kvsim.policies.h2o``); the newcomer starts at 0;
- ``|v_p|_1`` is the float64 sum of the absolute values of the KV head's value at p, added in dimension
  order (``value_l1``), computed once when the position is handed over (``see``): a value is fixed once
  the model has written it;
- eviction is repeated argmin of ``A(p) x |v_p|_1`` over ``kept[:len - recent_window]``, equal scores
  evicting the older position; the positions below ``sinks`` are candidates only after every other
  candidate (the paper's "largest score"), the oldest first; victims come back in ascending order.

With ``sinks = 0`` and every value of the same non-zero L1 norm it is h2o exactly (the product keeps the order).
``ValueWeighted`` is the mechanism shared with ``critical`` (``kvsim.policies.critical``), which
multiplies by a different per-position norm.

Their fast path is declared here too (``STEPS``): the hooks with which the engine's one step loop
(``kvsim.sim.kernels``) replays every configuration at once, the same arithmetic. A slot's accumulated
attention gains ``float64(float32(w / mass))`` (h2o's), the newcomer's starts at 0; its score is
``accumulated x multipliers[position]``, one float64 product; the victim is the first minimum of the scores
over ``kept[:len - recent_window]`` leaving out the positions below ``sinks`` (held sinks are a prefix of kept
order, which is ascending), and, when only sinks are left to choose from, the oldest (slot 0).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, RECENT_WINDOW, WINDOW, Display, EngineBinding, Param, SlotPolicy, per_config
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks, _drop, _slots
from ..policykit.tensor_hooks import TensorHooks, TensorState, admitted, in_order, param, slots
from .streaming_llm import SINKS


def value_l1(values) -> np.ndarray:
    """``|v|_1`` of each row (last axis: the value's dimensions) as float64, added strictly in dimension
    order, so one row handed to ``see`` and the whole array handed to ``engine_inputs`` give the same bits."""
    v = np.abs(np.asarray(values, dtype=np.float64))
    if v.shape[-1] == 0:
        raise ValueError("values have no dimensions")
    return np.cumsum(v, axis=-1)[..., -1]


# --------------------------------------------------------------------------------------------
# the fast path of both value-weighted policies (vatp, critical): h2o's accumulated attention per slot
# (``state[3]``) times a fixed float64 multiplier per position (``state[2]``: ``engine_inputs``'s
# ``multipliers``, computed once for the whole trace with the very function ``see`` calls on one row, so
# the products are the reference's bit for bit); ``state[0]``, ``state[1]``: each configuration's recent
# window and sinks


@kernel
def _value_weighted_observe(state, c, p_c, n, gather, total):
    s_c = state[3][c]
    if total > 0:
        for i in range(n):
            s_c[i] += np.float64(np.float32(gather[i] / total))


@kernel
def _value_weighted_admit(state, c, p_c, n):
    state[3][c, n] = 0.0  # the newcomer starts with no attention


@kernel
def _value_weighted_score(state, c, p_c, i):
    return state[3][c, i] * state[2][p_c[i]]


@kernel
def _value_weighted_pick(state, c, t, p_c, n, A, a0, scored):
    windows, sinks, mult, acc = state
    count = n - windows[c]
    first = 0
    while first < count and p_c[first] < sinks[c]:  # the held sinks: a prefix of kept order
        first += 1
    if first == count:
        return 0  # nothing but sinks to choose from: the oldest goes
    a_c = acc[c]
    best = first
    low = a_c[first] * mult[p_c[first]]
    for i in range(first + 1, count):
        s = a_c[i] * mult[p_c[i]]
        if s < low:  # strict: the first minimum, the older position
            low = s
            best = i
    return best


@kernel
def _value_weighted_drop(state, c, best, n):
    _drop(state[3][c], best, n)


def _value_weighted_state(shape: Shape, windows, sinks, multipliers):
    if multipliers.shape != (shape.steps + 1,):
        raise ValueError(f"multipliers has shape {multipliers.shape}, expected ({shape.steps + 1},): one per position")
    return windows, sinks, multipliers, _slots(shape, 0.0, np.float64)


#: the value-weighted policies' hooks of the engine's step loop, one set for both (the multiplier is all
#: that differs), which ``ValueWeighted.engine_binding`` names
STEPS = SlotHooks("value_weighted_steps", _value_weighted_state, observe=_value_weighted_observe,
                  admit=_value_weighted_admit, score=_value_weighted_score, pick=_value_weighted_pick,
                  drop=_value_weighted_drop)


# --------------------------------------------------------------------------------------------
# the tensor step of both (the deployed cache's, ``kvsim.hf.tensor``): h2o's float64 score per column gaining the
# float32 row shown, a float64 multiplier per column set as its position is admitted (``multiplier`` of
# ``state.now``, each policy's own statement in torch, the same bits), the victim the first minimum of their
# product over the columns outside the recent window; a held sink ranks after every other candidate at the largest
# float64 (their first minimum is then the oldest sink, as the reference's ranks have it). The reference refuses a
# multiplier that overflows float64 in one line; the tensor step cannot look without reading back to the host, so
# such a value (beyond 1.8e308) would rank as its product does.


def _value_weighted_tensor_state(policies, batch, heads, width, device):
    return TensorState({WINDOW: param(policies, WINDOW, device), "sinks": param(policies, "_sinks", device)},
                       {"score": slots(batch, heads, width, device), "mult": slots(batch, heads, width, device)})


def _value_weighted_tensor_observe(state, shown, before):
    state.slots["score"] += shown.double()  # zero off the held columns


def _value_weighted_tensor_admit(state, new, before):
    state.slots["score"].masked_fill_(new, 0.0)
    state.slots["mult"] = admitted(state.slots["mult"], new, state.host["multiplier"](state.now))


def _value_weighted_tensor_rank(state, cols):
    import torch

    product = state.slots["score"] * state.slots["mult"]
    pinned = cols.pos < state.params["sinks"][..., None]
    return (torch.where(pinned, torch.finfo(torch.float64).max, product),
            cols.newer >= state.params[WINDOW][..., None])


def value_weighted_tensor_step(name: str, multiplier) -> TensorHooks:
    """The tensor step of a value-weighted policy whose multiplier, from position t's ``state.now``, is
    ``multiplier`` (``(batch, heads)`` float64)."""

    def state(policies, batch, heads, width, device):
        out = _value_weighted_tensor_state(policies, batch, heads, width, device)
        out.host["multiplier"] = multiplier
        return out

    return TensorHooks(name, state, _value_weighted_tensor_rank, observe=_value_weighted_tensor_observe,
                       admit=_value_weighted_tensor_admit, walk=(("score", 3), ("mult", 2, "position")),
                       walk_rows=_value_weighted_walk_rows)


def _value_weighted_walk_rows(policy, engine, t0, rows):
    """A call's multipliers (the class's own statement, ``multipliers``) at their positions of one configuration's
    engine state (the compiled walk, ``kvsim.hf.walk``); one that overflows ranks as its product does, as on the
    tensor path, which cannot look without reading back."""
    with np.errstate(over="ignore"):
        m = type(policy).multipliers(rows)
    engine[2][t0 : t0 + len(m)] = m


def _value_l1_tensor(now):
    """``value_l1`` of t's value in torch: float64, added in dimension order."""
    return in_order(now["values"].double().abs())


class ValueWeighted(SlotPolicy):
    """Accumulated attention (h2o's) times a fixed per-position multiplier that ``multipliers`` computes
    from the members the policy ``reads``; the newest ``recent_window`` positions are never evicted and
    the first ``sinks`` positions go only when nothing else can."""

    reads_attention = True
    keeps_scores = True
    engine_binding = EngineBinding(STEPS)
    #: the class's own: sinks is VATP's alone (CriticalKV pins none)
    tunables: tuple[Param, ...] = (RECENT_WINDOW,)
    window = RECENT_WINDOW.name

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None,
                 recent_window: int = RECENT_WINDOW.default, sinks: int = 0) -> None:
        super().__init__(budget, rng)
        self.recent_window = RECENT_WINDOW.check(recent_window, self.budget)
        self._sinks = SINKS.check(sinks, self.budget)
        self._score = np.zeros(self.budget + 1, dtype=np.float64)  # accumulated attention, position 0 at 0
        self._mult = np.full(self.budget + 1, np.nan)  # the multiplier of each slot; NaN: not handed over yet
        self._pending: tuple[int, float] | None = None  # (position, multiplier) handed over, not yet admitted

    @classmethod
    def multipliers(cls, members: Mapping[str, np.ndarray]) -> np.ndarray:  # pragma: no cover - abstract
        """The float64 multiplier of each row of ``members`` (position-major; one row or all of them)."""
        raise NotImplementedError

    @classmethod
    def checked_multipliers(cls, members: Mapping[str, np.ndarray]) -> np.ndarray:
        with np.errstate(over="ignore"):  # an overflow is refused just below, in the policy's words
            m = cls.multipliers(members)
        if not np.isfinite(m).all():
            raise ValueError(f"{cls.name}: the {' x '.join(cls.reads)} norm overflows float64 (a value too large)")
        return m

    @classmethod
    def engine_inputs(cls, policies, steps, vectors=None):
        if vectors is None:
            raise ValueError(f"{cls.name} reads {', '.join(cls.reads)}; the engine was not handed them")
        return {"windows": per_config(p.recent_window for p in policies),
                "sinks": per_config(p._sinks for p in policies),
                "multipliers": np.ascontiguousarray(cls.checked_multipliers(vectors), dtype=np.float64)}

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._score, self._mult]

    def see(self, pos: int, vectors: Mapping[str, np.ndarray]) -> None:
        m = float(self.checked_multipliers(vectors))
        if pos == 0 and self._len == 1 and self._pos[0] == 0:
            self._mult[0] = m  # held from the start, never admitted
        else:
            self._pending = (pos, m)

    @property
    def scores(self) -> np.ndarray:
        """``A(p) x multiplier(p)`` of each kept position, aligned with ``kept``."""
        return self._score[: self._len] * self._mult[: self._len]

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        if np.isnan(self._mult[0]) and self._pos[0] == 0:
            raise ValueError(f"{self.name}: position 0's {', '.join(self.reads)} were never handed over (see(0, ...))")
        if self._pending is None or self._pending[0] != pos:
            raise ValueError(f"{self.name}: position {pos}'s {', '.join(self.reads)} were not handed over (see) before "
                             "it was admitted")
        attn = self._step_attention(attn)
        if attn is not None:
            self._score[: self._len] += attn.astype(np.float64)
        i = self._admit(pos)
        self._score[i] = 0.0
        self._mult[i] = self._pending[1]
        self._pending = None

    def evict(self, budget: int) -> list[int]:
        candidates = max(self._len - self.recent_window, 0)
        product = self._score[:candidates] * self._mult[:candidates]
        pinned = self._pos[:candidates] < self._sinks  # a prefix: kept is ascending
        # the order repeated first-minimum takes: the others by score (stable: the older first on ties),
        # then the sinks, oldest first; handed to the argmin as ranks
        order = np.concatenate([np.flatnonzero(~pinned)[np.argsort(product[~pinned], kind="stable")],
                                np.flatnonzero(pinned)])
        ranks = np.empty(candidates, dtype=np.float64)
        ranks[order] = np.arange(candidates)
        return self._evict_lowest(budget, ranks)


@register
class VATP(ValueWeighted):
    name = "vatp"
    order = 80
    table_rows = ({WINDOW: 32},)
    summary = ("keep the newest recent_window and the first sinks positions and, of the rest, the largest "
               "cumulative attention x |value|_1")
    display = Display("#556b2f", "9px,3px,2px,3px", 2.5, "square", score_name="cumulative attention x |v|_1")
    reads = ("values",)
    tunables = (RECENT_WINDOW, SINKS)
    tensor_step = value_weighted_tensor_step("vatp", _value_l1_tensor)

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None,
                 recent_window: int = RECENT_WINDOW.default, sinks: int = SINKS.default) -> None:
        super().__init__(budget, rng, recent_window, sinks)
        self.sinks = self._sinks

    @classmethod
    def multipliers(cls, members):
        return value_l1(members["values"])

    def layout_priorities(self) -> np.ndarray:
        """A serving layout's per-position score (kvsim.policykit.layouts): vatp ranks its pinned sinks after
        every other position rather than scoring them, so its score here is its own product, cumulative
        attention x |v|_1, with the sinks and the recent window never going (``inf``)."""
        out = np.full(self.kept.size, np.inf)
        n = max(self._len - self.recent_window, 0)
        product = self._score[:n] * self._mult[:n]
        out[:n] = np.where(self._pos[:n] < self._sinks, np.inf, product)
        return out

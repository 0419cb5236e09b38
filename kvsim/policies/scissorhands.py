"""Scissorhands: keep the positions that most often beat their fair share of attention, plus the
``recent_window`` newest positions, which are never evicted.

Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
Compression at Test Time", NeurIPS 2023 (arXiv:2305.17118).

H2O's nearest neighbour. Where H2O sums attention, this policy counts votes: at each step every
kept position whose observed weight is strictly greater than ``1 / n`` (``n`` = the number of
positions the query attended over that step) gains one vote. A position that once took nearly all
of a row has the highest H2O score for the rest of the run but a single vote here: a stale early
spike earns one vote, not a lead that a cumulative sum defends forever.

The fair share is compared in float32, the precision the weights arrive in: a uniform row,
renormalised to float32, then gives nobody a vote (in float64, float32(1/3) > 1/3 would give
everybody one).

``history_window``: the paper scores over a finite history window (the attention of the last
``w`` steps, counting how often each token falls below the 1/n threshold). The default here, 0,
counts the whole run, as the H2O card's comparison and the project's issue specify; a positive
``history_window = N`` counts only the votes of the last N *observed* steps, closer to the
paper. Steps with ``attn=None`` carry no information: they add no votes and do not advance the
window either, so every count stays exactly as it was (docs/domain.md). The paper counts the
times a token falls *below* 1/n and drops the largest count; we count votes *for* it, as the H2O
card describes. The two differ for positions held for different lengths of time: a count against
favours newcomers, a count for favours positions that have been held long.

Eviction is repeated argmin of the count over ``kept[:len - recent_window]``; equal counts evict
the lower position (counts tie often, so this rule matters here more than for H2O); victims come
back in ascending position order.

Its fast path is declared here too (``STEPS``): the hooks with which the engine's one step loop
(``kvsim.sim.kernels``) replays every configuration at once, the same arithmetic. A vote is
``float32(observed) > float32(1 / n)`` (``observed = float32(float64(A[t, p]) / mass)``, n = the positions
held before the step); a row of zeros gives no vote but still advances the history window; the victim is the
first minimum of the counts over ``kept[:len - recent_window]``.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, RECENT_WINDOW, WINDOW, Display, EngineBinding, Param, SlotPolicy, per_config
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks
from ..policykit.tensor_hooks import TensorHooks, TensorState, param, slots

HISTORY_WINDOW = Param("history_window", 0, "votes of the last history_window observed steps count (0: the whole run)")


# --------------------------------------------------------------------------------------------
# the fast path: votes by position (eviction moves positions only); with a history window,
# ``ring[c, j]`` lists the voters of the j-th observed step (mod the window), so the vote that leaves
# the window is taken back in O(voters)


@kernel
def _scissorhands_observe(state, c, p_c, n, gather, total):
    windows, histories, votes, observed, ring, ring_len = state
    v_c = votes[c]
    h = histories[c]
    col = 0
    if h > 0:  # the oldest observed step in the window takes its votes back
        col = observed[c] % h
        for j in range(ring_len[c, col]):
            v_c[ring[c, col, j]] -= 1
        ring_len[c, col] = 0
    if total > 0:  # a row of zeros is shown as zeros: nobody beats the fair share
        share = np.float32(1.0 / n)
        for i in range(n):
            if np.float32(gather[i] / total) > share:
                p = p_c[i]
                v_c[p] += 1
                if h > 0:
                    ring[c, col, ring_len[c, col]] = p
                    ring_len[c, col] += 1
    observed[c] += 1


@kernel
def _scissorhands_admit(state, c, p_c, n):
    state[2][c, p_c[n]] = 0


@kernel
def _scissorhands_score(state, c, p_c, i):
    return state[2][c, p_c[i]]


@kernel
def _scissorhands_pick(state, c, t, p_c, n, A, a0, scored):
    windows, histories, votes, observed, ring, ring_len = state
    v_c = votes[c]
    best = 0
    low = v_c[p_c[0]]
    for i in range(1, n - windows[c]):
        if v_c[p_c[i]] < low:  # strict: the first minimum, the lower position
            low = v_c[p_c[i]]
            best = i
    return best


def _scissorhands_state(shape: Shape, windows, histories):
    # voters of each observed step in the window, O(configs x history_window x budget) int32; a step's
    # voters are among the n <= budget positions held, so `width` entries suffice
    h = int(histories.max())
    ring = np.zeros((shape.configs, max(1, h), shape.width if h else 1), dtype=np.int32)
    return (windows, histories, np.zeros((shape.configs, shape.steps + 1), dtype=np.int64),
            np.zeros(shape.configs, dtype=np.int64), ring, np.zeros(ring.shape[:2], dtype=np.int64))


#: scissorhands' hooks of the engine's step loop, which its ``engine_binding`` names
STEPS = SlotHooks("scissorhands_steps", _scissorhands_state, observe=_scissorhands_observe, admit=_scissorhands_admit,
                  score=_scissorhands_score, pick=_scissorhands_pick)


# the tensor step (``kvsim.hf.tensor``) of the whole-run count (``history_window`` 0, the default): a vote per
# column whose float32 weight beats float32(1 / n), n the positions the query attended over


def _scissorhands_tensor_state(policies, batch, heads, width, device):
    return TensorState({WINDOW: param(policies, WINDOW, device)},
                       {"votes": slots(batch, heads, width, device)})


def _scissorhands_tensor_observe(state, shown, before):
    fair = (1.0 / before.sum(-1, keepdim=True).double()).float()
    state.slots["votes"] += (before & (shown > fair)).double()


def _scissorhands_tensor_admit(state, new, before):
    state.slots["votes"].masked_fill_(new, 0.0)


def _scissorhands_tensor_rank(state, cols):
    return state.slots["votes"], cols.newer >= state.params[WINDOW][..., None]


#: scissorhands' tensor step, which its ``tensor_step`` names (a finite history window steps on the reference path)
TENSOR = TensorHooks("scissorhands", _scissorhands_tensor_state, _scissorhands_tensor_rank,
                     observe=_scissorhands_tensor_observe, admit=_scissorhands_tensor_admit,
                     takes=lambda spec: spec.params.history_window == 0, walk=(("votes", 2, "position"),))


@register
class Scissorhands(SlotPolicy):
    name = "scissorhands"
    order = 40
    table_rows = ({WINDOW: 32}, {WINDOW: 64})
    summary = "keep the newest recent_window positions and, of the rest, the ones that most often drew more than a fair share"
    display = Display("#9467bd", "solid", 2, "diamond", score_name="votes (steps above a fair share)")
    engine_binding = EngineBinding(STEPS)
    tensor_step = TENSOR
    reads_attention = True
    keeps_scores = True
    tunables = (RECENT_WINDOW, HISTORY_WINDOW)
    window = RECENT_WINDOW.name

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        rng: np.random.Generator | None = None,
        recent_window: int = RECENT_WINDOW.default,
        history_window: int = HISTORY_WINDOW.default,
    ) -> None:
        super().__init__(budget, rng)
        self.recent_window = RECENT_WINDOW.check(recent_window, self.budget)
        self.history_window = HISTORY_WINDOW.check(history_window, self.budget)
        self._count = np.zeros(self.budget + 1, dtype=np.int64)  # position 0 starts with no votes
        # with a finite window, each slot remembers its votes of the last N observed steps (a ring
        # indexed by observed step), so the vote that leaves the window can be taken back
        self._ring = np.zeros((self.budget + 1, self.history_window), dtype=bool) if self.history_window else None
        self._observed = 0  # steps with attention so far: the ring's clock

    @classmethod
    def engine_inputs(cls, policies, steps):
        return {"windows": per_config(p.recent_window for p in policies),
                "histories": per_config(p.history_window for p in policies)}

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._count] if self._ring is None else [self._count, self._ring]

    @property
    def scores(self) -> np.ndarray:
        """Vote count of each kept position (float64, like every policy's scores), aligned with
        ``kept``."""
        return self._count[: self._len].astype(np.float64)

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        attn = self._step_attention(attn)
        n = self._len
        if attn is not None:
            votes = attn.astype(np.float32) > np.float32(1.0 / n)
            if self._ring is None:
                self._count[:n] += votes
            else:
                col = self._observed % self.history_window
                self._count[:n] -= self._ring[:n, col]  # the vote leaving the window
                self._ring[:n, col] = votes
                self._count[:n] += votes
            self._observed += 1
        i = self._admit(pos)
        self._count[i] = 0
        if self._ring is not None:
            self._ring[i] = False

    def evict(self, budget: int) -> list[int]:
        return self._evict_lowest(budget, self._count[: max(self._len - self.recent_window, 0)])

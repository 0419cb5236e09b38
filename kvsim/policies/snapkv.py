"""SnapKV-style eviction: a position's score is the attention it received from the last
``observation_window`` queries only, and the lowest score outside the ``recent_window`` newest
positions is evicted.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024
(arXiv:2404.14469). The paper scores the prompt's positions by the attention of an observation
window of the last prompt queries and keeps the top ones, once, at prefill; here the same score
is applied at every decode step over a sliding window of rows, the way decode-time variants
use it. The paper's 1-D pooling of the scores (clustering neighbours) is left out: this is the
windowed-score idea alone, so the difference from h2o (a sum over *every* row) is exactly the
window.

Scores: each slot remembers its observed weights (float64 of the float32 ``attn``) of the last
``observation_window`` steps with attention, in a ring; the score is their sum, added oldest to
newest, so equal windows give equal scores bit for bit (no running-sum drift). A position held
for fewer steps has zeros for the steps before it existed. ``attn=None`` adds nothing and does
not advance the window: scores stay exactly as they were. ``observation_window = 0`` scores over
every observed row, which is h2o (the same convention as scissorhands' ``history_window``).

Eviction is repeated argmin over ``kept[:len - recent_window]``; equal scores evict the lower
position; victims come back in ascending position order. Deterministic: ``rng`` is never used.

Its fast path is declared here too (``STEPS``): the hooks with which the engine's one step loop
(``kvsim.sim.kernels``) replays every configuration at once, the same arithmetic: each observed weight
``float32(float64(A[t, p]) / mass)`` widened to float64, a window's sum added oldest to newest, the victim
the first minimum over ``kept[:len - recent_window]``.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, RECENT_WINDOW, WINDOW, Display, EngineBinding, Param, SlotPolicy, per_config
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks, _drop, _first_min, _slots
from ..policykit.tensor_hooks import TensorHooks, TensorState, WalkMap, param, slots

OBSERVATION_WINDOW = Param("observation_window", 32, "the score is the attention of the last observation_window queries")


# --------------------------------------------------------------------------------------------
# the fast path: with ``obs_windows[c] == w > 0`` each slot keeps its last w observed weights in ring row
# ``row_of[c, slot]`` (``ring[c, row, :w]``; a row of zeros is written too: it was shown) and the score
# is their chronological sum; with w == 0, a running sum as h2o keeps it. An eviction closes the gap
# in ``row_of`` and hands the freed row to the next newcomer: ring rows never move. Summing every
# window is budget x w work a step, so the victim is found through ``approx``, a running sum of each
# ring row (off the exact sum by at most ``tols[c]``): only the slots it cannot rule out are summed
# exactly (``_window_first_min``).


@kernel
def _window_sum(ring_c, r, w, start):
    """Ring row r's weights over the last w observed rows, added oldest to newest (the reference's
    cumsum over the ring in chronological order): columns start .. w-1, then 0 .. start-1."""
    acc = 0.0
    for j in range(start, w):
        acc += ring_c[r, j]
    for j in range(start):
        acc += ring_c[r, j]
    return acc


@kernel
def _window_first_min(ring_c, row_c, approx_c, count, w, start, tol):
    """``_first_min`` over the exact window sums of slots ``0 .. count-1``, computing an exact sum
    only for a slot whose running sum (``approx_c``, within ``tol`` of the exact sum) says it could
    be the smallest: the same slot as summing every window, at a fraction of the cost."""
    reach = approx_c[0]
    for i in range(1, count):
        reach = min(reach, approx_c[i])
    reach += 2.0 * tol
    best = 0
    low = np.inf
    for i in range(count):
        a = approx_c[i]
        if a <= reach and a <= low + tol:
            exact = _window_sum(ring_c, row_c[i], w, start)
            if exact < low:  # strict: the first minimum, the lower position
                low = exact
                best = i
                if low == 0.0:  # weights are non-negative: no later sum is smaller
                    break
    return best


@kernel
def _snapkv_observe(state, c, p_c, n, gather, total):
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = state
    w = obs_windows[c]
    if w > 0:
        r_c = ring[c]
        o_c = row_of[c]
        a_c = approx[c]
        col = observed[c] % w
        for i in range(n):
            v = np.float64(np.float32(gather[i] / total)) if total > 0 else 0.0
            a_c[i] = (a_c[i] - r_c[o_c[i], col]) + v
            r_c[o_c[i], col] = v
    elif total > 0:
        run_c = running[c]
        for i in range(n):
            run_c[i] += np.float64(np.float32(gather[i] / total))
    observed[c] += 1


@kernel
def _snapkv_admit(state, c, p_c, n):
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = state
    w = obs_windows[c]
    if w > 0:
        r = row_of[c, n]
        for j in range(w):
            ring[c, r, j] = 0.0
        approx[c, n] = 0.0
    else:
        running[c, n] = 0.0


@kernel
def _snapkv_score(state, c, p_c, i):
    """Slot i's exact score, kept in ``scores`` too: ``pick`` reads it back on a recorded step."""
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = state
    w = obs_windows[c]
    scores[i] = _window_sum(ring[c], row_of[c, i], w, observed[c] % w) if w > 0 else running[c, i]
    return scores[i]


@kernel
def _snapkv_pick(state, c, t, p_c, n, A, a0, scored):
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = state
    w = obs_windows[c]
    if scored:
        return _first_min(scores, n - windows[c])
    if w > 0:
        return _window_first_min(ring[c], row_of[c], approx[c], n - windows[c], w, observed[c] % w, tols[c])
    return _first_min(running[c], n - windows[c])


@kernel
def _snapkv_drop(state, c, best, n):
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = state
    if obs_windows[c] > 0:
        o_c = row_of[c]
        freed = o_c[best]
        _drop(o_c, best, n)
        o_c[n - 1] = freed  # the next newcomer's ring row
        _drop(approx[c], best, n)
    else:
        _drop(running[c], best, n)


def _snapkv_state(shape: Shape, windows, obs_windows):
    n_cfg, width = shape.configs, shape.width
    # O(configs x budget x observation_window) float64: the weights each slot still counts
    ring = np.zeros((n_cfg, width, max(1, int(obs_windows.max()))), dtype=np.float64)
    row_of = np.tile(np.arange(width, dtype=np.int64), (n_cfg, 1))  # slot -> its ring row
    # |approx - the exact window sum| <= u (w + 1) (2T + w) (u = 2^-53: at most 2T updates of a sum
    # of at most w + 1 weights in [0, 1], against a w-term sequential sum); twice that, for margin
    tols = 2.3e-16 * (obs_windows + 1) * (2 * shape.steps + obs_windows + 2)
    return (windows, obs_windows, tols, ring, row_of, _slots(shape, 0.0, np.float64),
            _slots(shape, 0.0, np.float64),  # observation_window 0: the whole run
            np.zeros(n_cfg, dtype=np.int64), np.empty(width, dtype=np.float64))


#: snapkv's hooks of the engine's step loop, which its ``engine_binding`` names
STEPS = SlotHooks("snapkv_steps", _snapkv_state, observe=_snapkv_observe, admit=_snapkv_admit, score=_snapkv_score,
                  pick=_snapkv_pick, drop=_snapkv_drop)


# --------------------------------------------------------------------------------------------
# the tensor step (the deployed cache's, ``kvsim.hf.tensor``): each column's ring of its last observed weights
# (``(batch, heads, width, w + 1)`` float64, w the largest observation window of the layer's rows; a row at a
# smaller window uses its first columns, the last column stays zero) written at the row's clock (the steps it was
# shown a row, counted per (row, KV head)), beside h2o's running sum for a window of 0; the score the ring's
# window gathered oldest to newest and added in that order (the zeros of the columns a smaller window leaves out
# added after, exactly), the victim the first minimum outside the recent window


def _snapkv_tensor_state(policies, batch, heads, width, device):
    import torch

    windows = param(policies, "observation_window", device)
    wide = max(p.observation_window for row in policies for p in row) + 1
    return TensorState({WINDOW: param(policies, WINDOW, device), "window": windows,
                        "clock": torch.zeros(batch, heads, dtype=torch.int64, device=device)},
                       {"sum": slots(batch, heads, width, device),
                        "ring": torch.zeros(batch, heads, width, wide, dtype=torch.float64, device=device)})


def _snapkv_tensor_observe(state, shown, before):
    import torch

    seen = before.any(-1)  # a padded position is shown nothing and does not advance the clock
    w, clock, ring = state.params["window"], state.params["clock"], state.slots["ring"]
    row = shown.double()
    state.slots["sum"] += torch.where((w == 0)[..., None], row, 0.0)  # the running sum of a window of 0 alone
    at = (clock % w.clamp(min=1))[..., None, None].expand(*ring.shape[:3], 1)
    written = ring.scatter(-1, at, row[..., None])
    state.slots["ring"] = torch.where((seen & (w > 0))[..., None, None], written, ring)
    state.params["clock"] = clock + seen


def _snapkv_tensor_admit(state, new, before):
    state.slots["sum"].masked_fill_(new, 0.0)
    state.slots["ring"].masked_fill_(new[..., None], 0.0)


def _snapkv_tensor_rank(state, cols):
    import torch

    w, clock, ring = state.params["window"], state.params["clock"], state.slots["ring"]
    j = torch.arange(ring.shape[-1], device=ring.device)
    at = torch.where(j < w[..., None], (clock[..., None] + j) % w[..., None].clamp(min=1), ring.shape[-1] - 1)
    window = ring.gather(-1, at[:, :, None, :].expand_as(ring)).cumsum(-1)[..., -1]  # oldest to newest
    return (torch.where(w[..., None] > 0, window, state.slots["sum"]),
            cols.newer >= state.params[WINDOW][..., None])


def _snapkv_walk_read(engine, c, held, slots, params):
    """Configuration c's tensor state into the engine's (the compiled walk, ``kvsim.hf.walk``): the held columns' rings
    as ring rows 0 .. n-1 in position order (the row map the identity), each row's running sum started at its window's
    sum, the running sums of a window of 0, and the clock as the count of observed steps."""
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = engine
    n, w, wide = len(held), obs_windows[c], ring.shape[2]
    row_of[c] = np.arange(row_of.shape[1])
    ring[c, :n] = slots["ring"][c, held, :wide]
    running[c, :n] = slots["sum"][c, held]
    observed[c] = params["clock"][c]
    if w > 0:  # within the pick's tolerance of the exact window sums (it sums the candidates exactly)
        approx[c, :n] = ring[c, :n, :w].sum(axis=1)


def _snapkv_walk_write(engine, p, col, length, slots, params):
    """Every configuration's held rings, running sums and clock from the engine's state into the tensor state."""
    windows, obs_windows, tols, ring, row_of, approx, running, observed, scores = engine
    held = np.arange(p.shape[1])[None, :] < length[:, None]
    c, i = np.nonzero(held)
    cols = col[held]
    slots["ring"][c, cols, : ring.shape[2]] = ring[c, row_of[c, i]]
    slots["sum"][c, cols] = running[c, i]
    params["clock"][:] = observed


#: snapkv's tensor step, which its ``tensor_step`` names
TENSOR = TensorHooks("snapkv", _snapkv_tensor_state, _snapkv_tensor_rank, observe=_snapkv_tensor_observe,
                     admit=_snapkv_tensor_admit, walk=WalkMap(_snapkv_walk_read, _snapkv_walk_write))


@register
class SnapKV(SlotPolicy):
    name = "snapkv"
    order = 70
    table_rows = ({WINDOW: 32, "observation_window": 32},)
    summary = "keep the newest recent_window positions and, of the rest, the most attended by the last observation_window queries"
    display = Display("#e377c2", "solid", 2, "x")
    engine_binding = EngineBinding(STEPS)
    tensor_step = TENSOR
    reads_attention = True
    keeps_scores = True
    tunables = (RECENT_WINDOW, OBSERVATION_WINDOW)
    window = RECENT_WINDOW.name

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        rng: np.random.Generator | None = None,
        recent_window: int = RECENT_WINDOW.default,
        observation_window: int = OBSERVATION_WINDOW.default,
    ) -> None:
        super().__init__(budget, rng)
        self.recent_window = RECENT_WINDOW.check(recent_window, self.budget)
        self.observation_window = OBSERVATION_WINDOW.check(observation_window, self.budget)
        w = self.observation_window
        # with a window: the last w observed weights per slot (ring indexed by observed step);
        # without (0): a running float64 sum over every row, as h2o keeps it
        self._ring = np.zeros((self.budget + 1, w), dtype=np.float64) if w else None
        self._sum = np.zeros(self.budget + 1, dtype=np.float64) if not w else None
        self._observed = 0  # steps with attention so far: the ring's clock

    @classmethod
    def engine_inputs(cls, policies, steps):
        return {"windows": per_config(p.recent_window for p in policies),
                "obs_windows": per_config(p.observation_window for p in policies)}

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._ring] if self._ring is not None else [self._sum]

    def _window_scores(self, n: int) -> np.ndarray:
        if self._ring is None:
            return self._sum[:n].copy()
        w = self.observation_window
        order = (self._observed + np.arange(w)) % w  # oldest column first
        window = self._ring[:n][:, order]
        return np.cumsum(window, axis=1)[:, -1] if n else np.zeros(0)  # sequential, oldest to newest

    @property
    def scores(self) -> np.ndarray:
        """Attention of the last ``observation_window`` observed rows on each kept position."""
        return self._window_scores(self._len)

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        attn = self._step_attention(attn)
        n = self._len
        if attn is not None:
            if self._ring is None:
                self._sum[:n] += attn.astype(np.float64)
            else:
                self._ring[:n, self._observed % self.observation_window] = attn.astype(np.float64)
            self._observed += 1
        i = self._admit(pos)
        if self._ring is None:
            self._sum[i] = 0.0
        else:
            self._ring[i] = 0.0

    def evict(self, budget: int) -> list[int]:
        return self._evict_lowest(budget, self._window_scores(max(self._len - self.recent_window, 0)))

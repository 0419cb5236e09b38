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
"""

from __future__ import annotations

import numpy as np

from .base import DEFAULT_BUDGET, Display, EngineBinding, Param, SlotPolicy, per_config
from .h2o import RECENT_WINDOW
from .registry import register

OBSERVATION_WINDOW = Param("observation_window", 32, "the score is the attention of the last observation_window queries")


@register
class SnapKV(SlotPolicy):
    name = "snapkv"
    order = 70
    table_rows = ({"recent_window": 32, "observation_window": 32},)
    summary = "keep the newest recent_window positions and, of the rest, the most attended by the last observation_window queries"
    display = Display("#e377c2", "solid", 2, "x")
    engine_binding = EngineBinding("kvsim.sim.kernels_snapkv:SNAPKV")
    reads_attention = True
    keeps_scores = True
    tunables = (RECENT_WINDOW, OBSERVATION_WINDOW)

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

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
"""

from __future__ import annotations

import numpy as np

from .base import DEFAULT_BUDGET, Policy


class TOVA(Policy):
    name = "tova"
    reads_attention = True

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        super().__init__(budget, rng)
        # parallel arrays in kept order (ascending position), budget + 1 slots
        self._pos = np.zeros(self.budget + 1, dtype=np.int64)
        # latest weight per kept position; +inf until a row has shown it (see module docstring)
        self._weight = np.full(self.budget + 1, np.inf, dtype=np.float64)
        self._len = 1  # position 0, no weight yet

    @property
    def kept(self) -> np.ndarray:
        return self._pos[: self._len].copy()

    @property
    def weights(self) -> np.ndarray:
        """Latest observed weight of each kept position, aligned with ``kept``; NaN where no row
        has shown it yet."""
        w = self._weight[: self._len].copy()
        w[np.isinf(w)] = np.nan
        return w

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        n = self._len
        if n == self._pos.size:
            raise RuntimeError(f"{self.name}: cache full ({n}); evict before the next step")
        if attn is not None:
            attn = np.asarray(attn)
            if attn.shape != (n,):
                raise ValueError(f"{self.name}: attn has shape {attn.shape}, expected ({n},)")
            self._weight[:n] = attn.astype(np.float64)
        self._pos[n] = pos
        self._weight[n] = np.inf
        self._len = n + 1

    def evict(self, budget: int) -> list[int]:
        n_evict = self._len - budget
        if n_evict <= 0:
            return []
        # the newest position (the last in kept order) is never a candidate
        candidates = self._len - 1
        if candidates < n_evict:
            raise ValueError(f"{self.name}: cannot evict to budget {budget}: the newest position is never evicted")
        weights = self._weight[:candidates].copy()
        chosen = np.zeros(candidates, dtype=bool)
        for _ in range(n_evict):
            # argmin of weights, lower position on ties; unweighted (+inf) positions only when
            # nothing weighted is left, again lower position first
            finite = np.flatnonzero(~chosen & np.isfinite(weights))
            if finite.size:
                i = int(finite[np.argmin(weights[finite])])
            else:
                i = int(np.flatnonzero(~chosen)[0])
            chosen[i] = True
        victims = self._pos[:candidates][chosen].tolist()
        keep = np.concatenate([~chosen, [True]])
        m = self._len - n_evict
        self._pos[:m] = self._pos[: self._len][keep]
        self._weight[:m] = self._weight[: self._len][keep]
        self._len = m
        return victims

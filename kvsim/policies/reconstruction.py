"""Reconstruction: keep the prompt positions the model needs to repeat the prompt (KVzip's score).

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", 2025
(arXiv:2505.23416; the authors' code, github.com/snu-mllab/KVzip). After the context, the model is
teacher-forced to repeat it ("Repeat the previous context exactly." then the context again); a context
position's score, per (layer, KV head), is the largest attention weight it draws from any query of that
repeat (the instruction's tokens included) in any query head of the KV head's group. A position the model
needs to rebuild the context scores high whatever question comes later: the score is query-agnostic by
construction, the question is never in its view.

The scores come from a pass of the model (``kvsim.hf.reconstruction``), not from a trace's rows, so the
class declares ``needs_model`` and is registered with ``register_scorer``: it is the ``prefill_policy`` of a
compressed prompt on a model (``kvsim.hf.cache(..., prefill="compress", prefill_policy="reconstruction")``,
``kvsim needle --prefill-policy reconstruction``), refused on a trace and as a decode-time policy.

What it reads: each position's score, handed over by ``see`` as the member ``reconstruction`` (one float)
right before the position is admitted, as a key is to knorm. It reads no attention. The one-time choice is
``kvsim.sim.prefill.choose``'s, as for every scorer: stepped through the prompt at budget P, then
``evict(keep)``: repeated argmin over every held position (no window kept: KVzip keeps none inside the
context), equal scores evicting the older, lower position (``SlotPolicy._evict_lowest``, the rule every
slot policy ranks by). The score kept for the view is the reconstruction score itself (the lowest goes).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..policykit.base import DEFAULT_BUDGET, SlotPolicy
from ..policykit.registry import register_scorer

#: the member ``see`` hands over: the position's reconstruction score
MEMBER = "reconstruction"


@register_scorer
class Reconstruction(SlotPolicy):
    name = "reconstruction"
    summary = "keep the prompt positions the model attends to most while it repeats the prompt (KVzip)"
    reads = (MEMBER,)
    keeps_scores = True
    needs_model = True
    layout_score = False  # a prompt scorer: no serving layout ranks by it while decoding

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        super().__init__(budget, rng)
        self._score = np.zeros(self.budget + 1, dtype=np.float64)
        self._pending: tuple[int, float] | None = None
        self._first_seen = False

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._score]

    def see(self, pos: int, vectors: Mapping[str, np.ndarray]) -> None:
        if MEMBER not in vectors:
            raise ValueError(f"{self.name}: position {pos} was shown no {MEMBER} score (it reads {MEMBER})")
        value = np.asarray(vectors[MEMBER], dtype=np.float64)
        if value.size != 1 or not np.isfinite(value).all():
            raise ValueError(f"{self.name}: the score of position {pos} must be one finite number, got {value!r}")
        score = float(value.reshape(()))
        if pos == 0 and self._len == 1 and self._pos[0] == 0 and not self._first_seen:
            self._score[0] = score
            self._first_seen = True
        else:
            self._pending = (pos, score)

    @property
    def scores(self) -> np.ndarray:
        """The reconstruction score of each held position, aligned with ``kept``: the lowest goes."""
        return self._score[: self._len].copy()

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        self._step_attention(None)  # the free-slot check only: attention is never read
        if not self._first_seen:
            raise ValueError(f"{self.name}: position 0's score was never seen (Policy.see before the first step)")
        if self._pending is None or self._pending[0] != pos:
            raise ValueError(f"{self.name}: position {pos} admitted before its score was seen (Policy.see)")
        self._score[self._admit(pos)] = self._pending[1]
        self._pending = None

    def evict(self, budget: int) -> list[int]:
        return self._evict_lowest(budget, self._score[: self._len])

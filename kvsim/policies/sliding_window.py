"""Sliding window: keep the most recent ``budget`` positions (folklore; the recency baseline).

StreamingLLM with no sinks: a ring buffer of exactly ``budget + 1`` slots, the most the cache ever
holds (right after the new position is admitted). Victims come back oldest first; positions only
increase, so that is also ascending position order and the domain's "lower position first" tie
rule holds trivially. Attention is never read. Position 0 is the oldest thing held, so it is the
first thing evicted: the attention sink goes as soon as the cache fills.

The engine replays it with streaming_llm's hooks (``kvsim.policies.streaming_llm.STEPS``), its sinks 0.
"""

from __future__ import annotations

import numpy as np

from ..policykit.base import DEFAULT_BUDGET, Display, EngineBinding, Policy
from ..policykit.registry import register
from .streaming_llm import STEPS, TENSOR, StreamingLLM


@register
class SlidingWindow(StreamingLLM):
    name = "sliding_window"
    order = 10
    table_rows = ({},)  # not its parent streaming_llm's sinks
    summary = "keep the newest budget positions"
    display = Display("#bcbd22", "12px,4px,3px,4px", 4)
    engine_binding = EngineBinding(STEPS, compile_s=1)
    tensor_step = TENSOR
    tunables = ()

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        Policy.__init__(self, budget, rng)
        self._init_ring(0)

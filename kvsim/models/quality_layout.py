"""``kvsim quality --mode open`` under a serving layout (``kvsim.policies.layouts``; docs/serving.md): the
policy replays the full-cache traces under the layout (``decode.replay_masks(..., layout=)``: a layer's KV
heads together under shared selection), and its kept sets mask one teacher-forced pass, as the open loop
does without a layout. The result is the open loop's document with the layout's columns added; it is cached
under the open loop's key plus the layout, so no result without a layout changes key. The closed loop (the
deployed cache) takes a layout in a later step."""

from __future__ import annotations

import time

from ..policies.layouts import Layout
from .decode import MaskedPass, hidden_states, replay_masks
from .quality import Session, read_cached, write_cached


def measure_open(session: Session, policy: str, budget: int, params: dict, layout: Layout, *,
                 use_cache: bool = True) -> dict:
    """One open-loop measurement of ``policy`` at ``budget`` and ``params`` under ``layout``."""
    c = session.configuration(policy, budget, params)
    memory, _ = layout.memory(budget)
    columns = {"layout": layout.label, **layout.to_dict(), "memory": memory}
    key = {**session.cache_key(c, "open"), "layout": layout.to_dict()}
    hit = read_cached(key) if use_cache else None
    if hit is not None:
        return {**hit, "cached": True}
    t0 = time.perf_counter()
    allowed, mass = replay_masks(session.traces, c.policy, c.budget, c.asked, session.n, layout=layout)
    hidden = hidden_states(session.model, session.ids, MaskedPass(allowed=allowed))
    ((nll, kl),) = session._scorer.score([hidden])
    result = {**session._result(c.policy, c.budget, c.params, "open", mass, nll, kl, time.perf_counter() - t0, 1),
              **columns}
    if use_cache:
        write_cached(key, result)
    return {**result, "cached": False}

"""``kvsim quality --mode open`` under a serving layout (``kvsim.policykit.layouts``; docs/serving.md): the
policy replays the full-cache traces under the layout (``decode.replay_masks(..., layout=)``: a layer's KV
heads together under shared selection), and its kept sets mask one teacher-forced pass, as the open loop
does without a layout. The result is the open loop's document with the layout's columns added; it is cached
under the open loop's key plus the layout, so no result without a layout changes key.

``measure_closed``: ``kvsim quality --mode closed`` under a layout, token by token through the deployed cache
under it (``kvsim.hf.layout``: whole blocks, one block table per layer under shared selection, the
simulator's own ``LayoutCache`` deciding), one configuration a decode; cached the same way."""

from __future__ import annotations

import time

from ..policykit.layouts import Layout
from ..progress import Progress
from .decode import ClosedLoopDecoder, MaskedPass, hidden_states, replay_masks
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


class _LayoutDecoder(ClosedLoopDecoder):
    """The closed loop through layers under ``layout`` (``kvsim.hf.layout.LayoutLayer``, the policies built at
    its memory)."""

    def __init__(self, model, policies, full_rows, n, layout: Layout):
        super().__init__(model, policies, None, full_rows, n)
        self.layout = layout

    def _cache(self):
        from ..hf import EvictingCache
        from ..hf.layout import LayoutLayer

        return EvictingCache([LayoutLayer(None, self.layout, policies=[config[layer] for config in self.policies])
                              for layer in range(len(self.policies[0]))])


def measure_closed(session: Session, policy: str, budget: int, params: dict, layout: Layout, *,
                   use_cache: bool = True, progress: Progress | None = None) -> dict:
    """One closed-loop measurement of ``policy`` at ``budget`` and ``params`` under ``layout``: the deployed cache
    under it decodes the text token by token (the closed loop's truth); the closed loop's document with the
    layout's columns."""
    c = session.configuration(policy, budget, params)
    memory, _ = layout.memory(budget)
    columns = {"layout": layout.label, **layout.to_dict(), "memory": memory}
    key = {**session.cache_key(c, "closed"), "layout": layout.to_dict()}
    hit = read_cached(key) if use_cache else None
    if hit is not None:
        return {**hit, "cached": True}
    t0 = time.perf_counter()
    policies = [[spec.replace(budget=memory).build(session.traces[x][h]) for h in range(session.kv_heads)]
                for x, spec in enumerate(c.specs)]
    rows = [[tr.attention for tr in layer] for layer in session.traces]
    decoder = _LayoutDecoder(session.model, [policies], rows, session.n, layout)
    ((hidden, mass),) = decoder.decode(session.ids, session.hidden_full.shape[1], progress)
    ((nll, kl),) = session._scorer.score([hidden])
    result = {**session._result(c.policy, c.budget, c.params, "closed", mass, nll, kl, time.perf_counter() - t0, 1),
              **columns}
    if use_cache:
        write_cached(key, result)
    return {**result, "cached": False}


def layout_key(session: Session, c, mode: str, layout: Layout) -> dict:
    """What a measurement under ``layout`` is cached under: the plain one's key, plus the layout unless it is plain."""
    key = session.cache_key(c, mode)
    return key if layout.plain else {**key, "layout": layout.to_dict()}


def layout_cell(session: Session, policy: str, budget: int, params: dict, layout: Layout, mode: str) -> dict:
    """One measurement under ``layout`` in ``mode``, not through the cache (a cell of a grid whose runner reads and
    writes the cache, here or on Dask: ``kvsim.models.fanout``): the plain open or closed loop's document when the
    layout is plain, else ``measure_open``'s or ``measure_closed``'s."""
    if layout.plain:
        return session.evaluate_many([session.configuration(policy, budget, params)], mode)[0]
    result = (measure_open if mode == "open" else measure_closed)(session, policy, budget, params, layout, use_cache=False)
    return {k: v for k, v in result.items() if k != "cached"}

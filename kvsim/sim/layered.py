"""Replays under a serving layout (``kvsim.policykit.layouts``; docs/serving.md), on the reference path.

``replay_layout``: one trace (one KV head) through a policy under a layout: the policy built at the
layout's memory, wrapped (``layouts.held.LayoutPolicy``) and stepped by the harness, whose held-count
check reads the layout's bounds; ``optimal`` with blocks is the optimum under blocks
(``kvsim.policykit.optimal_blocks``), measured as the harness measures any kept set. Shared selection on one
trace is a no-op (one KV head). ``replay_layer``: a layer's KV heads (one trace each, one length) together,
each head's policy shown its own attention over what the layer holds, the choice made once under shared
selection (``layouts.held.LayoutCache``); each head's retained mass and top-k recall, and their mean.

Speed: the reference path is Python per step, about 20 to 60 microseconds a step for the attention
policies on two shared cores (tests/test_layouts.py times 512 steps of the shipped bundle); the fast engine
replays bare policies only.
"""

from __future__ import annotations

import numpy as np

from ..data.trace import Trace
from ..policies import PolicySpec
from ..policykit import registry
from ..policykit.layouts import Layout
from ..policykit.layouts.held import LayoutCache, LayoutPolicy
from ..progress import Progress
from .harness import ReplayResult, kept_sum, observe, replay_reference, top_k_hits


def replay_layout(trace: Trace, spec: PolicySpec, layout: Layout, *, top_k: int, record_kept: bool = False,
                  record_scores: bool = False, record_victims: bool = False,
                  progress: Progress | None = None) -> ReplayResult:
    """``spec`` replayed on ``trace`` under ``layout`` (not ``Layout()``: that is ``kvsim.replay``'s own path)."""
    layout.check(spec.name, spec.budget, spec.params)
    memory, _ = layout.memory(spec.budget)
    if registry.is_optimum(spec.name):
        return _block_optimum(trace, spec, layout, top_k, record_kept, progress)
    inner = spec.replace(budget=memory).build(trace)
    policy = LayoutPolicy(inner, layout, spec.budget)
    result = replay_reference(trace, policy, top_k=top_k, record_kept=record_kept, record_scores=record_scores,
                              record_victims=record_victims, progress=progress, spec=spec)
    result.budget, result.layout, result.memory = spec.budget, layout, memory
    return result


def _block_optimum(trace: Trace, spec: PolicySpec, layout: Layout, top_k: int, record_kept: bool,
                   progress) -> ReplayResult:
    from ..policykit.optimal_blocks import block_schedule

    x = block_schedule(trace, spec.budget, layout.block_size, progress=progress)
    gone = x.evicted_at()
    store = trace.derived
    recall = np.empty(trace.steps)
    for t in range(1, trace.steps + 1):
        kept = np.flatnonzero(gone[:t] >= t)
        recall[t - 1] = top_k_hits(store, t, top_k, kept) / min(top_k, t)
    return ReplayResult(policy=spec.name, budget=spec.budget, params={}, steps=trace.steps, top_k=top_k,
                        retained_mass_series=x.retained_mass_series, top_k_recall_series=recall,
                        kept_history=x.kept_history() if record_kept else None, spec=spec, layout=layout,
                        memory=x.capacity)


def replay_layer(traces: list[Trace], spec: PolicySpec, layout: Layout, *, top_k: int = 32,
                 record_kept: bool = False) -> dict:
    """A layer's KV heads (``traces``, one per head, in head order) under ``layout``, together: one policy per
    head (``spec`` at the layout's memory), each shown its own observed attention over what it holds; the
    eviction at each decision step made per head, or once for all under shared selection. Returns
    ``{"heads": [ReplayResult, ...], "retained_mass": mean, "top_k_recall": mean}``; with ``record_kept``
    each head's ``kept_history``."""
    if not traces:
        raise ValueError("a layer replay needs at least one head's trace")
    steps = {t.steps for t in traces}
    if len(steps) != 1:
        raise ValueError(f"a layer's heads must have one length; got {sorted(steps)} steps")
    T = steps.pop()
    layout.check(spec.name, spec.budget, spec.params, heads=len(traces))
    if registry.is_offline(spec.name):
        raise ValueError(f"{spec.name} is an offline reference: a layer replay runs online policies")
    memory, _ = layout.memory(spec.budget)
    inner = spec.replace(budget=memory)
    heads = [inner.build(t) for t in traces]
    cache = LayoutCache(heads, layout, spec.budget)
    from ..data import vectors

    members = [vectors.require(t, h.reads, h.name) for t, h in zip(traces, heads, strict=True)]
    for h, m in zip(heads, members, strict=True):
        if m:
            h.see(0, vectors.at(m, 0))
    stores = [t.derived for t in traces]
    scratch = [s.row_scratch() for s in stores]
    mass = np.empty((len(heads), T))
    recall = np.empty((len(heads), T))
    hist = np.full((len(heads), T, memory), -1, dtype=np.int32) if record_kept else None
    for t in range(1, T + 1):
        for i, (h, store) in enumerate(zip(heads, stores, strict=True)):
            kept = h.kept
            row = store.row(t, kept, scratch[i])
            total = kept_sum(row, kept)
            mass[i, t - 1] = total
            recall[i, t - 1] = top_k_hits(store, t, top_k, kept) / min(top_k, t)
            if members[i]:
                h.see(t, vectors.at(members[i], t))
            h.on_decode_step(t, observe(row[kept], total) if h.reads_attention else None)
        victims = cache.evict(t)
        low, high = cache.held_bounds(t)
        for i, h in enumerate(heads):
            held = h.kept
            if not low <= held.size <= high:
                raise AssertionError(f"{spec.label} ({layout.label}) head {i} step {t}: holds {held.size}, "
                                     f"expected {low} to {high}")
            if np.isin(victims[i], held).any():
                raise AssertionError(f"{spec.label} head {i} step {t}: victims still held")
            if hist is not None:
                hist[i, t - 1, : held.size] = held
    results = [ReplayResult(spec.name, spec.budget, dict(spec.params), T, top_k, mass[i], recall[i],
                            kept_history=None if hist is None else hist[i], spec=spec, layout=layout, memory=memory)
               for i in range(len(heads))]
    return {"heads": results, "retained_mass": float(mass.mean()), "top_k_recall": float(recall.mean())}

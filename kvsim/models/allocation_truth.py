"""The truth of an allocation: the model's loss and KL when each (layer, KV head) holds its own budget
(docs/allocation.md, "The truth of a split"), open loop or closed loop.

- open (``open_truth``): the policy replays each head's full-cache trace at that head's budget; the
  schedules mask one teacher-forced pass (docs/domain.md, "The truth"), as ``Session.run_open`` does with one
  budget for all, so a split of equal budgets is exactly ``Session.evaluate(policy, budget, "open")``.
- closed (``closed_truth``): the model decodes the text teacher-forced, token by token, through the deployed
  cache (``kvsim.hf``) holding each head's budget, as ``Session.run_closed`` does for one budget, so a split of
  equal budgets is exactly ``Session.evaluate(policy, budget, "closed")``; or, with ``pooled`` (adakv's floor),
  through layers whose KV heads share one pool (``kvsim.hf.pooled``), a pool of ``budget x KV heads``.

tests/test_allocation_truth.py holds both equalities. ``measure`` keeps each result in the quality cache
(``kvsim.models.quality.read_cached``), keyed by the split itself. The split is made above this layer
(``kvsim.analysis.allocation``, by the command line); this module reads it as ``budgets[layer][kv_head]``.
"""

from __future__ import annotations

import time

import numpy as np

from ..progress import Progress
from .decode import ClosedLoopDecoder, MaskedPass, hidden_states, layer_params, replay_masks
from .errors import QualityError

MODES = ("open", "closed")


def _check_shape(session, budgets) -> None:
    shape = (session.layers, session.kv_heads)
    got = (len(budgets), len(budgets[0]) if len(budgets) else 0)
    if got != shape or any(len(row) != shape[1] for row in budgets):
        raise QualityError(f"an allocation for {got[0]} layers x {got[1]} KV heads; the model has "
                           f"{shape[0]} x {shape[1]}")


def _result(session, policy: str, params: dict, mode: str, hidden, mass: np.ndarray, seconds: float) -> dict:
    ((nll, kl),) = session._scorer.score([hidden])
    mean_nll = float(nll.mean())
    return {"policy": policy, "params": params, "mode": mode, "steps": session.steps, "nll_full": session.nll_full,
            "nll": mean_nll, "delta_nll": mean_nll - session.nll_full, "kl": float(kl.mean()),
            "retained_mass": float(mass.mean()), "retained_mass_by_layer": mass.mean(axis=1).tolist(),
            "seconds": seconds}


def open_truth(session, policy: str, budgets, params: dict | None = None) -> dict:
    """The open-loop truth of ``policy`` with ``budgets[layer][kv_head]`` on ``session`` (a
    ``kvsim.models.quality.Session``): NLL, delta NLL, KL against the full cache, retained mass."""
    params = dict(params or {})
    _check_shape(session, budgets)
    t0 = time.perf_counter()
    allowed, mass = replay_masks(session.traces, policy, budgets, params, session.n)
    hidden = hidden_states(session.model, session.ids, MaskedPass(allowed=allowed))
    return _result(session, policy, params, "open", hidden, mass, time.perf_counter() - t0)


class _PooledDecoder(ClosedLoopDecoder):
    """The closed loop through adakv's pooled layers (one configuration): the retained mass read from what each
    head of the store holds."""

    def __init__(self, model, specs, pool: int, floor: int, full_rows, n):
        super().__init__(model, [[[None] * len(row) for row in specs]], None, full_rows, n)
        self.specs, self.pool, self.floor = specs, pool, floor

    def _cache(self):
        from ..hf import EvictingCache
        from ..hf.pooled import PooledLayer

        return EvictingCache([PooledLayer(row, self.pool, self.floor) for row in self.specs])

    def _mass(self, t: int) -> None:
        for x, layer in enumerate(self.cache.layers):
            for h in range(len(self.specs[x])):
                self.mass[0, x, h, t] = self.full_rows[x][h][t, layer.held(0, h)].astype(np.float64).sum()


def closed_truth(session, policy: str, budgets, params: dict | None = None, *, pooled: int | None = None,
                 progress: Progress | None = None) -> dict:
    """The closed-loop truth of ``policy`` with ``budgets[layer][kv_head]``: the text decoded teacher-forced
    through the deployed cache, each head at its budget; ``pooled`` (adakv's floor per head): each layer's
    heads share one pool of their summed budgets instead (h2o, one recent_window per layer)."""
    from ..policies import PolicySpec

    params = dict(params or {})
    _check_shape(session, budgets)
    try:
        per_layer = layer_params(params, session.layers)
    except ValueError as e:
        raise QualityError(str(e)) from None
    specs = [[PolicySpec.of(policy, int(b), **per_layer[x]) for b in row] for x, row in enumerate(budgets)]
    rows = [[tr.attention for tr in layer] for layer in session.traces]
    t0 = time.perf_counter()
    if pooled is None:
        policies = [[spec.build(session.traces[x][h]) for h, spec in enumerate(row)] for x, row in enumerate(specs)]
        decoder = ClosedLoopDecoder(session.model, [policies], None, rows, session.n)
    else:
        pools = {sum(int(b) for b in row) for row in budgets}
        if len(pools) != 1:
            raise QualityError(f"a pooled allocation holds one pool per layer; these layers' budgets sum to {sorted(pools)}")
        decoder = _PooledDecoder(session.model, specs, pools.pop(), int(pooled), rows, session.n)
    ((hidden, mass),) = decoder.decode(session.ids, session.hidden_full.shape[1], progress)
    return _result(session, policy, params, "closed", hidden, mass, time.perf_counter() - t0)


def measure(session, policy: str, budgets, params: dict | None = None, mode: str = "closed", *,
            pooled: int | None = None, use_cache: bool = True, progress: Progress | None = None) -> dict:
    """``open_truth`` or ``closed_truth`` through the quality cache (``<cache>/quality/split-<key>.json``),
    keyed by the model, the tokens, the policy and its parameters, the mode and the split itself (each head's
    budget, and the floor of a pool); ``"cached": True`` on what was read."""
    from .quality import VERSION, read_cached, write_cached

    if mode not in MODES:
        raise QualityError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if pooled is not None and mode != "closed":
        raise QualityError("a pooled allocation (adakv) is measured closed loop, through the deployed pool")
    params = dict(params or {})
    budgets = [[int(b) for b in row] for row in budgets]
    key = {"version": VERSION, "model": session.model_id, "tokens": session.tokens_id, "steps": session.steps,
           "policy": policy, "params": dict(sorted(params.items())), "mode": mode, "budgets": budgets, "pooled": pooled,
           "key_rule": session.key_rule}
    use_cache = use_cache and session.use_cache
    got = read_cached(key, "split") if use_cache else None
    if got is not None:
        return {**got, "cached": True}
    if mode == "open":
        got = open_truth(session, policy, budgets, params)
    else:
        got = closed_truth(session, policy, budgets, params, pooled=pooled, progress=progress)
    if session.use_cache:
        write_cached(key, got, "split")
    return {**got, "cached": False}


def cached_open_truth(session, policy: str, budgets, params: dict | None = None, *, use_cache: bool = True) -> dict:
    """``measure`` in open loop: what the split search and tune's allocator step read (the same cache)."""
    return measure(session, policy, budgets, params, "open", use_cache=use_cache)

"""The truth of an allocation, open loop: the model's loss and KL when each (layer, KV head) holds its own
budget (docs/allocation.md). The policy replays each head's full-cache trace at that head's budget; the
schedules mask one teacher-forced pass (docs/domain.md, "The truth"), as ``Session.run_open`` does with one
budget for all, so a split of equal budgets is exactly ``Session.evaluate(policy, budget, "open")``
(tests/test_allocation_truth.py). The split itself is made above this layer (``kvsim.analysis.allocation``,
by the command line); this module reads it as ``budgets[layer][kv_head]``."""

from __future__ import annotations

from .decode import MaskedPass, hidden_states, replay_masks
from .errors import QualityError


def open_truth(session, policy: str, budgets, params: dict | None = None) -> dict:
    """The open-loop truth of ``policy`` with ``budgets[layer][kv_head]`` on ``session`` (a
    ``kvsim.models.quality.Session``): NLL, delta NLL, KL against the full cache, retained mass."""
    params = dict(params or {})
    shape = (session.layers, session.kv_heads)
    got = (len(budgets), len(budgets[0]) if len(budgets) else 0)
    if got != shape:
        raise QualityError(f"an allocation for {got[0]} layers x {got[1]} KV heads; the model has "
                           f"{shape[0]} x {shape[1]}")
    allowed, mass = replay_masks(session.traces, policy, budgets, params, session.n)
    hidden = hidden_states(session.model, session.ids, MaskedPass(allowed=allowed))
    ((nll, kl),) = session._scorer.score([hidden])
    mean_nll = float(nll.mean())
    return {"policy": policy, "params": params, "mode": "open", "steps": session.steps, "nll_full": session.nll_full,
            "nll": mean_nll, "delta_nll": mean_nll - session.nll_full, "kl": float(kl.mean()),
            "retained_mass": float(mass.mean()), "retained_mass_by_layer": mass.mean(axis=1).tolist()}


#: what a cached split's truth means; bump it when the figures change meaning
CACHE_VERSION = 1


def truth_key(session, policy: str, budgets, params: dict | None = None) -> dict:
    """What a split's open-loop truth depends on: the model, the tokens (text and steps), the policy and
    its parameters as asked, every head's budget, and the key-token rule the session scores by."""
    return {"version": CACHE_VERSION, "model": session.model_id, "tokens": session.tokens_id, "steps": session.steps,
            "policy": policy, "params": dict(sorted((params or {}).items())),
            "budgets": [[int(b) for b in row] for row in budgets], "key_rule": session.key_rule}


def cached_open_truth(session, policy: str, budgets, params: dict | None = None, *, use_cache: bool = True) -> dict:
    """``open_truth`` through the on-disk cache (``<cache_dir>/quality/allocation-<digest>.json``, the
    quality results' folder, written atomically), keyed by ``truth_key``; the result says ``cached``.
    A session whose model names nothing (``model_id`` "model") keys nothing: measured every time."""
    from .quality import read_cached, write_cached

    use_cache = use_cache and session.model_id != "model"
    key = truth_key(session, policy, budgets, params)
    if use_cache:
        got = read_cached(key, "allocation")
        if got is not None:
            return {**got, "cached": True}
    got = open_truth(session, policy, budgets, params)
    if use_cache:
        write_cached(key, got, "allocation")
    return {**got, "cached": False}

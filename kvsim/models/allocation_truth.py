"""The truth of an allocation, open loop: the model's loss and KL when each (layer, KV head) holds its own
budget (docs/allocation.md). The policy replays each head's full-cache trace at that head's budget; the
schedules mask one teacher-forced pass (docs/domain.md, "The truth"), as ``Session.run_open`` does with one
budget for all, so a split of equal budgets is exactly ``Session.evaluate(policy, budget, "open")``
(tests/test_allocation_truth.py). The split itself is made above this layer (``kvsim.analysis.allocation``,
by the command line); this module reads it as ``budgets[layer][kv_head]``."""

from __future__ import annotations

import numpy as np

from ..sim.simulate import replay
from .decode import MaskedPass, hidden_states
from .errors import QualityError


def allocation_masks(traces, policy: str, budgets, params: dict, n: int):
    """``replay_masks`` (kvsim.models.decode) with a budget per head: per layer what each query sees, and the
    retained mass of each replay (layers x KV heads)."""
    import torch

    layers, kv_heads = len(traces), len(traces[0])
    allowed, mass = {}, np.zeros((layers, kv_heads))
    for layer in range(layers):
        masks = torch.zeros(kv_heads, n, n, dtype=torch.bool)
        for h in range(kv_heads):
            res = replay(traces[layer][h], policy, budget=int(budgets[layer][h]), record_kept=True, **params)
            mass[layer, h] = res.retained_mass
            hist = res.kept_history  # row s - 1: kept after step s, which query s + 1 sees
            rows, cols = np.nonzero(hist[: n - 2] >= 0)
            m = np.zeros((n, n), dtype=bool)
            m[rows + 2, hist[rows, cols]] = True
            m[1, 0] = True  # query 1 sees the starting cache, [0]
            m[np.arange(n), np.arange(n)] = True  # and every query its own key
            masks[h] = torch.from_numpy(m)
        allowed[layer] = masks
    return allowed, mass


def open_truth(session, policy: str, budgets, params: dict | None = None) -> dict:
    """The open-loop truth of ``policy`` with ``budgets[layer][kv_head]`` on ``session`` (a
    ``kvsim.models.quality.Session``): NLL, delta NLL, KL against the full cache, retained mass."""
    params = dict(params or {})
    shape = (session.layers, session.kv_heads)
    got = (len(budgets), len(budgets[0]) if len(budgets) else 0)
    if got != shape:
        raise QualityError(f"an allocation for {got[0]} layers x {got[1]} KV heads; the model has "
                           f"{shape[0]} x {shape[1]}")
    allowed, mass = allocation_masks(session.traces, policy, budgets, params, session.n)
    hidden = hidden_states(session.model, session.ids, MaskedPass(allowed=allowed))
    ((nll, kl),) = session._scorer.score([hidden])
    mean_nll = float(nll.mean())
    return {"policy": policy, "params": params, "mode": "open", "steps": session.steps, "nll_full": session.nll_full,
            "nll": mean_nll, "delta_nll": mean_nll - session.nll_full, "kl": float(kl.mean()),
            "retained_mass": float(mass.mean()), "retained_mass_by_layer": mass.mean(axis=1).tolist()}

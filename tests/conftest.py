"""Shared fixtures: the canonical trace (built once per session) and small random traces."""

from __future__ import annotations

import numpy as np
import pytest

import kvsim
from kvsim.catalog import resolve_trace


def random_trace(steps: int, seed: int = 0, ties: bool = False, name: str = "random") -> kvsim.Trace:
    """A valid trace of ``steps`` steps. ``ties=True`` draws small integer weights (zeros and
    exact ties everywhere), which is what exercises the lower-position-first rules."""
    rng = np.random.default_rng(seed)
    n = steps + 1
    if ties:
        # mostly zeros, the rest 1 or 2: many positions share a score exactly
        a = np.tril(rng.choice([0.0, 0.0, 0.0, 1.0, 2.0], size=(n, n)), k=-1)
        empty = np.flatnonzero(a.sum(axis=1) == 0)[1:]
        a[empty, empty - 1] = 1.0  # a row must have some weight: put it on the newest position
    else:
        # heavy-tailed rows, like attention: a few large weights and a long thin tail
        a = np.tril(rng.gamma(0.3, size=(n, n)) + 1e-6, k=-1)
        a[np.arange(1, n), np.arange(n - 1)] += 1.0  # and most of it on the newest position
    return kvsim.from_array(a, name=name)


def policy_args(name: str, budget: int, trace: kvsim.Trace | None = None, **params) -> dict:
    """Keyword arguments that build ``name`` at ``budget``: its defaults, with every integer
    parameter scaled down when the defaults do not fit a small budget (recent_window 32 at budget
    8), plus the trace for offline policies."""
    cls = kvsim.POLICIES[name]
    extra = {"trace": trace} if cls.needs_trace else {}
    try:
        kvsim.make_policy(name, budget=budget, **params, **extra)
        return {**params, **extra}
    except ValueError:
        pass
    fitted = dict(params)
    for p, default in kvsim.policy_params(name).items():
        if p in fitted or p == "trace" or isinstance(default, bool) or not isinstance(default, int):
            continue
        fitted[p] = min(default, budget // 2)
    kvsim.make_policy(name, budget=budget, **fitted, **extra)  # fails the test loudly if still refused
    return {**fitted, **extra}


@pytest.fixture(scope="session")
def canonical() -> kvsim.Trace:
    return resolve_trace("canonical")


@pytest.fixture(scope="session")
def make_trace():
    """``make_trace(steps, seed=0, ties=False)``: a small random trace (a session fixture so that
    hypothesis tests may use it)."""
    return random_trace


@pytest.fixture(scope="session")
def fit_args():
    """``fit_args(name, budget, trace=None, **params)``: see ``policy_args``."""
    return policy_args

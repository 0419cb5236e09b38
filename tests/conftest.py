"""Shared fixtures: the canonical trace (built once per session) and small random traces."""

from __future__ import annotations

import numpy as np
import pytest

import kvsim
from kvsim.data.catalog import resolve_trace


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
    """The parameters that build ``name`` at ``budget``: its defaults, each tunable brought within
    the bounds the registry gives for that budget (recent_window 32 at budget 8 becomes 4), with
    ``params`` as given. The trace is passed to ``make_policy(..., trace=)`` separately."""
    fitted = dict(params)
    for p in kvsim.tunables(name):
        upper = p.upper(budget)
        if p.name not in fitted and upper is not None and p.default > upper:
            fitted[p.name] = min(p.default, budget // 2)
    kvsim.make_policy(name, budget=budget, trace=trace, **fitted)  # fails the test loudly if still refused
    return fitted


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

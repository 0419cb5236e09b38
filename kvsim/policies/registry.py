"""The one registry of eviction policies. The CLI, the app and the contract tests all read it."""

from __future__ import annotations

import inspect

import numpy as np

from .base import DEFAULT_BUDGET, Policy
from .greedy_future import GreedyFuture
from .h2o import H2O
from .h2o_normalized import H2ONormalized
from .optimal import Optimal
from .random_eviction import RandomEviction
from .scissorhands import Scissorhands
from .sliding_window import SlidingWindow
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM
from .tova import TOVA

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        SlidingWindow, StreamingLLM, H2O, Scissorhands, TOVA, H2ONormalized, SnapKV, RandomEviction,
        GreedyFuture, Optimal,
    )
}


def register(cls: type[Policy]) -> type[Policy]:
    """Add a policy class to the registry under its ``name`` (usable as a decorator)."""
    if not cls.name or cls.name in POLICIES:
        raise ValueError(f"policy name {cls.name!r} is empty or already registered")
    POLICIES[cls.name] = cls
    return cls


def policy_params(name: str) -> dict[str, int]:
    """The parameters a policy accepts beyond budget and rng, with their defaults."""
    cls = _lookup(name)
    sig = inspect.signature(cls.__init__)
    return {
        p.name: p.default
        for p in sig.parameters.values()
        if p.name not in ("self", "budget", "rng") and p.kind is p.POSITIONAL_OR_KEYWORD
    }


def _lookup(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None


def make_policy(
    name: str, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None, **params
) -> Policy:
    """Build a policy by registry name, e.g. ``make_policy("h2o", budget=256, recent_window=64)``."""
    cls = _lookup(name)
    accepted = policy_params(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"{name} does not take parameter(s) {', '.join(unknown)}; "
            f"it takes: {', '.join(accepted) or 'none beyond budget'}"
        )
    return cls(budget=budget, rng=rng, **params)

"""The one registry of eviction policies. The CLI, the app and the contract tests all read it.

``make_policy`` builds any of them from (name, budget, params, trace): an offline reference that
reads the whole trace is handed it here and nowhere else. ``tunables`` lists each policy's integer
parameters with their defaults and bounds, which is what the CLI's flags and the app's controls
are made from.
"""

from __future__ import annotations

import numpy as np

from ..data.trace import Trace
from .base import DEFAULT_BUDGET, Param, Policy
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


def policy_class(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None


def tunables(name: str) -> tuple[Param, ...]:
    """A policy's tunable parameters beyond budget (name, default, bounds, help)."""
    return policy_class(name).tunables


def policy_params(name: str) -> dict[str, int]:
    """The parameters a policy accepts beyond budget, with their defaults."""
    return {p.name: p.default for p in tunables(name)}


def all_tunables() -> dict[str, Param]:
    """Every tunable parameter of any registered policy, by name (the first declaration seen)."""
    out: dict[str, Param] = {}
    for cls in POLICIES.values():
        for p in cls.tunables:
            out.setdefault(p.name, p)
    return out


def make_policy(
    name: str,
    budget: int = DEFAULT_BUDGET,
    rng: np.random.Generator | None = None,
    *,
    trace: Trace | None = None,
    **params,
) -> Policy:
    """Build a policy by registry name, e.g. ``make_policy("h2o", budget=256, recent_window=64)``.

    ``trace`` is passed on to the offline references that read it (``needs_trace``) and ignored by
    every other policy, so a caller can always give it."""
    cls = policy_class(name)
    accepted = policy_params(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"{name} does not take parameter(s) {', '.join(unknown)}; "
            f"it takes: {', '.join(accepted) or 'none beyond budget'}"
        )
    if cls.needs_trace:
        params = {**params, "trace": trace}
    return cls(budget=budget, rng=rng, **params)

"""The one registry of eviction policies. The CLI, the app and the contract tests all read it.

``tunables`` lists each policy's integer parameters with their defaults and bounds, which is what
the CLI's flags and the app's controls are made from; ``kvsim.policies.spec`` validates a choice of
them once (``PolicySpec``) and builds the policy from it (``make_policy``).
"""

from __future__ import annotations

from .base import Param, Policy
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

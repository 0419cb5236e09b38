"""The one registry of eviction policies. The CLI, the app, the views, the engine and the contract
tests all read it: every table of policies (the engine's kernels, the curve's styles, the scores'
names, the app's warm-up, the CLI's choices, the app's lists) is derived from the classes here, each of
which carries its own parameters, display and engine binding. ``register`` adds one more; nothing else
needs editing (docs/architecture.md, "Adding a policy").

``tunables`` lists each policy's integer parameters with their defaults and bounds, which is what
the CLI's flags and the app's controls are made from; ``kvsim.policies.spec`` validates a choice of
them once (``PolicySpec``) and builds the policy from it (``make_policy``).
"""

from __future__ import annotations

import re

from .base import Display, EngineBinding, Param, Policy
from .critical import CriticalKV
from .expected_attention import ExpectedAttention
from .greedy_future import GreedyFuture
from .h2o import H2O
from .h2o_normalized import H2ONormalized
from .keydiff import KeyDiff
from .knorm import KNorm
from .optimal import Optimal
from .random_eviction import RandomEviction
from .scissorhands import Scissorhands
from .sliding_window import SlidingWindow
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM
from .tova import TOVA
from .vatp import VATP

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        SlidingWindow, StreamingLLM, H2O, Scissorhands, TOVA, H2ONormalized, SnapKV, VATP, CriticalKV, ExpectedAttention,
        KNorm, KeyDiff,
        RandomEviction, GreedyFuture, Optimal,
    )
}


_NAME = re.compile(r"[a-z][a-z0-9_]*")


def register(cls: type[Policy]) -> type[Policy]:
    """Add a policy class to the registry (usable as a class decorator): from then on the CLI's
    ``--policy`` choices, the app's lists, the curve's styles and the engine (its kernel when it
    declares ``engine_binding``, the reference harness otherwise) all know it. A ``ValueError`` names
    what is wrong: not a ``Policy``, a name that is no lower-case identifier or is taken by another
    class, a ``display`` or ``engine_binding`` of the wrong type."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"register: {cls!r} is not a subclass of kvsim.policies.Policy")
    name = cls.name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"register: {cls.__name__}.name {name!r} is not a lower-case identifier (the CLI's --policy value)")
    if POLICIES.get(name, cls) is not cls:
        raise ValueError(f"register: the name {name!r} is taken by {POLICIES[name].__module__}.{POLICIES[name].__name__}")
    for field, kind in (("display", Display), ("engine_binding", EngineBinding)):
        value = getattr(cls, field)
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"register: {cls.__name__}.{field} must be a {kind.__name__} or None, got {value!r}")
    POLICIES[name] = cls
    return cls


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

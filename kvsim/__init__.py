"""kvsim: replay attention traces through KV-cache eviction policies and measure what they keep.

Public API (no import side effects)::

    kvsim.make_policy(name, budget=DEFAULT_BUDGET, rng=None, trace=None, **params)
    kvsim.tunables(name)                    # its parameters: defaults, bounds, help
    kvsim.PolicySpec.of("h2o", 256, recent_window=64)   # policy, budget, parameters: validated once
    kvsim.replay(trace, spec)                            # a spec, or a name with budget= and params
    kvsim.replay(trace, "h2o", budget=256, recent_window=64)          # fast engine where it covers
    kvsim.sweep(trace, "h2o", 256, "recent_window", range(1, 256))   # the policy, reference otherwise
    kvsim.canonical_trace()                 # the calibrated synthetic trace (cached on disk)
    kvsim.resolve_trace("canonical")        # canonical, a shipped trace's name, or a path
    kvsim.load_trace(path)                  # the interchange .npz format
    kvsim.describe(trace)                   # sink share, recent share, concentration
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names are, for readers and checkers; at run time ``__getattr__`` imports each on first use
    from .analysis.metrics import describe
    from .analysis.windows import best_row as best
    from .data.canonical import CanonicalConfig
    from .data.canonical import generate as generate_canonical
    from .data.catalog import available_traces, resolve_trace
    from .data.store import canonical_trace
    from .data.trace import Trace, TraceError, from_array, save_npz
    from .data.trace import load_npz as load_trace
    from .policies import DEFAULT_BUDGET, POLICIES, Param, Policy, PolicySpec, make_policy, policy_params, tunables
    from .sim.harness import DEFAULT_TOP_K, ContractError, ReplayResult
    from .sim.simulate import replay, sweep

#: each public name's module and name there, imported when the name is first read, so that ``import
#: kvsim`` (and every ``kvsim`` command, whose package this is) loads none of them: ``kvsim --help`` and
#: a usage error answer before the simulator's modules would have loaded (issue 36)
_HOMES = {
    "describe": ("analysis.metrics", "describe"),
    "CanonicalConfig": ("data.canonical", "CanonicalConfig"),
    "generate_canonical": ("data.canonical", "generate"),
    "available_traces": ("data.catalog", "available_traces"),
    "resolve_trace": ("data.catalog", "resolve_trace"),
    "canonical_trace": ("data.store", "canonical_trace"),
    **{name: ("data.trace", name) for name in ("Trace", "TraceError", "from_array", "save_npz")},
    "load_trace": ("data.trace", "load_npz"),
    **{name: ("policies", name) for name in ("DEFAULT_BUDGET", "POLICIES", "Param", "Policy", "PolicySpec", "make_policy",
                                             "policy_params", "tunables")},
    **{name: ("sim.harness", name) for name in ("DEFAULT_TOP_K", "ContractError", "ReplayResult")},
    **{name: ("sim.simulate", name) for name in ("replay", "sweep")},
    "best": ("analysis.windows", "best_row"),  # the one window rule (its module imports the engine only to sweep)
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _HOMES[name]
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value  # the next read is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_TOP_K",
    "POLICIES",
    "CanonicalConfig",
    "ContractError",
    "Param",
    "Policy",
    "PolicySpec",
    "ReplayResult",
    "Trace",
    "TraceError",
    "available_traces",
    "best",
    "canonical_trace",
    "describe",
    "from_array",
    "generate_canonical",
    "load_trace",
    "make_policy",
    "policy_params",
    "replay",
    "resolve_trace",
    "save_npz",
    "sweep",
    "tunables",
]

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

from .analysis.metrics import describe
from .data.canonical import CanonicalConfig
from .data.canonical import generate as generate_canonical
from .data.catalog import available_traces, resolve_trace
from .data.store import canonical_trace
from .data.trace import Trace, TraceError, from_array, save_npz
from .data.trace import load_npz as load_trace
from .policies import DEFAULT_BUDGET, POLICIES, Param, Policy, PolicySpec, make_policy, policy_params, tunables
from .sim.harness import DEFAULT_TOP_K, ContractError, ReplayResult
from .sim.simulate import best, replay, sweep

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

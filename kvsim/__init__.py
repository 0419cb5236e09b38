"""kvsim: replay attention traces through KV-cache eviction policies and measure what they keep.

Public API (no import side effects)::

    kvsim.make_policy(name, budget=512, rng=None, **params)
    kvsim.replay(trace, "h2o", budget=256, recent_window=64)
    kvsim.canonical_trace()                 # the calibrated synthetic trace
    kvsim.load_trace(path)                  # the interchange .npz format
"""

from .canonical import CanonicalConfig
from .canonical import generate as generate_canonical
from .policies import DEFAULT_BUDGET, POLICIES, Policy, make_policy, policy_params, register
from .replay import DEFAULT_TOP_K, ContractError, ReplayResult, replay
from .trace import Trace, TraceError, from_array, save_npz
from .trace import load_npz as load_trace

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_TOP_K",
    "POLICIES",
    "CanonicalConfig",
    "ContractError",
    "Policy",
    "ReplayResult",
    "Trace",
    "TraceError",
    "from_array",
    "generate_canonical",
    "load_trace",
    "make_policy",
    "policy_params",
    "register",
    "replay",
    "save_npz",
]

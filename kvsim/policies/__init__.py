"""The eviction policies, one module each and nothing else: the registry (``kvsim.policykit.registry``)
imports every module here and each registers its class. This package re-exports the API a plugin is written
against (docs/architecture.md, "Adding a policy": ``from kvsim.policies import Policy, register``), from
``kvsim.policykit``, where the interface, the registry and the policies' other support live; importing it loads
every policy, the entry points and ``KVSIM_PLUGINS``."""

from ..policykit.base import (
    DEFAULT_BUDGET,
    RECENT_WINDOW,
    WINDOW,
    Capabilities,
    ContractError,
    Display,
    EngineBinding,
    Param,
    ParamError,
    Policy,
    describe_policy,
)
from ..policykit.registry import (
    POLICIES,
    PROBLEMS,
    all_tunables,
    load_policies,
    policy_class,
    policy_params,
    register,
    register_scorer,
    tunables,
)
from ..policykit.spec import ParamValues, PolicySpec, make_policy

__all__ = [
    "Capabilities", "DEFAULT_BUDGET", "POLICIES", "ContractError", "Display", "EngineBinding", "Param", "ParamError",
    "ParamValues", "Policy", "RECENT_WINDOW", "WINDOW",
    "PolicySpec", "PROBLEMS", "all_tunables", "load_policies", "describe_policy", "make_policy", "policy_class",
    "policy_params", "register", "register_scorer", "tunables",
]

# last, once everything above is bound: the shipped policy modules, the entry points and KVSIM_PLUGINS
load_policies()

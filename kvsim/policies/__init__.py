from .base import DEFAULT_BUDGET, Capabilities, ContractError, Display, EngineBinding, Param, ParamError, Policy, describe_policy
from .registry import POLICIES, PROBLEMS, all_tunables, load_policies, policy_class, policy_params, register, register_scorer, tunables
from .spec import ParamValues, PolicySpec, make_policy

__all__ = [
    "Capabilities", "DEFAULT_BUDGET", "POLICIES", "ContractError", "Display", "EngineBinding", "Param", "ParamError",
    "ParamValues", "Policy",
    "PolicySpec", "PROBLEMS", "all_tunables", "load_policies", "describe_policy", "make_policy", "policy_class",
    "policy_params", "register", "register_scorer", "tunables",
]

# last, once everything above is bound: the shipped policy modules, the entry points and KVSIM_PLUGINS
load_policies()

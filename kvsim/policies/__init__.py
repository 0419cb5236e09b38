from .base import DEFAULT_BUDGET, ContractError, Display, EngineBinding, Param, ParamError, Policy, describe_policy
from .registry import POLICIES, all_tunables, policy_class, policy_params, register, tunables
from .spec import PolicySpec, make_policy

__all__ = [
    "DEFAULT_BUDGET", "POLICIES", "ContractError", "Display", "EngineBinding", "Param", "ParamError", "Policy",
    "PolicySpec", "all_tunables", "describe_policy", "make_policy", "policy_class", "policy_params", "register",
    "tunables",
]

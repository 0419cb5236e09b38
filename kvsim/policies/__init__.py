from .base import DEFAULT_BUDGET, Param, ParamError, Policy, describe_policy
from .registry import POLICIES, all_tunables, make_policy, policy_class, policy_params, tunables
from .spec import PolicySpec

__all__ = [
    "DEFAULT_BUDGET", "POLICIES", "Param", "ParamError", "Policy", "PolicySpec", "all_tunables", "describe_policy",
    "make_policy", "policy_class", "policy_params", "tunables",
]

from .base import DEFAULT_BUDGET, Param, Policy, describe_policy
from .registry import POLICIES, all_tunables, make_policy, policy_class, policy_params, tunables

__all__ = [
    "DEFAULT_BUDGET", "POLICIES", "Param", "Policy", "all_tunables", "describe_policy", "make_policy", "policy_class", "policy_params",
    "tunables",
]

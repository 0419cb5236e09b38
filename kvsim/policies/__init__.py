from .base import DEFAULT_BUDGET, Param, Policy
from .registry import POLICIES, all_tunables, make_policy, policy_class, policy_params, tunables

__all__ = [
    "DEFAULT_BUDGET", "POLICIES", "Param", "Policy", "all_tunables", "make_policy", "policy_class", "policy_params",
    "tunables",
]

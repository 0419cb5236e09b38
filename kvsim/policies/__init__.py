from .base import DEFAULT_BUDGET, Policy
from .registry import POLICIES, make_policy, policy_params, register

__all__ = ["DEFAULT_BUDGET", "POLICIES", "Policy", "make_policy", "policy_params", "register"]

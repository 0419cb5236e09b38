"""``PolicySpec``: one value for "policy, budget, parameters", made once from a control or a flag.

It is validated when it is made (the registry name, the budget, every parameter against its
``Param`` bounds, unknown parameters refused), so nothing downstream builds a policy only to check
its arguments. It is frozen and hashable: the app keys its caches by it, the replay builds the
policy from it (``build``), and the result carries it back to the figure (``ReplayResult.spec``).
Parameters the caller leaves out take their defaults, so two specs that replay the same thing are
equal however they were asked for.

Its parameters are typed: ``spec.params`` is a ``ParamValues``, every tunable the policy declares (its
``Param``) an attribute (``spec.params.recent_window``), a name it does not declare an ``AttributeError``
naming the ones it does. It stays the ``(name, value)`` pairs it always was, in the declared order, so a
spec hashes, compares, prints and keys a cache (``dict(spec.params)`` in a JSON key) exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import DEFAULT_BUDGET, Policy, check_budget
from .registry import policy_class, window_param


class ParamValues(tuple):
    """A spec's parameter values: ``(name, value)`` pairs in the order the policy declares its ``Param``s, each
    also an attribute. A tuple underneath, so equality, hashing, ``repr``, ``dict(...)`` and JSON are a tuple's."""

    __slots__ = ()

    def __getattr__(self, name: str) -> int:
        for key, value in self:
            if key == name:
                return value
        raise AttributeError(f"no parameter {name!r} here; these are set: {', '.join(self.names) or 'none'}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self)

    def __repr__(self) -> str:  # a plain tuple's, so a spec prints (and any text key made of it reads) as before
        return tuple.__repr__(self)


@dataclass(frozen=True)
class PolicySpec:
    name: str
    budget: int
    #: every tunable of the policy, in the order it declares them, with its value (``spec.params.recent_window``)
    params: ParamValues = ParamValues()

    def __post_init__(self) -> None:
        if type(self.params) is not ParamValues:  # made from pairs (a caller's tuple): the same pairs, typed
            object.__setattr__(self, "params", ParamValues(self.params))

    @classmethod
    def of(cls, name: str, budget: int = DEFAULT_BUDGET, **params) -> PolicySpec:
        """The validated spec; a ``ValueError`` (``ParamError`` for a value out of bounds) names
        what is wrong."""
        policy = policy_class(name)
        budget = check_budget(budget)
        declared = {p.name: p for p in policy.tunables}
        unknown = sorted(set(params) - set(declared))
        if unknown:
            raise ValueError(
                f"{name} does not take parameter(s) {', '.join(unknown)}; it takes: {', '.join(declared) or 'none beyond budget'}"
            )
        values = ParamValues((p.name, p.check(params.get(p.name, p.default), budget)) for p in policy.tunables)
        return cls(name, budget, values)

    @property
    def kwargs(self) -> dict[str, int]:
        """The parameters as keyword arguments (``make_policy(spec.name, spec.budget, **spec.kwargs)``)."""
        return dict(self.params)

    def __getitem__(self, param: str) -> int:
        """A parameter named by a variable (a generic loop over ``Param``s); a known one reads as
        ``spec.params.NAME``."""
        for name, value in self.params:
            if name == param:
                return value
        raise KeyError(f"{self.name} has no parameter {param!r}")

    @property
    def window(self) -> int | None:
        """The value of the policy's window parameter (its declared ``window``: ``spec.params.recent_window``), None
        for a policy without one."""
        param = window_param(self.name)
        return None if param is None else self[param]

    def get(self, param: str, default: int | None = None) -> int | None:
        """The parameter named ``param``, or ``default`` for a policy that does not declare it."""
        return dict(self.params).get(param, default)

    def replace(self, *, budget: int | None = None, **params) -> PolicySpec:
        """The same policy with some values changed, validated again."""
        return PolicySpec.of(self.name, self.budget if budget is None else budget, **{**self.kwargs, **params})

    def build(self, trace=None, rng: np.random.Generator | None = None) -> Policy:
        """A fresh policy in its starting state (offline references are handed ``trace``)."""
        cls = policy_class(self.name)
        # offline references read the trace; a policy that ``reads_meta`` reads constants of its meta (a RoPE)
        extra = {"trace": trace} if cls.needs_trace or cls.reads_meta else {}
        return cls(budget=self.budget, rng=rng, **self.kwargs, **extra)

    @property
    def label(self) -> str:
        """``h2o recent_window=32`` (the budget is said apart, where a view shows it)."""
        return " ".join([self.name, *(f"{k}={v}" for k, v in self.params)])


def make_policy(name: str, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None, *, trace=None,
                **params) -> Policy:
    """Build a policy by registry name, e.g. ``make_policy("h2o", budget=256, recent_window=64)``:
    ``PolicySpec.of(...).build(trace, rng)``, so a bad value fails with the spec's message.

    ``trace`` is passed on to the offline references that read it (``needs_trace``) and ignored by
    every other policy, so a caller can always give it."""
    return PolicySpec.of(name, budget, **params).build(trace, rng)

"""The policy interface every eviction policy implements (DOMAIN.md section 2).

A policy holds a set of token positions, ``kept``, in ascending order: the order in which
attention arrives. The harness calls ``on_decode_step(pos, attn)`` once per decode step
(``attn`` is aligned with ``kept`` as it was *before* the call, or ``None`` for "no
information"), then ``evict(budget)``, which returns the victims in ascending position order.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

DEFAULT_BUDGET = 512


def check_budget(budget: int) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise ValueError(f"budget must be an integer, got {budget!r}")
    if budget < 1:
        raise ValueError(f"budget must be at least 1, got {budget}")
    return int(budget)


def check_param(name: str, value: int, *, below: int | None = None, below_name: str = "budget") -> int:
    """Validate a non-negative integer parameter, optionally strictly below ``below``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")
    if below is not None and value >= below:
        raise ValueError(f"{name} must be less than {below_name} ({below}), got {value}")
    return int(value)


class Policy:
    """Base class: the members of DOMAIN.md section 2, plus the cache's starting state ``[0]``."""

    name: ClassVar[str] = ""
    #: True for policies whose eviction depends on the attention they are shown.
    reads_attention: ClassVar[bool] = False
    #: True for policies that keep a per-position score (the app's cumulative-score view).
    keeps_scores: ClassVar[bool] = False
    #: True for offline references that read the whole trace (future rows included); they take
    #: a ``trace=`` parameter, which ``replay`` passes when it builds the policy by name.
    needs_trace: ClassVar[bool] = False

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        self.budget = check_budget(budget)
        self.rng = rng  # accepted by every policy; deterministic ones never touch it

    @property
    def params(self) -> dict[str, int]:
        """The policy's own parameters (beyond budget), as passed to ``make_policy``."""
        return {}

    @property
    def kept(self) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:  # pragma: no cover
        raise NotImplementedError

    def evict(self, budget: int) -> list[int]:  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in {"budget": self.budget, **self.params}.items())
        return f"{type(self).__name__}({args})"

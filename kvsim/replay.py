"""The replay harness (DOMAIN.md section 4): the one hot loop of the reference path.

For each step t = 1..T: read ``kept``; score it against the full row (retained mass, top-k
recall); show the policy the observed attention, renormalised over the kept set, as float32;
admit position t; evict to budget and check the victims contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .policies import POLICIES, Policy, make_policy
from .trace import Trace

DEFAULT_TOP_K = 32


class ContractError(AssertionError):
    """A policy broke the victims contract of DOMAIN.md section 4."""


@dataclass(eq=False)
class ReplayResult:
    policy: str
    budget: int
    params: dict
    steps: int
    top_k: int
    retained_mass_series: np.ndarray  # float64, per step t = 1..T
    top_k_recall_series: np.ndarray  # float64, per step t = 1..T
    kept_history: np.ndarray | None = None  # int32 (T, budget), kept after step t, -1 padded
    score_history: np.ndarray | None = None  # float64 (T, budget + 1), scores before eviction
    score_positions: np.ndarray | None = None  # int32 (T, budget + 1), positions of those scores
    victims_history: list = field(default_factory=list)

    @property
    def retained_mass(self) -> float:
        return float(self.retained_mass_series.mean())

    @property
    def top_k_recall(self) -> float:
        return float(self.top_k_recall_series.mean())

    def summary(self) -> dict:
        return {
            "policy": self.policy,
            "budget": self.budget,
            **self.params,
            "retained_mass": self.retained_mass,
            "top_k_recall": self.top_k_recall,
            "top_k": self.top_k,
            "steps": self.steps,
        }

    def kept_mask(self) -> np.ndarray:
        """uint8 ``(T, T + 1)``: 1 where position p is held after step t (row t - 1)."""
        if self.kept_history is None:
            raise ValueError("replay was run without record_kept=True")
        T = self.steps
        mask = np.zeros((T, T + 1), dtype=np.uint8)
        rows, cols = np.nonzero(self.kept_history >= 0)
        mask[rows, self.kept_history[rows, cols]] = 1
        return mask


def kept_sum(row: np.ndarray, kept: np.ndarray) -> float:
    """``sum(row[kept])`` in float64, added strictly in kept order.

    Sequential on purpose (numpy's own sum is pairwise): a fast engine that loops over the kept
    set reproduces it bit for bit, and with it the observed attention and every later score.
    """
    sub = row[kept].astype(np.float64)
    return float(np.cumsum(sub)[-1]) if sub.size else 0.0


def observed_attention(row: np.ndarray, kept: np.ndarray, total: float | None = None) -> np.ndarray:
    """What a serving stack holding only ``kept`` would expose: the row renormalised over kept,
    as float32 (a softmax over a subset is the full softmax renormalised). Zeros if it sums to 0."""
    s = kept_sum(row, kept) if total is None else total
    if s > 0:
        return (row[kept].astype(np.float64) / s).astype(np.float32)
    return np.zeros(kept.size, dtype=np.float32)


def replay(
    trace: Trace,
    policy: Policy | str,
    *,
    budget: int | None = None,
    top_k: int = DEFAULT_TOP_K,
    record_kept: bool = False,
    record_scores: bool = False,
    record_victims: bool = False,
    **params,
) -> ReplayResult:
    """Replay ``trace`` through ``policy`` (an instance, or a registry name plus budget/params)."""
    if isinstance(policy, str):
        if POLICIES[policy].needs_trace if policy in POLICIES else False:
            params = {**params, "trace": trace}
        policy = make_policy(policy, budget=512 if budget is None else budget, **params)
    elif params:
        raise ValueError("params are only accepted with a policy name")
    budget = policy.budget if budget is None else budget
    A = trace.attention
    T = trace.steps
    topk = trace.topk_mask(top_k)
    mass = np.empty(T, dtype=np.float64)
    recall = np.empty(T, dtype=np.float64)
    kept_hist = np.full((T, budget), -1, dtype=np.int32) if record_kept else None
    keeps_scores = record_scores and getattr(policy, "keeps_scores", False)
    score_hist = np.full((T, budget + 1), np.nan) if keeps_scores else None
    score_pos = np.full((T, budget + 1), -1, dtype=np.int32) if keeps_scores else None
    victims_hist = []
    for t in range(1, T + 1):
        kept = policy.kept
        row = A[t]
        total = kept_sum(row, kept)
        mass[t - 1] = total
        recall[t - 1] = topk[t, kept].sum(dtype=np.int64) / min(top_k, t)
        policy.on_decode_step(t, observed_attention(row, kept, total) if policy.reads_attention else None)
        if keeps_scores:
            s = policy.scores
            score_hist[t - 1, : s.size] = s
            score_pos[t - 1, : s.size] = policy.kept
        before = policy.kept
        victims = policy.evict(budget)
        _check_victims(policy, t, before, victims, budget)
        if record_kept:
            k = policy.kept
            kept_hist[t - 1, : k.size] = k
        if record_victims:
            victims_hist.append(list(victims))
    return ReplayResult(
        policy=policy.name,
        budget=budget,
        params=dict(policy.params),
        steps=T,
        top_k=top_k,
        retained_mass_series=mass,
        top_k_recall_series=recall,
        kept_history=kept_hist,
        score_history=score_hist,
        score_positions=score_pos,
        victims_history=victims_hist,
    )


def _check_victims(policy: Policy, t: int, before: np.ndarray, victims: list[int], budget: int) -> None:
    v = np.asarray(victims, dtype=np.int64)
    if v.size and np.any(np.diff(v) <= 0):
        raise ContractError(f"{policy!r} step {t}: victims {victims} not in ascending order")
    if v.size and not np.all(np.isin(v, before)):
        raise ContractError(f"{policy!r} step {t}: victims {victims} include positions it did not hold")
    after = policy.kept
    expected = min(t + 1, budget)
    if after.size != expected:
        raise ContractError(f"{policy!r} step {t}: holds {after.size} positions after eviction, expected {expected}")
    if after.size + v.size != before.size or np.any(np.isin(v, after)):
        raise ContractError(f"{policy!r} step {t}: victims {victims} are still held or the cache changed otherwise")

"""The replay harness (docs/domain.md, "The harness"): the one loop of the reference path.

For each step t = 1..T: read ``kept``; score it against the full row (retained mass, top-k
recall); show the policy the observed attention, renormalised over the kept set, as float32;
admit position t; evict to budget and check the victims contract.

``step`` is the last three (observe -> admit -> evict, the victims checked): the one step of a policy,
which the deployed cache (``kvsim.hf``) takes too, with the attention a real model computed.
``steps`` is the loop, one ``Step`` per decode step: ``replay_reference`` totals it into a
``ReplayResult`` and the policy lab walks two of them side by side. It is the authority the fast
engine (``kvsim.sim.engine``) is held to bit for bit; callers use ``kvsim.replay``, which picks the
engine where it covers the policy and this loop otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..data import vectors
from ..data.gqa import position_sum, renormalise
from ..data.trace import Trace
from ..policies import Policy, PolicySpec
from ..policykit.base import ContractError
from ..progress import Progress

DEFAULT_TOP_K = 32


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
    #: what was replayed, as one validated value (None when a built policy was handed in: it may be
    #: one the registry does not know); ``policy``, ``budget`` and ``params`` say the same in plain terms
    spec: PolicySpec | None = None
    #: the serving layout it ran under (``kvsim.policykit.layouts``; None: none), and the positions that
    #: layout allocates (the budget in whole blocks); both stated in ``summary`` only when there is one
    layout: object | None = None
    memory: int | None = None

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
            **self.layout_fields(),
        }

    def layout_fields(self) -> dict:
        """The layout's columns of a row (none without a layout, so a bare replay's row is today's)."""
        if self.layout is None or self.layout.plain:
            return {}
        return {"layout": self.layout.label, **self.layout.to_dict(), "memory": self.memory}

    def kept_mask(self) -> np.ndarray:
        """uint8 ``(T, T + 1)``: 1 where position p is held after step t (row t - 1)."""
        if self.kept_history is None:
            raise ValueError("replay was run without record_kept=True")
        return kept_mask_of(self.kept_history)


def kept_mask_of(kept_history: np.ndarray) -> np.ndarray:
    """uint8 ``(T, T + 1)``, 1 where position p is held after step t (row t - 1), from a kept
    history (``(T, budget)``, -1 padded)."""
    kept = np.asarray(kept_history)
    T = kept.shape[0]
    mask = np.zeros((T, T + 1), dtype=np.uint8)
    flat = (np.arange(T, dtype=np.int64)[:, None] * (T + 1) + kept)[kept >= 0]  # row t's cells, -1 left out
    mask.reshape(-1)[flat] = 1
    return mask


def kept_sum(row: np.ndarray, kept: np.ndarray) -> float:
    """``sum(row[kept])`` in float64, added strictly in kept order.

    Sequential on purpose (numpy's own sum is pairwise): a fast engine that loops over the kept
    set reproduces it bit for bit, and with it the observed attention and every later score.
    """
    return float(position_sum(row[kept]))


def top_k_hits(store, t: int, top_k: int, kept: np.ndarray) -> int:
    """How many of row t's ``top_k`` largest weights (``store.topk_row``) sit at positions ``kept`` holds;
    divided by ``min(top_k, t)`` it is the step's top-k recall."""
    return int(store.topk_row(t, top_k)[kept].sum(dtype=np.int64))


def observe(attention: np.ndarray, total: float | None = None) -> np.ndarray:
    """``attention`` (the weights on the held positions, aligned with them) renormalised over them by
    the combining rule's ``renormalise`` (its sum in position order, ``total`` when the caller has it),
    as float32: what the policy is shown."""
    return renormalise(attention, total=position_sum(attention) if total is None else total)[0].astype(np.float32)


@dataclass(frozen=True)
class Taken:
    """What one ``step`` did: what the policy was shown, its scores before eviction (score-keeping
    policies), what it held then (``kept + [t]``), its victims and what it held after."""

    observed: np.ndarray | None
    scores: np.ndarray | None
    before: np.ndarray
    victims: list[int]
    after: np.ndarray


def step(policy: Policy, t: int, attention: np.ndarray | None, budget: int, total: float | None = None,
         vectors: Mapping[str, np.ndarray] | None = None) -> Taken:
    """Observe -> admit -> evict, the one step of a policy (docs/domain.md, "The harness", 3 to 5):
    ``attention`` is query t's weight on each position of ``policy.kept`` (aligned, not yet
    renormalised; None is read only by a policy that reads no attention), shown renormalised as float32
    (``observe``) if the policy reads attention; ``vectors`` is position t's row of each member the
    policy ``reads`` (keys, values, queries, out_norms), handed to ``policy.see`` first; then t is
    admitted and the policy evicts to ``budget``, and its victims are checked (ContractError, naming the
    policy and the step, if they break the contract)."""
    if policy.reads:
        if vectors is None or any(name not in vectors for name in policy.reads):
            raise ValueError(f"{policy.name} reads {', '.join(policy.reads)} at step {t}; they were not handed over")
        policy.see(t, vectors)
    observed = observe(attention, total) if policy.reads_attention else None
    policy.on_decode_step(t, observed)
    before = policy.kept
    scores = policy.scores if policy.keeps_scores else None
    victims = [int(v) for v in policy.evict(budget)]
    after = policy.kept
    _check_victims(policy, t, before, victims, budget, after)
    return Taken(observed, scores, before, victims, after)


@dataclass(frozen=True)
class Step:
    """One decode step of one policy, in the harness's order."""

    t: int
    kept: np.ndarray  # held when query t came: what it attended over
    retained_mass: float  # share of the full row t on ``kept``, added in kept order
    top_k_hits: int  # how many of row t's top k are in ``kept`` (0 when top_k was not asked for)
    observed: np.ndarray | None  # what the policy was shown, aligned with kept (None: not read)
    scores: np.ndarray | None  # its scores after the step, before eviction (score-keeping policies)
    score_positions: np.ndarray | None  # kept + [t], the positions ``scores`` is aligned with
    victims: list[int]
    kept_after: np.ndarray  # held after eviction


def steps(trace: Trace, policy: Policy, budget: int | None = None, *, top_k: int | None = None) -> Iterator[Step]:
    """Step ``policy`` through ``trace``, checking the victims contract after every eviction.
    ``top_k`` counts the hits of each row's k largest weights (lower position first on ties). Rows
    come through ``trace.derived.row``: a query/key trace computes only the kept weights, with the
    engine's arithmetic."""
    budget = policy.budget if budget is None else budget
    store = trace.derived
    out = store.row_scratch()
    scored, reads = policy.keeps_scores, policy.reads_attention
    members = vectors.require(trace, policy.reads, policy.name)
    if members:
        policy.see(0, vectors.at(members, 0))  # position 0, held from the start, was never admitted
    for t in range(1, trace.steps + 1):
        kept = policy.kept
        row = store.row(t, kept, out)  # the whole row of a dense trace; a query/key trace's at kept
        total = kept_sum(row, kept)
        hits = top_k_hits(store, t, top_k, kept) if top_k is not None else 0
        taken = step(policy, t, row[kept] if reads else None, budget, total, vectors.at(members, t) if members else None)
        yield Step(t, kept, total, hits, taken.observed, taken.scores, taken.before if scored else None,
                   taken.victims, taken.after)


def replay_reference(
    trace: Trace,
    policy: Policy,
    budget: int | None = None,
    *,
    top_k: int = DEFAULT_TOP_K,
    record_kept: bool = False,
    record_scores: bool = False,
    record_victims: bool = False,
    progress: Progress | None = None,
    spec: PolicySpec | None = None,
) -> ReplayResult:
    """Replay ``trace`` through a built ``policy`` on the reference path: ``steps``, totalled
    (``spec``: what it was built from, carried by the result)."""
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    budget = policy.budget if budget is None else budget
    T = trace.steps
    mass = np.empty(T, dtype=np.float64)
    recall = np.empty(T, dtype=np.float64)
    kept_hist = np.full((T, budget), -1, dtype=np.int32) if record_kept else None
    keeps_scores = record_scores and policy.keeps_scores
    score_hist = np.full((T, budget + 1), np.nan) if keeps_scores else None
    score_pos = np.full((T, budget + 1), -1, dtype=np.int32) if keeps_scores else None
    victims_hist = []
    every = max(1, T // 16)
    for s in steps(trace, policy, budget, top_k=top_k):
        i = s.t - 1
        mass[i] = s.retained_mass
        recall[i] = s.top_k_hits / min(top_k, s.t)
        if keeps_scores:
            score_hist[i, : s.scores.size] = s.scores
            score_pos[i, : s.scores.size] = s.score_positions
        if record_kept:
            kept_hist[i, : s.kept_after.size] = s.kept_after
        if record_victims:
            victims_hist.append(s.victims)
        if progress is not None and (s.t % every == 0 or s.t == T):
            progress(s.t / T)
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
        spec=spec,
    )


def _holds(arr: np.ndarray, v: list[int]) -> np.ndarray:
    """Whether each of ``v`` is in ``arr``: ``np.isin``, but without its sort for the usual one or
    two victims (a comparison per victim is ~20x cheaper there, and this runs every step)."""
    if len(v) <= 8:
        return np.array([bool((arr == x).any()) for x in v], dtype=bool)
    return np.isin(np.asarray(v, dtype=np.int64), arr)


def _check_victims(policy: Policy, t: int, before: np.ndarray, victims: list[int], budget: int, after: np.ndarray) -> None:
    # victims are Python ints (``step``'s); the checks stay in Python for the usual one or two, where
    # NumPy's array and diff would cost more than the comparisons (the deployed cache runs this per
    # row, KV head and position)
    n = len(victims)
    if n > 1 and any(victims[i + 1] <= victims[i] for i in range(n - 1)):
        raise ContractError(f"{policy!r} step {t}: victims {victims} not in ascending order")
    if n and not _holds(before, victims).all():
        raise ContractError(f"{policy!r} step {t}: victims {victims} include positions it did not hold")
    low, high = policy.held_bounds(t, budget)  # min(t + 1, budget); a layout's range under a serving layout
    if not low <= after.size <= high:
        expected = low if low == high else f"{low} to {high}"
        raise ContractError(f"{policy!r} step {t}: holds {after.size} positions after eviction, expected {expected}")
    if after.size + n != before.size or (n and _holds(after, victims).any()):
        raise ContractError(f"{policy!r} step {t}: victims {victims} are still held or the cache changed otherwise")

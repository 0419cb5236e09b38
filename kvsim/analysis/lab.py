"""The policy lab: two policies stepped side by side over a tiny trace, one step at a time.

A dozen steps is small enough to read every number: each step's attention row, what each policy
held when the query came, what it was shown, its scores or votes, and what it evicted. The
presets are the policy cards' distinguishing vectors and the h2o ``recent_window = 0`` pitfall;
any tiny trace can be typed in as a table (``trace_from_table``) and is validated by
``kvsim.from_array`` like any other trace.

The stepping is the harness's own loop (``kvsim.sim.harness.steps``, with its contract checks), two
policies walked side by side, so what the lab shows is what ``replay`` measures. The lab's figures
are drawn from its steps by ``kvsim.views.lab``; nothing here draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..data.trace import Trace, TraceError, from_array
from ..policies import Policy, PolicySpec
from ..policykit.base import WINDOW
from ..sim.harness import Step, steps

if TYPE_CHECKING:  # pandas is imported where a table is built: the app's default page needs none
    import pandas as pd

#: a lab trace is for reading cell by cell; longer ones belong in the main views
MAX_LAB_STEPS = 24


@dataclass(frozen=True)
class LabPolicy:
    """A policy as the lab's controls name it: a registry name and the parameters set beyond the
    budget. It is not a ``PolicySpec``: the lab's budget is one control shared by both sides, given
    when the lab steps (``spec``), and the label names only the parameters set, as the controls show
    them."""

    name: str
    params: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name} ({args})" if args else self.name

    def spec(self, budget: int) -> PolicySpec:
        """The house's one validated value for this policy at ``budget``; a ``ValueError`` naming the
        side and the parameter when it does not fit."""
        try:
            return PolicySpec.of(self.name, budget, **self.params)
        except ValueError as e:  # say which side refused
            raise ValueError(f"{self.name}: {e}") from None


@dataclass(frozen=True)
class Preset:
    """A named tiny trace with the two policies it was made to tell apart."""

    title: str
    rows: tuple  # row t-1 = attention of the query at position t over positions 0 .. t-1
    budget: int
    left: LabPolicy
    right: LabPolicy
    watch: str  # what to look for, one or two sentences

    def trace(self) -> Trace:
        return trace_from_rows(self.rows, name=self.title)


#: the H2O card's vector: position 0 takes all of step 1 and 0.98 of step 2, then 0.01 of every later row
SPIKE_ROWS = ((1.0,), (0.98, 0.02), *((0.01, *[0.99 / (t - 1)] * (t - 1)) for t in range(3, 13)))


def _recency_rows(steps: int) -> list[list[float]]:
    # every position gets some attention, leaning toward the recent: weight of p in row t ~ p + 1
    return [(np.arange(1, t + 1) / (t * (t + 1) / 2)).tolist() for t in range(1, steps + 1)]


def _sink_rows() -> list[list[float]]:
    # half of every row on position 0 (an attention sink), the rest spread evenly
    return [[1.0]] + [[0.5] + [0.5 / (t - 1)] * (t - 1) for t in range(2, 13)]


def _flicker_rows() -> list[list[float]]:
    # position 1 is central at every step but one (step 6), where the query looks elsewhere
    rows = []
    for t in range(1, 13):
        row = np.full(t, 1.0)
        if t > 1:
            row[1] = 0.05 if t == 6 else 4.0 * t
        rows.append((row / row.sum()).tolist())
    return rows


PRESETS: dict[str, Preset] = {
    "sliding_window vs streaming_llm": Preset(
        title="sliding_window vs streaming_llm: the sinks",
        rows=tuple(map(tuple, _sink_rows())),
        budget=5,
        left=LabPolicy("sliding_window"),
        right=LabPolicy("streaming_llm", {"sinks": 4}),
        watch="The same steps at the same budget: sliding_window evicts positions 0, 1 and 2 in turn "
        "(the oldest, sink included); streaming_llm keeps them pinned and evicts 4 instead.",
    ),
    "h2o vs scissorhands": Preset(
        title="h2o vs scissorhands: a stale early spike",
        rows=SPIKE_ROWS,
        budget=4,
        left=LabPolicy("h2o", {WINDOW: 2}),
        right=LabPolicy("scissorhands", {WINDOW: 2}),
        watch="Position 0 takes almost all of steps 1 and 2 and nearly nothing after. At step 4, the "
        "first eviction, it has h2o's highest score (about 2.0) but a single scissorhands vote: "
        "h2o defends it and evicts 2; scissorhands evicts it.",
    ),
    "h2o recent_window 0 pitfall": Preset(
        title="h2o with recent_window 0: the cache never advances",
        rows=tuple(map(tuple, _recency_rows(12))),
        budget=4,
        left=LabPolicy("h2o", {WINDOW: 0}),
        right=LabPolicy("h2o", {WINDOW: 2}),
        watch="A position admitted this step has score 0 while everything older has gained some "
        "attention, so without a recent window h2o evicts the newest position at once, every "
        "step: it holds 0, 1, 2, 3 forever. With recent_window 2 the cache moves on.",
    ),
    "tova vs h2o": Preset(
        title="tova vs h2o: one quiet step",
        rows=tuple(map(tuple, _flicker_rows())),
        budget=4,
        left=LabPolicy("tova"),
        right=LabPolicy("h2o", {WINDOW: 1}),
        watch="Position 1 is central at every step but step 6. tova reads only the latest row, so "
        "at step 6 it evicts 1; h2o's sum remembers and keeps it for the steps after, which "
        "want it again.",
    ),
}


# --- tiny traces ---------------------------------------------------------------------------------


def trace_from_rows(rows: Sequence[Sequence[float]], name: str = "lab", source: str = "lab trace") -> Trace:
    """A trace whose row t is ``rows[t - 1]`` (t weights, over positions 0 .. t-1), validated and
    normalised by ``from_array``; one-line ``TraceError`` otherwise."""
    T = len(rows)
    if not 1 <= T <= MAX_LAB_STEPS:
        raise TraceError(f"{source}: a lab trace has 1 to {MAX_LAB_STEPS} steps, got {T}")
    A = np.zeros((T + 1, T + 1))
    for t, row in enumerate(rows, start=1):
        if len(row) != t:
            raise TraceError(f"{source}: step {t}: expected {t} weights (positions 0 .. {t - 1}), got {len(row)}")
        A[t, :t] = row
    return from_array(A, name=name, source=source)


def preset_table(trace: Trace) -> pd.DataFrame:
    """A trace as the lab's editable table: one row per step ("step 1" ..), one column per position
    ("0" ..), the attention weights below the diagonal and blanks (NaN) elsewhere."""
    import pandas as pd

    T = trace.steps
    a = trace.attention[1:, :T].astype(np.float64)
    a[np.triu_indices(T, k=1)] = np.nan
    return pd.DataFrame(a, index=[f"step {t}" for t in range(1, T + 1)], columns=[str(p) for p in range(T)])


def trace_from_table(table: pd.DataFrame, name: str = "edited", source: str = "lab table") -> Trace:
    """The inverse of ``preset_table``: read an edited table back into a trace. Cells on or above the
    diagonal are ignored; each row is normalised to sum to 1. One-line ``TraceError`` on a table
    that is not one (a missing column, a non-number, a negative weight, a row of zeros)."""
    import pandas as pd

    T = len(table)
    if not 1 <= T <= MAX_LAB_STEPS:
        raise TraceError(f"{source}: a lab trace has 1 to {MAX_LAB_STEPS} steps, got {T}")
    if table.shape[1] < T:
        raise TraceError(f"{source}: {T} steps need {T} position columns, got {table.shape[1]}")
    rows = []
    for t in range(1, T + 1):
        cells = table.iloc[t - 1, :t]
        values = pd.to_numeric(cells, errors="coerce")
        bad = values.isna() & cells.notna()
        if bad.any():
            raise TraceError(f"{source}: step {t}, position {int(np.flatnonzero(bad.to_numpy())[0])}: not a number")
        if values.isna().any():
            raise TraceError(f"{source}: step {t}, position {int(np.flatnonzero(values.isna().to_numpy())[0])}: empty")
        rows.append(values.to_numpy(dtype=np.float64))
    return trace_from_rows(rows, name=name, source=source)


# --- stepping ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyStep(Step):
    """One policy at one step (the harness's ``Step``), with the label the lab shows it under."""

    label: str = ""

    def state(self, p: int) -> str:
        """What this policy did with position ``p`` at this step: new, evicted at once, victim, held
        or gone (evicted before)."""
        if p == self.t:
            return "evicted at once" if p in self.victims else "new"
        if p in self.victims:
            return "victim"
        if p in self.kept:
            return "held"
        return "gone"


@dataclass(frozen=True)
class LabStep:
    t: int
    row: np.ndarray  # row t of the trace, over positions 0 .. t-1 (float64)
    sides: tuple[PolicyStep, PolicyStep]


def _build(side: LabPolicy | Policy, trace: Trace, budget: int) -> tuple[str, Policy]:
    if isinstance(side, Policy):
        return repr(side), side
    return side.label, side.spec(budget).build(trace)


def side_by_side(trace: Trace, left: LabPolicy | Policy, right: LabPolicy | Policy, budget: int) -> list[LabStep]:
    """Step both policies through ``trace`` together, each through the harness's own loop; one
    ``LabStep`` per decode step. Bad parameters raise ``ValueError`` naming the parameter."""
    (left_label, left_policy), (right_label, right_policy) = _build(left, trace, budget), _build(right, trace, budget)
    walks = zip(steps(trace, left_policy, budget), steps(trace, right_policy, budget), strict=True)
    A = trace.attention
    return [
        LabStep(a.t, A[a.t, : a.t].astype(np.float64),
                (PolicyStep(**vars(a), label=left_label), PolicyStep(**vars(b), label=right_label)))
        for a, b in walks
    ]


def first_divergence(steps: list[LabStep]) -> int:
    """The first step at which the two policies evict differently (the step worth looking at
    first), or 1 if they never do."""
    return next((s.t for s in steps if s.sides[0].victims != s.sides[1].victims), 1)


def run_preset(name: str) -> list[LabStep]:
    p = PRESETS[name]
    return side_by_side(p.trace(), p.left, p.right, p.budget)


def step_table(step: LabStep, side: int | None = None) -> pd.DataFrame:
    """One step as a table, a row per position 0 .. t: the full row's weight, and for each side
    whether the position was held, what the policy was shown, its score, and its fate. With
    ``side`` (0 or 1), that side's columns only, under short headers: narrow enough to sit
    beside the other side's table."""
    import pandas as pd

    t = step.t
    # every cell says something: an empty one read "None" in the app. The new position t has no weight
    # in row t (a query does not attend to itself here); a position not held shows nothing and has no score
    data: dict[str, list] = {"position": list(range(t + 1)), "weight": [*map(_number, step.row.tolist()), NEW_WEIGHT]}
    if side is not None:
        one = step.sides[side]
        full = step_table(step)
        keep = [c for c in full.columns if c.startswith(f"{one.label}: ")]
        return full[["position", "weight", *keep]].rename(columns={c: c.split(": ", 1)[1] for c in keep})
    for each in step.sides:
        seen = {} if each.observed is None else dict(zip(each.kept.tolist(), each.observed.tolist(), strict=True))
        scored = {} if each.scores is None else dict(zip(each.score_positions.tolist(), each.scores.tolist(), strict=True))
        data[f"{each.label}: state"] = [each.state(p) for p in range(t + 1)]
        if each.observed is not None:
            data[f"{each.label}: shown"] = [_number(seen[p]) if p in seen else NOT_HELD for p in range(t + 1)]
        if each.scores is not None:
            data[f"{each.label}: score"] = [_number(scored[p]) if p in scored else NOT_HELD for p in range(t + 1)]
    return pd.DataFrame(data)


#: what the step table says where there is no number: the new position's weight, and the figures of a
#: position the policy does not hold
NEW_WEIGHT = "(the query's own)"
NOT_HELD = "(not held)"


def _number(x: float) -> str:
    """A weight, share or score as the table shows it (one column of text: a blank cell read "None")."""
    return str(int(x)) if float(x).is_integer() else f"{x:.3f}"

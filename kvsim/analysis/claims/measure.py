"""What every claim's check shares: the verdicts and scopes, the tolerances the cards are held to,
``Claim`` (a claim and its check), ``Measurer`` (one trace and the replays the claims need, each run
once) and the small helpers the checks of both cards use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ...data.trace import Trace
from ...policies import make_policy
from ...policykit.base import WINDOW
from ...sim.simulate import sweep
from ..lab import SPIKE_ROWS, trace_from_rows
from ..metrics import describe
from ..windows import WindowChoice, choose_window

VERDICTS = ("holds", "fails", "not applicable", "not measured")
SCOPES = ("canonical", "trace", "policy", "model")
#: the budget the cards measure at
BUDGET = 256
#: the h2o windows the saturation claim sweeps (as the table does)
WINDOWS = tuple(range(8, 193, 8))
#: tolerances the cards' figures are held to (docs/domain.md, "The canonical trace")
FIGURE_TOLERANCE = 0.003
BAND_TOLERANCE = 0.01
#: "looks alike": every policy's retained mass within this of every other's
ALIKE = 0.01


@dataclass(frozen=True)
class Claim:
    id: str
    card: str  # "h2o" or "sliding_window": the card the words come from
    words: str  # the card's words, quoted as written
    scope: str  # one of SCOPES (see the package docstring)
    measurement: str  # what is measured, and the rule that turns it into a verdict
    view: dict  # the app's URL query parameters that show it
    check: Callable[[Measurer], tuple[str, dict, str]] = field(repr=False, compare=False)


class Measurer:
    """One trace and the replays the claims need, each run once (fast engine, same results as the
    reference harness)."""

    def __init__(self, trace: Trace, budget: int = BUDGET):
        self.trace = trace
        self.budget = budget
        self.is_canonical = trace.name == "canonical" and trace.steps == 4096
        self._runs: dict[tuple, dict] = {}
        self._sweep: dict[int, dict] | None = None
        self._describe: dict | None = None
        self._choice: WindowChoice | None = None

    def run(self, policy: str, budget: int | None = None, **params) -> dict:
        budget = self.budget if budget is None else budget
        key = (policy, budget, tuple(sorted(params.items())))
        if key not in self._runs:
            self._runs[key] = sweep(self.trace, policy, budget, None, [None], **params)[0]
        return self._runs[key]

    def h2o_sweep(self) -> dict[int, dict]:
        if self._sweep is None:
            values = [w for w in WINDOWS if w < self.budget]
            rows = sweep(self.trace, "h2o", self.budget, WINDOW, values)
            self._sweep = {r[WINDOW]: r for r in rows}
            for w, r in self._sweep.items():
                self._runs[("h2o", self.budget, ((WINDOW, w),))] = r
        return self._sweep

    def h2o_choice(self) -> WindowChoice | None:
        """h2o's exact best and recommended recent_window (``kvsim.analysis.windows``): every window 1 ..
        budget - 1, not the sampled ``WINDOWS``. None below budget 2."""
        if self._choice is None and self.budget >= 2:
            rows = sweep(self.trace, "h2o", self.budget, WINDOW, list(range(1, self.budget)))
            self._choice = choose_window(rows, budget=self.budget)
        return self._choice

    def describe(self) -> dict:
        if self._describe is None:
            self._describe = describe(self.trace, band=64)
        return self._describe


def rounded(x: float | None) -> float | None:
    """A figure as the ledger shows it: four decimals, None for a missing or non-finite one."""
    return None if x is None or not np.isfinite(x) else round(float(x), 4)


def verdict(ok: bool) -> str:
    return "holds" if ok else "fails"


def canonical_only(m: Measurer, ok: bool, figures: dict, note: str) -> tuple[str, dict, str]:
    """The verdict of a figure the card pins on the canonical trace: decided there, for reference elsewhere."""
    if m.is_canonical:
        return verdict(ok), figures, note
    return ("not applicable", figures,
            f"the card pins this on the canonical trace; on {m.trace.name} the figures are for reference only")


def steps_from(trace: Trace, t0: int) -> np.ndarray:
    return np.arange(max(1, t0), trace.steps + 1)


# --- the small vectors the policy claims run (the cards' own cases) -------------------------------


def spike_trace() -> Trace:
    """The H2O card's vector (the lab's ``SPIKE_ROWS``: position 0 takes the whole of step 1 and
    0.98 of step 2, then 0.01 of every row after) as a 12-step trace."""
    return trace_from_rows(SPIKE_ROWS, name="spike")


def step(policy, t: int, attn=None) -> list[int]:
    """One decode step of a policy driven by hand (the cards' vectors give each step's attention, or
    None), then its eviction to budget: the victims."""
    policy.on_decode_step(t, None if attn is None else np.asarray(attn, dtype=np.float32))
    return policy.evict(policy.budget)


# --- checks both cards share --------------------------------------------------------------------


def check_deterministic(name: str, params: dict):
    def check(m: Measurer):
        tr = spike_trace()
        victims = []
        for seed in (1, 2):
            policy = make_policy(name, budget=4, rng=np.random.default_rng(seed), **params)
            victims.append([step(policy, t, tr.attention[t, policy.kept]) for t in range(1, tr.steps + 1)])
        same = victims[0] == victims[1]
        return verdict(same), {"same_victims_under_two_rngs": same}, "the card's spike vector under two different rngs"
    return check


def check_cost_not_measured(m: Measurer):
    return ("not measured", {},
            "per-step cost against cache size is not timed here: on a shared machine the wall clock of one "
            "step does not separate O(kept) from O(1) at these sizes; `python -m kvsim bench` times whole replays")

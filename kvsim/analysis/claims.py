"""The claims ledger: every checkable claim of the two policy cards, measured on a trace.

Each ``Claim`` quotes the card's words, says how they are checked, and carries the app view (as URL
query parameters) that shows them. ``ledger(trace)`` measures every claim on one trace and returns
one record per claim with a verdict:

- ``holds`` / ``fails``: measured, and the figures say which;
- ``not applicable``: the claim is about something this trace is not (an exact figure of the
  canonical trace, measured on a real one) or about an implementation this project is not; the
  figures are still measured where they can be, and the note says why they do not decide it;
- ``not measured``: checking it needs something this project does not have yet; the note says what.

Scopes: ``canonical`` claims pin a figure of the canonical trace (``not applicable`` elsewhere);
``trace`` claims are structural (sinks matter, h2o against streaming_llm, where the gain saturates)
and are decided on every trace; ``policy`` claims are about a policy's mechanics and are decided on
the card's own small vector (the same on every trace); ``model`` claims need a language model's
output quality, which attention traces do not carry.

``python -m kvsim claims [--trace NAME] [--json]`` prints the ledger; ``ledger_frame`` gives it to
the app as a DataFrame.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..data.trace import Trace, from_array
from ..policies import POLICIES, make_policy
from ..sim.simulate import replay, sweep
from .metrics import describe

if TYPE_CHECKING:  # pandas is imported where a table is built: the app's default page needs none
    import pandas as pd

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
    scope: str  # one of SCOPES (see the module docstring)
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

    def run(self, policy: str, budget: int | None = None, **params) -> dict:
        budget = self.budget if budget is None else budget
        key = (policy, budget, tuple(sorted(params.items())))
        if key not in self._runs:
            self._runs[key] = sweep(self.trace, policy, budget, None, [None], **params)[0]
        return self._runs[key]

    def h2o_sweep(self) -> dict[int, dict]:
        if self._sweep is None:
            values = [w for w in WINDOWS if w < self.budget]
            rows = sweep(self.trace, "h2o", self.budget, "recent_window", values)
            self._sweep = {r["recent_window"]: r for r in rows}
            for w, r in self._sweep.items():
                self._runs[("h2o", self.budget, (("recent_window", w),))] = r
        return self._sweep

    def describe(self) -> dict:
        if self._describe is None:
            self._describe = describe(self.trace, band=64)
        return self._describe


def _r(x: float | None) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), 4)


def _verdict(ok: bool) -> str:
    return "holds" if ok else "fails"


def _canonical_only(m: Measurer, ok: bool, figures: dict, note: str) -> tuple[str, dict, str]:
    if m.is_canonical:
        return _verdict(ok), figures, note
    return ("not applicable", figures,
            f"the card pins this on the canonical trace; on {m.trace.name} the figures are for reference only")


def _steps_from(trace: Trace, t0: int) -> np.ndarray:
    return np.arange(max(1, t0), trace.steps + 1)


# --- the small vectors the policy claims run (the cards' own cases) -------------------------------

#: position 0 takes the whole of step 1 and 0.98 of step 2, then 0.01 of every row after
SPIKE_ROWS = [[1.0], [0.98, 0.02]] + [[0.01] + [0.99 / (t - 1)] * (t - 1) for t in range(3, 13)]


def _rows_trace(rows: list[list[float]], name: str) -> Trace:
    A = np.zeros((len(rows) + 1, len(rows) + 1))
    for t, row in enumerate(rows, start=1):
        A[t, :t] = row
    return from_array(A, name=name)


def _step(policy, t: int, attn=None) -> list[int]:
    policy.on_decode_step(t, None if attn is None else np.asarray(attn, dtype=np.float32))
    return policy.evict(policy.budget)


# --- checks: the H2O card ------------------------------------------------------------------------


def _attention_blind() -> list[str]:
    """Registry policies that do not read attention and are not offline references."""
    return [n for n, cls in POLICIES.items() if not cls.reads_attention and not cls.needs_trace]


def check_h2o_recall_vs_blind(m: Measurer):
    h = m.run("h2o", recent_window=32)
    others = {n: m.run(n)["top_k_recall"] for n in _attention_blind()}
    best = max(others, key=others.get)
    figures = {"h2o_recent_window_32_top_32_recall": _r(h["top_k_recall"]),
               **{f"{n}_top_32_recall": _r(v) for n, v in others.items()}}
    return _verdict(h["top_k_recall"] > others[best]), figures, f"best policy that does not read attention: {best}"


def check_h2o_32_less_mass(m: Measurer):
    h, s = m.run("h2o", recent_window=32), m.run("streaming_llm", sinks=4)
    figures = {"h2o_recent_window_32_retained_mass": _r(h["retained_mass"]),
               "streaming_llm_retained_mass": _r(s["retained_mass"])}
    return _verdict(h["retained_mass"] < s["retained_mass"]), figures, ""


def check_h2o_33_64_lose(m: Measurer):
    """Share of the attention on positions 33..64 steps old that h2o at 32 still holds."""
    trace = m.trace
    res = replay(trace, "h2o", budget=m.budget, recent_window=32, record_kept=True)
    A = trace.attention
    held = total = 0.0
    for t in _steps_from(trace, 65):
        kept = res.kept_history[t - 2]
        kept = kept[(kept >= t - 64) & (kept <= t - 33)]
        total += float(A[t, t - 64 : t - 32].astype(np.float64).sum())
        held += float(A[t, kept].astype(np.float64).sum())
    share = held / total if total > 0 else float("nan")
    figures = {"attention_on_ages_33_64_per_row": _r(total / max(1, trace.steps - 64)),
               "share_of_it_h2o_32_holds": _r(share), "share_streaming_llm_holds": 1.0}
    return _verdict(share < 0.5), figures, "they lose when h2o at 32 holds under half of it (streaming_llm holds all)"


def check_h2o_64_beats(m: Measurer):
    h, s = m.run("h2o", recent_window=64), m.run("streaming_llm", sinks=4)
    figures = {"h2o_recent_window_64_retained_mass": _r(h["retained_mass"]),
               "h2o_recent_window_64_top_32_recall": _r(h["top_k_recall"]),
               "streaming_llm_retained_mass": _r(s["retained_mass"]),
               "streaming_llm_top_32_recall": _r(s["top_k_recall"])}
    ok = h["retained_mass"] > s["retained_mass"] and h["top_k_recall"] > s["top_k_recall"]
    return _verdict(ok), figures, ""


def check_h2o_saturates(m: Measurer):
    mass = {w: r["retained_mass"] for w, r in m.h2o_sweep().items()}
    peak = max(mass, key=mass.get)
    first = min(w for w in mass if mass[w] >= mass[peak] - 0.001)  # where the gain has saturated
    ok = 64 in mass and mass[peak] <= mass[64] + 0.001 and mass[32] < mass[48] < mass[64]
    figures = {"argmax_recent_window": peak, "max_retained_mass": _r(mass[peak]),
               "first_window_within_0.001_of_max": first,
               **{f"retained_mass_at_{w}": _r(mass[w]) for w in (32, 48, 64, 96, 192) if w in mass}}
    return _verdict(ok), figures, "holds when no window beats 64 by more than 0.001 and the mass rises through 32, 48, 64"


def check_band_share(m: Measurer):
    share = m.describe()["recent_share"]
    ok = share is not None and abs(share - 0.55) <= BAND_TOLERANCE
    return _canonical_only(m, ok, {"share_on_newest_64_positions": _r(share)}, f"target 0.55 ± {BAND_TOLERANCE}")


def check_streaming_figure(m: Measurer):
    s = m.run("streaming_llm", sinks=4)["retained_mass"]
    return _canonical_only(m, abs(s - 0.7367) <= FIGURE_TOLERANCE, {"streaming_llm_retained_mass": _r(s)},
                           f"0.7367 ± {FIGURE_TOLERANCE}")


def check_within_hundredth(m: Measurer):
    figures, ok = {}, True
    for w in (32, 64):
        h, s = m.run("h2o", recent_window=w)["retained_mass"], m.run("scissorhands", recent_window=w)["retained_mass"]
        figures[f"h2o_{w}_retained_mass"], figures[f"scissorhands_{w}_retained_mass"] = _r(h), _r(s)
        figures[f"gap_at_{w}"] = _r(abs(h - s))
        ok = ok and abs(h - s) <= 0.01
    if not m.is_canonical:
        return ("not applicable", figures, "the card scopes this to the canonical trace and says other workloads "
                "separate the two rules; the gaps are measured here for reference")
    return _verdict(ok), figures, "within 0.01 at recent_window 32 and 64"


def check_heavy_hitters_epoch(m: Measurer):
    meta = m.trace.meta or {}
    config = meta.get("config") or {}
    if not m.is_canonical or "heavy_hitters" not in meta:
        return "not applicable", {}, f"{m.trace.name} has no generator-declared heavy hitters to follow"
    A, T, epoch = m.trace.attention, m.trace.steps, int(config.get("epoch", 512))
    fair = 1.0 / BUDGET
    live_share, ratios = [], []
    for p in meta["heavy_hitters"]:
        live = np.arange(p + 1, min(p + epoch, T) + 1)
        after = np.arange(p + epoch + 1, min(p + 2 * epoch, T) + 1)
        if live.size < epoch or after.size == 0:
            continue  # its epoch or its stale period runs past the trace's end
        w_live = A[live, p].astype(np.float64)
        live_share.append(float((w_live > fair).mean()))
        ratios.append(float(w_live.mean() / max(A[after, p].astype(np.float64).mean(), 1e-12)))
    figures = {"heavy_hitters_followed": len(live_share),
               "least_share_of_epoch_steps_above_1/256": _r(min(live_share)),
               "least_live_to_stale_weight_ratio": _r(min(ratios))}
    ok = min(live_share) >= 0.95 and min(ratios) >= 10
    return _verdict(ok), figures, "holds when every heavy hitter clears 1/256 on 95% of its 512 steps and weighs 10x less after"


def check_h2o_vector(m: Measurer):
    tr = _rows_trace(SPIKE_ROWS, "spike")
    h = replay(tr, "h2o", budget=4, recent_window=2, record_victims=True, record_kept=True, record_scores=True)
    s = replay(tr, "scissorhands", budget=4, recent_window=2, record_victims=True, record_kept=True, record_scores=True)
    first = int(np.flatnonzero([len(v) > 0 for v in h.victims_history])[0])
    h_scores = dict(zip(h.score_positions[first].tolist(), h.score_history[first].tolist(), strict=True))
    s_votes = dict(zip(s.score_positions[first].tolist(), s.score_history[first].tolist(), strict=True))
    h_scores = {p: v for p, v in h_scores.items() if p >= 0}
    figures = {"first_eviction_step": first + 1, "h2o_victim": h.victims_history[first],
               "scissorhands_victim": s.victims_history[first],
               "h2o_score_of_0": _r(h_scores[0]), "h2o_highest_scored": max(h_scores, key=h_scores.get),
               "scissorhands_votes_of_0": int(s_votes[0]),
               "h2o_holds_0_to_the_end": bool(0 in h.kept_history[-1])}
    ok = (max(h_scores, key=h_scores.get) == 0 and int(s_votes[0]) == 1 and 0 not in h.victims_history[first]
          and s.victims_history[first] == [0] and figures["h2o_holds_0_to_the_end"])
    return _verdict(ok), figures, "run on the card's vector (SPIKE_ROWS, budget 4, recent_window 2), not on the trace"


def check_h2o_ties(m: Measurer):
    h2o = make_policy("h2o", budget=3, recent_window=1)
    victims = [_step(h2o, 1, [1.0]), _step(h2o, 2, [0.75, 0.25]), _step(h2o, 3, [0.75, 0.0, 0.25])]
    several = make_policy("h2o", budget=6, recent_window=1)
    for t, attn in enumerate([[1.0], [0.1, 0.9], [0.1, 0.1, 0.8], [0.5, 0.05, 0.4, 0.05], [0.6, 0.1, 0.1, 0.1, 0.1]], 1):
        several.on_decode_step(t, np.asarray(attn, dtype=np.float32))
    chosen = several.evict(3)
    figures = {"tie_victims": victims, "several_victims": chosen}
    ok = victims == [[], [], [1]] and chosen == [1, 3, 4]  # chosen 4, 3, 1 (lowest score first)
    return _verdict(ok), figures, "positions 1 and 2 tie at 0.25 (exact in binary): 1 goes; victims come back ascending"


def check_h2o_float64(m: Measurer):
    rng = np.random.default_rng(0)
    w = rng.random(4000).astype(np.float32) * np.float32(1e-3)
    h2o = make_policy("h2o", budget=2, recent_window=1)
    _step(h2o, 1, [1.0])  # position 0 now scores 1.0; the small weights then pile onto it
    exact = 1.0
    for t, x in enumerate(w, start=2):
        _step(h2o, t, [float(x), 1.0 - float(x)])
        exact += float(x)  # float64 addition of the float32 weight, as the card prescribes
    single = np.float32(1.0)
    for x in w:
        single = np.float32(single + x)
    score = float(h2o.scores[0])
    figures = {"h2o_score": score, "float64_sum": exact, "float32_sum": float(single),
               "float32_error": float(abs(float(single) - exact))}
    ok = h2o.scores.dtype == np.float64 and score == exact and float(single) != exact
    return _verdict(ok), figures, "4,000 float32 weights added to one score: h2o's equals the float64 sum bit for bit"


def check_h2o_refuses_window(m: Measurer):
    try:
        make_policy("h2o", budget=8, recent_window=8)
    except ValueError as e:
        return _verdict("recent_window" in str(e)), {"error": str(e)}, ""
    return "fails", {"error": None}, "recent_window = budget was accepted"


def check_h2o_window_load_bearing(m: Measurer):
    res = replay(m.trace, "h2o", budget=m.budget, recent_window=0, record_victims=True)
    steps = [t for t in range(m.budget, m.trace.steps + 1) if res.victims_history[t - 1]]
    newest = sum(res.victims_history[t - 1] == [t] for t in steps)
    share = newest / len(steps) if steps else float("nan")
    figures = {"steps_with_an_eviction": len(steps), "share_evicting_the_newest": _r(share),
               "retained_mass_recent_window_0": _r(res.retained_mass)}
    return _verdict(share >= 0.99), figures, "at recent_window 0 the victim is the position admitted that step"


def check_h2o_one_victim(m: Measurer):
    res = replay(m.trace, "h2o", budget=m.budget, recent_window=32, record_victims=True)
    counts = [len(v) for v in res.victims_history[m.budget :]]
    figures = {"steady_state_steps": len(counts), "victims_per_step": sorted(set(counts))}
    return _verdict(set(counts) <= {1}), figures, "steps after the cache first fills"


def check_deterministic(name: str, params: dict):
    def check(m: Measurer):
        tr = _rows_trace(SPIKE_ROWS, "spike")
        victims = []
        for seed in (1, 2):
            policy = make_policy(name, budget=4, rng=np.random.default_rng(seed), **params)
            victims.append([_step(policy, t, tr.attention[t, policy.kept]) for t in range(1, tr.steps + 1)])
        same = victims[0] == victims[1]
        return _verdict(same), {"same_victims_under_two_rngs": same}, "the card's spike vector under two different rngs"
    return check


def check_h2o_null_attn(m: Measurer):
    h2o = make_policy("h2o", budget=8, recent_window=2)
    _step(h2o, 1, [1.0])
    _step(h2o, 2, [0.25, 0.75])
    before = h2o.scores.copy()
    _step(h2o, 3, None)
    after = h2o.scores
    figures = {"scores_before": before.tolist(), "scores_after_none": after.tolist()}
    ok = np.array_equal(after[: before.size], before) and after[-1] == 0.0
    return _verdict(ok), figures, "a None step adds nothing to any score; the new position enters at 0"


def check_h2o_space(m: Measurer):
    policy = make_policy("h2o")
    slots = policy.budget + 1
    ours = sum(a.nbytes for a in (policy._pos, *policy._slot_arrays())) / slots
    figures = {"card_bytes_per_slot": 13, "card_total_bytes": 13 * slots, "kvsim_bytes_per_slot": ours,
               "kvsim_total_bytes": int(ours * slots)}
    return ("not applicable", figures,
            "the byte count is the card's C/TypeScript layout (uint32 position); its arithmetic holds "
            f"(13 x {slots} = {13 * slots} bytes, about 6.7 KB); kvsim is Python only and keeps int64 positions: "
            "O(budget) as claimed, a different constant")


def check_cost_not_measured(m: Measurer):
    return ("not measured", {},
            "per-step cost against cache size is not timed here: on a shared machine the wall clock of one "
            "step does not separate O(kept) from O(1) at these sizes; `python -m kvsim bench` times whole replays")


# --- checks: the sliding-window card ---------------------------------------------------------------


def check_sw_most_mass(m: Measurer):
    sw = m.run("sliding_window")["retained_mass"]
    return _verdict(sw > 0.5), {"sliding_window_retained_mass": _r(sw), "budget": m.budget}, "most = over half"


def check_sw_quarter(m: Measurer):
    budget = max(1, m.trace.steps // 4)
    mass, refused = {}, []
    for n in (n for n, cls in POLICIES.items() if not cls.needs_trace):
        try:
            mass[n] = m.run(n, budget=budget)["retained_mass"]
        except ValueError:  # its default parameters do not fit this budget (recent_window 32 at budget 10)
            refused.append(n)
    spread = max(mass.values()) - min(mass.values())
    figures = {"budget": budget, **{f"{n}_retained_mass": _r(v) for n, v in mass.items()}, "spread": _r(spread)}
    if refused:
        figures["refused_at_this_budget"] = refused
    note = f"alike = every online policy within {ALIKE} of every other"
    if spread > ALIKE and mass.get("sliding_window") == min(mass.values()):
        sinks = float(m.trace.attention[budget + 1 :, :4].astype(np.float64).sum(axis=1).mean()) if m.trace.steps > budget else 0.0
        figures["sink_share_of_rows_past_the_budget"] = _r(sinks)
        note += ("; not reproduced: sliding_window loses the sinks at any budget below the trace length, "
                 "and they hold this share of every later row (docs/domain.md, the canonical trace)")
    return _verdict(spread <= ALIKE), figures, note


def check_sw_figures(m: Measurer):
    sw, sl = m.run("sliding_window")["retained_mass"], m.run("streaming_llm", sinks=4)["retained_mass"]
    ok = abs(sw - 0.5966) <= FIGURE_TOLERANCE and abs(sl - 0.7367) <= FIGURE_TOLERANCE
    return _canonical_only(m, ok, {"sliding_window_retained_mass": _r(sw), "streaming_llm_retained_mass": _r(sl)},
                           f"0.5966 and 0.7367, each ± {FIGURE_TOLERANCE}")


def check_sw_gap_is_sinks(m: Measurer):
    A, T, b = m.trace.attention, m.trace.steps, m.budget
    sw, sl = m.run("sliding_window")["retained_mass"], m.run("streaming_llm", sinks=4)["retained_mass"]
    gap = sl - sw
    if T <= b:
        return "not applicable", {"gap": _r(gap)}, f"the trace has no step past the budget {b}"
    lost = dropped = 0.0
    for t in range(b + 1, T + 1):
        # sliding_window holds positions t-b .. t-1; streaming_llm holds 0..3 and t-b+4 .. t-1
        lost += float(A[t, : min(4, t - b)].astype(np.float64).sum())  # sinks sliding_window no longer holds
        dropped += float(A[t, max(4, t - b) : t - b + 4].astype(np.float64).sum())  # the 4 slots they cost
    lost, dropped = lost / T, dropped / T
    figures = {"gap_streaming_minus_sliding": _r(gap), "sink_mass_sliding_window_loses": _r(lost),
               "mass_of_the_4_slots_streaming_llm_gives_up": _r(dropped)}
    ok = gap > 0 and abs(lost - dropped - gap) <= 1e-4 and dropped <= 0.1 * gap
    return _verdict(ok), figures, "holds when the gap is the sinks' mass, less the 4 slots they cost (under a tenth of it)"


def check_sw_sinks_first(m: Measurer):
    res = replay(m.trace, "sliding_window", budget=m.budget, record_victims=True)
    first = [v for vs in res.victims_history for v in vs][:4]
    return _verdict(first == [0, 1, 2, 3]), {"first_four_victims": first}, ""


def check_sw_streaming_better(m: Measurer):
    budgets = [b for b in (8, 16, 32, 64, 128, 256, 512, 1024, 2048) if b < m.trace.steps]
    sw = sweep(m.trace, "sliding_window", budgets[0], "budget", budgets)
    sl = sweep(m.trace, "streaming_llm", budgets[0], "budget", budgets)
    better = [b for b, x, y in zip(budgets, sw, sl, strict=True) if y["retained_mass"] > x["retained_mass"]]
    worse_recall = [b for b, x, y in zip(budgets, sw, sl, strict=True) if y["top_k_recall"] < x["top_k_recall"]]
    figures = {"budgets": budgets, "streaming_llm_more_mass_at": better, "streaming_llm_lower_recall_at": worse_recall,
               "mass_gap_at_each_budget": [_r(y["retained_mass"] - x["retained_mass"]) for x, y in zip(sw, sl, strict=True)]}
    return _verdict(better == budgets), figures, "holds when streaming_llm retains more mass at every budget"


def check_sw_vector(m: Measurer):
    window = make_policy("sliding_window", budget=5)
    pinned = make_policy("streaming_llm", budget=5, sinks=4)
    wv = [_step(window, t) for t in range(1, 9)]
    pv = [_step(pinned, t) for t in range(1, 9)]
    figures = {"sliding_window_victims": wv, "streaming_llm_victims": pv}
    ok = wv[4:7] == [[0], [1], [2]] and pv[4:7] == [[4], [5], [6]]
    return _verdict(ok), figures, "budget 5, steps 1..8: the cache fills at step 4, then one position goes per step"


def check_sw_budget_one(m: Measurer):
    window = make_policy("sliding_window", budget=1)
    ok = all(_step(window, t) == [t - 1] and window.kept.tolist() == [t] for t in range(1, 12))
    try:
        make_policy("sliding_window", budget=0)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return _verdict(ok and "budget" in refused), {"budget_1_keeps_newest": ok, "budget_0_error": refused}, ""


def check_sw_blind(m: Measurer):
    trace = m.trace
    steps = min(trace.steps, 600)
    a = make_policy("sliding_window", budget=64)
    b = make_policy("sliding_window", budget=64)
    same = True
    for t in range(1, steps + 1):
        va = _step(a, t, trace.attention[t, a.kept])
        vb = _step(b, t, None)
        same = same and va == vb
    return _verdict(same), {"steps": steps, "same_victims_with_and_without_attention": same}, ""


def check_sw_space(m: Measurer):
    policy = make_policy("sliding_window")
    slots = policy.budget + 1
    return ("not applicable", {"card_total_bytes": 4 * slots, "kvsim_total_bytes": int(policy._slots.nbytes)},
            f"the card counts uint32_t in C ({slots} x 4 = {4 * slots} bytes: its arithmetic holds); kvsim is Python "
            "only and keeps int64 positions, budget + 1 of them as the card says")


#: the shipped real-model measurements (``python -m kvsim quality``, see traces/README.md)
QUALITY_RESULTS = Path(__file__).resolve().parents[2] / "traces" / "quality-heapq.json"
#: "sharply": without its sinks the model's perplexity at least doubles against the same cache with them
SHARP_PPL_RATIO = 2.0


def check_deprived(m: Measurer):
    """The real model's loss, closed loop, with every layer's cache held by sliding_window against
    streaming_llm at the same budget: the same ring buffer, with and without the four sinks."""
    try:
        doc = json.loads(QUALITY_RESULTS.read_text())
        rows = [r for r in doc["results"] if r.get("mode") == "closed"]
        by = {r["policy"]: r for r in rows if r["policy"] in ("sliding_window", "streaming_llm")}
        sw, sl = by["sliding_window"], by["streaming_llm"]
    except (OSError, ValueError, KeyError, TypeError):
        return ("not measured", {},
                f"needs the real-model measurements in {QUALITY_RESULTS.name} (python -m kvsim quality heapq "
                "--policies sliding_window,streaming_llm --budget 64 --mode closed --json)")
    ratio = sw["ppl"] / sl["ppl"]
    figures = {"model": sw.get("model"), "text": sw.get("text"), "steps": sw["steps"], "budget": sw["budget"],
               "ppl_full": _r(sw["ppl_full"]), "ppl_streaming_llm": _r(sl["ppl"]), "ppl_sliding_window": _r(sw["ppl"]),
               "ppl_ratio_without_sinks": _r(ratio), "delta_nll_streaming_llm": _r(sl["delta_nll"]),
               "delta_nll_sliding_window": _r(sw["delta_nll"]), "retained_mass_streaming_llm": _r(sl["retained_mass"]),
               "retained_mass_sliding_window": _r(sw["retained_mass"])}
    return (_verdict(ratio >= SHARP_PPL_RATIO), figures,
            f"the same model, text and cache size with and without the 4 sinks; 'sharply' = perplexity at least "
            f"x{SHARP_PPL_RATIO:g}: it is x{ratio:.2f} while retained mass falls only from {sl['retained_mass']:.2f} "
            f"to {sw['retained_mass']:.2f}. Measured once on the model, so the verdict is the same on every trace")


# --- the ledger ------------------------------------------------------------------------------------


def _view(view: str, **params) -> dict:
    out = {"view": view, "trace": "{trace}", "budget": BUDGET}
    out.update({k: (",".join(v) if isinstance(v, (list, tuple)) else v) for k, v in params.items()})
    return out


KEPT, SCORES, CURVE, TRACE, LAB = "Kept positions", "Cumulative scores", "Choosing recent_window", "The trace", "Policy lab"
QUALITY = "Proxy against truth"

CLAIMS: list[Claim] = [
    Claim("h2o-recall-beats-attention-blind", "h2o",
          "On the canonical trace it recovers more of the top-32 attended positions than any policy here that does "
          "not read attention.", "trace",
          "top-32 recall at budget 256: h2o (recent_window 32, the default) against every registry policy that "
          "neither reads attention nor reads the whole trace (sliding_window, streaming_llm)",
          _view(KEPT, policies=["sliding_window", "streaming_llm", "h2o"], recent_window=32), check_h2o_recall_vs_blind),
    Claim("h2o-32-less-mass-than-streaming", "h2o",
          "at the default of 32 on a trace whose recency band is 64 wide, this policy retains less attention mass "
          "than a much simpler one", "trace",
          "retained mass at budget 256: h2o at recent_window 32 against streaming_llm (4 sinks)",
          _view(CURVE, curve_policy="h2o", policies=["streaming_llm", "h2o"], recent_window=32), check_h2o_32_less_mass),
    Claim("h2o-33-to-64-lose", "h2o",
          "At recentWindow = 32, positions that are 33 to 64 steps old are unprotected and must compete on "
          "cumulative score: against attention sinks and against heavy hitters from earlier epochs that have been "
          "accumulating for thousands of steps. They lose.", "trace",
          "of the attention on positions 33..64 steps old (steps t > 64), the share h2o at 32 still holds",
          _view(KEPT, policies=["streaming_llm", "h2o"], recent_window=32), check_h2o_33_64_lose),
    Claim("h2o-64-beats-on-both", "h2o", "At 64 it beats it on both metrics at once.", "trace",
          "retained mass and top-32 recall at budget 256: h2o at recent_window 64 against streaming_llm",
          _view(CURVE, curve_policy="h2o", policies=["streaming_llm", "h2o"], recent_window=64), check_h2o_64_beats),
    Claim("h2o-saturates-at-64", "h2o",
          "The gain saturates at exactly 64, the trace’s span, which is what identifies the window width as the "
          "cause rather than something else.", "trace",
          "h2o's retained mass over recent_window 8..192 (step 8) at budget 256: the argmax, and whether any window "
          "beats 64 by more than 0.001",
          _view(CURVE, curve_policy="h2o", policies=["h2o"], recent_window=64), check_h2o_saturates),
    Claim("h2o-band-holds-0.55", "h2o",
          "The canonical trace puts 0.55 of its attention on the most recent 64 positions.", "canonical",
          "mean share of each row (t > 64) on the newest 64 positions", _view(TRACE), check_band_share),
    Claim("h2o-streaming-0.7367", "h2o", "At 32 this policy retains less mass than streaming-llm’s 0.7367.",
          "canonical", "streaming_llm's retained mass at budget 256 (the comparison itself is h2o-32-less-mass-than-streaming)",
          _view(KEPT, policies=["streaming_llm", "h2o"], recent_window=32), check_streaming_figure),
    Claim("h2o-scissorhands-within-a-hundredth", "h2o",
          "On the canonical trace the two land within a hundredth of each other, because that workload’s heavy "
          "hitters hold their weight for a whole 512-step epoch and so score well under either rule.", "canonical",
          "retained mass at budget 256 of h2o and scissorhands at recent_window 32 and at 64",
          _view(CURVE, curve_policy="scissorhands", policies=["h2o", "scissorhands"], recent_window=32),
          check_within_hundredth),
    Claim("h2o-heavy-hitters-hold-an-epoch", "h2o",
          "that workload’s heavy hitters hold their weight for a whole 512-step epoch", "canonical",
          "each generator-declared heavy hitter: the share of its 512 live steps on which it clears 1/256 of the "
          "row, and its mean weight live against the 512 steps after", _view(TRACE), check_heavy_hitters_epoch),
    Claim("h2o-defends-a-stale-spike", "h2o",
          "a position that takes almost the whole of the first two steps and nearly nothing after has the highest "
          "score of any position here and a single vote there, so this policy defends it and that one evicts it.",
          "policy", "the card's vector at budget 4, recent_window 2: h2o's scores, scissorhands' votes and victims "
          "at the first eviction", {"view": LAB, "lab_preset": "h2o vs scissorhands"}, check_h2o_vector),
    Claim("h2o-ties-lower-position", "h2o",
          "Tie-breaking. Equal scores evict the lower position. Victims are returned in ascending position order, "
          "not in the order they were chosen.", "policy",
          "two positions tied at exactly 0.25 (the lower goes); three victims chosen at once (ascending)",
          {"view": LAB, "lab_preset": "h2o vs scissorhands"}, check_h2o_ties),
    Claim("h2o-float64-scores", "h2o",
          "Scores accumulate in float64 while the weights arrive as float32. Four thousand float32 additions would "
          "lose low-order bits that the eviction comparison then depends on.", "policy",
          "4,000 float32 weights added to one position's score, against the float64 and the float32 sums",
          _view(SCORES, policies=["h2o"], recent_window=32), check_h2o_float64),
    Claim("h2o-refuses-window-at-budget", "h2o", "recentWindow >= budget is refused", "policy",
          "make_policy('h2o', budget=8, recent_window=8) raises ValueError naming recent_window",
          {"view": LAB}, check_h2o_refuses_window),
    Claim("h2o-recent-window-load-bearing", "h2o",
          "A token generated this step has accumulated nothing, so without protection it would be the first thing "
          "evicted every time and the cache would never advance.", "trace",
          "h2o at recent_window 0, budget 256: the share of eviction steps whose victim is the newest position",
          {"view": LAB, "lab_preset": "h2o recent_window 0 pitfall"}, check_h2o_window_load_bearing),
    Claim("h2o-one-victim-per-step", "h2o", "in steady state exactly one position goes per step", "trace",
          "victims per step of h2o (recent_window 32, budget 256) after the cache first fills",
          _view(KEPT, policies=["h2o"], recent_window=32), check_h2o_one_victim),
    Claim("h2o-deterministic", "h2o", "The Rng is accepted at construction and never used: this policy is entirely "
          "deterministic.", "policy", "the same steps under two different rngs give the same victims",
          {"view": LAB}, check_deterministic("h2o", {"recent_window": 2})),
    Claim("h2o-null-attention", "h2o",
          "A null attn is read as “no information this step” and leaves every score unchanged, rather than as a "
          "vector of zeroes.", "policy", "scores before and after a step with attn=None",
          {"view": LAB}, check_h2o_null_attn),
    Claim("h2o-space", "h2o", "O(budget) space: per slot, 4 bytes of position, 8 of score and 1 of eviction scratch, "
          "so about 6.7 KB at the default budget.", "policy",
          "the card's arithmetic, and the bytes kvsim's h2o actually allocates per slot", {"view": LAB}, check_h2o_space),
    Claim("h2o-cost-per-step", "h2o", "The per-step cost is O(kept), against O(1) for streaming-llm", "policy",
          "not timed (see the note)", {"view": LAB}, check_cost_not_measured),
    Claim("sw-retains-most-mass", "sliding_window",
          "So keeping only recent tokens still retains most of the attention mass.", "trace",
          "sliding_window's retained mass at budget 256; most = over half",
          _view(KEPT, policies=["sliding_window"]), check_sw_most_mass),
    Claim("sw-quarter-looks-alike", "sliding_window",
          "At a budget of a quarter of the sequence, every policy in this domain looks alike.", "trace",
          "retained mass of every online registry policy (defaults) at budget T/4; alike = all within 0.01",
          {"view": KEPT, "trace": "{trace}", "budget": "{quarter}",
           "policies": ",".join(n for n, c in POLICIES.items() if not c.needs_trace)}, check_sw_quarter),
    Claim("sw-0.7367-against-0.5966", "sliding_window",
          "On the canonical trace at a budget of 256 it retains 0.7367 of the attention mass against this "
          "policy’s 0.5966", "canonical", "retained mass at budget 256 of streaming_llm and sliding_window",
          _view(KEPT, policies=["sliding_window", "streaming_llm"]), check_sw_figures),
    Claim("sw-gap-is-the-sinks", "sliding_window",
          "the entire gap being the attention sinks this policy throws away first.", "trace",
          "streaming_llm minus sliding_window at budget 256, against the sinks' mass sliding_window loses and the "
          "mass of the 4 slots the sinks cost streaming_llm",
          _view(KEPT, policies=["sliding_window", "streaming_llm"]), check_sw_gap_is_sinks),
    Claim("sw-evicts-sinks-first", "sliding_window",
          "This policy evicts them before anything else, purely because they are the oldest thing it holds", "trace",
          "the first four victims of sliding_window at budget 256", _view(KEPT, policies=["sliding_window"]),
          check_sw_sinks_first),
    Claim("sw-streaming-strictly-better", "sliding_window",
          "streaming-llm is the same ring buffer plus four pinned positions and is strictly better.", "trace",
          "retained mass of both at budgets 8..2048 (powers of two below T); recall reported alongside",
          _view(CURVE, policies=["sliding_window", "streaming_llm"]), check_sw_streaming_better),
    Claim("sw-deprived-degrades-sharply", "sliding_window",
          "a model deprived of them degrades sharply rather than gracefully.", "model",
          "Gemma-3-270M's perplexity on heapq.py, closed-loop decoding, every layer's cache held to the budget by "
          "sliding_window and by streaming_llm (shipped measurements, traces/quality-heapq.json)",
          _view(QUALITY, budget=64),
          check_deprived),
    Claim("sw-distinguishing-vector", "sliding_window",
          "this one evicts positions 0, 1 and 2 in turn, and that one keeps them and evicts 4 instead.", "policy",
          "the card's vector: budget 5, steps 1..8, both policies", {"view": LAB,
                                                                      "lab_preset": "sliding_window vs streaming_llm"},
          check_sw_vector),
    Claim("sw-budget-one", "sliding_window",
          "A budget of 1 is legitimate, keeping only the newest token, and a vector covers it. Zero is refused",
          "policy", "budget 1 over 11 steps; budget 0 raises ValueError naming budget", {"view": LAB},
          check_sw_budget_one),
    Claim("sw-never-reads-attention", "sliding_window",
          "Some serving stacks do not expose them per step, and this policy needs nothing but the position.", "trace",
          "the first 600 steps of the trace at budget 64, with the trace's attention and with None: same victims",
          _view(KEPT, policies=["sliding_window"]), check_sw_blind),
    Claim("sw-space", "sliding_window", "O(budget) space: budget + 1 positions of uint32_t in C, so 2,052 bytes at "
          "the default plus the struct.", "policy", "the card's arithmetic, and the bytes kvsim's ring allocates",
          {"view": LAB}, check_sw_space),
    Claim("sw-cost-per-step", "sliding_window", "O(1) time per decode step and per eviction.", "policy",
          "not timed (see the note)", {"view": LAB}, check_cost_not_measured),
]


def ledger(trace: Trace, budget: int = BUDGET) -> list[dict]:
    """Every claim measured on ``trace``: one JSON-ready record per claim, in ``CLAIMS`` order."""
    m = Measurer(trace, budget)
    out = []
    for claim in CLAIMS:
        if claim.scope == "trace" and trace.steps <= budget and claim.id != "sw-quarter-looks-alike":
            verdict, figures, note = "not applicable", {}, f"the trace has {trace.steps} steps: at budget {budget} nothing is evicted"
        else:
            verdict, figures, note = claim.check(m)
        assert verdict in VERDICTS, (claim.id, verdict)
        view = {k: str(v).format(trace=trace.name, quarter=max(1, trace.steps // 4)) for k, v in claim.view.items()}
        out.append({"id": claim.id, "card": claim.card, "words": claim.words, "scope": claim.scope,
                    "measurement": claim.measurement, "trace": trace.name, "verdict": verdict,
                    "figures": figures, "note": note, "view": view})
    return out


def ledger_frame(records: list[dict]) -> pd.DataFrame:
    """The ledger as a table for the app: one row per (claim, trace), the figures as ``k=v`` text."""
    import pandas as pd

    rows = [{"id": r["id"], "card": r["card"], "trace": r["trace"], "verdict": r["verdict"], "scope": r["scope"],
             "words": r["words"], "measured": _figures_text(r["figures"]), "note": r["note"],
             "measurement": r["measurement"], "view": r["view"]} for r in records]
    return pd.DataFrame(rows, columns=["id", "card", "trace", "verdict", "scope", "words", "measured", "note",
                                       "measurement", "view"])


def _figures_text(figures: dict) -> str:
    return "; ".join(f"{k}={v}" for k, v in figures.items())


def render_ledger(records: list[dict]) -> str:
    """The ledger as text: per trace, one line per claim (verdict and figures), then the cards' words
    and the notes, so the table stays readable and nothing is cut."""
    parts = []
    for trace in dict.fromkeys(r["trace"] for r in records):
        rows = [r for r in records if r["trace"] == trace]
        counts = ", ".join(f"{sum(r['verdict'] == v for r in rows)} {v}" for v in VERDICTS)
        parts.append(f"Claims of the two cards on the {trace} trace ({counts}):\n")
        width = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in ("id", "card", "scope", "verdict")}
        head = "  ".join(k.ljust(width[k]) for k in width) + "  measured"
        parts.append(head)
        parts.append("  ".join("-" * width[k] for k in width) + "  " + "-" * 8)
        for r in rows:
            parts.append(("  ".join(str(r[k]).ljust(width[k]) for k in width) + "  " + _figures_text(r["figures"])).rstrip())
        parts.append("")
        for r in rows:
            parts.append(f"{r['id']} ({r['card']} card): \"{r['words']}\"")
            parts.append(f"    measured: {r['measurement']}")
            if r["note"]:
                parts.append(f"    note: {r['note']}")
        parts.append("")
    return "\n".join(parts).rstrip()

"""The checks of the sliding-window card's claims: each takes a ``Measurer`` and returns (verdict,
figures, note)."""

from __future__ import annotations

import json

import numpy as np

from ...data.catalog import TRACES_DIR
from ...policies import POLICIES, make_policy
from ...policykit import registry
from ...sim.simulate import replay, sweep
from .measure import ALIKE, FIGURE_TOLERANCE, Measurer, canonical_only, rounded, step, verdict


def check_sw_most_mass(m: Measurer):
    sw = m.run("sliding_window")["retained_mass"]
    return verdict(sw > 0.5), {"sliding_window_retained_mass": rounded(sw), "budget": m.budget}, "most = over half"


def check_sw_quarter(m: Measurer):
    budget = max(1, m.trace.steps // 4)
    mass, refused = {}, []
    # the cards' domain: the online policies that evict by attention (the scorers beyond it: docs/scorers.md)
    for n in (n for n in registry.online() if not POLICIES[n].reads):
        try:
            mass[n] = m.run(n, budget=budget)["retained_mass"]
        except ValueError:  # its default parameters do not fit this budget (recent_window 32 at budget 10)
            refused.append(n)
    spread = max(mass.values()) - min(mass.values())
    figures = {"budget": budget, **{f"{n}_retained_mass": rounded(v) for n, v in mass.items()}, "spread": rounded(spread)}
    if refused:
        figures["refused_at_this_budget"] = refused
    note = f"alike = every online policy within {ALIKE} of every other"
    if spread > ALIKE and mass.get("sliding_window") == min(mass.values()):
        sinks = float(m.trace.attention[budget + 1 :, :4].astype(np.float64).sum(axis=1).mean()) if m.trace.steps > budget else 0.0
        figures["sink_share_of_rows_past_the_budget"] = rounded(sinks)
        note += ("; not reproduced: sliding_window loses the sinks at any budget below the trace length, "
                 "and they hold this share of every later row (docs/domain.md, the canonical trace)")
    return verdict(spread <= ALIKE), figures, note


def check_sw_figures(m: Measurer):
    sw, sl = m.run("sliding_window")["retained_mass"], m.run("streaming_llm", sinks=4)["retained_mass"]
    ok = abs(sw - 0.5966) <= FIGURE_TOLERANCE and abs(sl - 0.7367) <= FIGURE_TOLERANCE
    return canonical_only(m, ok, {"sliding_window_retained_mass": rounded(sw), "streaming_llm_retained_mass": rounded(sl)},
                           f"0.5966 and 0.7367, each ± {FIGURE_TOLERANCE}")


def check_sw_gap_is_sinks(m: Measurer):
    A, T, b = m.trace.attention, m.trace.steps, m.budget
    sw, sl = m.run("sliding_window")["retained_mass"], m.run("streaming_llm", sinks=4)["retained_mass"]
    gap = sl - sw
    if T <= b:
        return "not applicable", {"gap": rounded(gap)}, f"the trace has no step past the budget {b}"
    lost = dropped = 0.0
    for t in range(b + 1, T + 1):
        # sliding_window holds positions t-b .. t-1; streaming_llm holds 0..3 and t-b+4 .. t-1
        lost += float(A[t, : min(4, t - b)].astype(np.float64).sum())  # sinks sliding_window no longer holds
        dropped += float(A[t, max(4, t - b) : t - b + 4].astype(np.float64).sum())  # the 4 slots they cost
    lost, dropped = lost / T, dropped / T
    figures = {"gap_streaming_minus_sliding": rounded(gap), "sink_mass_sliding_window_loses": rounded(lost),
               "mass_of_the_4_slots_streaming_llm_gives_up": rounded(dropped)}
    ok = gap > 0 and abs(lost - dropped - gap) <= 1e-4 and dropped <= 0.1 * gap
    return verdict(ok), figures, "holds when the gap is the sinks' mass, less the 4 slots they cost (under a tenth of it)"


def check_sw_sinks_first(m: Measurer):
    res = replay(m.trace, "sliding_window", budget=m.budget, record_victims=True)
    first = [v for vs in res.victims_history for v in vs][:4]
    return verdict(first == [0, 1, 2, 3]), {"first_four_victims": first}, ""


def check_sw_streaming_better(m: Measurer):
    budgets = [b for b in (8, 16, 32, 64, 128, 256, 512, 1024, 2048) if b < m.trace.steps]
    sw = sweep(m.trace, "sliding_window", budgets[0], "budget", budgets)
    sl = sweep(m.trace, "streaming_llm", budgets[0], "budget", budgets)
    better = [b for b, x, y in zip(budgets, sw, sl, strict=True) if y["retained_mass"] > x["retained_mass"]]
    worse_recall = [b for b, x, y in zip(budgets, sw, sl, strict=True) if y["top_k_recall"] < x["top_k_recall"]]
    figures = {"budgets": budgets, "streaming_llm_more_mass_at": better, "streaming_llm_lower_recall_at": worse_recall,
               "mass_gap_at_each_budget": [rounded(y["retained_mass"] - x["retained_mass"]) for x, y in zip(sw, sl, strict=True)]}
    return verdict(better == budgets), figures, "holds when streaming_llm retains more mass at every budget"


def check_sw_vector(m: Measurer):
    window = make_policy("sliding_window", budget=5)
    pinned = make_policy("streaming_llm", budget=5, sinks=4)
    wv = [step(window, t) for t in range(1, 9)]
    pv = [step(pinned, t) for t in range(1, 9)]
    figures = {"sliding_window_victims": wv, "streaming_llm_victims": pv}
    ok = wv[4:7] == [[0], [1], [2]] and pv[4:7] == [[4], [5], [6]]
    return verdict(ok), figures, "budget 5, steps 1..8: the cache fills at step 4, then one position goes per step"


def check_sw_budget_one(m: Measurer):
    window = make_policy("sliding_window", budget=1)
    ok = all(step(window, t) == [t - 1] and window.kept.tolist() == [t] for t in range(1, 12))
    try:
        make_policy("sliding_window", budget=0)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return verdict(ok and "budget" in refused), {"budget_1_keeps_newest": ok, "budget_0_error": refused}, ""


def check_sw_blind(m: Measurer):
    trace = m.trace
    steps = min(trace.steps, 600)
    a = make_policy("sliding_window", budget=64)
    b = make_policy("sliding_window", budget=64)
    same = True
    for t in range(1, steps + 1):
        va = step(a, t, trace.attention[t, a.kept])
        vb = step(b, t, None)
        same = same and va == vb
    return verdict(same), {"steps": steps, "same_victims_with_and_without_attention": same}, ""


def check_sw_space(m: Measurer):
    policy = make_policy("sliding_window")
    slots = policy.budget + 1
    return ("not applicable", {"card_total_bytes": 4 * slots, "kvsim_total_bytes": int(policy._slots.nbytes)},
            f"the card counts uint32_t in C ({slots} x 4 = {4 * slots} bytes: its arithmetic holds); kvsim is Python "
            "only and keeps int64 positions, budget + 1 of them as the card says")


#: the shipped real-model measurements (``python -m kvsim quality``, see traces/README.md)
QUALITY_RESULTS = TRACES_DIR / "quality-heapq.json"
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
               "ppl_full": rounded(sw["ppl_full"]), "ppl_streaming_llm": rounded(sl["ppl"]), "ppl_sliding_window": rounded(sw["ppl"]),
               "ppl_ratio_without_sinks": rounded(ratio), "delta_nll_streaming_llm": rounded(sl["delta_nll"]),
               "delta_nll_sliding_window": rounded(sw["delta_nll"]), "retained_mass_streaming_llm": rounded(sl["retained_mass"]),
               "retained_mass_sliding_window": rounded(sw["retained_mass"])}
    return (verdict(ratio >= SHARP_PPL_RATIO), figures,
            f"the same model, text and cache size with and without the 4 sinks; 'sharply' = perplexity at least "
            f"x{SHARP_PPL_RATIO:g}: it is x{ratio:.2f} while retained mass falls only from {sl['retained_mass']:.2f} "
            f"to {sw['retained_mass']:.2f}. Measured once on the model, so the verdict is the same on every trace")

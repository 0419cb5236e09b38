"""The policy cards' comparison table (the one the H2O card introduces with "Measured at budget 256:")
and the calibration targets of docs/domain.md, "The canonical trace", measured. ``python -m kvsim table`` prints it.

The rows come from the registry (``table_rows``): each policy at the configurations it declares. A row
that is not a registry policy (an upper bound computed from the trace alone) gives ``measure``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..data import vectors
from ..data.trace import Trace
from ..policies import POLICIES
from ..policykit.base import WINDOW
from ..policykit.registry import offline, online, reads_meta
from ..policykit.upper_bound import upper_bound_summary
from ..sim.harness import DEFAULT_TOP_K
from .metrics import describe
from .windows import best_row, choose_window

TABLE_BUDGET = 256


@dataclass(frozen=True)
class Row:
    policy: str  # registry name, or the row's name when ``measure`` is given
    params: dict = field(default_factory=dict)  # the policy's parameters beyond budget
    #: for rows that are not registry policies: (trace, budget, top_k) -> {"retained_mass", "top_k_recall"}
    measure: Callable[[Trace, int, int], dict] | None = None


def table_rows() -> list[Row]:
    """Every registry policy at the configurations it declares (``table_rows``), in the registry's order,
    the offline references after the online ones (they read the whole trace, future rows included, which no
    serving stack can), and the upper bound, computed from the trace alone. A policy saved in
    kvsim/policies/ or loaded as a plugin is a row with nothing edited here."""
    rows = [Row(name, dict(params)) for name in online() for params in POLICIES[name].table_rows]
    rows += [Row(f"{name} (offline reference)", measure=lambda trace, budget, top_k, name=name: _offline(trace, name, budget, top_k))
             for name in offline()]
    return [*rows, Row("upper bound (offline reference)", measure=upper_bound_summary)]


def _offline(trace: Trace, name: str, budget: int, top_k: int) -> dict:
    """An offline reference as a table row: a replay that hands it the trace."""
    from ..sim.simulate import replay

    return replay(trace, name, budget=budget, top_k=top_k).summary()


#: the second part: h2o's retained mass over recent_window 8 .. 192 (docs/domain.md, "The canonical trace", last target)
SWEEP_POLICY = "h2o"
SWEEP_VALUES = range(8, 193, 8)


def params_label(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "-"


def build_table(trace: Trace, budget: int = TABLE_BUDGET, top_k: int = DEFAULT_TOP_K, targets: bool | None = None,
                layout=None) -> dict:
    """Measure every row of ``table_rows()``, the h2o sweep and (on the canonical trace at budget 256, or when
    ``targets`` is True) the eight calibration targets. A JSON-ready dict.

    ``layout`` (``kvsim.policykit.layouts.Layout``, not ``Layout()``): every row under that serving layout
    instead (``layout_table``)."""
    if layout is not None and not layout.plain:
        return layout_table(trace, budget, top_k, layout)
    # the engine loads with the first measurement, not with this module (the CLI's --help reads TABLE_BUDGET)
    from ..sim.simulate import replay, sweep

    measured: dict[tuple, dict] = {}

    def key(policy: str, params: dict) -> tuple:
        return (policy, tuple(sorted(params.items())))

    values = [v for v in SWEEP_VALUES if v < budget]  # recent_window >= budget is refused
    sweep_rows = sweep(trace, SWEEP_POLICY, budget, WINDOW, values, top_k=top_k) if values else []
    for r in sweep_rows:  # the h2o rows of the first part are in the sweep: measure them once
        measured[key(SWEEP_POLICY, {WINDOW: r[WINDOW]})] = r

    def measure(row: Row) -> dict:
        k = key(row.policy, row.params)
        if k not in measured:
            if row.measure is not None:
                measured[k] = dict(row.measure(trace, budget, top_k))
            else:  # the engine where it covers the policy (same bits), the reference harness otherwise
                measured[k] = replay(trace, row.policy, budget=budget, top_k=top_k, **row.params).summary()
        return measured[k]

    rows = []
    for row in table_rows():
        entry = {"policy": row.policy, "params": dict(row.params)}
        cls = POLICIES.get(row.policy)
        lacking = vectors.missing(trace, cls.reads, reads_meta(cls.name)) if cls is not None else []
        if lacking:  # a scorer that reads what this trace was recorded without: said, not measured
            rows.append({**entry, "retained_mass": None, "top_k_recall": None,
                         "absent": f"it reads {', '.join(lacking)}, which this trace does not hold"})
            continue
        try:
            m = measure(row)
        except ValueError as e:  # a row this budget cannot hold (recent_window 64 at budget 64): say why
            rows.append({**entry, "retained_mass": None, "top_k_recall": None, "refused": " ".join(str(e).split())})
            continue
        rows.append({**entry, "retained_mass": m["retained_mass"], "top_k_recall": m["top_k_recall"]})
    _gap_shares(rows)
    top = best_row(sweep_rows) if sweep_rows else None
    out = {
        "trace": trace.name,
        "steps": trace.steps,
        "budget": budget,
        "top_k": top_k,
        "rows": rows,
        "sweep": {
            "policy": SWEEP_POLICY,
            "param": WINDOW,
            "rows": [
                {WINDOW: r[WINDOW], "retained_mass": r["retained_mass"], "top_k_recall": r["top_k_recall"]}
                for r in sweep_rows
            ],
            "argmax": top[WINDOW] if top else None,
            "max_retained_mass": top["retained_mass"] if top else None,
        },
        "targets": None,
    }
    if targets is None:
        targets = trace.name == "canonical" and trace.steps == 4096 and budget == TABLE_BUDGET
    if targets:
        out["targets"] = calibration_targets(trace, budget, top_k, lambda p, params: measure(Row(p, params)), sweep_rows)
    out["window"] = best_window(trace, budget, top_k)
    return out


#: the row of the unconstrained optimum beside a layout's rows
UNCONSTRAINED = "optimal, no layout (offline reference)"


def layout_table(trace: Trace, budget: int, top_k: int, layout) -> dict:
    """Every online policy's rows under ``layout`` (reference replays), the offline references it takes
    (``optimal`` with blocks alone: the optimum under blocks) and, beside them, the unconstrained optimum at
    the same budget: its gap to the optimum under blocks is what the page layout itself costs. A row the layout
    refuses says why (``refused``). No sweep, no calibration targets (they are today's, without a layout)."""
    from ..sim.simulate import replay

    rows = []
    for row in table_rows():
        entry = {"policy": row.policy, "params": dict(row.params), "layout": layout.label}
        name = row.policy.removesuffix(" (offline reference)")
        cls = POLICIES.get(name)
        if cls is None:  # the upper bound: from the trace alone, whatever the layout
            m = row.measure(trace, budget, top_k)
            rows.append({**entry, "layout": "-", "retained_mass": m["retained_mass"], "top_k_recall": m["top_k_recall"]})
            continue
        lacking = vectors.missing(trace, cls.reads, reads_meta(cls.name))
        if lacking:
            rows.append({**entry, "retained_mass": None, "top_k_recall": None,
                         "absent": f"it reads {', '.join(lacking)}, which this trace does not hold"})
            continue
        try:  # replay checks the layout first (kvsim.sim.layered.replay_layout): a refusal is this row's
            m = replay(trace, name, budget=budget, top_k=top_k, layout=layout, **row.params).summary()
        except ValueError as e:
            rows.append({**entry, "retained_mass": None, "top_k_recall": None, "refused": " ".join(str(e).split())})
            continue
        rows.append({**entry, "retained_mass": m["retained_mass"], "top_k_recall": m["top_k_recall"]})
    free = replay(trace, "optimal", budget=budget, top_k=top_k).summary()
    rows.append({"policy": UNCONSTRAINED, "params": {}, "layout": "-", "retained_mass": free["retained_mass"],
                 "top_k_recall": free["top_k_recall"]})
    _gap_shares(rows)
    memory, note = layout.memory(budget)
    return {"trace": trace.name, "steps": trace.steps, "budget": budget, "top_k": top_k, "rows": rows,
            "layout": {**layout.to_dict(), "label": layout.label, "memory": memory, "note": note},
            "sweep": {"policy": SWEEP_POLICY, "param": WINDOW, "rows": [], "argmax": None, "max_retained_mass": None},
            "targets": None, "window": None}


def _gap_shares(rows: list[dict]) -> None:
    """Each measured row's ``gap_share``: its share of the way from sliding_window's retained mass to the
    exact optimum's, (mass - sliding) / (optimal - sliding); 0 is no better than keeping the latest
    positions, 1 is the optimum, below 0 worse than the window. None where either end is missing (the
    optimum refused at this budget) or the two coincide (nothing to gain)."""
    by = {r["policy"]: r["retained_mass"] for r in rows if not r["params"]}
    low, high = by.get("sliding_window"), by.get("optimal (offline reference)")
    for r in rows:
        m = r["retained_mass"]
        r["gap_share"] = (m - low) / (high - low) if None not in (m, low, high) and high > low else None


def best_window(trace: Trace, budget: int, top_k: int = DEFAULT_TOP_K) -> dict | None:
    """h2o's exact best and recommended recent_window (``kvsim.analysis.windows``): every window 1 ..
    budget - 1 replayed, unlike the sweep above (8 .. 192 step 8, the calibration target's, whose
    ``argmax`` is the largest of those sampled windows only). None below budget 2 (no window fits)."""
    if budget < 2:
        return None
    from ..sim.simulate import sweep

    rows = sweep(trace, SWEEP_POLICY, budget, WINDOW, list(range(1, budget)), top_k=top_k)
    return {"policy": SWEEP_POLICY, "param": WINDOW, "windows": [1, budget - 1],
            **choose_window(rows, budget=budget).to_dict()}


def calibration_targets(
    trace: Trace, budget: int, top_k: int, measure: Callable[[str, dict], dict], sweep_rows: list[dict]
) -> list[dict]:
    """docs/domain.md, "The canonical trace", each target with its measured value and whether it holds."""
    recent = describe(trace, band=64)["recent_share"]
    sw = measure("sliding_window", {})
    sl = measure("streaming_llm", {"sinks": 4})
    h32 = measure("h2o", {WINDOW: 32})
    h64 = measure("h2o", {WINDOW: 64})
    s32 = measure("scissorhands", {WINDOW: 32})
    s64 = measure("scissorhands", {WINDOW: 64})
    mass = {r[WINDOW]: r["retained_mass"] for r in sweep_rows}
    at = [mass.get(v) for v in (32, 48, 64)]
    peak = max(mass, key=mass.get) if mass else None  # first maximum: the smallest window on ties
    peak_ok = 64 in mass and max(mass.values()) <= mass[64] + 0.001
    rising = None not in at and at[0] < at[1] < at[2]
    targets = [
        ("mean share of attention on the most recent 64 positions (steps t > 64)", "0.55 ± 0.01",
         _fmt(recent), recent is not None and abs(recent - 0.55) <= 0.01),
        ("sliding_window retained mass", "0.5966 ± 0.003",
         _fmt(sw["retained_mass"]), abs(sw["retained_mass"] - 0.5966) <= 0.003),
        ("streaming_llm (4 sinks) retained mass", "0.7367 ± 0.003",
         _fmt(sl["retained_mass"]), abs(sl["retained_mass"] - 0.7367) <= 0.003),
        ("h2o, recent_window 32, retained mass", "below streaming_llm's",
         f"{_fmt(h32['retained_mass'])} vs {_fmt(sl['retained_mass'])}", h32["retained_mass"] < sl["retained_mass"]),
        (f"h2o, recent_window 64, retained mass and top-{top_k} recall", "both above streaming_llm's",
         f"mass {_fmt(h64['retained_mass'])} vs {_fmt(sl['retained_mass'])}, "
         f"recall {_fmt(h64['top_k_recall'])} vs {_fmt(sl['top_k_recall'])}",
         h64["retained_mass"] > sl["retained_mass"] and h64["top_k_recall"] > sl["top_k_recall"]),
        ("h2o retained mass over recent_window 8 .. 192",
         "largest at 64 (none higher by more than 0.001); rising through 32, 48, 64",
         f"argmax {peak}; at 32, 48, 64: {', '.join(_fmt(m) for m in at)}", bool(peak_ok and rising)),
        (f"h2o, recent_window 32, top-{top_k} recall", "above streaming_llm's (while its mass stays below: row 4)",
         f"{_fmt(h32['top_k_recall'])} vs {_fmt(sl['top_k_recall'])}",
         h32["top_k_recall"] > sl["top_k_recall"] and h32["retained_mass"] < sl["retained_mass"]),
        ("scissorhands retained mass, recent_window 32 and 64", "within 0.01 of h2o's at the same recent_window",
         f"32: {_fmt(s32['retained_mass'])} vs {_fmt(h32['retained_mass'])}; "
         f"64: {_fmt(s64['retained_mass'])} vs {_fmt(h64['retained_mass'])}",
         abs(s32["retained_mass"] - h32["retained_mass"]) <= 0.01 and abs(s64["retained_mass"] - h64["retained_mass"]) <= 0.01),
    ]
    return [{"figure": f, "target": t, "measured": m, "pass": bool(ok)} for f, t, m, ok in targets]


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"

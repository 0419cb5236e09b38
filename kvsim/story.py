"""The app's sentences about a trace, as pure functions of the figures measured on it.

Every number in them comes from the arguments (a sweep, the reference lines, ``describe``), so the
same function tells the canonical trace's story and a real trace's, and tests check the words
against the figures without running the app.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .figures import Line, curve_peak

#: what each offline reference is, for the sentence under the curve
OFFLINE_WHAT = {
    "greedy_future": "it evicts the position with the least attention still to come, greedy rather than optimal",
    "optimal": "the best eviction schedule under the cache's rules, found exactly: the ceiling for any policy",
}


def gap(value: float, other: float, whose: str) -> str:
    """``0.083 below h2o's 0.961``, or ``within 0.01 of h2o's 0.961``: how two retained masses compare."""
    d = value - other
    if abs(d) < 0.01:
        return f"within 0.01 of {whose} {other:.3f}"
    return f"{abs(d):.3f} {'below' if d < 0 else 'above'} {whose} {other:.3f}"


def possessive(name: str) -> str:
    """``h2o's``, ``scissorhands'``."""
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def window_text(policy: str, band: int, share: float | None) -> str:
    """Why the recent window is load-bearing, with this trace's band and its share."""
    share_text = "n/a" if share is None else f"{share:.2f}"
    return (
        f"**Why the recent window is load-bearing.** A new position starts with a score of zero, so {policy} must "
        f"protect the newest positions or evict each one on arrival. On this trace the newest {band} positions take "
        f"{share_text} of every row's attention. With a window narrower than that, positions a few dozen steps old "
        "still draw much of it, but they are unprotected and must compete on score against sinks and old heavy "
        "hitters whose totals have been growing all run long; they lose, and are evicted while still wanted. A "
        "window as wide as the band protects all of them."
    )


def curve_verdict(rows: Sequence[Mapping], band: int) -> str:
    """Where the primary curve stops gaining, in words computed from its sweep."""
    peak, top = curve_peak(rows)
    if peak == band:
        return (f"On this trace the gain stops at {peak}, the band's width: past it the extra protected slots "
                "go to positions little looked at any more, taken from heavy hitters.")
    return (f"On this trace retained mass peaks at recent_window {peak} ({top:.3f}), not at the band's "
            f"{band}: its attention is not one clean band, so read the curve rather than the rule.")


def lines_story(policy: str, curves: Mapping[str, Sequence[Mapping]], lines: Sequence[Line], budget: int) -> str:
    """What the chart's other curves and lines show on this trace, computed from them."""
    peak, top = curve_peak(curves[policy])
    peak_of = f"{possessive(policy)} peak"
    out = []
    for name, rows in curves.items():
        if name == policy:
            continue
        p, v = curve_peak(rows)
        where = f"also peaks at {p}" if p == peak else f"peaks at {p}"
        out.append(f"**{name}** {where}, at {v:.3f}: {gap(v, top, peak_of)}.")
    bound = next((line for line in lines if line.kind == "bound"), None)
    for line in lines:
        if line.kind == "policy" and line.policy not in ("sliding_window", "streaming_llm"):  # the cards' baselines
            near = f", {gap(line.retained_mass, bound.retained_mass, 'the upper bound')}" if bound else ""
            out.append(f"**{line.label}** has no recent_window, so it is one line: {line.retained_mass:.3f}{near}.")
    if bound is not None:
        out.append(
            f"\n\n**The dotted lines are offline references, not policies to deploy**: they read the whole "
            f"trace, future rows included. Black, the **upper bound** ({bound.retained_mass:.3f}): the sum of "
            f"each row's {budget} largest weights; no cache of {budget} positions can hold more."
        )
    for line in lines:
        if line.kind == "offline":
            what = OFFLINE_WHAT.get(line.policy, "an offline reference")
            out.append(
                f"Grey, **{line.policy or line.label}** ({line.retained_mass:.3f}): {what}; here "
                f"{gap(line.retained_mass, top, peak_of)}."
            )
    return " ".join(out).replace(" \n\n", "\n\n").strip()

"""The app's sentences about a trace, as pure functions of the figures measured on it.

Every number in them comes from the arguments (a sweep, the reference lines, ``describe``), so the
same function tells the canonical trace's story and a real trace's, and tests check the words
against the figures without running the app.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..analysis.features import HeavyFate, TraceFeatures, curve_peak
from ..analysis.windows import choose_window, covers
from ..policykit.base import WINDOW
from .figures.curve import COINCIDE, Line
from .figures.kept import heavy_marks
from .figures.trace import heavy_marks_drawn
from .selection import Region


def gap(value: float, other: float, whose: str) -> str:
    """``0.083 below h2o's 0.961``, ``0.004 above h2o's 0.961, within 0.01``, or ``level with h2o's 0.961``
    (equal to three decimals): how two retained masses compare, always in the direction of the figure (a
    close one said as close, never with its sign hidden)."""
    d = value - other
    if round(abs(d), 3) == 0:
        return f"level with {whose} {other:.3f}"
    near = ", within 0.01" if abs(d) < 0.01 else ""
    return f"{abs(d):.3f} {'below' if d < 0 else 'above'} {whose} {other:.3f}{near}"


def possessive(name: str) -> str:
    """``h2o's``, ``scissorhands'``."""
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def window_text(policy: str, band: int, share: float | None, band_known: bool = True) -> str:
    """Why the recent window is load-bearing, with this trace's band and its share (or, on a trace
    without a band, the share of the newest ``band`` positions and no band to match)."""
    share_text = "n/a" if share is None else f"{share:.2f}"
    head = (f"**Why the recent window is load-bearing.** A new position starts with a score of zero, so {policy} must "
            "protect the newest positions or evict each one on arrival. ")
    if not band_known:
        return head + (
            f"This trace has no sharp recency band: attention fades with age (the newest {band} positions take "
            f"{share_text} of every row), so there is no one width that protects \"the band\". A wider window "
            "protects more of the positions still wanted but leaves fewer slots for old ones the score would defend; "
            "the curve shows where that trade stops paying on this trace."
        )
    return head + (
        f"On this trace the newest {band} positions take "
        f"{share_text} of every row's attention. With a window narrower than that, positions a few dozen steps old "
        "still draw much of it, but they are unprotected and must compete on score against sinks and old heavy "
        "hitters whose totals have been growing all run long; they lose, and are evicted while still wanted. A "
        "window as wide as the band protects all of them."
    )


def curve_verdict(rows: Sequence[Mapping], band: int, band_known: bool = True, budget: int | None = None) -> str:
    """Where the primary curve stops gaining, in words computed from its sweep: at the band, near
    it (the curve is flat past it), elsewhere, or, on a trace without a band, simply where. With
    ``budget``: when the rows hold every window 1 .. budget - 1 the best and recommended windows
    (``kvsim.analysis.windows``) are quoted after it; otherwise the peak is the peak so far, of the
    windows sampled."""
    choice = None if budget is None else choose_window(rows, budget=budget)
    sampled = choice is not None and not choice.exact
    peaks = "peaks so far (of the windows sampled) at" if sampled else "peaks at"
    verdict = _verdict(rows, band, band_known, peaks, "its highest point so far" if sampled else "its highest point")
    if choice is None or sampled:
        return verdict
    return (f"{verdict} Over every window 1 .. {budget - 1}: the **best** is {choice.best} ({choice.best_mass:.3f}); "
            f"the **recommended** is {choice.recommended} ({choice.recommended_mass:.3f}), the smallest within "
            f"{choice.tolerance:g} of the best.")


def _verdict(rows: Sequence[Mapping], band: int, band_known: bool, peaks: str, highest: str) -> str:
    peak, top = curve_peak(rows)
    at = {int(r[WINDOW]): float(r["retained_mass"]) for r in rows}
    if not band_known:
        return (f"This trace has no sharp recency band, so there is no width to match: retained mass {peaks} "
                f"recent_window {peak} ({top:.3f}). Read the curve rather than a rule.")
    if peak == band:
        return (f"On this trace the gain stops at {peak}, the band's width: past it the extra protected slots "
                "go to positions little looked at any more, taken from heavy hitters.")
    if band in at and top - at[band] <= 0.002:
        return (f"On this trace the gain all but stops at the band's width, {band} ({at[band]:.3f}); the curve is "
                f"flat past it, with {highest} at {peak} ({top:.3f}), {top - at[band]:.4f} more.")
    if band in at:
        return (f"On this trace retained mass {peaks} recent_window {peak} ({top:.3f}), not at the band's {band} "
                f"({at[band]:.3f}): at this budget, protecting more than the band still pays.")
    return (f"On this trace retained mass {peaks} recent_window {peak} ({top:.3f}); the band's width, {band}, is "
            "outside the swept range.")


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
        sampled = " of the windows sampled" if budget and not covers((r[WINDOW] for r in rows), budget) else ""
        out.append(f"**{name}** {where}{sampled}, at {v:.3f}: {gap(v, top, peak_of)}.")
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
            what = f": {line.note}" if line.note else ""
            out.append(
                f"Grey, the **{line.policy or line.label}** ({line.retained_mass:.3f}){what}; here "
                f"{gap(line.retained_mass, top, peak_of)}."
            )
    for line in lines:
        if line.kind == "policy" and bound is not None and abs(line.retained_mass - bound.retained_mass) < COINCIDE:
            out.append(f"**{line.label}** and the upper bound differ by {abs(line.retained_mass - bound.retained_mass):.4f}: "
                       "on the chart they are one line, the dotted bound over the wide coloured one.")
    return " ".join(out).replace(" \n\n", "\n\n").strip()


# --------------------------------------------------------------------------------------------
# what the trace has: each sentence quotes the trace's own figures, or says the feature is absent


def _positions(n: int) -> str:
    return "position 0" if n == 1 else f"positions 0-{n - 1}"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def sink_text(features: TraceFeatures, info: Mapping, difference: bool = False) -> str:
    """The kept view's note on sinks: where they are drawn and what share they take here (and how
    the strip reads in the difference view)."""
    if features.sinks == 0:
        return ("**Sinks**: this trace has none. No leading position takes a steady share of every row, so "
                "pinning the first positions (streaming_llm's sinks) buys nothing here.")
    return (f"**Sinks** ({_positions(features.sinks)}, widened in the strip at each panel's left): the first "
            "tokens. Trained models send a steady share of every row to them whatever they say, a place to park "
            f"attention that is needed nowhere else; here they take {_share(info.get('sink_share'))} of each row"
            + _sink_figure(info) + ". "
            + ("In the strip, blue: held by the first policy only; grey: by both." if difference
               else "Dark in the strip: held; white: evicted."))


def _sink_figure(info: Mapping) -> str:
    """`` (sink share 0.3812: positions 0-3, steps t > 4, as `describe` reports it)``: the figure the
    note rounds, named as ``python -m kvsim describe`` names it, so the two are seen to be one."""
    share, sinks = info.get("sink_share"), info.get("sinks")
    if share is None or not sinks:
        return ""
    return f" (sink share {share:.4f}: {_positions(int(sinks))}, steps t > {int(sinks)}, as `describe` reports it)"


def band_text(features: TraceFeatures, info: Mapping, ages: int) -> str:
    """The kept view's note on the recency band and the strip that shows the newest positions."""
    strip = (f"The strip at each panel's right shows the newest {ages} positions of every step by age (newest at "
             "its left edge), widened and shaded by the share of them held (dark: all, white: none): a policy's "
             "protected window is the dark stripe there, its edge a dashed green line.")
    if not features.band_known:
        return (f"**No sharp recency band** on this trace: attention fades with age without a cliff; the newest "
                f"{features.band} positions take {_share(info.get('recent_share'))} of each row. " + strip)
    return (f"**Recency band** (dotted orange line, in the strip at the right): the newest {features.band} positions "
            f"take {_share(info.get('recent_share'))} of each row here. A policy that loses them loses that "
            "attention. " + strip)


def heavy_text(features: TraceFeatures, fates: Mapping[str, Sequence[HeavyFate]], region: Region | None = None,
               panels: int | None = None) -> str:
    """The kept view's note on heavy hitters, with what each policy shown did with them. The count
    is the heavy hitters'; where the figure shows part of them (a zoomed ``region``) or their marks
    merge at the scale drawn (``panels`` side by side; by default one per policy in ``fates``), it
    says how many there are to see."""
    n = len(features.heavy)
    if n == 0:
        return ("**Heavy hitters**: none on this trace. No position past the sinks keeps drawing much more than an "
                "even share of the rows after it, so there is nothing old for a score to defend.")
    stale = len(features.stale)
    if not features.live_known:
        life = ""
    elif stale:
        life = f"; {stale} of them go stale (stop drawing attention) before the end"
    else:
        life = "; all of them still draw attention at the end of the trace"
    drawn = heavy_drawn(features, region, panels or max(1, len(fates)))
    out = [f"**Heavy hitters** (red ▼ over their columns; {features.heavy_source}): {n} here{drawn}{life}. Beside each "
           "column a red line runs while the policy holds it" + (" and it is live" if features.live_known else "")
           + "; an × marks where the policy evicts it while still wanted, dotted after."]
    for name, fs in fates.items():
        lost = [f for f in fs if f.lost_while_live]
        if not lost:
            out.append(f"{name} keeps all {n}" + (" while they are live." if features.live_known else "."))
        else:
            first = min(lost, key=lambda f: f.evicted_at)
            out.append(f"{name} loses {len(lost)} of {n} while live (the first, position {first.position}, at step "
                       f"{first.evicted_at}).")
    return " ".join(out)


def budget_note(steps: int, budget: int) -> str | None:
    """Said when the budget holds the whole trace: nothing is ever evicted, so every figure is 1."""
    if steps + 1 > budget:
        return None
    return (f"This trace has {steps} steps, so at most {steps + 1} positions ever exist, within the budget of "
            f"{budget}: nothing is ever evicted, every policy keeps everything, and retained mass and recall are "
            f"1.000 everywhere. Set the budget below {steps + 1} to see the policies differ.")


def heavy_drawn(features: TraceFeatures, region: Region | None, panels: int) -> str:
    """What of the heavy hitters the kept figure shows: ", drawn as 8 ▼ at this scale ..." where
    neighbours' marks merge (the figure groups them with the same ``heavy_marks``, over the same
    region and panels, and writes ×n beside a shared mark), " (3 of them in the zoomed positions ...)"
    where it shows part of the run."""
    region = (region or Region.whole(features.steps)).clip(features.steps)
    inside = [p for p, _, _ in features.heavy if region.p0 <= p <= region.p1]
    marks = len(heavy_marks(inside, region.p1 - region.p0 + 1, panels))
    merged = (f"drawn as {marks} ▼ at this scale (neighbours closer than a mark's width share one, marked ×n: zoom "
              "in to tell them apart)")
    if len(inside) < len(features.heavy):
        return (f" ({len(inside)} of them in the zoomed positions {region.p0}-{region.p1}"
                + (f", {merged}" if inside and marks < len(inside) else "") + ")")
    return "" if marks == len(inside) else f", {merged}"


def difference_text(a: str, b: str, mass_a: float, mass_b: float, counts: tuple[float, float]) -> str:
    """The difference view's reading: how many positions each holds that the other does not."""
    only_a, only_b = counts
    return (f"**Blue: held by {a} and not by {b}; orange: the reverse; grey: held by both.** On average over the "
            f"steps, {a} holds {only_a:.1f} positions that {b} does not and {b} holds {only_b:.1f} that {a} does "
            f"not. Those differences are worth {gap(mass_a, mass_b, possessive(b))} retained mass: {a} keeps "
            f"{mass_a:.3f}.")


def score_text(features: TraceFeatures, policy: str) -> str:
    """How a score-keeping policy decides, with the trace's stale heavy hitters named only if it has them."""
    stale = features.stale
    if stale:
        never = (f"A heavy hitter that stopped drawing attention long ago (*stale*, purple: {len(stale)} of this "
                 "trace's heavy hitters go stale) keeps its large total and so keeps its slot; the sum never forgets.")
    elif features.heavy and features.live_known:
        never = ("On this trace every heavy hitter still draws attention at the end, so none is stale; on a trace "
                 "where one stops, its large total would keep its slot all the same: the sum never forgets.")
    else:
        never = "A position that once drew much attention keeps its large total, and so its slot: the sum never forgets."
    return (
        f"**How a score-keeping policy decides.** {policy} adds up, every step, what each kept position earns "
        "(h2o: the attention it receives; scissorhands: a vote when it beats a fair share) and, when the cache is "
        "over budget, evicts the lowest score among the positions outside the recent window. " + never + " A new "
        "position starts at zero, so without the recent window it would be the lowest score in the cache and the "
        "next thing evicted, every step: the window is what lets the cache move forward. Ringed crosses (legend: "
        "*evicted at this step*) are the positions evicted at this step; green points under the threshold survive "
        "only because the window protects them. Move **step** in the sidebar to walk through the run."
    )


def trace_text(features: TraceFeatures, info: Mapping) -> str:
    """The trace view's reading of the matrix: what is there, and what is not."""
    parts = ["**The trace itself.** Row *t* is where the query at step *t* put its attention over every earlier "
             "position, with the whole history available (colour is the weight on a log scale, averaged over small blocks)."]
    if features.sinks:
        parts.append(f"The bright column at the left edge is the sinks ({_positions(features.sinks)}, "
                     f"{_share(info.get('sink_share'))} of each row).")
    else:
        parts.append("There is no sink column: no leading position takes a steady share of every row.")
    if features.band_known:
        parts.append(f"The bright diagonal is the recency band: the newest {features.band} positions, "
                     f"{_share(info.get('recent_share'))} of each row.")
    else:
        parts.append(f"There is no sharp band along the diagonal: attention fades with age (the newest "
                     f"{features.band} positions take {_share(info.get('recent_share'))} of each row).")
    n, stale = len(features.heavy), len(features.stale)
    marks = len(heavy_marks_drawn(features))
    # the triangles counted as the figure draws them: 24 heavy hitters beside 8 triangles read as a mistake
    drawn = (f"{n}, a red triangle at each one's birth" if marks == n else
             f"{n}, drawn as {marks} red triangles at their births: neighbours closer than a triangle's width share "
             "one, marked ×n")
    if n == 0:
        parts.append("No heavy hitters: no older position keeps drawing a large share.")
    elif stale:
        parts.append(f"The vertical stripes are heavy hitters ({drawn}): bright for a stretch, then {stale} of them "
                     "fade into the background.")
    else:
        parts.append(f"The vertical stripes are heavy hitters ({drawn})"
                     + (": they keep drawing attention to the end of the trace." if features.live_known else "."))
    return " ".join(parts)


def when_done(fraction: float, elapsed_s: float | None) -> str:
    """When a background job ends, from how far it got in how long: "0% done" alone said nothing of when.
    While it waits for a worker, or before its first report past 0, there is nothing to extrapolate
    from, and it says so; then the time left at the pace so far."""
    if elapsed_s is None:
        return "it waits for the background worker (one job at a time), and starts once the jobs before it end."
    if fraction <= 0:
        return (f"started {elapsed_s:.0f} s ago and not yet through its first part (the costs of every possible "
                "eviction come first): how long the rest takes is said here once that part is done.")
    left = elapsed_s * (1 - fraction) / fraction
    return (f"{fraction:.0%} done in {elapsed_s:.0f} s; at that pace about {max(1, round(left))} s more "
            f"(about {max(1, round(elapsed_s + left))} s in all).")


"""Issue 21, what a newcomer trips on where the text and the picture meet: every series of the
recent_window curve told apart and labelled (its legends inside the figure, none over another), and
the sentences beside a figure saying what the figure draws.

The layout checks draw the figure in headless Chromium (Debian's ``chromium``, driven by Playwright
through ``executable_path``) at the width the app gives it at 1500 x 1100, and read where plotly put
each legend, label and point; they are skipped where there is no Chromium.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from browser_support import CHROMIUM, CHROMIUM_ARGS
from tolerance import rounding64

import kvsim
from kvsim.analysis import features
from kvsim.sim import summaries
from kvsim.views import figures, model_figures, story
from kvsim.views.figures import curve as curve_figures

ROOT = Path(__file__).resolve().parent.parent
#: the chart column's width in the app at 1500 x 1100 (three quarters of the main area)
CHART_WIDTH = 770


_BROWSER: list = []  # one Chromium page for the module's figures, plotly.js loaded once: (playwright, browser, page)


@pytest.fixture(scope="module", autouse=True)
def _close_browser():
    yield
    while _BROWSER:
        playwright, browser, _ = _BROWSER.pop()
        browser.close()
        playwright.stop()


def _page():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM}")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    if not _BROWSER:
        from plotly.offline import get_plotlyjs

        playwright = sync_playwright().start()
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1100})
        page.set_content("<html><body style='margin:0'><div id='plot'></div></body></html>")
        page.add_script_tag(content=get_plotlyjs())
        _BROWSER.append((playwright, browser, page))
    return _BROWSER[0][2]


def drawn(fig, script: str, width: int = CHART_WIDTH):
    """The figure drawn by plotly.js in headless Chromium ``width`` px wide, and what ``script`` (a
    JavaScript expression, run in the page) gives there."""
    page = _page()
    page.evaluate("""([spec, width]) => {
        const old = document.getElementById('plot'); Plotly.purge(old); old.remove();
        const div = document.createElement('div'); div.id = 'plot'; div.style.width = width + 'px';
        document.body.appendChild(div);
        const fig = JSON.parse(spec);
        return Plotly.newPlot(div, fig.data, {...fig.layout, width: width}, {responsive: false}).then(() => true);
    }""", [fig.to_json(), width])
    return page.evaluate(script)


BOXES = """(wanted) => Object.fromEntries(Object.entries(wanted).map(([name, sel]) => [name,
    [...document.querySelectorAll(sel)].map(e => {
        const r = e.getBoundingClientRect();
        return {x0: r.left, x1: r.right, y0: r.top, y1: r.bottom, text: e.textContent};
    })]))"""


def boxes(fig, width: int = CHART_WIDTH, selectors: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """The bounding boxes of what each of ``selectors`` (CSS) matches in the drawn figure, plus the
    whole figure's ("svg")."""
    wanted = {"svg": ".main-svg", **(selectors or {})}
    return drawn(fig, f"({BOXES})({json.dumps(wanted)})", width)


def overlap(a: dict, b: dict, pad: float = 0.0) -> bool:
    return a["x0"] < b["x1"] - pad and b["x0"] < a["x1"] - pad and a["y0"] < b["y1"] - pad and b["y0"] < a["y1"] - pad


def inside(a: dict, b: dict, tol: float = 0.5) -> bool:
    return a["x0"] >= b["x0"] - tol and a["x1"] <= b["x1"] + tol and a["y0"] >= b["y0"] - tol and a["y1"] <= b["y1"] + tol


# --------------------------------------------------------------------------------------------
# item 2: the recent_window curve's legend


def whole_registry_curve():
    """The curve as the app draws it on the canonical trace's shape: every policy with a
    recent_window a curve (h2o the primary), every other one a line, the upper bound."""
    rows = [dict(policy="h2o", recent_window=w, retained_mass=0.4 + w / 600, top_k_recall=0.5 + w / 600)
            for w in sorted({*range(1, 256, 8), 32, 64})]
    curves = [n for n in kvsim.POLICIES if "recent_window" in kvsim.policy_params(n)]
    companions = {n: [dict(r, policy=n, retained_mass=r["retained_mass"] - 0.01 * i) for r in rows]
                  for i, n in enumerate(curves) if n != "h2o"}
    lines = []
    for i, (name, cls) in enumerate(kvsim.POLICIES.items()):
        if name in curves:
            continue
        label = "streaming_llm (sinks=4)" if name == "streaming_llm" else name
        if cls.needs_trace:
            lines.append(figures.Line(f"{label} (offline reference)", 0.9 - 0.01 * i, 0.9, "offline", name))
        else:
            lines.append(figures.Line(label, 0.5 + 0.04 * i, 0.6, policy=name))
    lines.append(figures.Line("upper bound (offline reference)", 0.97, 1.0, "bound"))
    fig = figures.recent_window_curve(rows, lines, current=32, default=32, band=64, companions=companions)
    return fig, curves, lines


def test_every_registered_policy_has_a_colour_and_a_line_of_its_own():
    styles = {name: curve_figures.style_of(name) for name in kvsim.POLICIES}
    assert set(kvsim.POLICIES) <= set(curve_figures.POLICY_STYLES)  # none falls back to a spare style
    every = [*styles.values(), curve_figures.style_of(None, "bound")]
    colours = [s.colour.lower() for s in every]
    assert len(set(colours)) == len(colours), colours
    # nor the colour of a mark on the primary curve (orange default, cyan band, red current)
    assert not {"#ff7f0e", "#17becf", curve_figures.CURRENT_COLOUR.lower()} & set(colours)
    lines = [(s.dash, s.width, s.symbol) for s in every]
    assert len(set(lines)) == len(lines), lines
    # a curve (a policy with a recent_window) carries a marker; a horizontal line does not need one
    for name, s in styles.items():
        assert (s.symbol is not None) == ("recent_window" in kvsim.policy_params(name)), name


def _lab(colour: str) -> tuple[float, float, float]:
    """A colour (``#rrggbb`` or ``black``) in CIELAB (sRGB, D65): where a distance is what the eye sees."""
    hexa = {"black": "000000"}.get(colour.lower(), colour.lstrip("#"))
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (int(hexa[i:i + 2], 16) / 255 for i in (0, 2, 4))]
    x = (0.4124 * lin[0] + 0.3576 * lin[1] + 0.1805 * lin[2]) / 0.95047
    y = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    z = (0.0193 * lin[0] + 0.1192 * lin[1] + 0.9505 * lin[2]) / 1.08883

    def f(t):
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


#: the least CIE76 distance two series' colours keep: sliding_window's olive (#bcbd22) and random's yellow
#: (#f5c400) were 25 apart and read as one colour at a glance (issue 44); vatp and keydiff's browns were 10,
#: h2o's and critical's blues 14, greedy_future's and optimal's greys 20
COLOUR_APART = 27.0


def test_the_lab_distance_is_cie76():
    assert _lab("#ffffff") == pytest.approx((100.0, 0.0, 0.0), abs=0.05)
    assert _lab("black") == pytest.approx((0.0, 0.0, 0.0), abs=1e-9)
    assert _lab("#ff0000") == pytest.approx((53.24, 80.09, 67.20), abs=0.1)


def test_every_policy_colour_is_apart_from_every_other_to_the_eye():
    """Distinct strings are not enough: every two colours of the registry (and the bound's, and the curve's
    marks) are at least ``COLOUR_APART`` apart in CIELAB, so the policies of any view read apart."""
    every = {name: curve_figures.style_of(name).colour for name in kvsim.POLICIES}
    every |= {"upper bound": curve_figures.BOUND_STYLE.colour, "default mark": "#ff7f0e", "band mark": "#17becf",
              "current": curve_figures.CURRENT_COLOUR}
    for (a, ca), (b, cb) in itertools.combinations(every.items(), 2):
        distance = sum((p - q) ** 2 for p, q in zip(_lab(ca), _lab(cb), strict=True)) ** 0.5
        assert distance >= COLOUR_APART, f"{a} ({ca}) and {b} ({cb}) are {distance:.1f} apart"


#: two dash patterns whose proportions differ by less than this share of a period look alike (the
#: issue's tova and streaming_llm, Plotly's "dash" and "longdash" at width 4: 12-on-12-off and 20-on-20-off)
ALIKE = 0.1


def _proportions(pattern: tuple[float, ...]) -> tuple[float, ...]:
    """A dash pattern as shares of its shortest period: a pattern repeated twice is the pattern."""
    n = len(pattern)
    for k in range(2, n, 2):
        if n % k == 0 and pattern == pattern[:k] * (n // k):
            pattern = pattern[:k]
            break
    return tuple(x / sum(pattern) for x in pattern) if pattern else ()


def look_alike(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Whether two dash patterns draw the same figure at another size: the same number of segments and
    the same proportions (within ``ALIKE``) from some starting point (a line has no start on screen)."""
    pa, pb = _proportions(a), _proportions(b)
    if len(pa) != len(pb):
        return False
    if not pa:
        return True
    return any(max(abs(x - y) for x, y in zip(pa, pb[i:] + pb[:i], strict=True)) < ALIKE
               for i in range(0, len(pb), 2))


def test_the_look_alike_rule_catches_what_the_issue_saw():
    """The rule itself: Plotly's dash and longdash at width 4 (tova's and streaming_llm's before), and dot
    at widths 3 and 2 (greedy_future's and the upper bound's), look alike; a dash-dot does not."""
    style = curve_figures.Style
    pattern = curve_figures.dash_pattern
    assert pattern(style("#000", "dash", 4)) == (12, 12) and pattern(style("#000", "longdash", 4)) == (20, 20)
    assert look_alike(pattern(style("#000", "dash", 4)), pattern(style("#000", "longdash", 4)))
    assert look_alike(pattern(style("#000", "dot", 3)), pattern(style("#000", "dot", 2)))
    assert not look_alike(pattern(style("#000", "dash", 4)), pattern(style("#000", "dashdot", 4)))
    assert look_alike((12, 4, 3, 4), (3, 4, 12, 4))  # the same line started elsewhere


def test_every_line_of_the_curve_has_a_pattern_of_its_own():
    """Issue 31, item 5: every pair of styles differs in what the eye reads on the chart, not only in the
    strings that make them: a curve by its marker, a horizontal line by its dash's proportions."""
    every = {name: curve_figures.style_of(name) for name in kvsim.POLICIES} | {"upper bound": curve_figures.BOUND_STYLE}
    for (a, sa), (b, sb) in itertools.combinations(every.items(), 2):
        same_marker = sa.symbol == sb.symbol
        alike = look_alike(curve_figures.dash_pattern(sa), curve_figures.dash_pattern(sb))
        assert not (same_marker and alike), f"{a} {sa} and {b} {sb} look alike"


def test_every_series_of_the_curve_is_drawn_apart():
    fig, curves, lines = whole_registry_curve()
    series = {t.name: t for t in fig.data if t.showlegend is not False and t.legend != "legend3"}
    assert set(series) == {*curves, *(line.label for line in lines)}
    colours = [t.line.color for t in series.values()]
    assert len(set(colours)) == len(colours), colours
    looks = [(t.line.dash, t.line.width, t.marker.symbol if "markers" in t.mode else None) for t in series.values()]
    assert len(set(looks)) == len(looks), looks


LEGENDS = "g.legend, g.legend2, g.legend3"
ENTRIES = "g.legend g.traces, g.legend2 g.traces, g.legend3 g.traces"


def test_the_curve_legends_stay_inside_the_figure_and_apart():
    fig, curves, lines = whole_registry_curve()
    # the panels' plotting areas, their tick labels and their titles: the legends lie between the panels (issue 56)
    got = boxes(fig, selectors={"legends": LEGENDS, "entries": ENTRIES, "panels": "g.draglayer rect.nsewdrag",
                                "ticks": "g.xtick text", "xtitle": "g.g-xtitle", "notes": "g.annotation"})
    (svg,) = got["svg"][:1]
    legends = got["legends"]
    assert len(legends) == 3 and len(got["panels"]) == 2
    titles = [n for n in got["notes"] if n["text"] in ("retained mass", "top-32 recall")]
    assert len(titles) == 2
    for a in legends:
        assert inside(a, svg), a  # no label cut at the figure's edge
        assert not overlap(a, got["xtitle"][0]), a
        for b in [*got["panels"], *got["ticks"], *titles]:
            assert not overlap(a, b), (a, b)
    upper, lower = sorted(got["panels"], key=lambda b: b["y0"])
    assert all(upper["y1"] <= a["y0"] and a["y1"] <= lower["y0"] for a in legends)  # between the panels
    for a, b in itertools.combinations(legends, 2):
        assert not overlap(a, b), (a, b)
    # every series is labelled: one legend row each, none over another
    labels = [e["text"] for e in got["entries"]]
    for name in [*curves, *(line.label for line in lines)]:
        assert name in labels
    for a, b in itertools.combinations(got["entries"], 2):
        assert not overlap(a, b, pad=1), (a, b)


# --------------------------------------------------------------------------------------------
# item 8: the sentences beside a figure say what it draws

#: the kept view's width in the app at 1500 x 1100 (the main area)
KEPT_WIDTH = 1100
#: the x pixel of every point of the traces named ``name``, one list per trace
PIXELS = """(name) => {
    const gd = document.getElementById('plot');
    return gd._fullData.filter(t => t.name === name).map(t => {
        const ax = gd._fullLayout['xaxis' + t.xaxis.slice(1)];
        return Array.from(t.x, x => ax._offset + ax.l2p(x));
    });
}"""


def seen(pixels: list[float], size: float) -> int:
    """How many marks ``size`` px wide a reader tells apart at these x pixels."""
    out, last = 0, None
    for x in sorted(pixels):
        if last is None or x - last > size:
            out += 1
        last = x
    return out


@pytest.fixture(scope="module")
def canonical_story():
    trace = kvsim.generate_canonical()
    results = [kvsim.replay(trace, name, budget=256, record_kept=True) for name in ("sliding_window", "streaming_llm", "h2o")]
    return trace, results


#: the kept figure's width in the app at 1280 x 800 and at 1500 x 1100 (the main area's sides 2.5rem: kvsim/app/main.py)
KEPT_WIDTHS = (900, 1120)
#: the kept figure's heavy-hitter marks, one ▼ per group of neighbours (×n above a shared one)
HEADS = "heavy hitter (×n: n side by side)"
TEXTS = """(name) => document.getElementById('plot')._fullData.filter(t => t.name === name).map(t => Array.from(t.text))"""


def test_the_heavy_hitters_count_said_is_the_count_drawn(canonical_story):
    """Issue 44: the 24 heavy hitters were drawn as 24 triangles that read as 8, beside a note of
    "24, drawn as 8" and no ×3 anywhere: now one ▼ per group, ×n over it, apart at both window sizes."""
    trace, results = canonical_story
    f = features.trace_features(trace)
    fig = figures.kept_heatmap(results, f, step=1000)
    text = story.heavy_text(f, {figures.policy_label(r): features.heavy_fates(r.kept_history, f) for r in results})
    assert "24 here, drawn as 8 ▼" in text and "marked ×n" in text
    for width in KEPT_WIDTHS:
        heads = drawn(fig, f"({PIXELS})({json.dumps(HEADS)})", width)
        assert len(heads) == 3 and all(len(h) == 8 for h in heads)  # one mark per group, in each panel
        assert all(seen(h, 9) == 8 for h in heads), (width, heads)  # the triangles are 9 px wide: none touch
        assert drawn(fig, f"({TEXTS})({json.dumps(HEADS)})", width) == [["×3"] * 8] * 3
    # zoomed on the first 300 positions: 3 heavy hitters there, and the text says which ones it counts
    zoom = figures.Region(0, 300, 1, trace.steps)
    text = story.heavy_text(f, {}, region=zoom, panels=3)
    assert "24 here (3 of them in the zoomed positions 0-300" in text
    zoomed = figures.kept_heatmap(results, f, region=zoom, size=341)
    (first, *_) = [t for t in zoomed.data if t.name == HEADS]
    assert (f", drawn as {len(first.x)} ▼" in text) == (len(first.x) < 3)  # the marks the zoomed figure draws
    # zoomed on the first 300 positions: 3 heavy hitters there, and the text says which ones it counts
    zoom = figures.Region(0, 300, 1, trace.steps)
    text = story.heavy_text(f, {}, region=zoom, panels=3)
    assert "24 here (3 of them in the zoomed positions 0-300" in text


@pytest.mark.parametrize("name", ["gemma3-270m-L11", "canonical"])
def test_the_app_and_describe_name_the_same_sinks_with_the_same_figure(name):
    from kvsim.app import memo
    from kvsim.data.catalog import resolve_trace

    trace = resolve_trace(name)
    proc = subprocess.run([sys.executable, "-m", "kvsim", "describe", "--trace", name, "--json"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    cli = json.loads(proc.stdout)
    f = memo.cached_features(trace)
    info = memo.describe(trace, f)  # what the kept view and the trace view quote
    assert cli["sinks"] == info["sinks"] == max(1, f.sinks)  # L11: position 0 alone, as the kept view draws it
    # the same float32 rows through two callers: float64 means over the trace's rows of at most steps + 1 terms
    assert cli["sink_share"] == pytest.approx(info["sink_share"], abs=2 * rounding64(2 * trace.steps + 1))
    text = story.sink_text(f, info)
    positions = "position 0" if f.sinks == 1 else f"positions 0-{f.sinks - 1}"
    assert f"**Sinks** ({positions}," in text
    assert f"sink share {cli['sink_share']:.4f}: {positions}, steps t > {cli['sinks']}" in text


def test_a_claim_the_card_pins_on_the_canonical_trace_is_not_applicable_elsewhere():
    from kvsim.analysis import claims
    from kvsim.data.catalog import resolve_trace

    def pins_canonical(c):  # the card's words say which trace they are about
        return " ".join(c.words.split()).lower().startswith(("on the canonical trace", "the canonical trace"))

    pinned = [c for c in claims.CLAIMS if pins_canonical(c)]
    assert "h2o-recall-beats-attention-blind" in {c.id for c in pinned}
    assert all(c.scope == "canonical" for c in pinned), [c.id for c in pinned if c.scope != "canonical"]
    real = {r["id"]: r for r in claims.ledger(resolve_trace("gemma3-270m-L11"))}
    for c in pinned:
        r = real[c.id]
        assert r["verdict"] == "not applicable" and "canonical trace" in r["note"], (c.id, r["verdict"], r["note"])
    # and on the canonical trace it is decided
    assert claims.ledger(kvsim.generate_canonical())[[c.id for c in claims.CLAIMS].index("h2o-recall-beats-attention-blind")][
        "verdict"] == "holds"


@pytest.fixture(scope="module")
def scored():
    from kvsim.data.catalog import resolve_trace

    out = {}
    for name in ("canonical", "gemma3-270m-L11"):
        trace = resolve_trace(name)
        out[name] = (kvsim.replay(trace, "h2o", budget=256, record_kept=True, record_scores=True),
                     features.trace_features(trace))
    return out


@pytest.mark.parametrize("name", ["canonical", "gemma3-270m-L11"])
@pytest.mark.parametrize("step", [300, 3000])
def test_the_eviction_threshold_label_covers_no_point(scored, name, step):
    result, f = scored[name]
    fig = figures.score_distribution(result, step, f)
    for width in (KEPT_WIDTH, 900):  # the score view takes the main area; a narrower window too
        got = boxes(fig, width, {"labels": "g.annotation", "points": ".cartesianlayer .subplot.xy path.point"})
        (label,) = [a for a in got["labels"] if a["text"].startswith("eviction threshold")]
        assert got["points"] and inside(label, got["svg"][0])
        hit = [p for p in got["points"] if overlap(label, p, pad=0.5)]
        assert not hit, (width, label, hit[:3])


def close_baselines_tuning():
    """A tuning of one layer whose two baselines lie 0.004 apart (as on a layer where the sinks
    weigh little): their labels must not land on each other."""
    import numpy as np

    from kvsim.analysis.tune import TraceTuning, TuneResult

    windows = list(range(1, 256))
    mass = np.array([0.5 + 0.2 * min(w, 64) / 64 for w in windows])
    t = TraceTuning(0, 0, "L00", "sliding", mass, mass - 0.05, 64, float(mass[63]), 40, float(mass[39]),
                    float(mass[39] - 0.05), {"sliding_window": (0.612, 0.6), "streaming_llm": (0.616, 0.61)})
    return TuneResult("gemma3-270m", "h2o", 256, windows, 0.01, 32, {}, (t,))


def test_the_model_views_line_labels_do_not_overlap():
    fig = model_figures.tune_curve(close_baselines_tuning(), 0)
    got = boxes(fig, CHART_WIDTH, {"labels": "g.annotation", "entries": "g.legend g.traces"})
    texts = [*got["labels"], *got["entries"]]
    for a, b in itertools.combinations(texts, 2):
        assert not overlap(a, b, pad=1), (a["text"], b["text"])
    for a in texts:
        assert inside(a, got["svg"][0]), a["text"]
    # each baseline still named, with its figure
    named = " ".join(a["text"] for a in texts)
    assert "sliding_window 0.612" in named and "streaming_llm 0.616" in named


def test_on_a_real_trace_the_heavy_hitters_note_counts_what_is_drawn():
    from kvsim.data.catalog import resolve_trace

    trace = resolve_trace("gemma3-270m-L11")
    f = features.trace_features(trace)
    results = [kvsim.replay(trace, name, budget=256, record_kept=True) for name in ("sliding_window", "streaming_llm", "h2o")]
    fig = figures.kept_heatmap(results, f, step=1000)
    n = len(f.heavy)
    text = story.heavy_text(f, {figures.policy_label(r): features.heavy_fates(r.kept_history, f) for r in results})
    for width in KEPT_WIDTHS:
        heads = drawn(fig, f"({PIXELS})({json.dumps(HEADS)})", width)
        marks = len(heads[0])
        assert seen(heads[0], 9) == marks  # every mark drawn is seen as one
        said = (f"{n} here, drawn as {marks} ▼" in text) if marks < n else (f"{n} here;" in text or f"{n} here." in text)
        assert said, (width, marks, text)


# --------------------------------------------------------------------------------------------
# issue 31, item 5: the curve's notes clear of the lines


JS_HLINES = """() => {
  const d = document.getElementById('plot'), L = d._fullLayout, b = d.getBoundingClientRect();
  return d._fullData.filter(t => t.yaxis === 'y' && t.x.length === 2 && t.y[0] === t.y[1]).map(t => ({
    name: t.name, y: b.top + L.yaxis._offset + L.yaxis.l2p(t.y[0]),
    x0: b.left + L.xaxis._offset + L.xaxis.l2p(t.x[0]), x1: b.left + L.xaxis._offset + L.xaxis.l2p(t.x[1])}));
}"""


def real_curve(trace_name: str, budget: int = 256):
    """The curve view's figure for a shipped trace as the app builds it: h2o's every window, its
    companions on a grid, every deployable policy and offline reference (the optimum aside: its solve is
    minutes) and the upper bound as lines."""
    from kvsim.data import vectors
    from kvsim.data.catalog import resolve_trace
    from kvsim.policykit.upper_bound import upper_bound_summary

    trace = resolve_trace(trace_name)
    rows = kvsim.sweep(trace, "h2o", budget, "recent_window", range(1, budget), top_k=32)
    companions = {n: kvsim.sweep(trace, n, budget, "recent_window", range(1, budget, 8), top_k=32)
                  for n in ("scissorhands", "h2o_normalized", "snapkv")}
    lines = []
    for name, cls in kvsim.POLICIES.items():
        if "recent_window" in kvsim.policy_params(name) or name == "optimal" or vectors.missing(trace, cls.reads):
            continue  # (a policy reading queries or keys has no line on a trace without them, as in the app)
        summary = summaries.summary(trace, kvsim.PolicySpec.of(name, budget), 32)
        kind = "offline" if cls.needs_trace else "policy"
        lines.append(figures.Line.of(summary, name + (" (offline reference)" if cls.needs_trace else ""), kind, name))
    lines.append(figures.Line.of(upper_bound_summary(trace, budget, 32), "upper bound (offline reference)", "bound"))
    f = features.trace_features_cached(trace)
    return figures.recent_window_curve(rows, lines, current=32, default=32, band=f.band, band_known=f.band_known,
                                       companions=companions, budget=budget, policy="h2o")


@pytest.mark.parametrize("trace_name", ["gemma3-270m-L11", "canonical"])
def test_the_curves_notes_sit_clear_of_the_lines(trace_name):
    """On gemma3-270m-L11 the "recommended" note sat on the upper bound's line (read as its label). Drawn
    by plotly.js at the app's chart width, no note of the best and recommended windows crosses a
    horizontal line, and they do not cover each other."""
    fig = real_curve(trace_name)
    got = boxes(fig, selectors={"notes": "g.annotation-text-g"})
    notes = [n for n in got["notes"] if n["text"].startswith(("recommended", "best"))]
    assert notes, [n["text"] for n in got["notes"]]
    lines = drawn(fig, f"({JS_HLINES})()")
    assert len(lines) >= 6
    for note in notes:
        for line in lines:
            crosses = note["y0"] - 1 <= line["y"] <= note["y1"] + 1 and line["x0"] < note["x1"] and note["x0"] < line["x1"]
            assert not crosses, (note["text"], line["name"])
    for a, b in itertools.combinations(got["notes"], 2):
        assert not overlap(a, b), (a["text"], b["text"])

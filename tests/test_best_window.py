"""Issue 21, item 3: one rule names the best and the recommended recent_window everywhere.

On gemma3-270m-L11 at budget 256 the app said the mass peaks at 211 (a refined grid), ``sweep 1:255``
marked 196 and ``table`` and ``claims`` said 168 (the sampled 8..192): the top is flat. The rule
(``kvsim.analysis.windows.choose_window``): the best is the argmax over every window 1 .. budget - 1
(the smallest on ties), the recommended the smallest window within ``TOLERANCE`` of it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_app import charts, named, problems, run, values

from kvsim import cli
from kvsim.analysis.tune import TOLERANCE as TUNE_TOLERANCE
from kvsim.analysis.tune import tune
from kvsim.analysis.windows import TOLERANCE, WindowChoice, choose_window, covers, pick
from kvsim.data.catalog import resolve_trace

REAL = "gemma3-270m-L11"
BUDGET = 256


def rows(pairs):
    return [{"recent_window": w, "retained_mass": m} for w, m in pairs]


# ---- the function ------------------------------------------------------------------------------

def test_the_best_is_the_smallest_of_equal_maxima_and_the_recommended_the_smallest_within_tolerance():
    c = choose_window(rows([(1, 0.5), (2, 0.7), (3, 0.9), (4, 0.9), (5, 0.896)]), budget=6)
    assert (c.best, c.best_mass, c.recommended, c.recommended_mass) == (3, 0.9, 3, 0.9)
    assert c.exact and c.tolerance == TOLERANCE == TUNE_TOLERANCE == 0.005
    flat = choose_window(rows([(1, 0.5), (2, 0.896), (3, 0.899), (4, 0.9), (5, 0.9)]), budget=6)
    assert (flat.best, flat.recommended) == (4, 2)  # a flat top: the recommended is where it starts
    assert flat.sentence() == "best 4 (0.900); recommended 2 (0.896): the smallest within 0.005 of it"


def test_tolerance_zero_recommends_the_best_and_the_order_of_the_rows_does_not_matter():
    c = choose_window(rows([(5, 0.9), (1, 0.5), (4, 0.9), (2, 0.899)]), tolerance=0)
    assert (c.best, c.recommended) == (4, 4) and not c.exact  # no budget given: not known to be every window
    assert pick([0.1, 0.3, 0.3], 0) == (1, 1) and pick([0.1, 0.3, 0.3], 0.2) == (1, 0)
    with pytest.raises(ValueError):
        pick([], 0.005)
    with pytest.raises(ValueError):
        pick([0.1], -0.1)


def test_a_sample_is_not_exact_and_says_so():
    c = choose_window(rows([(1, 0.5), (9, 0.8), (17, 0.7)]), budget=32)
    assert not c.exact and not covers([1, 9, 17], 32) and covers(range(1, 32), 32)
    assert c.sentence().startswith("peak so far 9 (0.800), of the windows sampled")
    assert WindowChoice(**c.to_dict()) == c


# ---- every path on the real trace --------------------------------------------------------------

@pytest.fixture(scope="module")
def exact() -> WindowChoice:
    trace = resolve_trace(REAL)
    from kvsim.sim.simulate import sweep

    return choose_window(sweep(trace, "h2o", BUDGET, "recent_window", range(1, BUDGET)), budget=BUDGET)


@pytest.fixture(scope="module")
def tuned():
    """``tune``'s sweep of the real trace (every window 1 .. 255), made once for the tests that read its
    windows and curves. By retained mass: the tests here read nothing that ``by`` chooses, and its default
    (the attention-output error of every candidate window, one replay each; tune by that proxy is checked
    on small traces in tests/test_proxies.py) is half a minute of the 4096-step trace. The CLI's default
    run is test_tune_names_the_same_windows's."""
    return tune(resolve_trace(REAL), "h2o", BUDGET, by="retained_mass")


def curve_of(fig: dict, policy: str) -> dict:
    (trace,) = [t for t in fig["data"] if t.get("name") == policy and t.get("xaxis", "x") == "x"]
    return trace


def main_json(capsys, *args: str):
    assert cli.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_real_trace_has_a_flat_top_where_a_sample_stops_elsewhere(exact):
    assert exact.exact and exact.best != exact.recommended  # (196 and 134 when this was written)
    assert exact.best_mass - exact.recommended_mass <= TOLERANCE


def test_sweep_marks_the_best_and_the_recommended_row(capsys, exact):
    doc = main_json(capsys, "sweep", "--trace", REAL, "--policy", "h2o", "--budget", str(BUDGET), "--recent-window", "1:255")
    assert isinstance(doc, list) and len(doc) == BUDGET - 1  # still a list of rows, two keys added to each
    assert [r["recent_window"] for r in doc if r["best"]] == [exact.best]
    assert [r["recent_window"] for r in doc if r["recommended"]] == [exact.recommended]
    assert cli.main(["sweep", "--trace", REAL, "--policy", "h2o", "--budget", str(BUDGET), "--recent-window", "1:255"]) == 0
    text = capsys.readouterr().out
    assert (f"best recent_window {exact.best} (retained mass {exact.best_mass:.4f}); recommended {exact.recommended} "
            f"({exact.recommended_mass:.4f}): the smallest within 0.005 of the best, of every window 1..budget - 1") in text


def test_table_and_claims_name_the_same_windows(capsys, exact):
    doc = main_json(capsys, "table", "--trace", REAL)
    assert {k: doc["window"][k] for k in ("best", "recommended", "exact", "tolerance")} == {
        "best": exact.best, "recommended": exact.recommended, "exact": True, "tolerance": TOLERANCE}
    assert doc["sweep"]["argmax"] != exact.best  # the sampled 8..192 stops elsewhere; it is labelled as a sample
    from kvsim.analysis.claims import ledger

    (saturates,) = [r for r in ledger(resolve_trace(REAL)) if r["id"] == "h2o-saturates-at-64"]
    assert saturates["figures"]["best_recent_window"] == exact.best
    assert saturates["figures"]["recommended_recent_window"] == exact.recommended
    assert "argmax_recent_window" not in saturates["figures"]  # the sampled one is named as such
    assert f"best {exact.best} ({exact.best_mass:.4f}); recommended {exact.recommended}" in saturates["note"]


def test_tune_names_the_same_windows(capsys, exact, tuned):
    doc = main_json(capsys, "tune", "--trace", REAL, "--serial", "--quiet")
    (row,) = doc["layers"]
    assert (row["best_window"], row["recommended_window"]) == (exact.best, exact.recommended)
    assert tuned.choice(tuned.traces[0]) == exact


def test_the_app_marks_the_exact_best_and_recommended_window(exact):
    # every window of the 4096-step trace on a fresh cache: 77 s on the quiet 2-core machine, past 120 s at load 5
    at = run({"trace": REAL, "budget": str(BUDGET), "curve_policy": "h2o"}, view="Choosing recent_window", timeout=600)
    assert problems(at) == [] and [e.value for e in at.error] == []
    fig, truth = charts(at)  # the curve, then the model's KL under it (shipped truth for this recording)
    assert named(truth, "KL (the truth)")
    assert values(curve_of(fig, "h2o")["x"]) == list(range(1, BUDGET))  # every window, so the choice is exact
    notes = [a["text"] for a in fig["layout"]["annotations"]]
    assert any(n.startswith(f"best {exact.best}: {exact.best_mass:.3f}") for n in notes), notes
    assert any(n.startswith(f"recommended {exact.recommended}: {exact.recommended_mass:.3f}") for n in notes), notes
    assert not any("peak" in n for n in notes)
    (mark,) = named(fig, f"recommended ({exact.recommended})")[:1]
    assert values(mark["x"]) == [exact.recommended]
    text = " ".join(m.value for m in at.markdown)
    assert (f"the **best** is {exact.best} ({exact.best_mass:.3f}); the **recommended** is {exact.recommended} "
            f"({exact.recommended_mass:.3f}), the smallest within 0.005 of the best") in text


def test_a_sampled_curve_in_the_app_calls_its_peak_the_peak_so_far(monkeypatch):
    from kvsim.app import curve_tab as curve

    monkeypatch.setattr(curve, "every_window", lambda trace, budget, primary: False)
    at = run({"trace": REAL, "budget": str(BUDGET), "curve_policy": "h2o"}, view="Choosing recent_window")
    assert problems(at) == [] and [e.value for e in at.error] == []
    fig, truth = charts(at)  # the curve, then the model's KL under it (shipped truth for this recording)
    assert named(truth, "KL (the truth)")
    assert len(values(curve_of(fig, "h2o")["x"])) < BUDGET - 1
    notes = [a["text"] for a in fig["layout"]["annotations"]]
    assert any(n.startswith("peak so far at ") and "of the windows sampled" in n for n in notes), notes
    assert not any(n.startswith(("best ", "recommended ")) for n in notes) and not named(fig, "recommended")
    text = " ".join(m.value for m in at.markdown)
    assert "peaks so far (of the windows sampled) at" in text or "its highest point so far" in text


def test_the_model_view_labels_its_windows_by_the_same_rule(tuned):
    from kvsim.views import model_figures

    t = tuned.traces[0]
    fig = model_figures.tune_curve(tuned, t.layer, t.head)
    names = [d.name for d in fig.data]
    assert f"recommended {t.recommended_window} (the smallest within 0.005 of the best)" in names
    assert f"best {t.best_window}" in names
    assert t.best_mass == float(np.max(t.retained_mass))  # the curve's largest value itself: no arithmetic, no tolerance


def test_the_recommended_mark_rides_on_a_mark_already_there_else_rings_its_own_point():
    from kvsim.views import figures

    curve = [{"recent_window": w, "retained_mass": m, "top_k_recall": m} for w, m in
             zip(range(1, 10), [0.5, 0.7, 0.9, 0.9, 0.9, 0.9, 0.9, 0.95, 0.9], strict=True)]
    fig = figures.recent_window_curve(curve, current=1, default=2, band=3, budget=10)
    names = [t.name for t in fig.data]
    assert "recommended (8): the smallest within 0.005 of the best" in names  # best 8 alone: its own ring
    assert [a.text for a in fig.layout.annotations if a.text.startswith(("best", "recommended"))] == [
        "best and recommended 8: 0.950"]
    curve[2]["retained_mass"] = 0.949  # now window 3, the band, is within 0.005 of the best
    fig = figures.recent_window_curve(curve, current=1, default=2, band=3, budget=10)
    names = [t.name for t in fig.data]
    assert "trace band (3), recommended: the smallest within 0.005 of the best" in names
    assert not any(n.startswith("recommended (") for n in names)  # said on the band's mark, not drawn over it
    assert [a.text for a in fig.layout.annotations if a.text.startswith(("best", "recommended"))] == [
        "recommended 3: 0.949", "best 8: 0.950"]

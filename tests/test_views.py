"""kvsim.views.support: the logic of the app's claims, model and quality views, without Streamlit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvsim.analysis import claims
from kvsim.analysis.tune import tune
from kvsim.data.catalog import resolve_trace
from kvsim.views import support as views
from kvsim.views.quality_figures import spearman


def test_claim_links_carry_the_view_and_the_apps_trace_name():
    view = {"view": "Choosing recent_window", "trace": "gemma3-270m-heapq-L05", "budget": "256",
            "policies": "streaming_llm,h2o", "recent_window": "64"}
    link = views.claim_link(view, "gemma3-270m-heapq:L05")
    assert link.startswith("?") and " " not in link
    assert views.link_params(link) == {**view, "trace": "gemma3-270m-heapq:L05"}
    assert views.link_params(views.claim_link({"view": "Policy lab"}, "canonical")) == {"view": "Policy lab"}


def test_every_claim_has_a_mark_and_a_colour():
    assert set(views.VERDICT_MARKS) == set(views.VERDICT_COLOURS) == set(claims.VERDICTS)


def test_bundle_selectors_resolve_to_each_layer():
    names = views.bundle_trace_names()
    assert names[0] == "gemma3-270m-heapq:L00" and len(names) == 18
    trace = resolve_trace(names[5])
    assert trace.steps == 1024


def test_a_click_on_the_heatmap_picks_its_row(make_trace):
    traces = [make_trace(40, seed=s, name=f"t{s}") for s in range(3)]
    result = tune(traces, "h2o", 16)
    picked = {"selection": {"points": [{"x": 4, "y": 2, "curve_number": 0}]}}
    assert views.selected_row(picked, result) == (result.traces[2].layer, result.traces[2].head)
    assert views.selected_row({"selection": {"points": []}}, result) is None
    assert views.selected_row({"selection": {"points": [{"y": 7}]}}, result) is None
    assert views.selected_row(None, result) is None


def _result(policy, mode, mass, nll, **params):
    return {"policy": policy, "budget": 64, "mode": mode, "params": params, "steps": 256, "delta_nll": nll,
            "kl": nll / 2, "retained_mass": mass}


def test_quality_results_read_the_file_and_refuse_a_damaged_one(tmp_path):
    assert views.quality_results(tmp_path / "absent.json") is None
    rows = [_result("h2o", "closed", 0.9, 0.1, recent_window=8), _result("h2o", "closed", 0.8, 0.3, recent_window=16)]
    wrapped = tmp_path / "q.json"
    wrapped.write_text(json.dumps({"meta": {"command": "x"}, "results": rows}))
    assert views.quality_results(wrapped) == (rows, {"command": "x"})
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(rows))
    assert views.quality_results(bare) == (rows, {})
    for text in ("{", json.dumps({"results": []}), json.dumps([{"policy": "h2o"}])):
        wrapped.write_text(text)
        with pytest.raises(views.QualityResultsError):
            views.quality_results(wrapped)


def test_rank_correlations_are_spearmans_per_mode():
    rng = np.random.default_rng(0)
    rows = [_result("h2o", mode, float(m), float(n), recent_window=w)
            for mode in ("closed", "open") for w, (m, n) in enumerate(rng.random((6, 2)))]
    rho = views.rank_correlations(rows)
    for mode in ("closed", "open"):
        pts = [r for r in rows if r["mode"] == mode]
        assert rho[mode] == (spearman([r["retained_mass"] for r in pts], [r["delta_nll"] for r in pts]), 6)
    assert views.rho_text(math.nan) == "n/a" and views.rho_text(-0.5) == "-0.500"
    assert views.swept_policies(rows + [_result("tova", "open", 0.5, 0.5)]) == ["h2o"]


@pytest.mark.parametrize(("rho", "verdict"), [
    (-0.95, "A good proxy here"), (-0.7, "A good proxy here"), (-0.5, "A fair proxy here"), (-0.3, "A weak proxy here"),
    (-0.1, "No useful agreement"), (0.064, "No useful agreement"), (0.5, "The wrong way round"), (1.0, "The wrong way round"),
])
def test_a_rank_correlation_is_read_in_words(rho, verdict):
    """Issue 44: the quality view showed a large "0.064" with no verdict and no word on which sign is good."""
    text = views.rho_reading(rho)
    assert text.startswith(f"**{verdict}**") and "A good proxy is near -1" in text
    assert ("wrong side of 0" in text) == (rho >= 0)


def test_no_rank_correlation_is_read_as_none():
    assert views.rho_reading(math.nan).startswith("**No reading**")


def test_the_shipped_results_are_what_the_view_reads():
    found = views.quality_results()
    assert found is not None, f"no {views.QUALITY_RESULTS.name}: produce it with {views.QUALITY_COMMAND}"
    results, meta = found
    assert meta["command"] == views.QUALITY_COMMAND
    assert {r["mode"] for r in results} == {"closed", "open"} and "h2o" in views.swept_policies(results)


def test_the_disk_cache_is_read_one_run_at_a_time(tmp_path):
    def put(name, steps, result):
        key = {"model": "m", "tokens": "t", "steps": steps}
        (tmp_path / f"{name}.json").write_text(json.dumps({"key": key, "result": result}))

    put("a", 256, _result("h2o", "open", 0.9, 0.1, recent_window=8))
    put("b", 256, _result("h2o", "open", 0.8, 0.2, recent_window=16))
    put("c", 1024, _result("h2o", "open", 0.7, 0.3, recent_window=8))
    (tmp_path / "d.json").write_text("{")
    found = views.cached_quality_results(tmp_path)
    assert len(found) == 2 and {r["steps"] for r in found} == {256}
    assert views.cached_quality_results(tmp_path / "absent") == []


def test_the_quality_scatter_colours_each_policy_as_every_view_does():
    """Issue 44: a palette by index gave a policy another colour here than on every other chart, and
    repeated after eight; each policy now has its own, held apart from every other (test_views_text.py)."""
    import kvsim
    from kvsim.views import quality_figures

    results, _meta = views.quality_results()
    fig = quality_figures.scatter_figure(results)
    for t in fig.data:
        policy = t.name.rsplit(" (", 1)[0]
        assert t.marker.color == kvsim.POLICIES[policy].display.colour, t.name
    assert len({t.marker.color for t in fig.data}) == len({r["policy"] for r in results})

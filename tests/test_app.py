"""The app's wiring, through Streamlit's AppTest: no browser, the script run as the server runs it."""

from __future__ import annotations

import base64
import io
import json
import re
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

import kvsim

APP = str(Path(__file__).resolve().parent.parent / "app.py")
TIMEOUT = 120  # the first run builds the canonical trace and replays it; later runs hit the caches


def run(query: dict | None = None, view: str | None = None, timeout: float = TIMEOUT) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=timeout)
    at.query_params.update(query or {})
    if view is not None:
        at.query_params["view"] = view
    return at.run()


def problems(at: AppTest) -> list[str]:
    return [e.value for e in at.exception]


def charts(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def named(spec: dict, prefix: str) -> list[dict]:
    return [t for t in spec["data"] if str(t.get("name", "")).startswith(prefix)]


def values(v) -> list:
    """A figure array as plotly.js receives it: a list, or a base64 typed array."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v)


def widget(at: AppTest, kind: str, label: str, sidebar: bool = True):
    where = at.sidebar if sidebar else at.main
    found = [w for w in getattr(where, kind) if w.label == label]
    assert found, f"no {kind} labelled {label!r}"
    return found[0]


def test_defaults_render_the_three_policies_without_errors():
    at = run()
    assert problems(at) == [] and [e.value for e in at.error] == []
    (kept,) = charts(at)
    mains = [t["name"] for t in kept["data"] if t["type"] == "image" and t["name"] in kvsim.POLICIES]
    assert mains == ["sliding_window", "streaming_llm", "h2o"]
    assert [t["name"] for t in kept["data"] if t["type"] == "image"].count("sinks") == 3  # the widened strips
    assert at.query_params["trace"] == "canonical" and at.query_params["budget"] == "256"
    assert at.query_params["policies"] == "sliding_window,streaming_llm,h2o"
    assert at.query_params["recent_window"] == "32" and at.query_params["step"] == "4096"
    labels = {b.label for b in at.get("download_button")}
    assert {"per-step metrics (CSV)", "this figure (HTML)"} <= labels


@pytest.mark.parametrize(
    ("view", "kind"),
    [("Cumulative scores", "histogram"), ("Choosing recent_window", "scatter"), ("The trace", "image")],
)
def test_every_view_renders(view, kind):
    at = run(view=view)
    assert problems(at) == [] and [e.value for e in at.error] == []
    specs = charts(at)
    assert specs and any(t["type"] == kind for s in specs for t in s["data"])


def test_policies_from_the_registry_are_all_offered():
    at = run()
    assert widget(at, "multiselect", "policies").options == list(kvsim.POLICIES)


def test_changing_recent_window_moves_the_curve_marker_and_the_heatmap():
    at = run(view="Choosing recent_window")
    (curve,) = charts(at)
    assert [t["x"] for t in named(curve, "current recent_window")] == [[32], [32]]
    assert any("the gain stops at 64, the band's width" in m.value for m in at.markdown)
    widget(at, "number_input", "recent_window").set_value(64)
    at.run()
    assert problems(at) == []
    (curve,) = charts(at)
    assert [t["x"] for t in named(curve, "current recent_window")] == [[64], [64]]
    assert at.query_params["recent_window"] == "64"
    # the number box beside the curve sets it everywhere too
    widget(at, "number_input", "recent_window", sidebar=False).set_value(48).run()
    assert widget(at, "number_input", "recent_window").value == 48
    (curve,) = charts(at)
    assert named(curve, "current recent_window")[0]["x"] == [48]


def test_the_curve_draws_the_family_and_exports_both_sweeps(deferred_downloads):
    # the CSV is built only when clicked (a deferred download): its callable is kept (conftest.deferred_downloads)
    deferred = deferred_downloads
    at = run(view="Choosing recent_window")
    for _ in range(120):  # the exact optimum is solved in the background: the page says so, then draws it
        if not any("being solved in the background" in i.value for i in at.info):
            break
        time.sleep(0.5)
        at.run()
    assert problems(at) == [] and [e.value for e in at.error] == []
    (curve,) = charts(at)
    def exactly(name):  # "h2o" is also the prefix of h2o_normalized's name
        return [t for t in curve["data"] if t.get("name") == name]

    assert len(exactly("h2o")) == 2 and len(exactly("scissorhands")) == 2
    assert len(exactly("h2o_normalized")) == 2 and len(exactly("snapkv")) == 2  # every policy with a recent_window
    # a grid over 1..255, the marks (default 32, band 64) and every window next to the peak: not all 255
    windows = values(named(curve, "scissorhands")[0]["x"])
    assert windows == sorted(windows) and {1, 32, 64, 255} <= set(windows) and len(windows) < 80
    assert set(range(60, 69)) <= set(values(exactly("h2o")[0]["x"]))
    for line in ("tova", "greedy_future (offline reference)", "optimal (offline reference)", "upper bound (offline reference)"):
        (mass, recall) = named(curve, line)
        assert mass["y"][0] == mass["y"][1]  # a horizontal line
    assert {t.get("legend") for t in named(curve, "greedy_future") + named(curve, "optimal") + named(curve, "upper bound")} == {"legend2"}
    story = " ".join(m.value for m in at.markdown)
    assert "**scissorhands** also peaks at 64" in story and "offline references, not policies to deploy" in story
    (name,) = [n for n in deferred if n.endswith("recent_window-sweep.csv")]
    table = pd.read_csv(io.StringIO(deferred[name]()))
    every = set().union(*(values(exactly(n)[0]["x"]) for n in ("h2o", "scissorhands", "h2o_normalized", "snapkv")))
    assert list(table["recent_window"]) == sorted(every)  # every window any curve replayed, once
    assert {"h2o retained_mass", "scissorhands retained_mass", "scissorhands top_32_recall"} <= set(table.columns)
    at64 = table[table["recent_window"] == 64]
    assert at64["h2o retained_mass"].item() > at64["scissorhands retained_mass"].item()


def test_the_offline_references_are_policies_the_views_can_show():
    at = run({"policies": "h2o,greedy_future"})
    assert problems(at) == [] and [e.value for e in at.error] == []
    (kept,) = charts(at)
    titles = " ".join(a["text"] for a in kept["layout"]["annotations"])
    assert "greedy_future" in titles


def test_changing_budget_changes_the_kept_positions():
    at = run()
    before = charts(at)[0]
    widget(at, "number_input", "budget").set_value(128).run()
    assert problems(at) == []
    after = charts(at)[0]
    assert before["data"][0]["source"] != after["data"][0]["source"]
    assert before["data"][0]["source"].startswith("data:image/png;base64,")
    titles = " ".join(a["text"] for a in after["layout"]["annotations"])
    assert "h2o (recent_window=32)" in titles


def test_step_moves_the_score_view():
    at = run(view="Cumulative scores")
    at.sidebar.slider[0].set_value(2000).run()
    (spec,) = charts(at)
    assert "step 2000" in spec["layout"]["title"]["text"]


def test_query_parameters_restore_a_state():
    at = run(
        {"policies": "streaming_llm,h2o", "budget": "128", "recent_window": "64", "sinks": "2", "step": "1500"},
        view="Choosing recent_window",
    )
    assert problems(at) == [] and [e.value for e in at.error] == []
    assert widget(at, "multiselect", "policies").value == ["streaming_llm", "h2o"]
    assert widget(at, "number_input", "budget").value == 128
    assert widget(at, "number_input", "sinks").value == 2
    assert at.sidebar.slider[0].value == 1500
    (curve,) = charts(at)
    assert named(curve, "current recent_window")[0]["x"] == [64]
    swept = values(named(curve, "h2o")[0]["x"])
    assert swept[0] == 1 and swept[-1] == 127 and 64 in swept  # swept to budget - 1, the current window included
    assert named(curve, "streaming_llm (sinks=2)")


def test_contradictory_settings_show_an_error_not_a_traceback():
    at = run({"budget": "256", "recent_window": "300", "sinks": "256"}, view="Choosing recent_window")
    assert problems(at) == []
    errors = " ".join(e.value for e in at.error)
    assert "recent_window must be less than budget (256), got 300" in errors
    assert "sinks must be less than budget (256), got 256" in errors
    # the policy that can still run does
    widget(at, "number_input", "budget").set_value(1).run()
    assert problems(at) == []
    assert "needs a budget of at least 2" in " ".join(e.value for e in at.error)


def test_a_bad_link_is_reported_and_defaults_used():
    at = run({"budget": "lots", "trace": "nowhere", "policies": "h2o,nonsense"})
    assert problems(at) == []
    warnings = " ".join(w.value for w in at.warning)
    assert "budget='lots'" in warnings and "'nowhere'" in warnings and "nonsense" in warnings
    assert widget(at, "number_input", "budget").value == 256
    assert widget(at, "multiselect", "policies").value == ["h2o"]


def npz_bytes(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def test_an_uploaded_trace_is_used_and_a_bad_one_reported():
    at = run()
    a = np.tril(np.random.default_rng(3).random((65, 65)), k=-1).astype(np.float32)
    at.sidebar.file_uploader[0].set_value(("mine.npz", npz_bytes(attention=a), "application/octet-stream"))
    at.run()
    assert problems(at) == [] and [e.value for e in at.error] == []
    assert at.sidebar.slider[0].max == 64
    assert widget(at, "selectbox", "trace").value == "uploaded: mine.npz"
    # 64 steps within a budget of 256: nothing is ever evicted, and the page says so
    assert any("nothing is ever evicted" in w.value for w in at.warning)
    bad = np.tril(np.ones((5, 5)), k=-1).astype(np.float32)
    bad[3, 1] = np.nan
    at.sidebar.file_uploader[0].set_value(("broken.npz", npz_bytes(attention=bad), "application/octet-stream"))
    at.run()
    assert problems(at) == []
    (message,) = [e.value for e in at.error]
    assert message.startswith("broken.npz: step 3") and "\n" not in message
    assert message.endswith("; showing canonical instead.")
    assert widget(at, "selectbox", "trace").value == "canonical"


def test_choosing_a_shipped_trace_replaces_an_upload():
    at = run()
    a = np.tril(np.random.default_rng(3).random((65, 65)), k=-1).astype(np.float32)
    at.sidebar.file_uploader[0].set_value(("mine.npz", npz_bytes(attention=a), "application/octet-stream")).run()
    widget(at, "selectbox", "trace").set_value("gemma3-270m-L05").run()
    assert problems(at) == [] and at.query_params["trace"] == "gemma3-270m-L05"
    assert widget(at, "selectbox", "trace").value == "gemma3-270m-L05"
    assert at.sidebar.slider[0].max == 4096 and not at.sidebar.file_uploader[0].value


# --------------------------------------------------------------------------------------------
# the sentences on the page are the trace's own figures


def shown(at: AppTest) -> str:
    return " ".join(m.value for m in at.markdown)


def expected(trace: kvsim.Trace):
    from kvsim.views import figures, story

    f = figures.trace_features(trace)
    info = kvsim.describe(trace, band=f.band, sinks=max(1, f.sinks))
    return f, info, figures, story


@pytest.mark.parametrize("name", ["canonical", "gemma3-270m-L11"])
def test_the_kept_and_trace_views_quote_the_trace(name):
    trace = kvsim.resolve_trace(name)
    f, info, figures, story = expected(trace)
    at = run({"trace": name})
    assert problems(at) == [] and [e.value for e in at.error] == []
    text = shown(at)
    assert story.sink_text(f, info) in text
    assert f"{info['sink_share']:.2f} of each row" in text
    assert story.band_text(f, info, figures.age_span(f, [32], 256)) in text
    fates = {}
    for policy, params in (("sliding_window", {}), ("streaming_llm", {"sinks": 4}), ("h2o", {"recent_window": 32})):
        r = kvsim.replay(trace, policy, budget=256, record_kept=True, **params)
        fates[figures.policy_label(r)] = figures.heavy_fates(r.kept_history, f)
    assert story.heavy_text(f, fates) in text
    if name != "canonical":
        assert "No sharp recency band" in text and "stale" not in text
    at = run({"trace": name}, view="The trace")
    assert story.trace_text(f, info) in shown(at)
    (matrix,) = charts(at)
    notes = " ".join(a.get("text", "") for a in matrix["layout"].get("annotations", []))
    assert ("recency band" in notes) == f.band_known


def test_an_uploaded_random_trace_is_described_as_having_no_features():
    rng = np.random.default_rng(11)
    n = 301
    a = np.tril(rng.gamma(0.3, size=(n, n)) + 1e-6, k=-1).astype(np.float32)
    trace = kvsim.from_array(a.astype(np.float64), name="random")
    f, info, figures, story = expected(trace)
    assert f.sinks == 0 and not f.band_known and f.heavy == ()
    at = run({"budget": "64"})
    at.sidebar.file_uploader[0].set_value(("random.npz", npz_bytes(attention=a), "application/octet-stream")).run()
    assert problems(at) == [] and [e.value for e in at.error] == []
    text = shown(at)
    assert "**Sinks**: this trace has none" in text and "**Heavy hitters**: none on this trace" in text
    assert "No sharp recency band" in text and f"take {info['recent_share']:.2f} of each row" in text
    assert not any("nothing is ever evicted" in w.value for w in at.warning)


def test_the_score_view_names_stale_heavy_hitters_only_where_there_are_some():
    at = run({"policies": "h2o,scissorhands"}, view="Cumulative scores")
    assert problems(at) == []
    assert "go stale" in shown(at) and "Ringed crosses (legend: *evicted at this step*)" in shown(at)
    specs = charts(at)
    assert len(specs) == 2
    for spec in specs:
        lo, hi = spec["layout"]["yaxis"]["range"]
        assert -6 < lo < hi < 4.5  # log10 units: the scores' own span, never 1e30
    at = run({"trace": "gemma3-270m-L11", "policies": "h2o"}, view="Cumulative scores")
    assert "none is stale" in shown(at) and "go stale" not in shown(at)


def test_the_difference_mode_is_a_link():
    at = run({"kept_mode": "difference", "policies": "streaming_llm,sliding_window"})
    assert problems(at) == [] and [e.value for e in at.error] == []
    (kept,) = charts(at)
    assert "kept by streaming_llm only" in {t.get("name") for t in kept["data"]}
    assert "streaming_llm holds" in shown(at) and "0.140 above sliding_window's 0.597" in shown(at)
    assert at.query_params["kept_mode"] == "difference"


@pytest.mark.parametrize("step", ["sinks", "heavy-hitters", "window"])
def test_each_tour_step_is_a_link_that_sets_the_controls_and_the_view(step):
    from kvsim.views import tour

    s = tour.BY_KEY[step]
    at = run({"tour": step})
    assert problems(at) == [] and [e.value for e in at.error] == [] and not at.warning
    assert s.look in shown(at) and at.query_params["tour"] == step
    assert widget(at, "multiselect", "policies").value == s.settings["policies"]
    assert at.session_state["view"] == s.view
    if s.view == "Choosing recent_window":
        (curve,) = charts(at)
        assert named(curve, "current recent_window")[0]["x"] == [s.settings["recent_window"]]
    else:
        (kept,) = charts(at)
        assert ("kept by streaming_llm only" in {t.get("name") for t in kept["data"]}) == (
            s.settings["kept_mode"] == "difference")


def test_the_tour_walks_forward_and_can_be_left():
    at = run({"tour": "sinks"})
    [b for b in at.button if b.label == "Heavy hitters →"][0].click().run()
    assert at.query_params["tour"] == "heavy-hitters" and at.query_params["kept_mode"] == "each"
    assert widget(at, "multiselect", "policies").value == ["streaming_llm", "h2o"]
    [b for b in at.button if b.label == "leave the tour"][0].click().run()
    assert "tour" not in at.query_params and problems(at) == []
    bad = run({"tour": "nowhere"})
    assert any("tour step 'nowhere'" in w.value for w in bad.warning)


def test_starting_the_tour_over_an_upload_shows_the_tour_trace():
    at = run()
    a = np.tril(np.random.default_rng(3).random((65, 65)), k=-1).astype(np.float32)
    at.sidebar.file_uploader[0].set_value(("mine.npz", npz_bytes(attention=a), "application/octet-stream")).run()
    [b for b in at.sidebar.button if b.label == "start the guided tour"][0].click().run()
    assert problems(at) == [] and widget(at, "selectbox", "trace").value == "canonical"
    assert at.sidebar.slider[0].max == 4096 and at.query_params["tour"] == "sinks"


# --- the claims ledger, your model, proxy against truth ----------------------------------------------

from kvsim.analysis import claims, lab  # noqa: E402
from kvsim.analysis.tune import tune  # noqa: E402
from kvsim.data.catalog import resolve_bundle, resolve_trace  # noqa: E402
from kvsim.policies import all_tunables  # noqa: E402
from kvsim.views import quality_figures  # noqa: E402
from kvsim.views import support as views  # noqa: E402

LINK = re.compile(r"\]\((\?[^)\s]+)\)")
#: every query parameter the app reads (read_link, the tabs' view, the tour, the lab's preset)
APP_KEYS = {"view", "trace", "policies", "budget", "step", "curve_policy", "kept_mode", "bundle", "tour", "lab_preset",
            *all_tunables()}


def claim_cards(at: AppTest) -> dict[str, str]:
    """claim id -> the verdict its card shows, from the card's first line."""
    out = {}
    for m in at.markdown:
        found = re.search(r"^:\w+\[:material/\w+: \*\*([a-z ]+)\*\*\] · `([^`]+)`", m.value)
        if found:
            out[found.group(2)] = found.group(1)
    return out


@pytest.mark.parametrize("trace", ["canonical", "gemma3-270m-L11"])
def test_claims_view_lists_every_claim_with_the_ledgers_verdict(trace):
    at = run({"trace": trace}, view="Claims")
    assert problems(at) == [] and [e.value for e in at.error] == []
    expected = {r["id"]: r["verdict"] for r in claims.ledger(resolve_trace(trace))}
    assert claim_cards(at) == expected
    (ledger,) = charts(at)  # the ledger at a glance: each bar a verdict's count per card, summing to every claim
    assert sum(sum(bar["x"]) for bar in ledger["data"]) == len(expected)
    assert {bar["name"] for bar in ledger["data"]} == set(expected.values())
    links = [link for m in at.markdown for link in LINK.findall(m.value)]
    assert len(links) == len(expected)
    tabs = set(app_tabs())
    for link in links:
        params = views.link_params(link)
        assert set(params) <= APP_KEYS, link
        assert params["view"] in tabs and params.get("trace", trace) == trace
        if "lab_preset" in params:
            assert params["lab_preset"] in lab.PRESETS


def app_tabs() -> list[str]:
    from kvsim.app.state import TABS

    return list(TABS)


def test_a_claims_link_opens_its_view_with_its_settings():
    record = next(r for r in claims.ledger(resolve_trace("canonical")) if r["id"] == "h2o-64-beats-on-both")
    at = run(views.link_params(views.claim_link(record["view"], "canonical")))
    assert problems(at) == [] and [e.value for e in at.error] == []
    assert at.query_params["view"] == "Choosing recent_window" and at.query_params["recent_window"] == "64"
    assert at.session_state["curve_policy"] == "h2o" and at.session_state["policies"] == ["streaming_llm", "h2o"]


def test_a_claims_link_opens_the_lab_on_its_preset():
    at = run({"lab_preset": "h2o recent_window 0 pitfall"}, view="Policy lab")
    assert problems(at) == [] and [e.value for e in at.error] == []
    assert widget(at, "selectbox", "preset", sidebar=False).value == "h2o recent_window 0 pitfall"


def test_model_view_shows_every_layer_and_the_tuned_windows():
    budget = 64  # a quarter of the windows of the default: the same code, a faster test
    at = run({"budget": str(budget)}, view="Your model")
    assert problems(at) == [] and [e.value for e in at.error] == []
    expected = tune(resolve_bundle("gemma3-270m-heapq"), "h2o", budget)
    heat = [s for s in charts(at) if any(t["type"] == "heatmap" for t in s["data"])]
    assert len(heat) == 1
    (z,) = [t for t in heat[0]["data"] if t["type"] == "heatmap"]
    rows = values(z["y"])
    assert len(rows) == 18 == len(expected.traces)
    (rec,) = named(heat[0], "recommended")
    assert values(rec["x"]) == [t.recommended_window for t in expected.traces]
    table = at.dataframe[0].value
    assert table["recommended recent_window"].tolist() == [t.recommended_window for t in expected.traces]
    assert any("recent_window" in s["layout"]["xaxis"]["title"]["text"] and "L00" in s["layout"]["title"]["text"]
               for s in charts(at))  # the first layer's curve


def test_model_view_shows_the_command_and_the_python_that_deploy_the_recommended_windows():
    at = run({"budget": "64"}, view="Your model")
    assert problems(at) == [] and [e.value for e in at.error] == []
    expected = tune(resolve_bundle("gemma3-270m-heapq"), "h2o", 64)
    shell, python = [c.value for c in at.code][-2:]
    # the tune file the shell lines write deploys exactly the per-layer windows the Python lines set
    assert ("kvsim tune --trace gemma3-270m-heapq --policy h2o --budget 64 --by retained_mass --per-layer --serial "
            "--json > tune.json") in shell
    assert "kvsim generate --model gemma3-270m --policy h2o --budget 64 --windows tune.json" in shell
    windows = {r["layer"]: r["recommended_window"] for r in expected.per_layer()}
    namespace: dict = {}
    exec(python.split("windows = ", 1)[1].split("\ncache")[0].join(["windows = ", ""]), namespace)  # the dict, as printed
    assert namespace["windows"] == windows and 'kvsim.hf.cache(model, "h2o", 64, windows=windows)' in python


def test_model_view_opens_a_layer_in_the_kept_views():
    at = run({"budget": "64"}, view="Your model")
    at.selectbox(key="model_layer_choice").set_value((5, 0)).run()
    at.button(key="open_layer").click().run(timeout=TIMEOUT)
    assert problems(at) == [] and [e.value for e in at.error] == []
    assert at.query_params["trace"] == "gemma3-270m-heapq:L05"
    assert at.query_params.get("view", "Kept positions") == "Kept positions"  # the first tab leaves the URL bare
    assert at.session_state["recent_window"] == tune(resolve_bundle("gemma3-270m-heapq"), "h2o", 64).traces[5].recommended_window
    (kept,) = charts(at)  # the kept panels of that layer, one per chosen policy
    assert [t["name"] for t in kept["data"] if t["type"] == "image" and t["name"] in kvsim.POLICIES] == [
        "sliding_window", "streaming_llm", "h2o"]


def test_quality_view_shows_the_rank_correlation_of_the_shown_results():
    at = run({"budget": "64"}, view="Proxy against truth")  # the shipped quality runs' budget
    assert problems(at) == [] and [e.value for e in at.error] == []
    results, _meta = views.quality_results()
    shown = {m.label: m.value for m in at.metric}
    for mode in ("closed", "open"):
        pts = [r for r in results if r["mode"] == mode]
        rho = quality_figures.spearman([r["retained_mass"] for r in pts], [r["delta_nll"] for r in pts])
        (label,) = [k for k in shown if k.startswith(f"Spearman rank correlation, {mode}")]
        assert shown[label] == f"{rho:.3f}"
    assert len(charts(at)) >= 2


def test_quality_view_says_how_to_produce_results_when_there_are_none(tmp_path, monkeypatch):
    monkeypatch.setattr(views, "QUALITY_RESULTS", tmp_path / "absent.json")
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))  # and an empty disk cache
    monkeypatch.setattr("kvsim.models.truth.documents", lambda: [])  # and no truth document's sweep
    at = run(view="Proxy against truth")
    assert problems(at) == [] and [e.value for e in at.error] == []
    # the one notice about results (a fresh install may add the engine's first-compile line beside it)
    (info,) = [i for i in at.info if "No quality results here yet" in i.value]
    assert views.QUALITY_COMMAND in info.value


@pytest.mark.parametrize("view", ["Your model", "Proxy against truth"])
def test_model_and_quality_views_render_on_a_real_trace(view):
    at = run({"trace": "gemma3-270m-L11", "budget": "64"}, view=view)
    assert problems(at) == [] and [e.value for e in at.error] == []
    assert at.query_params["trace"] == "gemma3-270m-L11" and charts(at)


def test_the_new_views_need_no_torch(monkeypatch):
    """torch is an optional extra (recording, quality): the app imports and draws every new view
    without it."""
    import sys

    for name in ("torch", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of either now raises ImportError
    for view in ("Claims", "Your model", "Proxy against truth"):
        at = run({"budget": "64"}, view=view)
        assert problems(at) == [] and [e.value for e in at.error] == [], view


def test_a_failed_optimum_solve_is_one_line_not_a_traceback(monkeypatch, tmp_path):
    from kvsim.policies import optimal

    def fail(*args, **kw):
        raise MemoryError("no room for the forfeit costs")

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))  # nothing solved on disk yet
    monkeypatch.setattr(optimal, "optimal_schedule", fail)
    at = run({"budget": "200"}, view="Choosing recent_window")
    for _ in range(40):  # the solve runs in the background; the page says so until it ends
        if not any("being solved in the background" in i.value for i in at.info):
            break
        time.sleep(0.25)
        at.run()
    assert problems(at) == []
    assert any("the exact optimum could not be solved: no room for the forfeit costs" in e.value for e in at.error)


def test_a_slow_curve_is_drawn_coarse_first_then_refined_in_the_background(monkeypatch):
    """Coarse first, then refined around the peak (its peak the peak so far), then every window (its
    exact best marked), each drawn as it ends; the last stage is held here until the refined one is seen."""
    import threading

    from kvsim.analysis.windows import choose_window, sweep_coarse_to_fine
    from kvsim.app import curve_tab as curve

    monkeypatch.setattr(curve, "PROGRESSIVE_COST", 0)  # every budget counts as slow (as 1024 is on the shipped traces)
    every_window = threading.Event()
    sweep = kvsim.sweep

    def held(trace, name, budget, param, values, **kw):  # the windows the refinement left, replayed once released
        values = list(values)
        if len(values) > 8:
            every_window.wait(60)
        return sweep(trace, name, budget, param, values, **kw)

    def coarse_to_fine(*args, **kwargs):  # the grid and its refinements: never held
        return sweep_coarse_to_fine(*args, **{**kwargs, "run": sweep})

    # the view's sweeps replayed, never read from the disk where an earlier test kept them (summaries.sweep)
    monkeypatch.setattr("kvsim.sim.summaries.sweep", held)
    monkeypatch.setattr(curve, "sweep_coarse_to_fine", coarse_to_fine)
    at = run({"budget": "96"}, view="Choosing recent_window")
    assert problems(at) == [] and [e.value for e in at.error] == []

    def peak_note(fig):
        (note,) = [a["text"] for a in fig["layout"]["annotations"] if "peak" in a["text"] or a["text"].startswith("best")]
        return note

    def still(text):
        return any(text in c.value for c in at.caption)

    (fig,) = charts(at)
    assert peak_note(fig).startswith("peak so far at ")
    assert len(values(named(fig, "h2o")[0]["x"])) <= 8 and not named(fig, "scissorhands")  # the coarse grid alone
    assert still("Still replaying in the background")
    assert not at.main.get("download_button")  # the first paint is the chart: the notes and downloads come refined
    for _ in range(480):  # each background replay that ends draws the page again
        if not still("Still replaying") or still("in the background: every window of h2o's curve; each"):  # only that left
            break
        time.sleep(0.25)
        at.run()
    assert problems(at) == [] and [e.value for e in at.error] == []
    assert still("every window of h2o's curve") and still("Refined around the peak")
    (fig,) = charts(at)
    exact = sweep_coarse_to_fine(resolve_trace("canonical"), "h2o", 96, "recent_window", 1, 95, marks=(32, 64),
                                 points=curve.curve_points(96))
    assert values(named(fig, "h2o")[0]["x"]) == [r["recent_window"] for r in exact]
    best = max(exact, key=lambda r: r["retained_mass"])
    # refined around its peak, the curve is still a sample (not every window): its peak is the peak so far
    # (a sample's peak is not called the best)
    assert peak_note(fig).startswith(f"peak so far at {best['recent_window']}: {best['retained_mass']:.3f}")
    assert named(fig, "scissorhands") and named(fig, "tova") and named(fig, "upper bound")
    assert len(at.main.get("download_button")) == 2
    every_window.set()
    for _ in range(480):
        if not still("Still replaying"):
            break
        time.sleep(0.25)
        at.run()
    assert problems(at) == [] and [e.value for e in at.error] == []
    (fig,) = charts(at)
    (h2o,) = [t for t in fig["data"] if t.get("name") == "h2o" and t.get("xaxis") == "x"]  # not h2o_normalized
    assert values(h2o["x"]) == list(range(1, 96))  # every window: its best is exact
    choice = choose_window(sweep(resolve_trace("canonical"), "h2o", 96, "recent_window", range(1, 96)), budget=96)
    assert choice.exact and peak_note(fig).startswith(f"best {'and recommended ' if choice.recommended == choice.best else ''}"
                                                      f"{choice.best}: {choice.best_mass:.3f}")
    assert "has every window 1 .. 95" in " ".join(m.value for m in at.markdown)


def test_the_curve_shows_the_truth_beside_the_proxy_and_its_sentence_holds_the_figures():
    """On the shipped bundle, the model's KL over the windows (shipped truth) under the curve, both
    optima marked, and the sentence's figures those of the truth and of the curve's recommendation."""
    from kvsim.analysis.windows import choose_window
    from kvsim.views import window_truth as vt

    at = run({"trace": "gemma3-270m-heapq:L11", "budget": "256", "policies": "h2o"}, view="Choosing recent_window")
    assert not problems(at)
    trace = kvsim.resolve_trace("gemma3-270m-heapq:L11")
    truth = vt.truth_for(trace.meta, "h2o", 256)
    # the shipped document, or one measured here that holds more windows of the same recording
    assert truth is not None and truth.source in ("shipped", "measured here") and len(truth.windows) >= 16
    rows = kvsim.sweep(trace, "h2o", 256, "recent_window", range(1, 256))
    proxy = choose_window(rows, budget=256).recommended
    v = vt.verdict(truth, proxy)
    text = " ".join(m.value for m in at.markdown)
    assert vt.sentence(truth, vt.layer_pick(proxy, "L11", trace.steps, 0.005)) in text
    assert f"recommends recent_window {proxy};" in text and f"least at {v['truth_window']} (KL {v['kl_best']:.4f})" in text
    assert f"costs {100 * v['cost']:+.0f}% KL" in text and ("agree" if v["agree"] else "disagree") in text
    fig = next(c for c in charts(at) if named(c, "KL (the truth)"))
    assert values(named(fig, "truth's best")[0]["x"]) == [v["truth_window"]]
    assert values(named(fig, "retained mass of L11 recommends")[0]["x"]) == [v["measured_window"]]


def test_the_canonical_trace_keeps_its_story_and_says_why_it_has_no_truth():
    at = run(view="Choosing recent_window")
    assert not problems(at)
    assert any("No truth for this trace: it names no model and text" in c.value for c in at.caption)
    assert not any(named(c, "KL (the truth)") for c in charts(at))

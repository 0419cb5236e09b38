"""``kvsim tune`` under a serving layout (docs/serving.md, "Tuning under a layout"): every candidate window and
baseline is measured under the layout (the replays ``kvsim.replay``/``replay_layer`` run under it), the truth
under it is ``measure_open``'s (cached under the layout, apart from the bare truth), ``--save-plan`` writes the
layout, ``--search-layout`` tunes under each candidate and keeps the best; bad input is one line before any trace
or model loads; without a layout tune is today's, key for key."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from doc_chains import chains
from doc_chains import run as run_chain
from test_quality import HAS_TORCH, STEPS, ByteTokenizer, _tiny

import kvsim
from kvsim import cli
from kvsim.analysis.tune import TuneError, layout_windows, tune
from kvsim.analysis.tune_layout import candidates, parse
from kvsim.cli.render import render
from kvsim.policies import PolicySpec
from kvsim.policykit.layouts import Layout
from kvsim.policykit.plan import Plan

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")


def run(capsys, *argv):
    code = cli.main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def _same_but_time(a: dict, b: dict) -> bool:
    strip = lambda d: {k: v for k, v in d.items() if k != "run"}  # noqa: E731
    return strip(a) == strip(b)


def test_every_window_and_baseline_is_measured_under_the_layout(make_trace):
    trace = make_trace(120, seed=4)
    layout = Layout(4, False, 4)
    result = tune(trace, "h2o", 32, by="retained_mass", layout=layout)
    windows = layout_windows("h2o", 32, layout, {})
    assert result.windows == windows and max(windows) < layout.floor(32) and len(windows) > 4
    (t,) = result.traces
    for w, mass, recall in zip(windows, t.retained_mass, t.top_k_recall, strict=True):
        r = kvsim.replay(trace, "h2o", budget=32, recent_window=w, layout=layout)
        assert (mass, recall) == (r.retained_mass, r.top_k_recall)
    for p, (mass, _) in t.baselines.items():
        assert mass == kvsim.replay(trace, p, budget=32, layout=layout).retained_mass
    bare = tune(trace, "h2o", 32, by="retained_mass", windows=windows)
    assert list(bare.traces[0].retained_mass) != list(t.retained_mass)  # the layout moved the curve
    doc = result.to_dict()
    assert (doc["layout"], doc["block_size"], doc["evict_every"], doc["memory"]) == ("block_size=4 evict_every=4", 4, 4, 32)
    assert doc["swept_windows"] == windows and doc["model_window"] in windows


def test_without_a_layout_tune_is_todays_key_for_key(make_trace, capsys):
    trace = make_trace(60, seed=5)
    today = tune(trace, "h2o", 16, by="retained_mass").to_dict()
    assert _same_but_time(tune(trace, "h2o", 16, by="retained_mass", layout=Layout()).to_dict(), today)
    assert not {"layout", "block_size", "memory", "swept_windows", "layout_search"} & set(today)
    argv = ["tune", "--trace", "gemma3-270m-L05", "--budget", "24", "--by", "retained_mass", "--serial", "--quiet", "--json"]
    code, plain, _ = run(capsys, *argv)
    code1, ones, _ = run(capsys, *argv, "--block-size", "1", "--evict-every", "1")
    assert code == code1 == 0 and _same_but_time(json.loads(plain), json.loads(ones))


def test_shared_selection_sweeps_a_layers_kv_heads_together(make_trace):
    from kvsim.sim.layered import replay_layer

    heads = [dataclasses.replace(make_trace(50, seed=s, name=f"L00-kv{s}"), meta={"layer": 0, "head": s}) for s in (0, 1)]
    layout = Layout(1, True, 1)
    result = tune(heads, "h2o", 16, by="retained_mass", layout=layout, windows=[2, 6, 10])
    for i, w in enumerate([2, 6, 10]):
        got = replay_layer(heads, PolicySpec.of("h2o", 16, recent_window=w), layout)["heads"]
        assert [t.retained_mass[i] for t in result.traces] == [g.retained_mass for g in got]
    alone = tune(heads, "h2o", 16, by="retained_mass", windows=[2, 6, 10])
    assert [list(t.retained_mass) for t in alone.traces] != [list(t.retained_mass) for t in result.traces]


def test_a_layout_the_policy_refuses_is_one_line_before_any_trace_loads(capsys, tmp_path):
    missing = str(tmp_path / "no-such-trace.npz")
    argv = ["tune", "--trace", missing, "--policy", "h2o", "--budget", "64", "--serial"]
    cases = [(["--block-size", "128"], "--block-size 128: block_size 128 is larger than the budget (64)"),
             (["--evict-every", "64"], "--evict-every 64: evict_every=64 leaves budget - k + 1 = 1: h2o's recent_window 1 must"),
             (["--evict-every", "65"], "--evict-every 65: evict_every 65 does not fit budget 64"),
             (["--block-size", "0"], "--block-size 0 must be at least 1"),
             (["--block-size", "16", "--per-layer"], "--per-layer is not measured under a serving layout yet"),
             (["--block-size", "16", "--allocate", "auto"], "--block-size 16 does not go with --allocate yet"),
             (["--search-layout", "page"], "--search-layout: 'page': the field searched is one of block_size, evict_every"),
             (["--search-layout", "block_size=16"], "a search needs two candidate values or more"),
             (["--search-layout", "block_size", "--block-size", "16"], "searches --block-size: give one or the other"),
             (["--search-layout", "block_size=1", "--evict-every", "1"], "a search needs two candidate values or more")]
    for flags, said in cases:
        code, out, err = run(capsys, *argv, *flags)
        assert code != 0 and out == "" and len(err.strip().splitlines()) == 1 and said in err, (flags, err)
    plan = tmp_path / "paged.json"
    plan.write_text(Plan(PolicySpec.of("h2o", 64, recent_window=8), layout=Layout(16)).to_json())
    for flags, said in ((["--block-size", "8"], f"--plan {plan} sets --block-size too: give it in one place"),
                        (["--search-layout", "block_size"], "sets the serving layout; search from a plan without one")):
        code, out, err = run(capsys, "tune", "--trace", missing, "--plan", str(plan), "--serial", *flags)
        assert code != 0 and out == "" and len(err.strip().splitlines()) == 1 and said in err, (flags, err)
    with pytest.raises(TuneError, match="does not take it"):  # an offline reference takes no window to tune
        tune(kvsim.from_array(np.tril(np.ones((9, 9)), -1)), "optimal", 4, by="retained_mass", layout=Layout(2))
    assert parse("evict_every") == ("evict_every", (1, 2, 4, 8, 16))
    # so little room after a decision (budget - k + 1 = 7) that no evenly spaced window fits: each that does
    assert layout_windows("h2o", 256, Layout(1, False, 250), {}) == [1, 2, 3, 4, 5, 6]
    assert [lay.label for lay in candidates(Layout(1, False, 8), "block_size", (1, 16))] == [
        "evict_every=8", "block_size=16 evict_every=8"]


def test_tune_plan_with_a_layout_saves_it_and_replays_as_tuned(tmp_path, capsys):
    plan = tmp_path / "paged.json"
    plan.write_text(Plan(PolicySpec.of("h2o", 48, recent_window=8), layout=Layout(16, False, 4)).to_json())
    tuned = tmp_path / "tuned.json"
    code, out, err = run(capsys, "tune", "--trace", "gemma3-270m-L05", "--plan", str(plan), "--by", "retained_mass",
                         "--serial", "--quiet", "--json", "--save-plan", str(tuned))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["layout"] == "block_size=16 evict_every=4" and doc["budget"] == 48
    saved = Plan.read(tuned)
    assert saved.layout == Layout(16, False, 4) and saved.policy == PolicySpec.of("h2o", 48, recent_window=doc["model_window"])
    code, out, err = run(capsys, "replay", "--trace", "gemma3-270m-L05", "--plan", str(tuned), "--json")
    row = json.loads(out)
    assert code == 0 and row["layout"] == doc["layout"] and row["recent_window"] == doc["model_window"]
    assert doc["model_window"] in doc["swept_windows"]
    assert row["retained_mass"] == doc["model"]["one_window"]["recommended_mass"] == doc["layers"][0]["recommended_mass"]
    text = render("tune", doc)
    assert max(map(len, text.splitlines())) <= 100
    assert "under block_size=16 evict_every=4 (48 positions), recent_window at" in " ".join(text.split())


def test_the_layout_search_tunes_under_each_candidate_and_saves_the_best(tmp_path, capsys):
    tuned = tmp_path / "best.json"
    argv = ["tune", "--trace", "gemma3-270m-L05", "--budget", "32", "--by", "retained_mass", "--serial", "--quiet"]
    code, out, err = run(capsys, *argv, "--search-layout", "block_size=1,8,64", "--json", "--save-plan", str(tuned))
    assert code == 0, err
    doc = json.loads(out)
    t = doc["layout_search"]
    assert [c["layout"] for c in t["candidates"]] == ["no layout", "block_size=8"]
    assert "block_size=64" in t["left_out"] and "larger than the budget" in t["left_out"]["block_size=64"]
    for c in t["candidates"]:  # each candidate is the tune under it, its figure the model_window's retained mass
        lay = Layout(c["block_size"], c["shared_selection"], c["evict_every"])
        code, out, err = run(capsys, *argv, "--json", *([] if lay.plain else ["--block-size", str(lay.block_size)]))
        one = json.loads(out)
        assert (one["model_window"], one["model"]["one_window"]["recommended_mass"]) == (c["model_window"], c["figure"])
    best = max(t["candidates"], key=lambda c: c["figure"])
    assert t["chosen"] == best["layout"] and doc["model_window"] == best["model_window"]
    saved = Plan.read(tuned)
    assert saved.policy.params.recent_window == best["model_window"]
    assert (saved.layout or Layout()) == Layout(best["block_size"], best["shared_selection"], best["evict_every"])
    text = render("tune", doc)
    assert "serving layouts searched" in text and re.search(r"chosen: .* left out: block_size=64", text)
    code, out, err = run(capsys, *argv, "--search-layout", "block_size=64,128")
    assert code != 0 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "--search-layout block_size: h2o at budget 32 runs under none of the candidates (block_size=64: " in err


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    if not HAS_TORCH:
        pytest.skip("torch/transformers not installed")
    from kvsim.models.quality import Session

    path = tmp_path_factory.mktemp("tune-layout") / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 2)
    return Session(_tiny("gemma3"), ByteTokenizer(), path, STEPS, model_id="tiny-gemma3", progress=None)


@needs_torch
def test_the_truth_under_a_layout_is_measure_opens_and_cached_apart(session, tmp_path, monkeypatch):
    """tune --by kl under a layout (the CLI's truth, its session opened already): each candidate window's KL is
    ``measure_open`` under the layout, cached under the layout's key; the bare truth of the same window is not."""
    import argparse

    from kvsim.cli.tune_command import _Truth
    from kvsim.models.quality_layout import measure_open

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    layout = Layout(4, False, 2)
    bare = _Truth.__new__(_Truth)
    bare.args = argparse.Namespace(no_cache=False, trace="tiny")
    bare.policy, bare.budget, bare.fixed, bare.say, bare.layout, bare.key = "h2o", 16, {}, None, None, "kl_open"
    bare.session, bare.counts = session, {"read": 0, "measured": 0}
    bare.at = lambda window: {**bare.fixed, "recent_window": window}  # as _Tuning.at hands it over
    truth = bare.under(layout)
    traces = [dataclasses.replace(t, meta={"layer": x, "head": h}) for x, layer in enumerate(session.traces)
              for h, t in enumerate(layer)]
    result = tune(traces, "h2o", 16, by="kl", truth=truth, layout=layout)
    windows = result.by["windows"]
    assert windows == result.windows == layout_windows("h2o", 16, layout, {})
    want = [measure_open(session, "h2o", 16, {"recent_window": w}, layout)["kl"] for w in windows]
    assert result.by["curve"] == want and result.model_window == windows[want.index(min(want))]
    assert truth.counts["measured"] == len(windows) and bare.counts["measured"] == 0  # one session, counted apart
    assert bare.under(None) is bare and truth.under(layout) is truth
    assert session.measure("h2o", 16, "open", recent_window=windows[0])["cached"] is False  # its own key
    with pytest.raises(TuneError, match="the truth is measured under block_size=4 evict_every=2, the sweep under no layout"):
        tune(traces, "h2o", 16, by="kl", truth=truth)


@needs_torch
@pytest.mark.record
def test_the_documented_tune_under_a_layout_then_generate_chain_runs_as_printed(tmp_path):
    """docs/deploy.md: the window tuned under blocks of 8 deciding every 4 steps, saved with the layout, deployed by
    generate --plan in those blocks (Gemma-3-270M, 16 tokens)."""
    (chain,) = [c for c in chains("docs/deploy.md") if any(" tune " in line and "--block-size" in line for line in c)]
    done = run_chain(chain, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    tune_doc = json.loads((tmp_path / "paged-tune.json").read_text())
    plan = Plan.read(tmp_path / "paged.json")
    assert plan.layout == Layout(8, False, 4) and plan.policy.params.recent_window == tune_doc["model_window"]
    assert tune_doc["layout"] == "block_size=8 evict_every=4" and tune_doc["model_window"] in tune_doc["swept_windows"]
    out = json.loads((tmp_path / "paged-out.json").read_text())
    assert out["layout"]["block_size"] == 8 and out["layout"]["evict_every"] == 4
    assert out["recent_window_per_layer"] == [tune_doc["model_window"]] * 18
    assert out["blocks"]["block_peak"] <= 4


def test_on_dask_a_layout_gives_the_serial_results(make_trace):
    """The same groups (a layer's KV heads together under shared selection) run on local Dask workers."""
    from kvsim.cluster import dask_available

    if not dask_available():
        pytest.skip("dask is not installed (the record extra)")
    traces = [dataclasses.replace(make_trace(40, seed=10 + 2 * x + h, name=f"L{x:02d}-kv{h}"), meta={"layer": x, "head": h})
              for x in range(2) for h in range(2)]
    layout = Layout(2, True, 2)
    serial = tune(traces, "h2o", 12, by="retained_mass", layout=layout)
    on_dask = tune(traces, "h2o", 12, by="retained_mass", layout=layout, scheduler="local", workers=2)
    assert on_dask.run["executor"] == "dask"
    assert _same_but_time(on_dask.to_dict(curves=True), serial.to_dict(curves=True))

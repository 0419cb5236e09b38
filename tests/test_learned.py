"""The learned policy and ``kvsim learn`` (docs/learned.md): the fit on a small trace, the weights' round trip,
the bad inputs refused in one line before any fit, the policy's own rules, and docs/learned.md against its JSON.
The registry's contract tests (tests/test_policies_contract.py) cover ``learned`` as every registered policy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from random_traces import random_trace, with_members

import kvsim
from kvsim.analysis import learn as fitting
from kvsim.cli.entry import main
from kvsim.policies.learned import (
    ATTENTION_FEATURES,
    DEFAULT_WEIGHTS,
    RECENT_WINDOW,
    WEIGHTS_ENV,
    Learned,
    WeightsError,
    check_weights,
    load_weights,
)
from kvsim.policies.optimal import optimal_schedule
from kvsim.views.learned import beside_sentence, kept_beside, study_markdown, weights_figure

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small():
    """The canonical trace's first 400 steps: its sinks, anchors and heavy hitters, small enough to fit in a second."""
    return kvsim.from_array(np.asarray(kvsim.canonical_trace().attention[:401, :401], dtype=np.float64), name="small")


@pytest.fixture(scope="module")
def weights(small):
    return fitting.learn([small], [24, 40], recent_window=4, dagger=1)


def test_the_fit_on_a_small_trace_gives_checked_weights_that_beat_the_window(small, weights):
    assert weights["features"] == list(ATTENTION_FEATURES)
    assert weights["fitted_on"] == ["small"] and weights["budgets"] == [24, 40]
    fit = weights["fit"]
    assert fit["optimum_steps"] == (400 - 24 + 1) + (400 - 40 + 1)  # round 0: every evicting step
    assert fit["steps"] == 2 * fit["optimum_steps"]  # and one DAgger round as many again
    assert fit["final_loss"] < np.log(2)  # better than a coin on each pair
    mass = kvsim.replay(small, Learned(24, recent_window=4, weights=weights)).retained_mass
    assert mass <= optimal_schedule(small, 24).retained_mass + 1e-9
    assert mass > kvsim.replay(small, "sliding_window", budget=24).retained_mass


def test_the_walk_holds_what_the_optimum_holds_and_labels_its_victims(small):
    """Walking the optimum's schedule with the policy's state leaves the policy holding the optimum's cache."""
    ex = fitting.walk(small, 24, ATTENTION_FEATURES, 0)
    assert ex.skipped == 0 and ex.steps == 400 - 24 + 1  # no window: every victim is a candidate
    victims = optimal_schedule(small, 24).victims
    held = ex.starts[1:] - ex.starts[:-1]
    assert held.tolist() == [25] * ex.steps  # budget + 1 after admitting, every one a candidate
    first = ex.victim[0] - ex.starts[0]
    assert first == victims[0]  # at step 24 the held positions are 0 .. 24, in order


def test_the_choice_loss_gradient_and_hessian_are_its_derivatives():
    rng = np.random.default_rng(0)
    sizes = [3, 5, 2, 4]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    Z = rng.normal(size=(starts[-1], 3))
    victim = starts[:-1] + np.array([1, 4, 0, 2])
    w = rng.normal(size=3)
    f, g, H = fitting._objective(w, Z, starts, victim, 0.1, True)
    eps = 1e-6
    for k in range(3):
        e = np.zeros(3)
        e[k] = eps
        fp, gp, _ = fitting._objective(w + e, Z, starts, victim, 0.1, False)
        fm, gm, _ = fitting._objective(w - e, Z, starts, victim, 0.1, False)
        assert (fp - fm) / (2 * eps) == pytest.approx(g[k], abs=1e-6)
        assert (gp - gm) / (2 * eps) == pytest.approx(H[k], abs=1e-5)


def test_the_weights_round_trip_through_json(tmp_path, small, weights, monkeypatch):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(weights))
    assert load_weights(path) == check_weights(json.loads(json.dumps(weights)))
    by_path = kvsim.replay(small, Learned(24, recent_window=4, weights=path), record_victims=True)
    by_doc = kvsim.replay(small, Learned(24, recent_window=4, weights=weights), record_victims=True)
    assert by_path.victims_history == by_doc.victims_history
    monkeypatch.setenv(WEIGHTS_ENV, str(path))  # every `learned` built by name reads it
    by_name = kvsim.replay(small, "learned", budget=24, recent_window=4, record_victims=True)
    assert by_name.victims_history == by_doc.victims_history


def test_the_shipped_weights_are_the_format_and_the_policys_default_window():
    shipped = load_weights(DEFAULT_WEIGHTS)
    assert shipped["recent_window"] == RECENT_WINDOW.default
    assert shipped["features"] == list(ATTENTION_FEATURES)
    assert DEFAULT_WEIGHTS.stat().st_size < 4096


def test_ties_evict_the_lower_position_and_the_window_is_kept():
    weights = {**fitting.weights_template(["log_cum"], 2), "weights": [1.0]}
    p = Learned(3, recent_window=2, weights=weights)
    for t in (1, 2, 3):
        p.on_decode_step(t, np.zeros(p.kept.size, dtype=np.float32))  # every score equal
        p.evict(3)
    assert p.kept.tolist() == [1, 2, 3]  # at step 3, of the evictable 0 and 1 (equal scores), 0 went


def test_a_key_feature_reads_the_traces_keys():
    trace = with_members(random_trace(80, 3), 3)
    weights = fitting.learn([trace], [16], features=["log_cum", "log_key_norm"], recent_window=2, dagger=1)
    policy = Learned(16, recent_window=2, weights=weights)
    assert policy.reads == ("keys",)
    assert 0 < kvsim.replay(trace, policy).retained_mass <= 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--trace", "canonical", "--budget", "5000"], "canonical: budget 5000 is never reached in its 4096 steps"),
    (["--trace", "gemma3-270m-L05", "--features", "log_cum,log_key_norm"],
     "gemma3-270m-L05: feature log_key_norm needs keys, which this trace does not hold"),
    (["--features", "log_cum,log_nonsense"], "--features: unknown feature 'log_nonsense'"),
    (["--budget", "16", "--recent-window", "16"], "--recent-window 16 must be below --budget 16"),
])
def test_learn_refuses_bad_input_in_one_line_before_the_fit(argv, message, capsys):
    assert main(["learn", *argv]) in (1, 2)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Newton" not in err


@pytest.mark.parametrize(("content", "message"), [
    ("not json at all", "not a learned-weights file (not JSON"),
    ('{"format": "something-else"}', "not a learned-weights file"),
    (None, "weights for another feature set (unknown feature 'log_future'"),
    ("mean", "'mean' must be a list of 8 finite numbers"),
])
def test_a_weights_file_that_is_not_the_format_is_refused_in_one_line(content, message, tmp_path, capsys):
    doc = load_weights(DEFAULT_WEIGHTS)
    if content is None:
        doc["features"] = [*doc["features"][:-1], "log_future"]
        content = json.dumps(doc)
    elif content == "mean":
        doc["mean"] = doc["mean"][:-1]
        content = json.dumps(doc)
    path = tmp_path / "w.json"
    path.write_text(content)
    assert main(["learn", "--weights", str(path), "--eval", "canonical"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    with pytest.raises(WeightsError):
        Learned(8, recent_window=2, weights=path)


def test_weights_for_another_feature_set_are_refused(capsys):
    assert main(["learn", "--weights", str(DEFAULT_WEIGHTS), "--features", "log_cum", "--eval", "canonical"]) == 2
    assert "weights for another feature set" in capsys.readouterr().err
    doc = {**load_weights(DEFAULT_WEIGHTS), "feature_params": {"window": 99, "decay": 0.5, "eps": 1e-6}}
    with pytest.raises(WeightsError, match="another feature set"):
        check_weights(doc)


def test_learn_writes_weights_and_a_study_the_doc_is_printed_from(tmp_path, capsys):
    out, study = tmp_path / "w.json", tmp_path / "study.json"
    code = main(["learn", "--trace", "canonical", "--budget", "64", "--stride", "16", "--dagger", "1", "--out", str(out),
                 "--eval", "canonical", "--eval-budget", "64", "--study", str(study), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Newton iteration" in captured.err
    doc = json.loads(captured.out)
    assert load_weights(out)["weights"] == doc["weights"]["weights"]
    assert [r["budget"] for r in doc["rows"]] == [64]
    assert {"learned", "h2o", "tova", "snapkv", "optimal"} <= set(doc["rows"][0]["retained_mass"])
    paged = doc["rows"][0]["pages"]  # in pages of 16 too, under the optimum under pages
    assert paged["block_size"] == 16 and set(paged["retained_mass"]) == {"learned", "h2o", "tova", "snapkv", "optimal"}
    assert max(paged["retained_mass"].values()) == paged["retained_mass"]["optimal"]
    assert paged["retained_mass"]["learned"] != doc["rows"][0]["retained_mass"]["learned"]
    assert main(["learn", "--doc", str(study)]) == 0
    text = capsys.readouterr().out
    assert text.rstrip("\n") == study_markdown(json.loads(study.read_text())).rstrip("\n")
    assert "--stride 16" in text


def test_docs_learned_md_is_printed_from_its_json():
    study = json.loads((ROOT / "docs" / "learned-study.json").read_text())
    assert (ROOT / "docs" / "learned.md").read_text() == study_markdown(study).rstrip("\n") + "\n", (
        "docs/learned.md is stale: python -m kvsim learn --doc docs/learned-study.json > docs/learned.md")
    assert study["weights"] == load_weights(DEFAULT_WEIGHTS)  # the shipped weights are the study's


def test_the_weights_figure_has_a_bar_per_feature():
    fig = weights_figure(load_weights(DEFAULT_WEIGHTS))
    assert list(fig.data[0].y)[::-1] == list(ATTENTION_FEATURES)


def test_the_score_view_draws_the_learned_weights():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.query_params.update({"policies": "learned", "budget": "128", "step": "600", "view": "Cumulative scores"})
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    bars = [s for s in specs if s["data"] and s["data"][0].get("type") == "bar" and "learned: weights" in
            s["layout"]["title"]["text"]]
    assert len(bars) == 1 and list(bars[0]["data"][0]["y"])[::-1] == list(ATTENTION_FEATURES)
    # beside it, the learned policy's kept positions beside the optimum's and h2o's at the same budget and step
    beside = [s for s in specs if s["layout"].get("title", {}).get("text") == "learned beside the optimum and h2o"]
    assert len(beside) == 1
    rows = {}
    for trace in beside[0]["data"]:
        if trace.get("xaxis", "x") == "x":
            rows.setdefault(trace["y"][0] if trace["y"] else None, []).extend(trace["x"])
    rows.pop(None, None)
    assert set(rows) == {"learned", "optimal", "h2o"} and all(len(x) == 128 for x in rows.values())
    lines = [t for t in beside[0]["data"] if t.get("mode") == "lines"]
    assert [t["name"] for t in lines] == ["learned ∩ optimal", "h2o ∩ optimal"]
    assert all(0 <= y <= 1 for t in lines for y in t["y"] if y is not None)
    caption = " ".join(c.value for c in at.caption)
    assert "After step 600, positions that one policy keeps and the other two do not: learned" in caption


def test_the_kept_beside_marks_what_only_one_policy_keeps():
    kept = {"learned": np.array([[0, 1, 2, -1], [0, 2, 3, 4]]), "optimal": np.array([[0, 1, -1, -1], [0, 3, 4, 5]]),
            "h2o": np.array([[0, 1, 2, -1], [1, 2, 3, 6]])}
    b = kept_beside(kept, 2)
    assert b["alone"] == {"learned": [], "optimal": [5], "h2o": [1, 6]}
    assert b["with_optimal"] == {"learned": 3, "h2o": 1}
    np.testing.assert_allclose(b["share_of_optimal"]["learned"], [1.0, 0.75])
    np.testing.assert_allclose(b["share_of_optimal"]["h2o"], [1.0, 0.25])
    assert "learned 0; optimal 1; h2o 2" in beside_sentence(b)


def test_the_deployed_cache_runs_the_learned_policy():
    """kvsim.hf.cache steps `learned` on its reference path (``tensor=False``; the tensor path is held to it in
    tests/test_hf_tensor.py) inside a real (tiny, random) transformers model: every layer and KV head holds the
    budget, its policy's own held set, the newest position included."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from test_hf import _prompt, _tiny

    import kvsim.hf as hf

    model, ids = _tiny("llama"), _prompt(40)
    cache = hf.cache(model, "learned", 12, recent_window=3, tensor=False)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        model(ids[:, -1:], cache=cache, use_cache=True)
    for layer in cache.layers:
        for h in range(2):
            held = layer.held(0, h).tolist()
            assert len(held) == 12 and held == layer.policies[0][h].kept.tolist() and 40 in held


def test_a_page_sums_exp_of_the_scores_and_the_window_never_goes():
    p = Learned(8, recent_window=2, weights=load_weights(DEFAULT_WEIGHTS))
    for t in range(1, 9):
        p.on_decode_step(t, np.linspace(1, 2, p.kept.size, dtype=np.float32) / np.linspace(1, 2, p.kept.size).sum())
        p.evict(8)
    prio = p.layout_priorities()
    assert np.isinf(prio[-2:]).all() and np.isfinite(prio[:-2]).all()
    np.testing.assert_allclose(np.log(prio[:-2]), p.scores[:-2])


def test_add_puts_rows_of_the_same_weights_into_a_study_and_refuses_other_weights(tmp_path, capsys):
    trace = tmp_path / "small.npz"
    kvsim.save_npz(random_trace(160, 7, name="small"), trace)
    weights = load_weights(DEFAULT_WEIGHTS)
    study = tmp_path / "study.json"
    old_row = {"trace": "other", "budget": 64, "retained_mass": {"learned": 0.5}, "gap_closed": 0.5}
    study.write_text(json.dumps({"command": "python -m kvsim learn ...", "weights": weights, "rows": [old_row]}))
    argv = ["learn", "--weights", str(DEFAULT_WEIGHTS), "--eval", str(trace), "--eval-budget", "48", "--study",
            str(study), "--add"]
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads(study.read_text())
    assert [(r["trace"], r["budget"]) for r in doc["rows"]] == [("other", 64), ("small", 48)]
    assert doc["rows"][0] == old_row and len(doc["added_by"]) == 1 and doc["added_by"][0].endswith("--add")
    assert main(argv) == 0  # again: the row replaced in its place, the command listed once
    again = json.loads(study.read_text())
    assert [(r["trace"], r["budget"]) for r in again["rows"]] == [("other", 64), ("small", 48)]
    assert again["added_by"] == doc["added_by"]
    capsys.readouterr()
    study.write_text(json.dumps({**doc, "weights": {**weights, "weights": [0.0] * len(weights["weights"])}}))
    assert main(argv) in (1, 2)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its weights are not --weights'" in err and "evaluated" not in err


def test_the_models_own_measures_are_printed_with_their_commands_and_what_is_still_missing():
    from kvsim.views.learned import model_measures

    quality = {"model": "smollm2-135m", "budget": 256, "steps": 1024, "mode": "open", "text": "heapq", "nll_full": 2.5,
               "command": "python -m kvsim quality heapq --model smollm2-135m --json", "results": [
                   {"policy": "learned", "kl": 0.08, "delta_nll": 0.09, "delta_nll_key": 1.2, "retained_mass": 0.97},
                   {"policy": "tova", "kl": 0.05, "delta_nll": 0.05, "delta_nll_key": 0.5, "retained_mass": 0.97},
                   {"policy": "h2o", "kl": 0.10, "delta_nll": 0.10, "delta_nll_key": 0.2, "retained_mass": 0.91},
                   {"policy": "optimal", "kl": 0.02, "delta_nll": 0.02, "delta_nll_key": 0.1, "retained_mass": 0.99}]}
    needle = {"model": "gemma3-270m", "command": "python -m kvsim needle --json", "lengths": [1024], "depths": [0.1, 0.9],
              "budget": 256, "trials": 1, "control": [1.0, 1.0],
              "policies": [{"policy": "learned", "label": "learned", "found": [0.0, 1.0], "key_held": 3,
                            "optimum_key_held": 18, "heads": 18}]}
    text = "\n".join(model_measures({"quality": [{**quality, "how": "python kvsim/bench/scripts/learned_measures.py"}],
                                     "needle": [{**needle, "how": "python kvsim/bench/scripts/learned_measures.py"}]}))
    assert text.count("python kvsim/bench/scripts/learned_measures.py") == 1
    assert "### SmolLM2-135M, budget 256, 1024 steps of heapq (full-cache NLL 2.5000)" in text
    assert "| learned | 0.0800 | +0.0900 | +1.2000 | 0.9700 |" in text
    assert "Learned ranks 2 of 3 online policies by KL (0.0800; the lowest: tova, 0.0500)" in text
    assert "On the key tokens it ranks 3 of 3" in text and "the optimum (by retained mass, not by KL) has KL 0.0200" in text
    assert "| full cache (control) | found | found | | |" in text and "| learned | - | found | 3 of 18 | 18 of 18 |" in text
    assert text.count("python -m kvsim quality heapq --model smollm2-135m --json") == 1
    study = json.loads((ROOT / "docs" / "learned-study.json").read_text())
    missing = "\n".join(study_markdown({**study, "model_measures": {"quality": [quality], "needle": []}})
                        .split("## Measured here, and not")[1:])
    assert "Not measured here yet: open-loop KL and delta NLL on the other model family; the pass key;" in missing

"""Tune, then deploy: the chains docs/deploy.md prints run as printed (read from the docs,
tests/doc_chains.py) and the deployed cache evicts; a tune file made for the model is accepted as it
is, and one made for another model is refused by what that model is; the windows a tune file deploys
follow its ``by`` (the truth's model_window everywhere, or a per-layer search by the truth that is never
worse by it), named in the file with their KL."""

from __future__ import annotations

import importlib.util
import json
import re
import types

import numpy as np
import pytest
from doc_chains import chains, run

from kvsim.analysis.tune import SEARCH_STEP, TuneError, layer_groups, search_layer_windows, tune
from kvsim.cli.render import render
from kvsim.data.catalog import resolve_bundle

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")
#: the docs whose tune -> generate chains run here (the README's moved to docs/deploy.md with issue 44)
DOCS = ("README.md", "docs/deploy.md")


def _deploy_chains() -> list[tuple[str, list[str]]]:
    # the tune -> generate chains by a tune file (docs/deploy.md's replay --allocate -> generate chain runs in
    # test_hf_allocation.py, its tune --save-plan -> generate --plan chain in test_plan.py)
    return [(doc, c) for doc in DOCS for c in chains(doc)
            if any(" generate " in line for line in c) and any(" tune " in line for line in c)
            and not any("--save-plan" in line for line in c)]


def test_the_docs_print_tune_then_generate_chains_and_the_test_reads_them():
    found = _deploy_chains()
    assert [doc for doc, _ in found].count("README.md") == 0 and [doc for doc, _ in found].count("docs/deploy.md") == 3
    for _, chain in found:  # each chain tunes into the file it deploys
        assert "tune.json" in next(line for line in chain if " tune " in line)
        assert "--windows tune.json" in next(line for line in chain if " generate " in line)


@needs_torch
@pytest.mark.record
@pytest.mark.parametrize("doc, chain", _deploy_chains(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_documented_tune_then_generate_chain_runs_as_printed_and_evicts(doc, chain, tmp_path):
    done = run(chain, tmp_path)
    assert done.returncode == 0, f"{doc}: {chain}\n{done.stderr[-3000:]}"
    budget = int(re.search(r"--budget (\d+)", chain[-1]).group(1))
    tuned = json.loads((tmp_path / "tune.json").read_text())
    deployed = [r["recent_window"] for r in tuned["deploy"]["per_layer"]]
    if "--per-layer" in chain[0]:  # by retained mass, each layer's own recommended window
        assert tuned["by"] == "retained_mass" and deployed == [r["recommended_window"] for r in tuned["per_layer"]]
    elif "--by retained_mass" in chain[0]:  # model_window by retained mass, in every layer
        assert tuned["by"] == "retained_mass" and deployed == [tuned["model_window"]] * 18
    else:  # tune's default: the truth's window, in every layer
        assert tuned["by"] == "kl" and deployed == [tuned["model_window"]] * 18
    out = (tmp_path / "out.json").read_text() if (tmp_path / "out.json").exists() else done.stdout
    if out.lstrip().startswith("{"):
        result = json.loads(out)
        assert result["recent_window_per_layer"] == deployed
        if result["prompt_tokens"] + len(result["token_ids"]) > budget:  # every layer held the budget at its peak
            assert result["peak_positions"] == [budget] * 18
        else:
            assert max(result["peak_positions"]) <= budget
    else:  # the text, then what the cache did: a run that outgrows the budget (issue 56: the first example did not)
        said = re.search(r"\[(\d+) tokens after a (\d+)-token prompt; .* at budget (\d+): at most (\d+) positions", out)
        new, prompt, at, peak = map(int, said.groups())
        assert at == budget and new + prompt > budget and peak == budget
    if "--prompt-file" in chain[-1]:  # the chains whose prompt is longer than the budget: they must evict
        assert out.lstrip().startswith("{") and json.loads(out)["peak_positions"] == [budget] * 18


def _gemma_270m_layout():
    """A stand-in with Gemma-3-270M's configuration only (18 layers, every sixth global, one KV head,
    a sliding window of 512): what ``kvsim.hf`` checks a tune file against, without the weights."""
    import transformers as tf

    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    cfg = tf.Gemma3TextConfig(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, sliding_window=512,
                              layer_types=kinds, vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8)
    return types.SimpleNamespace(config=cfg)


@pytest.fixture(scope="module")
def shipped_tuning():
    return tune(resolve_bundle("gemma3-270m-heapq"), "h2o", 256, by="retained_mass")


@needs_torch
def test_a_tune_file_made_for_the_model_is_accepted_as_tune_wrote_it(shipped_tuning, tmp_path):
    """Before, its model_window (a recent_window, 105 here) was compared with the model's sliding window
    (512) and every file tune wrote was refused as 'for another model'."""
    import kvsim.hf as hf

    doc = shipped_tuning.to_dict()
    assert doc["model_window"] != 512 and doc["recording"]["sliding_window"] == 512
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(doc))
    specs = hf.layer_specs(_gemma_270m_layout(), "h2o", 256, str(path))
    assert [row[0]["recent_window"] for row in specs] == [doc["model_window"]] * 18
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**doc, "recording": {**doc["recording"], "sliding_window": 4096}}))
    with pytest.raises(hf.WindowsError, match="other.json: recorded on google/gemma-3-270m.* with a sliding window of "
                                              "4096, SimpleNamespace's is 512; it is for another model"):
        hf.layer_specs(_gemma_270m_layout(), "h2o", 256, str(other))


def test_by_retained_mass_deploys_model_window_everywhere_or_per_layer_its_own_windows(shipped_tuning):
    one = shipped_tuning.deploy
    assert one["by"] == "retained_mass" and one["search"] is None and one["kl"] is None and "not measured" in one["kl_note"]
    assert [r["recent_window"] for r in one["per_layer"]] == [shipped_tuning.model_window] * 18
    per = tune(resolve_bundle("gemma3-270m-heapq"), "h2o", 256, by="retained_mass", per_layer=True).deploy
    assert [r["recent_window"] for r in per["per_layer"]] == [r["recommended_window"] for r in shipped_tuning.per_layer()]


def test_per_layer_windows_need_the_truth_or_retained_mass(shipped_tuning):
    with pytest.raises(TuneError, match="--per-layer windows are searched by the truth .* by output_error_late has no"):
        tune(resolve_bundle("gemma3-270m-heapq"), "h2o", 256, by="output_error_late", per_layer=True)


def test_layer_groups_are_the_models_runs_of_one_attention_kind():
    gemma = ["sliding"] * 5 + ["global"]
    assert layer_groups(gemma * 3) == [[0, 1, 2, 3, 4], [5], [6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16], [17]]
    assert layer_groups(["global"] * 4) == [[0], [1], [2], [3]]
    assert layer_groups(["global"] * 12) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    alternating = layer_groups(["sliding", "global"] * 13)
    assert len(alternating) == 6 and sum(alternating, []) == list(range(26))


class _FakeTruth:
    """A truth with a known answer: KL is a bowl around a window per layer, so the search has somewhere
    to go; it counts what it is asked, as the CLI's truth does."""

    def __init__(self, target: list[int]):
        self.target = np.asarray(target, dtype=np.float64)
        self.asked: list[tuple[int, ...]] = []
        self.counts = {"read": 0, "measured": 0}

    def configurations(self, configs, figure):
        self.asked += list(configs)
        self.counts["measured"] += len(configs)
        return [float(np.mean((np.asarray(c) - self.target) ** 2) / 1e4 + 0.05) for c in configs]

    def __call__(self, windows):
        return self.configurations([(w,) * len(self.target) for w in windows], "kl")


def test_the_search_starts_from_the_model_window_and_is_never_worse_by_the_truth():
    target = [40] * 5 + [200] + [104] * 12
    truth = _FakeTruth(target)
    groups = layer_groups((["sliding"] * 5 + ["global"]) * 3)
    found = search_layer_windows(104, groups, 256, lambda c: truth.configurations(c, "kl"), toward=target)
    assert truth.asked[0] == (104,) * 18 and found["start_kl"] == truth.configurations([(104,) * 18], "kl")[0]
    assert found["kl"] < found["start_kl"] and found["measurements"] == 1 + len(groups) == len(truth.asked) - 1
    step = 256 // SEARCH_STEP
    assert found["windows"][:5] == [104 - step] * 5 and found["windows"][5] == 104 + step  # toward the bowl's floor
    assert found["windows"][6:] == [104] * 12 and [m["layers"] for m in found["moves"]] == [groups[0], groups[1]]
    assert all(len({found["windows"][layer] for layer in g}) == 1 for g in groups)  # a group moves as one
    # the proxy points the wrong way: the truth refuses every move, and the model-wide window stands
    wrong = search_layer_windows(104, groups, 256, lambda c: truth.configurations(c, "kl"), toward=[200] * 5 + [40] * 13)
    assert wrong["windows"] == [104] * 18 and wrong["kl"] == wrong["start_kl"] and wrong["moves"] == []


def test_tune_per_layer_by_the_truth_deploys_the_search_and_names_its_kl_and_cost():
    bundle = resolve_bundle("gemma3-270m-heapq")
    truth = _FakeTruth([40] * 5 + [200] + [104] * 12)
    result = tune(bundle, "h2o", 256, by="kl", truth=truth, per_layer=True)
    doc = result.to_dict()
    deployed = [r["recent_window"] for r in doc["deploy"]["per_layer"]]
    assert doc["deploy"]["search"]["start"] == doc["model_window"] and deployed == doc["deploy"]["search"]["windows"]
    assert doc["deploy"]["kl"] == truth.configurations([tuple(deployed)], "kl")[0] <= doc["deploy"]["search"]["start_kl"]
    assert "searched by the truth (kl)" in doc["deploy"]["rule"] and "7 measurements" in doc["deploy"]["rule"]
    text = " ".join(render("tune", doc).split())  # its sentences wrapped to 100 columns
    assert f"recommended: recent_window per layer {', '.join(map(str, deployed))}" in text
    assert f"KL {doc['deploy']['kl']:.4f}" in text and "the per-layer search 7 configurations" in text


class _SlowTruth(_FakeTruth):
    """A truth that takes its time, as the model does (258 s on a fresh recording)."""

    def configurations(self, configs, figure):
        import time

        time.sleep(0.4)
        return super().configurations(configs, figure)


def test_the_tune_summary_counts_the_truths_time_not_only_the_sweeps(make_trace):
    """Before, tune ended '1 traces swept serially in 0.0 s' after the truth had measured for minutes:
    the run's seconds were taken before the truth was asked."""
    trace = make_trace(40, seed=3)
    truth = _SlowTruth([8])
    doc = tune(trace, "h2o", 16, by="kl", truth=truth).to_dict()
    last = " ".join(render("tune", doc).split("\n\n")[-1].split())  # the last sentence, wrapped to 100 columns
    total = float(re.search(r"; ([0-9.]+) s in all$", last).group(1))
    # two asks of 0.4 s each (the candidates' curve, the deployed windows' KL) beside the sweep, counted in
    # the run's seconds; the line prints them rounded to 0.1 s, so within half of that of the exact figure
    assert doc["run"]["seconds"] >= doc["run"]["sweep_seconds"] + 0.8
    assert total == pytest.approx(doc["run"]["seconds"], abs=0.05 + 1e-9)
    assert last.startswith(f"1 traces swept serially in {doc['run']['sweep_seconds']:.1f} s; the truth: 0 configurations "
                           f"read (shipped or cached), {truth.counts['measured']} measured, ")


def test_the_apps_deploy_lines_name_what_each_tune_file_deploys(shipped_tuning):
    """The "Your model" tab shows per-layer windows by retained mass: its tune line writes the file that
    deploys exactly those, and its sentence names what tune's default deploys instead, the window the
    shipped truth gives (104 at budget 256, as ``tune`` answers)."""
    from kvsim.views import window_truth as vt
    from kvsim.views.deploy import deploy_snippets

    bundle = resolve_bundle("gemma3-270m-heapq")
    truth = vt.truth_for(bundle.manifest, "h2o", 256)
    sentence, shell, python = deploy_snippets(shipped_tuning, bundle.name, bundle.model, truth)
    assert "--by retained_mass --per-layer" in shell.splitlines()[0] and "--windows tune.json" in shell
    windows = [r["recommended_window"] for r in shipped_tuning.per_layer()]
    assert f"({min(windows)} to {max(windows)}; their KL not measured here)" in sentence
    assert "Without those flags `tune` deploys what the truth recommends (by KL): model_window **104** in every layer, " \
           "KL 0.0663 (shipped truth, 1024 steps, open loop)" in sentence
    assert "measured by the model where" in deploy_snippets(shipped_tuning, bundle.name, bundle.model, None)[0]

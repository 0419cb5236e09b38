"""One plan per run (issue 42, item 3): the policy at its budget and parameters, the split over layers and KV
heads and the prompt's compression as one frozen value, made once from flags or a file; ``--save-plan`` writes
what the flags say, ``--plan`` runs it again through every command that takes it, ``kvsim.hf.cache(plan=)``
deploys it, and its JSON is an allocation file. Bad plans are one line naming the file and the field."""

from __future__ import annotations

import importlib.util
import json

import pytest
from doc_chains import chains
from doc_chains import run as run_chain
from random_traces import random_trace

from kvsim import cli
from kvsim.allocation.split import read_allocation
from kvsim.data.trace import save_npz
from kvsim.policies import PolicySpec
from kvsim.policykit.plan import Compression, Plan

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "small.npz"
    save_npz(random_trace(90, seed=7), path)
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_plan_is_one_hashable_value_and_its_json_reads_back_equal(tmp_path):
    plan = Plan(PolicySpec.of("h2o", 64, recent_window=16), "pyramidkv", None,
                Compression(0.5, "snapkv", (("recent_window", 8),), 40))
    assert Plan.from_dict(json.loads(plan.to_json())) == plan and hash(plan) == hash(Plan.from_dict(plan.to_dict()))
    rows = Plan(PolicySpec.of("tova", 8), allocation=((0, 0, 6), (0, 1, 10)))
    path = tmp_path / "split.json"
    path.write_text(rows.to_json())
    assert Plan.read(path) == rows
    assert read_allocation(path) == ({(0, 0): 6, (0, 1): 10}, "tova")  # a plan with rows is an --allocate file
    assert rows.budgets == {(0, 0): 6, (0, 1): 10}


def test_save_plan_then_plan_runs_the_same_configuration(small, tmp_path, capsys):
    saved = tmp_path / "run.json"
    flags = ["--trace", str(small), "--policy", "snapkv", "--budget", "20", "--recent-window", "4",
             "--prefill-budget", "0.5", "--prompt-length", "40", "--prefill-policy", "tova"]
    code, by_flags, err = run(capsys, "replay", *flags, "--save-plan", str(saved), "--json")
    assert code == 0, err
    plan = Plan.read(saved)
    assert plan.policy == PolicySpec.of("snapkv", 20, recent_window=4)
    assert plan.compression == Compression(0.5, "tova", (), 40)
    code, by_plan, err = run(capsys, "replay", "--trace", str(small), "--plan", str(saved), "--json")
    assert code == 0, err
    assert json.loads(by_plan) == json.loads(by_flags)
    # sweep takes the plan and runs the range given beside it over the plan's value
    code, out, err = run(capsys, "sweep", "--trace", str(small), "--plan", str(saved), "--recent-window", "2:6:2", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["recent_window"] for r in rows] == [2, 4, 6]
    assert rows[1]["retained_mass"] == json.loads(by_flags)["retained_mass"]


def test_a_flag_the_plan_also_sets_and_a_bad_plan_are_one_line(small, tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(Plan(PolicySpec.of("h2o", 16, recent_window=4)).to_json())
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    cases = {
        "conflict": (["--plan", str(good), "--budget", "32"], f"--plan {good} sets --budget too: give it in one place"),
        "missing": ([], "the following arguments are required: --policy (or --plan FILE)"),
        # replay runs from the plan: a setting it leaves unset is not added beside it
        "beside": (["--plan", str(good), "--prefill-budget", "0.5"],
                   f"--plan {good} is the whole run: give --prefill-budget in the plan, not beside it"),
        "no file": (["--plan", str(tmp_path / "none.json")], f"--plan: {tmp_path}/none.json: no such file"),
        "deep": (["--plan", str(deep)], f"--plan: {deep}: "),
    }
    docs = {
        "not a plan": ({"policy": "h2o"}, "not a kvsim plan"),
        "misspelt": ({"kvsim_plan": 1, "policy": "h20", "budget": 16}, "policy: 'h20' is not a registered policy (did you mean 'h2o'?)"),
        "offline": ({"kvsim_plan": 1, "policy": "optimal", "budget": 16}, "optimal is an offline reference"),
        "budget": ({"kvsim_plan": 1, "policy": "h2o", "budget": "16"}, "budget: an integer is needed, got '16'"),
        "window": ({"kvsim_plan": 1, "policy": "h2o", "budget": 16, "params": {"recent_window": 16}},
                   "recent_window must be less than budget (16), got 16"),
        "field": ({"kvsim_plan": 1, "policy": "h2o", "budget": 64, "windows": {}}, "unknown field 'windows'"),
        "keep": ({"kvsim_plan": 1, "policy": "h2o", "budget": 64, "compression": {"keep": 1.5}}, "compression.keep: a number"),
        "rows": ({"kvsim_plan": 1, "policy": "h2o", "budget": 64,
                  "allocation": [{"layer": 0, "kv_head": 0, "budget": 8}, {"layer": 0, "kv_head": 0, "budget": 8}]},
                 "allocation[1]: layer 0 KV head 0 is listed twice"),
        "both": ({"kvsim_plan": 1, "policy": "h2o", "budget": 64, "allocate": "uniform",
                  "allocation": [{"layer": 0, "kv_head": 0, "budget": 8}]}, "allocate and allocation: give one"),
    }
    for name, doc in docs.items():
        path = tmp_path / f"{name.replace(' ', '-')}.json"
        path.write_text(json.dumps(doc[0]))
        cases[name] = (["--plan", str(path)], doc[1])
    for name, (argv, said) in cases.items():
        code, out, err = run(capsys, "replay", "--trace", str(small), *argv)
        assert code != 0 and out == "", name
        assert len(err.strip().splitlines()) == 1 and said in err, (name, err)


@pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (the record extra)")
def test_the_deployed_cache_and_generate_take_the_plan(tmp_path, capsys):
    from test_hf import _model_folder, _prompt, _tiny

    import kvsim.hf as hf

    path = tmp_path / "plan.json"
    path.write_text(Plan(PolicySpec.of("h2o", 12, recent_window=3)).to_json())
    model, ids = _tiny("llama"), _prompt()
    tokens = {}
    for how, cache in (("plan", hf.cache(model, plan=str(path))), ("args", hf.cache(model, "h2o", 12, recent_window=3))):
        tokens[how] = model.generate(ids, cache=cache, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0].tolist()
        assert cache.peak_positions == [12] * len(cache.layers)
    assert tokens["plan"] == tokens["args"]
    # a plan with rows (what tune --save-plan writes after a split) deploys each head at its own budget
    rows = Plan(PolicySpec.of("h2o", 12, recent_window=3), allocation=((0, 0, 10), (0, 1, 14), (1, 0, 12), (1, 1, 12)))
    cache = hf.cache(model, plan=rows)
    model.generate(ids, cache=cache, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert cache.budgets == cache.head_peaks == rows.budgets
    with pytest.raises(hf.HFError, match="plan= gives the policy"):
        hf.cache(model, "h2o", 12, plan=str(path))
    from kvsim.policykit.layouts import Layout

    laid = Plan(PolicySpec.of("h2o", 16, recent_window=3), layout=Layout(block_size=4))
    paged = {}  # a plan's layout deploys (kvsim.hf.layout): as the same layout given by its arguments
    for how, cache in (("plan", hf.cache(model, plan=laid)), ("args", hf.cache(model, "h2o", 16, block_size=4, recent_window=3))):
        paged[how] = model.generate(ids, cache=cache, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0].tolist()
        assert cache.layers[0].layout == Layout(block_size=4)
    assert paged["plan"] == paged["args"]
    folder = _model_folder(tmp_path)
    argv = ["generate", "--model", str(folder), "--max-new-tokens", "6", "the quick brown fox jumps over the lazy dog", "--json"]
    code, by_plan, err = run(capsys, *argv, "--plan", str(path))
    assert code == 0, err
    code, by_flags, err = run(capsys, *argv, "--policy", "h2o", "--budget", "12", "--recent-window", "3")
    assert code == 0, err
    assert json.loads(by_plan)["token_ids"] == json.loads(by_flags)["token_ids"]


def test_the_app_offers_each_chosen_policy_as_a_plan():
    """The sidebar's settings as plans: the file the app offers reads back as that policy at that budget."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from kvsim.app.plan_download import plans

    made = plans([PolicySpec.of("h2o", 128, recent_window=16), PolicySpec.of("optimal", 128)])
    assert list(made) == ["h2o"]  # an offline reference reads the future: no plan to run
    assert Plan.from_dict(json.loads(made["h2o"].to_json())) == Plan(PolicySpec.of("h2o", 128, recent_window=16))
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=180)
    at.run()
    assert [e.value for e in at.exception] == []
    assert "run these settings elsewhere" in [e.label for e in at.sidebar.expander]


def test_save_plan_refuses_what_the_run_would_refuse_and_writes_nothing(small, tmp_path, capsys):
    saved = tmp_path / "never.json"
    cases = [(["--policy", "h2o", "--budget", "16", "--sinks", "2"], "sinks"),
             (["--policy", "h2o", "--budget", "16", "--recent-window", "4", "--prefill-budget", "abc"], "--prefill-budget"),
             (["--policy", "h2o", "--budget", "16", "--recent-window", "4", "--prefill-budget", "8",
               "--prefill-policy", "snapkv:nope=3"], "--save-plan: compression.")]
    for argv, said in cases:
        code, out, err = run(capsys, "replay", "--trace", str(small), *argv, "--save-plan", str(saved))
        assert code != 0 and out == "" and len(err.strip().splitlines()) == 1 and said in err, err
        assert not saved.exists()


def test_spec_parameters_are_typed_attributes_and_the_same_pairs_underneath():
    spec = PolicySpec.of("snapkv", 64, recent_window=8)
    assert spec.params.recent_window == 8 and spec.params.observation_window == 32
    assert spec.params.names == ("recent_window", "observation_window")
    with pytest.raises(AttributeError, match="no parameter 'sinks'"):
        _ = spec.params.sinks
    # what keys caches and JSON is unchanged: equal, hashed, printed and dumped as the plain pairs
    plain = PolicySpec("snapkv", 64, (("recent_window", 8), ("observation_window", 32)))
    assert plain == spec and hash(plain) == hash(spec) and repr(plain) == repr(spec)
    assert repr(spec.params) == "(('recent_window', 8), ('observation_window', 32))"
    assert json.dumps(dict(spec.params)) == '{"recent_window": 8, "observation_window": 32}'
    assert plain.params.recent_window == 8  # made from pairs, typed all the same
    assert Compression(0.5, "snapkv", (("recent_window", 4),)).params.recent_window == 4


def _tune_chain() -> list[str]:
    found = [c for c in chains("docs/deploy.md") if any(" tune " in line and "--save-plan" in line for line in c)
             and not any("--block-size" in line for line in c)]  # the chain under a layout: tests/test_tune_layout.py
    assert len(found) == 1, found
    return found[0]


def test_tune_takes_a_plan_and_saves_what_it_tuned(tmp_path, capsys):
    """tune --plan: the plan's policy, budget and allocator held, the window tuned; --save-plan: that run as a plan."""
    chain = _tune_chain()
    given = tmp_path / "plan.json"
    given.write_text(Plan(PolicySpec.of("h2o", 24, recent_window=8), "pyramidkv").to_json())
    tuned = tmp_path / "tuned.json"
    argv = ["tune", "--trace", "gemma3-270m-heapq", "--by", "retained_mass", "--serial", "--quiet", "--json"]
    code, out, err = run(capsys, *argv, "--plan", str(given), "--save-plan", str(tuned))
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["policy"], doc["budget"], doc["allocate"]["chosen"]) == ("h2o", 24, "pyramidkv")
    assert [c["allocator"] for c in doc["allocate"]["candidates"]] == ["pyramidkv"]
    plan = Plan.read(tuned)
    assert plan.policy == PolicySpec.of("h2o", 24, recent_window=doc["model_window"])
    assert plan.budgets == {(r["layer"], r["kv_head"]): r["budget"] for r in doc["allocation"]}
    # what the docs print: the same plan made by replay --save-plan, then tuned into the same file
    assert "--plan plan.json" in chain[1] and "--plan tuned.json" in chain[2]
    refusals = [
        (["--plan", str(given), "--budget", "32"], f"--plan {given} sets --budget too: give it in one place"),
        (["--plan", str(given), "--allocate", "auto"], "sets the split, which --allocate auto would choose"),
        (["--per-layer", "--save-plan", str(tmp_path / "never.json")], "--save-plan writes one recent_window for every layer"),
    ]
    laid = tmp_path / "laid.json"
    laid.write_text(Plan(PolicySpec.of("h2o", 24, recent_window=8), compression=Compression(0.5)).to_json())
    refusals.append((["--plan", str(laid)], "sets the prompt's compression, which tune does not measure yet"))
    for flags, said in refusals:
        code, out, err = run(capsys, *argv, *flags)
        assert code != 0 and out == "" and len(err.strip().splitlines()) == 1 and said in err, (flags, err)
    assert not (tmp_path / "never.json").exists()


@pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (the record extra)")
@pytest.mark.record
def test_the_documented_tune_then_run_chain_runs_as_printed(tmp_path):
    chain = _tune_chain()
    done = run_chain(chain, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    tuned = Plan.read(tmp_path / "tuned.json")
    tune = json.loads((tmp_path / "tune.json").read_text())
    assert tuned.policy.params.recent_window == tune["model_window"]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["policy"] == "h2o" and out["recent_window_per_layer"] == [tune["model_window"]] * 18
    assert {(r["layer"], r["kv_head"]): r["budget"] for r in out["allocation"]} == tuned.budgets
    assert all(r["peak_positions"] <= r["budget"] for r in out["allocation"])

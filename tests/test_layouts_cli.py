"""The serving layouts on the command line (issue 45): ``--block-size``, ``--shared-selection`` and
``--evict-every`` on replay, sweep and table, the plan's ``layout`` field (written only when set: a plan without
one is today's, byte for byte), and every bad input as one line before any trace loads, never a traceback."""

from __future__ import annotations

import json

import pytest
from random_traces import random_trace

from kvsim import cli
from kvsim.data.trace import save_npz
from kvsim.policies import PolicySpec
from kvsim.policykit.layouts import Layout
from kvsim.policykit.plan import Plan, PlanError


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("layouts") / "small.npz"
    save_npz(random_trace(120, seed=11), path)
    return str(path)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_replay_and_sweep_take_the_layout_and_say_it_in_their_rows(small, capsys):
    code, out, err = run(capsys, "replay", "--trace", small, "--policy", "h2o", "--budget", "32", "--recent-window",
                         "4", "--block-size", "8", "--evict-every", "4", "--json")
    assert code == 0, err
    row = json.loads(out)
    assert row["layout"] == "block_size=8 evict_every=4" and row["memory"] == 32 and row["block_size"] == 8
    code, out, err = run(capsys, "replay", "--trace", small, "--policy", "h2o", "--budget", "32", "--recent-window",
                         "4", "--json")
    assert "layout" not in json.loads(out)
    code, out, err = run(capsys, "sweep", "--trace", small, "--policy", "h2o", "--budget", "32", "--recent-window",
                         "2:6:2", "--block-size", "8", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["recent_window"] for r in rows] == [2, 4, 6] and {r["layout"] for r in rows} == {"block_size=8"}


def test_the_table_has_a_layout_column_and_the_optimum_both_ways(small, capsys):
    code, out, err = run(capsys, "table", "--trace", small, "--budget", "32", "--block-size", "8", "--json")
    assert code == 0, err
    doc = json.loads(out)
    by = {r["policy"]: r for r in doc["rows"] if not r["params"]}
    blocks, free = by["optimal (offline reference)"], by["optimal, no layout (offline reference)"]
    assert blocks["layout"] == "block_size=8" and free["layout"] == "-"
    assert blocks["retained_mass"] <= free["retained_mass"]
    online = [r for r in doc["rows"] if "(offline" not in r["policy"] and r["retained_mass"] is not None]
    assert online and all(r["retained_mass"] <= blocks["retained_mass"] + 1e-12 for r in online)
    code, text, err = run(capsys, "table", "--trace", small, "--budget", "32", "--block-size", "8")
    assert code == 0 and "layout" in text and "block_size=8" in text


@pytest.mark.parametrize("argv,says", [
    (["--budget", "16", "--block-size", "32", "--recent-window", "4"], "block_size 32 is larger than the budget (16)"),
    (["--evict-every", "0"], "--evict-every 0 must be at least 1"),
    (["--block-size", "0"], "--block-size 0 must be at least 1"),
    (["--budget", "64", "--evict-every", "40"], "leaves budget - k + 1 = 25: h2o's recent_window 32 must be below it"),
    (["--budget", "64", "--block-size", "16", "--evict-every", "64"], "does not fit budget 64 in blocks of 16"),
])
def test_bad_layouts_are_one_line_before_the_trace_loads(capsys, argv, says):
    code, out, err = run(capsys, "replay", "--trace", "/no/such/trace.npz", "--policy", "h2o", *argv)
    assert code == 2 and out == "" and says in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("policy,says", [("greedy_future", "greedy_future is an offline reference"),
                                         ("optimal", "--block-size only")])
def test_an_offline_policy_takes_only_blocks_and_only_the_optimum(capsys, policy, says):
    extra = ["--shared-selection"] if policy == "optimal" else []
    code, out, err = run(capsys, "replay", "--trace", "/no/such.npz", "--policy", policy, "--block-size", "16", *extra)
    assert code == 2 and says in err and err.count("\n") == 1


def test_rounding_and_one_kv_head_are_said_and_the_run_goes_on(small, capsys):
    code, out, err = run(capsys, "replay", "--trace", small, "--policy", "tova", "--budget", "30", "--block-size", "8",
                         "--shared-selection", "--json")
    assert code == 0
    assert "budget 30 is no multiple of block_size 8: rounded down to 3 whole blocks (24 positions)" in err
    assert "shared selection on a trace with one KV head: a no-op" in err
    assert json.loads(out)["memory"] == 24


def test_the_plan_carries_the_layout_and_a_plan_without_one_is_unchanged(small, tmp_path, capsys):
    bare = Plan(PolicySpec.of("h2o", 64, recent_window=8))
    assert "layout" not in bare.to_dict() and Plan(bare.policy, layout=Layout()) == bare
    plan = Plan(PolicySpec.of("h2o", 64, recent_window=8), layout=Layout(16, True, 4))
    assert Plan.from_dict(json.loads(plan.to_json())) == plan and hash(plan) != hash(bare)
    saved = tmp_path / "plan.json"
    code, out, err = run(capsys, "replay", "--trace", small, "--policy", "h2o", "--budget", "32", "--recent-window", "4",
                         "--block-size", "8", "--save-plan", str(saved), "--json")
    assert code == 0 and json.loads(saved.read_text())["layout"] == {"block_size": 8, "shared_selection": False,
                                                                      "evict_every": 1}
    code, again, err = run(capsys, "replay", "--trace", small, "--plan", str(saved), "--json")
    assert code == 0 and json.loads(again) == json.loads(out)
    code, _, err = run(capsys, "replay", "--trace", small, "--plan", str(saved), "--block-size", "4")
    assert code == 2 and "--block-size" in err and err.count("\n") == 1
    doc = {**plan.to_dict(), "layout": {"block_size": 0}}
    with pytest.raises(PlanError, match="block_size"):
        Plan.from_dict(doc)


def test_shared_selection_on_a_bundle_layer_replays_its_kv_heads_together(tmp_path, capsys):
    from kvsim.data.bundle import write_manifest
    from kvsim.sim.layered import replay_layer

    folder = tmp_path / "two"
    folder.mkdir()
    entries, traces = [], []
    for head in (0, 1):
        trace = random_trace(60, seed=20 + head)
        save_npz(trace, folder / f"two-L00-kv{head}.npz")
        traces.append(trace)
        entries.append({"file": f"two-L00-kv{head}.npz", "layer": 0, "head": head, "query_heads": [head],
                        "attention": "global", "sliding_window": None})
    write_manifest(folder, {"name": "two", "model": "random", "model_licence": "CC0",
                            "text": {"source": "none", "licence": "CC0"}, "steps": 60, "traces": entries})
    argv = ["replay", "--trace", f"{folder}:L00", "--policy", "tova", "--budget", "16", "--block-size", "4",
            "--shared-selection"]
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    row = json.loads(out)
    want = replay_layer([t for t in traces], PolicySpec.of("tova", 16), Layout(4, True))
    assert row["kv_heads"] == 2 and row["retained_mass"] == want["retained_mass"]
    assert [h["retained_mass"] for h in row["heads"]] == [r.retained_mass for r in want["heads"]]
    assert "no-op" not in err
    code, text, err = run(capsys, *argv)
    assert code == 0 and "2 KV heads of the layer, replayed together" in text
    code, _, err = run(capsys, *argv[:-1], "--json")  # without shared selection a layer of two heads is refused as before
    assert code == 1 and "pick one" in err

"""``kvsim needle`` reaches the rest of kvsim (issue 35): a static split (``--allocate``) and a compressed
prompt (``--prefill-budget``) through kvsim.hf, each in the trial's cache key and its label; the exact
optimum's kept sets on the control's attention (``--optimum``); a trial's attention kept as a bundle the
kept-positions view replays (``--attention``), whose replay gives the trial's own departures. On the
tiny config-built Gemma 3 of tests/test_needle.py (random weights, a character tokenizer)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_needle import HAS_TORCH, folder  # noqa: F401  (the tiny model, a module fixture)

from kvsim import cli

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

BASE = ["--budget", "24", "--recent-window", "4", "--lengths", "100", "--depths", "0.5", "--trials", "1", "--quiet",
        "--json"]


def _grid(folder, capsys, *flags, policies="h2o,streaming_llm"):  # noqa: F811
    code = cli.main(["needle", "--model", str(folder), "--policies", policies, *BASE, *flags])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _loop_departures(kept_history: np.ndarray, steps: int) -> np.ndarray:
    """Departures read step by step from a replay's kept sets (what ``departures_of`` counts)."""
    left = np.full(steps + 1, -1, dtype=np.int32)
    held = {0}
    for t in range(1, steps + 1):
        now = set(kept_history[t - 1][kept_history[t - 1] >= 0].tolist())
        for p in (held | {t}) - now:
            left[p] = t
        held = now
    return left


def test_departures_of_counts_what_the_loop_reads():
    from kvsim.data.trace import from_array
    from kvsim.models.needle_traces import departures_of
    from kvsim.sim.simulate import replay

    rng = np.random.default_rng(3)
    a = np.tril(rng.random((90, 90)), -1) ** 4
    a[0, 0] = 1.0
    trace = from_array(a)
    for policy, budget, params in [("h2o", 10, {"recent_window": 4}), ("streaming_llm", 7, {"sinks": 2}),
                                   ("optimal", 12, {}), ("tova", 89, {})]:
        kept = replay(trace, policy, budget=budget, record_kept=True, **params).kept_history
        assert np.array_equal(departures_of(kept, trace.steps), _loop_departures(kept, trace.steps)), policy


def test_a_split_and_a_compressed_prompt_run_and_key_their_trials(folder, capsys):  # noqa: F811
    plain = _grid(folder, capsys, policies="h2o")["cells"][0]["runs"][0]
    split = _grid(folder, capsys, "--allocate", "pyramidkv", policies="h2o")
    run = split["cells"][0]["runs"][0]
    assert run["label"] == "h2o @ 24, recent_window 4, split pyramidkv" and run["allocate"] == "pyramidkv"
    assert run["cache_key"]["allocate"] == "pyramidkv" and "allocate" not in plain["cache_key"]
    budgets = np.asarray(run["budgets"])
    assert budgets.sum() == 24 * budgets.size and budgets[0, 0] > budgets[-1, 0]  # pyramidkv: more below, same memory
    assert plain["budgets"] == [[24, 24]] * 3
    # a file's split, deployed as it is: its rows are in the key, not its path
    rows = [{"layer": x, "kv_head": h, "budget": b} for x, h, b in [(0, 0, 20), (0, 1, 28), (1, 0, 30), (1, 1, 18),
                                                                     (2, 0, 24), (2, 1, 24)]]
    path = folder.parent / "split.json"
    path.write_text(json.dumps({"allocation": rows}))
    filed = _grid(folder, capsys, "--allocate", str(path), policies="h2o")["cells"][0]["runs"][0]
    assert filed["budgets"] == [[20, 28], [30, 18], [24, 24]]
    assert filed["cache_key"]["allocate"] == [[0, 0, 20], [0, 1, 28], [1, 0, 30], [1, 1, 18], [2, 0, 24], [2, 1, 24]]
    assert "split from a file" in filed["label"]
    # a compressed prompt: what the scorer does not keep leaves at the prompt's last step (99)
    squeezed = _grid(folder, capsys, "--prefill-budget", "40", "--prefill-policy", "snapkv:recent_window=8",
                     policies="h2o")
    run = squeezed["cells"][0]["runs"][0]
    assert run["prefill"] == {"budget": 40, "policy": "snapkv", "params": {"recent_window": 8}}
    assert run["cache_key"]["prefill"] == run["prefill"] and plain["cache_key"]["prefill"] == "exact"
    from kvsim.models.needle import departures

    left = departures(run)
    for layer in left:
        for head in layer:
            assert (head[:99] == -1).sum() + (head[:99] == 99).sum() + (head[:99] > 99).sum() == 99
            assert (head[:100] < 0).sum() + (head[:100] == 99).sum() >= 60  # 40 kept of 100, then 24 of them decoded on
    text = capsys.readouterr()
    assert text.err == ""


def test_the_optimum_is_optimal_replayed_on_the_controls_attention(folder, capsys):  # noqa: F811
    from kvsim.models import needle, needle_prompt
    from kvsim.models.needle_traces import control_traces
    from kvsim.models.quality import load
    from kvsim.sim.simulate import replay

    doc = _grid(folder, capsys, "--optimum")
    cell = doc["cells"][0]
    model, tokenizer, _ = load(str(folder), None)
    prompt = needle_prompt.Builder(tokenizer, needle_prompt.Template()).prompt(100, 0.5, cell["key"])
    control = needle.read_trial(cell["control"]["cache_key"])
    ids = list(prompt.ids) + list(control["tokens"])[:-1]
    traces = control_traces(model, ids)
    assert len(traces) == 6 and all(t.steps == len(ids) - 1 for t in traces.values())
    for run in cell["runs"]:
        for (x, h), trace in traces.items():
            kept = replay(trace, "optimal", budget=24, record_kept=True).kept_history
            left = _loop_departures(kept, trace.steps)
            key = left[cell["key_positions"]]
            assert run["optimal_key_left"][x][h] == (None if (key < 0).any() else int(key.max()))
            assert run["optimal_key_first_left"][x][h] == (None if (key < 0).all() else int(key[key >= 0].min()))
    # the optimum holds the key longer than streaming_llm, which drops it a fixed distance after it came
    streaming = cell["runs"][1]
    assert streaming["policy"] == "streaming_llm"
    assert all(v is not None for row in streaming["key_left"] for v in row)
    latest = lambda fates: sum(len(ids) if v is None else v for row in fates for v in row)  # noqa: E731
    assert latest(streaming["optimal_key_left"]) > latest(streaming["key_left"])
    out = cli.main(["needle", "--model", str(folder), "--policies", "h2o,streaming_llm", *BASE[:-1], "--optimum"])
    printed = capsys.readouterr().out
    assert out == 0 and "the exact optimum on the control's attention at the same budgets:" in printed


def test_under_blocks_the_optimum_is_the_optimum_under_the_same_blocks(folder, capsys):  # noqa: F811
    """``--optimum --block-size 8``: each run's optimum is ``optimal`` under blocks of 8 (whole-block
    evictions, docs/serving.md) on the control's attention, not the free optimum, and the text says so."""
    from kvsim.models import needle, needle_prompt
    from kvsim.models.needle_traces import control_traces
    from kvsim.models.quality import load
    from kvsim.policykit.layouts import Layout
    from kvsim.sim.simulate import replay

    doc = _grid(folder, capsys, "--optimum", "--block-size", "8", policies="h2o")
    cell = doc["cells"][0]
    (run,) = cell["runs"]
    assert run["layout"]["block_size"] == 8 and run["optimal_cache_key"]["block_size"] == 8
    model, tokenizer, _ = load(str(folder), None)
    prompt = needle_prompt.Builder(tokenizer, needle_prompt.Template()).prompt(100, 0.5, cell["key"])
    control = needle.read_trial(cell["control"]["cache_key"])
    traces = control_traces(model, list(prompt.ids) + list(control["tokens"])[:-1])
    differs = False
    for (x, h), trace in traces.items():
        paged = _loop_departures(replay(trace, "optimal", budget=24, layout=Layout(8), record_kept=True).kept_history,
                                 trace.steps)
        free = _loop_departures(replay(trace, "optimal", budget=24, record_kept=True).kept_history, trace.steps)
        key = paged[cell["key_positions"]]
        assert run["optimal_key_left"][x][h] == (None if (key < 0).any() else int(key.max()))
        differs |= not np.array_equal(paged, free)
    assert differs  # whole blocks are another schedule than single positions
    out = cli.main(["needle", "--model", str(folder), "--policies", "h2o", *BASE[:-1], "--optimum", "--block-size", "8"])
    assert out == 0 and "the exact optimum under the same blocks of 8 on the control's attention" in capsys.readouterr().out


def test_a_trials_attention_replays_to_its_own_departures(folder, capsys):  # noqa: F811
    """The kept view's replay of a trial's bundle (the same policy, budget and parameters) evicts each
    position at the step the trial's cache did: the simulator on the same attention."""
    from kvsim.data.catalog import resolve_bundle
    from kvsim.models.needle import departures
    from kvsim.models.needle_traces import bundle_meta, replay_departures

    doc = _grid(folder, capsys, "--attention", "--sinks", "2", "--lengths", "120")
    cell = doc["cells"][0]
    for run in cell["runs"]:
        name = run["attention"]["bundle"]
        bundle = resolve_bundle(name)
        meta = bundle_meta(name)
        assert meta["key_positions"] == cell["key_positions"] and meta["policy"] == run["policy"]
        left = departures(run)
        done = {(t.layer, t.head) for t in bundle.traces} | {tuple(s) for s in run["attention"]["skipped"]}
        assert done == {(x, h) for x in range(3) for h in range(2)} and (1, 0) in {(t.layer, t.head) for t in bundle.traces}
        for t in bundle.traces:
            trace = bundle.load(t.layer, t.head)
            assert trace.steps == run["positions"] - 1 and trace.meta["key_positions"] == cell["key_positions"]
            sim = replay_departures(trace, run["policy"], run["budget"], **run["params"])
            assert np.array_equal(sim, left[t.layer, t.head, : trace.steps + 1]), (run["label"], t.layer, t.head)
    # a second run reads the trials and their bundles back
    again = _grid(folder, capsys, "--attention", "--sinks", "2", "--lengths", "120")
    assert all(r["cached"] for r in again["cells"][0]["runs"])


def test_bad_input_for_the_new_flags_is_one_line_before_the_weights_load(folder, tmp_path, capsys):  # noqa: F811
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"allocation": [{"layer": 0, "kv_head": 0, "budget": 24}]}))
    cases = [
        (["--allocate", "adakv"], "--allocate: adakv: a trial reads each head's departures from its own block"),
        (["--allocate", "cake"], "--allocate: cake: cake computes its split from a recorded bundle"),
        (["--allocate", str(tmp_path / "none.json")], "--allocate: "),
        (["--allocate", str(odd)], "an allocation for another model's shape"),
        (["--allocate", "pyramidkv", "--prefill-budget", "0.5"], "--allocate does not go with --prefill-budget"),
        (["--allocate", "pyramidkv", "--budget", "90"], "budget 1"),  # pyramidkv's lowest layer holds more than 100
        (["--prefill-budget", "100"], "--prefill-budget: 100: keeps all of the 100-token prompt"),
        (["--prefill-budget", "1.5"], "--prefill-budget: the ratio 1.5 must lie strictly between 0 and 1"),
        (["--prefill-budget", "abc"], "--prefill-budget: expected an integer or a ratio"),
        (["--prefill-budget", "8", "--prefill-policy", "snapkv"], "--prefill-budget: 8 positions must be above"),
        (["--prefill-budget", "50", "--prefill-policy", "optimal"], "--prefill-policy: optimal cannot rank the prompt"),
        (["--prefill-policy", "snapkv"], "--prefill-policy goes with --prefill-budget"),
        (["--prefill-budget", "50", "--optimum"], "--optimum does not go with --prefill-budget"),
        (["--prefill-budget", "50", "--attention"], "--attention does not go with --prefill-budget"),
    ]
    for flags, message in cases:
        code = cli.main(["needle", "--model", str(folder), "--policies", "streaming_llm", "--budget", "24", "--lengths",
                         "100", *flags])
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert code == 1 and out.out == "" and len(lines) == 1, (flags, out.err)
        assert lines[0].startswith("kvsim: error: ") and message in lines[0], (flags, lines[0])

"""``kvsim needle`` (issue 35): the pass-key grid end to end on a tiny config-built Gemma 3 (random
weights, a character tokenizer, nothing downloaded), the needle's fate checked against the kept sets the
simulator's harness gives for the same attention, and each bad input refused in one line before the
weights load."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from kvsim import cli

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Gemma 3 (sliding, global, sliding; 4 query heads over 2 KV heads; context 512) saved with
    a tokenizer of one token per character."""
    from tiny_models import char_gemma3

    return char_gemma3(tmp_path_factory.mktemp("needle") / "tiny-gemma3")


def _grid(folder, capsys, *flags):
    code = cli.main(["needle", "--model", str(folder), "--policies", "h2o,streaming_llm", "--budget", "24",
                     "--recent-window", "4", "--sinks", "2", "--lengths", "100,140", "--depths", "0:1:0.5",
                     "--trials", "1", "--quiet", "--json", *flags])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _simulated_departures(shown: dict, policy: str, seen: int, **params) -> np.ndarray:
    """Each position's departure step in the harness's replay of a trace whose row t is the attention the
    cache showed the policy at step t (at the positions it held then)."""
    from kvsim.data.trace import from_array
    from kvsim.policies import make_policy
    from kvsim.sim.harness import replay_reference

    a = np.zeros((seen, seen), dtype=np.float64)
    for t, (kept, attn) in shown.items():
        a[t, kept] = attn if attn is not None else 1.0 / kept.size
    a[0, 0] = 1.0
    result = replay_reference(from_array(a), make_policy(policy, budget=24, **params), record_kept=True)
    left = np.full(seen + 1, -1, dtype=np.int32)
    held = {0}
    for t in range(1, seen):
        now = set(result.kept_history[t - 1][result.kept_history[t - 1] >= 0].tolist())
        for p in (held | {t}) - now:
            left[p] = t
        held = now
    return left


def test_a_tiny_models_grid_runs_end_to_end_and_its_key_fates_are_the_simulators(folder, capsys):
    from kvsim.models import needle, needle_prompt
    from kvsim.models.quality import load

    doc = _grid(folder, capsys)
    assert doc["lengths"] == [100, 140] and doc["depths"] == [0.0, 0.5, 1.0] and len(doc["cells"]) == 6
    assert [g["label"] for g in doc["grids"]] == ["h2o @ 24, recent_window 4", "streaming_llm @ 24, sinks 2"]
    assert doc["template"]["needle"] == needle_prompt.NEEDLE and doc["template"]["filler_repeated"] is True
    # random weights never find the key: every cell is labelled (None), none counted
    assert doc["control"]["fails"] and all(v is None for g in doc["grids"] for row in g["accuracy"] for v in row)
    model, tokenizer, _ = load(str(folder), None)
    builder = needle_prompt.Builder(tokenizer, needle_prompt.Template())
    for cell in doc["cells"]:
        prompt = builder.prompt(cell["length"], cell["depth"], cell["key"], cell["trial"])
        assert len(prompt.ids) == cell["length"] and list(prompt.key_positions) == cell["key_positions"]
        assert "".join(tokenizer.decode([prompt.ids[p]]) for p in prompt.key_positions) == cell["key"] * 2
        for run in cell["runs"]:
            params = run["params"]
            shown = {}

            def listen(layer, head, t, kept, attn, shown=shown):
                shown.setdefault((layer, head), {})[t] = (kept, attn)

            fresh = needle.run_trial(model, prompt, run["policy"], run["budget"], params, listen=listen)
            cached = needle.departures(run)
            assert np.array_equal(fresh["left"], cached)  # the disk cache holds what a fresh decode gives
            seen = cell["length"] + needle.NEW_TOKENS - 1
            assert fresh["positions"] == run["positions"] == seen
            for (layer, head), rows in shown.items():
                sim = _simulated_departures(rows, run["policy"], seen, **params)
                assert np.array_equal(fresh["left"][layer, head, :seen], sim[:seen]), (run["label"], layer, head)
            assert run["key_left"] == needle.fate(cached, cell["key_positions"])
    # the needle is lost somewhere: at budget 24 of 100+ positions, a sliding window drops it
    streaming = [r for c in doc["cells"] for r in c["runs"] if r["policy"] == "streaming_llm" and c["depth"] == 0.5]
    assert all(step is not None for r in streaming for layer in r["key_left"] for step in layer)


def test_a_second_run_reads_every_trial_from_the_cache_and_dask_gives_the_same_grid(folder, capsys):
    first = _grid(folder, capsys, "--lengths", "100", "--depths", "0.5")
    again = _grid(folder, capsys, "--lengths", "100", "--depths", "0.5")
    assert all(r["cached"] for c in again["cells"] for r in [c["control"], *c["runs"]])
    spread = _grid(folder, capsys, "--lengths", "100", "--depths", "0.5", "--workers", "1", "--no-cache")
    assert spread["run"]["executor"] == "dask" and spread["run"]["workers"] == 1
    assert not any(r["cached"] for c in spread["cells"] for r in [c["control"], *c["runs"]])
    strip = lambda d: [[(r["text"], r["key_left"]) for r in [c["control"], *c["runs"]]] for c in d["cells"]]  # noqa: E731
    assert strip(spread) == strip(first)


def test_bad_input_is_one_line_before_the_weights_load(folder, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here. Not enough.")
    cases = [
        (["--lengths", "600"], "--lengths: 600: beyond"),
        (["--budget", "100", "--lengths", "100,200"], "--budget: 100: at or above --lengths 100: nothing is evicted"),
        (["--depths", "0:1.5:0.5"], "--depths: 0:1.5:0.5: 1.5 is outside [0, 1]"),
        (["--depths", "-0.1"], "--depths: -0.1: -0.1 is outside [0, 1]"),
        (["--filler", str(short), "--lengths", "200"], f"--filler: {short}: 34 tokens, a 200-token prompt needs"),
        (["--policy", "optimal"], "--policy: optimal: an offline reference"),
        (["--policies", "optimal"], "--policy: optimal: an offline reference"),  # the old spelling, still taken
        (["--needle", "no key here"], "--needle: 'no key here': has no {key}"),
        (["--policies", "h2o", "--recent-window", "30"], "h2o: --recent-window 30 must be below --budget 24"),
    ]
    for flags, message in cases:
        code = cli.main(["needle", "--model", str(folder), "--policies", "streaming_llm", "--budget", "24", "--lengths", "100",
                         *flags])
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert code == 1 and out.out == "" and len(lines) == 1, (flags, out.err)
        assert lines[0].startswith("kvsim: error: ") and message in lines[0], (flags, lines[0])


def test_accuracy_counts_only_the_trials_the_control_got_right():
    from kvsim.models.needle import Job, accuracy

    def cell(depth, length, control, *runs):
        return {"depth": depth, "length": length, "control": {"correct": control},
                "runs": [{"correct": r} for r in runs]}

    trials = [cell(0.0, 64, True, True), cell(0.0, 64, True, False), cell(0.0, 64, False, True),
              cell(1.0, 64, False, True)]
    doc = accuracy(trials, [Job("h2o", 32)], [64], [0.0, 1.0])
    assert doc["control"]["accuracy"] == [[2 / 3], [0.0]] and not doc["control"]["fails"]
    assert doc["grids"][0]["accuracy"] == [[0.5], [None]] and doc["grids"][0]["counted"] == [[2], [0]]


def test_a_serial_grid_says_each_run_as_it_ends(folder, capsys):
    """A cell of many policies decodes for minutes: progress names every run (the control's and each
    policy's), whether decoded or read from the cache, then the cell's summary."""
    code = cli.main(["needle", "--model", str(folder), "--policies", "h2o,streaming_llm", "--budget", "24",
                     "--recent-window", "4", "--sinks", "2", "--lengths", "100", "--depths", "0.5", "--trials", "1",
                     "--json"])
    err = capsys.readouterr().err
    assert code == 0, err
    runs = [line for line in err.splitlines() if "length 100 depth 0.5 trial 1: " in line
            and "run(s)" not in line]
    assert len(runs) == 3, err
    assert any("full cache" in line for line in runs) and any("h2o" in line for line in runs)
    assert any("streaming_llm" in line for line in runs)

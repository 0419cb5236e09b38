"""Compression at the prompt's end (kvsim.sim.prefill; docs/scorers.md "prefill compression"): the one-time
choice on a hand-computed prompt, decoding from the kept set (the cache growing, or a decode-time policy
resumed from it), the figures over the decode steps only, and the CLI's flags with their one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from random_traces import random_trace

from kvsim import cli
from kvsim.data.trace import from_array, save_npz
from kvsim.policies import PolicySpec
from kvsim.sim.prefill import GROW, Prefill, PrefillError, choose_on, keep_count, rankers, replay_prefill
from kvsim.sim.simulate import replay

#: six steps; positions 0 .. 4 are the prompt (P = 5), steps 5 and 6 decode. Row t is query t's weight on
#: positions 0 .. t - 1 (its own dropped: docs/domain.md), summing to 1; dyadic, so every sum below is exact.
ROWS = [
    [],
    [1.0],
    [0.5, 0.5],
    [0.25, 0.5, 0.25],
    [0.125, 0.0, 0.125, 0.75],
    [0.125, 0.25, 0.125, 0.25, 0.25],
    [0.0625, 0.0625, 0.125, 0.25, 0.25, 0.25],
]


def _hand_trace(meta=None):
    a = np.zeros((7, 7), dtype=np.float32)
    for t, row in enumerate(ROWS):
        a[t, : len(row)] = row
    return from_array(a, name="hand", meta=meta)


def test_snapkv_keeps_the_window_and_the_most_attended_by_the_last_queries():
    """By hand, P = 5, keep 3, snapkv (recent_window 1, observation_window 2): position 4 is the window;
    the last two prompt queries (rows 3 and 4) give p0 0.25 + 0.125 = 0.375, p1 0.5 + 0 = 0.5, p2 0.375,
    p3 0.75: p3 and p1. h2o over every prompt row keeps p0 (1 + 0.5 + 0.25 + 0.125 = 1.875) and p1
    (0.5 + 0.5 + 0 = 1) instead (p3 has 0.75): the window is what makes SnapKV."""
    trace = _hand_trace()
    snap = Prefill.of(trace, 3, "snapkv", prompt=5, recent_window=1, observation_window=2)
    assert choose_on(trace, snap).tolist() == [1, 3, 4]
    h2o = Prefill.of(trace, 3, "h2o", prompt=5, recent_window=1)
    assert choose_on(trace, h2o).tolist() == [0, 1, 4]


def test_decoding_goes_on_from_the_kept_set_and_is_measured_after_the_prompt():
    """The cache grows: step 5 sees {1, 3, 4}, step 6 {1, 3, 4, 5}; retained mass and top-k recall are over
    steps 5 and 6 alone. By hand: 0.25 + 0.25 + 0.25 = 0.75 and 0.0625 + 0.25 + 0.25 + 0.25 = 0.8125."""
    trace = _hand_trace()
    prefill = Prefill.of(trace, 3, "snapkv", prompt=5, recent_window=1, observation_window=2)
    r = replay_prefill(trace, prefill, None, top_k=2, record_kept=True)
    assert r.steps == 2 and r.policy == GROW
    assert r.retained_mass_series.tolist() == [0.75, 0.8125]
    # top 2 of row 5: p1 and p3 (p1, p3 and p4 tie at 0.25; the lower positions first): both held; of row 6: p3
    # and p4, held. Of row 6's top 3 (p3, p4, p5) all are held too; of row 5's top 4, p0 (0.125, before p2) is not
    assert r.top_k_recall_series.tolist() == [1.0, 1.0]
    assert replay_prefill(trace, prefill, None, top_k=4).top_k_recall_series.tolist() == [0.75, 0.75]
    assert r.kept_history[0].tolist()[:4] == [1, 3, 4, 5] and r.kept_history[1].tolist()[:5] == [1, 3, 4, 5, 6]
    assert r.params["prompt_length"] == 5 and r.params["prefill_budget"] == 3


def test_a_decode_policy_resumes_from_the_kept_set():
    """h2o at budget 3 from {1, 3, 4}: seeded with the prompt's rows 3 and 4 over what it holds (row 3 on {1}:
    1; row 4 on {1, 3}: 0, 1), so before step 5 its scores are p1 1, p3 1, p4 0; row 5 over {1, 3, 4} is
    1/3 each: p1 4/3, p3 4/3, p4 1/3, and p5 (recent_window 1) is protected: p4 goes."""
    trace = _hand_trace()
    prefill = Prefill.of(trace, 3, "snapkv", prompt=5, recent_window=1, observation_window=2)
    r = replay_prefill(trace, prefill, PolicySpec.of("h2o", 3, recent_window=1), top_k=2, record_kept=True)
    assert r.kept_history[0].tolist() == [1, 3, 5]
    assert r.retained_mass_series[0] == 0.75  # step 5 still saw the whole kept set
    # a budget that holds everything decodes as the growing cache
    trace = random_trace(120, 3)
    prefill = Prefill.of(trace, 0.5, prompt=80)
    grown = replay_prefill(trace, prefill, None)
    wide = replay_prefill(trace, prefill, PolicySpec.of("h2o", 200))
    assert wide.retained_mass_series.tolist() == grown.retained_mass_series.tolist()


def test_keeping_the_whole_prompt_is_the_full_cache_after_it():
    """keep = P evicts nothing: the decode steps' retained mass is every row's whole mass but its own weight,
    which the full-cache replay (sliding window at a budget above T) measures the same way, added in the same
    order (so equal bit for bit)."""
    trace = random_trace(100, 4)
    r = replay_prefill(trace, Prefill.of(trace, 60, prompt=60), None)
    full = replay(trace, "sliding_window", budget=101, reference=True)
    assert r.retained_mass_series.tolist() == full.retained_mass_series[59:].tolist()


def test_ratios_line_up_with_kvpress():
    """kvpress keeps int(q_len x (1 - compression_ratio)); kvsim's ratio is the share kept."""
    for ratio in (0.25, 0.5, 0.75, 0.875):
        assert keep_count(1 - ratio, 4096) == int(4096 * (1 - ratio))
    assert keep_count("0.5", 100) == 50 and keep_count("7", 100) == 7


def test_bad_values_are_refused_naming_what_is_wrong():
    trace = _hand_trace()
    for keep, field in ((0, "prefill_budget"), (6, "prefill_budget"), (1.5, "prefill_budget"), ("x", "prefill_budget")):
        with pytest.raises(PrefillError) as e:
            Prefill.of(trace, keep, prompt=5, recent_window=1, observation_window=1)
        assert e.value.field == field
    with pytest.raises(PrefillError, match="prompt_length: hand does not say"):
        Prefill.of(trace, 2)
    assert Prefill.of(_hand_trace({"prompt_length": 4}), 2, recent_window=1, observation_window=1).prompt == 4
    with pytest.raises(PrefillError, match="cannot rank"):
        Prefill.of(trace, 2, "optimal", prompt=5)
    assert "optimal" not in rankers() and "snapkv" in rankers()


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "t.npz"
    save_npz(random_trace(160, 5, name="t"), path)
    return str(path)


BAD = [
    (["replay", "--policy", "none", "--prefill-budget", "0", "--prompt-length", "100"], "--prefill-budget: 0 positions"),
    (["replay", "--policy", "none", "--prefill-budget", "101", "--prompt-length", "100"], "--prefill-budget: 101 positions"),
    (["replay", "--policy", "none", "--prefill-budget", "1.5", "--prompt-length", "100"], "--prefill-budget: the ratio 1.5"),
    (["replay", "--policy", "none", "--prefill-budget", "1.0", "--prompt-length", "100"], "--prefill-budget: the ratio 1.0"),
    (["replay", "--policy", "none", "--prefill-budget", "16", "--prompt-length", "100"],
     "--prefill-budget: 16 positions must be above the scorer snapkv's recent_window 32"),
    (["replay", "--policy", "none", "--prefill-budget", "50", "--prompt-length", "100", "--prefill-policy", "optimal"],
     "--prefill-policy: optimal cannot rank the prompt"),
    (["replay", "--policy", "none", "--prefill-budget", "50"], "--prompt-length: t does not say where its prompt ends"),
    (["replay", "--policy", "none", "--prefill-budget", "50", "--prompt-length", "161"], "--prompt-length: --prompt-length 161"),
    (["replay", "--policy", "none", "--budget", "8", "--prefill-budget", "50", "--prompt-length", "100"],
     "--budget does not apply to --policy none"),
    (["replay", "--policy", "none"], "--policy none (the cache growing after the prompt) needs --prefill-budget"),
    (["replay", "--policy", "h2o", "--prompt-length", "100"], "--prompt-length and --prefill-policy go with --prefill-budget"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_flags_are_one_line_naming_the_flag(argv, message, trace_file, capsys):
    code = cli.main([*argv, "--trace", trace_file])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith(f"kvsim: error: {message}") and err.count("\n") == 1, err


def test_replay_sweep_and_table_take_the_prefill(trace_file, capsys):
    trace = random_trace(160, 5, name="t")
    code = cli.main(["replay", "--trace", trace_file, "--policy", "h2o", "--budget", "40", "--prefill-budget", "0.5",
                     "--prompt-length", "100", "--json"])
    doc = json.loads(capsys.readouterr().out)
    want = replay_prefill(trace, Prefill.of(trace, 50, prompt=100), PolicySpec.of("h2o", 40))
    assert code == 0 and doc["retained_mass"] == want.retained_mass and doc["steps"] == 61 and doc["prefill_budget"] == 50
    code = cli.main(["sweep", "--trace", trace_file, "--policy", "none", "--prefill-budget", "0.5,0.75,0.875",
                     "--prompt-length", "100", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["prefill_budget"] for r in rows] == [50, 75, 87]
    masses = [r["retained_mass"] for r in rows]
    assert masses == sorted(masses) and sum(r["best"] for r in rows) == 1
    code = cli.main(["sweep", "--trace", trace_file, "--policy", "h2o", "--budget", "40:56:16", "--prefill-budget", "50",
                     "--prompt-length", "100", "--prefill-policy", "h2o:recent_window=4", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["budget"] for r in rows] == [40, 56] and rows[0]["prefill_policy"] == "h2o recent_window=4"
    code = cli.main(["table", "--trace", trace_file, "--prefill-budget", "0.5", "--prompt-length", "100", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["policy"] for r in doc["rows"]] == rankers()
    snap = next(r for r in doc["rows"] if r["policy"] == "snapkv")
    assert snap["retained_mass"] == replay_prefill(trace, Prefill.of(trace, 50, prompt=100), None).retained_mass
    code = cli.main(["table", "--trace", trace_file, "--prefill-budget", "0.5", "--prompt-length", "100"])
    text = capsys.readouterr().out
    assert code == 0 and "50 of the prompt's 100 positions kept per head" in text


def test_the_documented_prefill_commands_run_as_printed_and_print_the_quoted_figures(tmp_path):
    """docs/scorers.md's chain (tests/doc_chains.py), on the shipped real trace: its quoted table is the table's
    output, and the figures its prose quotes are the sweep's and the replay's."""
    from doc_chains import ROOT, chains, run

    (chain,) = [c for c in chains("docs/scorers.md") if any("--prefill-budget" in line for line in c)]
    done = run(chain, tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    text = (ROOT / "docs" / "scorers.md").read_text()
    quoted = text.split("```text\n")[1].split("```")[0].strip()
    assert quoted in done.stdout
    for figure in ("0.8190", "0.8880", "0.9665", "0.9935", "0.6909"):
        assert figure in done.stdout and figure in text

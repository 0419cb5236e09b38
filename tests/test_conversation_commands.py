"""``--conversation FILE`` of quality, generate and record (docs/cli.md, "Conversations"; docs/domain.md, "A
conversation"), and what replay, table and the app's heatmap make of a conversation's trace. A tiny config-built
Gemma 3 with a tokenizer of one token per character (tests/tiny_models.py; random weights, nothing downloaded)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from tiny_models import char_gemma3
from tolerance import rounding

from kvsim import cli

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

CONTEXT = "The cat sat on the mat. The dog ran in the park. The cat sat on the mat. The dog ran in the park."
TURNS = [{"question": "Where did the cat sit?", "answer": "on the mat."},
         {"question": "Where did the dog run?", "answer": "in the park."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if not HAS_TORCH:
        pytest.skip("torch/transformers not installed (requirements-record.txt)")
    return char_gemma3(tmp_path_factory.mktemp("conversation") / "tiny")


@pytest.fixture
def conversation(tmp_path):
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps({"context": CONTEXT, "turns": TURNS}), encoding="utf-8")
    return path


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@needs_torch
def test_quality_measures_each_turns_answer_and_reads_it_back_from_the_cache(model, conversation, capsys):
    """Per turn, delta NLL and KL on its answer tokens: nothing evicted (a budget past the run, open loop) is exactly
    the full cache's; a small budget, closed loop, loses on every turn; a second run reads every result back."""
    from kvsim.models.conversation_tokens import ANSWER

    argv = ["quality", "--conversation", conversation, "--model", model, "--policy", "h2o", "--budget", "48,400",
            "--mode", "both", "--quiet", "--json"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    rows = {(r["budget"], r["mode"]): r for r in json.loads(out)}
    assert len(rows) == 4
    for r in rows.values():
        assert [t["turn"] for t in r["turns"]] == [1, 2] and not r["cached"]
        # one token per character: each answer is its text after the format's space
        assert [t["answer_tokens"] for t in r["turns"]] == [len(ANSWER.format(answer=t["answer"])) for t in TURNS]
    full = rows[(400, "open")]
    assert all(t["delta_nll"] == 0.0 and t["kl"] == 0.0 for t in full["turns"])
    assert full["retained_mass"] == pytest.approx(1.0, abs=rounding(full["tokens"]))  # float32 rows, summed
    small = rows[(48, "closed")]
    assert all(t["kl"] > 0 for t in small["turns"]) and small["retained_mass"] < 1.0
    # the whole is the answer tokens' mean: the turns' weighted by their tokens
    weights = [t["answer_tokens"] for t in small["turns"]]
    assert small["delta_nll"] == pytest.approx(np.average([t["delta_nll"] for t in small["turns"]], weights=weights))
    code, again, _ = _run(capsys, *argv)
    assert code == 0 and all(r["cached"] for r in json.loads(again))
    assert [r["turns"] for r in json.loads(again)] == [r["turns"] for r in json.loads(out)]
    code, text, _ = _run(capsys, *argv[:-1])
    assert code == 0 and "answers teacher-forced" in text and text.count(" closed ") == 6  # 2 turns and all, 2 budgets


@needs_torch
def test_bad_conversations_are_one_line_naming_the_file_and_turn_before_any_model_loads(tmp_path, capsys):
    """Every refusal here comes with a --model that does not exist: the conversation is refused first."""
    nowhere = tmp_path / "no-model"
    files = {
        "empty": {"context": CONTEXT, "turns": [TURNS[0], {"question": "  ", "answer": "x"}]},
        "unanswered": {"context": CONTEXT, "turns": [TURNS[0], {"question": "And the dog?"}]},
    }
    for name, doc in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc), encoding="utf-8")
    (tmp_path / "latin1.json").write_bytes(json.dumps({"context": "caf\u00e9", "turns": TURNS}).replace("\\u00e9", "\u00e9")
                                           .encode("latin-1"))
    cases = [
        (["quality", "--conversation", tmp_path / "empty.json", "--policy", "h2o"], "empty.json: turn 2 is empty"),
        (["quality", "--conversation", tmp_path / "unanswered.json", "--policy", "h2o"],
         "unanswered.json: turn 2 has no answer"),
        (["record", "--conversation", tmp_path / "unanswered.json"], "unanswered.json: turn 2 has no answer"),
        (["quality", "--conversation", tmp_path / "latin1.json", "--policy", "h2o"], "latin1.json: not UTF-8"),
        (["generate", "--conversation", tmp_path / "latin1.json", "--policy", "h2o", "--max-new-tokens", "4"],
         "latin1.json: not UTF-8"),
        (["generate", "--conversation", tmp_path / "empty.json", "--policy", "h2o", "--max-new-tokens", "4"],
         "empty.json: turn 2 is empty"),
        (["quality", "heapq", "--conversation", tmp_path / "empty.json", "--policy", "h2o"],
         "leave out the TEXT argument ('heapq')"),
        (["generate", "hello", "--conversation", tmp_path / "empty.json", "--policy", "h2o", "--max-new-tokens", "4"],
         "leave out the PROMPT argument ('hello')"),
        (["record", "text.txt", "--conversation", tmp_path / "empty.json"], "leave out the TEXT argument"),
        (["record", "--conversation", tmp_path / "empty.json", "--steps", "9"], "--steps and --conversation"),
        (["quality", "--policy", "h2o"], "give the TEXT to measure on, or --conversation FILE"),
        (["quality", "--conversation", tmp_path / "empty.json", "--policy", "h2o", "--block-size", "8"],
         "--block-size 8 and --conversation"),
    ]
    for argv, message in cases:
        code, out, err = _run(capsys, *argv, "--model", nowhere)
        lines = err.strip().splitlines()
        assert code != 0 and out == "" and len(lines) == 1 and message in lines[0], (argv, err)


@needs_torch
def test_a_turn_past_the_models_context_is_named_before_any_pass(model, tmp_path, capsys):
    """The tiny model's context is 512 tokens (one a character): a second answer of 600 characters runs past it."""
    path = tmp_path / "long.json"
    path.write_text(json.dumps({"context": CONTEXT, "turns": [TURNS[0], {"question": "And?", "answer": "a" * 600}]}))
    code, out, err = _run(capsys, "quality", "--conversation", path, "--model", model, "--policy", "h2o", "--quiet")
    assert code == 1 and out == "" and "long.json: turn 2 is" in err and "tokens, longer than the" in err
    code, out, err = _run(capsys, "generate", "--conversation", path, "--model", model, "--policy", "h2o",
                          "--max-new-tokens", "480")
    assert code == 1 and "long.json: turn 1 is" in err.splitlines()[-1] and "full-cache" not in err


@needs_torch
def test_generate_answers_each_turn_on_one_cache_and_prints_the_reference_beside(model, conversation, capsys):
    code, out, err = _run(capsys, "generate", "--conversation", conversation, "--model", model, "--policy", "h2o",
                          "--budget", "48", "--max-new-tokens", "6", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [t["question"] for t in doc["turns"]] == [t["question"] for t in TURNS]
    assert [t["reference"] for t in doc["turns"]] == [t["answer"] for t in TURNS]
    assert all(1 <= len(t["token_ids"]) <= 6 for t in doc["turns"]) and max(doc["peak_positions"]) == 48
    # every question and every token written but the last went into the one cache
    written = sum(len(t["token_ids"]) for t in doc["turns"]) - 1
    assert doc["positions_seen"] == doc["context_tokens"] + sum(t["question_tokens"] for t in doc["turns"]) + written
    code, text, _ = _run(capsys, "generate", "--conversation", conversation, "--model", model, "--policy", "h2o",
                         "--budget", "48", "--max-new-tokens", "6")
    assert code == 0 and "Q1: Where did the cat sit?" in text and "(reference, not fed: in the park.)" in text


@needs_torch
def test_record_keeps_the_turns_and_replay_table_and_the_heatmap_show_them(model, conversation, tmp_path, capsys):
    """The trace's meta holds each turn's positions; replay gives the retained mass per turn (1 where nothing is
    evicted, and the steps' mean over the turn's queries otherwise); table a row of them per policy; the kept
    heatmap a line where each turn starts."""
    from kvsim.cli.replay_command import load
    from kvsim.sim.simulate import replay
    from kvsim.views import figures, turns
    from kvsim.views.turns import turns_of

    out = tmp_path / "bundle"
    code, _, err = _run(capsys, "record", "--conversation", conversation, "--model", model, "--layers", "1",
                        "--out", out, "--quiet", "--json")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    trace = load(f"{out}:L01H0")
    spans = turns_of(trace.meta, trace.steps)
    assert spans == manifest["turns"] and len(spans) == 2 and spans[-1]["end"] == trace.steps + 1
    assert spans[0]["question_start"] == manifest["context_end"] == trace.meta["context_end"]
    code, doc, err = _run(capsys, "replay", "--trace", f"{out}:L01H0", "--policy", "h2o", "--budget", "48", "--json")
    assert code == 0, err
    got = json.loads(doc)["turns"]
    series = replay(trace, "h2o", budget=48).retained_mass_series
    for t, span in zip(got, spans, strict=True):
        assert t["retained_mass"] == pytest.approx(series[span["question_start"] - 1 : span["end"] - 1].mean())
    code, doc, _ = _run(capsys, "replay", "--trace", f"{out}:L01H0", "--policy", "h2o", "--budget", "400", "--json")
    assert [t["retained_mass"] for t in json.loads(doc)["turns"]] == pytest.approx([1.0, 1.0], abs=rounding(trace.steps))
    code, text, _ = _run(capsys, "table", "--trace", f"{out}:L01H0", "--budget", "48", "--wide")
    assert code == 0 and "Retained mass per turn" in text and "turn 2" in text
    result = replay(trace, "h2o", budget=48, record_kept=True)
    fig = figures.kept_heatmap([result], figures.trace_features(trace))
    marked = turns.marked(fig, trace)
    assert len(marked.layout.shapes) == len(fig.layout.shapes) + 3 * len(spans)
    lines = [s for s in marked.layout.shapes if s.line.color == turns.TURN_COLOUR]
    assert sorted({s.y0 for s in lines if s.y0 == s.y1}) == sorted(
        [t["question_start"] - 0.5 for t in spans] + [t["answer_start"] - 0.5 for t in spans])
    assert turns.marked(fig, load("canonical")) is fig  # not a conversation: nothing drawn


def test_turns_that_do_not_hold_together_are_no_turns():
    from kvsim.views.turns import turns_of

    good = {"question_start": 5, "answer_start": 8, "end": 10}
    assert turns_of({"turns": [good]}, 9) == [good]
    for bad in ([{**good, "end": 8}], [good, good], [{**good, "end": 11}], [{**good, "answer_start": "8"}], "x", []):
        assert turns_of({"turns": bad}, 9) is None
    assert turns_of({}, 9) is None


@needs_torch
def test_the_app_draws_a_recorded_conversations_turns_on_the_kept_heatmap(model, conversation, tmp_path, monkeypatch,
                                                                         capsys):
    """A conversation recorded into the cache is offered by the app; its kept view draws each turn's lines on every
    panel and says the retained mass per turn, without an error."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from kvsim.app import memo
    from kvsim.views.turns import TURN_COLOUR

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    code, _, err = _run(capsys, "record", "--conversation", conversation, "--model", model, "--layers", "1", "--quiet")
    assert code == 0, err
    memo.bundle_traces.clear()  # the trace list is kept a minute; this bundle is new
    (name,) = [n for n in memo.bundle_traces() if "-conversation-" in n and n.endswith(":L01H0")]
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=300)
    at.query_params.update({"view": "Kept positions", "trace": name, "budget": "48"})
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    (chart,) = at.get("plotly_chart")
    spec = json.loads(chart.proto.spec)
    panels = {(t.get("xaxis", "x"), t.get("yaxis", "y")) for t in spec["data"] if t["type"] == "image"}
    drawn = [s for s in spec["layout"]["shapes"] if s.get("line", {}).get("color") == TURN_COLOUR]
    # three lines a turn on every panel, and a label a turn on the first
    assert {(s["xref"], s["yref"]) for s in drawn} == panels and len(drawn) == 3 * 2 * len(panels)
    assert [a["text"] for a in spec["layout"]["annotations"] if a.get("font", {}).get("color") == TURN_COLOUR] == [
        "turn 1", "turn 2"]
    (said,) = [c.value for c in at.caption if c.value.startswith("A conversation of 2 turns")]
    assert "h2o (recent_window=32): turn 1 " in said

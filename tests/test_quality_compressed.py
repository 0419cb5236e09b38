"""``quality --conversation`` with a compressed prompt (``--prefill-budget``, ``--prefill-policy``, ``--query``;
``kvsim.models.quality_turns.Compression``): the context compressed once by a scorer, then every later token
teacher-forced through that cache, delta NLL and KL per turn, in the closed loop only. A tiny config-built Gemma 3
with a tokenizer of one token per character (tests/tiny_models.py; random weights, nothing downloaded)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from tiny_models import char_gemma3

from kvsim import cli

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

CONTEXT = "The cat sat on the mat. The dog ran in the park. The cat sat on the mat. The dog ran in the park."
TURNS = [{"question": "Where did the cat sit?", "answer": "on the mat."},
         {"question": "Where did the dog run?", "answer": "in the park."}]
BUDGET = 40  # snapkv's recent window is 32: the prompt (98 positions of context) is compressed to 40


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if not HAS_TORCH:
        pytest.skip("torch/transformers not installed (requirements-record.txt)")
    return char_gemma3(tmp_path_factory.mktemp("compressed") / "tiny")


@pytest.fixture(scope="module")
def session(model, tmp_path_factory):
    from kvsim.models.quality_turns import open_conversation

    path = tmp_path_factory.mktemp("conv") / "conversation.json"
    path.write_text(json.dumps({"context": CONTEXT, "turns": TURNS}), encoding="utf-8")
    return open_conversation(path, model, progress=None, use_cache=False)


def _by_hand(session, query: str):
    """The same cache fed by hand, without converse: the context and the first question in one call (aware) or two
    (agnostic), then every later position one call each; per answer token its log-probability under the model's own
    logits, and KL(full || this) against the session's full-cache hidden states through the output layer."""
    import torch

    import kvsim.hf as hf

    model, ids, first = session.model, list(session.tokens.ids), session.tokens.turns[0]
    cache = hf.cache(model, "snapkv", BUDGET, prefill="compress", prefill_budget=BUDGET, prefill_policy="snapkv")
    logits = {}
    with torch.no_grad():
        if query == "aware":
            out = model(torch.tensor([ids[: first.answer_start]]), cache=cache, use_cache=True)
        else:
            model(torch.tensor([ids[: first.question_start]]), cache=cache, use_cache=True)
            out = model(torch.tensor([ids[first.question_start : first.answer_start]]), cache=cache, use_cache=True)
        logits[first.answer_start - 1] = out.logits[0, -1]
        for p in range(first.answer_start, session.n - 1):
            logits[p] = model(torch.tensor([[ids[p]]]), cache=cache, use_cache=True).logits[0, -1]
        turns = []
        for t in session.tokens.turns:
            at = range(t.answer_start - 1, t.end - 1)  # the positions that predict the answer's tokens
            lp = torch.stack([torch.log_softmax(logits[p].double(), -1) for p in at])
            full = torch.log_softmax(model.get_output_embeddings()(session.hidden_full[list(at)]).double(), -1)
            targets = torch.tensor([ids[p + 1] for p in at])
            nll = -lp.gather(1, targets[:, None])[:, 0]
            kl = (full.exp() * (full - lp)).sum(-1)
            turns.append((float(nll.mean()), float(kl.mean())))
    return turns


@needs_torch
@pytest.mark.parametrize("query", ["aware", "agnostic"])
def test_a_compressed_prompts_closed_loop_per_turn_is_the_same_cache_fed_by_hand(session, query):
    from kvsim.models.quality_turns import Compression

    mine = session.compressed(Compression(BUDGET, "snapkv", (), query))
    (r,) = mine.evaluate_many([mine.configuration("snapkv", BUDGET)])
    assert r["prefill"] == {"budget": BUDGET, "policy": "snapkv", "params": {}, "query": query} and r["mode"] == "closed"
    hand = _by_hand(session, query)
    for t, (nll, kl) in zip(r["turns"], hand, strict=True):
        assert t["nll"] == pytest.approx(nll, abs=1e-5) and t["kl"] == pytest.approx(kl, abs=1e-5)
        assert t["delta_nll"] == pytest.approx(t["nll"] - t["nll_full"], abs=1e-12)
    # the compression lost something on every turn, and the budget holds after the prompt
    assert all(t["kl"] > 1e-6 for t in r["turns"]) and r["retained_mass_after_prompt"] < 1.0


@needs_torch
def test_query_aware_and_agnostic_keep_different_prompt_positions(session):
    """Aware compresses at the first question's end (the question in snapkv's observation window); agnostic at the
    context's end. The context positions each keeps differ, and so does what turn 1's answer loses."""
    import torch

    from kvsim.models.quality_turns import Compression

    first = session.tokens.turns[0]
    runs = {}
    for query in ("aware", "agnostic"):
        mine = session.compressed(Compression(BUDGET, "snapkv", (), query))
        c = mine.configuration("snapkv", BUDGET)
        hidden, mass, after, left = mine.run_compressed(c)
        runs[query] = (left, mine.evaluate_many([c])[0])
        if query == "aware":  # the prompt's one call attends in full: its last row is the full pass's, position for position
            assert torch.allclose(hidden[first.answer_start - 1], session.hidden_full[first.answer_start - 1], atol=1e-4)
    aware, agnostic = runs["aware"][0], runs["agnostic"][0]
    # where each compression happened: every context position it dropped left at that step
    dropped_aware = aware[:, :, : first.question_start] == first.answer_start - 1
    dropped_agnostic = agnostic[:, :, : first.question_start] == first.question_start - 1
    assert dropped_aware.any() and dropped_agnostic.any() and not (aware == first.question_start - 1).any()
    held = lambda left, step: (left[:, :, : first.question_start] < 0) | (left[:, :, : first.question_start] > step)  # noqa: E731
    assert not np.array_equal(held(aware, first.answer_start - 1), held(agnostic, first.answer_start - 1))
    assert runs["aware"][1]["turns"][0]["nll"] != runs["agnostic"][1]["turns"][0]["nll"]


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@needs_torch
def test_the_command_line_measures_a_compressed_prompt_and_reads_it_back(model, tmp_path, capsys):
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps({"context": CONTEXT, "turns": TURNS}), encoding="utf-8")
    argv = ["quality", "--conversation", path, "--model", model, "--policy", "snapkv", "--budget", BUDGET,
            "--prefill-budget", BUDGET, "--query", "agnostic", "--quiet", "--json"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    r = json.loads(out)
    assert r["prefill"]["query"] == "agnostic" and [t["turn"] for t in r["turns"]] == [1, 2] and not r["cached"]
    code, again, _ = _run(capsys, *argv)
    assert code == 0 and json.loads(again)["cached"] and json.loads(again)["turns"] == r["turns"]
    # aware is another measurement, under its own key
    code, aware, _ = _run(capsys, *argv[:-4], "--quiet", "--json")
    assert code == 0 and not json.loads(aware)["cached"] and json.loads(aware)["prefill"]["query"] == "aware"
    code, text, _ = _run(capsys, *argv[:-1])
    assert code == 0 and "the prompt compressed once to 40 by snapkv, query-agnostic" in text
    # the prefill budget against the prompt: once the tokenizer has loaded, before any pass
    code, out, err = _run(capsys, *argv[:9], "--prefill-budget", "500", "--quiet")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert "--prefill-budget: 500 positions must be from 1 to the prompt's 128 (the context and the first question" in err


@needs_torch
def test_bad_compression_flags_are_one_line_before_any_model_loads(tmp_path, capsys):
    """Every refusal here comes with a --model that does not exist: the flags are refused first."""
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps({"context": CONTEXT, "turns": TURNS}), encoding="utf-8")
    base = ["quality", "--conversation", path, "--policy", "snapkv", "--budget", "40"]
    cases = [
        ([*base, "--prefill-budget", "0"], "--prefill-budget: 0: at least 1 position per head"),
        ([*base, "--prefill-budget", "1.5"], "--prefill-budget: the ratio 1.5 must lie strictly between 0 and 1"),
        ([*base, "--prefill-budget", "lots"], "--prefill-budget: expected an integer or a ratio"),
        ([*base, "--prefill-budget", "40", "--prefill-policy", "nonesuch"], "--prefill-policy: unknown policy 'nonesuch'"),
        ([*base, "--prefill-budget", "40", "--prefill-policy", "optimal"], "--prefill-policy: optimal cannot rank"),
        ([*base, "--prefill-budget", "8"], "--prefill-budget: 8 positions must be above the scorer snapkv's recent_window"),
        ([*base, "--query", "agnostic"], "--query goes with --prefill-budget"),
        ([*base, "--prefill-policy", "knorm"], "--prefill-policy goes with --prefill-budget"),
        ([*base, "--prefill-budget", "40", "--mode", "open"], "--mode open and --prefill-budget: the open loop replays"),
        ([*base, "--prefill-budget", "40", "--mode", "both"], "--mode both and --prefill-budget"),
        (["quality", "heapq", "--policy", "snapkv", "--prefill-budget", "40"], "--prefill-budget goes with --conversation"),
    ]
    for argv, message in cases:
        code, out, err = _run(capsys, *argv, "--model", tmp_path / "no-model")
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1 and message in lines[0], (argv, err)

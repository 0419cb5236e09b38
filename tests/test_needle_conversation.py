"""A pass key per turn (issue 57): ``kvsim needle --keys K`` on a tiny config-built Gemma 3 (random weights, a
character tokenizer): K numbered keys in one context, each turn's question on the same evicting cache, each
key's fate per (layer, KV head), the optimum over the whole conversation at or above every policy's retained
mass, query-aware against query-agnostic compression, and each bad input refused in one line before the weights
load."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from kvsim import cli

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

#: the tiny model's context is 512 characters: a 330-token context and first question leave room for the second turn
LENGTH = "330"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tiny_models import char_gemma3

    return char_gemma3(tmp_path_factory.mktemp("conversation") / "tiny-gemma3")


def _run(folder, capsys, *flags, code=0):
    got = cli.main(["needle", "--model", str(folder), "--lengths", LENGTH, "--quiet", *flags])
    out = capsys.readouterr()
    assert got == code, out.err
    return out


def _doc(folder, capsys, *flags):
    return json.loads(_run(folder, capsys, "--json", *flags).out)


def test_two_turns_on_one_cache_give_each_keys_fate_and_the_optimum_bounds_every_policy(folder, capsys):
    from kvsim.models import needle
    from kvsim.models.quality import load

    doc = _doc(folder, capsys, "--keys", "2", "--depths", "0.7,0.3", "--policy", "h2o,streaming_llm,tova", "--budget",
               "24", "--recent-window", "4", "--sinks", "2", "--optimum")
    assert doc["conversation"] and doc["keys"] == 2 and doc["depths"] == [0.7, 0.3]
    (cell,) = doc["cells"]
    _, tokenizer, _ = load(str(folder), None)
    k1, k2 = cell["keys"]
    assert k1 != k2 and all(len(k) == 5 for k in cell["keys"])
    for key, positions in zip(cell["keys"], cell["key_positions"], strict=True):
        assert "".join(tokenizer.decode([cell_id]) for cell_id in _ids(folder, cell, positions)) == key  # said once
    assert cell["key_positions"][1][0] < cell["key_positions"][0][0]  # key 2 at depth 0.3 comes first
    assert [g["label"] for g in doc["grids"]] == ["h2o @ 24, recent_window 4", "streaming_llm @ 24, sinks 2",
                                                  "tova @ 24"]
    for run in cell["runs"]:
        assert len(run["found"]) == 2 and len(run["answers"]) == 2 and len(run["texts"]) == 2
        assert len(run["key_left"]) == 2 and len(run["key_left"][0]) == 3 and len(run["key_left"][0][0]) == 2
        # the departures this run cached say the same fate, key by key
        left = needle.read_trial(run["cache_key"])["left"]
        for i, positions in enumerate(cell["key_positions"]):
            at = left[:, :, positions]
            assert run["key_left"][i] == [[None if (r < 0).any() else int(r.max()) for r in lay] for lay in at]
        # the whole conversation's optimum at the same budgets keeps at least the policy's attention mass
        assert run["optimal_retained"] >= run["retained"] - 1e-9
        assert 0 < run["retained"] <= 1
    # the second turn comes after what the first wrote: its question starts after the context, question 1, answer 1
    control = cell["control"]
    assert control["turn_starts"] == [cell["context_tokens"], cell["context_tokens"] + cell["question_tokens"][0] + 8]
    assert control["positions"] == cell["context_tokens"] + sum(cell["question_tokens"]) + 2 * 8 - 1
    text = _run(folder, capsys, "--keys", "2", "--depths", "0.7,0.3", "--policy", "h2o", "--budget", "24",
                "--recent-window", "4", "--optimum").out
    assert "turn 1" in text and "turn 2" in text and "retained mass over the conversation" in text
    # the grid is saved for the app's Pass key view (kvsim.models.conversation_grid), where it reads back whole
    from kvsim.models import conversation_grid

    (line,) = [x for x in text.splitlines() if x.startswith("saved for the app's Pass key view: ")]
    saved = conversation_grid.read(Path(line.split(": ", 1)[1]))
    assert saved["keys"] == 2 and saved["cells"][0]["keys"] == cell["keys"]
    assert saved["cells"][0]["runs"][0]["key_left"] == cell["runs"][0]["key_left"]  # h2o @ 24, recent_window 4 both


def _ids(folder, cell, positions):
    from kvsim.models.needle_prompt import Builder, Template, conversation
    from kvsim.models.quality import load

    _, tokenizer, _ = load(str(folder), None)
    prompt = conversation(Builder(tokenizer, Template()), cell["length"], cell["depths"], cell["keys"], cell["trial"])
    return [prompt.context[p] for p in positions]


@pytest.mark.parametrize(("policy", "params"), [("h2o", {"recent_window": 2}), ("keydiff", {}),
                                               ("expected_attention", {"refresh": 4})], ids=["h2o", "keydiff", "expected"])
def test_a_conversation_on_the_tensor_path_records_what_the_reference_path_does(folder, policy, params):
    """Two turns on one cache, each turn's question a further call: the tensor path's tokens and every position's
    departure in every (layer, KV head) equal the reference path's (``tensor=False``)."""
    from kvsim.models.needle_conversation import run_conversation
    from kvsim.models.needle_prompt import Builder, Template, conversation
    from kvsim.models.needle_runs import Job
    from kvsim.models.quality import load

    model, tokenizer, _ = load(str(folder), None)
    prompt = conversation(Builder(tokenizer, Template()), int(LENGTH), (0.3, 0.7), ("31", "58"), 0)
    job = Job(policy, 24, tuple(sorted(params.items())))
    fast, slow = (run_conversation(model, prompt, job, seed=0, tensor=t) for t in (True, False))
    assert fast["tokens"] == slow["tokens"]
    assert np.array_equal(fast["left"], slow["left"])
    assert (slow["left"] >= 0).any()  # it did evict


def test_the_retained_mass_read_from_departures_is_the_harness_own(folder):
    """``retained_mass`` on departures reads what the simulator's replay reports, for the optimum and for h2o."""
    from kvsim.models import needle_traces as nt
    from kvsim.models.needle_conversation import retained_mass
    from kvsim.models.quality import load
    from kvsim.sim.simulate import replay

    model, _, _ = load(str(folder), None)
    traces = nt.control_traces(model, list(range(4, 60)) * 2)
    (x, h), trace = next(iter(traces.items()))
    for policy, params in (("optimal", {}), ("h2o", {"recent_window": 2})):
        left = np.full((3, 2, trace.steps + 1), -1, dtype=np.int32)
        left[x, h] = nt.replay_departures(trace, policy, 12, **params)
        said = replay(trace, policy, budget=12, **params).retained_mass
        assert retained_mass({(x, h): trace}, left) == pytest.approx(said, abs=1e-9)


def test_query_aware_compression_chooses_with_the_question_and_agnostic_without(folder, capsys):
    """Aware: the context and question 1 compressed at once (what was dropped left at question 1's last position);
    agnostic: the context alone compressed (dropped at the context's last position), the question fed after."""
    from kvsim.models import needle

    flags = ("--keys", "2", "--depths", "0.3,0.7", "--policy", "h2o", "--budget", "24", "--recent-window", "4",
             "--prefill-budget", "24", "--prefill-policy", "snapkv:recent_window=8")
    aware, agnostic = (_doc(folder, capsys, *flags, "--query", q) for q in ("aware", "agnostic"))
    ra, rg = aware["cells"][0]["runs"][0], agnostic["cells"][0]["runs"][0]
    assert ra["label"].endswith("query-aware") and rg["label"].endswith("query-agnostic")
    assert ra["query"] == "aware" and rg["query"] == "agnostic" and ra["cache_key"] != rg["cache_key"]
    n, context = int(LENGTH), aware["cells"][0]["context_tokens"]
    la, lg = needle.read_trial(ra["cache_key"])["left"], needle.read_trial(rg["cache_key"])["left"]
    # aware: every head drops all but its 24 of the n positions at once, at the first question's last position
    assert ((la[:, :, :n] == n - 1).sum(axis=2) == n - 24).all() and not (la == context - 1).any()
    # agnostic: all but 24 of the context's, at the context's last position; then h2o steps the question in
    assert ((lg[:, :, :context] == context - 1).sum(axis=2) == context - 24).all()
    assert ((lg[:, :, :n] == n - 1).sum(axis=2) <= 1).all()
    # one key stays today's needle: no --keys, no --query gives the one-key grid as before
    assert "conversation" not in _doc(folder, capsys, "--policy", "h2o", "--budget", "24", "--recent-window", "4",
                                      "--depths", "0.5")


@pytest.mark.parametrize(("flags", "said"), [
    (("--keys", "2", "--depths", "0.3"), "--depths: 0.3: 1 depth(s) for --keys 2 (more keys than depths)"),
    (("--keys", "2", "--depths", "0.1,0.5,0.9"), "--depths: 0.1,0.5,0.9: 3 depth(s) for --keys 2 (more depths than keys)"),
    (("--keys", "2", "--depths", "0.3,0.31"), "--depths: 0.3 and 0.31: keys 1 and 2 overlap"),
    (("--keys", "2", "--depths", "0.5,0.5"), "--depths: 0.5,0.5: keys 1 and 2 overlap"),
    (("--keys", "3", "--lengths", "480"), "--keys 3 --lengths 480: turn 2 is"),
    (("--keys", "2", "--question", "Which?"), "--question: 'Which?': a conversation needs {n}"),
    (("--keys", "2", "--question", " "), "--question: empty: turn"),
    (("--keys", "0",), "--keys: 0: must be at least 1"),
    (("--query", "agnostic"), "--query agnostic goes with --prefill-budget"),
])
def test_bad_conversations_are_refused_in_one_line_before_the_weights_load(folder, capsys, monkeypatch, flags, said):
    from kvsim.models import needle

    def never(*a, **k):
        raise AssertionError("the weights loaded")

    real = needle.open_model

    def opened(*a, **k):
        config, tokenizer, _, model_id = real(*a, **k)
        return config, tokenizer, never, model_id

    monkeypatch.setattr(needle, "open_model", opened)
    err = _run(folder, capsys, *flags, code=1).err
    assert said in err and len(err.strip().splitlines()) == 1, err


def test_the_python_example_in_docs_needle_md_runs(folder, monkeypatch, tmp_path):
    """docs/needle.md's "A conversation: a pass key per turn" Python block, run as printed but on the tiny model
    (its name for gemma3-270m, its 330 tokens for 1024: the tiny model's context is 512)."""
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "needle.md").read_text(encoding="utf-8")
    section = page[page.index("## A conversation: a pass key per turn"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert '"gemma3-270m"' in block and "length=1024" in block
    code = block.replace('"gemma3-270m"', repr(str(folder))).replace("length=1024", f"length={LENGTH}")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/needle.md", "exec"), scope)  # noqa: S102 -- the page's own example
    cell = scope["cell"]
    assert len(cell["keys"]) == 2 and len(cell["runs"][0]["key_left"]) == 2


def test_a_plan_holds_the_keys_and_the_query_mode_and_old_plans_read_and_write_as_before(folder, capsys, tmp_path):
    from kvsim.policies import PolicySpec
    from kvsim.policykit.plan import Compression, Plan, PlanError

    old = Plan(PolicySpec.of("h2o", 24, recent_window=4), compression=Compression(24, "snapkv", (("recent_window", 8),)))
    assert "keys" not in old.to_dict() and "query" not in old.to_dict()["compression"]
    plan = Plan(old.policy, compression=Compression(24, "snapkv", (("recent_window", 8),), query="agnostic"), keys=2)
    doc = plan.to_dict()
    assert doc["keys"] == 2 and doc["compression"]["query"] == "agnostic" and Plan.from_dict(doc) == plan
    for bad, said in ((dict(doc, keys=0), "keys: a conversation's number of keys"),
                      (dict(doc, compression=dict(doc["compression"], query="both")), "compression.query: 'both'")):
        with pytest.raises(PlanError, match=said):
            Plan.from_dict(bad, "p.json")
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json(), encoding="utf-8")
    by_plan = _doc(folder, capsys, "--plan", str(path), "--depths", "0.3,0.7")
    assert by_plan["keys"] == 2 and by_plan["query"] == "agnostic"
    assert by_plan["grids"][0]["label"] == ("h2o @ 24, recent_window 4, prompt compressed to 24 by snapkv recent_window "
                                            "8, query-agnostic")
    err = _run(folder, capsys, "--plan", str(path), "--keys", "2", code=2).err
    assert "sets --keys too: give it in one place" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["replay", "--plan", str(path), "--trace", "x"]) != 0
    err = capsys.readouterr().err
    assert "which replay does not take" in err and len(err.strip().splitlines()) == 1, err

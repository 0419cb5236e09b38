"""The deployed cache holds each (layer, KV head) to its own budget (issue 33, item 2): ``kvsim.hf.cache(...,
allocate=NAME or {(layer, kv_head): budget})`` and ``generate --allocate NAME|FILE``. Its bytes follow the
split (each head's budget plus one spare slot, not the largest head's), no head ever holds more than its
budget, and each head keeps what the simulator's policy keeps at that budget on the attention it was shown."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from doc_chains import chains, run
from test_hf import _model_folder, _prompt, _tiny
from tolerance import rounding

from kvsim import cli

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

#: tiny Llama: 2 layers x 2 KV heads, head_dim 8; every head a different budget, h2o's minimum is 4 (window 3 + 1)
SPLIT = {(0, 0): 6, (0, 1): 14, (1, 0): 20, (1, 1): 8}
HEAD_DIM = 8


def _expected_bytes(split: dict, head_dim: int, itemsize: int, rows: int = 1) -> int:
    """Keys and values, each head its budget plus the step's spare slot."""
    return sum(b + 1 for b in split.values()) * head_dim * 2 * itemsize * rows


def test_each_head_holds_its_own_budget_its_bytes_follow_the_split_and_it_keeps_what_the_simulator_keeps():
    import torch

    import kvsim.hf as hf
    from kvsim.policies import make_policy

    model, ids = _tiny("llama"), _prompt(40)
    cache = hf.cache(model, "h2o", None, allocate=SPLIT, recent_window=3)
    shown = {head: [] for head in SPLIT}
    with torch.no_grad():
        model(ids[:, :1], cache=cache, use_cache=True)
        for (x, h) in SPLIT:  # the policies exist once the first token came; hear what each is shown
            policy = cache.layers[x].policies[0][h]
            step = policy.on_decode_step

            def record(t, attn, into=shown[(x, h)], step=step):
                into.append((t, None if attn is None else np.array(attn)))
                step(t, attn)

            policy.on_decode_step = record
        model(ids[:, 1:], cache=cache, use_cache=True)
    itemsize = torch.finfo(model.dtype).bits // 8
    assert cache.nbytes == _expected_bytes(SPLIT, HEAD_DIM, itemsize)
    # the split's positions x head dim x 2 x dtype size, plus at most one spare slot per head
    held = sum(SPLIT.values()) * HEAD_DIM * 2 * itemsize
    assert held <= cache.nbytes <= held + len(SPLIT) * HEAD_DIM * 2 * itemsize
    # not the largest head's budget in every head (what a cache sized by its largest head would take)
    assert cache.nbytes < len(SPLIT) * (max(SPLIT.values()) + 1) * HEAD_DIM * 2 * itemsize
    assert cache.budgets == SPLIT
    assert cache.head_peaks == SPLIT  # 40 positions: every head filled to its budget, none above it
    for (x, h), budget in SPLIT.items():
        assert len(shown[(x, h)]) == 39
        again = make_policy("h2o", budget=budget, recent_window=3)
        for t, attn in shown[(x, h)]:
            assert attn.dtype == np.float32 and attn.shape == (again.kept.size,)
            assert attn.sum() == pytest.approx(1.0, abs=rounding(2 * (again.kept.size + 1)))  # float32 weights, summed
            again.on_decode_step(t, attn)
            again.evict(budget)
        assert again.kept.tolist() == cache.layers[x].held(0, h).tolist(), (x, h)


def test_fast_prefill_holds_each_heads_budget_too():
    import torch

    import kvsim.hf as hf

    model, ids = _tiny("gemma3"), _prompt(40)
    split = {(x, h): 5 + 3 * x + 7 * h for x in range(4) for h in range(2)}
    cache = hf.cache(model, "tova", None, allocate=split, prefill="fast")
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        model(ids[:, :1], cache=cache, use_cache=True)
    assert cache.head_peaks == split
    assert cache.nbytes == _expected_bytes(split, HEAD_DIM, torch.finfo(model.dtype).bits // 8)
    for (x, h), b in split.items():
        assert cache.layers[x].held(0, h).size == b and cache.layers[x].held(0, h)[-1] == 40


def test_pyramidkv_by_name_spends_uniforms_memory_early_layers_first():
    import torch

    import kvsim.hf as hf
    from kvsim.allocation.allocators import integer_split, pyramid_schedule

    model, ids = _tiny("gemma3"), _prompt(8)
    cache = hf.cache(model, "h2o", 32, allocate="pyramidkv", recent_window=3)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    budgets = cache.budgets
    assert sum(budgets.values()) == 32 * 8  # uniform's memory
    per_layer = [budgets[(x, 0)] for x in range(4)]
    assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] > per_layer[-1]
    assert all(budgets[(x, 0)] == budgets[(x, 1)] for x in range(4))  # a layer's heads alike
    weights = [w for w in pyramid_schedule(32, 4) for _ in range(2)]
    assert list(budgets.values()) == integer_split(np.array(weights), 256, 4, 256 - 4 * 7).tolist()
    assert cache.nbytes == _expected_bytes(budgets, HEAD_DIM, torch.finfo(model.dtype).bits // 8)
    uniform = hf.cache(model, "h2o", 32, allocate="uniform", recent_window=3)
    with torch.no_grad():
        model(ids, cache=uniform, use_cache=True)
    assert uniform.budgets == {head: 32 for head in budgets} and uniform.nbytes == cache.nbytes  # the same memory


@pytest.mark.parametrize("allocate, budget, message", [
    ({(x, h): 8 for x in range(3) for h in range(2)}, None,
     "an allocation for another model's shape (6 rows; LlamaForCausalLM has 2 layers x 2 KV heads): it has layer 2 KV head 0"),
    ({(0, 0): 8, (0, 1): 8, (1, 0): 3, (1, 1): 8}, None,
     "layer 1 KV head 0: budget 3 is below h2o's minimum of 4 positions per head (recent_window 3 + 1)"),
    ({(0, 0): 8, (0, 1): 8, (1, 0): 8, (1, 1): 8}, 16, "the split holds 32 positions, not budget 16 x 4 heads = 64"),
    ("cake", 16, "cake computes its split from a recorded bundle's attention; run python -m kvsim replay"),
    ("optimal", 16, "--allocate optimal --budget B --json > split.json"),
    ("adakv", None, "allocate=adakv pools budget x 2 KV heads in each layer; give the budget"),  # tests/test_hf_pooled.py
    ("uniform", 3, "allocate=uniform: layer 0 KV head 0: budget 3 is below h2o's minimum of 4"),
])
def test_an_allocation_that_cannot_deploy_is_one_line_before_any_token(allocate, budget, message):
    import kvsim.hf as hf

    model = _tiny("llama")
    with pytest.raises(hf.HFError) as e:
        hf.cache(model, "h2o", budget, allocate=allocate, recent_window=3)
    assert message in str(e.value) and "\n" not in str(e.value)


def _split_file(tmp_path, rows, **doc) -> str:
    path = tmp_path / "split.json"
    path.write_text(json.dumps({**doc, "allocation": [{"layer": x, "kv_head": h, "budget": b} for (x, h), b in rows.items()]}))
    return str(path)


def test_cli_generate_deploys_an_allocation_file_says_what_each_head_held_and_what_was_never_evicted(tmp_path, capsys):
    import torch

    folder = _model_folder(tmp_path)
    prompt = "the quick brown fox jumps over the lazy dog and on"  # 50 characters, one token each, plus <bos>
    split = {(x, h): 6 + 4 * x + 2 * h for x in range(4) for h in range(2)}
    split[(3, 1)] = 200  # more than the 51 + 9 positions processed: nothing evicted there
    path = _split_file(tmp_path, split, policy="h2o")
    code = cli.main(["generate", "--model", str(folder), "--policy", "h2o", "--recent-window", "2", "--allocate", path,
                     "--max-new-tokens", "10", prompt, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    doc = json.loads(out.out)
    assert doc["budget"] is None and doc["allocate"] == path and doc["positions"] == sum(split.values())
    assert {(r["layer"], r["kv_head"]): r["budget"] for r in doc["allocation"]} == split
    seen = doc["prompt_tokens"] + len(doc["token_ids"]) - 1
    assert doc["positions_seen"] == seen == 60
    assert [r["peak_positions"] for r in doc["allocation"]] == [min(b, seen) for b in split.values()]
    assert doc["unevicted_heads"] == 1
    assert doc["cache_bytes"] == _expected_bytes(split, HEAD_DIM, torch.finfo(torch.float32).bits // 8)
    code = cli.main(["generate", "--model", str(folder), "--policy", "h2o", "--recent-window", "2", "--allocate", path,
                     "--max-new-tokens", "10", prompt])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"h2o split by {path} ({sum(split.values())} positions over 8 KV heads)" in out.out
    assert "1 of 8 heads' budgets reach the 60 positions processed: nothing was evicted there" in out.out


def test_cli_generate_refuses_a_bad_allocation_in_one_line(tmp_path, capsys):
    folder = _model_folder(tmp_path)
    good = {(x, h): 8 for x in range(4) for h in range(2)}
    other = _split_file(tmp_path, {(x, 0): 8 for x in range(18)})
    (tmp_path / "low").mkdir()
    low = _split_file(tmp_path / "low", {**good, (2, 1): 2})
    (tmp_path / "tova").mkdir()
    made_for_tova = _split_file(tmp_path / "tova", good, policy="tova")
    (tmp_path / "good").mkdir()
    made_for_h2o = _split_file(tmp_path / "good", good, policy="h2o")
    (tmp_path / "broken.json").write_text("{")
    bad = [  # (flags, the line); only the model's shape needs the model: the rest are refused before it loads
        (["--allocate", other], "an allocation for another model's shape (18 rows; Gemma3ForCausalLM has 4 layers x 2 KV heads)"),
        (["--allocate", low], f"--allocate: {low}: layer 2 KV head 1: budget 2 is below h2o's minimum of 4 positions per head "
                              "(recent_window 3 + 1)"),
        (["--allocate", made_for_tova], f"--allocate: {made_for_tova}: a split made for tova, --policy is h2o"),
        (["--allocate", str(tmp_path / "broken.json")], f"--allocate: {tmp_path}/broken.json: not valid JSON"),
        (["--allocate", str(tmp_path / "none.json")], f"--allocate: {tmp_path}/none.json: no such file"),
        (["--allocate", "cake", "--budget", "16"], "--allocate cake: cake computes its split from a recorded bundle's attention"),
        (["--allocate", made_for_h2o, "--budget", "9"], "the split holds 64 positions, not --budget 9 x 8 heads; leave out --budget"),
    ]
    for flags, message in bad:
        code = cli.main(["generate", "--model", str(folder), "--policy", "h2o", "--recent-window", "3", *flags,
                         "--max-new-tokens", "4", "a prompt"])
        out = capsys.readouterr()
        err = [line for line in out.err.splitlines() if not line.startswith("generate: ")]  # progress: loading
        assert code != 0 and out.out == "" and len(err) == 1 and message in err[0], (flags, out.err)
        assert flags[1] == other or "generate: " not in out.err, (flags, out.err)  # the model never loaded


def _allocation_chains() -> list[list[str]]:
    return [c for c in chains("docs/deploy.md") if any("--allocate" in line and " generate " in line for line in c)]


def test_docs_deploy_prints_one_replay_allocate_then_generate_chain():
    (chain,) = _allocation_chains()
    assert "--allocate pyramidkv" in chain[0] and "> split.json" in chain[0] and "--allocate split.json" in chain[-1]


@pytest.mark.record
def test_the_documented_allocation_chain_runs_as_printed_and_the_shipped_model_holds_the_split(tmp_path):
    """Gemma-3-270M (18 layers x 1 KV head, head dim 256, float32): the bytes and peaks the docs quote."""
    from kvsim.allocation.deployed import split

    (chain,) = _allocation_chains()
    done = run(chain, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "split.json").read_text())["allocation"]
    budgets = {(r["layer"], r["kv_head"]): r["budget"] for r in rows}
    # the replay's split is the one the deployed cache computes by name from the model's shape
    assert split("pyramidkv", "h2o", 64, 18, 1, {}) == budgets
    out = json.loads((tmp_path / "out.json").read_text())
    assert {(r["layer"], r["kv_head"]): r["budget"] for r in out["allocation"]} == budgets
    assert out["positions_seen"] > max(budgets.values()) and out["unevicted_heads"] == 0
    assert [r["peak_positions"] for r in out["allocation"]] == list(budgets.values())  # each at its budget, none above
    assert out["cache_bytes"] == _expected_bytes(budgets, 256, 4) == 2_396_160  # the figure docs/deploy.md quotes
    assert (sum(budgets.values()), budgets[(0, 0)], budgets[(17, 0)]) == (1152, 109, 33)


def test_a_window_per_layer_sets_each_heads_minimum_under_an_allocation():
    import kvsim.hf as hf

    model = _tiny("llama")
    cache = hf.cache(model, "h2o", None, allocate=SPLIT, windows={0: 5, 1: 7})
    assert [[(s.budget, s["recent_window"]) for s in layer.specs] for layer in cache.layers] == [[(6, 5), (14, 5)],
                                                                                                 [(20, 7), (8, 7)]]
    with pytest.raises(hf.HFError) as e:  # layer 0 KV head 0 holds 6: a window of 8 needs 9
        hf.cache(model, "h2o", None, allocate=SPLIT, windows={0: 8, 1: 7})
    assert str(e.value) == ("allocate: layer 0 KV head 0: budget 6 is below h2o's minimum of 9 positions per head "
                            "(recent_window 8 + 1)")

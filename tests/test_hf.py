"""kvsim.hf: a transformers cache that really evicts, checked on tiny config-built models (random
weights, nothing downloaded) against a plain decode loop that keeps the full cache and masks what the
policy would have evicted (docs/domain.md, "The deployed cache"), and ``python -m kvsim generate`` on a model folder."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
from tolerance import forward_pass, rounding

from kvsim import cli

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

BUDGET, SINKS, PROMPT, NEW = 32, 4, 16, 96


def _tiny(kind: str, window: int = 24):
    """Gemma 3 (sliding, global, sliding, global; 4 query heads over 2 KV heads) or Llama (2 layers)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    if kind == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, head_dim=8, sliding_window=window, query_pre_attn_scalar=8,
                                  layer_types=["sliding_attention", "full_attention"] * 2)
        model = tf.Gemma3ForCausalLM(cfg)
        with torch.no_grad():  # a trained Gemma's key norms carry weights: at their initial zeros every key's norm is
            for layer in model.model.layers:  # sqrt(head_dim) to the last bits, and knorm would rank rounding noise
                layer.self_attn.k_norm.weight.normal_(0.0, 0.5)
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**common, "num_hidden_layers": 2}))
    model.set_attn_implementation("eager")
    return model.eval()


def _prompt(n: int = PROMPT):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (1, n), generator=g)
    ids[0, 0] = 1
    return ids


def _streaming_held(t: int) -> list[int]:
    """What StreamingLLM (sinks, budget) holds when query t comes: everything before t while it fits,
    then the sinks and the newest budget - sinks."""
    return list(range(t)) if t <= BUDGET else [*range(SINKS), *range(t - (BUDGET - SINKS), t)]


def _masked_reference(model, ids, new: int) -> list[int]:
    """Greedy decoding that recomputes the whole sequence every step (nothing evicted, no cache) and
    masks, for each query t, every position StreamingLLM would not hold (its own key is always seen,
    and a sliding layer's window applies as in the model)."""
    import torch
    import transformers as tf

    def attention(module, query, key, value, mask, scaling=None, dropout=0.0, softcap=None, sliding_window=None, **kw):
        n, group = query.shape[2], query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        seen = torch.zeros(n, n, dtype=torch.bool)
        for t in range(n):
            for p in [*_streaming_held(t), t]:
                seen[t, p] = sliding_window is None or p > t - sliding_window
        scores = (torch.matmul(query, key.transpose(2, 3)) * scaling).masked_fill(~seen, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    tf.AttentionInterface.register("test_masked_full", attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("test_masked_full")
    seq = ids
    try:
        with torch.no_grad():
            for _ in range(new):
                nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=1)
    finally:
        model.set_attn_implementation(previous)
    return seq[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("tensor", [False, True], ids=["reference", "tensor"])
@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_streaming_llm_generates_what_the_masked_full_cache_generates_holding_at_most_the_budget(kind, tensor):
    """The issue's check: sinks 4, budget 32, a 16-token prompt, 96 greedy tokens through
    ``model.generate(cache=...)``; and the eviction matters (the full cache decodes otherwise). On both
    paths: the reference's one tensor of runs per KV head, the tensor path's transformers' own
    ``(batch, KV heads, slots, head_dim)``, the same bytes."""
    import kvsim.hf as hf

    model, ids = _tiny(kind), _prompt()
    expected = _masked_reference(model, ids, NEW)
    cache = hf.cache(model, "streaming_llm", BUDGET, sinks=SINKS, tensor=tensor)
    out = model.generate(ids, cache=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert out[0, PROMPT:].tolist() == expected
    assert cache.peak_positions == [BUDGET] * len(cache.layers)
    fed = PROMPT + NEW - 1  # the last token generated is never fed back
    for layer in cache.layers:
        if tensor:
            assert layer.keys.shape == layer.values.shape == (1, 2, BUDGET + 1, 8)  # the budget and the step's new key
        else:
            assert layer.keys.shape == layer.values.shape == (1, 2 * (BUDGET + 1), 8)  # one tensor, a run per KV head
        for h in range(2):
            if not tensor:
                span = layer.store.span(h)
                assert span.stop - span.start == BUDGET + 1  # the storage: the budget and the step's new key
            assert layer.held(0, h).tolist() == _streaming_held(fed)  # what query `fed` would see
    model.set_attn_implementation("eager")
    full = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert full[0, PROMPT:].tolist() != expected


def test_a_prompt_longer_than_the_budget_is_stepped_as_decoding_would_step_it():
    """h2o reads attention: one forward pass over a 48-token prompt (each layer stepping the policy
    through it, position by position) leaves every policy holding what feeding the same tokens one
    at a time leaves, and the next logits agree; what each layer stores is what its policy holds."""
    import torch

    import kvsim.hf as hf

    model, ids = _tiny("gemma3"), _prompt(48)
    # the reference path, whose layers step the Python policy they hold (tests/test_hf_tensor.py holds the tensor
    # path to it, prompt chunks against decoding included)
    whole = hf.cache(model, "h2o", 16, recent_window=4, tensor=False)
    single = hf.cache(model, "h2o", 16, recent_window=4, tensor=False)
    with torch.no_grad():
        a = model(ids, cache=whole, use_cache=True).logits[0, -1]
        for t in range(ids.shape[1]):
            b = model(ids[:, t : t + 1], cache=single, use_cache=True).logits[0, -1]
    # one pass against 48, ordering their sums otherwise: within two float32 passes' rounding of the logits
    torch.testing.assert_close(a, b, rtol=0, atol=forward_pass(model.config, 16 + 1, float(a.abs().max())))
    for la, lb in zip(whole.layers, single.layers, strict=True):
        for h in range(2):
            assert la.held(0, h).tolist() == lb.held(0, h).tolist() == la.policies[0][h].kept.tolist()
            assert la.held(0, h).size == 16 and la.held(0, h)[-1] == 47
    assert whole.get_seq_length() == 48 and max(whole.peak_positions) == 16
    assert any(la.held(0, 0).tolist() != list(range(32, 48)) for la in whole.layers)  # not merely the newest 16


def test_fast_prefill_attends_the_prompt_in_full_then_holds_the_budget():
    """prefill='fast': the prompt's last logits are the full cache's; after it each layer holds the
    budget, the newest position included, and decoding goes on from there."""
    import torch

    import kvsim.hf as hf

    model, ids = _tiny("gemma3"), _prompt(40)
    with torch.no_grad():
        full = model(ids).logits[0, -1]
        cache = hf.cache(model, "tova", 12, prefill="fast")
        fast = model(ids, cache=cache, use_cache=True).logits[0, -1]
        model(ids[:, -1:], cache=cache, use_cache=True)
    torch.testing.assert_close(fast, full, rtol=0, atol=forward_pass(model.config, 40, float(full.abs().max())))  # as above
    for layer in cache.layers:
        assert layer.held(0, 0).size == 12 and 40 in layer.held(0, 0).tolist()
    exact = hf.cache(model, "tova", 12)
    with torch.no_grad():
        exact_logits = model(ids, cache=exact, use_cache=True).logits[0, -1]
    # exact eviction does change the prompt's outputs, by more than any rounding could
    assert not torch.allclose(exact_logits, full, rtol=0, atol=forward_pass(model.config, 40, float(full.abs().max())))


def _tune_doc(layers: list[str], windows: list[int], heads: int = 2, policy: str = "h2o") -> dict:
    """A document in the shape ``python -m kvsim tune --json`` writes (the fields kvsim.hf reads)."""
    rows = [{"layer": i, "head": h, "trace": f"L{i:02d}H{h}", "attention": kind, "recommended_window": w,
             "best_window": w} for i, (kind, w) in enumerate(zip(layers, windows, strict=True)) for h in range(heads)]
    return {"trace": "tiny", "policy": policy, "budget": 32, "param": "recent_window", "windows": [1, 31],
            "layers": rows, "per_layer": [{"layer": i, "kv_heads": heads, "recommended_window": w}
                                          for i, w in enumerate(windows)]}


def test_windows_from_a_tune_file_set_each_layers_recent_window(tmp_path):
    import kvsim.hf as hf

    model = _tiny("gemma3")
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({**_tune_doc(["sliding", "global"] * 2, [3, 9, 5, 20]), "model_window": 24, "by": "mass"}))
    cache = hf.cache(model, "h2o", 32, windows=path)
    specs = [layer.specs[0]["recent_window"] for layer in cache.layers]
    assert specs == [3, 9, 5, 20]
    # what tune writes: a model_window (a recent_window, below the budget) that is not the model's sliding
    # window, the recording's identity, and the windows it deploys by its by, which win over per_layer's
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({**_tune_doc(["sliding", "global"] * 2, [3, 9, 5, 20]), "model_window": 11, "by": "kl",
                                 "recording": {"model": "tiny", "sliding_window": 24},
                                 "deploy": {"by": "kl", "per_layer": [{"layer": i, "recent_window": 11} for i in range(4)]}}))
    assert [layer.specs[0]["recent_window"] for layer in hf.cache(model, "h2o", 32, windows=tuned).layers] == [11] * 4
    assert [row[1]["recent_window"] for row in hf.layer_specs(model, "h2o", 32, str(tuned), by="head")] == [3, 9, 5, 20]
    per_head = hf.layer_specs(model, "h2o", 64, {(1, 1): 7, 2: 4})  # the rest at h2o's default, 32
    assert [[spec["recent_window"] for spec in row] for row in per_head] == [[32, 32], [32, 7], [4, 4], [32, 32]]


def test_bad_input_is_one_clear_line_before_anything_runs(tmp_path):
    import transformers as tf

    import kvsim.hf as hf

    model = _tiny("gemma3")
    with pytest.raises(hf.HFError, match="unknown policy 'lru'"):
        hf.cache(model, "lru", 32)
    with pytest.raises(hf.HFError, match="offline reference"):
        hf.cache(model, "optimal", 32)
    with pytest.raises(hf.HFError, match=r"layer 2: recent_window must be less than budget \(64\), got 64"):
        hf.cache(model, "h2o", 64, windows={2: 64})
    with pytest.raises(hf.HFError, match="recent_window must be less than budget"):
        hf.cache(model, "h2o", 16, recent_window=16)
    with pytest.raises(hf.HFError, match=r"windows for \(1, 2\): the model has layers 0-3 and 2 KV head"):
        hf.cache(model, "h2o", 64, windows={(1, 2): 4})
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_tune_doc(["sliding"] * 5 + ["global"], [4] * 6, heads=1)))
    with pytest.raises(hf.WindowsError, match=r"other.json: tuned on 6 layers \(tiny\), Gemma3ForCausalLM has 4; it is for another model"):
        hf.cache(model, "h2o", 32, windows=other)
    kinds = tmp_path / "kinds.json"
    kinds.write_text(json.dumps(_tune_doc(["global"] * 4, [4] * 4)))
    with pytest.raises(hf.WindowsError, match="layer 0 is global attention there"):
        hf.cache(model, "h2o", 32, windows=kinds)
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps({**_tune_doc(["sliding", "global"] * 2, [4] * 4), "model_window": 4,
                                "recording": {"model": "big", "sliding_window": 512}}))
    with pytest.raises(hf.WindowsError, match="wide.json: recorded on big with a sliding window of 512, "
                                              "Gemma3ForCausalLM's is 24; it is for another model"):
        hf.cache(model, "h2o", 32, windows=wide)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_tune_doc(["sliding", "global"] * 2, [4] * 4)))
    with pytest.raises(hf.WindowsError, match="tuned for h2o, --policy is snapkv"):
        hf.cache(model, "snapkv", 32, windows=good)

    # a model whose modelling code computes attention itself, as remote code often does: transformers
    # reads the module's source and will not hand it another attention function
    (tmp_path / "legacy_model.py").write_text(
        "import torch.nn as nn\nimport transformers as tf\n\n\nclass LegacyAttention(nn.Module):\n    pass\n\n\n"
        "class LegacyForCausalLM(tf.LlamaPreTrainedModel):\n    def __init__(self, config):\n"
        "        super().__init__(config)\n        self.attn = LegacyAttention()\n        self.post_init()\n")
    spec = importlib.util.spec_from_file_location("legacy_model", tmp_path / "legacy_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["legacy_model"] = module
    try:
        spec.loader.exec_module(module)
        legacy = module.LegacyForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=2, num_attention_heads=2))
        with pytest.raises(hf.HFError, match="LegacyForCausalLM has no eager-compatible attention"):
            hf.cache(legacy, "h2o", 64)
    finally:
        del sys.modules["legacy_model"]


def test_a_model_left_on_kvsim_attention_still_decodes_with_transformers_caches():
    import torch

    import kvsim.hf as hf

    model, ids = _tiny("gemma3"), _prompt(30)
    with torch.no_grad():
        eager = model(ids).logits
        hf.cache(model, "h2o", 8, recent_window=2)
        assert model.config._attn_implementation == hf.ATTN
        again = model(ids).logits
        stepped = model.generate(ids, max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(again, eager, rtol=0, atol=forward_pass(model.config, 30, float(eager.abs().max())))  # two passes
    model.set_attn_implementation("eager")
    assert model.generate(ids, max_new_tokens=8, do_sample=False).tolist() == stepped.tolist()


def _model_folder(tmp_path):
    """The tiny Gemma 3 saved with a tokenizer transformers loads offline: one id per character."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "tiny-gemma3"
    _tiny("gemma3").save_pretrained(folder)
    vocab = {"<pad>": 0, "<bos>": 1, "<unk>": 2, **{c: 3 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", pad_token="<pad>", unk_token="<unk>").save_pretrained(folder)
    return folder


def test_cli_generate_prints_the_documented_json_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    folder = _model_folder(tmp_path)
    prompt = "the quick brown fox jumps over the lazy dog and on"
    code = cli.main(["generate", "--model", str(folder), "--policy", "streaming_llm", "--budget", "16", "--sinks", "2",
                     "--max-new-tokens", "20", prompt, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    doc = json.loads(out.out)
    assert len(doc["token_ids"]) == 20 and isinstance(doc["text"], str)
    assert doc["prompt_tokens"] > 16 and doc["peak_positions"] == [16] * 4
    assert doc["cache_bytes"] == 4 * 2 * 2 * 17 * 8 * 4  # layers x (K, V) x KV heads x slots x head_dim x float32
    assert doc["tokens_per_second"] > 0 and doc["prefill"] == "exact"
    assert doc["recent_window_per_layer"] is None  # streaming_llm has none
    # the exact prefill is heard on stderr with --json too (and off a terminal, as here): one line a layer
    steps = [line for line in out.err.splitlines() if "exact prefill: layer" in line]
    assert [line.split("layer ")[1].split(" ")[0] for line in steps] == ["1/4", "2/4", "3/4", "4/4"]
    assert f"stepped through the prompt's {doc['prompt_tokens']} positions" in steps[-1]
    tune = tmp_path / "tune.json"
    tune.write_text(json.dumps(_tune_doc(["sliding"] * 5 + ["global"], [4] * 6, heads=1)))
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps(_tune_doc(["sliding", "global"] * 2, [4, 4, 20, 4])))
    bad = [
        (["--policy", "lru", "--budget", "16"], "--policy 'lru': unknown"),
        (["--policy", "h2o", "--budget", "16", "--windows", str(wide)], "layer 2's recent_window 20 must be below --budget 16"),
        (["--policy", "h2o", "--budget", "16", "--recent-window", "16"], "--recent-window 16 must be below --budget 16"),
        (["--policy", "h2o", "--budget", "16", "--windows", str(tune)], "it is for another model"),
        (["--policy", "h2o", "--budget", "16", "--windows", str(tmp_path / "none.json")], f"--windows: {tmp_path}/none.json: no such file"),
        (["--policy", "h2o", "--budget", "16", "--sinks", "2"], "h2o does not take --sinks"),
    ]
    for flags, message in bad:
        code = cli.main(["generate", "--model", str(folder), *flags, "--max-new-tokens", "4", prompt])
        out = capsys.readouterr()
        err = [line for line in out.err.splitlines() if not line.startswith("generate: ")]  # progress: loading
        assert code != 0 and out.out == "" and len(err) == 1 and message in err[0], (flags, out.err)


def test_the_hf_cache_holds_what_a_replay_on_its_own_attention_holds():
    """The policy in each layer sees exactly the rows a replay would: re-running h2o's decisions from the
    attention the cache showed it gives the same kept set (the harness's victims contract holds)."""
    import torch

    import kvsim.hf as hf
    from kvsim.policies import make_policy

    model, ids = _tiny("llama"), _prompt(40)
    cache = hf.cache(model, "h2o", 10, recent_window=3, tensor=False)  # the path that steps a Python policy
    shown = []
    layer = cache.layers[1]
    with torch.no_grad():
        model(ids[:, :1], cache=cache, use_cache=True)
        policy = layer.policies[0][0]
        step = policy.on_decode_step

        def record(t, attn):
            shown.append((t, None if attn is None else np.array(attn)))
            step(t, attn)

        policy.on_decode_step = record
        model(ids[:, 1:], cache=cache, use_cache=True)
    assert len(shown) == 39
    again = make_policy("h2o", budget=10, recent_window=3)
    for t, attn in shown:
        assert attn.dtype == np.float32 and attn.shape == (again.kept.size,)
        assert attn.sum() == pytest.approx(1.0, abs=rounding(2 * (again.kept.size + 1)))  # float32 weights, summed
        again.on_decode_step(t, attn)
        again.evict(10)
    assert again.kept.tolist() == layer.held(0, 0).tolist()

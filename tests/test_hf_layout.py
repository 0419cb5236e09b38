"""The deployed cache under a serving layout (kvsim.hf.layout, docs/serving.md): whole blocks, one selection
per layer, decisions at intervals, decided by the simulator's own layout code and allocated as an engine
allocates it."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")


def _llama(kv_heads: int = 3, layers: int = 2):
    """A tiny Llama with ``kv_heads`` KV heads (SmolLM2's shape: 3 KV heads under 9 query heads, here 6)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=6, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = tf.LlamaForCausalLM(cfg)
    model.set_attn_implementation("eager")
    return model.eval()


def _ids(n: int, vocab: int = 64):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (1, n), generator=g)
    ids[0, 0] = 1
    return ids


def _whole_blocks(cache, t: int, budget: int, s: int = 16) -> None:
    """After step t: in every layer every KV head holds the same positions, in whole blocks of s (the newest,
    t's, filling), and never more than the budget."""
    for x, layer in enumerate(cache.layers):
        held = [layer.held(0, h) for h in range(layer.kv_heads)]
        for h in range(1, len(held)):
            assert np.array_equal(held[h], held[0]), (x, h, t)
        assert held[0].size <= budget, (x, t, held[0].size)
        blocks, counts = np.unique(held[0] // s, return_counts=True)
        for j, c in zip(blocks.tolist(), counts.tolist(), strict=True):
            want = s if j < t // s else t - j * s + 1
            assert c == want, (x, t, j, c)
        assert layer.held_blocks(0, 0) == blocks.tolist()


def _step_through(model, cache, ids, check) -> None:
    import torch

    with torch.no_grad():
        for i in range(ids.shape[1]):
            model(ids[:, i : i + 1], cache=cache, use_cache=True)
            check(i)


@pytest.mark.parametrize("budget", [32, 64])
def test_shared_blocks_hold_the_same_whole_blocks_in_every_kv_head_and_never_past_the_budget(budget):
    import kvsim.hf as hf
    from kvsim.hf.layout import memory

    model = _llama()
    cache = hf.cache(model, "h2o", budget, block_size=16, shared_selection=True, recent_window=4)
    _step_through(model, cache, _ids(budget + 40), lambda t: _whole_blocks(cache, t, budget))
    mem = memory(cache)
    assert mem["blocks"] == budget // 16 and mem["block_tables"] == 1 and mem["block_peak"] == budget // 16
    layers, per_position = len(cache.layers), 3 * 8 * 2 * 4  # 3 KV heads x head dim 8 x K and V x float32
    assert mem["block_bytes"] == 16 * per_position and mem["staging_bytes"] == per_position
    assert cache.nbytes == layers * (mem["blocks"] * mem["block_tables"] * mem["block_bytes"] + mem["staging_bytes"])
    assert cache.peak_positions == [budget] * layers


def test_each_kv_head_alone_holds_its_own_whole_blocks_and_intervals_let_the_cache_grow_to_the_budget():
    import kvsim.hf as hf
    from kvsim.hf.layout import memory

    model = _llama()
    cache = hf.cache(model, "tova", 40, block_size=8, evict_every=4)
    heights = []

    def check(t):
        for layer in cache.layers:
            for h in range(layer.kv_heads):
                held = layer.held(0, h)
                assert held.size <= 40
                blocks, counts = np.unique(held // 8, return_counts=True)
                assert all(c == 8 for j, c in zip(blocks, counts, strict=True) if j < t // 8)
                assert layer.held_blocks(0, h) == blocks.tolist()
        heights.append(cache.layers[0].held(0, 0).size)

    _step_through(model, cache, _ids(90), check)
    assert max(heights) == 40 and min(heights[60:]) < 40  # grown to the memory, cut at the decisions
    assert memory(cache)["block_tables"] == 3 and memory(cache)["blocks"] == 5


def test_no_layout_is_todays_cache_and_shared_selection_on_one_kv_head_changes_nothing():
    """block_size 1, no shared selection, interval 1: today's layer itself; shared selection on a model of one KV
    head (a no-op, said) goes through the layout's store and steps and gives today's tokens and bytes."""
    import kvsim.hf as hf
    from kvsim.hf.cache import EvictingLayer
    from kvsim.hf.decoding import greedy
    from kvsim.hf.layout import LayoutLayer
    from kvsim.hf.tensor import TensorLayer

    model, ids = _llama(kv_heads=1), _ids(12)
    # the reference path's layer, which a layout's store and steps extend (a plain layout takes the tensor path
    # by default, as a cache without one does)
    assert type(hf.cache(model, "h2o", 16, block_size=1, recent_window=4).layers[0]) is TensorLayer
    today = hf.cache(model, "h2o", 16, recent_window=4, tensor=False)
    plain = hf.cache(model, "h2o", 16, block_size=1, shared_selection=False, evict_every=1, recent_window=4,
                     tensor=False)
    shared = hf.cache(model, "h2o", 16, shared_selection=True, recent_window=4)
    assert type(plain.layers[0]) is EvictingLayer and isinstance(shared.layers[0], LayoutLayer)
    assert shared.notes == ["shared selection on a trace with one KV head: a no-op"]
    runs = [greedy(model, ids, c, 30, None)["tokens"] for c in (today, plain, shared)]
    assert runs[0] == runs[1] == runs[2]
    assert today.nbytes == plain.nbytes == shared.nbytes
    for a, b in zip(today.layers, shared.layers, strict=True):
        assert a.held(0, 0).tolist() == b.held(0, 0).tolist()


@pytest.mark.parametrize("shared", [False, True])
def test_the_deployed_layout_holds_what_the_simulators_layout_holds_on_the_attention_it_showed(shared):
    """Re-running the simulator's layout steps (``LayoutPolicy`` through the harness's step, as replay_layout steps
    one KV head; ``LayoutCache`` over a layer's heads, as replay_layer does under shared selection) on the rows the
    deployed cache showed each head gives the same kept sets at every step."""
    import torch

    import kvsim.hf as hf
    from kvsim.policies import PolicySpec
    from kvsim.policykit.layouts import Layout
    from kvsim.policykit.layouts.held import LayoutCache, LayoutPolicy
    from kvsim.sim.harness import step

    model, ids = _llama(), _ids(70)
    layout = Layout(8, shared, 3)
    cache = hf.cache(model, "h2o", 24, block_size=8, shared_selection=shared, evict_every=3, recent_window=4)
    layer = cache.layers[1]
    shown, held = {}, []
    with torch.no_grad():
        model(ids[:, :1], cache=cache, use_cache=True)
        for h, policy in enumerate(layer.policies[0]):
            def record(t, attn, h=h, own=policy.on_decode_step):
                shown[(t, h)] = np.array(attn)
                own(t, attn)
            policy.on_decode_step = record
        for i in range(1, ids.shape[1]):
            model(ids[:, i : i + 1], cache=cache, use_cache=True)
            held.append([layer.held(0, h).tolist() for h in range(3)])
    spec = PolicySpec.of("h2o", 24, recent_window=4)
    fresh = [spec.build() for _ in range(3)]
    if shared:
        joint = LayoutCache(fresh, layout, 24)
        for t in range(1, ids.shape[1]):
            for h, p in enumerate(fresh):
                p.on_decode_step(t, shown[(t, h)])
            joint.evict(t)
            assert [p.kept.tolist() for p in fresh] == held[t - 1], t
    else:
        alone = [LayoutPolicy(p, layout, 24) for p in fresh]
        for t in range(1, ids.shape[1]):
            for h, p in enumerate(alone):
                step(p, t, shown[(t, h)], 24)
            assert [p.kept.tolist() for p in alone] == held[t - 1], t


def test_fast_prefill_under_a_layout_steps_the_prompt_as_exact_does():
    import kvsim.hf as hf
    from kvsim.hf.decoding import greedy

    model, ids = _llama(), _ids(60)
    runs = []
    for prefill in ("exact", "fast"):
        cache = hf.cache(model, "h2o", 32, block_size=16, shared_selection=True, prefill=prefill, recent_window=4)
        tokens = greedy(model, ids, cache, 8, None)["tokens"]
        runs.append((tokens, [layer.held(0, 0).tolist() for layer in cache.layers]))
    assert runs[1][1] == runs[0][1]  # the same kept sets: the prompt stepped through the same rows


def test_a_plan_with_a_layout_deploys_it(tmp_path):
    import kvsim.hf as hf
    from kvsim.hf.layout import LayoutLayer
    from kvsim.policies import PolicySpec
    from kvsim.policykit.layouts import Layout
    from kvsim.policykit.plan import Plan

    plan = Plan(policy=PolicySpec.of("h2o", 32, recent_window=4), layout=Layout(16, True, 1))
    cache = hf.cache(_llama(), plan=plan)
    assert isinstance(cache.layers[0], LayoutLayer) and cache.layers[0].layout == Layout(16, True, 1)
    with pytest.raises(hf.HFError, match="plan= gives the layout"):
        hf.cache(_llama(), plan=plan, block_size=16)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=64), "block_size=64: block_size 64 is larger than the budget (32): the cache would hold no whole block"),
    (dict(evict_every=0), "evict_every must be at least 1"),
    (dict(evict_every=33), "evict_every=33: evict_every 33 does not fit budget 32: the cache would fill before the next decision"),
    (dict(evict_every=30), "evict_every=30: evict_every=30 leaves budget - k + 1 = 3: h2o's recent_window 4 must be below it"),
    (dict(block_size=16, policy="optimal"), "optimal is an offline reference (it reads the future)"),
    (dict(block_size=16, allocate="pyramidkv"), "a serving layout (block_size=16) holds every KV head at one budget in "
                                                "whole blocks; allocate= is not taken with it"),
    (dict(block_size=16, prefill="compress", prefill_budget=0.5), "a serving layout (block_size=16) holds the cache while "
                                                                "decoding; prefill='compress' chooses"),
])
def test_bad_layouts_are_one_line_before_any_token(kwargs, message):
    import kvsim.hf as hf

    with pytest.raises(hf.HFError) as e:
        kwargs = {"policy": "h2o", "recent_window": 4, **kwargs}
        if kwargs["policy"] == "optimal":
            kwargs.pop("recent_window")
        hf.cache(_llama(), budget=32, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_generate_deploys_a_layout_and_says_its_memory_in_blocks(tmp_path, capsys):
    import json

    from test_hf import _model_folder

    from kvsim import cli

    folder = _model_folder(tmp_path)
    prompt = "the quick brown fox jumps over the lazy dog and on"
    flags = ["generate", "--model", str(folder), "--policy", "h2o", "--budget", "16", "--recent-window", "3",
             "--block-size", "8", "--shared-selection", "--max-new-tokens", "12", prompt]
    assert cli.main([*flags, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"] == {"block_size": 8, "shared_selection": True, "evict_every": 1}
    m = doc["blocks"]
    assert (m["blocks"], m["block_tables"], m["block_peak"], m["memory_positions"]) == (2, 1, 2, 16)
    layers = len(doc["peak_positions"])
    assert doc["cache_bytes"] == layers * (m["blocks"] * m["block_bytes"] + m["staging_bytes"])
    assert max(doc["peak_positions"]) == 16
    assert cli.main(flags) == 0
    out = capsys.readouterr().out
    assert "h2o at budget 16 under block_size=8 shared_selection" in out
    assert "cache 2 blocks of 8 positions in one block table per layer (2 held at most) and one staging position" in out
    bad = [
        (["--block-size", "32"], "--block-size 32: block_size 32 is larger than the budget (16): the cache would hold no whole block"),
        (["--evict-every", "0"], "--evict-every 0 must be at least 1"),
        (["--block-size", "8", "--allocate", "uniform"], "--block-size 8 does not go with --allocate yet"),
        (["--block-size", "8", "--evict-every", "9"], "--block-size 8 --evict-every 9: block_size=8 evict_every=9 leaves"),
    ]
    for extra, message in bad:
        code = cli.main(["generate", "--model", str(folder), "--policy", "h2o", "--budget", "16", "--recent-window", "3",
                         *extra, "--max-new-tokens", "4", prompt])
        out = capsys.readouterr()
        assert code != 0 and out.out == "" and len(out.err.splitlines()) == 1 and message in out.err, (extra, out.err)
    code = cli.main(["generate", "--model", str(folder), "--policy", "h2o", "--budget", "20", "--recent-window", "3",
                     "--block-size", "8", "--max-new-tokens", "2", prompt, "--json"])
    out = capsys.readouterr()
    assert code == 0 and "kvsim: note: budget 20 is no multiple of block_size 8: rounded down to 2 whole blocks (16 positions)" \
        in out.err
    assert json.loads(out.out)["blocks"]["memory_positions"] == 16


def test_cli_generate_says_shared_selection_on_one_kv_head_is_a_no_op_before_the_model_loads(tmp_path, capsys):
    from kvsim import cli

    folder = tmp_path / "one-kv-head"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 1}')
    code = cli.main(["generate", "--model", str(folder), "--policy", "h2o", "--budget", "32", "--recent-window", "4",
                     "--shared-selection", "--max-new-tokens", "2", "a prompt"])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "kvsim: note: shared selection on a trace with one KV head: a no-op"
    assert code != 0  # the folder has no weights: the note came before the model was read

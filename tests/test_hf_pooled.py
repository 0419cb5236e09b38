"""adakv in the deployed cache (issue 33; kvsim.hf.pooled): a layer's KV heads share one pool of budget x KV
heads positions in one flattened store per layer, each eviction the lowest h2o score among the heads' evictable
positions with adakv's floor per head: the kept sets are the simulator's joint replay (kvsim.sim.joint) on the
attention the model computed, the bytes are the pool's plus one spare slot per head, and a layer never holds more
than its pool."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from test_hf import _model_folder, _prompt, _tiny

from kvsim import cli

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

HEAD_DIM = 8
BUDGET, WINDOW = 8, 3  # h2o's minimum is 4 (window 3 + 1); adakv's floor max(4, ceil(0.2 x 8)) = 4, below the share 8


def _full_rows(model, ids):
    """Per layer, per KV head, the full-cache attention the model computes over ``ids`` as the recorder combines
    it (kvsim.models.decode.MaskedPass with capture: the truth's full pass)."""
    from kvsim.data.trace import from_array
    from kvsim.models.decode import MaskedPass, hidden_states

    serving = MaskedPass(capture=True)
    hidden_states(model, ids, serving)
    return [[from_array(rows, name=f"layer {x} head {h}") for h, rows in enumerate(serving.captured[x])]
            for x in sorted(serving.captured)]


def _joint_kept(traces, pool: int, floor: int, window: int):
    """The joint replay's kept sets after the last step (kvsim.sim.joint.Pool driven as joint_reference drives
    it), and its masses, which must be joint_reference's and the compiled joint_replay's."""
    from kvsim.sim.joint import Pool, joint_reference, joint_replay

    state = Pool(len(traces), pool, floor, window)
    mass = np.empty((len(traces), traces[0].steps))
    for t in range(1, traces[0].steps + 1):
        rows = []
        for h, trace in enumerate(traces):
            k = np.asarray(state.kept[h], dtype=np.int64)
            rows.append(trace.derived.row(t, k)[k])
        mass[:, t - 1] = state.step(t, rows)[0]
    assert np.array_equal(mass, joint_reference(traces, pool, floor, window))
    assert np.array_equal(mass, joint_replay(traces, pool, floor, window))
    return [list(k) for k in state.kept]


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_pooled_layer_keeps_the_joint_replays_sets_in_one_store_never_above_its_pool(kind):
    import torch

    import kvsim.hf as hf

    model, ids = _tiny(kind, window=64), _prompt(40)  # gemma3's sliding layers see all 40 (the trace has no window)
    if kind == "llama":  # KV head 0 and its queries (query heads 0, 1) sharpened, head 1 left near uniform: the heads then
        with torch.no_grad():  # differ enough for the pool to move memory (random weights attend almost evenly)
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight[: 2 * HEAD_DIM] *= 30
                layer.self_attn.k_proj.weight[:HEAD_DIM] *= 30
    cache = hf.cache(model, "h2o", BUDGET, allocate="adakv", recent_window=WINDOW, prefill="fast")
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)  # the prompt attends in full, then the pool steps through its rows
    traces = _full_rows(model, ids)
    kv_heads, pool, floor = 2, 2 * BUDGET, 4
    moved = False
    for x, layer in enumerate(cache.layers):
        assert (layer.pool, layer.floor) == (pool, floor)
        want = _joint_kept(traces[x], pool, floor, WINDOW)
        got = [layer.held(0, h).tolist() for h in range(kv_heads)]
        assert got == want, (kind, x)
        assert sum(len(k) for k in got) == pool and all(len(k) >= floor for k in got)
        moved |= max(layer.head_peaks) > BUDGET  # some head held more than its share at some step
        assert layer.pool_peak == pool  # never above the pool: checked after every step
    assert moved or kind != "llama"  # the pool moved memory between some layer's heads: not uniform in disguise
    itemsize = torch.finfo(model.dtype).bits // 8
    layers = len(cache.layers)
    # one key and one value store per layer: the pool's positions, plus one slot per head for the position admitted
    assert cache.nbytes == layers * (pool + kv_heads) * HEAD_DIM * 2 * itemsize
    assert all(isinstance(layer.keys, torch.Tensor) and layer.keys.shape == (1, pool + kv_heads, HEAD_DIM)
               for layer in cache.layers)
    # decoding on, token by token (exact steps): the pool holds, the store is not reallocated
    with torch.no_grad():
        for t in range(8):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    for layer in cache.layers:
        held = [layer.held(0, h) for h in range(kv_heads)]
        assert sum(k.size for k in held) == pool and min(k.size for k in held) >= floor and layer.pool_peak == pool
        assert all(k[-1] == 47 for k in held)  # the newest position is protected (recent_window) in every head
    assert cache.nbytes == layers * (pool + kv_heads) * HEAD_DIM * 2 * itemsize


def test_exact_decoding_steps_the_pool_on_what_each_head_was_shown():
    """Closed loop, token by token: each step's victims are the Pool's on the rows the heads were shown, and the
    floor binds (a head can fall to it, never below)."""
    import torch

    import kvsim.hf as hf
    from kvsim.sim.joint import Pool

    model, ids = _tiny("llama"), _prompt(48)
    cache = hf.cache(model, "h2o", BUDGET, allocate="adakv", recent_window=WINDOW)
    shown = {x: [] for x in range(2)}
    with torch.no_grad():
        model(ids[:, :1], cache=cache, use_cache=True)
        for x, layer in enumerate(cache.layers):
            pool = layer.pools[0]
            step = pool.step

            def record(t, rows, into=shown[x], step=step):
                into.append((t, [np.array(r) for r in rows]))
                return step(t, rows)

            pool.step = record
        for t in range(1, 48):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    for x, layer in enumerate(cache.layers):
        again = Pool(2, 2 * BUDGET, 4, WINDOW)
        for t, rows in shown[x]:
            assert [r.size for r in rows] == [len(k) for k in again.kept]  # each head shown what it held, in order
            again.step(t, rows)
        assert [layer.held(0, h).tolist() for h in range(2)] == [list(k) for k in again.kept]


@pytest.mark.parametrize("policy, budget, params, prefill, message", [
    ("tova", 8, {}, "exact",
     "allocate=adakv: tova declares no score to pool a layer's heads by (pools_heads): adakv cannot run it (use h2o)"),
    ("h2o", None, {"recent_window": 3}, "exact", "allocate=adakv pools budget x 2 KV heads in each layer; give the budget"),
    ("h2o", 8, {"recent_window": 8}, "exact", "recent_window"),
    ("h2o", 8, {"recent_window": 3}, "compress", "prefill='compress' chooses each head's positions once"),
])
def test_adakv_that_cannot_deploy_is_one_line_before_any_token(policy, budget, params, prefill, message):
    import kvsim.hf as hf

    model = _tiny("llama")
    kw = {"prefill_budget": 64} if prefill == "compress" else {}
    with pytest.raises(hf.HFError) as e:
        hf.cache(model, policy, budget, allocate="adakv", prefill=prefill, **kw, **params)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_one_kv_head_per_layer_is_refused_adakv_would_be_uniform():
    import transformers as tf

    import kvsim.hf as hf

    cfg = tf.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8)
    with pytest.raises(hf.HFError) as e:
        hf.cache(tf.Gemma3ForCausalLM(cfg), "h2o", 64, allocate="adakv")
    assert str(e.value) == ("allocate=adakv: adakv pools a layer's KV heads, and with one KV head per layer the pool is "
                            "that head: adakv is uniform within a layer on this model (Gemma3ForCausalLM has 2 layers x "
                            "1 KV head); use uniform, pyramidkv or a split file")


@pytest.mark.record
def test_gemma3_270m_is_refused_adakv_in_one_line():
    import kvsim.hf as hf
    from kvsim.models.loading import load_model

    model, _ = load_model(None, tokenizer=False)
    with pytest.raises(hf.HFError) as e:
        hf.cache(model, "h2o", 64, allocate="adakv")
    assert "adakv is uniform within a layer on this model (Gemma3ForCausalLM has 18 layers x 1 KV head)" in str(e.value)


def test_cli_generate_deploys_adakv_and_says_each_layers_pool(tmp_path, capsys):
    import torch

    folder = _model_folder(tmp_path)
    prompt = "the quick brown fox jumps over the lazy dog and on"
    code = cli.main(["generate", "--model", str(folder), "--policy", "h2o", "--recent-window", "3", "--budget", "8",
                     "--allocate", "adakv", "--max-new-tokens", "6", prompt, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    doc = json.loads(out.out)
    layers = len(doc["peak_positions"])
    assert doc["pools"] == [{"layer": x, "pool": 16, "floor": 4, "peak_positions": 16} for x in range(layers)]
    assert doc["cache_bytes"] == layers * (16 + 2) * HEAD_DIM * 2 * torch.finfo(torch.float32).bits // 8
    assert doc["positions"] == 16 * layers  # uniform's memory: budget x KV heads in every layer
    code = cli.main(["generate", "--model", str(folder), "--policy", "tova", "--budget", "8", "--allocate", "adakv",
                     "--max-new-tokens", "4", "a prompt"])
    out = capsys.readouterr()
    err = [line for line in out.err.splitlines() if not line.startswith("generate: ")]
    assert code != 0 and len(err) == 1 and ("--allocate adakv: tova declares no score to pool a layer's heads by "
                                            "(pools_heads): adakv cannot run it (use h2o)") in err[0]
    assert "generate: " not in out.err  # refused before the model loaded


def test_an_adakv_replay_file_is_refused_as_a_split(tmp_path):
    """replay --allocate adakv --json writes each head's share with "pooled": true: deployed as a split it would be
    uniform, so it is refused, naming the file and what deploys the pool."""
    import kvsim.hf as hf

    path = tmp_path / "adakv.json"
    rows = [{"layer": x, "kv_head": h, "budget": 8} for x in range(2) for h in range(2)]
    path.write_text(json.dumps({"policy": "h2o", "allocate": "adakv", "pooled": True, "floor": 4, "allocation": rows}))
    with pytest.raises(hf.HFError) as e:
        hf.cache(_tiny("llama"), "h2o", None, allocate=str(path), recent_window=3)
    assert str(e.value) == (f"{path}: adakv's pool (each row is a head's share, 'pooled': true), not a split of budgets; "
                            "deploy the pool itself with --allocate adakv (allocate='adakv') at its budget")

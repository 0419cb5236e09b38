"""The torch side steps and attends once (issue 32, point 2): one attention function whose state comes
with the call, one step (observe -> admit -> evict, the victims checked) shared by the harness and the
deployed cache, one combining rule (kvsim.data.gqa) behind the recorder, the query/key rows and their
kernels, the closed loop's capture and the deployed cache; a lost link between an attention call and
its cache layer is an error (docs/domain.md, "The harness", "The deployed cache")."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tolerance import attention_rows, logit_magnitude

from kvsim.data import gqa, qk, qk_rows
from kvsim.policies import PolicySpec, make_policy
from kvsim.policykit.base import ContractError
from kvsim.sim import harness

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")
ROOT = Path(__file__).resolve().parent.parent

G, N, D, SCALE = 4, 48, 8, 8 ** -0.5


def _qk(seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(G, N, D)).astype(np.float32), rng.normal(size=(N, D)).astype(np.float32)


def _softmax64(q, k):
    """Every query head's causal softmax over its own key too, in float64: what ``reference_rows`` starts from."""
    s = SCALE * np.einsum("gtd,pd->gtp", q.astype(np.float64), k.astype(np.float64))
    t, p = np.arange(N)[:, None], np.arange(N)[None, :]
    s = np.where((p <= t)[None], s, -np.inf)
    e = np.exp(s - s.max(axis=2, keepdims=True))
    return e / e.sum(axis=2, keepdims=True)


def _cache_rows(q, k):
    """What an EvictingLayer (h2o, nothing evicted) shows its policy at each step t, driven through
    ``update`` and ``attend`` as kvsim's attention function drives it: ``{t: float32 row over 0 .. t-1}``."""
    import torch

    from kvsim.hf.attention import Call
    from kvsim.hf.cache import LAYER, EvictingLayer

    layer = EvictingLayer([PolicySpec.of("h2o", N, recent_window=1)])
    module = SimpleNamespace(layer_idx=0, head_dim=D)
    Q, K = torch.tensor(q)[None], torch.tensor(k)[None, None]  # (1, G, N, D), (1, 1, N, D)
    shown = {}
    for t in range(N):
        call = {}
        keys, values = layer.update(K[:, :, t : t + 1], K[:, :, t : t + 1], kwargs=call)
        assert call[LAYER] is layer
        if t == 0:
            policy = layer.policies[0][0]
            policy.on_decode_step = lambda pos, attn, inner=policy.on_decode_step: (shown.__setitem__(pos, attn),
                                                                                   inner(pos, attn))
        layer.attend(Call(module, Q[:, :, t : t + 1], keys, values, None, {"scaling": SCALE}))
    return shown


@needs_torch
@pytest.mark.parametrize("rule", gqa.GQA)
def test_the_five_places_that_combine_query_heads_agree_on_random_inputs(rule):
    """The recorder's NumPy statement and its blockwise reduction, the query/key rows' reference and
    kernels, and the deployed cache: the same rows, bit for bit where they start from the same softmax,
    within float32 rounding (tests/tolerance.py) where they compute their own."""
    import torch

    from kvsim.models.qkv_capture import Block
    from kvsim.models.recorder import _Recorder, kv_head_rows

    q, k = _qk()
    expected = qk_rows.reference_rows(q, k, SCALE, None, None, rule)
    # the recorder's statement from the very softmax the reference starts from: the same rule, the same bits
    assert np.array_equal(kv_head_rows(_softmax64(q, k), 1, rule)[0], expected)

    # the blockwise reduction of a float32 softmax, against the statement on that softmax: bit for bit
    w32 = _softmax64(q, k).astype(np.float32)
    buf = np.zeros((1, N * (N - 1) // 2), dtype=np.float32)
    half = N // 2
    for i, j in ((0, half), (half, N)):  # two blocks of rows, the second seeing keys from 0
        block = Block(i, j, 0, j, None, None, torch.from_numpy(w32[:, i:j, :j])[None])
        _Recorder(rule, 1 << 20, None)._reduce(0, block, 1, N, buf)
    stated = kv_head_rows(w32, 1, rule)[0].astype(np.float32)
    assert np.array_equal(buf[0], stated[np.tri(N, k=-1, dtype=bool)])

    bound = attention_rows(D, logit_magnitude(q, k, SCALE), N, G)
    # the kernels (float32 logits, one weight at a time)
    kernel_rows = qk.from_qk(q, k, np.zeros((N, 2), np.float32), scale=SCALE, softcap=None, sliding_window=None,
                             gqa=rule).attention
    np.testing.assert_allclose(kernel_rows, expected, rtol=bound, atol=0)
    # the deployed cache (float32 torch attention over what it holds; it always takes the mean)
    if rule == "mean":
        for t, attn in _cache_rows(q, k).items():
            assert attn.dtype == np.float32
            np.testing.assert_allclose(attn, expected[t, :t], rtol=bound, atol=0)


def test_the_combining_rule_is_written_once():
    """No module but kvsim/data/gqa.py takes a mean or maximum over query heads or renormalises a row
    itself: each of the five places imports the rule (the kernels call its jitted ``fold``/``finish``)."""
    users = {"kvsim/models/recorder.py": {"combine", "renormalise"},
             "kvsim/data/qk_rows.py": {"combine", "fold", "finish", "renormalise"},
             "kvsim/hf/modes.py": {"combine"}, "kvsim/sim/harness.py": {"renormalise", "position_sum"}}
    for path, names in users.items():
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and (node.module or "").split(".")[-1] == "gqa" for a in node.names}
        assert names <= imported, (path, names - imported)
        source = (ROOT / path).read_text(encoding="utf-8")
        for own in (".mean(axis=0)", ".max(axis=0)", ".mean(dim=", ".amax(dim=", "def _mix"):
            assert own not in source, (path, own)


def test_the_harness_step_refuses_a_victim_it_did_not_hold():
    policy = make_policy("h2o", budget=2, recent_window=1)
    policy.evict = lambda budget: [7]
    with pytest.raises(ContractError, match=r"step 1: victims \[7\] include positions it did not hold"):
        harness.step(policy, 1, np.ones(1, dtype=np.float32), 2)


def _tiny_llama():
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    return tf.LlamaForCausalLM(cfg).eval(), torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(1))


@needs_torch
def test_the_deployed_cache_takes_the_harness_step_and_its_victims_contract():
    """A policy that breaks the victims contract inside a real model's cache raises the harness's
    ContractError, as in a replay: the cache steps its policies through ``kvsim.sim.harness.step``."""
    import torch

    import kvsim.hf as hf

    assert importlib.import_module("kvsim.hf.stepping").step is harness.step
    model, ids = _tiny_llama()
    cache = hf.cache(model, "h2o", 8, recent_window=2, tensor=False)  # the path whose layers step a Python policy
    with torch.no_grad():
        model(ids[:, :3], cache=cache, use_cache=True)
        cache.layers[1].policies[0][1].evict = lambda budget: [99]
        with pytest.raises(ContractError, match=r"step 3: victims \[99\] include positions it did not hold"):
            model(ids[:, 3:4], cache=cache, use_cache=True)


@needs_torch
def test_a_lost_link_between_the_attention_and_the_cache_is_an_error_not_a_silent_decode():
    """The layer hands itself to the attention call in that call's keyword arguments, and checks that
    the call got the very keys it returned. An attention that gets a copy of them (where the tensor
    attribute kvsim used to ride on was lost, and plain eager attention ran instead), one that never
    gets the layer (a family that drops the call's keyword arguments), and an update without them are
    each refused in one line."""
    import torch
    import transformers as tf

    import kvsim.hf as hf
    from kvsim.hf.attention import Call, kvsim_attention
    from kvsim.hf.cache import LAYER

    def copied(module, query, key, value, mask, **kwargs):
        return kvsim_attention(module, query, key.clone(), value, mask, **kwargs)

    def dropped(module, query, key, value, mask, **kwargs):
        return kvsim_attention(module, query, key, value, mask, **{k: v for k, v in kwargs.items() if k != LAYER})

    model, ids = _tiny_llama()
    for name, fn, message in [
        ("test_keys_copied", copied, "layer 0: the attention call got keys this cache did not return for it"),
        ("test_layer_dropped", dropped, "layer 0: the keys this cache returned for position 0 never reached kvsim's attention"),
    ]:
        cache = hf.cache(model, "h2o", 8, recent_window=2)
        tf.AttentionInterface.register(name, fn)
        model.set_attn_implementation(name)
        with torch.no_grad(), pytest.raises(hf.HFError, match=message):
            model(ids[:, :3], cache=cache, use_cache=True)

    layer = hf.cache(model, "h2o", 8, recent_window=2).layers[0]
    k = torch.zeros(1, 2, 1, 8)
    with pytest.raises(hf.HFError, match="layer 0: the model does not pass its attention call's keyword arguments"):
        layer.update(k, k)
    keys, values = layer.update(k, k, kwargs={})
    with pytest.raises(hf.HFError, match="layer 0: the attention call got keys this cache did not return"):
        layer.attend(Call(SimpleNamespace(layer_idx=0, head_dim=8), torch.zeros(1, 4, 1, 8), keys.clone(), values, None, {}))


def test_the_torch_side_has_one_attention_function_and_no_module_globals():
    """Only kvsim/hf/attention.py registers anything with transformers' attention or mask interfaces,
    and no module of the torch side (kvsim/hf, kvsim/models) rebinds a module global to hand state to it."""
    for path in sorted([*(ROOT / "kvsim" / "hf").glob("*.py"), *(ROOT / "kvsim" / "models").glob("*.py")]):
        source = path.read_text(encoding="utf-8")
        assert not [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Global)], path
        if path.name != "attention.py":
            assert "Interface.register(" not in source and "ATTENTION_FUNCTIONS.register(" not in source, path

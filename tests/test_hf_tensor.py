"""The deployed cache's tensor path (kvsim.hf.tensor) held to the reference path (one Python policy per (row,
KV head), ``tensor=False``): the same tokens, the same held sets in every layer and KV head, the same peaks,
for every policy that declares a tensor step, on a tiny Llama, a tiny Gemma 3 (sliding layers: the model's
window cuts what a query sees) and the shipped Gemma-3-270M; and a decode step that reads nothing back to
the host."""

from __future__ import annotations

import contextlib
import importlib.util

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

#: every policy with a tensor step, at parameters that evict at BUDGET
TENSOR_POLICIES = [("h2o", {"recent_window": 4}), ("tova", {}), ("streaming_llm", {"sinks": 2}), ("sliding_window", {}),
                   ("scissorhands", {"recent_window": 4}), ("h2o_normalized", {"recent_window": 4}), ("knorm", {}),
                   ("keydiff", {}), ("vatp", {"recent_window": 4, "sinks": 2}), ("critical", {"recent_window": 4}),
                   ("snapkv", {"recent_window": 4, "observation_window": 3}), ("random", {}),
                   ("learned", {"recent_window": 4}),
                   ("expected_attention", {"sinks": 2, "query_window": 5, "refresh": 3, "future_positions": 7})]
BUDGET, PROMPT, NEW, CHUNK = 16, 40, 30, 7


def _tiny(kind: str):
    from test_hf import _tiny as tiny

    return tiny(kind)


def _decode(model, ids, cache, new: int = NEW) -> dict:
    from kvsim.hf.decoding import greedy

    tokens = greedy(model, ids, cache, new)["tokens"]
    heads = cache.layers[0].kv_heads
    return {"tokens": tokens, "peaks": cache.peak_positions,
            "held": [[layer.held(0, h).tolist() for h in range(heads)] for layer in cache.layers]}


def test_every_online_policy_with_a_tensor_step_is_covered():
    """The list above is the registry's: a policy that declares a tensor step is held to the reference here."""
    from kvsim.hf.tensor import hooks_of
    from kvsim.policies import POLICIES

    declared = {name for name, cls in POLICIES.items() if hooks_of(cls) is not None and not cls.needs_trace}
    assert declared == {name for name, _ in TENSOR_POLICIES}


@pytest.mark.parametrize("prefill", ["exact", "fast"])
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize(("policy", "params"), TENSOR_POLICIES, ids=[p for p, _ in TENSOR_POLICIES])
def test_the_tensor_path_holds_and_generates_what_the_reference_path_does(policy, params, kind, prefill):
    """A prompt over twice the budget, in chunks smaller than it (exact) or at once (fast), then greedy decoding:
    the tokens, every layer's and KV head's held set, and the peaks equal the reference path's."""
    from test_hf import _prompt

    import kvsim.hf as hf
    from kvsim.hf.tensor import TensorLayer

    model, ids = _tiny(kind), _prompt(PROMPT)
    ref = hf.cache(model, policy, BUDGET, prefill=prefill, tensor=False, **params)
    fast = hf.cache(model, policy, BUDGET, prefill=prefill, tensor=True, chunk=CHUNK, **params)
    assert all(isinstance(layer, TensorLayer) for layer in fast.layers)
    assert not any(isinstance(layer, TensorLayer) for layer in ref.layers)
    expected = _decode(model, ids, ref)
    assert _decode(model, ids, fast) == expected
    assert expected["peaks"] == [BUDGET] * len(fast.layers)


@pytest.mark.parametrize("prefill", ["exact", "fast"])
def test_a_seeded_random_draws_what_the_reference_draws_from_one_generator_per_layer(prefill):
    """A seed gives every head of a layer one generator (the reference path's): the tensor path draws from it in
    the reference's order (step, KV head, row), so two rows x two KV heads hold and generate what the reference
    does; fast prefill draws a chunk head by head, so a seeded cache of several KV heads stays on the reference
    path there, said once."""
    from test_hf import _prompt

    import kvsim.hf as hf
    from kvsim.hf.tensor import TensorLayer

    model, ids = _tiny("llama"), _prompt(PROMPT).expand(2, -1)
    ref = hf.cache(model, "random", BUDGET, prefill=prefill, seed=7, tensor=False)
    fast = hf.cache(model, "random", BUDGET, prefill=prefill, seed=7, chunk=CHUNK)
    assert all(isinstance(layer, TensorLayer) for layer in fast.layers) == (prefill == "exact")
    if prefill == "fast":
        assert fast.notes == ["a seeded random draws a layer's KV heads from one generator, which fast prefill draws "
                              "head by head: the reference path steps it, one (row, KV head) at a time in Python"]
    got, expected = (_decode(model, ids, c) for c in (fast, ref))
    both = [[[layer.held(b, h).tolist() for h in range(2)] for b in range(2)] for layer in fast.layers]
    assert got == expected and both == [[[layer.held(b, h).tolist() for h in range(2)] for b in range(2)]
                                        for layer in ref.layers]
    assert both[0][0][0] != both[0][0][1]  # one generator: the heads draw differently


def test_a_prompt_in_one_pass_holds_what_feeding_it_one_token_at_a_time_holds():
    """The tensor path's chunked prompt (chunks of 7, 48 positions at budget 16) against the same tokens fed one
    at a time (decode steps): the same held sets, and the next logits within two float32 passes' rounding."""
    import torch
    from test_hf import _prompt
    from tolerance import forward_pass

    import kvsim.hf as hf

    model, ids = _tiny("gemma3"), _prompt(48)
    whole = hf.cache(model, "h2o", BUDGET, recent_window=4, tensor=True, chunk=CHUNK)
    single = hf.cache(model, "h2o", BUDGET, recent_window=4, tensor=True, chunk=CHUNK)
    with torch.no_grad():
        a = model(ids, cache=whole, use_cache=True).logits[0, -1]
        for t in range(ids.shape[1]):
            b = model(ids[:, t : t + 1], cache=single, use_cache=True).logits[0, -1]
    torch.testing.assert_close(a, b, rtol=0, atol=forward_pass(model.config, BUDGET + 1, float(a.abs().max())))
    for la, lb in zip(whole.layers, single.layers, strict=True):
        for h in range(2):
            assert la.held(0, h).tolist() == lb.held(0, h).tolist()
            assert la.held(0, h).size == BUDGET and la.held(0, h)[-1] == 47
    assert any(la.held(0, 0).tolist() != list(range(32, 48)) for la in whole.layers)  # not merely the newest 16


@pytest.mark.parametrize(("policy", "rows"), [("h2o", ({"recent_window": 3}, {"recent_window": 8})),
                                             ("snapkv", ({"recent_window": 2, "observation_window": 0},
                                                         {"recent_window": 2, "observation_window": 1}))],
                         ids=["h2o", "snapkv"])
def test_a_batch_of_rows_each_at_its_own_parameters_matches_the_reference(policy, rows):
    """Two rows, each (row, KV head) its own built policy (h2o at recent_window 3 in row 0 and 8 in row 1; snapkv
    scoring every row in row 0 and the last one in row 1, as a quality batch's rows are configurations): every row's
    held sets match the reference layer's."""
    import torch
    from test_hf import _prompt

    from kvsim.hf import EvictingCache, EvictingLayer
    from kvsim.hf.attention import attach
    from kvsim.hf.tensor import TensorLayer
    from kvsim.policies import make_policy

    model = _tiny("llama")
    attach(model)
    ids = _prompt(PROMPT).expand(2, -1)
    out = {}
    for kind in (EvictingLayer, TensorLayer):
        layers = [kind(policies=[[make_policy(policy, BUDGET, **params) for _ in range(2)] for params in rows])
                  for _ in range(2)]
        cache = EvictingCache(layers)
        with torch.no_grad():
            step = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(10):
                step = model(step, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        out[kind] = [[[layer.held(b, h).tolist() for h in range(2)] for b in range(2)] for layer in cache.layers]
    assert out[TensorLayer] == out[EvictingLayer]
    differ = [layer[0] != layer[1] for layer in out[TensorLayer]]  # each row at its own parameters
    assert all(differ) if policy == "h2o" else any(differ)


#: rows of several policy classes in one batch, a class's rows side by side (as the needle's cells batch them)
CLASSES = [("h2o", {"recent_window": 3}), ("h2o", {"recent_window": 8}), ("knorm", {}), ("tova", {}),
           ("snapkv", {"recent_window": 2, "observation_window": 2}), ("critical", {"recent_window": 4}), ("keydiff", {})]


def test_a_batch_of_rows_of_several_policy_classes_matches_the_reference():
    """One layer, a row per configuration of CLASSES: each class's run of rows stepped by its own hooks in the
    layer's one step (``TensorLayer.groups``) holds what the reference layer's rows hold, in a prompt of several
    chunks and at decoding; such a layer refuses to reorder its rows (beam search) in one line."""
    import torch
    from test_hf import _prompt

    import kvsim.hf as hf
    from kvsim.hf import EvictingCache, EvictingLayer
    from kvsim.hf.attention import attach
    from kvsim.hf.tensor import TensorLayer
    from kvsim.policies import make_policy

    model = _tiny("gemma3")
    attach(model)
    ids = _prompt(PROMPT).expand(len(CLASSES), -1)
    out, heads = {}, model.config.num_key_value_heads
    for kind, extra in ((EvictingLayer, {}), (TensorLayer, {"chunk": CHUNK})):
        layers = [kind(policies=[[make_policy(p, BUDGET, **params) for _ in range(heads)] for p, params in CLASSES],
                       **extra) for _ in range(model.config.num_hidden_layers)]
        cache = EvictingCache(layers)
        with torch.no_grad():
            step = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(10):
                step = model(step, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        out[kind] = [[[layer.held(b, h).tolist() for h in range(heads)] for b in range(len(CLASSES))]
                     for layer in cache.layers]
    assert [len(layer.groups) for layer in cache.layers] == [6] * len(cache.layers)
    assert out[TensorLayer] == out[EvictingLayer]
    with pytest.raises(hf.HFError, match="a layer of several policy classes .* cannot select or reorder rows"):
        cache.reorder_cache(torch.arange(len(CLASSES)).flip(0))
    assert [[[layer.held(b, h).tolist() for h in range(heads)] for b in range(len(CLASSES))]
            for layer in cache.layers] == out[TensorLayer]  # refused before anything moved


@pytest.mark.parametrize("walked", [False, True], ids=["operations", "walk"])
def test_a_decode_step_reads_nothing_back_to_the_host(monkeypatch, walked):
    """After the prompt, decode steps of every layer with ``Tensor.item``, ``.cpu``, ``.numpy`` and ``.tolist``
    made to raise: the tensor path's step is tensor operations only (on a GPU it never waits for the host). On a
    CPU the policies whose tensor step declares ``walk`` take one compiled call per step (kvsim.hf.walk), which
    reads the layer's tensors through ``.numpy()``: there the host is the device, and every such read must be a view
    of a CPU tensor's own memory (nothing copied, nothing waited for); the rest still raise."""
    import torch
    from test_hf import _prompt

    import kvsim.hf as hf
    from kvsim.hf import walk
    from kvsim.policykit import registry

    model = _tiny("gemma3")
    views = []
    as_array = torch.Tensor.numpy

    def in_place(tensor, *args, **kwargs):
        array = as_array(tensor, *args, **kwargs)
        assert tensor.device.type == "cpu" and array.__array_interface__["data"][0] == tensor.data_ptr()
        views.append(1)
        return array

    for policy, params in TENSOR_POLICIES:
        if walked and registry.walks_prompt(policy) is None:
            continue
        cache = hf.cache(model, policy, BUDGET, tensor=True, chunk=CHUNK, **params)
        with torch.no_grad(), walk.off() if not walked else contextlib.nullcontext():
            nxt = model(_prompt(PROMPT), cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            with monkeypatch.context() as m:
                for name in ("item", "cpu", "numpy", "tolist"):
                    m.setattr(torch.Tensor, name, in_place if walked and name == "numpy" else _raiser(name))
                for _ in range(4):
                    nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        assert cache.peak_positions == [BUDGET] * len(cache.layers)
    assert bool(views) == walked  # the walk ran where it should, and only there


def _raiser(name: str):
    def read_back(*args, **kwargs):
        raise AssertionError(f"Tensor.{name} on the decode path")

    return read_back


def test_the_cache_says_once_when_a_policy_runs_on_the_reference_path_and_refuses_bad_input(newest_plugin):
    """A policy without a tensor step runs on the reference path, said once in the cache's notes; tensor=True
    refuses it, and a chunk below 1 or above the model's context, in one line before any token."""
    import kvsim.hf as hf

    model = _tiny("llama")
    ref = hf.cache(model, "newest", BUDGET)
    assert ref.notes == ["newest declares no tensor step: the reference path steps it, one (row, KV head) "
                         "at a time in Python"]
    assert hf.cache(model, "h2o", BUDGET, recent_window=4).notes == []
    for kwargs, message in (
        ({"tensor": True, "policy": "newest"}, "tensor=True: newest declares no tensor step"),
        ({"chunk": 0}, "chunk must be an integer of at least 1, got 0"),
        ({"chunk": 513}, "chunk 513 is above LlamaForCausalLM's context of 512 positions"),
        ({"tensor": True, "scissorhands": True}, "tensor=True: scissorhands's tensor step does not cover scissorhands "
                                                 "recent_window=4 history_window=2"),
        ({"tensor": True, "block_size": 4}, "tensor=True: a serving layout"),
    ):
        kwargs = dict(kwargs)
        policy = kwargs.pop("policy", "h2o")
        extra = {"recent_window": 4}
        if kwargs.pop("scissorhands", False):
            policy, extra = "scissorhands", {"recent_window": 4, "history_window": 2}
        with pytest.raises(hf.HFError) as e:
            hf.cache(model, policy, BUDGET, **kwargs, **({} if policy == "newest" else extra))
        assert str(e.value).startswith(message)
        assert "\n" not in str(e.value)


@pytest.mark.record
@pytest.mark.parametrize(("policy", "params"), [("h2o", {"recent_window": 32}), ("streaming_llm", {}), ("tova", {})],
                         ids=["h2o", "streaming_llm", "tova"])
def test_on_the_shipped_model_the_tensor_path_holds_and_generates_what_the_reference_does(policy, params):
    """Gemma-3-270M (18 layers, sliding and global), a 130-token prompt at budget 48 in chunks of 40, 6 greedy
    tokens: every layer's held set and every token equal the reference path's."""
    import torch

    import kvsim.hf as hf
    from kvsim.models.loading import load_model

    model, tokenizer = load_model(None)
    text = "The heap queue algorithm keeps the smallest item at the root. " * 30
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False).input_ids[:129]]])
    ref = _decode(model, ids, hf.cache(model, policy, 48, tensor=False, **params), new=6)
    got = _decode(model, ids, hf.cache(model, policy, 48, tensor=True, chunk=40, **params), new=6)
    assert got == ref

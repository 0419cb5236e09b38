"""A prompt walked in one compiled loop (kvsim.hf.walk) held to the tensor path's own operations
(``walk.off()``): the same held sets, departures, peaks and tokens, and each held column's state within the
rounding the two softmaxes may differ by, for every policy whose tensor step declares ``walk``, on a tiny Llama
and a tiny Gemma 3 (sliding layers), exact prompts in chunks and fast ones, and a later prompt on the same cache
(a conversation's question) walked from what the cache holds."""

from __future__ import annotations

import importlib.util

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

WALKING = [("h2o", {"recent_window": 4}), ("h2o_normalized", {"recent_window": 4}), ("tova", {}),
           ("scissorhands", {"recent_window": 4}), ("streaming_llm", {"sinks": 2}), ("sliding_window", {}),
           ("snapkv", {"recent_window": 4, "observation_window": 3}), ("vatp", {"recent_window": 4, "sinks": 2}),
           ("critical", {"recent_window": 4}), ("keydiff", {}), ("random", {}), ("knorm", {}),
           ("expected_attention", {"sinks": 2, "query_window": 5, "refresh": 3, "future_positions": 7})]
BUDGET, PROMPT, NEW, CHUNK = 16, 40, 12, 7


def _run(kind: str, policy: str, params: dict, prefill: str, walked, question: int = 0, headroom: int | None = None):
    """``walked``: True, the prompts and the decode steps walk; False, neither (``walk.off()``); ``"decode"``, the
    decode steps alone, after a prompt the tensor operations stepped. ``headroom``: the walk's ``HEADROOM``."""
    import torch
    from test_hf import _prompt, _tiny

    import kvsim.hf as hf
    from kvsim.hf import walk
    from kvsim.hf.decoding import greedy

    model, ids = _tiny(kind), _prompt(PROMPT)
    cache = hf.cache(model, policy, BUDGET, prefill=prefill, tensor=True, chunk=CHUNK, **params)
    for layer in cache.layers:
        layer.watch(PROMPT)
    calls = {"run": [], "decode": []}
    real = {"run": walk.run, "decode": walk.decode, "fits": walk.fits, "HEADROOM": walk.HEADROOM}

    def counted(name):
        def call(*args):
            calls[name].append(1)
            return real[name](*args)

        return call

    def fits(layer, q, mask):  # "decode": a prompt takes the tensor operations
        return (walked != "decode" or q.shape[3] == 1) and real["fits"](layer, q, mask)

    walk.run, walk.decode, walk.fits = counted("run"), counted("decode"), fits
    walk.HEADROOM = real["HEADROOM"] if headroom is None else headroom
    try:
        with walk.off() if not walked else _nothing():
            tokens = greedy(model, ids, cache, NEW)["tokens"]
            if question:  # a second prompt on the same cache, as a conversation's next question
                with torch.no_grad():
                    more = torch.tensor([tokens[-question:]])
                    model(more, cache=cache, use_cache=True)
    finally:
        walk.run, walk.decode, walk.fits, walk.HEADROOM = (real[k] for k in ("run", "decode", "fits", "HEADROOM"))
    if policy == "keydiff":
        _units(cache)
    if policy == "expected_attention":
        _keys(cache)
    heads = cache.layers[0].kv_heads
    state = [{name: _held_values(layer, s) for name, s in layer.groups[0].state.slots.items()} for layer in cache.layers]
    return {"tokens": tokens, "peaks": cache.peak_positions, "calls": len(calls["run"]) / len(cache.layers),
            "decodes": len(calls["decode"]) / len(cache.layers),
            "seen": [layer.seen for layer in cache.layers], "length": cache.get_seq_length(),
            "held": [[layer.held(0, h).tolist() for h in range(heads)] for layer in cache.layers],
            "left": [layer.left.tolist() for layer in cache.layers]}, state


def _held_values(layer, slot):
    """Each (KV head, held position)'s value of a state slot, by position (the slots' order is the layer's own)."""
    return {(h, int(p)): slot[0, h, s].tolist() for h in range(layer.pos.shape[1])
            for s, p in enumerate(layer.pos[0, h].tolist()) if p >= 0}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("prefill", ["exact", "fast"])
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize(("policy", "params"), WALKING, ids=[p for p, _ in WALKING])
def test_the_walk_holds_departs_and_generates_what_the_tensor_operations_do(policy, params, kind, prefill):
    """Tokens, held sets, each key's departure step, peaks: equal. A state value is a sum of at most PROMPT + NEW
    rows shown, each a quotient of float32 weights whose softmax added at most BUDGET + CHUNK + 1 terms in another
    order: relatively within (BUDGET + CHUNK + 3) x 2^-23 of the other path's, row by row, so the sum is too."""
    walked, walked_state = _run(kind, policy, params, prefill, True)
    ops, ops_state = _run(kind, policy, params, prefill, False)
    assert walked["calls"] == 1 and ops["calls"] == 0  # the prompt walked once in every layer
    assert walked["decodes"] == NEW - 1 and ops["decodes"] == 0  # and every decode step after it
    assert _same(walked, ops)
    _close(walked_state, ops_state)


def _same(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in ("calls", "decodes")} == {k: v for k, v in b.items()
                                                                              if k not in ("calls", "decodes")}


def _close(walked_state, ops_state) -> None:
    """Each held column's state: relatively within (BUDGET + CHUNK + 3) x 2^-23 (the test above says why). keydiff's
    unit keys and expected_attention's keys are functions of the keys alone, which a later layer computes from outputs
    that differ in their last bits: they are held instead to the keys each path stores (``_units``, ``_keys``)."""
    tol = (BUDGET + CHUNK + 3) * 2.0**-23
    for mine, theirs in zip(walked_state, ops_state, strict=True):
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert mine[name].keys() == theirs[name].keys()
            if name in ("unit", "key"):
                continue
            # expected_attention's logits are sums of terms whose size is the largest logits', which may cancel:
            # each is held within the tolerance of those, absolutely
            scale = max((abs(x) for v in theirs[name].values() for x in v), default=0.0) if name == "logit" else 0.0
            for at, value in mine[name].items():
                if name in ("logit", "stamp") and at[1] < 2:  # expected_attention's sinks (2): never scored, and the
                    continue  # operations take their logits with the others', which the engine does not
                assert value == pytest.approx(theirs[name][at], rel=tol, abs=max(tol * scale, 1e-300)), (name, at)


def _units(cache) -> None:
    """keydiff's unit key in every held column is ``unit_keys`` of the key the layer holds there, within one unit in
    the last place of a number below 1 (a component of a unit vector): the walk's are those bits; the tensor
    operations' may differ from them in a last bit (torch's division against NumPy's)."""
    import numpy as np

    from kvsim.policies.keydiff import unit_keys

    for layer in cache.layers:
        unit, keys, pos = layer.groups[0].state.slots["unit"], layer._keys, layer.pos
        held = (pos >= 0).numpy()
        assert held.any()
        assert np.abs(unit.numpy()[held] - unit_keys(keys.numpy()[held])).max() <= 2.0**-52


def _keys(cache) -> None:
    """expected_attention's key slot in every held column is the key the layer holds there, widened to float64."""
    for layer in cache.layers:
        key, held = layer.groups[0].state.slots["key"], layer.pos >= 0
        assert held.any()
        assert (key[held] == layer._keys[held].double()).all()


@pytest.mark.parametrize("prefill", ["exact", "fast"])
@pytest.mark.parametrize("policy", ["h2o", "tova", "h2o_normalized", "scissorhands", "snapkv", "keydiff",
                                    "expected_attention"])
def test_a_second_prompt_on_the_cache_walks_from_what_it_holds(policy, prefill):
    """A conversation's next question is a prompt on a cache that holds a state: the walk reads it in (held positions,
    their slots, the policy's values) and walks on; what the cache holds after, every key's departure and the tokens
    equal the operations' throughout."""
    params = dict(WALKING)[policy]
    walked, _ = _run("gemma3", policy, params, prefill, True, question=9)
    ops, _ = _run("gemma3", policy, params, prefill, False, question=9)
    assert walked["calls"] == 2  # in every layer: the first prompt and the question
    assert _same(walked, ops)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize(("policy", "params"), WALKING, ids=[p for p, _ in WALKING])
def test_decode_steps_walk_on_from_the_operations_and_past_the_walks_headroom(policy, params, kind):
    """The decode steps walk after a prompt the tensor operations stepped (what the layer holds read in at the first
    step), and a walk sized for fewer positions than the run (``HEADROOM`` 3: built again from the layer's tensors
    every few steps) walks on: the same tokens, held sets, departures, peaks and states as the operations alone."""
    ops, ops_state = _run(kind, policy, params, "exact", False)
    for walked, headroom in (("decode", None), (True, 3)):
        mine, state = _run(kind, policy, params, "exact", walked, headroom=headroom)
        assert mine["decodes"] == NEW - 1 and mine["calls"] == (walked is True)
        assert _same(mine, ops), (walked, headroom)
        _close(state, ops_state)


@pytest.mark.parametrize("prefill", ["exact", "fast"])
def test_snapkv_at_an_observation_window_of_0_walks_its_running_sum(prefill):
    """snapkv's window of 0 scores by the running sum of every row shown (h2o's rule), which its engine keeps apart from
    the ring: walked through a prompt, a question and the decode steps, it holds, departs and scores as the operations."""
    params = {"recent_window": 4, "observation_window": 0}
    walked, walked_state = _run("llama", "snapkv", params, prefill, True, question=9)
    ops, ops_state = _run("llama", "snapkv", params, prefill, False, question=9)
    assert walked["calls"] == 2 and walked["decodes"] == NEW - 1
    assert _same(walked, ops)
    _close(walked_state, ops_state)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_seeded_random_walks_the_tensor_operations_draws(kind):
    """A seeded cache's random draws a layer's (row, KV head)s from one generator in the reference path's order; the
    walk reads each draw from the tensor step's plan and never draws again: through a prompt in chunks, a question on
    the same cache and the decode steps, it holds, departs and generates as the operations (a draw out of the
    reference's order would move a victim)."""
    walked, walked_state = _run(kind, "random", {"seed": 0}, "exact", True, question=9)
    ops, ops_state = _run(kind, "random", {"seed": 0}, "exact", False, question=9)
    assert walked["calls"] == 2 and walked["decodes"] == NEW - 1
    assert _same(walked, ops)
    _close(walked_state, ops_state)


def test_the_registry_says_which_policies_walk():
    """A class walks where its tensor step declares ``walk`` and its engine binding gives hooks; others do not, a
    plugin without either included."""
    from kvsim.policykit import registry

    walking = {name for name in registry.POLICIES if registry.walks_prompt(name) is not None}
    assert walking == {name for name, _ in WALKING}
    assert registry.walks_prompt("h2o") == (("score", 1),)


@pytest.mark.parametrize("prefill", ["exact", "fast"])
def test_a_rows_outputs_are_its_own_whatever_shares_its_batch(prefill):
    """A row whose class reads no attention (streaming_llm, knorm) takes a prompt's outputs from a fused attention
    masked by what it sees, a row that reads attention from the weights the walk computes, each kind over its own rows:
    batched with rows of the other kind, every row's logits over the prompt are bit for bit those it gets in a batch of
    its own kind (the pass key's cell batches every class together, and a class near a tie in its scores must not part
    from its run alone by its batch-mates' last bits). The prompt's, not a decode step's: there the model's own
    products of a handful of rows differ in their last bits between batch sizes, transformers' full cache's too."""
    import torch
    from test_hf import _prompt, _tiny

    from kvsim.hf import EvictingCache
    from kvsim.hf.attention import attach
    from kvsim.hf.tensor import TensorLayer
    from kvsim.policies import make_policy

    model = _tiny("gemma3")
    attach(model)
    heads = model.config.num_key_value_heads
    rows = [("h2o", {"recent_window": 4}), ("streaming_llm", {"sinks": 2}), ("knorm", {}), ("tova", {})]

    def logits(members):
        layers = [TensorLayer(policies=[[make_policy(p, BUDGET, **params) for _ in range(heads)] for p, params in members],
                              prefill=prefill, chunk=CHUNK) for _ in range(model.config.num_hidden_layers)]
        cache = EvictingCache(layers)
        ids = _prompt(PROMPT).expand(len(members), -1)
        with torch.no_grad():
            return model(ids, cache=cache, use_cache=True).logits

    together = logits(rows)
    seeing, blind = logits([rows[0], rows[3]]), logits([rows[1], rows[2]])
    assert torch.equal(together[[0, 3]], seeing) and torch.equal(together[[1, 2]], blind)

"""The deployed cache against the simulator (kvsim.hf against kvsim.sim): compression at the prompt's end
(``prefill="compress"``) keeps, in every layer and KV head, the positions the simulator chooses from the same
attention, and a policy that reads keys, values, queries or output norms is handed what the model computed,
so its kept sets are the simulator's on the model's recorded query/key trace. A tiny Gemma 3 built from a
config (random weights, nothing downloaded), recorded by ``kvsim record --store qk`` in float32; and the
shipped Gemma-3-270M on a short prompt (``record``). Needs the recorder's extra."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import policy_args

torch = pytest.importorskip("torch", reason="the recorder's extra is not installed (pip install -r requirements-record.txt)")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import tiny_models  # noqa: E402  (tests/, beside this file)

from kvsim.data.bundle import load_bundle  # noqa: E402
from kvsim.policies import POLICIES, Display, PolicySpec  # noqa: E402
from kvsim.policykit.base import DEFAULT_BUDGET, SlotPolicy  # noqa: E402
from kvsim.sim.prefill import Prefill, Resumed, choose_on, replay_prefill, trace_rows, trace_vectors  # noqa: E402
from kvsim.sim.simulate import replay  # noqa: E402

STEPS, PROMPT, KEEP, BUDGET = 48, 40, 12, 10
SNAP = {"recent_window": 4, "observation_window": 8}


class KeyValueNorm(SlotPolicy):
    """Test-only: a position's score is |k|_2 x |v|_1 of its key and value (no attention); the lowest goes."""

    name = "test_key_value_norm"
    reads = ("keys", "values")
    display = Display("#0b5394", "3px,9px", 1.5)

    def __init__(self, budget=DEFAULT_BUDGET, rng=None):
        super().__init__(budget, rng)
        self._score = np.zeros(self.budget + 1)
        self._next = 0.0

    def _slot_arrays(self):
        return [self._score]

    def see(self, pos, vectors):
        score = float(np.linalg.norm(vectors["keys"].astype(np.float64))) * float(np.abs(vectors["values"]).sum())
        if pos == 0 and self._len == 1:
            self._score[0] = score  # position 0 is held from the start
        self._next = score

    def on_decode_step(self, pos, attn):
        self._step_attention(attn)
        self._score[self._admit(pos)] = self._next

    def evict(self, budget):
        return self._evict_lowest(budget, self._score[: self._len])


#: every registered policy that reads vectors, and the test-only one; expected_attention also reads its model's
#: RoPE, which the deployed cache takes from the model with the recorder's own call (``rope_meta``)
READERS = [*(name for name, cls in POLICIES.items() if cls.reads and not cls.needs_trace), KeyValueNorm.name]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(model, token ids, {(layer, kv head): its query/key trace with out_norms}) of a tiny Gemma 3 (sliding,
    global, sliding; 4 query heads over 2 KV heads), recorded in float32 over STEPS + 1 tokens."""
    return _recorded(tmp_path_factory, "gemma3")


@pytest.fixture(scope="module")
def recorded_llama(tmp_path_factory):
    """The same of a tiny Llama (2 global layers, the default RoPE at base 10,000, head dim 8)."""
    return _recorded(tmp_path_factory, "llama")


def _recorded(tmp_path_factory, family: str):
    from transformers import AutoModelForCausalLM

    from kvsim.models.loading import token_ids
    from kvsim.models.record import RecordConfig, record

    tmp = tmp_path_factory.mktemp(f"prefill_hf_{family}")
    tokenizer, vocab = tiny_models.tokenizer(tiny_models.TEXT, 300)
    torch.manual_seed(5)
    cfg = tiny_models.config(family, vocab, hidden=32, intermediate=64, max_positions=256, head_dim=8, window=16)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    folder = tmp / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (tmp / "text.txt").write_text(tiny_models.TEXT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSIM_CACHE_DIR", str(tmp / "cache"))
        record(RecordConfig(tmp / "text.txt", tmp / "qk", model=folder, steps=STEPS, layers="all", store="qk",
                            dtype=np.float32), progress=None)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    ids = token_ids(tokenizer, tiny_models.TEXT)[:, : STEPS + 1]
    traces = {}
    for entry in load_bundle(tmp / "qk").traces:
        trace = entry.load()
        # the recorder's norms (what the simulator reads) against a plain NumPy statement: both float64 inside,
        # rounded once to float32, so within two float32 roundings
        np.testing.assert_allclose(trace.out_norms, _out_norms(model, entry.layer, entry.head, trace.values), rtol=2.5e-7)
        traces[(entry.layer, entry.head)] = trace
    return model, ids, traces


def _out_norms(model, layer: int, head: int, values: np.ndarray) -> np.ndarray:
    """``(N, G)``: |W_O^j v_p|_2 for each query head j of KV head ``head``'s group, from the layer's o_proj."""
    attn = model.model.layers[layer].self_attn
    w = attn.o_proj.weight.detach().double().numpy()
    cfg = model.config
    group, d = cfg.num_attention_heads // cfg.num_key_value_heads, values.shape[1]
    wh = w[:, head * group * d : (head + 1) * group * d].reshape(w.shape[0], group, d)
    return np.linalg.norm(np.einsum("ogd,nd->ngo", wh, values.astype(np.float64)), axis=-1).astype(np.float32)


def _held_after_prompt(trace, prefill, decode):
    """The simulator's kept set once the prompt is compressed and the decode policy resumed from it."""
    from kvsim.sim.prefill import GROW  # noqa: F401  (None below is the growing cache)

    kept = choose_on(trace, prefill)
    policy = None if decode is None else decode.build(trace)
    vectors = None if decode is None else trace_vectors(trace, [decode])
    return Resumed(policy, kept, prefill.prompt, trace_rows(trace), vectors).kept.tolist()


@pytest.mark.parametrize("decode", [None, ("h2o", {"recent_window": 2}), ("tova", {}), (KeyValueNorm.name, {})],
                         ids=["grow", "h2o", "tova", "vectors"])
def test_compress_keeps_the_simulators_positions_in_every_layer_and_head(recorded, decode, monkeypatch):
    """After the prompt's one pass, every (layer, KV head) holds what ``kvsim.sim.prefill`` keeps on the recorded
    trace of that head (SnapKV keeping 12 of 40); then, teacher-forced through the recording's next tokens, layer
    0 (whose inputs eviction cannot change) holds after each step what the simulator holds after that step."""
    import kvsim.hf as hf

    monkeypatch.setitem(POLICIES, KeyValueNorm.name, KeyValueNorm)
    model, ids, traces = recorded
    name, params = ("none", {}) if decode is None else decode
    spec = None if decode is None else PolicySpec.of(name, BUDGET, **params)
    cache = hf.cache(model, name, None if decode is None else BUDGET, prefill="compress", prefill_budget=KEEP,
                     prefill_params=SNAP, **params)
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache, use_cache=True)
    for (layer, head), trace in traces.items():
        prefill = Prefill.of(trace, KEEP, "snapkv", prompt=PROMPT, **SNAP)
        assert cache.layers[layer].held(0, head).tolist() == _held_after_prompt(trace, prefill, spec), (layer, head)
    history = {h: replay_prefill(traces[(0, h)], Prefill.of(traces[(0, h)], KEEP, "snapkv", prompt=PROMPT, **SNAP), spec,
                                 record_kept=True).kept_history for h in range(2)}
    with torch.no_grad():
        for i, t in enumerate(range(PROMPT, STEPS + 1)):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
            for h in range(2):
                row = history[h][i]
                assert cache.layers[0].held(0, h).tolist() == row[row >= 0].tolist(), (t, h)


@pytest.mark.parametrize("scorer", [KeyValueNorm.name, "expected_attention"])
def test_a_scorer_that_reads_vectors_chooses_as_the_simulator_does(recorded, scorer, monkeypatch):
    """The one-time choice by the test-only policy (keys and values, no attention), and by expected_attention (its
    RoPE read from the model, each layer's own): every head keeps the positions the simulator's choice keeps on the
    recording."""
    import kvsim.hf as hf

    monkeypatch.setitem(POLICIES, KeyValueNorm.name, KeyValueNorm)
    model, ids, traces = recorded
    params = {"query_window": 6, "future_positions": 20} if scorer == "expected_attention" else {}
    cache = hf.cache(model, "none", None, prefill="compress", prefill_budget=KEEP, prefill_policy=scorer,
                     prefill_params=params)
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache, use_cache=True)
    for (layer, head), trace in traces.items():
        want = choose_on(trace, Prefill.of(trace, KEEP, scorer, prompt=PROMPT, **params)).tolist()
        assert cache.layers[layer].held(0, head).tolist() == want, (layer, head)


def test_a_ratio_keeps_that_share_and_bad_settings_are_refused_before_any_token(recorded):
    import kvsim.hf as hf

    model, ids, traces = recorded
    cache = hf.cache(model, "none", None, prefill="compress", prefill_budget=0.5, prefill_params=SNAP)
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache, use_cache=True)
    assert {cache.layers[x].held(0, h).size for x, h in traces} == {PROMPT // 2}
    bad = [
        (dict(prefill_budget=0), "prefill_budget: 0 positions"),
        (dict(prefill_budget=1.5), "prefill_budget: the ratio 1.5"),
        (dict(prefill_budget=4), "prefill_budget: 4 positions must be above the scorer snapkv's recent_window 32"),
        (dict(prefill_budget=40, prefill_policy="optimal"), "prefill_policy: optimal cannot rank the prompt"),
        (dict(), "prefill='compress' needs prefill_budget"),
    ]
    for kw, message in bad:
        with pytest.raises(hf.HFError) as e:
            hf.cache(model, "none", None, prefill="compress", **kw)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(hf.HFError, match="policy 'none' .* is for prefill='compress'"):
        hf.cache(model, "none", None)
    cache = hf.cache(model, "none", None, prefill="compress", prefill_budget=41, prefill_params=SNAP)
    with torch.no_grad(), pytest.raises(hf.HFError, match="prefill_budget: 41 positions must be from 1 to the prompt's 40"):
        model(ids[:, :PROMPT], cache=cache, use_cache=True)


def test_keeping_the_whole_prompt_and_growing_is_the_full_cache(recorded):
    """prefill_budget = the prompt: nothing is evicted, and the cache grows past the prompt's 40 slots (its blocks
    double) through the decode steps: every step's logits are one teacher-forced pass's over the same tokens."""
    from tolerance import forward_pass

    import kvsim.hf as hf

    model, ids, _ = recorded
    cache = hf.cache(model, "none", None, prefill="compress", prefill_budget=PROMPT, prefill_params=SNAP)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[0]
        got = [model(ids[:, :PROMPT], cache=cache, use_cache=True).logits[0, -1]]
        got += [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1] for t in range(PROMPT, STEPS + 1)]
    assert cache.layers[0].held(0, 0).tolist() == list(range(STEPS + 1)) and cache.layers[0].store.span(0).stop > PROMPT + 1
    # two passes that add their sums in different orders: within the first-order rounding bound of tests/tolerance.py
    torch.testing.assert_close(torch.stack(got), full[PROMPT - 1 :], rtol=0,
                               atol=forward_pass(model.config, STEPS + 1, float(full.abs().max())))


@pytest.mark.parametrize("name", READERS)
def test_a_policy_that_reads_vectors_keeps_what_the_simulator_keeps(recorded, name, monkeypatch):
    """The prompt attended in full (``prefill="fast"``: every layer's policy is stepped through the full-cache
    rows, the open loop) with each position's key, value, queries and output norms handed over as the model
    computed them: every (layer, KV head) holds what a replay of its recorded trace holds after the last step."""
    monkeypatch.setitem(POLICIES, KeyValueNorm.name, KeyValueNorm)
    _same_kept(recorded, name, policy_args(name, BUDGET))  # vatp's recent_window 32 at budget 10 becomes 5


def _same_kept(recorded, name: str, params: dict, **kw) -> None:
    import kvsim.hf as hf

    model, ids, traces = recorded
    cache = hf.cache(model, name, BUDGET, prefill="fast", **params)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True, **kw)
    for (layer, head), trace in traces.items():
        row = replay(trace, name, budget=BUDGET, record_kept=True, reference=True, **params).kept_history[-1]
        assert cache.layers[layer].held(0, head).tolist() == row[row >= 0].tolist(), (name, layer, head)


EXPECTED = {"query_window": 6, "future_positions": 20, "sinks": 2}


@pytest.mark.parametrize("refresh", [1, 4])
def test_expected_attention_keeps_what_the_simulator_keeps_on_a_llama(recorded_llama, refresh):
    """Llama's default RoPE (base 10,000, every dimension rotated, ``rotate_half``): the deployed cache reads it from
    the model with the recorder's ``rope_meta``, and every (layer, KV head) holds the replay's kept set; the
    recording's meta and the deployed layer's are the same fields."""
    import kvsim.hf as hf

    model, _, traces = recorded_llama
    metas = hf.layer_metas(model, ["expected_attention"])
    for (layer, _), trace in traces.items():
        assert {k: trace.meta[k] for k in metas[layer]} == metas[layer] and metas[layer]["rope_layout"] == "rotate_half"
    _same_kept(recorded_llama, "expected_attention", {**EXPECTED, "refresh": refresh})


def test_expected_attention_reads_each_gemma_3_layers_own_rope(recorded):
    """Gemma 3's sliding layers turn by base 10,000 and its global one by 1,000,000: each deployed layer's policy
    holds its own layer's frequencies (those of the recording), and keeps the replay's positions (the other
    parametrisation of the open-loop test runs at the policy's defaults fitted to the budget)."""
    import kvsim.hf as hf

    model, ids, traces = recorded
    metas = hf.layer_metas(model, ["expected_attention"])
    assert [m["rope_theta"] for m in metas] == [1e4, 1e6, 1e4]
    cache = hf.cache(model, "expected_attention", BUDGET, prefill="fast", **EXPECTED)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    for (layer, head), trace in traces.items():
        rope = cache.layers[layer].policies[0][head].rope(8)
        assert rope.inv_freq.tolist() == trace.meta["rope_inv_freq"], (layer, head)
        row = replay(trace, "expected_attention", budget=BUDGET, record_kept=True, reference=True, **EXPECTED).kept_history[-1]
        assert cache.layers[layer].held(0, head).tolist() == row[row >= 0].tolist(), (layer, head)


def test_expected_attention_refuses_a_rope_it_cannot_turn_back_before_any_token(recorded, monkeypatch):
    """A model whose rotary layout is not ``rotate_half`` is refused by ``kvsim.hf.cache`` in one line naming the
    policy, the model and the layer, before any token (the replay refuses such a trace's meta the same way)."""
    import kvsim.hf as hf
    import kvsim.policykit.rope as rope

    model, _, _ = recorded
    monkeypatch.setattr(rope, "rope_layout", lambda lm: "interleaved")
    with pytest.raises(hf.HFError) as e:
        hf.cache(model, "expected_attention", BUDGET)
    assert str(e.value).startswith("expected_attention cannot run on Gemma3ForCausalLM: layer 0: meta 'rope_layout' "
                                   "'interleaved'") and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("name", [KeyValueNorm.name, "vatp", "critical"])
def test_exact_prefill_hands_the_same_vectors(recorded, name, monkeypatch):
    """Token by token (``prefill="exact"``), layer 0's inputs are the recording's whatever is evicted, so its
    policy keeps what the replay keeps after every step: the test-only one (keys and values), and the two that
    read output norms, which the exact prefill computes for the whole prompt in one product."""
    import kvsim.hf as hf

    monkeypatch.setitem(POLICIES, KeyValueNorm.name, KeyValueNorm)
    model, ids, traces = recorded
    params = policy_args(name, BUDGET)
    cache = hf.cache(model, name, BUDGET, **params)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    for head in range(2):
        row = replay(traces[(0, head)], name, budget=BUDGET, record_kept=True, **params).kept_history[-1]
        assert cache.layers[0].held(0, head).tolist() == row[row >= 0].tolist(), (name, head)


@pytest.mark.record
def test_gemma_3_270m_compresses_a_short_prompt_as_the_simulator_does():
    """The shipped model, the first 97 tokens of heapq.py captured as the query/key recorder captures them (every
    layer, float32), 96 of them the prompt, SnapKV at its defaults keeping half: each of the 18 layers holds the
    simulator's choice on its own layer's trace."""
    import kvsim.hf as hf
    from kvsim.data.qk import from_qk
    from kvsim.models.loading import load_model, token_ids
    from kvsim.models.qkv_capture import capture_qkv
    from kvsim.models.texts import heapq_path

    model, tokenizer = load_model(progress=None)
    ids = token_ids(tokenizer, heapq_path().read_text())[:, :97]
    traces = {}

    def sink(got):
        for h in range(got.key.shape[0]):
            q = got.query[h * got.group : (h + 1) * got.group].detach().numpy()
            traces[(got.layer, h)] = from_qk(q, got.key[h].detach().numpy(), got.value[h].detach().numpy(),
                                             scale=got.scale, softcap=got.softcap, sliding_window=got.sliding_window)

    with torch.no_grad():
        capture_qkv(model, ids, list(range(model.config.num_hidden_layers)), sink)
    cache = hf.cache(model, "none", None, prefill="compress", prefill_budget=0.5)
    with torch.no_grad():
        model(ids[:, :96], cache=cache, use_cache=True, logits_to_keep=1)
    assert len(traces) == 18
    for (layer, head), trace in traces.items():
        want = choose_on(trace, Prefill.of(trace, 0.5, prompt=96)).tolist()
        assert cache.layers[layer].held(0, head).tolist() == want, layer


@pytest.mark.record
def test_gemma_3_270m_expected_attention_keeps_what_the_simulator_keeps():
    """The shipped model over the first 97 tokens of heapq.py, captured as the query/key recorder captures them
    (every layer, float32), each layer's trace given the meta the recorder writes (``rope_meta``: its sliding
    layers' base 10,000, its global ones' 1,000,000); expected_attention at budget 32 deployed open-loop
    (``prefill="fast"``): each of the 18 layers holds what the replay of its own trace holds."""
    import kvsim.hf as hf
    from kvsim.data.qk import from_qk
    from kvsim.models.layer_vectors import rope_meta
    from kvsim.models.loading import load_model, token_ids
    from kvsim.models.qkv_capture import capture_qkv
    from kvsim.models.texts import heapq_path

    model, tokenizer = load_model(progress=None)
    ids = token_ids(tokenizer, heapq_path().read_text())[:, :97]
    traces = {}

    def sink(got):
        meta = rope_meta(model, got.layer, got.key.shape[-1])
        for h in range(got.key.shape[0]):
            q = got.query[h * got.group : (h + 1) * got.group].detach().numpy()
            traces[(got.layer, h)] = from_qk(q, got.key[h].detach().numpy(), got.value[h].detach().numpy(),
                                             scale=got.scale, softcap=got.softcap, sliding_window=got.sliding_window,
                                             meta=meta)

    with torch.no_grad():
        capture_qkv(model, ids, list(range(model.config.num_hidden_layers)), sink)
    params = {"query_window": 16, "future_positions": 512, "sinks": 4}
    cache = hf.cache(model, "expected_attention", 32, prefill="fast", **params)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    assert len(traces) == 18 and {t.meta["rope_theta"] for t in traces.values()} == {1e4, 1e6}
    for (layer, head), trace in traces.items():
        row = replay(trace, "expected_attention", budget=32, record_kept=True, reference=True, **params).kept_history[-1]
        assert cache.layers[layer].held(0, head).tolist() == row[row >= 0].tolist(), layer

"""KVzip's context reconstruction as a prompt scorer (``prefill_policy="reconstruction"``, kvsim.hf.reconstruction,
kvsim.policies.reconstruction): its scores are the attention the model's repeat of the context draws, computed here a
second way (transformers' own eager attention weights over the whole sequence, renormalised over what a chunk's score
sees); the deployed cache keeps, per (layer, KV head), the top of those scores under the shared rules (the one
``choose``, ties to the newer position); a question fed as a second call after the compressed context and a step of
decoding run on the kept set; and a trace, a decode-time list or a cache without the scores refuses it in one line.
A tiny Gemma 3 built from a config (sliding, global, sliding layers; 4 query heads over 2 KV heads)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim import cli
from kvsim.policies import POLICIES, Policy, register, register_scorer
from kvsim.policies.reconstruction import Reconstruction
from kvsim.policykit import registry
from kvsim.sim.prefill import Prefill, PrefillError, choose, choose_on

N, KEEP, WINDOW = 40, 8, 16
REPEAT = ([5, 6, 7], [8, 9])  # the repeat prompts' ids, the first chunk's and the later ones'


def test_the_registry_declares_it_a_scorer_that_needs_the_model():
    caps = registry.capabilities("reconstruction")
    assert caps.needs_model and registry.needs_model("reconstruction") and not registry.needs_model("snapkv")
    assert "reconstruction" not in POLICIES and "reconstruction" in registry.model_scorers()
    assert registry.policy_class("reconstruction") is Reconstruction
    assert "reconstruction" not in registry.online() and "reconstruction" not in registry.compared()
    with pytest.raises(ValueError, match="register it with register_scorer") as e:
        register(type("NeedsModel", (Reconstruction,), {"name": "needs_model_test"}))
    assert "\n" not in str(e.value) and "needs_model_test" not in POLICIES
    with pytest.raises(ValueError, match="does not declare needs_model"):
        register_scorer(type("Plain", (Policy,), {"name": "plain_scorer_test"}))


def _scores(n: int, seed: int, ties: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    s = rng.random(n).astype(np.float32)
    if ties:
        s = np.round(s * 4) / 4  # five values: many ties
    return s


def _top(scores: np.ndarray, keep: int) -> np.ndarray:
    """The ``keep`` highest scores, equal scores keeping the newer (higher) position: written out by sorting."""
    order = sorted(range(scores.size), key=lambda p: (-float(scores[p]), -p))
    return np.sort(np.asarray(order[:keep], dtype=np.int64))


@pytest.mark.parametrize("ties", [False, True])
def test_the_one_time_choice_is_the_top_of_the_scores_under_the_shared_rules(ties):
    for seed in range(5):
        s = _scores(N, seed, ties)
        kept = choose(Prefill.of(N, KEEP, "reconstruction"), lambda t, held: None, lambda p, s=s: {"reconstruction": s[p]})
        np.testing.assert_array_equal(kept, _top(s, KEEP))


def test_a_trace_has_no_model_for_it():
    from random_traces import random_trace

    trace = random_trace(60, 3, name="t")
    with pytest.raises(PrefillError, match="needs_model") as e:
        Prefill.of(trace, 8, "reconstruction", prompt=40)
    assert e.value.field == "prefill_policy" and "\n" not in str(e.value)
    with pytest.raises(PrefillError, match="a trace holds no model"):
        choose_on(trace, Prefill.of(40, 8, "reconstruction"))


@pytest.mark.parametrize("command", [["replay", "--policy", "none"], ["sweep", "--policy", "none"]])
def test_the_simulator_refuses_it_in_one_line_before_the_trace_loads(command, tmp_path, capsys):
    code = cli.main([*command, "--prefill-budget", "8", "--prompt-length", "40", "--prefill-policy", "reconstruction",
                     "--trace", str(tmp_path / "absent.npz")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("kvsim: error: --prefill-policy: reconstruction scores the prompt by a pass of the model")


def test_a_plan_holds_it_as_the_compression_only_and_a_replay_of_the_plan_refuses_it(tmp_path, capsys):
    import json

    from kvsim.policykit.plan import Plan, PlanError

    doc = {"kvsim_plan": 1, "policy": "none",
           "compression": {"keep": 8, "policy": "reconstruction", "params": {}, "prompt_length": 40}}
    assert Plan.from_dict(doc, "p").compression.policy == "reconstruction"
    with pytest.raises(PlanError, match="'reconstruction' is not a registered policy"):
        Plan.from_dict({"kvsim_plan": 1, "policy": "reconstruction", "budget": 8}, "p")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    from random_traces import random_trace

    from kvsim.data.trace import save_npz

    save_npz(random_trace(60, 3, name="t"), tmp_path / "t.npz")
    code = cli.main(["replay", "--plan", str(path), "--trace", str(tmp_path / "t.npz")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "a trace holds no model" in err, err


torch = pytest.importorskip("torch", reason="the model extra is not installed")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import tiny_models  # noqa: E402  (tests/, beside this file)


@pytest.fixture(scope="module")
def tiny():
    """(model, context ids (1, N), question ids (1, 6)) of a tiny Gemma 3 with a sliding window of WINDOW."""
    from transformers import AutoModelForCausalLM

    tok, vocab = tiny_models.tokenizer(tiny_models.TEXT, 300)
    cfg = tiny_models.config("gemma3", vocab, hidden=32, intermediate=64, max_positions=512, head_dim=8, window=WINDOW)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = tok.encode(tiny_models.TEXT)
    return model, torch.tensor([ids[:N]]), torch.tensor([ids[N + 3 : N + 9]])


def _reference(model, ids, chunk: int) -> np.ndarray:
    """The scores from transformers' eager weights: per chunk, the context, the chunk's repeat prompt and the chunk
    as one sequence, each repeat query's weights renormalised over the chunk and the repeat (its score's softmax),
    the most over the group's query heads and the repeat's queries."""
    n = ids.shape[1]
    out = np.zeros((3, 1, 2, n), dtype=np.float64)
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        head = REPEAT[0] if lo == 0 else REPEAT[1] + ids[0, max(lo - 8, 0) : lo].tolist()
        seq = torch.cat([ids, torch.tensor([head]), ids[:, lo:hi]], dim=1)
        with torch.no_grad():
            attentions = model(seq, output_attentions=True).attentions
        for layer, a in enumerate(attentions):
            w = a[0, :, n:, :].double().numpy()  # (4 heads, repeat queries, keys)
            seen = np.r_[lo:hi, n : seq.shape[1]]
            w = w / w[:, :, seen].sum(axis=-1, keepdims=True)
            out[layer, 0, :, lo:hi] = w[:, :, lo:hi].reshape(2, 2, -1, hi - lo).max(axis=(1, 2))
    return out


@pytest.mark.parametrize("chunk", [N, 16])
def test_scores_are_the_attention_the_repeat_draws(tiny, chunk):
    from kvsim.hf import reconstruction_scores

    model, ids, _ = tiny
    scores = reconstruction_scores(model, ids, REPEAT, chunk=chunk)
    assert scores.shape == (3, 1, 2, N) and scores.dtype == np.float32
    np.testing.assert_allclose(scores, _reference(model, ids, chunk), rtol=1e-5, atol=1e-7)
    assert (scores[1] > 0).all()  # the global layer: every position drew some attention
    if chunk == N:  # a sliding layer's window hides the oldest positions from every repeat query
        assert (scores[0, :, :, : N - WINDOW] == 0).all() and (scores[0, :, :, N - WINDOW + 3 :] > 0).all()


def test_the_cache_keeps_the_top_scores_then_takes_a_question_as_a_second_call(tiny):
    import kvsim.hf as hf
    from kvsim.hf import reconstruction_scores

    model, ids, question = tiny
    scores = reconstruction_scores(model, ids, REPEAT)
    cache = hf.cache(model, "none", prefill="compress", prefill_budget=KEEP, prefill_policy="reconstruction",
                     prefill_scores=scores)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        for x, layer in enumerate(cache.layers):
            for h in range(2):
                np.testing.assert_array_equal(layer.held(0, h), _top(scores[x, 0, h], KEEP))
        out = model(question, cache=cache, use_cache=True)  # the question: a second forward call
        step = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    assert torch.isfinite(step.logits).all()
    q = question.shape[1]
    for x, layer in enumerate(cache.layers):
        held = layer.held(0, 0)
        np.testing.assert_array_equal(held, np.r_[_top(scores[x, 0, 0], KEEP), N : N + q + 1])


def test_decoding_prefill_computes_the_scores_from_the_prompt_it_feeds(tiny):
    import kvsim.hf as hf
    from kvsim.hf import reconstruction, reconstruction_scores

    model, ids, _ = tiny
    cache = hf.cache(model, "none", prefill="compress", prefill_budget=KEEP, prefill_policy="reconstruction")
    assert len(reconstruction.wanting(cache)) == 3
    reconstruction.supply(model, ids, cache, REPEAT)
    assert not reconstruction.wanting(cache)
    np.testing.assert_array_equal(np.stack([layer.prefill_scores for layer in cache.layers]),
                                  reconstruction_scores(model, ids, REPEAT))


def test_a_cache_without_the_scores_or_with_a_wrong_combination_is_refused_in_one_line(tiny):
    import kvsim.hf as hf
    from kvsim.hf import HFError

    model, ids, _ = tiny
    cache = hf.cache(model, "none", prefill="compress", prefill_budget=KEEP, prefill_policy="reconstruction")
    with pytest.raises(HFError, match="prefill_scores") as e, torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    assert "\n" not in str(e.value)
    bad = [dict(policy="reconstruction", budget=KEEP),  # a decode-time policy it is not
           dict(policy="none", prefill="compress", prefill_budget=KEEP, prefill_scores=np.zeros((3, 1, 2, N))),  # snapkv's
           dict(policy="none", prefill="compress", prefill_budget=KEEP, prefill_policy="reconstruction",
                prefill_scores=np.zeros((2, 1, 2, N)))]  # another model's layers
    for kwargs in bad:
        with pytest.raises(HFError) as e:
            hf.cache(model, kwargs.pop("policy"), kwargs.pop("budget", None), **kwargs)
        assert "\n" not in str(e.value)
    cache = hf.cache(model, "none", prefill="compress", prefill_budget=KEEP, prefill_policy="reconstruction",
                     prefill_scores=np.zeros((3, 1, 2, N - 1)))  # another prompt's length
    with pytest.raises(HFError, match=r"prefill_scores have shape \(1, 2, 39\)"), torch.no_grad():
        model(ids, cache=cache, use_cache=True)


@pytest.mark.record
def test_gemma_3_270m_runs_it_as_needle_does_keeping_the_top_of_its_scores():
    """The shipped model, a 160-token pass-key prompt, ``run_trial`` with a compressed prompt (what ``kvsim needle
    --prefill-budget 32 --prefill-policy reconstruction`` runs): the scores come from the prompt ``kvsim.hf.decoding``
    feeds, the repeat prompt in the tokenizer saved beside the model, and every (layer, KV head) holds, right
    after the prompt, the top 32 of ``reconstruction_scores`` of that prompt."""
    from kvsim.hf import reconstruction
    from kvsim.models import needle_prompt
    from kvsim.models.loading import load_model
    from kvsim.models.needle_runs import run_trial

    model, tokenizer = load_model(progress=None)
    assert reconstruction.model_repeat_ids(model) == reconstruction.repeat_ids(tokenizer)
    prompt = needle_prompt.Builder(tokenizer, needle_prompt.Template()).prompt(160, 0.5, "12345")
    run = run_trial(model, prompt, "none", None, new_tokens=2, prefill={"budget": 32, "policy": "reconstruction"})
    scores = reconstruction.reconstruction_scores(model, torch.tensor([prompt.ids]), tokenizer)
    left = np.asarray(run["left"])  # the cache grows after the prompt: a kept prompt position is held to the end
    assert scores.shape == (18, 1, 1, 160) and left.shape[:2] == (18, 1)
    for layer in range(18):
        np.testing.assert_array_equal(np.flatnonzero(left[layer, 0, :160] == -1), _top(scores[layer, 0, 0], 32))

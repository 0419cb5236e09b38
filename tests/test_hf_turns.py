"""kvsim.hf's cache across calls, as a conversation uses it (docs/domain.md, "A conversation"): the context, then a
question, the model's answer decoded, the next question, and so on, each a call of the model on one cache. The
cache steps each layer's policy position by position, so where the calls are cut cannot change what it holds: at a
small budget the held sets equal one call over the same tokens, and at a budget past the run every token decoded
equals the full cache's (transformers' own). Tiny config-built models, nothing downloaded."""

from __future__ import annotations

import importlib.util

import pytest
from tolerance import forward_pass

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

CONTEXT, QUESTION, ANSWER, TURNS = 40, 6, 5, 2


def _tiny():
    """Gemma 3: sliding, global, sliding, global layers; 4 query heads over 2 KV heads; random weights."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=24,
                              query_pre_attn_scalar=8, max_position_embeddings=512, bos_token_id=1, pad_token_id=0,
                              eos_token_id=None, layer_types=["sliding_attention", "full_attention"] * 2)
    model = tf.Gemma3ForCausalLM(cfg)
    model.set_attn_implementation("eager")
    return model.eval()


def _pieces():
    """The context (``<bos>`` first) and each turn's question, random ids."""
    import torch

    g = torch.Generator().manual_seed(2)
    context = torch.randint(3, 64, (1, CONTEXT), generator=g)
    context[0, 0] = 1
    return context, [torch.randint(3, 64, (1, QUESTION), generator=g) for _ in range(TURNS)]


def _conversation(model, cache):
    """The calls a conversation makes: the context; then per turn the question (after the previous answer's last
    token, which decoding never fed), and ``ANSWER`` greedy tokens one call each. The tokens fed, in order, the
    answers, and the last call's logits."""
    import torch

    context, questions = _pieces()
    fed, answers = [context], []
    with torch.no_grad():
        model(context, cache=cache, use_cache=True)
        pending = None
        for q in questions:
            step = q if pending is None else torch.cat([pending, q], dim=1)
            out = model(step, cache=cache, use_cache=True)
            fed.append(step)
            answer = []
            for k in range(ANSWER):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                answer.append(int(nxt))
                if k < ANSWER - 1:
                    out = model(nxt, cache=cache, use_cache=True)
                    fed.append(nxt)
            pending = nxt
            answers.append(answer)
    return torch.cat(fed, dim=1), answers, out.logits[0, -1]


@pytest.mark.parametrize("tensor", [False, True], ids=["reference", "tensor"])
def test_one_cache_across_a_conversations_calls_holds_what_one_call_over_its_tokens_holds(tensor):
    """h2o (it reads attention) at budget 16: the held sets after the conversation's calls equal those of one call
    over the same tokens (exact prefill), in every layer and KV head, and the last logits agree within two passes'
    rounding; what it holds is not merely the newest positions."""
    import torch

    import kvsim.hf as hf

    model = _tiny()
    turns = hf.cache(model, "h2o", 16, recent_window=4, tensor=tensor)
    stream, _, last = _conversation(model, turns)
    whole = hf.cache(model, "h2o", 16, recent_window=4, tensor=tensor)
    with torch.no_grad():
        again = model(stream, cache=whole, use_cache=True).logits[0, -1]
    n = stream.shape[1]
    assert turns.get_seq_length() == whole.get_seq_length() == n
    for la, lb in zip(turns.layers, whole.layers, strict=True):
        for h in range(2):
            assert la.held(0, h).tolist() == lb.held(0, h).tolist()
            assert la.held(0, h).size == 16 and la.held(0, h)[-1] == n - 1
    assert any(la.held(0, 0).tolist() != list(range(n - 16, n)) for la in turns.layers)
    torch.testing.assert_close(last, again, rtol=0, atol=forward_pass(model.config, 16 + 1, float(last.abs().max())))


def test_a_budget_past_the_conversation_answers_every_turn_as_the_full_cache_does():
    """At a budget past the whole run nothing is evicted: every answer token decoded on the evicting cache across
    the calls equals transformers' own cache's, turn by turn (the default path: the tensor one)."""
    from transformers import DynamicCache

    import kvsim.hf as hf

    model = _tiny()
    total = CONTEXT + TURNS * (QUESTION + ANSWER)
    _, answers, _ = _conversation(model, hf.cache(model, "h2o", total + 8, recent_window=4))
    model.set_attn_implementation("eager")
    _, full, _ = _conversation(model, DynamicCache())
    assert answers == full and len(answers) == TURNS and all(len(a) == ANSWER for a in answers)

"""Tiny Hugging Face causal LMs for the recorder: a byte-level BPE tokenizer trained on a given text
and model configs of three families (random weights once built, grouped-query attention, sliding-window
layers), so nothing is downloaded. Used by the recorder's tests and by ``kvsim/bench/scripts/cuda_record_check.py``,
each at its own sizes. Needs the recorder's extra (transformers, tokenizers)."""

from __future__ import annotations

#: a few hundred tokens of plain words, what the recorder tests record
WORDS = ("the a cache that holds every token grows without bound so serving stack keeps only some of them "
         "which ones first few tokens soak up attention last carry local context handful in between matter").split()
TEXT = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(120))


def tokenizer(text: str, vocab_size: int):
    """``(tokenizer, vocabulary size)``: a byte-level BPE trained on ``text`` (no download). Byte-level,
    because transformers loads a Qwen2 folder's tokenizer through its own byte-level class whatever the
    file says."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    return fast, tok.get_vocab_size()


def config(family: str, vocab: int, *, hidden: int, intermediate: int, max_positions: int, head_dim: int, window: int):
    """The config of a tiny ``family`` model ("llama", "qwen2", "gemma3" or "gemma2"): 4 query heads over
    2 KV heads. Llama has 2 global layers; Qwen2 3 layers, the last two sliding (``window``); Gemma 3 3 layers,
    sliding, global, sliding; Gemma 2 2 layers, sliding then global, its attention logits soft-capped at 0.5
    (tight, so that the cap changes the weights of a tiny random model)."""
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    if family == "llama":
        return LlamaConfig(num_hidden_layers=2, **common)
    if family == "qwen2":  # layers from max_window_layers on use the sliding window
        return Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=window, max_window_layers=1,
                           **common)
    if family == "gemma3":
        return Gemma3TextConfig(num_hidden_layers=3, head_dim=head_dim, sliding_window=window,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"], **common)
    if family == "gemma2":
        return Gemma2Config(num_hidden_layers=2, head_dim=head_dim, sliding_window=window, attn_logit_softcapping=0.5,
                            layer_types=["sliding_attention", "full_attention"], **common)
    raise ValueError(f"no tiny config for the family {family!r}")


#: the characters of ``char_gemma3``'s tokenizer: what a pass-key prompt is written in
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .?,"


def char_gemma3(path):
    """A tiny Gemma 3 (sliding, global, sliding; 4 query heads over 2 KV heads; context 512; random weights,
    seed 0) saved at ``path`` with a tokenizer of one token per character (``CHARS``): what ``kvsim needle``
    and ``kvsim quality`` take as ``--model PATH``."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    vocab = {"<pad>": 0, "<bos>": 1, "<unk>": 2, "<eos>": 3, **{c: 4 + i for i, c in enumerate(CHARS)}}
    cfg = tf.Gemma3TextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                              sliding_window=24, query_pre_attn_scalar=8, bos_token_id=1, eos_token_id=3, pad_token_id=0,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    tf.Gemma3ForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    return path

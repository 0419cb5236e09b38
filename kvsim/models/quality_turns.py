"""``kvsim quality --conversation FILE``: what a conversation loses, turn by turn, on one evicting cache.

The conversation's tokens (``kvsim.models.conversation_tokens``: the context, then question 1, answer 1,
question 2, answer 2, ...) are one stream, teacher-forced with the file's reference answers, and the
cache keeps evicting all the way along it, exactly as ``kvsim quality`` runs a text
(``kvsim.models.quality``: ``closed``, token by token through the evicting cache, the truth; ``open``,
one pass masked by the replay of the full-cache traces). What changes is what is reported: the delta
NLL and KL against the full cache on each turn's answer tokens (the tokens that answer, predicted by
the positions before them), beside the mean over every answer token, and the retained mass over the
whole stream. A later turn's figure is what the eviction made while the earlier turns were asked.

Results are cached on disk like quality's (``<cache>/quality/<digest>.json``), keyed by the model,
the conversation's token ids and turn boundaries, the policy, its parameters, the budget and the mode.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..progress import Progress
from .conversation import Conversation, load_conversation
from .conversation_tokens import ConversationTokens, model_context, tokenize_conversation
from .errors import QualityError
from .loading import no_progress
from .quality import (
    KEY_ALPHA,
    KEY_BETA,
    QUALITY_STDERR,
    SHORT_WINDOW,
    Configuration,
    Session,
    load,
)
from .scoring import full_pass_key, read_full_pass, write_full_pass

#: what a cached per-turn result means; bump it when its figures change meaning
VERSION = 1


class ConversationSession(Session):
    """A :class:`~kvsim.models.quality.Session` over a conversation's tokens rather than a text file:
    the same full-cache pass and the same two modes, with the results split per turn."""

    def __init__(self, model, tokens: ConversationTokens, conversation: Conversation, *, model_id: str = "model",
                 progress: Progress | None = QUALITY_STDERR, use_cache: bool = True):
        import torch

        self.say = progress or no_progress
        self.short_window, self.key_alpha, self.key_beta = SHORT_WINDOW, KEY_ALPHA, KEY_BETA
        self._nll_short = None
        self.fanout = None
        self.short_seconds = 0.0
        self.model, self.model_id = model, model_id
        self.conversation, self.tokens = conversation, tokens
        self.text_path = Path(conversation.source)
        cfg = model.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.use_cache = use_cache = use_cache and model_id != "model"
        self.ids = torch.tensor([list(tokens.ids)], dtype=torch.long)
        self.n = self.ids.shape[1]
        self.steps_asked = self.steps = self.n - 1
        key = full_pass_key(model_id, f"conversation {tokens.digest}".encode(), self.steps)
        cached = read_full_pass(key) if use_cache else None
        if cached is None or tuple(int(x) for x in cached.ids) != tokens.ids:
            cached = self._full_pass()
            if use_cache:
                write_full_pass(key, cached)
        else:
            self.full_seconds = 0.0
            self.say(None, f"full-cache pass over {self.n} tokens read from the cache")
        self._adopt(cached)
        self.tokens_id = tokens.digest

    def cache_key(self, c: Configuration, mode: str) -> dict:
        return {"version": VERSION, "model": self.model_id, "tokens": self.tokens_id, "policy": c.policy,
                "budget": c.budget, "mode": mode, "params": dict(sorted(c.params.items()))}

    def _result(self, policy, budget, params, mode, mass, nll, kl, seconds, batch) -> dict:
        """One measurement's document: per turn, the answer tokens' NLL, delta NLL and KL; and over all of them."""
        full = self.nll_full_series
        # series index i is position i + 1 predicting token i + 2: a token at position p is index p - 2
        spans = [np.arange(t.answer_start - 2, t.end - 2) for t in self.tokens.turns]
        turns = []
        for i, (t, at) in enumerate(zip(self.tokens.turns, spans, strict=True), 1):
            turns.append({"turn": i, "question_tokens": t.answer_start - t.question_start,
                          "answer_tokens": t.end - t.answer_start, "nll_full": float(full[at].mean()),
                          "nll": float(nll[at].mean()), "delta_nll": float((nll[at] - full[at]).mean()),
                          "kl": float(kl[at].mean())})
        every = np.concatenate(spans)
        mean_nll = float(nll[every].mean())
        nll_full = float(full[every].mean())
        return {
            "policy": policy, "budget": budget, "params": params, "mode": mode,
            "conversation": self.text_path.name, "tokens": self.n, "context_tokens": self.tokens.context_end,
            "nll_full": nll_full, "nll": mean_nll, "delta_nll": mean_nll - nll_full,
            "ppl_full": math.exp(nll_full), "ppl": math.exp(mean_nll), "kl": float(kl[every].mean()),
            "retained_mass": float(mass.mean()), "retained_mass_by_layer": mass.mean(axis=1).tolist(),
            "turns": turns, "seconds": seconds, "batch": batch, "model": self.model_id,
        }


def open_conversation(path: str | Path, model: str | Path | None = None, progress: Progress | None = QUALITY_STDERR,
                      model_and_tokenizer=None, use_cache: bool = True) -> ConversationSession:
    """Read the conversation (every turn with its answer: ConversationError otherwise, before any model
    loads), load the model (or reuse ``(model, tokenizer, model_id)``), tokenize and check the lengths
    against the model's context, then run (or read) the full-cache pass."""
    conv = load_conversation(path, needs_answers=True)
    m, tok, model_id = model_and_tokenizer or load(model, progress)
    tokens = tokenize_conversation(tok, conv, model_context(m))
    if len(tokens.ids) < 3:
        raise QualityError(f"{conv.source}: {len(tokens.ids)} tokens; the loss needs at least 3")
    return ConversationSession(m, tokens, conv, model_id=model_id, progress=progress, use_cache=use_cache)


__all__ = ["VERSION", "ConversationSession", "open_conversation"]

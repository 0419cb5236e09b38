"""``kvsim quality --conversation FILE``: what a conversation loses, turn by turn, on one evicting cache.

The conversation's tokens (``kvsim.models.conversation_tokens``: the context, then question 1, answer 1,
question 2, answer 2, ...) are one stream, teacher-forced with the file's reference answers, and the
cache keeps evicting all the way along it, exactly as ``kvsim quality`` runs a text
(``kvsim.models.quality``: ``closed``, token by token through the evicting cache, the truth; ``open``,
one pass masked by the replay of the full-cache traces). What changes is what is reported: the delta
NLL and KL against the full cache on each turn's answer tokens (the tokens that answer, predicted by
the positions before them), beside the mean over every answer token, and the retained mass over the
whole stream. A later turn's figure is what the eviction made while the earlier turns were asked.

**A compressed prompt** (``--prefill-budget``, ``--prefill-policy``, ``--query``; ``Compression``): the
context compressed once, at its end, to the prefill budget by a prompt scorer, with the first question in the
scorer's observation window (``query="aware"``) or without it, the question fed after the compression
(``"agnostic"``), then the policy at its budget from the kept set. The cache is ``kvsim.hf.cache(...,
prefill="compress")`` as the needle's conversations build it (``needle_runs._cache_how``), and the prompt is
fed by the needle's own ``kvsim.hf.conversation.converse`` (its first turn, one token written and not fed),
so the two query modes are the needle's. Then every later token of the stream (turn 1's reference answer, each
later question and answer) is teacher-forced one position at a time through that cache, which keeps evicting;
each position's final hidden state is scored by the session's output layer against the full-cache pass, as the
closed loop's are. Only the closed loop: the open loop replays a policy over the full cache's traces
(``kvsim.replay``), which holds no step where a scorer compresses the prompt, so it is refused (``OPEN_REFUSED``).
The retained mass is the full cache's attention on what the run held, from its departures
(``needle_conversation.retained_mass``), over every step and over the steps after the first question (``retained_mass_after_prompt``).

Results are cached on disk like quality's (``<cache>/quality/<digest>.json``), keyed by the model,
the conversation's token ids and turn boundaries, the policy, its parameters, the budget and the mode,
and a compressed prompt's budget, scorer with its parameters and query mode.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
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
#: what a compressed prompt is chosen with (``kvsim.hf.conversation.QUERY``; the first: the default)
QUERY = ("aware", "agnostic")
#: why a compressed prompt has no open loop
OPEN_REFUSED = ("--mode open and --prefill-budget: the open loop replays a policy over the full cache's traces "
                "(kvsim.replay), which holds no step where a scorer compresses the prompt; measure it --mode closed")


#: a PrefillError's field as the flag that sets it here
_FLAGS = {"prefill_budget": "--prefill-budget", "prefill_policy": "--prefill-policy", "prompt_length": "--conversation"}


@dataclass(frozen=True)
class Compression:
    """A prompt compressed once at its end (``kvsim.hf.cache(..., prefill="compress")``): ``budget`` positions
    per KV head (an integer, or a ratio in (0, 1) of the prompt), chosen by ``scorer`` with its sorted ``(name,
    value)`` ``params``, with the first question in the scorer's window (``query`` aware) or not (agnostic)."""

    budget: int | float
    scorer: str = "snapkv"
    params: tuple = ()
    query: str = "aware"

    def to_json(self) -> dict:
        """What keys and labels it: ``needle_runs.Job.how``'s prefill, with the query mode."""
        return {"budget": self.budget, "policy": self.scorer, "params": dict(self.params), "query": self.query}


def check_compression(c: Compression, tokens: ConversationTokens) -> Compression:
    """``c`` against the conversation's prompt (the context, with the first question when query-aware): a budget
    from 1 to below the prompt, a scorer that can rank it, its parameters in bounds; QualityError naming the flag."""
    from ..sim.prefill import Prefill, PrefillError

    if c.query not in QUERY:
        raise QualityError(f"--query: {c.query!r}: one of {', '.join(QUERY)}")
    first = tokens.turns[0]
    prompt = first.answer_start if c.query == "aware" else first.question_start
    try:
        kept = Prefill.of(prompt, c.budget, c.scorer, **dict(c.params)).keep
    except PrefillError as e:
        said = str(e).removeprefix(e.field + ": ")
        raise QualityError(f"{_FLAGS.get(e.field, e.field)}: {said} ({_prompt_said(c.query)})") from None
    if kept >= prompt:
        raise QualityError(f"--prefill-budget: {c.budget}: keeps all of the {prompt}-token prompt ({_prompt_said(c.query)}): "
                           "nothing is compressed")
    return c


def _prompt_said(query: str) -> str:
    return "the context and the first question, query-aware" if query == "aware" else "the context, query-agnostic"


class ConversationSession(Session):
    """A :class:`~kvsim.models.quality.Session` over a conversation's tokens rather than a text file:
    the same full-cache pass and the same two modes, with the results split per turn."""

    def __init__(self, model, tokens: ConversationTokens, conversation: Conversation, *, model_id: str = "model",
                 progress: Progress | None = QUALITY_STDERR, use_cache: bool = True,
                 compression: Compression | None = None):
        import torch

        #: the prompt compressed once (``Compression``, checked before the full pass), or None: every position stepped
        self.compression = None if compression is None else check_compression(compression, tokens)
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
        key = {"version": VERSION, "model": self.model_id, "tokens": self.tokens_id, "policy": c.policy,
               "budget": c.budget, "mode": mode, "params": dict(sorted(c.params.items()))}
        if self.compression is not None:
            key["prefill"] = self.compression.to_json()
        return key

    def compressed(self, compression: Compression | None) -> ConversationSession:
        """This session (its full-cache pass shared) measuring with the prompt compressed as ``compression`` says
        (checked against this conversation's prompt: QualityError), or with every position stepped (None)."""
        other = copy.copy(self)
        other.compression = None if compression is None else check_compression(compression, self.tokens)
        return other

    def evaluate_many(self, configurations, mode: str = "closed", *, progress: Progress | None = None) -> list[dict]:
        """As quality's; with a compressed prompt, each configuration's closed loop from the compressed cache
        (``run_compressed``), one after another, the open loop refused (``OPEN_REFUSED``)."""
        if self.compression is None:
            return super().evaluate_many(configurations, mode, progress=progress)
        if mode != "closed":
            raise QualityError(OPEN_REFUSED)
        out = []
        for c in configurations:
            t0 = time.perf_counter()
            hidden, mass, after, _ = self.run_compressed(c)
            (nll, kl), = self._scorer.score([hidden])
            result = self._result(c.policy, c.budget, c.params, mode, mass, nll, kl, time.perf_counter() - t0, 1)
            out.append({**result, "prefill": self.compression.to_json(), "retained_mass_after_prompt": after})
        return out

    def run_compressed(self, c: Configuration):
        """One closed loop from the compressed prompt: the final hidden states ``(n, width)`` (the full cache's where
        the run computed none: the prompt's positions before its last, which attend in full, and the last token,
        never fed), the retained mass per (layer, KV head) over every step, over the steps after the prompt, and
        every position's departure step per (layer, KV head), -1 for held to the end (``needle_runs._Departures``)."""
        import torch

        import kvsim.hf as hf
        from kvsim.hf.conversation import converse

        from .needle_conversation import retained_mass
        from .needle_runs import _cache_how, _Departures

        if any(isinstance(v, list) for v in c.asked.values()):
            raise QualityError("--prefill-budget: a parameter per layer does not go with a compressed prompt")
        ids, first = list(self.tokens.ids), self.tokens.turns[0]
        cache = hf.cache(self.model, c.policy, c.budget, seed=0, **_cache_how(self.compression.to_json()), **c.asked)
        watch = _Departures(cache, self.n)
        calls = []
        hook = self.model.base_model.register_forward_hook(lambda _m, _a, out: calls.append(out.last_hidden_state[0]))
        hidden = self.hidden_full.clone()
        try:
            with torch.no_grad():
                # the needle's own feed of the context and the first question, aware or agnostic (one token written)
                converse(self.model, cache, ids[: first.question_start], [ids[first.question_start : first.answer_start]],
                         1, query=self.compression.query)
                hidden[first.answer_start - 1] = calls[-1][-1]
                for p in range(first.answer_start, self.n - 1):  # teacher-forced, one position a call
                    self.model(torch.tensor([[ids[p]]]), cache=cache, use_cache=True, logits_to_keep=1)
                    hidden[p] = calls[-1][-1]
        finally:
            hook.remove()
        watch.collect()
        watch.check(self.n - 1)
        left = watch.ended(0, self.n - 1)
        every = {(x, h): self.traces[x][h] for x in range(self.layers) for h in range(self.kv_heads)}
        mass = np.array([[retained_mass({xh: every[xh]}, left) for xh in every if xh[0] == x] for x in range(self.layers)])
        return hidden, mass, retained_mass(every, left, first.answer_start), left

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
                      model_and_tokenizer=None, use_cache: bool = True,
                      compression: Compression | None = None) -> ConversationSession:
    """Read the conversation (every turn with its answer: ConversationError otherwise, before any model
    loads), load the model (or reuse ``(model, tokenizer, model_id)``), tokenize and check the lengths
    against the model's context (and ``compression`` against the prompt), then run (or read) the full-cache pass."""
    conv = load_conversation(path, needs_answers=True)
    m, tok, model_id = model_and_tokenizer or load(model, progress)
    tokens = tokenize_conversation(tok, conv, model_context(m))
    if len(tokens.ids) < 3:
        raise QualityError(f"{conv.source}: {len(tokens.ids)} tokens; the loss needs at least 3")
    return ConversationSession(m, tokens, conv, model_id=model_id, progress=progress, use_cache=use_cache,
                               compression=compression)


__all__ = ["OPEN_REFUSED", "QUERY", "VERSION", "Compression", "ConversationSession", "check_compression",
           "open_conversation"]

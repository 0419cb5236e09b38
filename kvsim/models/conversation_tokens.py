"""A conversation's tokens (docs/domain.md, "A conversation"): the context with ``<bos>`` first, then each
turn's question and answer, tokenized piece by piece so that every boundary is a token position.

A turn is written as plain text a base model continues: the question as ``"\\n\\nQ: " + question + "\\nA:"``,
the answer as ``" " + answer`` (``QUESTION`` and ``ANSWER``). The pieces are tokenized on their own
(no special tokens), so the ids of the context never depend on what a later turn says, and a turn's
answer starts at a known position. :func:`tokenize_conversation` also refuses, one line naming the file
and the turn, a conversation longer than the model's context (``conversation.check_lengths``): the
caller does it after the tokenizer loads and before any pass runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .conversation import Conversation, ConversationError, check_lengths

#: how a turn's question and answer are written around their text
QUESTION = "\n\nQ: {question}\nA:"
ANSWER = " {answer}"


@dataclass(frozen=True)
class TurnSpan:
    """Where one turn lies, in token positions: its question from ``question_start``, its answer from
    ``answer_start`` to ``end`` (exclusive)."""

    question_start: int
    answer_start: int
    end: int

    def to_json(self) -> dict:
        return {"question_start": self.question_start, "answer_start": self.answer_start, "end": self.end}


@dataclass(frozen=True)
class ConversationTokens:
    """The token ids of a teacher-forced conversation (context, question 1, answer 1, ...) and its turns."""

    ids: tuple[int, ...]
    context_end: int
    turns: tuple[TurnSpan, ...]

    @property
    def digest(self) -> str:
        """What keys a measurement of these tokens: the ids and the turn boundaries."""
        h = hashlib.sha256(np.asarray(self.ids, dtype=np.int64).tobytes())
        h.update(repr([t.to_json() for t in self.turns]).encode())
        return h.hexdigest()[:16]


def encode(tokenizer, text: str) -> list[int]:
    """``text``'s token ids, no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def context_ids(tokenizer, context: str) -> list[int]:
    """The context's ids with ``<bos>`` first, where the tokenizer has one."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([bos] if bos is not None else []) + encode(tokenizer, context)


def question_ids(tokenizer, question: str) -> list[int]:
    return encode(tokenizer, QUESTION.format(question=question.strip()))


def answer_ids(tokenizer, answer: str) -> list[int]:
    return encode(tokenizer, ANSWER.format(answer=answer.strip()))


def model_context(model) -> int | None:
    """The model's context in tokens (``max_position_embeddings``), or None when its config does not say."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return getattr(cfg, "max_position_embeddings", None)


def tokenize_conversation(tokenizer, conv: Conversation, limit: int | None = None) -> ConversationTokens:
    """Every turn's question and reference answer after the context (each turn must have its answer),
    checked against ``limit`` tokens (the model's context) when given."""
    head = context_ids(tokenizer, conv.context)
    pieces = []
    for i, t in enumerate(conv.turns, 1):
        if t.answer is None:
            raise ConversationError(f"{conv.source}: turn {i} has no answer, and this measurement teacher-forces one")
        q, a = question_ids(tokenizer, t.question), answer_ids(tokenizer, t.answer)
        if not a:
            raise ConversationError(f"{conv.source}: turn {i}'s answer has no tokens")
        pieces.append((q, a))
    if limit is not None:
        check_lengths(conv, len(head), [len(q) + len(a) for q, a in pieces], limit)
    ids, turns = list(head), []
    for q, a in pieces:
        start = len(ids)
        ids += q
        turns.append(TurnSpan(start, len(ids), len(ids) + len(a)))
        ids += a
    return ConversationTokens(tuple(ids), len(head), tuple(turns))


__all__ = ["ANSWER", "QUESTION", "ConversationTokens", "TurnSpan", "answer_ids", "context_ids", "encode",
           "model_context", "question_ids", "tokenize_conversation"]

"""A conversation: a context, then turns (a question and its answer) on one cache (docs/domain.md, "A conversation").

The file is JSON, UTF-8::

    {"context": "text the cache holds first",
     "turns": [{"question": "What is ...?", "answer": "the reference answer"},
               {"question": "And ...?"}]}

``answer`` may be left out where nothing needs it (``generate`` writes its own); a measurement that
teacher-forces the reference (``quality``) asks for it with ``needs_answers=True``. Every check here runs
on the text alone, before any model loads; the checks that need token counts (a turn longer than the
context left) take them as numbers (:func:`check_lengths`), so the caller tokenizes once and nothing
here imports torch. Each failure is a :class:`ConversationError` with one line naming the file and the
turn (1-based, as a reader counts them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class ConversationError(ValueError):
    """A conversation that cannot run; the message is one line naming the file and, where it is one, the turn."""


@dataclass(frozen=True)
class Turn:
    """One question and, where known, its reference answer."""

    question: str
    answer: str | None = None


@dataclass(frozen=True)
class Conversation:
    """A context and its turns, in order; ``source`` names where it came from in every message."""

    context: str
    turns: tuple[Turn, ...]
    source: str = "conversation"

    def __post_init__(self):
        _check(self, self.source, needs_answers=False)

    def to_json(self) -> dict:
        """The file's form: what :func:`load_conversation` reads back to an equal conversation."""
        return {"context": self.context,
                "turns": [{"question": t.question} | ({} if t.answer is None else {"answer": t.answer})
                          for t in self.turns]}


def _check(conv: Conversation, where: str, needs_answers: bool) -> None:
    if not conv.context.strip():
        raise ConversationError(f"{where}: the context is empty")
    if not conv.turns:
        raise ConversationError(f"{where}: no turns (a conversation asks at least one question)")
    for i, t in enumerate(conv.turns, 1):
        if not t.question.strip():
            raise ConversationError(f"{where}: turn {i} is empty (its question has no text)")
        if t.answer is not None and not t.answer.strip():
            raise ConversationError(f"{where}: turn {i}'s answer is empty (leave 'answer' out instead)")
        if needs_answers and t.answer is None:
            raise ConversationError(f"{where}: turn {i} has no answer, and this measurement teacher-forces one")


def parse_conversation(doc, source: str = "conversation", needs_answers: bool = False) -> Conversation:
    """A conversation from the file's JSON value; every field checked, one line each."""
    if not isinstance(doc, dict):
        raise ConversationError(f"{source}: expected a JSON object with 'context' and 'turns'")
    unknown = sorted(set(doc) - {"context", "turns"})
    if unknown:
        raise ConversationError(f"{source}: unknown field {unknown[0]!r} (a conversation has 'context' and 'turns')")
    context, turns = doc.get("context"), doc.get("turns")
    if not isinstance(context, str):
        raise ConversationError(f"{source}: 'context' must be a string")
    if not isinstance(turns, list):
        raise ConversationError(f"{source}: 'turns' must be a list of {{'question': ..., 'answer': ...}}")
    parsed = []
    for i, t in enumerate(turns, 1):
        if not isinstance(t, dict):
            raise ConversationError(f"{source}: turn {i} must be an object with 'question' (and 'answer')")
        extra = sorted(set(t) - {"question", "answer"})
        if extra:
            raise ConversationError(f"{source}: turn {i} has an unknown field {extra[0]!r}")
        q, a = t.get("question"), t.get("answer")
        if not isinstance(q, str):
            raise ConversationError(f"{source}: turn {i} has no 'question' string")
        if a is not None and not isinstance(a, str):
            raise ConversationError(f"{source}: turn {i}'s 'answer' must be a string")
        parsed.append(Turn(q, a))
    conv = Conversation(context, tuple(parsed), source)
    _check(conv, source, needs_answers)
    return conv


def load_conversation(path, needs_answers: bool = False) -> Conversation:
    """The conversation in ``path`` (JSON, UTF-8), checked; ConversationError, one line, otherwise."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConversationError(f"{p}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConversationError(f"{p}: not UTF-8 (byte {e.start})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConversationError(f"{p}: not JSON (line {e.lineno}: {e.msg})") from None
    return parse_conversation(doc, str(p), needs_answers)


def check_lengths(conv: Conversation, context_tokens: int, turn_tokens: Sequence[int], limit: int) -> None:
    """Refuse a turn that does not fit: ``turn_tokens[i]`` is turn i's question and answer (or tokens to
    write) in tokens; ``limit`` the model's context. Named by the first turn that runs past it."""
    if context_tokens >= limit:
        raise ConversationError(f"{conv.source}: the context is {context_tokens} tokens, the model's context {limit}")
    used = context_tokens
    for i, n in enumerate(turn_tokens, 1):
        if used + n > limit:
            raise ConversationError(f"{conv.source}: turn {i} is {n} tokens, longer than the {limit - used} "
                                    f"the model's context has left after the context and earlier turns")
        used += n

"""The pass-key test's prompts (issue 35, docs/needle.md): the text a prompt is made of (``Template``),
its tokens (``Builder``: ``[start] filler[:a] needle filler[a:] question``, exactly ``length`` tokens, the
needle at the sentence boundary of the filler nearest ``depth`` x the filler's length), the trial's key
(``pass_key``) and what the model gave as the key (``answer``). Running trials and grids over them is
``kvsim.models.needle``'s."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

#: the classic pass-key filler (Mohtashami and Jaggi, "Landmark Attention", 2023), repeated as needed
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
KEY_DIGITS = 5
#: a conversation's needles and questions (``--keys K`` above 1) by the key's number (``{n}``, 1 to K): the
#: first wording, kept for ``--needle``/``--question``; the small shipped models answer key 2's number or its
#: digits for key 1 (docs/needle.md, "A conversation: a pass key per turn")
NEEDLE_NUMBERED = "The pass key number {n} is {key}. Remember it. {key} is the pass key number {n}."
QUESTION_NUMBERED = "What is the pass key number {n}? The pass key number {n} is"
#: ``{name}`` in a conversation's needle or question: key i's owner, a name the built-in filler does not hold
KEY_NAMES = ("Anna", "Boris", "Clara", "David", "Emma", "Felix", "Greta", "Hugo")
#: the conversation's default needle and question: key i named by its owner (``{name}``, ``KEY_NAMES``)
NEEDLE_NAMED = "{name}'s pass key is {key}."
QUESTION_NAMED = "What is {name}'s pass key? {name}'s pass key is"


class NeedleError(ValueError):
    """A needle test that cannot run as asked; ``flag`` names the option at fault (one line)."""

    def __init__(self, message: str, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class Prompt:
    """One trial's prompt: its token ids, the key and where the key's tokens are."""

    ids: tuple[int, ...]
    key: str
    key_positions: tuple[int, ...]  # the positions of the key's digits (both mentions)
    needle_start: int  # the needle's first position
    length: int
    depth: float
    trial: int

    @property
    def digest(self) -> str:
        return hashlib.sha256(np.asarray(self.ids, dtype=np.int64).tobytes()).hexdigest()[:24]


@dataclass(frozen=True)
class Template:
    """The text a prompt is made of, stated in every result: the filler (``FILLER`` repeated, or a text
    file used once, as it is), the needle with its ``{key}`` and the question."""

    filler: str = FILLER
    repeat: bool = True  # repeat the filler as needed; a file's filler is read once and must be long enough
    needle: str = NEEDLE
    question: str = QUESTION
    source: str = "built-in"  # where the filler comes from: built-in or the file's path

    def check(self) -> None:
        if "{key}" not in self.needle:
            raise NeedleError(f"--needle: {self.needle!r}: has no {{key}} to put the pass key in", "--needle")
        if not self.question.strip():
            raise NeedleError("--question: empty", "--question")
        if not self.filler.strip():
            raise NeedleError(f"--filler: {self.source}: empty", "--filler")

    def to_dict(self) -> dict:
        return {"filler_source": self.source, "filler_repeated": self.repeat, "filler_start": self.filler[:120],
                "needle": self.needle, "question": self.question}


class Builder:
    """Prompts of a tokenizer and a template: the filler, needle and question tokenised once each."""

    def __init__(self, tokenizer, template: Template) -> None:
        template.check()
        self.tokenizer = tokenizer
        self.template = template
        self.bos = getattr(tokenizer, "bos_token_id", None)
        self._filler: list[int] = []
        self._ends: list[int] = []
        self.question = self._encode(" " + template.question.strip())[0]
        if not template.repeat:
            self._grow(None)

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def _grow(self, tokens: int | None) -> None:
        """Tokenise enough filler for ``tokens`` tokens (a file's filler: all of it), and the sentence
        boundaries in it: the token indices right after a token that ends a sentence."""
        t = self.template
        if t.repeat:
            unit = t.filler.strip() + " "
            times = 1
            while True:
                ids, offsets = self._encode(unit * times)
                if len(ids) >= tokens:
                    break
                times *= 2
            text = unit * times
        else:
            text = t.filler
            ids, offsets = self._encode(text)
        self._filler = ids
        self._ends = [i + 1 for i, (_a, b) in enumerate(offsets) if text[max(b - 1, 0) : b] in (".", "!", "?", "\n")]

    def filler_tokens(self, length: int, key: str = "0" * KEY_DIGITS) -> int:
        """How many filler tokens a prompt of ``length`` tokens holds (negative: the needle and the
        question alone are longer)."""
        return length - (self.bos is not None) - len(self._needle(key)[0]) - len(self.question)

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``text``'s token ids and character offsets, no special tokens."""
        return self._encode(text)

    def filler(self, tokens: int) -> list[int]:
        """The filler's first ``tokens`` tokens (grown as needed; a file's filler too short: NeedleError)."""
        if len(self._filler) < tokens:
            if not self.template.repeat:
                raise NeedleError(f"--filler: {self.template.source}: {len(self._filler)} tokens, a prompt needs "
                                  f"{tokens}", "--filler")
            self._grow(tokens)
        return self._filler[:tokens]

    def sentence_ends(self) -> list[int]:
        """The filler's sentence boundaries (token indices right after a sentence's end)."""
        return list(self._ends)

    def available(self) -> int | None:
        """The filler's tokens when it is read once (a file), else None (it repeats)."""
        return None if self.template.repeat else len(self._filler)

    def _needle(self, key: str) -> tuple[list[int], list[int]]:
        """The needle's token ids and the indices of the key's digits among them."""
        text = " " + self.template.needle.strip().replace("{key}", key)
        ids, offsets = self._encode(text)
        spans = [(m.start(), m.end()) for m in re.finditer(re.escape(key), text)]
        at = [i for i, (a, b) in enumerate(offsets) if any(a < e and b > s for s, e in spans)]
        return ids, at

    def prompt(self, length: int, depth: float, key: str, trial: int = 0) -> Prompt:
        needle, at = self._needle(key)
        f = self.filler_tokens(length, key)
        if f < 0:
            raise NeedleError(f"--lengths: {length}: shorter than the needle and the question "
                              f"({length - f} tokens)", "--lengths")
        if len(self._filler) < f:
            if not self.template.repeat:
                raise NeedleError(f"--filler: {self.template.source}: {len(self._filler)} tokens, a "
                                  f"{length}-token prompt needs {f}", "--filler")
            self._grow(f)
        filler = self._filler[:f]
        cuts = [0, *[e for e in self._ends if e < f], f]
        a = min(cuts, key=lambda c: (abs(c - depth * f), c))
        head = [self.bos] if self.bos is not None else []
        ids = head + filler[:a] + needle + filler[a:] + self.question
        start = len(head) + a
        return Prompt(tuple(int(i) for i in ids), key, tuple(start + i for i in at), start, length, depth, trial)


@dataclass(frozen=True)
class ConversationPrompt:
    """A pass key per turn: a context holding K numbered needles (key i at ``depths[i]``), then K turns, turn
    i asking for key i. ``length`` is the context and the first question together (what a query-aware
    compression sees at once)."""

    context: tuple[int, ...]
    questions: tuple[tuple[int, ...], ...]
    keys: tuple[str, ...]
    key_positions: tuple[tuple[int, ...], ...]  # per key, the positions of its digits (both mentions)
    needle_starts: tuple[int, ...]
    length: int
    depths: tuple[float, ...]
    trial: int

    @property
    def digest(self) -> str:
        ids = list(self.context) + [-1] + [x for q in self.questions for x in (*q, -1)]
        return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:24]


def _named(text: str, i: int) -> str:
    """``text`` for key ``i`` (1-based): ``{n}`` its number, ``{name}`` its name (``KEY_NAMES``)."""
    text = text.strip().replace("{n}", str(i))
    return text.replace("{name}", KEY_NAMES[i - 1]) if "{name}" in text else text


def conversation(builder: Builder, length: int, depths, keys, trial: int = 0, needle: str = NEEDLE_NAMED,
                 question: str = QUESTION_NAMED) -> ConversationPrompt:
    """K = len(keys) needles, each named (``{name}``) or numbered (``{n}``), in the filler of ``builder`` (its
    template's filler), key i at the sentence boundary nearest ``depths[i]`` x the filler's length, the context and
    the first question exactly ``length`` tokens. NeedleError (one line) when the depths and keys differ in number
    or two keys snap to one boundary."""
    if len(depths) != len(keys):
        raise NeedleError(f"--depths: {len(depths)} depth(s) for --keys {len(keys)}: give one depth per key "
                          "(key i at the i-th depth)", "--depths")
    for text, flag in ((needle, "--needle"), (question, "--question")):
        if "{n}" not in text and "{name}" not in text:
            raise NeedleError(f"{flag}: {text!r}: has no {{n}} or {{name}} for the key's number or name (a conversation "
                              "asks for key n)", flag)
    if len(keys) > len(KEY_NAMES) and ("{name}" in needle or "{name}" in question):
        raise NeedleError(f"--keys: {len(keys)}: {{name}} names at most {len(KEY_NAMES)} keys", "--keys")
    needles = []
    for i, key in enumerate(keys, 1):
        text = " " + _named(needle, i).replace("{key}", key)
        ids, offsets = builder.encode(text)
        spans = [(m.start(), m.end()) for m in re.finditer(re.escape(key), text)]
        needles.append((ids, [j for j, (a, b) in enumerate(offsets) if any(a < e and b > s for s, e in spans)]))
    questions = tuple(tuple(builder.encode(" " + _named(question, i))[0])
                      for i in range(1, len(keys) + 1))
    head = [builder.bos] if builder.bos is not None else []
    f = length - len(head) - sum(len(ids) for ids, _ in needles) - len(questions[0])
    if f < 0:
        raise NeedleError(f"--lengths: {length}: shorter than the {len(keys)} needles and the first question "
                          f"({length - f} tokens)", "--lengths")
    filler = builder.filler(f)
    cuts = [0, *[e for e in builder.sentence_ends() if e < f], f]
    at = [min(cuts, key=lambda c, d=d: (abs(c - d * f), c)) for d in depths]
    for i in range(len(at)):
        for j in range(i):
            if at[i] == at[j]:
                raise NeedleError(f"--depths: {depths[j]:g} and {depths[i]:g}: keys {j + 1} and {i + 1} overlap (both "
                                  f"snap to the sentence boundary at filler token {at[i]} of {f}); give depths further "
                                  "apart", "--depths")
    ids, positions, starts = list(head), [()] * len(keys), [0] * len(keys)
    done = 0
    for i in sorted(range(len(keys)), key=lambda i: at[i]):
        ids += filler[done : at[i]]
        done = at[i]
        starts[i] = len(ids)
        positions[i] = tuple(len(ids) + j for j in needles[i][1])
        ids += needles[i][0]
    ids += filler[done:]
    return ConversationPrompt(tuple(int(x) for x in ids), questions, tuple(keys), tuple(positions), tuple(starts),
                              length, tuple(float(d) for d in depths), trial)


def pass_keys(seed: int, length: int, depths, trial: int) -> tuple[str, ...]:
    """A conversation's keys: key i drawn from (seed, length, its depth, trial, i), each unlike the others."""
    out: list[str] = []
    for i, d in enumerate(depths):
        rng = np.random.default_rng([seed, length, round(d * 1000), trial, i])
        key = str(int(rng.integers(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS)))
        while key in out:
            key = str(int(rng.integers(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS)))
        out.append(key)
    return tuple(out)


def pass_key(seed: int, length: int, depth: float, trial: int) -> str:
    """The trial's five-digit key, the same for every policy and the control."""
    rng = np.random.default_rng([seed, length, round(depth * 1000), trial])
    return str(int(rng.integers(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS)))


def answer(text: str) -> str | None:
    """The first run of digits the model wrote (what it gives as the key), or None."""
    m = re.search(r"\d+", text)
    return m.group() if m else None


__all__ = ["FILLER", "KEY_DIGITS", "KEY_NAMES", "NEEDLE", "NEEDLE_NAMED", "NEEDLE_NUMBERED", "QUESTION", "QUESTION_NAMED",
           "QUESTION_NUMBERED", "Builder",
           "ConversationPrompt", "NeedleError", "Prompt", "Template", "answer", "conversation", "pass_key", "pass_keys"]

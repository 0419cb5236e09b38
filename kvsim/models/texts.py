"""The texts a model is measured on (``kvsim quality``, the truth, the proxies): a path, or the name
``heapq``, the shipped traces' text (CPython 3.11.7's ``Lib/heapq.py``, found beside the interpreter and
checked by sha256); its bytes, which key a full-cache pass; and its tokens, ``<bos>`` first."""

from __future__ import annotations

import hashlib
from pathlib import Path

from .errors import QualityError, RecordError

#: sha256 of CPython 3.11.7's Lib/heapq.py, the text of the shipped traces (REAL_TRACES.md)
HEAPQ_SHA256 = "6d43277e5c76fc0f073cd388fcff852d14d068f6bb6d4886c340f8b75a1229a9"


def heapq_path() -> Path:
    """CPython 3.11.7's ``Lib/heapq.py``, the shipped traces' text, found beside this interpreter's
    standard library and checked by sha256. Raises QualityError when it is not there."""
    import sysconfig

    candidates = [Path(sysconfig.get_paths()["stdlib"]) / "heapq.py"]
    try:
        import heapq

        candidates.append(Path(heapq.__file__))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - heapq is always there
        pass
    for path in candidates:
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == HEAPQ_SHA256:
            return path
    raise QualityError(
        f"CPython 3.11.7's Lib/heapq.py (sha256 {HEAPQ_SHA256[:12]}...) is not this interpreter's "
        f"({candidates[0]}); pass the file's path instead of 'heapq'"
    )


def resolve_text(text: str | Path) -> Path:
    """A text file's path; the name ``heapq`` means the shipped traces' text (``heapq_path()``)."""
    path = Path(text)
    if str(text) == "heapq" and not path.exists():
        return heapq_path()
    return path



def text_bytes(path: Path) -> bytes:
    """The text's bytes (what the full-pass cache is keyed by), after ``read_text``'s checks."""
    from .loading import read_text

    try:
        read_text(path)
        return path.read_bytes()
    except RecordError as e:
        raise QualityError(str(e)) from None



def tokenize(tokenizer, text_path: str | Path, steps: int):
    """``x_0 .. x_N`` as a ``(1, N + 1)`` tensor: ``<bos>`` first (added if the tokenizer does not),
    then the text, cut to ``steps + 1`` tokens. N is ``steps`` or less for a short text."""
    from .loading import read_text, token_ids

    if steps < 2:
        raise QualityError(f"steps must be at least 2 (the loss is over positions 1 .. N-1), got {steps}")
    try:
        text = read_text(text_path)
    except RecordError as e:
        raise QualityError(str(e)) from None
    ids = token_ids(tokenizer, text)[:, : steps + 1]
    if ids.shape[1] < 3:
        raise QualityError(f"{text_path}: the text has {ids.shape[1]} tokens; the loss needs at least 3")
    return ids



__all__ = ["HEAPQ_SHA256", "heapq_path", "resolve_text", "text_bytes", "tokenize"]

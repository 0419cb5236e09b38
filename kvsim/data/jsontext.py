"""JSON a user hands kvsim (an allocation or tune file, a bundle's manifest, a trace's meta, a model's config),
parsed with its nesting bounded first.

``json.loads`` recurses once per level of nesting: a file of 100,000 ``[`` answers ``RecursionError: maximum
recursion depth exceeded``, a traceback instead of the one line every other malformed file gets. ``loads``
counts the brackets first (outside strings; a document with fewer brackets than the limit is not scanned at
all) and refuses a document nested deeper than ``MAX_DEPTH`` as a ``json.JSONDecodeError``, so each reader's
own ``except json.JSONDecodeError`` (or ``ValueError``) says it in its one line, with the file's name:
``split.json: not valid JSON (nested deeper than 100 levels, line 1)``. No document kvsim writes nests
deeper than a handful of levels.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: the deepest nesting a document may have; kvsim's own documents stay under ten
MAX_DEPTH = 100
#: a JSON string (its brackets are not nesting), or one bracket: the slow walk, for the offset only
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
#: every byte but a bracket or a quote, deleted in one pass
_NOT_KEPT = bytes(b for b in range(256) if b not in b'[]{}"')
#: a string once its escapes are gone: quote, no quote, quote
_BARE_STRING = re.compile(rb'"[^"]*"')


class NestingError(json.JSONDecodeError):
    """A document nested deeper than ``MAX_DEPTH``; ``msg`` says so, ``lineno`` where it went past."""


def too_deep(text: str, limit: int = MAX_DEPTH) -> int | None:
    """The offset of the first bracket that opens level ``limit + 1`` of ``text``, or None when it never gets
    that deep. Brackets inside strings do not count. The escapes, the strings and everything but brackets are
    cut out by C passes and the depth is one cumulative sum, so a document of megabytes costs a fraction of its
    parse; only a document found too deep is walked token by token, for the offset."""
    if text.count("[") + text.count("{") <= limit:
        return None
    # the escapes first (an escaped backslash, then an escaped quote), then everything but brackets and quotes,
    # then the strings: what is left is the document's brackets alone
    kept = text.replace("\\\\", "").replace('\\"', "").encode("utf-8", "surrogatepass").translate(None, _NOT_KEPT)
    brackets = _BARE_STRING.sub(b"", kept)
    import numpy as np

    codes = np.frombuffer(brackets, dtype=np.uint8)
    if int(np.cumsum(np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)).max(initial=0)) <= limit:
        return None
    depth = 0
    for m in _TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > limit:
                return m.start()
        elif c in "]}":
            depth -= 1
    return None


def loads(text: str | bytes) -> Any:
    """``json.loads``, refusing a document nested deeper than ``MAX_DEPTH`` (NestingError, a JSONDecodeError)
    before the parser recurses into it."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8")
    where = too_deep(text)
    if where is not None:
        raise NestingError(f"nested deeper than {MAX_DEPTH} levels", text, where)
    try:
        return json.loads(text)
    except RecursionError:  # a limit lowered below MAX_DEPTH's needs, say deep in a caller's stack
        raise NestingError(f"nested too deep for this process's recursion limit (at most {MAX_DEPTH} levels are read)",
                           text, 0) from None


def read_file(path, limit: int, error: type[Exception], what: str = "the limit") -> Any:
    """The document in the small JSON file ``path`` (its existence checked by the caller, who says what a
    missing one means): ``error`` (a one-line ``ValueError``), starting with the path, for a file over
    ``limit`` bytes, one that is not UTF-8, or not JSON (nesting included)."""
    from pathlib import Path

    p = Path(path)
    if p.stat().st_size > limit:
        raise error(f"{path}: {p.stat().st_size} bytes, more than {what} of {limit}")
    try:
        return loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None


__all__ = ["MAX_DEPTH", "NestingError", "loads", "read_file", "too_deep"]

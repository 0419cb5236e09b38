"""A conversation on one cache (docs/domain.md, "A conversation"; docs/needle.md, "A conversation: a pass key per
turn"): a context, then turns, each turn's question fed as a further forward call on the same cache after what it
has seen and written, its answer decoded greedily through the cache, which keeps evicting as it decodes.

``query`` says what a compressed prompt (``kvsim.hf.cache(..., prefill="compress")``) is chosen with: ``aware``,
the context and the first question in its one compressed call (the question in the scorer's observation window);
``agnostic``, the context alone compressed, the first question a call of its own after it. A cache that does not
compress steps every position one by one either way, and the two feed the same positions.

torch is imported inside ``converse``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

#: what a compressed prompt is chosen with (``--query``); the first: the default
QUERY = ("aware", "agnostic")


def compresses(cache) -> bool:
    """Whether ``cache`` compresses the prompt at its first call (``prefill="compress"``)."""
    return any(getattr(layer, "prefill", None) == "compress" for layer in getattr(cache, "layers", ()))


def converse(model, cache, context: Sequence[int], questions: Sequence[Sequence[int]], new_tokens: int, *, eos=None,
             query: str = "aware") -> dict:
    """Feed ``context`` and each of ``questions`` (token ids) on ``cache``, each answered greedily with at most
    ``new_tokens`` tokens (stopping at ``eos``); turn i's question comes after turn i-1's answer (its last token,
    written but never fed, first). Returns ``tokens`` (per turn), ``turn_starts`` (each question's first
    position), ``positions`` (every position fed), ``prefill_seconds`` (the context and questions) and
    ``decode_seconds``. ValueError for an unknown ``query``."""
    import torch

    from .decoding import prefill

    if query not in QUERY:
        raise ValueError(f"query: {query!r}: one of {', '.join(QUERY)}")
    stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    context = [int(x) for x in context]
    tokens: list[list[int]] = []
    starts: list[int] = []
    seen = 0
    pre = dec = 0.0
    with torch.no_grad():
        for i, question in enumerate(questions):
            t0 = time.perf_counter()
            if i == 0:
                starts.append(len(context))
                if compresses(cache) and query == "aware":
                    out = prefill(model, torch.tensor([context + list(question)]), cache)
                else:
                    prefill(model, torch.tensor([context]), cache)
                    out = prefill(model, torch.tensor([list(question)]), cache)
                seen += len(context) + len(question)
            else:
                starts.append(seen + 1)  # after the previous answer's last token, fed first
                out = prefill(model, torch.tensor([[tokens[-1][-1], *question]]), cache)
                seen += 1 + len(question)
            pre += time.perf_counter() - t0
            t0 = time.perf_counter()
            mine: list[int] = []
            while True:
                nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)
                mine.append(int(nxt[0, 0]))
                if len(mine) == new_tokens or mine[-1] in stops:
                    break
                out = model(nxt, cache=cache, use_cache=True)
                seen += 1
            tokens.append(mine)
            dec += time.perf_counter() - t0
    return {"tokens": tokens, "turn_starts": starts, "positions": seen, "prefill_seconds": pre, "decode_seconds": dec}


__all__ = ["QUERY", "compresses", "converse"]

"""A conversation's turns in a trace (docs/domain.md, "A conversation"): where they lie, read from the meta
``record --conversation`` writes (``turns``: per turn its ``question_start``, ``answer_start`` and ``end`` in
positions; ``context_end``), and the retained mass per turn: the mean, over the turn's queries (its question's
and its answer's positions), of the share of each query's attention the policy kept. ``replay``, ``table`` and
the app's kept-position heatmap read them here."""

from __future__ import annotations

import numpy as np


def turns_of(meta: dict, steps: int | None = None) -> list[dict] | None:
    """The turns in ``meta`` (each ``{"question_start", "answer_start", "end"}``, in order, within ``steps + 1``
    positions when given), or None for a trace that is not a conversation or whose turns do not hold together."""
    turns = meta.get("turns") if isinstance(meta, dict) else None
    if not isinstance(turns, list) or not turns:
        return None
    out, last = [], 1
    for t in turns:
        if not isinstance(t, dict):
            return None
        a, b, c = (t.get(k) for k in ("question_start", "answer_start", "end"))
        if not all(type(x) is int for x in (a, b, c)) or not last <= a <= b < c:
            return None
        if steps is not None and c > steps + 1:
            return None
        out.append({"question_start": a, "answer_start": b, "end": c})
        last = c
    return out


def turn_mass(series, turns: list[dict]) -> list[dict]:
    """Per turn, the retained mass over its queries (``series``: per step t = 1..T, as a replay gives it) and
    over its answer's queries alone."""
    s = np.asarray(series, dtype=np.float64)
    out = []
    for i, t in enumerate(turns, 1):
        every = s[t["question_start"] - 1 : t["end"] - 1]
        answer = s[t["answer_start"] - 1 : t["end"] - 1]
        out.append({"turn": i, **t, "retained_mass": float(every.mean()),
                    "answer_retained_mass": float(answer.mean()) if answer.size else None})
    return out


def turn_fields(trace, series) -> dict:
    """``{"turns": turn_mass(...)}`` for a conversation's trace, nothing for any other trace."""
    turns = turns_of(trace.meta, trace.steps)
    return {} if turns is None else {"turns": turn_mass(series, turns)}


__all__ = ["turn_fields", "turn_mass", "turns_of"]

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





def marked(fig, trace):
    """A copy of a kept-position heatmap (``kvsim.views.figures.kept_heatmap``: positions across, steps down) with
    each turn's start drawn on every panel: a dashed line where its question starts (the step and the position),
    a dotted one where its answer starts; ``fig`` itself when the trace is not a conversation."""
    import plotly.graph_objects as go

    turns = turns_of(trace.meta, trace.steps)
    if turns is None:
        return fig
    fig = go.Figure(fig)
    panels = list(dict.fromkeys((t.xaxis or "x", t.yaxis or "y") for t in fig.data if t.type == "image"))
    for i, (xa, ya) in enumerate(panels):
        for k, t in enumerate(turns, 1):
            q, a = t["question_start"] - 0.5, t["answer_start"] - 0.5
            first = i == 0 and k == 1
            for x0, x1, y0, y1, dash, name in ((-0.5, trace.steps + 0.5, q, q, "dash", "a turn's question starts"),
                                               (q, q, q, trace.steps + 0.5, "dash", None),
                                               (-0.5, trace.steps + 0.5, a, a, "dot", "its answer starts")):
                fig.add_shape(type="line", x0=x0, x1=x1, y0=y0, y1=y1, xref=xa, yref=ya, line=dict(color=TURN_COLOUR,
                              width=1, dash=dash), name=name if first and name else None,
                              showlegend=bool(first and name))
            if i == 0:
                fig.add_annotation(x=q, y=q, xref=xa, yref=ya, text=f"turn {k}", showarrow=False, xanchor="left",
                                   yanchor="bottom", font=dict(color=TURN_COLOUR, size=11))
    return fig


def caption(spans: list[dict], results, label) -> str:
    """What the turns' lines are, and each replay's retained mass per turn (``label(result)`` names a replay)."""
    per = "; ".join(f"{label(r)}: " + ", ".join(f"turn {t['turn']} {t['retained_mass']:.4f}"
                                                for t in turn_mass(r.retained_mass_series, spans)) for r in results)
    return (f"A conversation of {len(spans)} turns: purple dashed lines where each turn's question starts (the step "
            f"and the position), dotted where its answer starts. Retained mass per turn (over its queries): {per}.")


#: the turns' lines on the heatmap: a colour the kept/evicted palette does not use
TURN_COLOUR = "#7b2cbf"

__all__ = ["TURN_COLOUR", "caption", "marked", "turn_fields", "turn_mass", "turns_of"]

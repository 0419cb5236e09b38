"""A pass key per turn in the app (``kvsim needle --keys K``; docs/needle.md, "A conversation: a pass key per
turn"): per turn, which key it asked and what the full cache and the policy wrote; per key, where it left each
(layer, KV head)'s cache, dated by the turn it left in, beside where the optimum over the whole conversation
let it go.

A key's fate is the step its last token left (``key_left``: None when a token of it stayed to the end). Step t
feeds position t; turn i's question starts at ``turn_starts[i]`` (the run's own), so a step before turn 1's
start left in the context, and a step from turn i's start to turn i+1's left during turn i (its question or
its answer). A compressed prompt's positions leave at the prompt's last step (``needle_runs._Departures``): in
turn 1 when the first question was in the compressed call (query-aware), in the context when it was not.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: a phase's colour: in the context, each turn (lighter later), held to the end
CONTEXT_COLOUR = "#7f2704"
TURN_COLOURS = ("#d94801", "#fd8d3c", "#fdbe85", "#feedde")
HELD_COLOUR = "#238b45"


def phase(step: int | None, turn_starts: Sequence[int]) -> int:
    """0: left in the context (before turn 1's question); i: during turn i; ``len(turn_starts) + 1``: held."""
    if step is None:
        return len(turn_starts) + 1
    return sum(step >= s for s in turn_starts)


def phase_names(turns: int) -> list[str]:
    return ["left in the context", *[f"left during turn {i + 1}" for i in range(turns)], "held to the end"]


def _colours(turns: int) -> list[str]:
    middle = [TURN_COLOURS[min(i, len(TURN_COLOURS) - 1)] for i in range(turns)]
    return [CONTEXT_COLOUR, *middle, HELD_COLOUR]


def short(run: dict) -> str:
    """A run's label up to its first comma (``snapkv @ 256``; the prompt's compression said by the selector)."""
    return run["label"].split(",")[0]


def turn_rows(cell: dict, run: dict) -> list[dict]:
    """One row per turn: the key it asked for, what the full cache and ``run`` wrote, and whether each found it."""
    control = cell["control"]
    name = short(run)
    rows = []
    for i, key in enumerate(cell["keys"]):
        rows.append({"turn": i + 1, "asks for": f"key {i + 1} ({key})",
                     "full cache wrote": (control.get("texts") or [""] * len(cell["keys"]))[i].strip(),
                     "full cache found it": bool(control["found"][i]),
                     f"{name} wrote": (run.get("texts") or [""] * len(cell["keys"]))[i].strip(),
                     f"{name} found it": bool(run["found"][i])})
    return rows


def _grid(fates, starts) -> tuple[np.ndarray, list[list[str]]]:
    """Per (layer, KV head): the phase its key left in and the cell's text (its step, or held)."""
    z = np.array([[phase(s, starts) for s in heads] for heads in fates], dtype=float)
    text = [["held" if s is None else str(s) for s in heads] for heads in fates]
    return z, text


def key_fates(cell: dict, run: dict, *, title: str = ""):
    """One heatmap per key (layers down): the policy's KV heads, then the optimum's where measured, each cell
    coloured by the phase of the conversation its key left in and labelled with the step."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    k = len(cell["keys"])
    names = phase_names(k)
    colours = _colours(k)
    n = len(colours)
    scale = []  # a step per phase: phase j fills [j/n, (j+1)/n]
    for j, c in enumerate(colours):
        scale += [[j / n, c], [(j + 1) / n, c]]
    best = run.get("optimal_key_left")
    control_starts = cell["control"]["turn_starts"]
    fig = make_subplots(rows=1, cols=k, shared_yaxes=True, horizontal_spacing=0.06,
                        subplot_titles=[f"key {i + 1} ({cell['keys'][i]}), asked at turn {i + 1}" for i in range(k)])
    for i in range(k):
        heads = len(run["key_left"][i][0])
        z, text = _grid(run["key_left"][i], run["turn_starts"])
        xs = [short(run) if heads == 1 else f"{short(run)}, KV head {h}" for h in range(heads)]
        hover = [[f"layer {x}, {xs[h]}: {_said(s, run['turn_starts'], names)}" for h, s in enumerate(row)]
                 for x, row in enumerate(run["key_left"][i])]
        if best is not None:
            zb, tb = _grid(best[i], control_starts)
            ob = ["optimum" if heads == 1 else f"optimum, KV head {h}" for h in range(heads)]
            hover = [row + [f"layer {x}, {ob[h]}: {_said(s, control_starts, names)}" for h, s in enumerate(brow)]
                     for x, (row, brow) in enumerate(zip(hover, best[i], strict=True))]
            z = np.concatenate([z, zb], axis=1)
            text = [a + b for a, b in zip(text, tb, strict=True)]
            xs = xs + ob
        fig.add_trace(go.Heatmap(z=z, x=xs, y=list(range(len(z))), zmin=-0.5, zmax=n - 0.5, colorscale=scale,
                                 text=text, texttemplate="%{text}", customdata=hover, xgap=2, ygap=2,
                                 hovertemplate="%{customdata}<extra></extra>", showscale=i == k - 1,
                                 colorbar=dict(title=dict(text="the key's last token", side="top"),
                                               tickvals=list(range(n)), ticktext=names, len=0.9)),
                      row=1, col=i + 1)
        fig.update_xaxes(type="category", side="top", row=1, col=i + 1)
    for a in fig.layout.annotations:
        a.y = a.y + 0.05  # the titles above the column labels on top
    fig.update_yaxes(autorange="reversed", title_text="layer", row=1, col=1, dtick=1)
    layers = len(run["key_left"][0])
    fig.update_layout(title=title or None, height=100 + 24 * layers, template="plotly_white",
                      margin=dict(l=60, r=20, t=75 if not title else 105, b=10))
    return fig


def _said(step, starts, names) -> str:
    if step is None:
        return "a token of the key held to the end"
    return f"its last token left at step {step} ({names[phase(step, starts)]})"


def summary(run: dict) -> str | None:
    """The retained attention mass beside the optimum's over the whole conversation, where measured."""
    if run.get("optimal_retained") is None or run.get("retained") is None:
        return None
    said = (f"Retained attention mass over the conversation: {run['retained']:.3f} (the optimum at the same budgets "
            f"{run['optimal_retained']:.3f}); after the context and the first question {run['retained_after_prompt']:.3f} "
            f"({run['optimal_retained_after_prompt']:.3f}).")
    if run.get("prefill"):
        said += (" A compressed prompt attends to the whole prompt while it is read, so only the second pair "
                 "compares.")
    return said


__all__ = ["key_fates", "phase", "phase_names", "short", "summary", "turn_rows"]

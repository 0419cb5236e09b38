"""The policy lab's figures: pure builders, the lab's steps (``kvsim.analysis.lab``) in, Plotly
figures out; no Streamlit here, so they are tested without a browser and the app only lays them out.

- ``step_figure``: one policy at one step, row t's attention as bars coloured by what the policy did
  with each position, its scores or votes above them;
- ``timeline_figure``: one policy over the whole lab run, step by position, the cache after every step.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ..analysis.lab import LabStep

#: bar colours of the step figure, one per state of a position at that step
HELD_COLOUR = "rgba(31, 119, 180, 0.9)"  # held: the query saw it
VICTIM_COLOUR = "rgba(214, 39, 40, 0.9)"  # held, evicted at the end of this step
GONE_COLOUR = "rgba(190, 190, 190, 0.9)"  # evicted before this step: the query wanted it in vain
NEW_COLOUR = "rgba(44, 160, 44, 0.9)"  # admitted this step (the query's own position)


def step_figure(step: LabStep, side: int) -> go.Figure:
    """Row t's attention over positions 0 .. t-1 as bars, coloured by what this policy did with
    each position (held, victim this step, gone before); the new position t as a marker on the
    axis; the policy's score or vote count above each bar where it keeps one."""
    s = step.sides[side]
    t = step.t
    positions = np.arange(t)
    states = [s.state(p) for p in range(t)]
    colour = {"held": HELD_COLOUR, "victim": VICTIM_COLOUR, "gone": GONE_COLOUR}
    fig = go.Figure()
    for state, name in (("held", "held"), ("victim", "victim (evicted this step)"), ("gone", "evicted earlier")):
        mask = np.array([st == state for st in states])
        fig.add_bar(
            x=positions[mask], y=step.row[mask], name=name, marker_color=colour[state],
            hovertemplate="position %{x}<br>weight %{y:.3f}<extra>" + name + "</extra>",
        )
    new_state = s.state(t)
    fig.add_scatter(
        x=[t], y=[0], mode="markers", name=f"new position {t}" + (" (evicted at once)" if new_state != "new" else ""),
        marker={"symbol": "triangle-up", "size": 14, "color": VICTIM_COLOUR if new_state != "new" else NEW_COLOUR},
        hovertemplate=f"position {t}: admitted this step<extra></extra>",
    )
    if s.scores is not None:
        at = dict(zip(s.score_positions.tolist(), s.scores.tolist(), strict=True))
        xs = [p for p in range(t + 1) if p in at]
        ys = [step.row[p] if p < t else 0.0 for p in xs]
        fig.add_scatter(
            x=xs, y=ys, mode="text", text=[_fmt_score(at[p]) for p in xs], textposition="top center",
            name="score", showlegend=False, hoverinfo="skip",
        )
    fig.update_layout(
        title=step_title(step, side), barmode="overlay", bargap=0.15, height=320,
        margin={"l": 40, "r": 10, "t": 70, "b": 40},
        legend={"orientation": "h", "y": -0.25},
    )
    fig.update_xaxes(title="position", range=[-0.6, t + 0.6], dtick=1)
    fig.update_yaxes(title=f"attention of query {t}", range=[0, max(1.0, float(step.row.max())) * 1.15])
    return fig


def step_title(step: LabStep, side: int) -> str:
    """The step figure's title: what the query found, measured before this step's eviction (so a red
    victim bar beside "retained 1.000" is no contradiction), then what the policy evicts."""
    s, t = step.sides[side], step.t
    victims = ", ".join(map(str, s.victims)) if s.victims else "nothing"
    return (f"{s.label}, step {t}: retained {s.retained_mass:.3f}, then evicts {victims}"
            f"<br><sup>retained: query {t}'s attention on the cache it found, measured before this step's eviction</sup>")


def _fmt_score(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def timeline_figure(steps: list[LabStep], side: int, current: int | None = None) -> go.Figure:
    """The whole lab run for one policy: a grid of step (rows) by position (columns), each cell
    held / victim / gone / not yet generated, with the current step outlined."""
    T = len(steps)
    # 0 not yet generated, 1 gone, 2 held, 3 victim this step (codes index the colour scale)
    grid = np.zeros((T, T + 1))
    for i, step in enumerate(steps):
        s = step.sides[side]
        for p in range(step.t + 1):
            state = s.state(p)
            grid[i, p] = {"gone": 1, "held": 2, "new": 2, "victim": 3, "evicted at once": 3}[state]
    colours = ["white", GONE_COLOUR, HELD_COLOUR, VICTIM_COLOUR]
    scale = [[v, c] for i, c in enumerate(colours) for v in (i / 4, (i + 1) / 4)]
    labels = np.array(["not yet", "gone", "held", "victim"])[grid.astype(int)]
    fig = go.Figure(
        go.Heatmap(
            z=grid, x=list(range(T + 1)), y=[s.t for s in steps], zmin=0, zmax=4, colorscale=scale,
            showscale=False, xgap=1, ygap=1, customdata=labels,
            hovertemplate="step %{y}, position %{x}: %{customdata}<extra></extra>",
        )
    )
    if current is not None:
        fig.add_shape(type="rect", x0=-0.5, x1=T + 0.5, y0=current - 0.5, y1=current + 0.5,
                      line={"color": "black", "width": 2})
    fig.update_layout(title=f"{steps[0].sides[side].label}: the cache after every step", height=320,
                      margin={"l": 40, "r": 10, "t": 50, "b": 40})
    fig.update_xaxes(title="position", dtick=1)
    fig.update_yaxes(title="step", autorange="reversed", dtick=1)
    return fig

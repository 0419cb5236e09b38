"""The per-layer search of ``tune --per-layer`` by the truth: the model's layers cut into groups of one attention
kind (``layer_groups``), each group's window moved one step at a time and kept only where the whole model's
truth falls (``search_layer_windows``). ``kvsim.analysis.tune`` deploys it; ``kvsim.allocation.search``
moves budgets over the same groups."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ..progress import Progress

#: the per-layer search moves a group's window by the budget over this (32 at budget 256)
SEARCH_STEP = 8
#: the per-layer search moves at most this many groups of layers: each try is a pass of the whole model
#: over the text (about 6 s at 1024 steps on Gemma-3-270M on a quiet core, 40-75 s with the project
#: machine shared five ways), so 1 + 2 x 18 single-layer tries would take 25-45 minutes there
GROUPS = 6


def layer_groups(kinds: Sequence[str], most: int = GROUPS) -> list[list[int]]:
    """The groups of layers the search moves together: the model's runs of layers of one attention kind
    (``global`` / ``sliding``; Gemma-3-270M's five sliding layers, one global, ... are six), long runs
    cut into even pieces while there are fewer than ``most``; more runs than ``most`` (kinds
    alternating) are cut into ``most`` contiguous blocks instead."""
    runs: list[list[int]] = []
    for layer, kind in enumerate(kinds):
        if runs and kinds[runs[-1][-1]] == kind:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    if len(runs) > most:
        edges = np.linspace(0, len(kinds), most + 1).round().astype(int)
        return [list(range(a, b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
    pieces = [1] * len(runs)  # fewer runs than most: the longest runs (per piece) cut into even pieces
    while sum(pieces) < most and any(p < len(r) for p, r in zip(pieces, runs, strict=True)):
        i = max((j for j in range(len(runs)) if pieces[j] < len(runs[j])), key=lambda j: len(runs[j]) / pieces[j])
        pieces[i] += 1
    return [part.tolist() for r, p in zip(runs, pieces, strict=True) for part in np.array_split(np.array(r), p)]


def search_layer_windows(start: int, groups: Sequence[Sequence[int]], budget: int, measure, *, figure: str = "kl",
                         toward: Sequence[int] | None = None, progress: Progress | None = None) -> dict:
    """Per-layer windows by the truth: from ``start`` (the truth's model_window) in every layer, one pass
    over ``groups`` (``layer_groups``), each group's window tried one step (``budget // SEARCH_STEP``)
    away, the other groups as they stand; a group moves only when the whole model's ``figure`` (lower is
    better) falls, so the result is never worse by the truth than ``start`` everywhere. The step goes
    toward the mean of ``toward`` over the group's layers (retained mass's per-layer windows: the proxy
    only points, the truth decides; down where it points nowhere, a smaller window leaving more of the
    cache to the heavy hitters). ``measure(configs)``: the figure of each configuration (a tuple of
    one window per layer). Cost: 1 + groups measurements, the first the model-wide window's, usually
    known already; each is a pass of the whole model over the text, 40-75 s at 1024 steps on
    Gemma-3-270M with the project machine shared five ways, so one direction per group, not two."""
    step = max(1, budget // SEARCH_STEP)
    layers = sum(len(g) for g in groups)
    current = [int(start)] * layers
    t0 = time.perf_counter()
    best = float(measure([tuple(current)])[0])
    first, count, moves = best, 1, []
    for n, group in enumerate(groups, start=1):
        now = current[group[0]]
        up = toward is not None and float(np.mean([toward[layer] for layer in group])) > now
        w = min(budget - 1, max(1, now + (step if up else -step)))
        if w != now:
            config = tuple(w if layer in group else c for layer, c in enumerate(current))
            value = float(measure([config])[0])
            count += 1
            if value < best:
                moves.append({"layers": list(group), "from": now, "to": w, figure: value})
                current, best = list(config), value
        if progress is not None:
            progress(n / len(groups), f"per-layer search by {figure}: group {n}/{len(groups)} (layers {group[0]}-{group[-1]}), "
                     f"{figure} {best:.4f} (model_window {start} everywhere: {first:.4f}), {count} measurements, "
                     f"{time.perf_counter() - t0:.0f} s")
    return {"start": int(start), figure: best, f"start_{figure}": first, "windows": current, "step": step,
            "groups": [list(g) for g in groups], "moves": moves, "measurements": count,
            "seconds": round(time.perf_counter() - t0, 2)}


__all__ = ["GROUPS", "SEARCH_STEP", "layer_groups", "search_layer_windows"]

"""The split searched by the truth (``quality --allocate optimal --by kl``, docs/allocation.md): the static
splits measured by the model, then a greedy local search from the best of them that moves budget between
runs of layers and keeps a move only where the model's figure (KL or delta NLL, open loop; lower is
better) falls, so the result is never worse by the truth than the best static split.

- **Start**: the static splits at the same memory (``START``: uniform, pyramidkv, cake and the optimum by
  retained mass), each measured; the search starts from the lowest.
- **Move set**: the heads are cut into groups of whole layers (``kvsim.analysis.layer_search.layer_groups``: the
  model's runs of layers of one attention kind, at most ``GROUPS``); a move gives every head of one group
  ``step`` more positions, taken as evenly as the bounds allow from all the other heads, or takes ``step``
  from each of them and gives it to the others. Every head stays between the policy's minimum and the
  trace's length, and the total stays the budget x heads: uniform's memory.
- **Step**: ``budget // FIRST_STEP`` positions per head at first (16 at budget 64); a pass over every
  group in both directions that keeps no move halves it.
- **Stopping rule**: the step falls below ``budget // LAST_STEP`` (2 at 64; at least 1), or the search
  has tried ``measurements`` splits (the caller's bound on its time; a split met again in one search is
  not measured again and not counted). Each try is one pass of the whole model over the text.

Nothing here measures: ``measure(budgets)`` (the caller's, a function of the flat per-head budgets to
``{"kl", "delta_nll", ...}``) does, cached on disk per split (``kvsim.allocation.truth``), so a
second run of the same search follows the same path and measures nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ..analysis.layer_search import GROUPS, layer_groups
from ..policies import PolicySpec
from ..progress import Progress
from . import allocators as al

#: the static splits measured first; the search starts from the best of them by the truth
START = ("uniform", "pyramidkv", "cake", "optimal")
#: what the truth is read as (lower is better)
FIGURES = ("kl", "delta_nll")
#: the first step is the budget over this, per head of the group moved
FIRST_STEP = 4
#: the search stops when the step would fall below the budget over this (and at least 1)
LAST_STEP = 32
#: the default bound on the splits the search tries after the static ones
DEFAULT_MEASUREMENTS = 24

Measure = Callable[[list[int]], dict]


def head_groups(shape: Sequence[tuple[int, int]], kinds: Sequence[str] | None = None, most: int = GROUPS) -> list[list[int]]:
    """The heads (indices into ``shape``, (layer, KV head) pairs) of each group of layers the search moves
    together: ``layer_groups`` over the layers' attention kinds (``kinds[layer]``; one kind when None)."""
    layers = sorted({x for x, _ in shape})
    kinds = ["global"] * len(layers) if kinds is None else [kinds[x] for x in layers]
    out = []
    for g in layer_groups(kinds, most):
        members = {layers[i] for i in g}
        out.append([i for i, (x, _) in enumerate(shape) if x in members])
    return out


def spread(amount: int, caps: np.ndarray) -> np.ndarray | None:
    """``amount`` positions shared as evenly as ``caps`` (each element's most) allow, integers, the
    remainder to the first elements with room; None when the caps hold less than ``amount``."""
    caps = np.asarray(caps, dtype=np.int64)
    if amount > int(caps.sum()):
        return None
    got = np.zeros(caps.size, dtype=np.int64)
    left = int(amount)
    while left > 0:
        room = np.flatnonzero(got < caps)
        share = max(1, left // room.size)
        for i in room:
            take = min(share, int(caps[i] - got[i]), left)
            got[i] += take
            left -= take
            if left == 0:
                break
    return got


def shift(budgets: Sequence[int], group: Sequence[int], step: int, sign: int, low: int, high: int) -> list[int] | None:
    """``budgets`` with every head of ``group`` ``step`` positions up (``sign`` +1) or down (-1), bounded
    by ``low`` and ``high``, the difference taken from (or given to) the other heads as evenly as their
    bounds allow; None when nothing moves or the others cannot make up the difference."""
    b = np.asarray(budgets, dtype=np.int64).copy()
    inside = np.zeros(b.size, dtype=bool)
    inside[list(group)] = True
    if inside.all():
        return None
    moved = np.clip(b[inside] + sign * step, low, high)
    d = int(abs(moved - b[inside]).sum())
    if d == 0:
        return None
    rest = b[~inside]
    caps = rest - low if sign > 0 else high - rest
    share = spread(d, caps)
    if share is None:
        return None
    b[inside] = moved
    b[~inside] = rest - share if sign > 0 else rest + share
    return [int(x) for x in b]


def search(start: Sequence[int], groups: Sequence[Sequence[int]], low: int, high: int, budget: int, measure: Measure, *,
           figure: str = "kl", measurements: int = DEFAULT_MEASUREMENTS, start_result: dict | None = None,
           progress: Progress | None = None) -> dict:
    """The greedy local search of the module docstring from ``start`` (flat per-head budgets, its truth
    ``start_result`` when known): ``{"budgets", figure, "result" (the best split's measurement),
    "moves" (the path: group, layers, direction, step, figure after), "tried", "measured", "step",
    "stopped" (why), "seconds"}``. Never ends above the start's figure."""
    if figure not in FIGURES:
        raise ValueError(f"figure must be one of {', '.join(FIGURES)}, got {figure!r}")
    t0 = time.perf_counter()
    seen: dict[tuple[int, ...], dict] = {}

    def value(b: list[int]) -> dict:
        key = tuple(b)
        if key not in seen:
            seen[key] = measure(list(b))
        return seen[key]

    current = [int(x) for x in start]
    if start_result is not None:
        seen[tuple(current)] = start_result
    best = value(current)
    step, last = max(1, budget // FIRST_STEP), max(1, budget // LAST_STEP)
    tried = measured = 0
    moves: list[dict] = []
    stopped = None
    while stopped is None:
        kept = False
        for n, group in enumerate(groups):
            moved = False
            for sign in (+1, -1):
                cand = shift(current, group, step, sign, low, high)
                if cand is None or tuple(cand) in seen:
                    continue
                if tried >= measurements:
                    stopped = f"the measurement budget ({measurements} splits tried)"
                    break
                r = value(cand)
                tried += 1
                measured += not r.get("cached", False)
                if r[figure] < best[figure]:
                    current, best, kept, moved = cand, r, True, True
                    moves.append({"group": n, "direction": "more" if sign > 0 else "less", "step": step,
                                  figure: float(r[figure])})
                    break
                if progress is not None:
                    progress(None, f"search by {figure}: step {step}, group {n + 1}/{len(groups)} "
                                   f"{'+' if sign > 0 else '-'}{step}: {r[figure]:.4f} (best {best[figure]:.4f}), "
                                   f"{tried} tried, {time.perf_counter() - t0:.0f} s")
            if stopped is not None:
                break
            if moved and progress is not None:
                progress(None, f"search by {figure}: kept group {n + 1} {moves[-1]['direction']} by {step}: "
                               f"{best[figure]:.4f}, {tried} tried")
        if stopped is None and not kept:
            if step // 2 < last:
                stopped = f"no move of {step} positions lowers {figure}, and the next step ({step // 2}) is below {last}"
            else:
                step //= 2
    return {"budgets": current, figure: float(best[figure]), "result": best, "moves": moves, "tried": tried,
            "measured": measured, "step": step, "last_step": last, "stopped": stopped,
            "seconds": round(time.perf_counter() - t0, 2)}


def static_starts(heads: list[al.Head], spec: PolicySpec, names: Sequence[str] = START, *,
                  progress: Progress | None = None) -> dict[str, al.Allocation]:
    """The static splits the search starts from, each made at ``spec``'s memory (the optimum by mass's
    budget curves are the time here)."""
    return {name: al.allocate(name, heads, spec, progress=progress) for name in names}


def search_from_static(heads: list[al.Head], spec: PolicySpec, measure: Measure, *, figure: str = "kl",
                       kinds: Sequence[str] | None = None, measurements: int = DEFAULT_MEASUREMENTS,
                       progress: Progress | None = None) -> dict:
    """``--allocate optimal --by kl``: each static split (``START``) measured, then ``search`` from the
    best. ``{"allocation" (an ``Allocation`` named optimal), "start", "candidates", "search", figure}``."""
    shape = [(h.layer, h.kv_head) for h in heads]
    low, steps = al.minimum_budget(spec), heads[0].trace.steps
    splits = static_starts(heads, spec, progress=progress)
    candidates = []
    for name, a in splits.items():
        r = measure(list(a.budgets))
        candidates.append({"allocator": name, "kl": float(r["kl"]), "delta_nll": float(r["delta_nll"]),
                           "retained_mass": float(r["retained_mass"]), "cached": bool(r.get("cached", False)),
                           "result": r})
        if progress is not None:
            progress(None, f"{name}: KL {r['kl']:.4f}, delta NLL {r['delta_nll']:+.4f}"
                           + (" (cached)" if r.get("cached") else ""))
    first = min(candidates, key=lambda c: c[figure])  # the first of START on a tie
    groups = head_groups(shape, kinds)
    found = search(list(splits[first["allocator"]].budgets), groups, low, steps, spec.budget, measure, figure=figure,
                   measurements=measurements, start_result=first["result"], progress=progress)
    for m in found["moves"]:
        m["layers"] = sorted({shape[i][0] for i in groups[m["group"]]})
    alloc = al.Allocation("optimal", tuple(shape), tuple(found["budgets"]),
                          detail={"by": figure, "start": first["allocator"]})
    return {"allocation": alloc, "start": first["allocator"], "figure": figure,
            "candidates": [{k: v for k, v in c.items() if k != "result"} for c in candidates],
            "groups": [sorted({shape[i][0] for i in g}) for g in groups], "search": found}


__all__ = ["DEFAULT_MEASUREMENTS", "FIGURES", "FIRST_STEP", "LAST_STEP", "START", "head_groups", "search",
           "search_from_static", "shift", "spread", "static_starts"]

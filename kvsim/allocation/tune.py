"""``tune --allocate auto``: the allocator chosen beside the window, by tune's own ``--by``
(docs/allocation.md).

The window first, as tune chooses it at uniform's split (``model_window``); then, at that window in every
layer, each candidate allocator's split of the same memory (``budget x heads`` positions) and its figure:
the bundle's mean retained mass (higher is better; every candidate replayed on the bundle), or the
model's KL or delta NLL, open loop (lower is better; ``measure``, the caller's, cached on disk per split).
The chosen one is the best figure, the first of ``CANDIDATES`` on a tie (uniform first). A choice one
coordinate at a time, window then allocator, not a joint search of both: said in the result's ``rule``.

Left out, each with its reason in the result: ``adakv`` (a layer's heads share one pool at run time: not
a static split, so neither the truth of a split nor the deployed cache, which holds each head's own block,
takes it) and ``duo`` (its streaming heads run streaming_llm, not the tuned policy: a tune file deploys one
policy), and on a model with one KV head per layer both are refused by the allocators' own check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..policies import PolicySpec
from ..progress import Progress, scaled
from . import allocators as al

#: the allocators ``--allocate auto`` chooses among, in the order a tie goes
CANDIDATES = ("uniform", "pyramidkv", "cake", "optimal")
#: the figures an allocator is chosen by: retained mass (up) and the truth (down)
BY = ("retained_mass", "kl", "delta_nll")
#: why the other allocators are not candidates, whatever the model
LEFT_OUT = {
    "adakv": "a layer's heads share one pool at run time, not a static split: the truth measures static splits and "
             "the deployed cache holds each head's own block",
    "duo": "its streaming heads run streaming_llm, not the tuned policy: a tune file deploys one policy",
}


def left_out(heads: list[al.Head], spec: PolicySpec) -> dict[str, str]:
    """Each allocator that is not a candidate and why: the allocator's own refusal on this bundle where
    it has one (one KV head per layer), else ``LEFT_OUT``'s reason."""
    shape = [(h.layer, h.kv_head) for h in heads]
    out = {}
    for name in al.ALLOCATORS:
        if name in CANDIDATES:
            continue
        try:
            al.check(name, spec, shape, heads[0].trace.steps)
        except al.AllocationError as e:
            out[name] = str(e)
            continue
        out[name] = LEFT_OUT[name]
    return out


def choose(heads: list[al.Head], spec: PolicySpec, by: str, measure: Callable[[list[int]], dict] | None = None, *,
           candidates: Sequence[str] = CANDIDATES, progress: Progress | None = None) -> dict:
    """Each candidate's split at ``spec`` (its budget per head on average, its window) and figure ``by``;
    the best chosen. ``measure(budgets)`` (flat per-head budgets to ``{"kl", "delta_nll", ...}``) is
    needed for the truth. ``{"chosen", "by", "allocation" (rows), "candidates", "left_out"}``."""
    if by not in BY:
        raise ValueError(f"--allocate auto chooses by {', '.join(BY)}, not {by!r}")
    if by != "retained_mass" and measure is None:
        raise ValueError(f"choosing an allocator by {by} needs the truth")
    rows, splits = [], {}
    for i, name in enumerate(candidates):
        part = scaled(progress, i / len(candidates), (i + 1) / len(candidates))
        a = al.allocate(name, heads, spec, progress=part)
        splits[name] = a
        row = {"allocator": name, "retained_mass": al.measure(heads, spec, a).retained_mass,
               "budgets": [int(b) for b in a.budgets]}
        if by != "retained_mass":
            r = measure(list(a.budgets))
            row.update(kl=float(r["kl"]), delta_nll=float(r["delta_nll"]), cached=bool(r.get("cached", False)))
        row["figure"] = float(row[by])
        rows.append(row)
        if progress is not None:
            progress((i + 1) / len(candidates), f"allocate auto: {name} {by} {row['figure']:.4f}")
    sign = 1 if by == "retained_mass" else -1
    best = max(rows, key=lambda r: sign * r["figure"])  # max keeps the first of equals: CANDIDATES' order
    return {"chosen": best["allocator"], "by": by, "allocation": splits[best["allocator"]].rows(),
            "candidates": rows, "left_out": left_out(heads, spec)}


__all__ = ["BY", "CANDIDATES", "LEFT_OUT", "choose", "left_out"]

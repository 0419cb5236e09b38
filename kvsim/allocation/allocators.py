"""Allocation: where a bundle's memory goes, one budget per (layer, KV head), all at uniform's memory.

At ``--budget B`` every allocator spends ``B x heads`` positions in all (``heads``: the bundle's
(layer, KV head) traces); what differs is who holds them. A split is data (``Allocation``: rows of
``layer``, ``kv_head``, ``budget``) that every consumer reads: the bundle replay (``measure``), the
CLI's ``--allocate``, the app's allocation view. The figure is the bundle's mean retained mass, each
(layer, KV head) trace weighed equally (docs/domain.md, "The harness").

- ``uniform``: ``B`` per head (what every other kvsim answer assumes).
- ``pyramidkv`` (Cai et al., arXiv:2406.02069): linear in depth, the first recorded layer the most;
  the reference code's schedule with its ``beta`` = 20 and observation window 8: a layer's positions
  beyond the window run from ``2 (B - 8) - (B - 8) // 20`` down to ``(B - 8) // 20``.
- ``cake`` (Qin et al., ICLR 2025, arXiv:2503.12491): a layer's preference is ``H^(1/tau1) V^(1/tau2)``,
  ``H`` the entropy of the observation window's mean attention (spatial dispersion) and ``V`` the
  summed variance of each position's attention across the window (temporal shift); the window is
  the trace's last 32 rows over the positions before them (CAKE's prefill window, the prompt's last
  32 queries). CAKE tunes tau per model and budget (its LongBench settings run from 0.4 to 2.3); here
  both are 1 unless given.
- ``adakv`` (Feng et al., arXiv:2407.11550): not a static split. A layer's heads share one pool of
  ``B x heads``; each eviction removes the lowest h2o score across the layer's heads, with a floor of
  ``ADAKV_ALPHA x B`` per head, never below the policy's minimum (``kvsim.allocation.split.adakv_floor``):
  ``kvsim.sim.joint``. h2o only: it is the policy whose scores are comparable across heads (each head's
  sums of its own normalised rows).
- ``duo`` (Xiao et al., arXiv:2410.10819): DuoAttention learns a gate per head; kvsim measures one
  instead: a head's *streaming mass*, its retained mass as a streaming head (streaming_llm, 4 sinks,
  at ``B // 4`` positions). The half of the heads with the highest streaming mass stream (sinks and a
  window, ``B // 4`` positions), the others are retrieval heads that share the rest evenly, at most
  the whole trace each, and run the chosen policy.
- ``optimal``: the exact maximum of the bundle's mean retained mass over every split into integer
  budgets, each between the policy's minimum and the trace's length, summing to ``B x heads``: a
  dynamic programme over the heads on each head's budget curve (one replay per budget, the engine's
  sweep), exact because the heads replay independently. It bounds every static split of the same
  policy (uniform, pyramidkv, cake); adakv's pool is not a static split and duo's streaming heads run
  another policy, so neither is bounded by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data.bundle import Bundle
from ..data.store import cache_dir
from ..data.trace import Trace
from ..policies import PolicySpec
from ..policykit import registry
from ..progress import Progress, scaled
from ..sim.joint import joint_replay
from ..sim.simulate import sweep
from .split import (
    ALLOCATORS,
    AllocationError,
    adakv_floor,
    integer_split,
    minimum_budget,
    minimum_why,
    pyramid_schedule,
)

#: splits fixed before the replay, each head replaying the chosen policy alone: optimal bounds them
STATIC = ("uniform", "pyramidkv", "cake")
#: what each allocator does, in one line the app and the CLI quote
SUMMARIES = {
    "uniform": "the same budget for every layer and KV head",
    "pyramidkv": "linear in depth: early layers hold more (PyramidKV, beta 20, window 8)",
    "cake": "layers by their attention's entropy and variance over the last 32 rows (CAKE, tau1 = tau2 = 1)",
    "adakv": "a layer's KV heads share one pool; each eviction takes the lowest h2o score among them (Ada-KV)",
    "duo": "half the heads stream (4 sinks + window at B/4), the others share the rest (DuoAttention, measured)",
    "optimal": "the exact best split of the bundle's mean retained mass (a dynamic programme over heads)",
}
CAKE_WINDOW = 32
DUO_SINKS = 4


@dataclass(frozen=True)
class Head:
    """One (layer, KV head) of a bundle with its trace."""

    layer: int
    kv_head: int
    trace: Trace


@dataclass(frozen=True)
class Allocation:
    allocator: str
    heads: tuple[tuple[int, int], ...]
    budgets: tuple[int, ...]
    #: adakv: each layer's heads share their summed budgets as one pool, each kept at ``floor`` or more
    pooled: bool = False
    floor: int | None = None
    #: duo: which heads stream (sinks and a window) rather than run the policy
    streaming: tuple[bool, ...] | None = None
    #: what the allocator measured to decide (cake's preferences, duo's streaming masses, optimal's value)
    detail: dict = field(default_factory=dict, compare=False)

    @property
    def total(self) -> int:
        return int(sum(self.budgets))

    def rows(self) -> list[dict]:
        out = []
        for i, ((layer, kv_head), budget) in enumerate(zip(self.heads, self.budgets, strict=True)):
            row = {"layer": layer, "kv_head": kv_head, "budget": int(budget)}
            if self.streaming is not None:
                row["streaming"] = bool(self.streaming[i])
            out.append(row)
        return out

    def grid(self) -> tuple[list[int], list[int], np.ndarray]:
        """(layers, KV heads, budgets as a layers x KV heads array; NaN where a layer lacks that head)."""
        layers = sorted({x for x, _ in self.heads})
        kv = sorted({h for _, h in self.heads})
        g = np.full((len(layers), len(kv)), np.nan)
        for (x, h), b in zip(self.heads, self.budgets, strict=True):
            g[layers.index(x), kv.index(h)] = b
        return layers, kv, g


@dataclass(frozen=True)
class Measured:
    """An allocation replayed on a bundle: each head's mean retained mass and the bundle's."""

    allocation: Allocation
    policy: PolicySpec
    head_mass: tuple[float, ...]

    @property
    def retained_mass(self) -> float:
        """The bundle's mean retained mass, every (layer, KV head) weighed equally."""
        return float(np.mean(self.head_mass))

    def layers(self) -> list[dict]:
        by: dict[int, list[float]] = {}
        for (layer, _), m in zip(self.allocation.heads, self.head_mass, strict=True):
            by.setdefault(layer, []).append(m)
        return [{"layer": x, "retained_mass": float(np.mean(v))} for x, v in sorted(by.items())]


def load_heads(bundle: Bundle) -> list[Head]:
    """Every trace of ``bundle`` loaded, in (layer, KV head) order."""
    return [Head(t.layer, t.head, t.load()) for t in bundle.traces]


def check(allocator: str, spec: PolicySpec, shape: list[tuple[int, int]], steps: int) -> int:
    """Refuse what cannot be allocated, before any replay: one line each (AllocationError). Returns the least
    budget a head may get (``minimum_budget``), which ``allocate`` hands on rather than asking again."""
    if allocator not in ALLOCATORS:
        raise AllocationError(f"unknown allocator {allocator!r}; known: {', '.join(ALLOCATORS)}")
    B = spec.budget
    low = minimum_budget(spec)
    if B < low:
        raise AllocationError(f"budget {B} per head is below {minimum_why(spec)}")
    if B > steps:
        raise AllocationError(f"budget {B} per head is above the trace's length ({steps} steps)")
    per_layer: dict[int, int] = {}
    for layer, _ in shape:
        per_layer[layer] = per_layer.get(layer, 0) + 1
    if allocator in ("adakv", "duo") and max(per_layer.values()) == 1:
        what = ("adakv pools a layer's KV heads, and with one KV head per layer the pool is that head: adakv is "
                "uniform within a layer" if allocator == "adakv" else
                "duo splits a layer's KV heads into retrieval and streaming heads, and each layer has one KV head")
        raise AllocationError(f"{what} on this model; use uniform, pyramidkv, cake or optimal")
    if allocator == "adakv" and not registry.can_pool(spec.name):
        raise AllocationError(f"{registry.missing(spec.name, 'pools_heads', 'adakv')} (use --policy "
                              f"{' or '.join(registry.poolers())})")
    if allocator == "duo" and _duo_streaming_budget(B) < DUO_SINKS + 1:
        raise AllocationError(f"duo's streaming heads hold budget // 4 = {B // 4} positions, below "
                              f"{DUO_SINKS} sinks + 1; give --budget {4 * (DUO_SINKS + 1)} or more")
    return low


def check_split(budgets: dict[tuple[int, int], int], spec: PolicySpec, shape: list[tuple[int, int]],
                steps: int, where: str) -> None:
    """An allocation given as data (a file's rows) against the bundle: the same heads, every budget
    between the policy's minimum and the trace's length. ``where`` names the source in the message."""
    missing = [h for h in shape if h not in budgets]
    extra = [h for h in budgets if h not in set(shape)]
    if missing or extra:
        def shown(hs):
            return ", ".join(f"layer {x} KV head {h}" for x, h in hs[:3]) + (" ..." if len(hs) > 3 else "")
        n_layers = len({x for x, _ in shape})
        heads = len(shape) // max(n_layers, 1)
        got = f"{len(budgets)} rows"
        what = f"has {shown(extra)}, which the bundle lacks" if extra else f"lacks {shown(missing)}"
        raise AllocationError(f"{where}: an allocation for another model's shape ({got}; the bundle has "
                              f"{n_layers} layers x {heads} KV head{'s' if heads != 1 else ''}): it {what}")
    low = minimum_budget(spec)
    for (x, h), b in budgets.items():
        if b < low:
            raise AllocationError(f"{where}: layer {x} KV head {h}: budget {b} is below {minimum_why(spec)}")
        if b > steps:
            raise AllocationError(f"{where}: layer {x} KV head {h}: budget {b} is above the trace's length "
                                  f"({steps} steps)")


def from_budgets(budgets: dict[tuple[int, int], int], heads: list[Head], name: str = "file") -> Allocation:
    return Allocation(name, tuple((h.layer, h.kv_head) for h in heads),
                      tuple(int(budgets[(h.layer, h.kv_head)]) for h in heads))


def _per_layer(heads: list[Head], layer_weight: dict[int, float]) -> np.ndarray:
    """A layer's weight shared evenly by its KV heads: each head's weight."""
    count: dict[int, int] = {}
    for h in heads:
        count[h.layer] = count.get(h.layer, 0) + 1
    return np.array([layer_weight[h.layer] / count[h.layer] for h in heads])


def cake_preference(trace: Trace, tau1: float = 1.0, tau2: float = 1.0, window: int = CAKE_WINDOW) -> dict:
    """CAKE's layer preference measured on one trace: ``{"entropy", "variance", "preference"}``."""
    T = trace.steps
    w = min(window, T - 1)
    rows = np.asarray(trace.derived.rows(T - w + 1, T + 1), dtype=np.float64)[:, : T - w + 1]
    mean = rows.mean(axis=0)
    p = mean[mean > 0] / mean.sum() if mean.sum() > 0 else mean[mean > 0]
    entropy = float(-(p * np.log(p)).sum())
    variance = float(rows.var(axis=0).sum())
    return {"entropy": entropy, "variance": variance,
            "preference": entropy ** (1.0 / tau1) * variance ** (1.0 / tau2)}


def _duo_streaming_budget(B: int) -> int:
    return B // 4


def allocate(allocator: str, heads: list[Head], spec: PolicySpec, *, progress: Progress | None = None,
             tau1: float = 1.0, tau2: float = 1.0) -> Allocation:
    """The split ``allocator`` makes of ``spec.budget x len(heads)`` positions for ``spec`` on ``heads``."""
    shape = [(h.layer, h.kv_head) for h in heads]
    steps = heads[0].trace.steps
    low = check(allocator, spec, shape, steps)  # the policy's least budget per head, asked once
    B, n = spec.budget, len(heads)
    total = B * n
    keys = tuple(shape)
    if allocator in ("uniform", "adakv"):
        floor = adakv_floor(spec, low) if allocator == "adakv" else None
        return Allocation(allocator, keys, (B,) * n, pooled=allocator == "adakv", floor=floor)
    if allocator == "pyramidkv":
        layers = sorted({h.layer for h in heads})
        sched = pyramid_schedule(B, len(layers))
        weights = np.array([sched[layers.index(h.layer)] for h in heads])  # per head: a layer's heads alike
        return Allocation(allocator, keys, tuple(int(b) for b in integer_split(weights, total, low, steps)))
    if allocator == "cake":
        prefs = [cake_preference(h.trace, tau1, tau2) for h in heads]
        layer_pref: dict[int, list[float]] = {}
        for h, p in zip(heads, prefs, strict=True):
            layer_pref.setdefault(h.layer, []).append(p["preference"])
        weights = _per_layer(heads, {x: float(np.mean(v)) for x, v in layer_pref.items()})
        return Allocation(allocator, keys, tuple(int(b) for b in integer_split(weights, total, low, steps)),
                          detail={"preference": [p["preference"] for p in prefs], "tau1": tau1, "tau2": tau2})
    if allocator == "duo":
        return _duo(heads, spec, low, progress)
    return _optimal(heads, spec, low, progress)


def _duo(heads: list[Head], spec: PolicySpec, low: int, progress: Progress | None) -> Allocation:
    B, n, steps = spec.budget, len(heads), heads[0].trace.steps
    s = _duo_streaming_budget(B)
    stream_spec = PolicySpec.of("streaming_llm", s, sinks=DUO_SINKS)
    scores = []
    for i, h in enumerate(heads):
        scores.append(_mass(h.trace, stream_spec))
        if progress is not None:
            progress((i + 1) / n, "duo: each head's streaming mass")
    k = n // 2
    order = np.argsort(-np.asarray(scores), kind="stable")
    streaming = np.zeros(n, dtype=bool)
    streaming[order[:k]] = True
    budgets = np.full(n, s, dtype=np.int64)
    rest = B * n - s * k
    retrieval = np.flatnonzero(~streaming)
    room = min(rest, steps * retrieval.size)
    budgets[retrieval] = integer_split(np.ones(retrieval.size), room, low, steps)
    if rest > room:  # retrieval heads already hold their whole trace: the streaming heads get what is left
        budgets[order[:k]] = integer_split(np.ones(k), s * k + rest - room, s, steps)
    return Allocation("duo", tuple((h.layer, h.kv_head) for h in heads), tuple(int(b) for b in budgets),
                      streaming=tuple(bool(x) for x in streaming), detail={"streaming_mass": scores})


def budget_curves(heads: list[Head], spec: PolicySpec, low: int, high: int,
                  progress: Progress | None = None) -> np.ndarray:
    """float64 ``(heads, high - low + 1)``: each head's mean retained mass at every budget ``low .. high``
    (one engine sweep over the budget per head)."""
    out = np.empty((len(heads), high - low + 1))
    values = list(range(low, high + 1))
    for i, h in enumerate(heads):
        part = scaled(progress, i / len(heads), (i + 1) / len(heads))
        rows = sweep(h.trace, spec, param="budget", values=values, progress=None)
        out[i] = [r["retained_mass"] for r in rows]
        if part is not None:
            part(1.0, f"budget curve of layer {h.layer} KV head {h.kv_head} (head {i + 1} of {len(heads)}, "
                      f"{len(values)} budgets each)")
    return out


def best_split(curves: np.ndarray, low: int, total: int) -> tuple[np.ndarray, float]:
    """The exact maximum of ``sum_h curves[h, b_h - low]`` over integer ``b_h >= low`` (at most
    ``low + curves.shape[1] - 1``) with ``sum_h b_h == total``: (budgets, the summed value). A dynamic
    programme over heads on the spare positions ``x = sum (b_h - low)``: ``f_h(x) = max_e f_{h-1}(x - e) +
    curves[h, e]``, O(heads x spare x curve length). On equal values the smaller budget of the later
    head wins (strict improvement only)."""
    n, width = curves.shape
    spare = total - low * n
    if spare < 0 or spare > (width - 1) * n:
        raise AllocationError(f"{total} positions cannot be split over {n} heads between {low} and {low + width - 1}")
    f = np.full(spare + 1, -np.inf)
    f[0] = 0.0
    choice = np.zeros((n, spare + 1), dtype=np.int32)
    for h in range(n):
        g = np.full(spare + 1, -np.inf)
        pick = np.zeros(spare + 1, dtype=np.int32)
        for e in range(min(width - 1, spare) + 1):
            cand = f[: spare + 1 - e] + curves[h, e]
            better = cand > g[e:]
            g[e:][better] = cand[better]
            pick[e:][better] = e
        f, choice[h] = g, pick
    budgets = np.empty(n, dtype=np.int64)
    x = spare
    for h in range(n - 1, -1, -1):
        e = int(choice[h, x])
        budgets[h] = low + e
        x -= e
    return budgets, float(f[spare])


def optimal(heads: list[Head], spec: PolicySpec, *, progress: Progress | None = None) -> Allocation:
    """``optimal``: each head's budget curve, then ``best_split``. Progress: the curves (most of the
    time), then the programme."""
    return _optimal(heads, spec, minimum_budget(spec), progress)


def _optimal(heads: list[Head], spec: PolicySpec, low: int, progress: Progress | None) -> Allocation:
    B, n, steps = spec.budget, len(heads), heads[0].trace.steps
    total = B * n
    high = min(steps, total - (n - 1) * low)
    curves = budget_curves(heads, spec, low, high, scaled(progress, 0.0, 0.95))
    if progress is not None:
        progress(0.95, f"optimal: the best split of {total} positions over {n} heads")
    budgets, value = best_split(curves, low, total)
    if progress is not None:
        progress(1.0, "optimal: done")
    return Allocation("optimal", tuple((h.layer, h.kv_head) for h in heads), tuple(int(b) for b in budgets),
                      detail={"mass": value / n})


def _mass(trace: Trace, spec: PolicySpec) -> float:
    """One replay's mean retained mass. A one-value sweep: the engine wherever it covers the policy, even
    inside the app's ``compiled_only`` (the same number as ``replay``, bit for bit), so a bundle of
    heads does not fall back to the reference loop head by head."""
    return sweep(trace, spec)[0]["retained_mass"]


def measure(heads: list[Head], spec: PolicySpec, allocation: Allocation, *,
            progress: Progress | None = None) -> Measured:
    """Replay ``allocation`` on ``heads``: each head its own budget (a static split; duo's streaming heads
    run streaming_llm), or each layer's pool jointly (adakv)."""
    n = len(heads)
    mass = np.empty(n)
    if allocation.pooled:
        layers = sorted({h.layer for h in heads})
        for j, x in enumerate(layers):
            idx = [i for i, h in enumerate(heads) if h.layer == x]
            pool = sum(allocation.budgets[i] for i in idx)
            series = joint_replay([heads[i].trace for i in idx], pool, allocation.floor, spec.params.recent_window)
            mass[idx] = series.mean(axis=1)
            if progress is not None:
                progress((j + 1) / len(layers), f"adakv: layer {x}'s heads replayed jointly")
        return Measured(allocation, spec, tuple(float(m) for m in mass))
    for i, (h, b) in enumerate(zip(heads, allocation.budgets, strict=True)):
        streaming = allocation.streaming is not None and allocation.streaming[i]
        s = PolicySpec.of("streaming_llm", b, sinks=DUO_SINKS) if streaming else spec.replace(budget=int(b))
        mass[i] = _mass(h.trace, s)
        if progress is not None:
            progress((i + 1) / n, f"{allocation.allocator}: layer {h.layer} KV head {h.kv_head}")
    return Measured(allocation, spec, tuple(float(m) for m in mass))


def refusals(spec: PolicySpec, shape: list[tuple[int, int]], steps: int) -> dict[str, str]:
    """Each allocator that cannot split ``spec``'s memory over ``shape`` (a bundle's heads, ``steps`` long),
    with ``check``'s one line why: what a view says of those it does not show, and, when uniform is among
    them (a budget below the policy's minimum or above the trace), of the whole comparison."""
    out = {}
    for name in ALLOCATORS:
        try:
            check(name, spec, shape, steps)
        except AllocationError as e:
            out[name] = str(e)
    return out


def usable(heads: list[Head], spec: PolicySpec) -> list[str]:
    """The allocators that apply to ``heads`` and ``spec`` (the others' refusal is ``check``'s)."""
    refused = refusals(spec, [(h.layer, h.kv_head) for h in heads], heads[0].trace.steps)
    return [name for name in ALLOCATORS if name not in refused]


def _told(progress: Progress | None, what: str, name: str) -> Progress | None:
    """``progress`` with each note led by ``what`` (which allocator of how many) in place of the
    allocator's own ``name: ``, so a bar that counts the whole comparison says which part of it is running."""
    if progress is None:
        return None

    def report(fraction: float | None, note: str = "") -> None:
        note = note.removeprefix(f"{name}: ")
        progress(fraction, f"{what}: {note}" if note else what)

    return report


def compare(heads: list[Head], spec: PolicySpec, allocators: list[str] | None = None, *,
            progress: Progress | None = None) -> list[dict]:
    """Each allocator's split and mass at ``spec``'s memory, with the share of the gap from uniform to
    the optimum it closes (``gap_closed``: 0 is uniform, 1 the optimum; None when the two are equal)."""
    names = usable(heads, spec) if allocators is None else allocators
    measured = {}
    for i, name in enumerate(names):
        part = _told(scaled(progress, i / len(names), (i + 1) / len(names)), f"allocator {i + 1} of {len(names)}, {name}",
                     name)
        if part is not None:
            part(0.0, "")
        alloc = allocate(name, heads, spec, progress=part)
        measured[name] = measure(heads, spec, alloc)
    base = measured["uniform"].retained_mass if "uniform" in measured else None
    best = measured["optimal"].retained_mass if "optimal" in measured else None
    out = []
    for name, m in measured.items():
        gap = None
        if base is not None and best is not None and best > base:
            gap = (m.retained_mass - base) / (best - base)
        out.append({"allocator": name, "retained_mass": m.retained_mass, "gap_closed": gap, "measured": m})
    return out


#: the comparisons' disk cache (kind allocation in docs/caches.md): bump when what ``compare`` measures changes
COMPARE_VERSION = 1


def _plain(value):
    """``value`` with NumPy scalars and arrays as plain Python numbers and lists (JSON-ready, exact)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def bundle_digest(bundle: Bundle) -> str:
    """sha256 over the bundle's manifest and every trace file it names, in order: what a comparison depends
    on besides the policy (a re-recorded bundle is a new key; 13 MB for the shipped bundle, ~30 ms)."""
    import hashlib

    digest = hashlib.sha256()
    for path in (bundle.path / "manifest.json", *(t.path for t in bundle.traces)):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def compare_path(bundle: Bundle, spec: PolicySpec, allocators: list[str] | None = None) -> Path:
    """Where ``compare_bundle``'s rows for ``bundle`` at ``spec`` are kept: keyed by the bundle's contents,
    the policy with its budget and parameters, the allocators asked for and this module's version."""
    import hashlib
    import json

    key = {"version": COMPARE_VERSION, "bundle": bundle_digest(bundle), "policy": spec.name, "budget": spec.budget,
           "params": _plain(dict(spec.params)), "allocators": allocators}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "allocation" / f"compare-v{COMPARE_VERSION}-{digest}.json"


def _row_to_doc(row: dict) -> dict:
    a: Allocation = row["measured"].allocation
    return {"allocator": row["allocator"], "retained_mass": row["retained_mass"], "gap_closed": row["gap_closed"],
            "allocation": {"allocator": a.allocator, "heads": [list(h) for h in a.heads], "budgets": _plain(a.budgets),
                           "pooled": a.pooled, "floor": a.floor,
                           "streaming": None if a.streaming is None else list(a.streaming), "detail": _plain(a.detail)},
            "head_mass": _plain(row["measured"].head_mass)}


def _row_from_doc(doc: dict, spec: PolicySpec) -> dict:
    a = doc["allocation"]
    allocation = Allocation(a["allocator"], tuple(tuple(h) for h in a["heads"]), tuple(a["budgets"]), a["pooled"],
                            a["floor"], None if a["streaming"] is None else tuple(a["streaming"]), a["detail"])
    measured = Measured(allocation, spec, tuple(doc["head_mass"]))
    return {"allocator": doc["allocator"], "retained_mass": doc["retained_mass"], "gap_closed": doc["gap_closed"],
            "measured": measured}


def compare_bundle(bundle: Bundle, spec: PolicySpec, allocators: list[str] | None = None, *,
                   progress: Progress | None = None, use_cache: bool = True) -> list[dict]:
    """``compare`` on ``bundle``'s heads, kept on disk (``compare_path``): a comparison is measured once per
    install, not once per server start; a second call reads it back, the same figures to the bit (JSON keeps
    a float exactly), without loading the bundle's traces. An unreadable cache file is measured again."""
    import json

    from ..data.files import atomic_write

    path = compare_path(bundle, spec, allocators)
    if use_cache and path.is_file():
        try:
            return [_row_from_doc(d, spec) for d in json.loads(path.read_text(encoding="utf-8"))["rows"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # damaged or from another layout: measured again below, and rewritten
    rows = compare(load_heads(bundle), spec, allocators, progress=progress)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"bundle": bundle.name, "policy": spec.name, "budget": spec.budget,
                           "rows": [_row_to_doc(r) for r in rows]})
        atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    return rows


__all__ = [
    "ALLOCATORS",
    "STATIC",
    "SUMMARIES",
    "Allocation",
    "AllocationError",
    "Head",
    "Measured",
    "allocate",
    "best_split",
    "budget_curves",
    "check",
    "check_split",
    "compare",
    "compare_bundle",
    "integer_split",
    "load_heads",
    "measure",
    "minimum_budget",
    "optimal",
    "pyramid_schedule",
    "refusals",
]

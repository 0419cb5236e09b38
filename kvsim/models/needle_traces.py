"""A pass-key trial's attention as traces (issue 35, docs/needle.md): the exact optimum's kept sets, and
a trial the kept-positions view can open.

- **The exact optimum** (``optimum``): the full-cache control's attention, recomputed by one
  teacher-forced pass over the positions the control saw (the prompt and what it wrote,
  ``kvsim.models.recorder``: per (layer, KV head) the query heads' mean, the own weight dropped, each
  row renormalised), replayed through kvsim's offline ``optimal`` at each head's budget. What the best
  possible cache of that size keeps of the key, per layer, and when it lets the key's tokens go.
- **A trial's own attention** (``save_bundle``): the rows each step of a policy's trial showed each
  (layer, KV head)'s policy (``needle_runs._Departures``: row t over the positions held when query t came,
  zero elsewhere), written as a bundle in the cache directory's recordings (``<cache>/recordings/``),
  which the app offers as traces (``needle-<digest>:L05``). Replayed through the same policy at the same
  budget, the simulator's kept sets are the trial's own (``departures_of``; tests/test_needle_traces.py
  checks the departures equal).

torch is imported inside the functions that decode.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..data.bundle import MANIFEST, load_bundle, write_manifest
from ..data.catalog import RECORDINGS_DIR
from ..data.store import cache_dir
from ..data.trace import Trace, TraceError, from_array, save_npz

#: the bundles of needle trials begin so (``<cache>/recordings/needle-<digest>``)
PREFIX = "needle-"


def departures_of(kept_history: np.ndarray, steps: int) -> np.ndarray:
    """Each position's departure step from a replay's kept sets (``ReplayResult.kept_history``, ``(T,
    budget)``, row t - 1 the positions held after step t, -1 padded), -1 for held to the end. A position
    p >= 1 is held from step p until the step it leaves (a position never comes back), so the steps at
    which it is held count ``departure - p``; position 0 is held before step 1, so ``departure - 1``."""
    kept = np.asarray(kept_history)
    counts = np.bincount(kept[kept >= 0].ravel(), minlength=steps + 1)[: steps + 1]
    p = np.arange(steps + 1)
    left = np.where(p == 0, counts + 1, p + counts)
    return np.where(left > steps, -1, left).astype(np.int32)


def replay_departures(trace: Trace, policy: str, budget: int, **params) -> np.ndarray:
    """The departures (``departures_of``) of ``policy`` at ``budget`` replayed through ``trace``."""
    from ..sim.simulate import replay

    result = replay(trace, policy, budget=budget, record_kept=True, **params)
    return departures_of(result.kept_history, trace.steps)


def control_traces(model, ids: list[int], name: str = "control") -> dict[tuple[int, int], Trace]:
    """The full cache's attention over ``ids`` per (layer, KV head), as traces: one teacher-forced pass
    (what decoding with nothing evicted computes, row for row)."""
    import torch

    from .qkv_capture import CHUNK_ELEMENTS
    from .recorder import record_attention

    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    steps = len(ids) - 1
    out: dict[tuple[int, int], Trace] = {}

    def sink(layer, rows, values, vectors):
        from ..data.trace import unpack_lower

        for h in range(rows.shape[0]):
            a = unpack_lower(rows[h], steps)
            a[0, 0] = 1.0  # row 0 has no earlier position; a trace's row 0 is never read
            out[(layer, h)] = from_array(a, name=f"{name}-L{layer:02d}H{h}")

    with torch.no_grad():
        record_attention(model, torch.tensor([ids], dtype=torch.long), list(range(cfg.num_hidden_layers)), "mean",
                         CHUNK_ELEMENTS, sink)
    return out


def optimum(traces: dict[tuple[int, int], Trace], budgets: list[list[int]], block_size: int = 1) -> np.ndarray:
    """``optimal``'s departures per (layer, KV head) at each head's budget, ``(layers, KV heads, T + 1)``;
    a head whose budget holds every position evicts nothing (-1 throughout). ``block_size`` above 1: the
    optimum under blocks of that size (``--policy optimal --block-size S``; docs/serving.md)."""
    from ..policykit.layouts import Layout

    layers, heads = len(budgets), len(budgets[0])
    steps = next(iter(traces.values())).steps
    left = np.full((layers, heads, steps + 1), -1, dtype=np.int32)
    layout = Layout(block_size) if block_size > 1 else None
    for (x, h), trace in traces.items():
        if budgets[x][h] <= steps:
            left[x, h] = replay_departures(trace, "optimal", budgets[x][h], layout=layout)
    return left


def bundle_name(cache_key: dict) -> str:
    """The bundle a trial's attention is kept as: named by the trial's cache key."""
    return PREFIX + hashlib.sha256(json.dumps(cache_key, sort_keys=True).encode()).hexdigest()[:16]


def bundle_path(cache_key: dict) -> Path:
    return cache_dir() / RECORDINGS_DIR / bundle_name(cache_key)


def has_bundle(cache_key: dict) -> bool:
    try:
        load_bundle(bundle_path(cache_key))
    except TraceError:
        return False
    return True


def trial_trace(rows: np.ndarray, name: str, meta: dict) -> Trace | None:
    """A trial's rows of one (layer, KV head) as a trace, or None when some step showed its policy no
    weight at all (a sliding layer whose held positions all lay outside its window: that query read only
    itself, and a trace's row must sum to 1)."""
    a = np.array(rows, dtype=np.float32)
    a[0, 0] = 1.0
    if (a[1:].sum(axis=1) <= 0).any():
        return None
    return from_array(a, name=name, meta=meta)


def save_bundle(cache_key: dict, rows: dict[tuple[int, int], np.ndarray], meta: dict, model: str,
                kinds: list[str], window: int | None) -> dict:
    """Write a trial's attention (``rows`` per (layer, KV head)) as a bundle in the cache's recordings;
    ``meta`` goes into every trace (the key's positions, the policy, the budget). Returns what was
    written: the bundle's name and the layers left out (a row with no weight, ``trial_trace``)."""
    name = bundle_name(cache_key)
    folder = bundle_path(cache_key)
    folder.mkdir(parents=True, exist_ok=True)
    entries, skipped = [], []
    steps = None
    for (x, h), a in sorted(rows.items()):
        trace = trial_trace(a, f"{name}-L{x:02d}H{h}", {**meta, "layer": x, "head": h})
        if trace is None:
            skipped.append([x, h])
            continue
        steps = trace.steps
        file = f"{name}-L{x:02d}H{h}.npz"
        save_npz(trace, folder / file, packed=True)
        sliding = kinds[x] == "sliding"
        entries.append({"file": file, "layer": x, "head": h, "attention": "sliding" if sliding else "global",
                        "sliding_window": window if sliding else None})
    if not entries:
        return {"bundle": None, "skipped": skipped}
    write_manifest(folder, {"name": name, "model": model, "steps": steps, "gqa": "mean", "dtype": "float32",
                            "store": "dense", "layers": sorted({e["layer"] for e in entries}),
                            "text": {"source": "kvsim needle trial", "licence": "generated filler"},
                            "needle": meta, "traces": entries})
    return {"bundle": name, "skipped": skipped}


def bundle_meta(name: str) -> dict | None:
    """The needle meta a trial's bundle carries (the key's positions, the policy), or None."""
    folder = cache_dir() / RECORDINGS_DIR / name
    try:
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("needle")
    except (OSError, ValueError):
        return None


__all__ = ["PREFIX", "bundle_meta", "bundle_name", "control_traces", "departures_of", "has_bundle", "optimum",
           "replay_departures", "save_bundle", "trial_trace"]

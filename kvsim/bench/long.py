"""``python -m kvsim bench --long [--trace BUNDLE]``: query/key traces at length.

On a bundle of query/key traces (``"store": "qk"``; by default the long recording, ``python -m kvsim
record --preset long``: Gemma-3-270M over 32,768 tokens, 32,767 steps), one (layer, KV head) of a
global layer (the first), and the whole bundle:

1. the normaliser pass (every row's log-sum-exp per query head, its denominator and top-32 positions),
   timed on this trace, or read back when the cache holds it;
2. one h2o replay at budget 1024 on the first T steps, T = 4096, 8192, 16384 and the whole recording
   (``QKTrace.prefix``, which shares the normalisers), best of two after a warm-up: seconds, and
   microseconds per step, which stay flat when the cost is linear in T at a fixed budget;
3. an h2o sweep of 64 recent windows (15, 31, .., 1023) at budget 1024 on the longest;
4. ``tune`` of the whole bundle (h2o, budget 1024, the same 64 windows, every trace's normalisers
   cached first), serially and on a local Dask cluster of one process per core;
5. the row pass the app's trace views and ``describe`` read past the dense limit (``kvsim.data.row_stats``),
   timed on this trace, or read back when the cache holds it;
6. storage: each file's bytes against the dense equivalents (the packed float16 lower triangle, what
   the shipped dense traces hold before compression, and the float32 interchange matrix).

Targets (``--check`` exits 1 on a miss): the replay at the longest length at most 2 s, the sweep at
most 30 s, and per-step cost at the longest within 1.5x of the shortest (linear growth).

``--study`` measures instead what length changes (docs/long-context.md): ``tune`` at
budget 256 over every window 1..255 of the global layers on the first 1024, 2048, 8192 steps and all of
them (of every layer at the shortest and the longest): each global layer's best and recommended window
and sink share (the mean weight of positions 0..3 over steps t > 4) at each length, and the per-layer
windows of 1024 steps against those of the longest, with the retained mass at the longest with each.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from ..analysis.tune import tune
from ..cluster import dask_available
from ..data.bundle import MANIFEST, Bundle, BundleError
from ..data.catalog import resolve_bundle, shipped_bundles
from ..data.qk import ROW_BLOCK, QKTrace
from ..models.record_cache import preset
from ..policykit.base import WINDOW
from ..progress import Progress
from ..sim.simulate import replay, sweep
from .speed import timed

LENGTHS = (4096, 8192, 16384, 32768)
BUDGET = 1024
WINDOWS = list(range(15, BUDGET, 16))  # 64 windows
REPLAY_SECONDS, SWEEP_SECONDS, LINEAR_RATIO = 2.0, 30.0, 1.5
STUDY_LENGTHS, STUDY_BUDGET, SINKS = (1024, 2048, 8192, 32768), 256, 4


def long_bundle(spec: str | None) -> Bundle:
    """The bundle named, else the long recording ``kvsim record --preset long`` keeps in the cache, else
    a shipped query/key bundle of at least 16,385 steps."""
    if spec:
        bundle = resolve_bundle(spec)
    else:
        folders = [preset("long").out, *shipped_bundles().values()]
        found = [b for b in (resolve_bundle(str(p)) for p in folders if (p / MANIFEST).is_file())
                 if b.manifest.get("store") == "qk" and b.steps > LENGTHS[-2]]
        if not found:
            raise BundleError("no long query/key recording: make it with `python -m kvsim record --preset long` "
                              "(docs/long-context.md) or name a bundle with --trace")
        bundle = found[0]
    if bundle.manifest.get("store") != "qk":
        raise BundleError(f"{bundle.name}: not a bundle of query/key traces (its manifest's 'store' is not 'qk')")
    return bundle


def measured_lengths(wanted: tuple[int, ...], steps: int) -> list[int]:
    """The lengths of ``wanted`` shorter than the recording, then the recording's own (32,767 steps for
    the long preset stands for 32k)."""
    return [t for t in wanted if t < steps] + [steps]


def run(spec: str | None = None, with_tune: bool = True, progress: Progress | None = None) -> dict:
    """Every measurement above, in one document (``kind: "long"``)."""
    def say(note: str) -> None:
        if progress is not None:
            progress(None, note)

    bundle = long_bundle(spec)
    entry = next((t for t in bundle.traces if t.attention == "global"), bundle.traces[0])
    doc: dict = {"kind": "long", "bundle": bundle.name, "path": str(bundle.path), "steps": bundle.steps,
                 "trace": entry.name, "budget": BUDGET, "windows": [WINDOWS[0], WINDOWS[-1], len(WINDOWS)],
                 "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    say(f"loading {entry.name} and its normalisers")
    trace = entry.load()
    assert isinstance(trace, QKTrace)
    doc["normalisers_seconds"], _ = timed(trace.derived.normalisers)
    say(f"the row pass of {entry.name} (what the app and describe read past the dense limit)")
    doc["row_pass_seconds"], _ = timed(trace.derived.row_stats)
    doc["replay"] = _replays(trace, say)
    longest = trace.prefix(doc["replay"][-1]["steps"])
    say(f"h2o sweep of {len(WINDOWS)} windows at {longest.steps} steps")
    doc["sweep_seconds"], _ = timed(lambda: sweep(longest, "h2o", BUDGET, WINDOW, WINDOWS))
    if with_tune:
        doc["tune"] = _tune(bundle, say)
    doc["storage"] = _storage(bundle)
    return verdict(doc)


def _replays(trace: QKTrace, say) -> list[dict]:
    rows = []
    for T in measured_lengths(LENGTHS, trace.steps):
        say(f"h2o replay at budget {BUDGET}, {T} steps")
        part = trace.prefix(T)
        replay(part, "h2o", budget=BUDGET)  # the first call: kernels loaded, top-k handed over
        seconds, result = timed(lambda p=part: replay(p, "h2o", budget=BUDGET), repeat=2)
        rows.append({"steps": T, "seconds": seconds, "us_per_step": seconds / T * 1e6,
                     "retained_mass": result.retained_mass})
    return rows


def _tune(bundle: Bundle, say) -> dict:
    t0 = time.perf_counter()
    for i, entry in enumerate(bundle.traces):
        say(f"normalisers of {entry.name} ({i + 1} of {len(bundle.traces)}; computed once, then read from the cache)")
        entry.load().derived.normalisers()
    out = {"normalisers_seconds": time.perf_counter() - t0}
    say(f"tune of {len(bundle.traces)} traces, serial")
    out["serial_seconds"], result = timed(lambda: tune(bundle, "h2o", BUDGET, windows=WINDOWS, by="retained_mass"))
    out["recommended_windows"] = {t.name: t.recommended_window for t in result.traces}
    if dask_available():
        workers = os.cpu_count() or 1
        say(f"tune of {len(bundle.traces)} traces on a local Dask cluster of {workers} processes")
        out["dask_seconds"], _ = timed(lambda: tune(bundle, "h2o", BUDGET, windows=WINDOWS, by="retained_mass", scheduler="local",
                                                     workers=workers))
        out["dask_workers"] = workers
    return out


def _storage(bundle: Bundle) -> dict:
    rows = []
    for entry in bundle.traces:
        T = bundle.steps
        rows.append({"trace": entry.name, "bytes": entry.path.stat().st_size, "dense_packed_float16_bytes": T * (T + 1),
                     "dense_float32_bytes": 4 * (T + 1) ** 2})
    total = {k: sum(r[k] for r in rows) for k in ("bytes", "dense_packed_float16_bytes", "dense_float32_bytes")}
    return {"per_trace": rows[0] | {"traces": len(rows)}, "bundle": total}


def verdict(doc: dict) -> dict:
    last, first = doc["replay"][-1], doc["replay"][0]
    targets = {f"h2o replay at {last['steps']} steps <= {REPLAY_SECONDS:g} s": last["seconds"] <= REPLAY_SECONDS,
               f"sweep of {len(WINDOWS)} windows at {last['steps']} steps <= {SWEEP_SECONDS:g} s":
                   doc["sweep_seconds"] <= SWEEP_SECONDS,
               f"per-step cost at {last['steps']} within {LINEAR_RATIO}x of {first['steps']}":
                   last["us_per_step"] <= LINEAR_RATIO * first["us_per_step"]}
    missed = sum(not ok for ok in targets.values())
    return doc | {"targets": targets, "failed_targets": missed, "total_targets": len(targets),
                  "result": "PASS" if not missed else "FAIL"}


def render(doc: dict) -> str:
    mb = 2 ** 20
    lines = [f"query/key bundle {doc['bundle']} ({doc['steps']} steps), trace {doc['trace']}, h2o at budget {doc['budget']}",
             f"machine: {doc['machine']['cpus']} CPUs, Python {doc['machine']['python']}",
             f"normaliser pass of {doc['trace']}: {doc['normalisers_seconds']:.2f} s (0 when read from the cache)",
             f"row pass of {doc['trace']} (features, describe, the trace view): {doc.get('row_pass_seconds', 0.0):.2f} s "
             "(0 when read from the cache)", "",
             f"{'steps':>6}  {'replay s':>9}  {'us/step':>8}  {'retained mass':>13}"]
    lines += [f"{r['steps']:>6}  {r['seconds']:>9.3f}  {r['us_per_step']:>8.1f}  {r['retained_mass']:>13.4f}" for r in doc["replay"]]
    lines += ["", f"sweep of {doc['windows'][2]} recent windows ({doc['windows'][0]}..{doc['windows'][1]}) at "
              f"{doc['replay'][-1]['steps']} steps: {doc['sweep_seconds']:.2f} s"]
    if "tune" in doc:
        t = doc["tune"]
        lines.append(f"tune of the bundle ({len(t['recommended_windows'])} traces, the same windows): serial "
                     f"{t['serial_seconds']:.1f} s" + (f", Dask ({t['dask_workers']} processes) {t['dask_seconds']:.1f} s"
                                                       if "dask_seconds" in t else ", Dask not installed")
                     + f"; normalisers first {t['normalisers_seconds']:.1f} s")
    s = doc["storage"]
    p, b = s["per_trace"], s["bundle"]
    lines += ["", f"storage per trace: {p['bytes'] / mb:.1f} MB as queries/keys/values, dense "
              f"{p['dense_packed_float16_bytes'] / mb:.0f} MB (packed float16), {p['dense_float32_bytes'] / mb:.0f} MB (float32 matrix)",
              f"storage, bundle of {p['traces']}: {b['bytes'] / mb:.0f} MB, dense {b['dense_packed_float16_bytes'] / mb:.0f} MB "
              f"(packed float16), {b['dense_float32_bytes'] / mb:.0f} MB (float32)", "", "targets:"]
    width = max(len(k) for k in doc["targets"])
    lines += [f"  {k:<{width}}  {'PASS' if ok else 'FAIL'}" for k, ok in doc["targets"].items()]
    lines.append(f"overall: {doc['result']} ({doc['failed_targets']} of {doc['total_targets']} targets missed)")
    return "\n".join(lines)


def sink_share(trace: QKTrace, sinks: int = SINKS) -> float:
    """The mean over steps t > ``sinks`` of row t's weight on positions 0 .. sinks-1, computed a block of
    rows at a time at those positions only (O(T x sinks))."""
    T, cols = trace.steps, np.arange(sinks, dtype=np.int64)
    total = 0.0
    for t0 in range(sinks + 1, T + 1, ROW_BLOCK):
        t1 = min(T + 1, t0 + ROW_BLOCK)
        out = np.zeros((t1 - t0, sinks), dtype=np.float32)
        trace.derived.weights_block(t0, t1, cols, out)
        total += float(out.astype(np.float64).sum())
    return total / (T - sinks)


def study(spec: str | None = None, progress: Progress | None = None) -> dict:
    """What length changes (the module docstring's ``--study``), in one document (``kind: "long-study"``)."""
    bundle = long_bundle(spec)
    lengths = measured_lengths(STUDY_LENGTHS, bundle.steps)
    traces = [e.load() for e in bundle.traces]
    doc: dict = {"kind": "long-study", "bundle": bundle.name, "budget": STUDY_BUDGET, "lengths": lengths,
                 "global": [], "per_layer": {}}
    tuned = {}
    for T in lengths:  # every layer at the shortest and the longest (the per-layer windows), the global ones between
        chosen = [i for i, e in enumerate(bundle.traces) if T in (lengths[0], lengths[-1]) or e.attention == "global"]
        if progress is not None:
            progress(None, f"tune of {len(chosen)} traces on their first {T} steps, budget {STUDY_BUDGET}")
        parts = [traces[i].prefix(T) for i in chosen]
        tuned[T] = tune(parts, "h2o", STUDY_BUDGET, by="retained_mass")
        doc["per_layer"][T] = {r["layer"]: r["recommended_window"] for r in tuned[T].per_layer()}
        for i, part, t in zip(chosen, parts, tuned[T].traces, strict=True):
            e = bundle.traces[i]
            if e.attention == "global":
                doc["global"].append({"layer": e.layer, "head": e.head, "steps": T, "best_window": t.best_window,
                                      "best_mass": t.best_mass, "recommended_window": t.recommended_window,
                                      "recommended_mass": t.recommended_mass, "sink_share": sink_share(part)})
    short, long_ = lengths[0], lengths[-1]
    held = []
    for r in tuned[long_].per_layer():
        ts = [t for t in tuned[long_].traces if t.layer == r["layer"]]
        w_short = doc["per_layer"][short][r["layer"]]
        held.append({"layer": r["layer"], f"window_{short}": w_short, f"window_{long_}": r["recommended_window"],
                     f"mass_{long_}_with_window_{short}": float(np.mean([t.retained_mass[w_short - 1] for t in ts])),
                     f"mass_{long_}_with_own_window": r["recommended_mass"]})
    doc["windows_held"] = held
    return doc


def render_study(doc: dict) -> str:
    lines = [f"what length changes: {doc['bundle']}, h2o at budget {doc['budget']}, every recent_window 1..{doc['budget'] - 1}",
             "", "global layers:", f"{'layer':>5}  {'steps':>6}  {'best':>5}  {'mass':>7}  {'recommended':>11}  {'mass':>7}  "
             f"{'sink share':>10}"]
    lines += [f"{r['layer']:>5}  {r['steps']:>6}  {r['best_window']:>5}  {r['best_mass']:>7.4f}  {r['recommended_window']:>11}  "
              f"{r['recommended_mass']:>7.4f}  {r['sink_share']:>10.4f}" for r in doc["global"]]
    short, long_ = doc["lengths"][0], doc["lengths"][-1]
    lines += ["", f"per-layer recommended windows: {short} steps against {long_} (retained mass at {long_} steps with each)",
              f"{'layer':>5}  {'w@' + str(short):>7}  {'w@' + str(long_):>8}  {'mass, w@' + str(short):>12}  {'mass, own':>10}"]
    lines += [f"{r['layer']:>5}  {r[f'window_{short}']:>7}  {r[f'window_{long_}']:>8}  "
              f"{r[f'mass_{long_}_with_window_{short}']:>12.4f}  {r[f'mass_{long_}_with_own_window']:>10.4f}"
              for r in doc["windows_held"]]
    return "\n".join(lines)

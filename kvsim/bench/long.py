"""``python -m kvsim bench --long [--trace BUNDLE]``: query/key traces at length (issue 23, item 4).

On a bundle of query/key traces (``"store": "qk"``; by default the shipped one of at least 32,768 steps),
one (layer, KV head) of a global layer (the first), and the whole bundle:

1. the normaliser pass (every row's log-sum-exp per query head, its denominator and top-32 positions),
   timed on this trace, or read back when the cache holds it;
2. one h2o replay at budget 1024 on the first T steps, T = 4096, 8192, 16384, 32768 (those the bundle
   has; ``QKTrace.prefix``, which shares the normalisers), best of two after a warm-up: seconds, and
   microseconds per step, which stay flat when the cost is linear in T at a fixed budget;
3. an h2o sweep of 64 recent windows (15, 31, .., 1023) at budget 1024 on the longest;
4. ``tune`` of the whole bundle (h2o, budget 1024, the same 64 windows, every trace's normalisers
   cached first), serially and on a local Dask cluster of one process per core;
5. storage: each file's bytes against the dense equivalents (the packed float16 lower triangle, what
   the shipped dense traces hold before compression, and the float32 interchange matrix).

Targets (``--check`` exits 1 on a miss): the replay at the longest length at most 2 s, the sweep at
most 30 s, and per-step cost at the longest within 1.5x of the shortest (linear growth).
"""

from __future__ import annotations

import os
import sys
import time

from ..analysis.tune import dask_available, tune
from ..data.bundle import Bundle, BundleError
from ..data.catalog import resolve_bundle, shipped_bundles
from ..data.qk import QKTrace
from ..progress import Progress
from ..sim.simulate import replay, sweep

LENGTHS = (4096, 8192, 16384, 32768)
BUDGET = 1024
WINDOWS = list(range(15, BUDGET, 16))  # 64 windows
REPLAY_SECONDS, SWEEP_SECONDS, LINEAR_RATIO = 2.0, 30.0, 1.5


def long_bundle(spec: str | None) -> Bundle:
    """The bundle named, or the shipped query/key bundle of at least 32,768 steps."""
    if spec:
        bundle = resolve_bundle(spec)
    else:
        found = [b for b in (resolve_bundle(str(p)) for p in shipped_bundles().values())
                 if b.manifest.get("store") == "qk" and b.steps >= LENGTHS[-1]]
        if not found:
            raise BundleError("no shipped query/key bundle of 32768 steps: build it (docs/long-context.md) or name one "
                              "with --trace")
        bundle = found[0]
    if bundle.manifest.get("store") != "qk":
        raise BundleError(f"{bundle.name}: not a bundle of query/key traces (its manifest's 'store' is not 'qk')")
    return bundle


def _timed(fn, repeat: int = 1):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


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
    doc["normalisers_seconds"], _ = _timed(trace.derived.normalisers)
    doc["replay"] = _replays(trace, say)
    longest = trace.prefix(doc["replay"][-1]["steps"])
    say(f"h2o sweep of {len(WINDOWS)} windows at {longest.steps} steps")
    doc["sweep_seconds"], _ = _timed(lambda: sweep(longest, "h2o", BUDGET, "recent_window", WINDOWS))
    if with_tune:
        doc["tune"] = _tune(bundle, say)
    doc["storage"] = _storage(bundle)
    return verdict(doc)


def _replays(trace: QKTrace, say) -> list[dict]:
    rows = []
    for T in [t for t in LENGTHS if t <= trace.steps] or [trace.steps]:
        say(f"h2o replay at budget {BUDGET}, {T} steps")
        part = trace.prefix(T)
        replay(part, "h2o", budget=BUDGET)  # the first call: kernels loaded, top-k handed over
        seconds, result = _timed(lambda p=part: replay(p, "h2o", budget=BUDGET), repeat=2)
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
    out["serial_seconds"], result = _timed(lambda: tune(bundle, "h2o", BUDGET, windows=WINDOWS))
    out["recommended_windows"] = {t.name: t.recommended_window for t in result.traces}
    if dask_available():
        workers = os.cpu_count() or 1
        say(f"tune of {len(bundle.traces)} traces on a local Dask cluster of {workers} processes")
        out["dask_seconds"], _ = _timed(lambda: tune(bundle, "h2o", BUDGET, windows=WINDOWS, scheduler="local",
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
             f"normaliser pass of {doc['trace']}: {doc['normalisers_seconds']:.2f} s (0 when read from the cache)", "",
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

"""``python -m kvsim bench``: the reference path against the fast engine, timed in one run.

What it measures, on the canonical trace (read from the disk cache, generated once if needed):

1. one h2o replay at budget 256: the reference harness, the engine's first call in this process
   (it loads the compiled kernels and computes the trace's top-k once) and its steady state;
2. the recent_window sweep 1..255 at budget 256: the reference path replays a sample of windows and
   extrapolates (``--full-reference`` replays all 255; about a minute and a half), the engine runs
   them all; the ratio;
3. the whole process ``python -m kvsim sweep --trace canonical --policy h2o --budget 256
   --recent-window 1:255 --json``, in a subprocess: with an empty trace cache (cold), with the cache
   filled (warm), and with neither the trace nor the compiled kernels cached (the first run after
   an install);
4. memory: the engine's peak allocation during the sweep (tracemalloc; the memory-mapped trace is
   not an allocation) against the trace's own size, and the subprocess's peak RSS;
5. scaling: engine sweeps of the same 64 configurations at two trace lengths and two budgets, as
   time per kept slot per step per configuration (sum over t of min(t, budget), times configs):
   constant when the cost is linear in steps x budget x configurations.

6. the H2O card's pseudo-code, written literally in plain Python (``card_h2o``: lists and a loop),
   on a few sampled windows and extrapolated to the sweep of 255, side by side with the engine and
   the whole CLI process measured in the same run; and the whole ``python -m kvsim table`` process.
7. where a command's process spends its time (issue 36), for the sweep above and a canonical h2o replay:
   the interpreter's start, the imports (kvsim's CLI and the command's module), the kernel load (numba's
   import and the compiled code read from its disk cache) and the work (the rest of ``main``: the trace,
   the replays, the output), beside the floors of a bare interpreter and a bare ``import numba`` process.

Timings are wall-clock on whatever machine runs it; nothing here asserts a speed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from kvsim.policykit.base import WINDOW

from ..data import canonical
from ..data import store as cache
from ..data.trace import Trace, save_npz
from ..progress import Progress
from ..sim import engine
from ..sim.simulate import replay, sweep
from . import checkout_env

BUDGET = 256
WINDOWS = list(range(1, BUDGET))  # every valid recent_window at budget 256
REPLAY_WINDOW = 32  # the h2o default
SAMPLE = 16  # reference replays actually run when extrapolating the sweep
SCALING_STEPS = (2048, 4096)
SCALING_BUDGETS = (128, 256)
SCALING_WINDOWS = list(range(1, 65))  # the same 64 configurations at every size
SCALING_ROUNDS = 5
CLI_ARGS = ["sweep", "--trace", "canonical", "--policy", "h2o", "--budget", str(BUDGET),
            "--recent-window", f"1:{BUDGET - 1}", "--json"]
TABLE_ARGS = ["table", "--json"]
REPLAY_ARGS = ["replay", "--trace", "canonical", "--policy", "h2o", "--budget", str(BUDGET), "--json"]
CARD_SAMPLE = 4  # windows the plain-Python pseudo-code replays (about a second each); the rest is extrapolated
#: the targets: the warm sweep process within 1 s and 60x the card's pseudo-code (issue 36), the table
#: within 1.5 s, one replay under 50 ms (``targets`` says PASS or FAIL for each, with the results identical)
TARGETS = {"cli_sweep_seconds": 1.0, "cli_speedup": 60.0, "replay_ms": 50.0, "table_seconds": 1.5}


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    """(best wall time in seconds, last result) over ``repeat`` calls."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _sample(values: list[int], n: int) -> list[int]:
    """``n`` values spread evenly over ``values``, both ends included."""
    idx = np.unique(np.linspace(0, len(values) - 1, n).round().astype(int))
    return [values[i] for i in idx]


#: runs ``python -m kvsim ARGS`` (``kvsim.cli.main``) and, at exit, writes to the file in argv[1] the
#: process's own peak RSS (VmHWM, which exec resets; ru_maxrss from wait4 would include the forking
#: parent's pages) and where its time went: when its first line ran (the wall clock, which the parent
#: compares with its own), the imports of the CLI and of the command's module (what ``main`` would
#: import first), numba's import and the kernels' loads inside ``main`` (``kvsim.jit``), and ``main``
#: up to its atexit handlers (its way out, ``kvsim.cli.entry.exit_now``, is the parent's "exit")
_CHILD = """import time
started = time.time()
import atexit, importlib, json, sys
out = sys.argv.pop(1)
split = {"started": started, "kernel_load": 0.0}
t = time.perf_counter()
import kvsim.cli
from kvsim.cli import entry
name = sys.argv[1]
importlib.import_module("kvsim.cli." + entry.OWN_MODULE.get(name, "commands"))
split["imports"] = time.perf_counter() - t
from kvsim import jit
def timed(fn):
    def run(*args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            split["kernel_load"] += time.perf_counter() - t
    return run
dispatch = jit._dispatch
def first_dispatch(k):
    timed(dispatch)(k)
    from numba.core.caching import Cache
    if not getattr(Cache.load_overload, "timed", False):
        Cache.load_overload = timed(Cache.load_overload)
        Cache.load_overload.timed = True
jit._dispatch = first_dispatch
def finish():
    split["main"] = time.perf_counter() - t
    with open('/proc/self/status') as f:
        kb = next((line.split()[1] for line in f if line.startswith('VmHWM:')), '')
    with open(out, 'w') as f:
        json.dump({"hwm_kb": kb, "split": split}, f)
atexit.register(finish)
sys.argv[0] = "kvsim"
t = time.perf_counter()
sys.exit(kvsim.cli.main())  # as the command line runs it, its way out included
"""


def _cli_run(env_extra: dict, args: list[str] = CLI_ARGS) -> dict:
    """Time one whole ``python -m kvsim ...`` process, and its peak RSS where /proc tells it."""
    env = checkout_env(**env_extra)
    with tempfile.TemporaryDirectory(prefix="kvsim-bench-run-") as tmp:
        report = Path(tmp) / "report"
        spawned, t0 = time.time(), time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(report), *args], env=env, capture_output=True)
        seconds, ended = time.perf_counter() - t0, time.time()
        if proc.returncode != 0:
            message = proc.stderr.decode(errors="replace").strip()
            raise RuntimeError(f"python -m kvsim {' '.join(args)} failed: {message}")
        child = json.loads(report.read_text()) if report.is_file() else {"hwm_kb": "", "split": None}
    doc = json.loads(proc.stdout)
    if isinstance(doc, dict) and "rows" in doc:  # table: its rows, and the argmax of its recent_window sweep
        rows, best = doc["rows"], doc["sweep"]["argmax"]
    elif isinstance(doc, dict):  # one replay
        rows, best = [doc], doc.get(WINDOW)
    else:
        rows, best = doc, max(doc, key=lambda r: r["retained_mass"])[WINDOW]
    kb = child["hwm_kb"]
    return {
        "seconds": seconds,
        "rows": len(rows),
        "peak_rss_mb": int(kb) / 1024 if kb.isdigit() else None,
        "best_recent_window": best,
        "split": startup_split(child["split"], spawned, ended) if child["split"] else None,
    }


def startup_split(child: dict, spawned: float, ended: float) -> dict:
    """Seconds of one process by phase: ``interpreter`` (from the spawn to its first line: the
    interpreter's own start), ``imports``, ``kernel_load``, ``work`` (the rest of ``main``) and ``exit``
    (the rest: the process's end, seen from the parent). They add up to the whole."""
    interpreter = child["started"] - spawned
    imports, kernel_load, main = child["imports"], child["kernel_load"], child["main"]
    return {"interpreter": interpreter, "imports": imports, "kernel_load": kernel_load, "work": main - kernel_load,
            "exit": (ended - spawned) - interpreter - imports - main}


def card_h2o(A: np.ndarray, budget: int, recent_window: int, topk: list[set]) -> tuple[float, float]:
    """The H2O card's pseudo-code as it is written, in plain Python: the baseline the engine is
    measured against. Mean retained mass and top-k recall over the trace ``A`` ((T + 1, T + 1)).

        on_decode_step(pos, attn):
            for i, weight in enumerate(attn):      # attn is index-aligned with kept
                score[i] += weight                 # float64
            admit(pos, score = 0)
        evict(budget):
            evictable = kept[: len(kept) - recentWindow]
            drop the `len(kept) - budget` lowest-scoring of those

    ``topk[t]``, the set of row t's top-k positions, is given (computed once per trace, as the
    engine does, and not timed), which only flatters the baseline. The observed attention stays a
    Python float instead of being rounded to float32, so a tie can break differently from the
    reference and the means can differ in the last digits: the run reports by how much.
    """
    T = A.shape[0] - 1
    kept, score = [0], [0.0]  # parallel lists in kept order
    mass_total = recall_total = 0.0
    for t in range(1, T + 1):
        row = A[t, :t].tolist()
        total = 0.0
        for p in kept:
            total += row[p]
        top = topk[t]
        hits = 0
        for p in kept:
            if p in top:
                hits += 1
        mass_total += total
        recall_total += hits / min(len(top), t) if top else 0.0
        attn = [row[p] / total for p in kept] if total > 0 else [0.0] * len(kept)
        for i, weight in enumerate(attn):  # on_decode_step
            score[i] += weight
        kept.append(t)
        score.append(0.0)
        while len(kept) > budget:  # evict: repeated argmin over the evictable prefix, first minimum
            evictable = len(kept) - recent_window
            j = 0
            for i in range(1, evictable):
                if score[i] < score[j]:
                    j = i
            del kept[j]
            del score[j]
    return mass_total / T, recall_total / T


def run(full_reference: bool = False, progress: Progress | None = None) -> dict:
    """Every measurement above, in one document; ``progress(None, note)`` names each phase as it
    starts (the phases have no common measure of their extent)."""
    if not engine.AVAILABLE:
        raise RuntimeError("the benchmark times the numba engine, and numba is not installed (pip install -r requirements.txt)")

    def say(note: str) -> None:
        if progress is not None:
            progress(None, note)

    doc: dict = {"budget": BUDGET, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    say("loading the canonical trace")
    load_s, trace = timed(cache.canonical_trace)
    doc["trace"] = {"steps": trace.steps, "bytes": int(trace.attention.nbytes), "load_seconds": load_s,
                    "cache": str(cache.cache_path())}
    say("one h2o replay")
    doc["replay"] = _replay(trace)
    doc["sweep"], by_window = _sweeps(trace, full_reference, say)
    doc["cli"] = _processes(doc["sweep"]["reference_seconds"], say)
    doc["card"], doc["table_cli"] = _card(trace, by_window, doc["sweep"]["engine_seconds"], doc["cli"]["warm_seconds"], say)
    say("engine sweep under tracemalloc")
    doc["memory"] = _memory(trace)
    say(f"scaling: {len(SCALING_STEPS)} trace lengths x {len(SCALING_BUDGETS)} budgets, {SCALING_ROUNDS} rounds")
    doc["scaling"] = _scaling(trace)
    doc["targets"] = targets(doc)
    return verdict(doc)


def _replay(trace: Trace) -> dict:
    """1. one h2o replay: the reference, the engine's first call in this process, its steady state."""
    ref_s, ref = timed(lambda: replay(trace, "h2o", budget=BUDGET, recent_window=REPLAY_WINDOW, reference=True))
    first_s, fast = timed(lambda: replay(trace, "h2o", budget=BUDGET, recent_window=REPLAY_WINDOW))
    warm_s, fast = timed(lambda: replay(trace, "h2o", budget=BUDGET, recent_window=REPLAY_WINDOW), repeat=5)
    return {
        WINDOW: REPLAY_WINDOW,
        "reference_seconds": ref_s,
        "engine_first_call_seconds": first_s,
        "engine_seconds": warm_s,
        "speedup": ref_s / warm_s,
        "identical": fast.summary() == ref.summary()
        and np.array_equal(fast.retained_mass_series, ref.retained_mass_series),
    }


def _sweeps(trace: Trace, full_reference: bool, say) -> tuple[dict, dict[int, dict]]:
    """2. the sweep, reference against engine; and the engine's rows by window."""
    windows = WINDOWS if full_reference else _sample(WINDOWS, SAMPLE)
    say(f"reference sweep: {len(windows)} of {len(WINDOWS)} windows")
    per = []
    ref_rows = {}
    for w in windows:
        s, r = timed(lambda w=w: replay(trace, "h2o", budget=BUDGET, recent_window=w, reference=True))
        per.append(s)
        ref_rows[w] = r.summary()
    ref_total = sum(per) if full_reference else statistics.mean(per) * len(WINDOWS)
    say("engine sweep")
    eng_s, rows = timed(lambda: sweep(trace, "h2o", BUDGET, WINDOW, WINDOWS))
    by_window = {r[WINDOW]: r for r in rows}
    return {
        "configurations": len(WINDOWS),
        "reference_replayed": len(windows),
        "reference_extrapolated": not full_reference,
        "reference_seconds": ref_total,
        "engine_seconds": eng_s,
        "speedup": ref_total / eng_s,
        "identical": all(by_window[w] == ref_rows[w] for w in windows),
        "best_recent_window": max(rows, key=lambda r: r["retained_mass"])[WINDOW],
    }, by_window


def _processes(ref_total: float, say) -> dict:
    """3. the whole CLI process: empty trace cache, warm caches, nothing cached, and a 64-step trace
    (the memory baseline)."""
    with tempfile.TemporaryDirectory(prefix="kvsim-bench-") as tmp:
        say("whole process, empty trace cache")
        cold = _cli_run({"KVSIM_CACHE_DIR": str(Path(tmp) / "trace")})
        say("whole process, warm caches")
        warm_runs = [_cli_run({}) for _ in range(3)]
        warm = min(warm_runs, key=lambda r: r["seconds"])
        say("whole process: one h2o replay, and the floors (a bare interpreter, a bare import numba)")
        replay_runs = [_cli_run({}, REPLAY_ARGS) for _ in range(3)]
        floors = {name: min(_bare(code) for _ in range(3)) for name, code in FLOORS.items()}
        say("whole process, nothing cached (numba compiles the kernels)")
        install = _cli_run({"KVSIM_CACHE_DIR": str(Path(tmp) / "trace2"), "NUMBA_CACHE_DIR": str(Path(tmp) / "numba")})
        say("whole process on a 64-step trace (the memory baseline)")
        tiny = Path(tmp) / "tiny.npz"
        save_npz(canonical.generate(canonical.CanonicalConfig(steps=64)), tiny)
        baseline = _cli_run({}, ["sweep", "--trace", str(tiny), "--policy", "h2o", "--budget", "16",
                                 "--recent-window", "1:15", "--json"])
    return {
        "command": "python -m kvsim " + " ".join(CLI_ARGS),
        "cold_trace_cache_seconds": cold["seconds"],
        "warm_seconds": warm["seconds"],  # the best of three
        "warm_runs_seconds": [r["seconds"] for r in warm_runs],
        "first_run_after_install_seconds": install["seconds"],
        "peak_rss_mb": warm["peak_rss_mb"],
        "baseline_peak_rss_mb": baseline["peak_rss_mb"],  # same process on a 64-step trace
        # the reference figure leaves out start-up and the trace, so the ratio is a lower bound
        "speedup_vs_reference_sweep": ref_total / warm["seconds"],
        "rows": warm["rows"],
        "startup": {
            "sweep": warm["split"],
            "replay_command": "python -m kvsim " + " ".join(REPLAY_ARGS),
            "replay": min(replay_runs, key=lambda r: r["seconds"])["split"],
            "floors": floors,
            # without bytecode on disk (PYTHONDONTWRITEBYTECODE and no __pycache__) every process compiles kvsim's
            # sources as it imports them: part of "imports"
            "bytecode_cached": Path(importlib.util.cache_from_source(str(Path(__file__).parent.parent / "cli" / "entry.py")))
            .is_file(),
        },
    }


#: the floors a command's process is seen against: the interpreter alone, and it with numba imported
FLOORS = {"python -c pass": "pass", "python -c 'import numba'": "import numba"}


def _bare(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=checkout_env(), check=True)
    return time.perf_counter() - t0


def _card(trace: Trace, by_window: dict[int, dict], eng_s: float, cli_warm_s: float, say) -> tuple[dict, dict]:
    """6. the card's pseudo-code in plain Python, on a sample of windows, beside the engine's rows;
    and the whole ``python -m kvsim table`` process."""
    say(f"the H2O card's pseudo-code in plain Python: {CARD_SAMPLE} of {len(WINDOWS)} windows")
    top = trace.derived.topk(32)
    topk = [set(int(p) for p in r if p >= 0) for r in top]
    card_windows = _sample(WINDOWS, CARD_SAMPLE)
    card_times, diffs = [], []
    for w in card_windows:
        s, (m, r) = timed(lambda w=w: card_h2o(trace.attention, BUDGET, w, topk))
        card_times.append(s)
        diffs.append(max(abs(m - by_window[w]["retained_mass"]), abs(r - by_window[w]["top_k_recall"])))
    card_total = statistics.mean(card_times) * len(WINDOWS)
    say("whole process: python -m kvsim table")
    table = [_cli_run({}, TABLE_ARGS) for _ in range(3)]
    card = {
        "windows": card_windows,
        "seconds_per_window": card_times,
        "sweep_seconds_extrapolated": card_total,
        "max_abs_diff_vs_engine": max(diffs),
        "engine_speedup": card_total / eng_s,
        "cli_warm_speedup": card_total / cli_warm_s,
    }
    return card, {
        "command": "python -m kvsim " + " ".join(TABLE_ARGS),
        "seconds": [r["seconds"] for r in table],
        "median_seconds": statistics.median(r["seconds"] for r in table),
    }


def _memory(trace: Trace) -> dict:
    """4. memory of the engine sweep, on a fresh Trace so its top-k is computed inside the window."""
    fresh = Trace(trace.attention, name=trace.name, meta=trace.meta)
    tracemalloc.start()
    sweep(fresh, "h2o", BUDGET, WINDOW, WINDOWS)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "trace_mb": trace.attention.nbytes / 2**20,
        "engine_peak_mb": peak / 2**20,
        "engine_peak_share_of_trace": peak / trace.attention.nbytes,
        "bench_process_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _scaling(trace: Trace) -> list[dict]:
    """5. scaling: rounds over the four sizes, best of each, so a burst of load elsewhere on the
    machine does not land on one size only."""
    traces = {}
    for steps in SCALING_STEPS:
        t = trace if steps == trace.steps else cache.canonical_trace(canonical.CanonicalConfig(steps=steps))
        t.derived.topk(32)  # the per-trace top-k is outside the sweep's cost model
        traces[steps] = t
    sizes = [(steps, budget) for steps in SCALING_STEPS for budget in SCALING_BUDGETS]
    best = dict.fromkeys(sizes, float("inf"))
    for _ in range(SCALING_ROUNDS):
        for steps, budget in sizes:
            s, _ = timed(lambda t=traces[steps], b=budget: sweep(t, "h2o", b, WINDOW, SCALING_WINDOWS))
            best[steps, budget] = min(best[steps, budget], s)
    scaling = []
    for steps, budget in sizes:
        # the work: every configuration touches each kept slot once per step, min(t, budget) of them
        slots = int(np.minimum(np.arange(1, steps + 1), budget).sum()) * len(SCALING_WINDOWS)
        s = best[steps, budget]
        scaling.append({"steps": steps, "budget": budget, "configurations": len(SCALING_WINDOWS), "seconds": s,
                        "kept_slot_steps": slots, "ns_per_kept_slot_step": s / slots * 1e9})
    return scaling


def targets(doc: dict) -> dict[str, bool]:
    """Each target (``TARGETS``) met or not, by the document's figures."""
    return {
        "cli_sweep_within_1_s": doc["cli"]["warm_seconds"] <= TARGETS["cli_sweep_seconds"],
        "cli_sweep_60x_faster_than_card_pseudo_code": doc["card"]["cli_warm_speedup"] >= TARGETS["cli_speedup"],
        "table_within_1_5_s": doc["table_cli"]["median_seconds"] <= TARGETS["table_seconds"],
        "one_replay_under_50_ms": doc["replay"]["engine_seconds"] * 1e3 < TARGETS["replay_ms"],
        "results_identical": doc["replay"]["identical"] and doc["sweep"]["identical"],
    }


def verdict(doc: dict) -> dict:
    """The document's overall result from its targets: ``result`` PASS when every target is met, else
    FAIL, with ``failed_targets`` and ``total_targets`` (what ``kvsim bench --check`` exits on)."""
    missed = [name for name, ok in doc["targets"].items() if not ok]
    doc.update(failed_targets=len(missed), total_targets=len(doc["targets"]),
               result="PASS" if doc["targets"] and not missed else "FAIL")
    return doc


def render(doc: dict) -> str:
    return "\n".join([_figures_text(doc), "", *verdict_lines(doc)])


def verdict_lines(doc: dict) -> list[str]:
    """One line per target, PASS or FAIL, and the overall result."""
    width = max(map(len, doc["targets"]), default=0)
    return ["targets:", *(f"  {name:<{width}}  {'PASS' if ok else 'FAIL'}" for name, ok in doc["targets"].items()),
            f"overall: {doc['result']} ({doc['failed_targets']} of {doc['total_targets']} targets missed)"]


def _startup_lines(startup: dict | None) -> list[str]:
    """Where the sweep's and the replay's warm processes spent their time, beside the floors."""
    if not startup or not startup.get("sweep"):
        return []
    phases = ("interpreter", "imports", "kernel_load", "work", "exit")
    floors = startup["floors"]
    lines = [f"start-up split of the warm processes, in seconds (kvsim's bytecode "
             f"{'cached' if startup['bytecode_cached'] else 'not cached: each process compiles what it imports'}):",
             f"  {'process':<10}" + "".join(f"{p.replace('_', ' '):>13}" for p in phases) + f"{'total':>9}"]
    for name in ("sweep", "replay"):
        split = startup.get(name)
        if split:
            lines.append(f"  {name:<10}" + "".join(f"{split[p]:>13.3f}" for p in phases) + f"{sum(split.values()):>9.3f}")
    lines += [f"  replay: {startup['replay_command']}",
              "  floors: " + "; ".join(f"{k} {v:.3f} s" for k, v in floors.items()), ""]
    return lines


def _figures_text(doc: dict) -> str:
    r, s, c, m = doc["replay"], doc["sweep"], doc["cli"], doc["memory"]
    d, tc = doc["card"], doc["table_cli"]
    ms = 1e3
    ref_note = "all replayed" if not s["reference_extrapolated"] else \
        f"extrapolated from {s['reference_replayed']} sampled windows x {s['configurations']}"
    lines = [
        f"kvsim bench: canonical trace, {doc['trace']['steps']} steps, budget {doc['budget']} "
        f"({doc['machine']['cpus']} CPUs, Python {doc['machine']['python']})",
        f"trace read from cache in {doc['trace']['load_seconds'] * ms:.0f} ms ({doc['trace']['cache']})",
        "",
        f"{'what':<52}{'reference':>12}{'engine':>12}{'ratio':>9}",
        f"{'-' * 52}{'-' * 12:>12}{'-' * 12:>12}{'-' * 9:>9}",
        f"{'one h2o replay (recent_window ' + str(r['recent_window']) + ')':<52}{r['reference_seconds'] * ms:>9.1f} ms"
        f"{r['engine_seconds'] * ms:>9.1f} ms{r['speedup']:>8.0f}x",
        f"{'  engine, first call in a process (numba init, top-k)':<52}{'':>12}{r['engine_first_call_seconds'] * ms:>9.1f} ms",
        f"{'sweep recent_window 1..255 (' + str(s['configurations']) + ' configs)':<52}{s['reference_seconds']:>10.1f} s"
        f"{s['engine_seconds']:>10.2f} s{s['speedup']:>8.0f}x",
        f"  reference: {ref_note}",
        "",
        f"whole process: {c['command']}",
        f"  warm caches, best of 3         {c['warm_seconds']:6.2f} s   {c['speedup_vs_reference_sweep']:.0f}x the "
        "reference sweep alone (start-up and trace not counted for the reference); runs "
        + ", ".join(f"{x:.2f}" for x in c["warm_runs_seconds"]) + " s",
        f"  empty trace cache              {c['cold_trace_cache_seconds']:6.2f} s   (generates and caches the trace)",
        f"  nothing cached (after install) {c['first_run_after_install_seconds']:6.2f} s   (numba compiles; once)",
        "",
        *_startup_lines(c.get("startup")),
        f"the H2O card's pseudo-code in plain Python (lists and a loop), sweep of {len(d['windows'])} sampled "
        f"windows x {s['configurations']}: {d['sweep_seconds_extrapolated']:.0f} s "
        f"({statistics.mean(d['seconds_per_window']):.2f} s a window; means within {d['max_abs_diff_vs_engine']:.1e} "
        "of the engine's)",
        f"  engine sweep {d['engine_speedup']:.0f}x faster; the whole warm CLI process {d['cli_warm_speedup']:.0f}x",
        f"whole process: {tc['command']}: median {tc['median_seconds']:.2f} s of "
        + ", ".join(f"{x:.2f}" for x in tc["seconds"]),
        "",
        f"memory: trace {m['trace_mb']:.1f} MB; engine sweep peak allocation {m['engine_peak_mb']:.1f} MB "
        f"({m['engine_peak_share_of_trace']:.0%} of the trace); CLI process peak RSS "
        + (f"{c['peak_rss_mb']:.0f} MB, against {c['baseline_peak_rss_mb']:.0f} MB for the same command on a "
           "64-step trace (interpreter, numpy, numba/LLVM)" if c["peak_rss_mb"] else "n/a (no /proc)"),
        "",
        f"scaling (engine, {doc['scaling'][0]['configurations']} recent_windows each):",
        f"  {'steps':>6} {'budget':>7} {'seconds':>9} {'kept slot-steps':>16} {'ns per kept slot-step':>22}",
        *(f"  {x['steps']:>6} {x['budget']:>7} {x['seconds']:>9.3f} {x['kept_slot_steps']:>16,} "
          f"{x['ns_per_kept_slot_step']:>22.2f}"
          for x in doc["scaling"]),
    ]
    return "\n".join(lines)

"""How long a kvsim command takes as a whole process, for two checkouts in one sitting, alternating, so a
shared machine's noise falls on both alike (issue 36: a command line that answers at once).

    python kvsim/bench/scripts/startup_compare.py OLD_TREE NEW_TREE [--rounds 5] [--qk PATH] [--first-qk] [--bytecode]

Each round runs every command below once in each tree (cwd and PYTHONPATH the tree, this interpreter);
the table gives the fastest, the median and the slowest run, and each process's CPU time (user +
system, the best run: on a shared machine a process waits for a core, so wall time follows the load). Beside them, the floors: a bare
interpreter, ``import numpy`` and ``import numba`` processes, and the work of each replay measured in a
warm process of the tree (the best of five calls after a first one), so that "a second run within 0.3 s
of a bare ``import numba`` process plus the work" reads off the table.

``--qk`` names a query/key trace (default: layer 5 of a 7600-step Gemma-3-270M recording, made once by
``python -m kvsim record --preset long --steps 7600 --layers 5 --store qk``, found in the cache
directory). ``--first-qk`` also times, once per tree with an empty numba cache of its own, a query/key
replay of tova and of snapkv right after a dense replay of the same policy: what a trace kind's first
replay on a machine costs when the dense kind's kernels are already compiled, and the run after it.

``--bytecode`` times every process (the floors too) with Python's bytecode cache on, kept in a
temporary folder (``PYTHONPYCACHEPREFIX``), as an installed kvsim runs; without it the environment's own
setting holds (``PYTHONDONTWRITEBYTECODE=1`` on the project's machines: every kvsim module a process
imports is compiled from source, while numpy's and numba's bytecode came with their install).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QK_REPLAY_BUDGET = 1024
CANONICAL_BUDGET = 256


def commands(qk: str) -> list[tuple[str, list[str], int]]:
    """(label, argv after the interpreter, expected exit status) of each process timed."""
    replay = ["-m", "kvsim", "replay", "--json", "--policy"]
    return [
        ("python -c pass", ["-c", "pass"], 0),
        ("import numpy", ["-c", "import numpy"], 0),
        ("import numba", ["-c", "import numba"], 0),
        ("import kvsim", ["-c", "import kvsim"], 0),
        ("kvsim --help", ["-m", "kvsim", "--help"], 0),
        ("kvsim replay --budget zero (usage error)", ["-m", "kvsim", "replay", "--budget", "zero"], 2),
        ("kvsim cache list", ["-m", "kvsim", "cache", "list"], 0),
        ("kvsim describe --json (canonical)", ["-m", "kvsim", "describe", "--json"], 0),
        (f"replay h2o canonical, budget {CANONICAL_BUDGET}", [*replay, "h2o", "--budget", str(CANONICAL_BUDGET)], 0),
        (f"replay h2o qk, budget {QK_REPLAY_BUDGET}", [*replay, "h2o", "--budget", str(QK_REPLAY_BUDGET), "--trace", qk], 0),
        (f"replay tova qk, budget {QK_REPLAY_BUDGET}", [*replay, "tova", "--budget", str(QK_REPLAY_BUDGET), "--trace", qk], 0),
        (f"replay snapkv qk, budget {QK_REPLAY_BUDGET}", [*replay, "snapkv", "--budget", str(QK_REPLAY_BUDGET), "--trace", qk], 0),
        ("sweep h2o canonical 1:255 --json", ["-m", "kvsim", "sweep", "--policy", "h2o", "--budget", "256",
                                              "--recent-window", "1:255", "--json"], 0),
    ]


#: a warm replay in a process of the tree: the best of five calls after a first one, in seconds
_WORK = """import json, sys, time, kvsim
trace = kvsim.resolve_trace(sys.argv[1])
kvsim.replay(trace, sys.argv[2], budget=int(sys.argv[3]))
best, best_cpu = float("inf"), float("inf")
for _ in range(5):
    t0, c0 = time.perf_counter(), time.process_time()
    kvsim.replay(trace, sys.argv[2], budget=int(sys.argv[3]))
    best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
print(json.dumps([best, best_cpu]))
"""

#: the CPU time (user + system, all threads) of each process timed, beside its wall time: on a machine
#: whose cores others share, a process waits for a core, and its wall time grows with the load while
#: the CPU time it spends changes far less
CPU: dict[tuple[str, Path], list[float]] = {}


#: set by ``--bytecode``: the folder Python keeps every process's bytecode in
PYCACHE: str | None = None


def env_of(tree: Path, **extra: str) -> dict:
    env = {**os.environ, **extra, "PYTHONPATH": str(tree)}
    if PYCACHE is not None:  # a prefix per tree: the trees' modules share file names
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(PYCACHE) / tree.name)
    return env


def timed(tree: Path, argv: list[str], expect: int, **extra: str) -> float:
    t0, r0 = time.perf_counter(), os.times()
    done = subprocess.run([sys.executable, *argv], cwd=tree, env=env_of(tree, **extra), capture_output=True)
    seconds, r1 = time.perf_counter() - t0, os.times()
    CPU.setdefault((" ".join(argv), tree), []).append(
        r1.children_user - r0.children_user + r1.children_system - r0.children_system)
    if done.returncode != expect:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["(nothing on stderr)"]
        raise SystemExit(f"{tree}: python {' '.join(argv)} exited {done.returncode}, expected {expect}: {tail[0]}")
    return seconds


def work(tree: Path, trace: str, policy: str, budget: int) -> list[float]:
    done = subprocess.run([sys.executable, "-c", _WORK, trace, policy, str(budget)], cwd=tree, env=env_of(tree),
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def default_qk() -> str:
    cache = Path(os.environ.get("KVSIM_CACHE_DIR") or Path.home() / ".cache" / "kvsim") / "recordings"
    found = sorted(cache.glob("gemma3-270m-long-7600-qk-*/gemma3-270m-long-L05.qk.npz"))
    if not found:
        raise SystemExit("no 7600-step query/key recording in the cache directory: run `python -m kvsim record --preset "
                         "long --steps 7600 --layers 5 --store qk` first, or name a query/key trace with --qk")
    return str(found[0])


def first_qk(tree: Path, qk: str) -> dict[str, list[float]]:
    """Per policy: the dense replay that fills an empty numba cache, the first query/key replay after it,
    and the second (seconds, whole processes)."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="kvsim-startup-numba-") as numba_dir:
        for policy in ("tova", "snapkv"):
            base = ["-m", "kvsim", "replay", "--json", "--policy", policy, "--budget"]
            out[policy] = [timed(tree, [*base, str(CANONICAL_BUDGET)], 0, NUMBA_CACHE_DIR=numba_dir),
                           *(timed(tree, [*base, str(QK_REPLAY_BUDGET), "--trace", qk], 0, NUMBA_CACHE_DIR=numba_dir)
                             for _ in range(2))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs=2, type=Path, metavar="TREE")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--qk", default=None, help="a query/key trace (*.qk.npz)")
    ap.add_argument("--first-qk", action="store_true", help="also time a trace kind's first replay (compiles, minutes)")
    ap.add_argument("--bytecode", action="store_true", help="with Python's bytecode cache on (in a temporary folder)")
    args = ap.parse_args()
    global PYCACHE
    if args.bytecode:
        PYCACHE = tempfile.mkdtemp(prefix="kvsim-startup-pycache-")
    trees = [t.resolve() for t in args.trees]
    qk = args.qk or default_qk()
    cmds = commands(qk)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; trace {qk}; "
          f"bytecode {'kept in ' + PYCACHE if PYCACHE else 'as the environment says'}")
    for tree in trees:  # warm both: numba's disk caches, the trace caches, the query/key trace's row pass
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        print(f"{tree}: {head.stdout.strip()}{' (uncommitted changes)' if dirty else ''}")
        for _, argv, expect in cmds:
            timed(tree, argv, expect)
    CPU.clear()  # the warming runs compiled and filled caches: not what a second run spends
    runs: dict[tuple[str, Path], list[float]] = {}
    for _ in range(args.rounds):
        for tree in trees:
            for label, argv, expect in cmds:
                runs.setdefault((label, tree), []).append(timed(tree, argv, expect))
    works = {}
    for tree in trees:
        works["replay h2o canonical", tree] = work(tree, "canonical", "h2o", CANONICAL_BUDGET)
        for policy in ("h2o", "tova", "snapkv"):
            works[f"replay {policy} qk", tree] = work(tree, qk, policy, QK_REPLAY_BUDGET)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    names = [f"{t.name} (min / median / max s)" for t in trees]
    print(f"\n{'whole process, ' + str(args.rounds) + ' rounds alternating':<44}" + "".join(f"{n:>30}" for n in names))
    for label, _, _ in cmds:
        cells = []
        for tree in trees:
            xs = runs[label, tree]
            cells.append(f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}")
        print(f"{label:<44}" + "".join(f"{c:>30}" for c in cells))
    print(f"\n{'floors (best runs)':<44}" + "".join(f"{t.name:>30}" for t in trees))
    bare = {t: min(runs["python -c pass", t]) for t in trees}
    for label in ("import kvsim", "kvsim --help", "kvsim replay --budget zero (usage error)", "kvsim cache list"):
        print(f"{label + ' above python -c pass':<44}" + "".join(f"{min(runs[label, t]) - bare[t]:>30.2f}" for t in trees))
    numba_floor = {t: min(runs["import numba", t]) for t in trees}
    argv_of = {label: " ".join(argv) for label, argv, _ in cmds}
    cpu = {(label, t): min(CPU[argv_of[label], t]) for label in argv_of for t in trees}
    for what in dict.fromkeys(what for what, _ in works):
        label = next(lbl for lbl, _, _ in cmds if lbl.startswith(what))
        print(f"{what + ': work in a warm process':<44}" + "".join(f"{works[what, t][0] * 1e3:>27.1f} ms" for t in trees))
        over = [min(runs[label, t]) - numba_floor[t] - works[what, t][0] for t in trees]
        print(f"{'  process above import numba + work':<44}" + "".join(f"{x:>30.2f}" for x in over))
        over = [cpu[label, t] - cpu["import numba", t] - works[what, t][1] for t in trees]
        print(f"{'  the same in CPU time (user + system)':<44}" + "".join(f"{x:>30.2f}" for x in over))
    print(f"\n{'CPU time, best run (s)':<44}" + "".join(f"{t.name:>30}" for t in trees))
    for label in argv_of:
        print(f"{label:<44}" + "".join(f"{cpu[label, t]:>30.2f}" for t in trees))
    if args.first_qk:
        print("\nfirst query/key replay after a dense one, empty numba cache (s: dense, first qk, second qk)")
        for tree in trees:
            for policy, xs in first_qk(tree, qk).items():
                print(f"  {tree.name:<12} {policy:<8} " + "  ".join(f"{x:.2f}" for x in xs))


if __name__ == "__main__":
    main()

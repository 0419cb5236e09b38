"""A replay's second run against its floor, by medians, for two checkouts in one sitting (issue 36 item 2: a
second run of a replay command within 0.3 s of a bare ``import numba`` process plus the work).

    python kvsim/bench/scripts/startup_medians.py OLD_TREE NEW_TREE --qk PATH [--rounds 5] [--case canonical-h2o ...]

Each round runs, in this order, the floor (``python -c "import numba"``), the replay's process in the old tree
and in the new one (cwd and PYTHONPATH the tree, this interpreter); each process's wall time and CPU time (user +
system). Then each tree's work: the replay in a warm process of that tree, the best of five calls after a
first one. It prints every run, the medians, and each tree's median process above the median floor plus its
work: on a shared machine the medians of one sitting, floor included, compare the trees under the same load
(``startup_compare.py`` gives the best runs of every command instead). The trees' numba and trace caches
must be warm (run each replay once in each tree first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: case: (policy, budget, whether it reads the query/key trace)
CASES = {"canonical-h2o": ("h2o", 256, False), "qk-h2o": ("h2o", 1024, True), "qk-tova": ("tova", 1024, True),
         "qk-snapkv": ("snapkv", 1024, True)}

#: the replay in a warm process: the best of five calls after a first one, in seconds
_WORK = """import json, sys, time, kvsim
trace = kvsim.resolve_trace(sys.argv[1])
kvsim.replay(trace, sys.argv[2], budget=int(sys.argv[3]))
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    kvsim.replay(trace, sys.argv[2], budget=int(sys.argv[3]))
    best = min(best, time.perf_counter() - t0)
print(json.dumps(best))
"""


def run(tree: Path | None, argv: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one process of ``tree`` (None: no kvsim on the path)."""
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    t0, r0 = time.perf_counter(), os.times()
    subprocess.run([sys.executable, *argv], cwd=tree or Path.cwd(), env=env, check=True, capture_output=True)
    r1 = os.times()
    return time.perf_counter() - t0, r1.children_user - r0.children_user + r1.children_system - r0.children_system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs=2, type=Path, metavar="TREE")
    ap.add_argument("--qk", required=True, help="a query/key trace (*.qk.npz) for the qk cases")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--case", action="append", choices=list(CASES), help="default: every case")
    args = ap.parse_args()
    trees = [t.resolve() for t in args.trees]
    for case in args.case or list(CASES):
        policy, budget, qk = CASES[case]
        trace = args.qk if qk else "canonical"
        argv = ["-m", "kvsim", "replay", "--policy", policy, "--budget", str(budget), "--trace", trace, "--json"]
        print(f"{case}: load average at start {os.getloadavg()[0]:.2f}", flush=True)
        runs: dict[str, list[tuple[float, float]]] = {"floor": [], **{t.name: [] for t in trees}}
        for _ in range(args.rounds):
            runs["floor"].append(run(None, ["-c", "import numba"]))
            for tree in trees:
                runs[tree.name].append(run(tree, argv))
        work = {tree.name: json.loads(subprocess.run(
            [sys.executable, "-c", _WORK, trace, policy, str(budget)], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
            check=True, capture_output=True, text=True).stdout) for tree in trees}
        print(f"  load average at end {os.getloadavg()[0]:.2f}")
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
        for k, v in runs.items():
            print(f"  {k:<12} wall {' '.join(f'{w:.2f}' for w, _ in v)}  median wall {med[k][0]:.2f} s, CPU {med[k][1]:.2f} s")
        for tree in trees:
            above = med[tree.name][0] - med["floor"][0] - work[tree.name]
            print(f"  {tree.name:<12} warm work {work[tree.name] * 1e3:.1f} ms; median above the median floor + work {above:+.2f} s")


if __name__ == "__main__":
    main()

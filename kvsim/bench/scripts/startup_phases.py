"""Where a second replay process's start-up goes, for two checkouts in one sitting, alternating: in a
fresh process of each tree, after the command line's imports and ``import numba``, the time to read the
trace (``resolve_trace``) and the kernel's load (the first ``replay`` less a second one in the same
process), wall and CPU time, the best of ``--runs`` (issue 36 item 2).

    python kvsim/bench/scripts/startup_phases.py OLD_TREE NEW_TREE [--runs 5] [--qk PATH]

``--qk`` names a query/key trace (default: ``startup_compare.py``'s, layer 5 of a 7600-step Gemma-3-270M
recording in the cache directory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from startup_compare import CANONICAL_BUDGET, QK_REPLAY_BUDGET, default_qk, env_of

#: one process's phases, as JSON: [wall, CPU] seconds of each
_PHASES = """import json, sys, time, numba, kvsim.cli.entry, kvsim.cli.commands
from kvsim.data.catalog import resolve_trace
from kvsim.sim.simulate import replay
clock = lambda: (time.perf_counter(), time.process_time())
t1 = clock()
trace = resolve_trace(sys.argv[1])
t2 = clock()
replay(trace, sys.argv[2], budget=int(sys.argv[3]))
t3 = clock()
replay(trace, sys.argv[2], budget=int(sys.argv[3]))
t4 = clock()
print(json.dumps({"reading the trace": [t2[i] - t1[i] for i in (0, 1)],
                  "the kernel's load": [(t3[i] - t2[i]) - (t4[i] - t3[i]) for i in (0, 1)]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs=2, type=Path, metavar="TREE")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--qk", default=None, help="a query/key trace (*.qk.npz)")
    args = ap.parse_args()
    trees = [t.resolve() for t in args.trees]
    cases = [(f"canonical h2o {CANONICAL_BUDGET}", ["canonical", "h2o", str(CANONICAL_BUDGET)]),
             (f"query/key h2o {QK_REPLAY_BUDGET}", [args.qk or default_qk(), "h2o", str(QK_REPLAY_BUDGET)])]
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    found: dict[tuple, list] = {}
    for _ in range(args.runs + 1):  # the first round fills the caches and is not counted
        for name, argv in cases:
            for tree in trees:
                done = subprocess.run([sys.executable, "-c", _PHASES, *argv], cwd=tree, env=env_of(tree),
                                      capture_output=True, text=True, check=True)
                for phase, xs in json.loads(done.stdout.strip().splitlines()[-1]).items():
                    found.setdefault((name, phase, tree), []).append(xs)
    print(f"load average at end: {os.getloadavg()[0]:.2f}\n")
    print(f"{'best of ' + str(args.runs) + ', wall / CPU ms':<44}" + "".join(f"{t.name:>24}" for t in trees))
    for name, _ in cases:
        for phase in ("reading the trace", "the kernel's load"):
            cells = []
            for tree in trees:
                xs = found[name, phase, tree][1:]
                cells.append(f"{min(x[0] for x in xs) * 1e3:.1f} / {min(x[1] for x in xs) * 1e3:.1f}")
            print(f"{name + ': ' + phase:<44}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()

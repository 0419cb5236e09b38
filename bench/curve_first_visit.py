"""The first visit of *Choosing recent_window* on each shipped real trace with an empty cache (issue 56): the
AppTest script time of the first run, when its first chart reached the page (the chart so far, or the finished
one), and the time until nothing is left in the background (the whole curve and every reference line drawn),
each trace in its own process (a fresh server) with its own empty ``KVSIM_CACHE_DIR``.

    python bench/curve_first_visit.py [TREE] [--traces gemma3-270m-L05,...] [--budget 256] [--no-shipped]

``--no-shipped`` reads nothing of ``traces/kept/`` (``KVSIM_NO_SHIPPED_CACHE``): a trace met for the first time, as
an unshipped one is; the first run then draws what is quick and the rest comes in the background.

The compiled kernels are numba's, kept beside the tree's sources: run it once to compile them, then again
to measure (``--warm`` does one throwaway visit first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = """
import json, sys, time
from streamlit.testing.v1 import AppTest
tree, trace, budget = sys.argv[1], sys.argv[2], sys.argv[3]  # argv[4]: "all" waits for the background
from streamlit.runtime.forward_msg_queue import ForwardMsgQueue
from kvsim.app.launch import preload
preload()
charted = []  # when the first chart of the trace reached the page (a chart so far, or the finished one)
enqueue = ForwardMsgQueue.enqueue
def timed(self, msg):
    if not charted and msg.HasField("delta") and msg.delta.WhichOneof("type") == "new_element" and \
            msg.delta.new_element.WhichOneof("type") == "plotly_chart":
        charted.append(time.perf_counter() - t)
    return enqueue(self, msg)
ForwardMsgQueue.enqueue = timed
t = time.perf_counter()
at = AppTest.from_file(tree + "/app.py", default_timeout=1800)
at.query_params.update({"view": "Choosing recent_window", "trace": trace, "budget": budget})
at.run()
first = time.perf_counter() - t
def busy():
    words = " ".join([c.value for c in at.caption] + [i.value for i in at.info])
    return "Still replaying" in words or "being solved" in words
runs = 1
while busy() and time.perf_counter() - t < 1800 and sys.argv[4] == "all":
    time.sleep(0.25)
    at.run()
    runs += 1
print(json.dumps({"trace": trace, "first_chart_s": round(charted[0], 2) if charted else None,
                  "first_run_s": round(first, 2), "complete_s": round(time.perf_counter() - t, 2),
                  "runs": runs, "exceptions": [e.value for e in at.exception], "errors": [e.value for e in at.error],
                  "charts": len(at.get("plotly_chart"))}))
"""


def visit(tree: Path, trace: str, budget: int, shipped: bool = True, wait: bool = True) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvsim-cold-") as cache:
        env = {**os.environ, "KVSIM_CACHE_DIR": cache, **({} if shipped else {"KVSIM_NO_SHIPPED_CACHE": "1"}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-c", _CHILD, str(tree), trace, str(budget), "all" if wait else "first"], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return {"trace": trace, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _shipped(tree: Path) -> list[str]:
    """The tree's shipped real traces, asked of the tree's own kvsim in a child (this script measures that tree's
    code, never the copy it was started beside)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    code = "from kvsim.data.catalog import shipped_traces; print(','.join(shipped_traces()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"curve_first_visit.py: error: {tree}: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip().split(",")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", nargs="?", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--traces", help="comma-separated (default: every shipped real trace)")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--warm", action="store_true", help="one throwaway visit first (numba's kernels compiled)")
    parser.add_argument("--no-shipped", action="store_true", help="read nothing shipped in traces/kept/")
    parser.add_argument("--first", action="store_true", help="time the first run alone (not what it leaves running)")
    args = parser.parse_args()
    traces = args.traces.split(",") if args.traces else _shipped(Path(args.tree))
    if args.warm:
        visit(Path(args.tree), traces[0], args.budget)
    for trace in traces:
        print(json.dumps(visit(Path(args.tree), trace, args.budget, shipped=not args.no_shipped, wait=not args.first)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Each of the app's tabs opened in a fresh Streamlit AppTest, with its exceptions, errors, charts and time,
for one or two checkouts (issue 44: on an empty cache every tab draws a chart; issue 43: the first visit to
a tab after a server start, e.g. Allocation, on a warm cache).

    KVSIM_CACHE_DIR=<empty dir> python kvsim/bench/scripts/app_tabs.py TREE            # every tab, an empty cache
    python kvsim/bench/scripts/app_tabs.py OLD_TREE NEW_TREE --tabs Allocation --rounds 2   # a tab's first visit, twice
    python kvsim/bench/scripts/app_tabs.py OLD_TREE NEW_TREE --rounds 2 --started          # as on a server kvsim app started

``--started`` times the visit alone, after what a server started by ``kvsim app`` has loaded before it answers
(``kvsim.app.launch.preload``; a tree without it: the app's modules imported), as a fresh server's first
visitor to that tab meets it; without it the time includes the child's imports.

Each visit is its own process (a fresh server's memory), the tree first on the path; the cache directory is
the environment's (``KVSIM_CACHE_DIR``), shared by the rounds, so the second round reads what the first kept.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TABS = ("Kept positions", "Cumulative scores", "Choosing recent_window", "The trace", "Policy lab", "Claims",
        "Your model", "Proxy against truth", "Pass key", "Allocation")

#: one visit, in the child: the tab opened by its link, then what it drew
_CHILD = """
import json, sys, time
from streamlit.testing.v1 import AppTest
tree, tab, started = sys.argv[1], sys.argv[2], sys.argv[3] == "started"
if started:
    try:
        from kvsim.app.launch import preload
    except ImportError:  # a tree from before the launcher: its modules, as the script's first run imports them
        import kvsim.app.main as preload_main
        preload = lambda: preload_main
    preload()
t = time.perf_counter()
at = AppTest.from_file(tree + "/app.py", default_timeout=1800)
at.query_params.update({"view": tab})
at.run()
print(json.dumps({"tab": tab, "seconds": round(time.perf_counter() - t, 2), "exceptions": [e.value for e in at.exception],
                  "errors": [e.value for e in at.error], "charts": len(at.get("plotly_chart"))}))
"""


def visit(tree: Path, tab: str, started: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-c", _CHILD, str(tree), tab, "started" if started else "cold"]
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        return {"tab": tab, "seconds": None, "exceptions": [done.stderr.strip().splitlines()[-1:]], "errors": [], "charts": 0}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", type=Path, help="one or two checkouts")
    p.add_argument("--tabs", default=",".join(TABS), help="comma-separated tab names (default: every tab)")
    p.add_argument("--rounds", type=int, default=1, help="visits per tab and tree, one after another (default 1)")
    p.add_argument("--started", action="store_true", help="time the visit alone, after kvsim app's preload")
    args = p.parse_args()
    print(f"cache: {os.environ.get('KVSIM_CACHE_DIR', '(the default)')}")
    bad = 0
    for r in range(args.rounds):
        for tab in [t.strip() for t in args.tabs.split(",") if t.strip()]:
            for tree in args.trees:
                v = visit(tree.resolve(), tab, args.started)
                bad += bool(v["exceptions"] or v["errors"] or not v["charts"])
                print(f"round {r + 1}  {tree.name:12s} {tab:24s} {v['seconds']} s  charts {v['charts']}  "
                      f"exceptions {len(v['exceptions'])}  errors {len(v['errors'])}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

#!/bin/bash
# Time two checkouts of kvsim in one sitting, alternating, so that a shared machine's noise falls on
# both alike: whole warm CLI processes (sweep, table), then one browser round each (bench --browser).
#   kvsim/bench/scripts/compare_trees.sh OLD_TREE NEW_TREE [ROUNDS]      e.g. a `git worktree add --detach` of the old commit
# Needs the venv of NEW_TREE (.venv) with requirements-dev.txt, and Debian's chromium for the browser part.
set -euo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); rounds=${3:-2}
py="$new/.venv/bin/python"
out=$(mktemp -d)
t() { local s; s=$(date +%s.%N); (cd "$1" && PYTHONPATH="$1" "$py" -m kvsim "${@:2}" > /dev/null); printf "%.2f" "$(echo "$(date +%s.%N) - $s" | bc)"; }
for tree in "$old" "$new"; do  # warm both: numba's caches, the trace cache
  t "$tree" sweep --policy h2o --budget 256 --recent-window 1:255 --json > /dev/null; t "$tree" table > /dev/null
done
for i in 1 2 3 4 5; do for tree in "$old" "$new"; do
  echo "$(basename "$tree") sweep $(t "$tree" sweep --policy h2o --budget 256 --recent-window 1:255 --json)"
  echo "$(basename "$tree") table $(t "$tree" table)"
done; done | awk '{k=$1" "$2; v[k]=v[k]" "$3} END {for (k in v) print k ":" v[k] " s"}' | sort
for i in $(seq 1 "$rounds"); do for tree in "$old" "$new"; do
  (cd "$tree" && "$py" -m kvsim bench --browser --rounds 1 --no-load --json > "$out/$(basename "$tree")-$i.json" 2> /dev/null) || true
done; done
"$py" - "$out" "$(basename "$old")" "$(basename "$new")" <<'PY'
import json, pathlib, statistics, sys
out, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
rows = {}
for name in names:
    for f in sorted(out.glob(f"{name}-*.json")):
        for s in json.loads(f.read_text())["steps"]:
            rows.setdefault(s["name"], {}).setdefault(name, []).extend(r["seconds"] for r in s["runs"])
print(f"{'step':48s} " + "  ".join(f"{n:>16s}" for n in names))
for step, by in rows.items():
    cells = ["  ".join(f"{x:.2f}" if x else "-" for x in by.get(n, [])) for n in names]
    print(f"{step:48s} " + "  ".join(f"{c:>16s}" for c in cells))
PY

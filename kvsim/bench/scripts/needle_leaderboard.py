"""docs/needle.md's leaderboard tables, from the grid documents ``kvsim needle`` saves:

    python kvsim/bench/scripts/needle_leaderboard.py GRID.json [GRID.json ...] [--by budget|length]

One row per policy (in the order the grids list them), one column per budget (``--by budget``, one
length) or per length (``--by length``, one budget), each cell the depths in order: ``found`` where the
policy's accuracy is 100%, ``-`` where it is 0, the share between, ``n/a`` where the control got none
right (not counted: docs/needle.md, "What one trial is"). The control's accuracy per column comes first.
Grids of several files join when they share the model and depths (a length or budget run later adds
its column). Where the grids come from: ``kvsim cache list`` (kind needle), or the line ``saved for the
app's needle view`` that every grid prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkout import this_checkout

ROOT = this_checkout(__file__)


def _word(share: float | None) -> str:
    if share is None:
        return "n/a"
    return "found" if share == 1.0 else "-" if share == 0.0 else f"{share:.0%}"


def table(docs: list[dict], by: str) -> list[str]:
    """The markdown lines of one leaderboard table over ``docs`` (grid documents)."""
    models = {d["model"] for d in docs}
    depths = {tuple(d["depths"]) for d in docs}
    if len(models) != 1 or len(depths) != 1:
        raise SystemExit(f"needle_leaderboard.py: the grids differ in model {sorted(models)} or depths {sorted(depths)}; "
                         "give grids of one model and one set of depths")
    fixed = {n for d in docs for n in d["lengths"]} if by == "budget" else {g["budget"] for d in docs for g in d["grids"]}
    if len(fixed) != 1:
        other = "length" if by == "budget" else "budget"
        raise SystemExit(f"needle_leaderboard.py: --by {by} takes grids of one {other}; these have {sorted(fixed)}")
    cells: dict[tuple[str, int], list[float | None]] = {}  # (policy, column) -> share per depth
    control: dict[int, list[float | None]] = {}
    for doc in docs:
        for li, length in enumerate(doc["lengths"]):
            for grid in doc["grids"]:
                column = grid["budget"] if by == "budget" else length
                control[column] = [row[li] for row in doc["control"]["accuracy"]]
                name = grid["label"].split(" @ ", 1)[0]  # the label without its budget
                cells[(name, column)] = [acc[li] if counted[li] else None
                                         for acc, counted in zip(grid["accuracy"], grid["counted"], strict=True)]
    columns = sorted(control)
    head = [f"budget {c}" if by == "budget" else f"{c} tokens" for c in columns]
    lines = ["| policy | " + " | ".join(head) + " |", "| --- |" + " --- |" * len(columns),
             "| full cache (control) | " + " | ".join(" / ".join(_word(s) for s in control[c]) for c in columns) + " |"]
    for name in dict.fromkeys(name for name, _ in cells):
        row = [" / ".join(_word(s) for s in cells[(name, c)]) if (name, c) in cells else "not run" for c in columns]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grids", nargs="+", type=Path)
    ap.add_argument("--by", choices=("budget", "length"), default="budget")
    args = ap.parse_args()
    from kvsim.models.needle import read_grid
    from kvsim.models.needle_prompt import NeedleError

    try:
        docs = [read_grid(p) for p in args.grids]
    except NeedleError as e:
        raise SystemExit(f"needle_leaderboard.py: {e}") from None
    print(f"depths {' / '.join(f'{d:g}' for d in docs[0]['depths'])}, model {docs[0]['model']}")
    print("\n".join(table(docs, args.by)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

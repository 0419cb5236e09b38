"""docs/allocation.md's study, by retained mass: every allocator that applies x {h2o, snapkv, tova,
streaming_llm} x budgets 64 and 256 on each bundle given, at uniform's memory. Prints a Markdown table
(and, with --json PATH, the rows); progress on stderr.

    python kvsim/bench/scripts/allocation_study.py gemma3-270m-heapq [MORE BUNDLES ...] [--json rows.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from checkout import this_checkout

from kvsim.allocation import allocators as al
from kvsim.data.catalog import resolve_bundle
from kvsim.policies import PolicySpec
from kvsim.progress import stderr

this_checkout(__file__)

POLICIES = ("h2o", "snapkv", "tova", "streaming_llm")
BUDGETS = (64, 256)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", nargs="+")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for name in args.bundles:
        bundle = resolve_bundle(name)
        heads = al.load_heads(bundle)
        for policy in POLICIES:
            for budget in BUDGETS:
                t0 = time.perf_counter()
                got = al.compare(heads, PolicySpec.of(policy, budget), progress=stderr(f"{bundle.name} {policy} {budget}"))
                for r in got:
                    rows.append({"bundle": bundle.name, "steps": bundle.steps, "heads": len(heads), "policy": policy,
                                 "budget": budget, "allocator": r["allocator"], "retained_mass": r["retained_mass"],
                                 "gap_closed": r["gap_closed"], "seconds": time.perf_counter() - t0})
    allocators = list(dict.fromkeys(r["allocator"] for r in rows))
    print("| bundle | policy | budget | " + " | ".join(allocators) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in allocators) + " |")
    keys = list(dict.fromkeys((r["bundle"], r["policy"], r["budget"]) for r in rows))
    for key in keys:
        cells = {r["allocator"]: r for r in rows if (r["bundle"], r["policy"], r["budget"]) == key}
        shown = []
        for a in allocators:
            r = cells.get(a)
            if r is None:
                shown.append("n/a")
            elif r["gap_closed"] is None or a in ("uniform", "optimal"):
                shown.append(f"{r['retained_mass']:.4f}")
            else:
                shown.append(f"{r['retained_mass']:.4f} ({100 * r['gap_closed']:+.0f}%)")
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(shown) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

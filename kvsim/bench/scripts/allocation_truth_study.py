"""docs/allocation.md's study by the truth: the measured cells of allocators x policies x budgets on each
text, read from the frontier documents (the disk cache's ``allocation/`` and the shipped
``traces/allocation-*.json``; ``python -m kvsim quality TEXT --steps N --policies ... --budget B,B --mode open
--allocate uniform,pyramidkv,cake,optimal`` measures them). Prints one Markdown table; a cell not measured
is printed as such, never filled in.

    python kvsim/bench/scripts/allocation_truth_study.py --steps 512 traces/texts/code-heapq.py [MORE TEXTS ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkout import this_checkout

this_checkout(__file__)

POLICIES = ("h2o", "snapkv", "tova", "streaming_llm")
ALLOCATORS = ("uniform", "pyramidkv", "cake", "optimal")


def main() -> int:
    from kvsim.allocation.truth import documents_for
    from kvsim.models.loading import file_sha256
    from kvsim.models.quality import model_id_of

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("texts", nargs="+")
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--budgets", default="64,256")
    p.add_argument("--model", default=None)
    args = p.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    model_id = model_id_of(args.model)
    print("| text | policy | budget | " + " | ".join(ALLOCATORS) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in ALLOCATORS) + " |")
    for text in args.texts:
        rows = documents_for(model_id, file_sha256(text)).get(args.steps, [])
        cells = {(r["policy"], r["allocate"], r["budget"]): r for r in rows}
        for policy in POLICIES:
            for budget in budgets:
                shown = []
                for a in ALLOCATORS:
                    r = cells.get((policy, a, budget))
                    shown.append("not measured" if r is None else
                                 f"{r['kl']:.4f} / {r['delta_nll']:.4f} / {r['retained_mass']:.4f}")
                if all(s == "not measured" for s in shown):
                    continue
                best = min((cells[(policy, a, budget)]["kl"], a) for a in ALLOCATORS if (policy, a, budget) in cells)[1]
                shown = [f"**{s}**" if a == best else s for a, s in zip(ALLOCATORS, shown, strict=True)]
                print(f"| {Path(text).name} | {policy} | {budget} | " + " | ".join(shown) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

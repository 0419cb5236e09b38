"""Several splits' schedules masking ONE teacher-forced pass (its batch dimension) against one pass per
split, side by side in one run: the same splits, the same session, alternated so the machine's load falls
on both alike. Prints the seconds per split of each and their ratio, and the largest difference in KL.

    python kvsim/bench/scripts/allocation_batch_speed.py [--steps 256] [--batch 4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from checkout import this_checkout

from kvsim.allocation import allocators as al
from kvsim.policies import PolicySpec

this_checkout(__file__)


def main() -> int:
    from kvsim.allocation.truth import open_truth, open_truths
    from kvsim.models import quality as q

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    session = q.open_session("heapq", args.steps, progress=q.QUALITY_STDERR)
    heads = [al.Head(x, h, session.traces[x][h]) for x in range(session.layers) for h in range(session.kv_heads)]
    spec = PolicySpec.of("h2o", 64)
    splits = []
    for name in ("uniform", "pyramidkv", "cake", "optimal")[: args.batch]:
        s = al.allocate(name, heads, spec)
        splits.append([[s.budgets[x * session.kv_heads + h] for h in range(session.kv_heads)] for x in range(session.layers)])
    one, many, worst = [], [], 0.0
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        alone = [open_truth(session, "h2o", s, spec.kwargs) for s in splits]
        one.append((time.perf_counter() - t0) / len(splits))
        t0 = time.perf_counter()
        together = open_truths(session, "h2o", splits, spec.kwargs)
        many.append((time.perf_counter() - t0) / len(splits))
        worst = max(worst, *(abs(a["kl"] - b["kl"]) for a, b in zip(alone, together, strict=True)))
    load = os.getloadavg()[0]
    print(f"Gemma-3-270M on heapq.py, {session.steps} steps, h2o at 64, {len(splits)} splits, load {load:.1f}: "
          f"one pass per split {min(one):.2f} s per split, one batched pass {min(many):.2f} s per split (best of "
          f"{args.repeat}): ratio {min(many) / min(one):.2f}; largest KL difference {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The allocation figures of issue 33, measured and printed: a static allocator's bundle replay against
uniform's (best of --repeat, the engine compiled first), adakv's joint replay, and the exact optimum's
time on the bundle (its budget curves and the programme), progress on stderr.

    python kvsim/bench/scripts/allocation_speed.py BUNDLE [--budget 64] [--repeat 3] [--no-optimal]
"""

from __future__ import annotations

import argparse
import sys
import time

from checkout import this_checkout

from kvsim.allocation import allocators as al
from kvsim.data.catalog import resolve_bundle
from kvsim.policies import PolicySpec
from kvsim.progress import stderr

this_checkout(__file__)


def fastest_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-optimal", action="store_true", help="only the bundle replays")
    args = p.parse_args()
    bundle = resolve_bundle(args.bundle)
    heads = al.load_heads(bundle)
    spec = PolicySpec.of("h2o", args.budget)
    print(f"{bundle.name}: {bundle.describe()}; h2o at budget {args.budget} ({args.budget * len(heads)} positions)")
    splits = {name: al.allocate(name, heads, spec) for name in al.usable(heads, spec) if name != "optimal"}
    al.measure(heads, spec, splits["uniform"])  # the engine compiled (or read from numba's cache) first
    base = fastest_of(args.repeat, lambda: al.measure(heads, spec, splits["uniform"]))
    print(f"uniform bundle replay: {base:.3f} s (best of {args.repeat})")
    for name, split in splits.items():
        if name == "uniform":
            continue
        t = fastest_of(args.repeat, lambda split=split: al.measure(heads, spec, split))
        print(f"{name} bundle replay: {t:.3f} s, {100 * (t / base - 1):+.1f}% against uniform")
    if args.no_optimal:
        return 0
    t0 = time.perf_counter()
    best = al.allocate("optimal", heads, spec, progress=stderr("optimal"))
    print(f"optimal: {time.perf_counter() - t0:.1f} s (budget curves and the programme), bundle mean retained mass "
          f"{best.detail['mass']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

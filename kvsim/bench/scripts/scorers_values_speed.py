"""Issue 34's figure for the value-weighted scorers: each engine path (vatp, critical) replays a 4096-step
trace at budget 256 in at most 3x h2o's time on the same trace. Prints ms per replay (best of --repeat,
the three taken in turn so a load on the machine falls on all of them alike), each one's ratio to h2o,
and the load average, since the figure is a wall-clock one.

    python kvsim/bench/scripts/scorers_values_speed.py [--steps 4096] [--budget 256] [--repeat 5]

The trace is synthetic (the shipped real traces carry no values or output norms yet): heavy-tailed
attention rows with most weight on the newest positions, standard-normal values (d = 64) and positive
output norms for G = 4 query heads, from a fixed seed. The kernels are compiled (or read from numba's
disk cache) by a first replay of each before anything is timed.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from checkout import this_checkout

import kvsim
from kvsim.sim import engine

this_checkout(__file__)

POLICIES = ("h2o", "vatp", "critical")
#: the figure's bound: each value-weighted engine path within this many times h2o's
BOUND = 3.0


def synthetic(steps: int, seed: int = 0) -> kvsim.Trace:
    rng = np.random.default_rng(seed)
    n = steps + 1
    a = np.zeros((n, n), dtype=np.float32)
    for t in range(1, n):  # row by row: a dense 4097 x 4097 float64 draw at once would be 134 MB more
        w = rng.gamma(0.3, size=t).astype(np.float32) + np.float32(1e-6)
        w[max(0, t - 8):] += np.float32(0.5)  # the newest take most of it, as attention does
        a[t, :t] = w / w.sum(dtype=np.float32)
    trace = kvsim.from_array(a, name=f"synthetic-{steps}")
    trace.values = rng.standard_normal((n, 64)).astype(np.float32)
    trace.out_norms = (rng.random((n, 4)) + 0.05).astype(np.float32)
    return trace


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4096)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    if not engine.AVAILABLE:
        print("numba is not installed: there is no engine path to time")
        return 1
    trace = synthetic(args.steps)
    for name in POLICIES:
        assert engine.covers(trace, name), name
        kvsim.replay(trace, name, budget=args.budget)  # compile or load the kernels, and the trace's top-k
    times: dict[str, list[float]] = {name: [] for name in POLICIES}
    for _ in range(args.repeat):
        for name in POLICIES:
            t0 = time.perf_counter()
            kvsim.replay(trace, name, budget=args.budget)
            times[name].append(time.perf_counter() - t0)
    best = {name: 1000 * min(ts) for name, ts in times.items()}
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{trace.name}, budget {args.budget}, best of {args.repeat}; load average {load} on {os.cpu_count()} cores")
    ok = True
    for name in POLICIES:
        ratio = best[name] / best["h2o"]
        within = name == "h2o" or ratio <= BOUND
        ok &= within
        verdict = "" if name == "h2o" else ", within 3x" if within else ", OVER 3x"
        print(f"{name:>9}: {best[name]:8.1f} ms per replay  ({ratio:.2f}x h2o{verdict})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

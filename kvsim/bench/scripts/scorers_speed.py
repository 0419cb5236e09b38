"""The key-aware scorers' engine paths against h2o's on the same 4096-step trace at budget 256 (issue 34's
figure: each at most 3x h2o's time), side by side:

    python kvsim/bench/scripts/scorers_speed.py [--steps 4096] [--budget 256] [--repeat 5] [POLICY ...]

Two traces, each built here from a fixed seed (no recording needed):

- ``qk``: a query/key trace shaped like Gemma-3-270M's (4 query heads on one KV head, head dim 256,
  float16 as recorded), queries and keys drawn at random; its rows are computed from them as every
  replay of such a trace computes them (the shipped dense heapq traces carry no keys);
- ``dense``: a 4097 x 4097 float32 matrix of heavy-tailed random rows (most weight on the newest
  position) carrying the same keys: the rows cost nothing to read there, so this is the harder ratio.

For each policy (default h2o, knorm, keydiff): one replay first (numba's compile or disk-cache load, the
trace's top-k), then ``--repeat`` rounds of one timed replay of each policy in turn; the median of each
policy's, in milliseconds, and its ratio to h2o's median on the same trace. One JSON line per trace.
Timings are wall-clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from checkout import this_checkout

ROOT = this_checkout(__file__)

G, D = 4, 256


def qk_trace(steps: int, seed: int = 34):
    from kvsim.data.qk import from_qk

    rng = np.random.default_rng(seed)
    n = steps + 1
    q = rng.normal(size=(G, n, D)).astype(np.float16)
    # keys of varied norms, as real keys have (knorm's ranking is not all ties)
    k = (rng.normal(size=(n, D)) * rng.uniform(0.5, 2.0, size=(n, 1))).astype(np.float16)
    v = rng.normal(size=(n, D)).astype(np.float16)
    return from_qk(q, k, v, scale=D ** -0.5, name=f"random-qk-{steps}")


def dense_trace(steps: int, keys: np.ndarray, seed: int = 35):
    from kvsim.data.trace import from_array

    rng = np.random.default_rng(seed)
    n = steps + 1
    a = np.tril(rng.gamma(0.3, size=(n, n)).astype(np.float32) + np.float32(1e-6), k=-1)
    a[np.arange(1, n), np.arange(n - 1)] += 1.0
    trace = from_array(a, name=f"random-dense-{steps}")
    trace.keys = np.asarray(keys)
    return trace


def measure(trace, names: list[str], budget: int, repeat: int) -> dict:
    from kvsim.sim import engine
    from kvsim.sim.simulate import replay

    row = {"trace": trace.name, "steps": trace.steps, "budget": budget, "repeat": repeat}
    for name in names:
        if not engine.covers(trace, name):
            raise SystemExit(f"scorers_speed.py: error: the engine does not replay {name} on {trace.name}")
        replay(trace, name, budget=budget)  # compile or load the kernels; the trace's top-k
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeat):  # the policies in turn, so that a loaded machine's slow spells fall on all of them
        for name in names:
            t0 = time.perf_counter()
            replay(trace, name, budget=budget)
            times[name].append(time.perf_counter() - t0)
    for name in names:
        row[f"{name}_ms"] = round(1000 * statistics.median(times[name]), 1)
    base = row[f"{names[0]}_ms"]
    for name in names[1:]:
        row[f"{name}_over_{names[0]}"] = round(row[f"{name}_ms"] / base, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("policies", nargs="*", default=["h2o", "knorm", "keydiff"],
                        help="policies to time, the first the baseline (default: h2o knorm keydiff)")
    parser.add_argument("--steps", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    qk = qk_trace(args.steps)
    for trace in (qk, dense_trace(args.steps, qk.keys)):
        print(json.dumps(measure(trace, args.policies, args.budget, args.repeat)), flush=True)


if __name__ == "__main__":
    main()

"""expected_attention's replay against h2o's on the same query/key trace, side by side (issue 34's figure:
a 4096-step trace at budget 256; target at most 3x h2o's time).

    PYTHONPATH=. python bench/scorers_queries_speed.py [--trace FILE.qk.npz] [--steps 4096] [--budget 256]

Without ``--trace`` the trace is made here with Gemma-3-270M's shape (4 query heads sharing one KV head
of 256 dimensions, RoPE theta 1e6 in the rotate_half layout, float16 like a recording): the cost of both
replays depends on the shapes, not on the values. The kernels are compiled and the trace's row
normalisers computed before the clock starts, so the times are the replays' own; each policy is timed
``--repeat`` times, alternately, and the best time of each is printed with the ratio. ``--reference``
also times expected_attention's reference (the harness's loop calling the same scoring kernel).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kvsim
from kvsim.data import qk
from kvsim.sim import engine
from kvsim.sim.harness import replay_reference

G, D, THETA = 4, 256, 1e6


def gemma_like(steps: int, seed: int = 0) -> qk.QKTrace:
    """Random queries and keys turned by RoPE as Gemma-3-270M's global layers store them."""
    rng = np.random.default_rng(seed)
    n, h = steps + 1, D // 2
    inv = THETA ** (-np.arange(0, D, 2) / D)
    angle = np.arange(n)[:, None] * inv[None, :]
    c, s = np.cos(angle), np.sin(angle)

    def turn(x):
        return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], axis=-1)

    q = np.stack([turn(rng.normal(size=(n, D)) + rng.normal(size=D)) for _ in range(G)]).astype(np.float16)
    k = turn(rng.normal(size=(n, D))).astype(np.float16)
    v = rng.normal(size=(n, D)).astype(np.float16)
    meta = {"rope": {"layout": "rotate_half", "theta": THETA, "rope_type": "default", "inv_freq": inv.tolist()}}
    return qk.from_qk(q, k, v, scale=D ** -0.5, name=f"gemma-like-{steps}", meta=meta)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="a query/key trace file (*.qk.npz) whose meta has 'rope'")
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--reference", action="store_true")
    args = ap.parse_args()
    trace = qk.load_qk(args.trace) if args.trace else gemma_like(args.steps)
    if args.trace and args.steps < trace.steps:
        trace = trace.prefix(args.steps)
    G_, N, d = trace.qk.Q.shape
    print(f"trace {trace.name}: {trace.steps} steps, {G_} query heads x {d} dims; budget {args.budget}; numba {engine.AVAILABLE}")
    engine.prepare("h2o")
    engine.prepare("expected_attention")
    trace.derived.normalisers()  # the rows' pass, shared by both replays: not theirs to pay
    best = {"h2o": np.inf, "expected_attention": np.inf}
    mass = {}
    for _ in range(args.repeat):
        for name in best:
            s, r = timed(lambda name=name: kvsim.replay(trace, name, budget=args.budget))
            best[name] = min(best[name], s)
            mass[name] = r.retained_mass
    for name, s in best.items():
        print(f"{name:>20}: {s * 1e3:10.0f} ms  (retained mass {mass[name]:.4f})")
    print(f"{'ratio':>20}: {best['expected_attention'] / best['h2o']:10.1f} x h2o")
    if args.reference:
        policy = kvsim.make_policy("expected_attention", budget=args.budget, trace=trace)
        s, r = timed(lambda: replay_reference(trace, policy))
        assert r.retained_mass == mass["expected_attention"]
        print(f"{'reference':>20}: {s * 1e3:10.0f} ms  (the same retained mass)")


if __name__ == "__main__":
    main()

"""expected_attention's replay against h2o's on the same query/key trace, side by side (issue 34's figure:
a 4096-step trace at budget 256; target at most 3x h2o's time).

    PYTHONPATH=. python kvsim/bench/scripts/scorers_queries_speed.py [--trace FILE.qk.npz] [--steps 4096] [--budget 256] [--refresh 1,64]

Without ``--trace`` the trace is made here with Gemma-3-270M's shape (4 query heads sharing one KV head
of 256 dimensions, RoPE theta 1e6 in the rotate_half layout, float16 like a recording): the cost of both
replays depends on the shapes, not on the values. The kernels are compiled and the trace's row
normalisers computed before the clock starts (each policy replays the trace's first 2 x budget steps
first: the query/key rows' kernels compile on their first use), so the times are the replays' own; each policy is timed
``--repeat`` times, alternately, and the best time of each is printed with the ratio, expected_attention
once per ``--refresh`` value (1, the default, takes the statistics afresh at every step). ``--reference``
also times expected_attention's reference at the first refresh (the harness's loop calling the same
scoring kernels).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from checkout import this_checkout

import kvsim
from kvsim.data import qk, qk_files
from kvsim.sim import engine
from kvsim.sim.harness import replay_reference

this_checkout(__file__)  # measuring this checkout's kvsim, not another copy on the path

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
    # the fields a recording's meta states its RoPE by (kvsim.policykit.rope.rope_meta), which the policy reads
    meta = {"rope_inv_freq": inv.tolist(), "rope_layout": "rotate_half", "rope_theta": THETA, "rope_type": "default",
            "rope_attention_scaling": 1.0, "rope_dim": D, "head_dim": D}
    return qk.from_qk(q, k, v, scale=D ** -0.5, name=f"gemma-like-{steps}", meta=meta)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="a query/key trace file (*.qk.npz) whose meta states its RoPE ('rope_inv_freq')")
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--refresh", default="1", help="comma-separated refresh values (default 1)")
    ap.add_argument("--reference", action="store_true")
    args = ap.parse_args()
    trace = qk_files.load_qk(args.trace) if args.trace else gemma_like(args.steps)
    if args.trace and args.steps < trace.steps:
        trace = trace.prefix(args.steps)
    G_, N, d = trace.qk.Q.shape
    print(f"trace {trace.name}: {trace.steps} steps, {G_} query heads x {d} dims; budget {args.budget}; numba {engine.AVAILABLE}")
    trace.derived.normalisers()  # the rows' pass, shared by both replays: not theirs to pay
    short = trace.prefix(min(trace.steps, 2 * args.budget))
    for name in ("h2o", "expected_attention"):  # every kernel either replay calls compiled (or loaded) before the clock
        engine.prepare(name)
        kvsim.replay(short, name, budget=args.budget)
    refresh = [int(x) for x in args.refresh.split(",")]
    runs = {"h2o": {}} | {f"expected_attention refresh={r}": {"refresh": r} for r in refresh}
    best = dict.fromkeys(runs, np.inf)
    mass = {}
    for _ in range(args.repeat):
        for label, params in runs.items():
            name = label.split()[0]
            s, r = timed(lambda name=name, params=params: kvsim.replay(trace, name, budget=args.budget, **params))
            best[label] = min(best[label], s)
            mass[label] = r.retained_mass
    for label, s in best.items():
        ratio = "" if label == "h2o" else f"  {s / best['h2o']:6.1f} x h2o"
        print(f"{label:>32}: {s * 1e3:10.0f} ms{ratio}  (retained mass {mass[label]:.4f})")
    if args.reference:
        policy = kvsim.make_policy("expected_attention", budget=args.budget, refresh=refresh[0], trace=trace)
        s, r = timed(lambda: replay_reference(trace, policy))
        assert r.retained_mass == mass[f"expected_attention refresh={refresh[0]}"]
        print(f"{'reference refresh=' + str(refresh[0]):>32}: {s * 1e3:10.0f} ms  (the same retained mass)")

if __name__ == "__main__":
    main()

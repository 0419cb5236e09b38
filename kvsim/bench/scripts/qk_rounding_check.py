"""What float16 storage does to retained mass, in a query/key recording and a dense one alike:

    python -m kvsim record --preset long --steps 4096 --store qk
    python -m kvsim record --preset long --steps 4096 --store dense
    python -m kvsim record --preset long --steps 4096 --store qk --dtype float32
    python -m kvsim record --preset long --steps 4096 --store dense --dtype float32
    python kvsim/bench/scripts/qk_rounding_check.py QK16 DENSE16 QK32 DENSE32 [--layers 0,5,11,17]

For every (layer, KV head) and every registered policy at its defaults, at budget 256 (and 1024 on the
global layers), the retained mass of all four recordings of the same text, and per pair the largest
difference over policies: qk against dense as recorded (float16 each), the dense float16 file against
the dense float32 one (float16's own effect on the dense store), and qk against dense in float32. One
JSON line per trace, then a summary line: the largest difference per pair, where it is, and the
policies within 1e-5 on every trace."""
import argparse
import json
import sys
import time

from checkout import this_checkout

ROOT = this_checkout(__file__)

PAIRS = {"qk16_vs_dense16": ("qk16", "dense16"), "dense16_vs_dense32": ("dense16", "dense32"),
         "qk32_vs_dense32": ("qk32", "dense32"), "qk16_vs_dense32": ("qk16", "dense32")}
TOLERANCE = 1e-5


def main() -> int:
    from kvsim.data.catalog import resolve_bundle
    from kvsim.policykit.registry import POLICIES
    from kvsim.sim.simulate import replay

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("qk16", "dense16", "qk32", "dense32"):
        ap.add_argument(name)
    ap.add_argument("--layers", default=None, help="comma-separated layers (default: every one)")
    args = ap.parse_args()
    bundles = {n: resolve_bundle(getattr(args, n)) for n in ("qk16", "dense16", "qk32", "dense32")}
    only = None if args.layers is None else {int(x) for x in args.layers.split(",")}
    worst = {p: (0.0, None) for p in PAIRS}
    within = {p: set(POLICIES) for p in PAIRS}
    for entries in zip(*(b.traces for b in bundles.values()), strict=True):
        first = entries[0]
        if only is not None and first.layer not in only:
            continue
        t0 = time.time()
        traces = {n: e.load() for n, e in zip(bundles, entries, strict=True)}
        row = {"trace": first.name, "attention": first.attention, "mass": {}, "max_diff": {}}
        for budget in ((256, 1024) if first.attention == "global" else (256,)):
            for policy in POLICIES:
                m = {n: replay(t, policy, budget=budget).retained_mass for n, t in traces.items()}
                row["mass"][f"{policy}@{budget}"] = m
                for p, (a, b) in PAIRS.items():
                    d = abs(m[a] - m[b])
                    if d > TOLERANCE:
                        within[p].discard(policy)
                    if d > row["max_diff"].get(p, (0.0,))[0]:
                        row["max_diff"][p] = (d, f"{policy}@{budget}")
                    if d > worst[p][0]:
                        worst[p] = (d, f"{first.name} {policy}@{budget}")
        row["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
    print(json.dumps({"summary": {p: {"max_diff": w[0], "at": w[1], f"policies_within_{TOLERANCE:g}": sorted(within[p])}
                                  for p, w in worst.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

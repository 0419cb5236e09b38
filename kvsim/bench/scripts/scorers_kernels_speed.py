"""The two scoring kernels that bound expected_attention's and keydiff's replays, this checkout's against
another revision's, side by side in one process, and checked to give the same bits:

    PYTHONPATH=. python kvsim/bench/scripts/scorers_kernels_speed.py [--rev main] [--rounds 21]

``key_logits`` (kvsim/policies/expected_attention.py: 257 held keys of 256 dimensions, 4 query heads, a
window of 256 centred queries: one step at refresh 1) and ``_keydiff_cosines`` (kvsim/policies/keydiff.py,
kvsim/sim/kernels_keys.py at a revision before the hooks moved beside their policies: the same 257 keys
held), each compiled from ``git show REV:path`` with numba beside this checkout's; ``--rounds`` alternating
rounds, the median and minimum of each. Timings are wall-clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import time

import numpy as np
from checkout import this_checkout

ROOT = this_checkout(__file__)


def at_revision(rev: str, paths: tuple[str, ...], name: str):
    """The kernel ``name`` as revision ``rev`` wrote it, in the first of ``paths`` that holds it there, compiled
    with numba (not cached)."""
    import numba

    for path in paths:
        done = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True)
        if done.returncode == 0 and f"@kernel\ndef {name}(" in done.stdout:
            src = done.stdout
            break
    else:
        raise SystemExit(f"{rev}: no kernel {name} in {', '.join(paths)}")
    start = src.index(f"@kernel\ndef {name}(")
    end = src.index("\n@kernel", start + 1)
    scope = {"np": np, "math": math, "BLOCK": 8}
    exec(src[start + len("@kernel\n") : end], scope)  # noqa: S102  (the project's own source at a revision)
    return numba.njit(nogil=True)(scope[name])


def main() -> None:
    from kvsim.policies import expected_attention as ea
    from kvsim.policies import keydiff as kk
    from kvsim.policykit.slot_hooks import Shape

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="main", help="the revision to compare with (default main)")
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    n, G, d, W = 257, 4, 256, 256
    keys = rng.normal(size=(4097, d))
    held = np.sort(rng.permutation(4097)[:n]).astype(np.int64)
    adv, cols = rng.normal(size=(G, d)), rng.normal(size=(G, d, W))
    state = kk._keydiff_state(Shape(1, n, 4096), keys)
    for i in range(n):
        kk._keydiff_admit(state, 0, held, i)
    logits = {"this": ea.key_logits, args.rev: at_revision(args.rev, ("kvsim/policies/expected_attention.py",), "key_logits")}
    cosines = {"this": kk._keydiff_cosines,
               args.rev: at_revision(args.rev, ("kvsim/policies/keydiff.py", "kvsim/sim/kernels_keys.py"), "_keydiff_cosines")}

    def run_logits(fn):
        out = np.zeros((n, G))
        fn(keys, held, n, 4, adv, cols, W, out, np.full(n, -1, dtype=np.int64), 1)
        return out

    def run_cosines(fn):
        fn(state, 0, held, n)
        return state[5][:n].copy()

    for label, kernels, run in (("key_logits", logits, run_logits), ("keydiff cosines", cosines, run_cosines)):
        outs = [run(fn) for fn in kernels.values()]  # compiles both
        same = all(np.array_equal(outs[0], o) for o in outs[1:])
        times: dict[str, list[float]] = {who: [] for who in kernels}
        for _ in range(args.rounds):
            for who, fn in kernels.items():
                t0 = time.perf_counter()
                run(fn)
                times[who].append(time.perf_counter() - t0)
        cells = ", ".join(f"{who}: median {1e6 * statistics.median(t):.0f} us, min {1e6 * min(t):.0f} us"
                          for who, t in times.items())
        print(f"{label}: {cells}; the same bits: {same}", flush=True)


if __name__ == "__main__":
    main()

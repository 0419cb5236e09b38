"""A query/key bundle against the dense bundle of the same recording, row by row, in plain NumPy.

    python kvsim/bench/scripts/qk_dense_check.py QK_BUNDLE DENSE_BUNDLE [--layers 0,5,11,17] [--tolerance 2e-3]

Each row of each qk file is computed from its ``q``, ``k`` and the constants in its ``meta`` exactly as
traces/README.md ("Query/key traces") states them (scale, softcap, sliding window, softmax per query head, the
heads combined by ``gqa``, the self weight dropped, renormalised), 512 rows at a time in float64, and
compared with the dense file's rows. Prints one JSON document: the largest absolute difference per
trace and overall; exits 1 when it is above the tolerance (2e-3 by default: float16 rows of either
store). Needs only NumPy: it reads what the recorder wrote, independently of kvsim's own reader.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from checkout import this_checkout

from kvsim.data.trace import unpack_lower

this_checkout(__file__)

ROWS = 512


def qk_rows(path: Path, lo: int, hi: int) -> np.ndarray:
    """Rows ``lo .. hi-1`` of the trace a qk file stands for, over every position (float64)."""
    with np.load(path, allow_pickle=False) as z:
        q, k = z["q"][:, lo:hi].astype(np.float64), z["k"].astype(np.float64)
        meta = json.loads(bytes(z["meta"]).decode("utf-8"))
    n = k.shape[0]
    s = np.einsum("gtd,pd->gtp", q, k) * meta["scale"]
    if meta["softcap"] is not None:
        s = meta["softcap"] * np.tanh(s / meta["softcap"])
    t, p = np.arange(lo, hi)[:, None], np.arange(n)[None, :]
    window = meta["sliding_window"]
    s = np.where((p <= t) if window is None else (p <= t) & (p > t - window), s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    rows = w.mean(axis=0) if meta["gqa"] == "mean" else w.max(axis=0)
    rows = np.where(p < t, rows, 0.0)
    sums = rows.sum(axis=1, keepdims=True)
    return np.divide(rows, sums, out=np.zeros_like(rows), where=sums > 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("qk")
    ap.add_argument("dense")
    ap.add_argument("--layers", default=None, help="comma-separated layers (default: every one)")
    ap.add_argument("--tolerance", type=float, default=2e-3)
    args = ap.parse_args()
    qk, dense = (json.loads((Path(d) / "manifest.json").read_text()) for d in (args.qk, args.dense))
    only = None if args.layers is None else {int(x) for x in args.layers.split(",")}
    pairs = {(e["layer"], e["head"]): e["file"] for e in dense["traces"]}
    out = {"qk": args.qk, "dense": args.dense, "steps": qk["steps"], "traces": {}}
    for e in qk["traces"]:
        if only is not None and e["layer"] not in only:
            continue
        with np.load(Path(args.dense) / pairs[(e["layer"], e["head"])], allow_pickle=False) as z:
            rows = unpack_lower(z["attention_packed"], int(z["steps"])).astype(np.float64)
        gap = max(float(np.abs(qk_rows(Path(args.qk) / e["file"], lo, min(lo + ROWS, rows.shape[0])) -
                               rows[lo : lo + ROWS]).max()) for lo in range(0, rows.shape[0], ROWS))
        out["traces"][e["file"]] = gap
        print(f"{e['file']}: {gap:.2e}", file=sys.stderr)
    out["max_abs_difference"] = max(out["traces"].values())
    out["pass"] = out["max_abs_difference"] <= args.tolerance
    print(json.dumps(out, indent=1))
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

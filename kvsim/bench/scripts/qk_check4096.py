"""A query/key recording against the dense recording of the same text:

    python -m kvsim record --preset long --steps 4096 --store qk
    python -m kvsim record --preset long --steps 4096 --store dense
    python kvsim/bench/scripts/qk_check4096.py QK_BUNDLE DENSE_BUNDLE [OUT_DIR]

For every (layer, KV head): the query/key trace exported by ``kvsim export`` (the dense interchange
format) against the dense file (the largest difference of any weight), and every registered policy's
retained mass at budget 256 (and 1024 on the global layers): the largest difference, the policy it is
of, and the policies within 1e-5. One JSON line per trace."""
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkout import this_checkout

ROOT = this_checkout(__file__)


def main() -> None:
    import argparse

    from kvsim.data.catalog import resolve_bundle
    from kvsim.data.trace import load_npz
    from kvsim.policykit.registry import POLICIES
    from kvsim.sim.simulate import replay

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("qk_bundle", help="the query/key recording (a bundle folder or name)")
    ap.add_argument("dense_bundle", help="the dense recording of the same text")
    ap.add_argument("out_dir", nargs="?", default=None, help="where the exported traces go (default: a temporary folder)")
    a = ap.parse_args()
    qd, dd = a.qk_bundle, a.dense_bundle
    scratch = Path(a.out_dir) if a.out_dir else Path(tempfile.mkdtemp())
    qb, db = resolve_bundle(qd), resolve_bundle(dd)
    for eq, ed in zip(qb.traces, db.traces, strict=True):
        t0 = time.time()
        q, d = eq.load(), ed.load()
        out = str(scratch / f"{eq.name}.npz")
        subprocess.run([sys.executable, "-m", "kvsim", "export", "--trace", f"{qd}:L{eq.layer:02d}", "--out", out, "--json"],
                       check=True, capture_output=True, cwd=ROOT)
        exported = load_npz(out)
        row = {"trace": eq.name, "attention": eq.attention, "export_vs_dense_max_abs": float(abs(exported.attention - d.attention).max())}
        for b in ((256, 1024) if eq.attention == "global" else (256,)):
            diffs = {n: abs(replay(q, n, budget=b).retained_mass - replay(d, n, budget=b).retained_mass) for n in POLICIES}
            row[f"b{b}_max_mass_diff"] = max(diffs.values())
            row[f"b{b}_worst"] = max(diffs, key=diffs.get)
            row[f"b{b}_within_1e-5"] = sorted(n for n, x in diffs.items() if x <= 1e-5)
        row["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

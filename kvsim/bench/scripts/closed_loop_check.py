"""quality --mode closed on a few configurations, as JSON; run it on two commits and compare the files.

    python kvsim/bench/scripts/closed_loop_check.py OUT.json [--real]
    python kvsim/bench/scripts/closed_loop_check.py --compare A.json B.json

Tiny Gemma 3, Gemma 2 and Llama (tests/test_quality.py's, random weights) at 32 steps with six
policies; with ``--real`` also the shipped Gemma-3-270M on 192 steps of heapq.py with four. Run at
ea250c1 (the closed loop that masked a full cache) and at the commit that made it decode through
kvsim.hf (docs/deploy.md, "One truth"); ``--compare`` prints the largest difference per figure.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

TINY_JOBS = [("h2o", 8, {"recent_window": 2}), ("tova", 6, {}), ("streaming_llm", 8, {"sinks": 2}),
             ("snapkv", 10, {"recent_window": 4, "observation_window": 4}), ("scissorhands", 8, {"recent_window": 3}),
             ("random", 5, {})]
REAL_JOBS = [("h2o", 64, {"recent_window": 16}), ("tova", 48, {}), ("streaming_llm", 32, {}),
             ("snapkv", 64, {"recent_window": 16})]
FIGURES = ("nll", "kl", "retained_mass")


def measure(real: bool) -> dict:
    from checkout import this_checkout

    sys.path.insert(0, str(this_checkout(__file__) / "tests"))  # the suite's helpers: modules of tests/, not a package
    from test_quality import TEXT, ByteTokenizer, _tiny

    from kvsim.models import quality, texts

    text = pathlib.Path(tempfile.mkdtemp()) / "text.txt"
    text.write_text(TEXT)
    out = {}
    for kind in ("gemma3", "gemma2", "llama"):
        s = quality.Session(_tiny(kind), ByteTokenizer(), text, 32, model_id=f"tiny-{kind}", progress=None)
        out[kind] = [{k: r[k] for k in FIGURES} for r in s.evaluate_many([s.configuration(*j) for j in TINY_JOBS], "closed")]
    if real:
        s = quality.open_session(texts.heapq_path(), 192, progress=None)
        out["gemma"] = [{k: r[k] for k in FIGURES} for r in s.evaluate_many([s.configuration(*j) for j in REAL_JOBS], "closed")]
    return out


def compare(a: dict, b: dict) -> dict:
    return {f: max(abs(x[f] - y[f]) for k in a for x, y in zip(a[k], b[k], strict=True)) for f in FIGURES}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="the JSON file to write")
    ap.add_argument("--real", action="store_true", help="also the shipped Gemma-3-270M (minutes)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="instead: the largest difference per figure of two files")
    a = ap.parse_args()
    if a.compare:
        print(compare(*(json.loads(pathlib.Path(p).read_text()) for p in a.compare)))
    elif a.out is None:
        ap.error("give OUT.json to write, or --compare A.json B.json")
    else:
        pathlib.Path(a.out).write_text(json.dumps(measure(a.real), indent=1))

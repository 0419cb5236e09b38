"""The learned policy judged by the model itself (docs/learned.md, issue 58): open-loop KL and delta NLL
(``kvsim quality --mode open``) and the pass key (``kvsim needle``) beside h2o, tova, snapkv, keydiff,
critical, expected_attention (and the optimum, where the command offers it), on Gemma-3-270M and SmolLM2-135M,
written into the study's ``model_measures`` with the commands that made them:

    python kvsim/bench/scripts/learned_measures.py [--study docs/learned-study.json] [--only quality|needle] [--models M[,M]]
                                     [--budget 256[,128]] [--policies P,P,...] [--depths D,D,...]
    python -m kvsim learn --doc docs/learned-study.json > docs/learned.md

An entry (quality: a model and budget; the pass key: a model) replaces the study's entry of the same key, so
a grid cut short by time is measured in part (``--policies``, ``--depths``: a subset) and completed later.

Each command runs as printed (``python -m kvsim ... --json``) with this interpreter; kvsim caches every
measurement it makes (kvsim cache list: quality, needle), so a command already run reads its results back in
seconds, and one not run yet measures (minutes to an hour each on a loaded CPU: run it in the background).
A command that fails stops the script with its last line, before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from checkout import this_checkout

ROOT = this_checkout(__file__)
MODELS = ("gemma3-270m", "smollm2-135m")
POLICIES = ("learned", "h2o", "tova", "snapkv", "keydiff", "critical", "expected_attention")
STEPS = 1024
NEEDLE = {"lengths": "1024", "depths": "0.1,0.5,0.9", "budget": "256"}


def quality_command(model: str, budget: int, policies: list[str]) -> list[str]:
    return ["python", "-m", "kvsim", "quality", "heapq", "--model", model, "--policy", ",".join(policies),
            "--budget", str(budget), "--steps", str(STEPS), "--mode", "open", "--json"]


def needle_command(model: str, policies: list[str], depths: str) -> list[str]:
    return ["python", "-m", "kvsim", "needle", "--model", model, "--policy", ",".join(policies), "--lengths",
            NEEDLE["lengths"], "--depths", depths, "--budget", NEEDLE["budget"], "--optimum", "--json"]


def run(words: list[str]):
    """The command's JSON document (its progress to a log beside nothing: --quiet is not given, stderr passes)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"learned_measures.py: {shlex.join(words)} failed (exit {done.returncode})")
    return json.loads(done.stdout)


def quality_entry(model: str, budget: int, results: list[dict], words: list[str]) -> dict:
    """What docs/learned.md prints of one quality grid: per policy its KL, delta NLL and retained mass."""
    keep = ("policy", "params", "kl", "delta_nll", "delta_nll_key", "key_tokens", "key_rule", "retained_mass", "nll",
            "nll_full")
    first = results[0]
    return {"model": model, "budget": budget, "steps": first["steps"], "mode": first["mode"], "text": "heapq",
            "command": shlex.join(words), "nll_full": first["nll_full"],
            "results": [{k: r[k] for k in keep if k in r} for r in results]}


def _held(cells: list[dict], j: int, key: str) -> tuple[int, int]:
    """(layer, KV head)s over the trials that held a key token to the end, and how many there were."""
    rows = [row for cell in cells for row in cell["runs"][j].get(key) or []]
    return sum(v is None for row in rows for v in row), sum(len(row) for row in rows)


def needle_entry(model: str, doc: dict, words: list[str]) -> dict:
    """What docs/learned.md prints of one needle grid: per policy, found at each depth (the one length), and
    the (layer, KV head)s that held a key token to the end, the exact optimum's beside."""
    policies = []
    for j, g in enumerate(doc["grids"]):
        held, heads = _held(doc["cells"], j, "key_left")
        best, _ = _held(doc["cells"], j, "optimal_key_left")
        policies.append({"policy": g["policy"], "label": g["label"], "found": [row[0] for row in g["accuracy"]],
                         "key_held": held, "optimum_key_held": best, "heads": heads})
    return {"model": model, "command": shlex.join(words), "lengths": doc["lengths"], "depths": doc["depths"],
            "budget": int(NEEDLE["budget"]), "trials": doc["trials"],
            "control": [row[0] for row in doc["control"]["accuracy"]], "policies": policies}


def _replace(entries: list[dict], new: dict, key: tuple[str, ...]) -> list[dict]:
    """``entries`` with ``new`` in place of the one of the same key (or added at the end)."""
    out, placed = [], False
    for e in entries:
        if all(e.get(k) == new.get(k) for k in key):
            if not placed:
                out.append(new)
                placed = True
        else:
            out.append(e)
    return out if placed else [*out, new]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default=str(ROOT / "docs" / "learned-study.json"))
    ap.add_argument("--only", choices=["quality", "needle"], default=None)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default: {','.join(MODELS)})")
    ap.add_argument("--budget", default="256", help="the quality grids' budgets, comma-separated (default: 256)")
    ap.add_argument("--policies", default=None, help="a subset of the policies, in this order (default: "
                    f"{','.join(POLICIES)}, and optimal in the quality grids)")
    ap.add_argument("--depths", default=NEEDLE["depths"], help=f"the pass key's depths (default: {NEEDLE['depths']})")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    study_path = Path(args.study)
    study = json.loads(study_path.read_text(encoding="utf-8"))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    chosen = [p.strip() for p in args.policies.split(",")] if args.policies else None
    quality, needle = [], []
    if args.only != "needle":
        for budget in [int(b) for b in args.budget.split(",")]:
            for model in models:
                words = quality_command(model, budget, chosen or [*POLICIES, "optimal"])
                print(f"learned_measures.py: {shlex.join(words)}", file=sys.stderr)
                results = run(words)
                quality.append(quality_entry(model, budget, results if isinstance(results, list) else [results], words))
    if args.only != "quality":
        for model in models:
            words = needle_command(model, [p for p in chosen or POLICIES if p != "optimal"], args.depths)
            print(f"learned_measures.py: {shlex.join(words)}", file=sys.stderr)
            needle.append(needle_entry(model, run(words), words))
    measures = study.get("model_measures") or {"quality": [], "needle": []}
    how = ("python kvsim/bench/scripts/learned_measures.py " + shlex.join(sys.argv[1:] if argv is None else argv)).strip()
    for q in quality:
        measures["quality"] = _replace(measures["quality"], {**q, "how": how}, ("model", "budget"))
    for n in needle:
        measures["needle"] = _replace(measures["needle"], {**n, "how": how}, ("model",))
    study["model_measures"] = {"quality": measures["quality"], "needle": measures["needle"]}
    study_path.write_text(json.dumps(study, indent=1) + "\n", encoding="utf-8")
    print(f"learned_measures.py: model measures written to {study_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""docs/serving.md's study: what each serving layout costs the model, against the same policy free of it.

    python kvsim/bench/scripts/serving_study.py measure --out docs/serving-study.json [--models ...] [--parts open,closed,passkey]
        [--scheduler ADDRESS | --workers N]
    python kvsim/bench/scripts/serving_study.py tables docs/serving-study.json

``measure`` runs the study's grid and writes every row to ``--out`` (atomically). Each figure goes through
kvsim's on-disk caches (``quality``'s results, ``needle``'s trials), keyed by everything it depends on, the
layout included, so a run that stops, or a second run that adds a part, measures only what is new; parts
can run in separate processes at once and a last run over all of them reads them back.

- ``open``: the open-loop truth (``kvsim quality --mode open`` under the layout: KL, delta NLL, retained
  mass), every policy x layout x budget x text x model.
- ``closed``: the closed loop (``kvsim quality --mode closed`` under the layout: the deployed cache decodes
  the text token by token), for the subset ``CLOSED`` names.
- ``passkey``: the pass key at 1,024 tokens (``kvsim needle``), each policy x layout at ``PASSKEY_BUDGET``.

``--scheduler ADDRESS`` (or ``--workers N``, local processes) sends the open and closed cells the cache lacks to
Dask (``kvsim.models.fanout``, as ``kvsim quality --scheduler``) and keeps each result in this cache as it comes
back, and passes the flag on to ``kvsim needle`` for the pass key: the rows are the local run's, their seconds aside.

``tables`` prints docs/serving.md's tables from the JSON; tests/test_serving_study.py checks the page
against it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

from checkout import this_checkout

ROOT = this_checkout(__file__)

from kvsim.data.files import atomic_write  # noqa: E402
from kvsim.policykit.layouts import Layout  # noqa: E402

MODELS = ("gemma3-270m", "smollm2-135m")
TEXTS = ("code-heapq.py", "prose-rust-book-introduction.txt", "legal-gpl-3.0.txt")
BUDGETS = (64, 256)
STEPS = 512
POLICIES = ("h2o", "tova", "snapkv", "keydiff", "critical", "streaming_llm")
#: (name, layout): each layout alone (an interval of 8 and of 32), and all three together: pages of 16 shared by a
#: layer's KV heads, decided every 8 steps
LAYOUTS = (
    ("none", Layout()),
    ("blocks of 16", Layout(16)),
    ("shared", Layout(1, True)),
    ("every 8", Layout(1, False, 8)),
    ("every 32", Layout(1, False, 32)),
    ("all three", Layout(16, True, 8)),
)
#: the exact optimum, free and under blocks (an offline reference: blocks are the only layout it takes)
OPTIMUM = (("none", Layout()), ("blocks of 16", Layout(16)))
#: the closed loop's subset: (model, text, budget, policies, layouts by name)
CLOSED = (("gemma3-270m", "code-heapq.py", 64, ("h2o", "tova"), ("none", "blocks of 16")),)
PASSKEY_LENGTH = 1024
PASSKEY_BUDGET = 256
PASSKEY_DEPTHS = {"gemma3-270m": (0.25, 0.75), "smollm2-135m": (0.5,)}
#: the layouts the pass key runs under, by model: SmolLM2's 90 (layer, KV head)s a position make a trial under a
#: layout 150-200 s at this machine's load (Gemma's 18: 65-75 s), so its pass key runs at one depth, under pages
#: alone and all three together (shared selection alone is measured by the open loop).
#: Gemma has one KV head (shared selection is a no-op) and 8 divides 16, so its "all three" is "blocks of 16"
#: step for step (tests/test_serving_study.py): not run twice
PASSKEY_LAYOUTS = {"gemma3-270m": ("none", "blocks of 16", "every 8", "every 32"),
                   "smollm2-135m": ("none", "blocks of 16", "all three")}


def _layout(name: str) -> Layout:
    return dict(LAYOUTS + OPTIMUM)[name]


def _fits(layout: Layout, policy: str, budget: int, heads: int) -> str | None:
    """None when ``policy`` runs under ``layout`` at ``budget``; else why not (the layout's own one line), or
    that shared selection is a no-op on one KV head (not measured: it is the free policy)."""
    try:
        notes = layout.check(policy, budget, {}, heads=heads)
    except ValueError as e:
        return f"refused: {e}"
    if layout.shared_selection and heads == 1 and layout.block_size == 1 and layout.evict_every == 1:
        return "no-op: one KV head"
    del notes
    return None


def _row(model: str, text: str, budget: int, policy: str, name: str, layout: Layout, mode: str, result: dict | None,
         why: str | None) -> dict:
    row = {"model": model, "text": text, "budget": budget, "policy": policy, "layout": name,
           **layout.to_dict(), "mode": mode, "why": why}
    if result is not None:
        row.update({k: result[k] for k in ("kl", "delta_nll", "retained_mass", "seconds")})
        row["memory"] = layout.memory(budget)[0]
    return row


def _measure(session, model, text, jobs, say) -> list[dict]:
    """Each job's row (``(budget, policy, layout name, mode)``, open or closed): its result from the quality cache
    (a plain layout's is ``kvsim quality``'s own result), else a cell measured here or on the session's Dask workers
    (``kvsim.models.fanout``), kept in the cache as it comes back; or the reason it is not measured."""
    from kvsim.models.fanout import compute
    from kvsim.models.quality import read_cached, write_cached
    from kvsim.models.quality_layout import layout_cell, layout_key

    results: list[dict | None] = [None] * len(jobs)
    whys: list[str | None] = [None] * len(jobs)
    todo, calls = [], []
    for j, (budget, policy, name, mode) in enumerate(jobs):
        layout = _layout(name)
        whys[j] = _fits(layout, policy, budget, session.kv_heads)
        if whys[j] is not None:
            continue
        key = layout_key(session, session.configuration(policy, budget, {}), mode, layout)
        hit = read_cached(key)
        if hit is not None:
            results[j] = {**hit, "cached": True}
            say(f"{model} {text} {budget} {policy} [{name}] {mode}: KL {hit['kl']:.4f} (cached)")
        else:
            todo.append((j, key))
            calls.append((layout_cell, (policy, budget, {}, layout, mode)))
    for k, result in compute(session, calls):
        j, key = todo[k]
        write_cached(key, result)
        results[j] = {**result, "cached": False}
        budget, policy, name, mode = jobs[j]
        say(f"{model} {text} {budget} {policy} [{name}] {mode}: KL {result['kl']:.4f} ({result['seconds']:.1f} s)")
    return [_row(model, text, budget, policy, name, _layout(name), mode, results[j], whys[j])
            for j, (budget, policy, name, mode) in enumerate(jobs)]


def measure_quality(models, parts, say, fanout=None) -> list[dict]:
    """The open and closed parts' rows; ``fanout``: a ``kvsim.models.fanout.Fanout`` to measure on (default: here)."""
    from kvsim.models import quality
    from kvsim.models.truth import TEXTS_DIR

    rows = []
    for model in models:
        loaded = None
        for text in TEXTS:
            closed = [c for c in CLOSED if c[0] == model and c[1] == text and "closed" in parts]
            if "open" not in parts and not closed:
                continue
            if loaded is None:
                loaded = quality.load(model)
            session = quality.open_session(TEXTS_DIR / text, STEPS, model, model_and_tokenizer=loaded)
            session.fanout = fanout
            jobs = []
            if "open" in parts:
                pairs = [(p, n) for p in POLICIES for n, _ in LAYOUTS] + [("optimal", n) for n, _ in OPTIMUM]
                jobs += [(budget, policy, name, "open") for budget in BUDGETS for policy, name in pairs]
            jobs += [(budget, policy, name, "closed") for _, _, budget, policies, names in closed for policy in policies
                     for name in names]
            rows += _measure(session, model, text, jobs, say)
    return rows


def _layout_flags(layout: Layout) -> list[str]:
    flags = []
    if layout.block_size > 1:
        flags += ["--block-size", str(layout.block_size)]
    if layout.shared_selection:
        flags.append("--shared-selection")
    if layout.evict_every > 1:
        flags += ["--evict-every", str(layout.evict_every)]
    return flags


def measure_passkey(models, say, where: tuple[str, ...] = ()) -> list[dict]:
    """Each layout's needle grid at ``PASSKEY_LENGTH`` tokens, ``PASSKEY_BUDGET`` positions, one trial at each
    of ``PASSKEY_DEPTHS``: the policies the layout takes, through ``kvsim needle`` (its trials cached); ``where``:
    its ``--scheduler ADDRESS`` or ``--workers N``."""
    heads = {"gemma3-270m": 1, "smollm2-135m": 3}
    rows = []
    for model in models:
        for name in PASSKEY_LAYOUTS[model]:
            layout = _layout(name)
            fits = {p: _fits(layout, p, PASSKEY_BUDGET, heads[model]) for p in POLICIES}
            run = [p for p, why in fits.items() if why is None]
            doc = None
            if run:
                command = [sys.executable, "-m", "kvsim", "needle", "--model", model, "--policies", ",".join(run),
                           "--budget", str(PASSKEY_BUDGET), "--lengths", str(PASSKEY_LENGTH), "--depths",
                           ",".join(map(str, PASSKEY_DEPTHS[model])), "--trials", "1", "--quiet", "--json",
                           *_layout_flags(layout), *where]
                t0 = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
                if done.returncode:
                    raise SystemExit(f"serving_study.py: {' '.join(command[1:])} failed: {done.stderr.strip()[-400:]}")
                doc = json.loads(done.stdout)
                say(f"{model} pass key [{name}]: {len(run)} policies in {time.perf_counter() - t0:.0f} s")
            grids = {g["policy"]: g for g in doc["grids"]} if doc else {}
            for policy in POLICIES:
                g = grids.get(policy)
                rows.append({"model": model, "budget": PASSKEY_BUDGET, "length": PASSKEY_LENGTH, "policy": policy,
                             "layout": name, **layout.to_dict(), "mode": "passkey", "why": fits[policy],
                             "found": None if g is None else [row[0] for row in g["accuracy"]],
                             "control": None if doc is None else [row[0] for row in doc["control"]["accuracy"]]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--models", default=",".join(MODELS))
    m.add_argument("--parts", default="open,closed,passkey")
    on = m.add_mutually_exclusive_group()
    on.add_argument("--scheduler", default=None, metavar="ADDRESS", help="the cells on the workers of a running Dask "
                    "scheduler (tcp://host:8786), as kvsim quality --scheduler; the pass key through kvsim needle "
                    "--scheduler (whose workers share this cache directory)")
    on.add_argument("--workers", type=int, default=None, metavar="N", help="the cells on N local Dask worker processes")
    t = sub.add_parser("tables")
    t.add_argument("study")
    args = ap.parse_args(argv)
    if args.command == "tables":
        from kvsim.analysis.serving_study import markdown

        print(markdown(json.loads(Path(args.study).read_text())))
        return 0
    models = [x for x in args.models.split(",") if x]
    parts = {x for x in args.parts.split(",") if x}
    unknown = sorted(parts - {"open", "closed", "passkey"} | set(models) - set(MODELS))
    if unknown:
        raise SystemExit(f"serving_study.py: --parts/--models: unknown {unknown[0]!r}")

    def say(line: str) -> None:
        print(f"serving_study: {line}", file=sys.stderr, flush=True)

    t0 = time.time()
    where = ("--scheduler", args.scheduler) if args.scheduler else ("--workers", str(args.workers)) if args.workers else ()
    rows = []
    if parts & {"open", "closed"}:
        with contextlib.ExitStack() as stack:
            fanout = None
            if where:  # reached before any model loads; refused in one line naming the flag
                from kvsim.cluster import LOCAL, ClusterError, dask_client
                from kvsim.models.fanout import Fanout

                try:
                    fanout = Fanout(*stack.enter_context(dask_client(args.scheduler or LOCAL, args.workers)))
                except ClusterError as e:
                    raise SystemExit(f"serving_study.py: {where[0]}: {e}") from None
                say(f"on Dask: {fanout.workers} worker(s) at {fanout.address}")
            rows = measure_quality(models, parts, say, fanout)
    if "passkey" in parts:
        rows += measure_passkey(models, say, where)
    plan = {"models": models, "texts": list(TEXTS), "budgets": list(BUDGETS), "steps": STEPS,
            "policies": list(POLICIES), "layouts": {n: lay.to_dict() for n, lay in LAYOUTS},
            "closed": [list(c[:3]) + [list(c[3]), list(c[4])] for c in CLOSED],
            "passkey": {"length": PASSKEY_LENGTH, "budget": PASSKEY_BUDGET,
                        "depths": {m: list(PASSKEY_DEPTHS[m]) for m in models},
                        "layouts": {m: list(PASSKEY_LAYOUTS[m]) for m in models}},
            "parts": sorted(parts)}
    text = json.dumps({"plan": plan, "rows": rows}, indent=1) + "\n"
    atomic_write(Path(args.out), lambda f: f.write(text.encode()))
    say(f"{len(rows)} rows in {time.time() - t0:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m kvsim``: replay, sweep, describe, export, the cards' table and their claims, record, tune and
quality, from the command line.

``--json`` on any subcommand prints exactly one JSON document on stdout and nothing else; without it
the same figures print as aligned tables. Every error exits non-zero with one line on stderr,
``kvsim: error: ...``, never a traceback: outside checks parse both.

The table's rows are ``kvsim.analysis.table.ROWS``. Policy parameters become flags (``recent_window`` ->
``--recent-window``) from the registry itself, so a policy that joins the registry gets its flags for
free; a flag is only passed to a policy that takes that parameter, and giving it to one that does not
is an error naming the flag.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from . import progress
from .analysis.metrics import DEFAULT_BAND, describe
from .analysis.table import TABLE_BUDGET, build_table, params_label
from .data.bundle import is_bundle
from .data.catalog import available_bundles, available_traces, resolve_trace
from .data.trace import save_npz
from .policies import DEFAULT_BUDGET, POLICIES, all_tunables, make_policy, policy_params
from .sim.harness import DEFAULT_TOP_K
from .sim.simulate import best, replay, sweep

PROG = "kvsim"


class CLIError(Exception):
    """A usage or input problem, reported as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse prints the usage block and the error on several lines; the contract is one line."""

    def error(self, message: str):
        raise CLIError(message)


def _flag(param: str) -> str:
    return "--" + param.replace("_", "-")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parse_range(flag: str, text: str) -> list[int]:
    """``A:B[:STEP]`` (inclusive) or a single integer, into the list of values."""
    parts = text.split(":")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise CLIError(f"{flag}: expected an integer or A:B[:STEP], got {text!r}") from None
    if len(nums) == 1:
        return nums
    if len(nums) > 3:
        raise CLIError(f"{flag}: expected A:B[:STEP], got {text!r}")
    start, stop, step = nums[0], nums[1], nums[2] if len(nums) == 3 else 1
    if step < 1:
        raise CLIError(f"{flag}: STEP must be at least 1, got {step}")
    if stop < start:
        raise CLIError(f"{flag}: range {text!r} is empty (B < A)")
    return list(range(start, stop + 1, step))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Replay attention traces through KV-cache eviction policies.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    specs = all_tunables()
    bundles = available_bundles()
    trace_help = (f"canonical, a shipped trace ({', '.join(available_traces()[1:]) or 'none yet'}), a path to an .npz, or one "
                  f"trace of a bundle as BUNDLE:L05 or BUNDLE:L05H1 (shipped bundles: {', '.join(bundles) or 'none yet'})")

    def common(p: argparse.ArgumentParser, budget_default: int | None, budget_type=int) -> None:
        p.add_argument("--trace", default="canonical", help=f"{trace_help} (default: canonical)")
        if budget_default is not None:
            p.add_argument("--budget", type=budget_type, default=None, help=f"cache budget (default: {budget_default})")
        p.add_argument("--top-k", type=_positive_int, default=DEFAULT_TOP_K, help="k of top-k recall (default: 32)")
        p.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")

    def policy_flags(p: argparse.ArgumentParser, ranges: bool) -> None:
        p.add_argument("--policy", required=True, choices=list(POLICIES), help="registry name")
        for param, spec in specs.items():
            owners = ", ".join(n for n, cls in POLICIES.items() if spec in cls.tunables)
            p.add_argument(
                _flag(param),
                dest=f"param_{param}",
                type=str if ranges else int,
                default=None,
                metavar="A:B[:STEP]" if ranges else "N",
                help=f"{spec.help} (default {spec.default}; {owners})",
            )

    p = sub.add_parser("replay", help="replay one policy; mean retained mass and top-k recall")
    common(p, DEFAULT_BUDGET)
    policy_flags(p, ranges=False)

    p = sub.add_parser("sweep", help="one replay per value of a parameter given as A:B[:STEP] (inclusive)")
    common(p, DEFAULT_BUDGET, budget_type=str)
    policy_flags(p, ranges=True)

    p = sub.add_parser("describe", help="statistics of the trace alone: sinks, recency band, concentration")
    common(p, None)
    p.add_argument("--band", type=_positive_int, default=DEFAULT_BAND, help="recency band width (default: 64)")

    p = sub.add_parser("export", help="write a trace in the interchange .npz format (float32)")
    p.add_argument("--trace", default="canonical", help=f"{trace_help} (default: canonical)")
    p.add_argument("--out", required=True, help="path of the .npz to write")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")

    p = sub.add_parser("table", help="the policy cards' comparison and the calibration targets")
    common(p, TABLE_BUDGET)

    p = sub.add_parser("claims", help="every checkable claim of the two policy cards, measured, with its verdict")
    p.add_argument("--trace", default="canonical", help=f"{trace_help}, or all (canonical and every shipped "
                   "trace) (default: canonical)")
    p.add_argument("--json", action="store_true", help="print one JSON document (a list of claim records) and nothing else")

    p = sub.add_parser("bench", help="time the reference path against the fast engine on the canonical trace")
    p.add_argument("--full-reference", action="store_true", help="replay all 255 windows on the reference path "
                   "(about a minute and a half) instead of extrapolating from 16")
    p.add_argument("--browser", action="store_true", help="instead: drive the app in headless Chromium through "
                   "the steps of issue 11 and an eight-session load, each step's median and worst against its target")
    p.add_argument("--rounds", type=_positive_int, default=3, help="with --browser: rounds, each on a fresh server (default: 3)")
    p.add_argument("--sessions", type=_positive_int, default=8, help="with --browser: concurrent sessions of the load (default: 8)")
    p.add_argument("--no-load", action="store_true", help="with --browser: skip the concurrent sessions")
    p.add_argument("--only-load", action="store_true", help="with --browser: only the concurrent sessions")
    p.add_argument("--cold-cache", action="store_true", help="with --browser: every server gets a fresh, empty "
                   "KVSIM_CACHE_DIR (the canonical trace is generated again, as on a machine that never ran it)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")

    tunable = [name for name in POLICIES if "recent_window" in policy_params(name)]
    p = sub.add_parser("tune", help="per layer and KV head of a bundle: the smallest recent_window within 0.005 "
                       "of the best retained mass, and the model-wide figures")
    p.add_argument("--trace", required=True, help="a bundle (a shipped bundle's name or a folder with a manifest.json), "
                   f"or any one trace ({trace_help})")
    p.add_argument("--policy", default="h2o", choices=tunable, help="a policy with a recent_window (default: h2o)")
    p.add_argument("--budget", type=_positive_int, default=256, help="cache budget (default: 256); recent_window "
                   "is swept over 1 .. budget - 1")
    p.add_argument("--top-k", type=_positive_int, default=DEFAULT_TOP_K, help="k of top-k recall (default: 32)")
    p.add_argument("--tolerance", type=float, default=0.005, help="recommend the smallest window within this much "
                   "of the best retained mass (default: 0.005)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--serial", action="store_true", help="sweep here, one trace after another (the default "
                       "when Dask is not installed)")
    where.add_argument("--scheduler", default=None, metavar="ADDRESS", help="the address of a running Dask "
                       "scheduler (tcp://host:8786); default: local Dask processes on every core")
    p.add_argument("--workers", type=_positive_int, default=None, help="local Dask worker processes (default: one "
                   "per core)")
    p.add_argument("--curves", action="store_true", help="with --json, add every trace's curve over the windows")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")

    p = sub.add_parser("record", help="record a bundle of real traces from a causal LM (needs requirements-record.txt)")
    p.add_argument("text", help="a UTF-8 text file; its first --steps + 1 tokens are read")
    p.add_argument("--model", default=None, help="a local Hugging Face model folder or a hub id already in the local "
                   "cache (nothing is downloaded); default: the shipped Gemma-3-270M")
    p.add_argument("--out", required=True, help="the bundle folder to write (traces + manifest.json)")
    p.add_argument("--steps", type=_positive_int, default=4096, help="decode steps per trace (default: 4096)")
    p.add_argument("--layers", default="global", help="all, global (default: the layers without a sliding window) "
                   "or comma-separated layer numbers")
    p.add_argument("--gqa", choices=["mean", "max"], default="mean", help="how the query heads that share a KV head "
                   "are combined (default: mean)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs (default: cpu)")
    p.add_argument("--prefix", default=None, help="file name prefix (default: gemma3-270m, or the model folder's name)")
    p.add_argument("--source", default=None, help="where the text comes from, for the traces' meta")
    p.add_argument("--licence", default=None, help="the text's licence, for the traces' meta")
    p.add_argument("--model-licence", default=None, help="the model's licence, for the traces' meta")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")

    _add_quality_parser(sub, specs)
    return parser


def _policy_args(args: argparse.Namespace) -> dict:
    """The policy-specific flags that were given, checked against what ``args.policy`` takes."""
    accepted = policy_params(args.policy)
    given = {
        name[len("param_") :]: value
        for name, value in vars(args).items()
        if name.startswith("param_") and value is not None
    }
    for param in given:
        if param not in accepted:
            takes = ", ".join(_flag(p) for p in accepted) or "nothing beyond --budget"
            raise CLIError(f"{_flag(param)} does not apply to policy {args.policy} (it takes {takes})")
    return given


def cmd_replay(args: argparse.Namespace) -> object:
    params = _policy_args(args)
    budget = DEFAULT_BUDGET if args.budget is None else args.budget
    if not POLICIES[args.policy].needs_trace:
        make_policy(args.policy, budget=budget, **params)  # refuse bad parameters before loading the trace
    trace = resolve_trace(args.trace)
    result = replay(trace, args.policy, budget=budget, top_k=args.top_k, **params)
    return {"trace": trace.name, **result.summary()}


def cmd_sweep(args: argparse.Namespace) -> object:
    given = _policy_args(args)
    if args.budget is not None:
        given["budget"] = args.budget
    ranges = {p: parse_range(_flag(p), text) for p, text in given.items()}
    swept = [p for p, values in ranges.items() if ":" in given[p]]
    if len(swept) != 1:
        flags = [_flag(p) for p in policy_params(args.policy)] + ["--budget"]
        what = "none was" if not swept else f"{len(swept)} were ({', '.join(_flag(p) for p in swept)})"
        raise CLIError(f"sweep needs exactly one range A:B[:STEP] among {', '.join(flags)}; {what} given")
    param = swept[0]
    fixed = {p: values[0] for p, values in ranges.items() if p != param}
    budget = fixed.pop("budget", DEFAULT_BUDGET)
    trace = resolve_trace(args.trace)
    rows = sweep(trace, args.policy, budget, param, ranges[param], top_k=args.top_k, **fixed)
    return [{"trace": trace.name, **r} for r in rows]


def cmd_describe(args: argparse.Namespace) -> object:
    trace = resolve_trace(args.trace)
    return {"trace": trace.name, **describe(trace, band=args.band, top_k=args.top_k)}


def cmd_export(args: argparse.Namespace) -> object:
    trace = resolve_trace(args.trace)
    out = Path(args.out)
    if out.suffix != ".npz":
        raise CLIError(f"--out: {args.out} must end in .npz")
    try:
        save_npz(trace, out, dtype=np.float32)
    except OSError as e:
        raise CLIError(f"cannot write {args.out}: {e.strerror or type(e).__name__}") from None
    return {"trace": trace.name, "out": str(out), "steps": trace.steps, "dtype": "float32", "bytes": out.stat().st_size}


def cmd_record(args: argparse.Namespace) -> object:
    # the recorder's extra (torch, transformers) is optional: nothing of it is imported until asked for
    from .models.record import RecordError, record_bundle, require_extra

    layers = args.layers.strip()
    try:
        if args.model is None:
            require_extra()  # the shipped model's packages; load_hf_model checks torch and transformers itself
        kwargs = {} if not args.quiet else {"progress": None}
        doc = record_bundle(args.text, args.out, model=args.model, steps=args.steps,
                            layers=layers, gqa=args.gqa, device=args.device,
                            prefix=args.prefix, source=args.source, licence=args.licence,
                            model_licence=args.model_licence, **kwargs)
    except RecordError as e:
        raise CLIError(str(e)) from None
    return {"text": args.text, **doc}


def cmd_tune(args: argparse.Namespace) -> object:
    from .analysis.tune import LOCAL, dask_available, tune
    from .data.catalog import resolve_bundle, shipped_bundles

    spec = args.trace.strip()
    source = resolve_bundle(spec) if spec in shipped_bundles() or is_bundle(spec) else resolve_trace(spec)
    if args.workers is not None and (args.serial or args.scheduler):
        raise CLIError("--workers is for local Dask processes; it does not go with --serial or --scheduler")
    if args.scheduler:
        scheduler = args.scheduler
    elif args.serial or not dask_available():
        scheduler = None
    else:
        scheduler = LOCAL
    result = tune(source, args.policy, args.budget, tolerance=args.tolerance, top_k=args.top_k, scheduler=scheduler,
                  workers=args.workers, progress=None if args.quiet else progress.stderr("tune"))
    return result.to_dict(curves=args.curves)


def cmd_claims(args: argparse.Namespace) -> object:
    from .analysis.claims import ledger  # the ledger runs its own replays; nothing of it loads until asked for

    names = available_traces() if args.trace.strip() == "all" else [args.trace]
    return [record for name in names for record in ledger(resolve_trace(name))]


def cmd_bench(args: argparse.Namespace) -> object:
    say = None if args.json else progress.stderr("bench")
    browser_only = [f for f, on in (("--rounds", args.rounds != 3), ("--sessions", args.sessions != 8),
                                    ("--no-load", args.no_load), ("--only-load", args.only_load),
                                    ("--cold-cache", args.cold_cache)) if on]
    if args.browser:
        if args.full_reference:
            raise CLIError("--full-reference does not apply to --browser")
        if args.no_load and args.only_load:
            raise CLIError("--no-load and --only-load exclude each other")
        from .bench import browser as bench_browser

        return bench_browser.run(rounds=args.rounds, sessions=args.sessions, cold_cache=args.cold_cache,
                                 load=not args.no_load, single=not args.only_load, progress=say)
    if browser_only:
        raise CLIError(f"{', '.join(browser_only)} only apply with --browser")
    from .bench import speed as bench

    return bench.run(full_reference=args.full_reference, progress=say)


def cmd_table(args: argparse.Namespace) -> object:
    trace = resolve_trace(args.trace)
    budget = TABLE_BUDGET if args.budget is None else args.budget
    if budget < 1:
        raise CLIError(f"budget must be at least 1, got {budget}")
    return build_table(trace, budget=budget, top_k=args.top_k)


# --- readable output --------------------------------------------------------------------------


def _aligned(headers: list[str], rows: list[list], text: bool = False) -> str:
    """Columns padded to their widest cell; ``text`` left-aligns everything."""
    cells = [[_cell(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(items):
        # text left, numbers right, so columns of figures line up on the decimal point
        return "  ".join(
            s.rjust(w) if _numeric(s) and not text else s.ljust(w) for s, w in zip(items, widths, strict=True)
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _cell(x) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.4f}"
    return str(x)


def _numeric(s: str) -> bool:
    if s == "n/a":
        return True
    try:
        float(s)
    except ValueError:
        return False
    return True


def _summary_params(r: dict) -> dict:
    skip = {"trace", "policy", "budget", "retained_mass", "top_k_recall", "top_k", "steps"}
    return {k: v for k, v in r.items() if k not in skip}


def render(command: str, doc) -> str:
    if command == "replay":
        return _aligned(
            ["trace", "policy", "params", "budget", "steps", "retained_mass", f"top_{doc['top_k']}_recall"],
            [[doc["trace"], doc["policy"], params_label(_summary_params(doc)), doc["budget"], doc["steps"],
              doc["retained_mass"], doc["top_k_recall"]]],
        )
    if command == "sweep":
        top = best(doc)
        return _aligned(
            ["trace", "policy", "params", "budget", "retained_mass", f"top_{doc[0]['top_k']}_recall", "best"],
            [[r["trace"], r["policy"], params_label(_summary_params(r)), r["budget"], r["retained_mass"],
              r["top_k_recall"], "*" if r is top else ""] for r in doc],
        )
    if command == "describe":
        labels = {
            "trace": "trace",
            "steps": "steps",
            "sink_share": f"sink share (positions 0-{doc['sinks'] - 1}, steps t > {doc['sinks']})",
            "recent_share": f"recent share (last {doc['band']} positions, steps t > {doc['band']})",
            "top_k_share": f"top-{doc['top_k']} share (steps t > {doc['top_k']})",
            "effective_positions": "effective positions, exp(entropy) per row",
        }
        return _aligned(["figure", "value"], [[label, doc[k]] for k, label in labels.items()])
    if command == "record":
        return "\n".join([*(f"wrote {f['path']} (layer {f['layer']}, KV head {f['head']}, {f['bytes']} bytes)"
                            for f in doc["files"]), f"bundle {doc['bundle']}: {len(doc['files'])} traces, {doc['steps']} steps"])
    if command == "export":
        return f"wrote {doc['out']}: trace {doc['trace']}, {doc['steps']} steps, {doc['dtype']}, {doc['bytes']} bytes"
    if command == "table":
        return _render_table(doc)
    if command == "bench":
        if doc.get("kind") == "browser":
            from .bench import browser as bench_browser

            return bench_browser.render(doc)
        from .bench import speed as bench

        return bench.render(doc)
    if command == "claims":
        from .analysis.claims import render_ledger

        return render_ledger(doc)
    if command == "quality":
        return _render_quality(doc)
    if command == "tune":
        return _render_tune(doc)
    raise AssertionError(command)


def _render_table(doc: dict) -> str:
    k = doc["top_k"]
    parts = [
        f"Measured at budget {doc['budget']} on the {doc['trace']} trace ({doc['steps']} steps):",
        "",
        _aligned(
            ["policy", "params", "retained_mass", f"top_{k}_recall"],
            [[r["policy"], params_label(r["params"]), r["retained_mass"], r["top_k_recall"]] for r in doc["rows"]],
        ),
        *(f"{r['policy']} {params_label(r['params'])}: refused at this budget ({r['refused']})"
          for r in doc["rows"] if "refused" in r),
    ]
    s = doc["sweep"]
    if s["rows"]:
        parts += [
            "",
            f"{s['policy']} over {s['param']} (budget {doc['budget']}); * marks the largest retained mass:",
            "",
            _aligned(
                [s["param"], "retained_mass", f"top_{k}_recall", "best"],
                [[r[s["param"]], r["retained_mass"], r["top_k_recall"], "*" if r[s["param"]] == s["argmax"] else ""]
                 for r in s["rows"]],
            ),
        ]
    if doc["targets"] is not None:
        parts += [
            "",
            "Calibration targets (docs/domain.md, the canonical trace):",
            "",
            _aligned(
                ["figure", "target", "measured", "result"],
                [[t["figure"], t["target"], t["measured"], "PASS" if t["pass"] else "FAIL"] for t in doc["targets"]],
                text=True,
            ),
        ]
    else:
        parts += ["", "Calibration targets: not checked (they are for the canonical trace at budget 256)."]
    return "\n".join(parts)


# --- quality: what a real model loses under each policy (kvsim/quality.py) ------------------------


def _add_quality_parser(sub, specs: dict) -> None:
    p = sub.add_parser("quality", help="a real model's loss and KL on a text with its KV cache evicted by a policy "
                                       "(needs requirements-record.txt)")
    p.add_argument("text", help="a UTF-8 text file, or heapq for the shipped traces' text (CPython 3.11.7 Lib/heapq.py)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--policy", choices=list(POLICIES), help="registry name")
    which.add_argument("--policies", help="comma-separated registry names: a grid")
    p.add_argument("--budget", default="256", metavar="B[,B...]", help="cache budget per layer (default: 256)")
    for param, spec in specs.items():
        p.add_argument(_flag(param), dest=f"param_{param}", type=int, default=None, metavar="N",
                       help=f"{spec.help} (passed to the policies that take it)")
    p.add_argument("--sweep", nargs=2, metavar=("PARAM", "A:B[:STEP]"), help="one measurement per value of a "
                   "policy parameter, e.g. --sweep recent_window 8:248:16")
    p.add_argument("--steps", type=_positive_int, default=1024, help="decode steps N (default: 1024)")
    p.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the shipped Gemma-3-270M)")
    p.add_argument("--mode", choices=["closed", "open", "both"], default="closed",
                   help="closed: token-by-token decoding with the real cache evicted (the truth); open: one "
                        "teacher-forced pass masked by the replay of the full-cache traces (default: closed)")
    p.add_argument("--batch", type=_positive_int, default=8, help="closed loops decoded together, sharing each "
                   "step's read of the weights (default: 8)")
    p.add_argument("--no-cache", action="store_true", help="measure again instead of reading cached results")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")


def cmd_quality(args: argparse.Namespace) -> object:
    # torch and transformers are imported by kvsim.models.quality's functions only when a measurement runs
    from .models import quality

    names = [args.policy] if args.policy else [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in names if x not in POLICIES]
    if unknown or not names:
        raise CLIError(f"--policies: unknown policy {unknown[0]!r}; known: {', '.join(POLICIES)}" if unknown
                       else "--policies: no policy given")
    budgets = []
    for part in args.budget.split(","):
        try:
            budgets.append(_positive_int(part.strip()))
        except argparse.ArgumentTypeError as e:
            raise CLIError(f"--budget: {e}") from None
    params = {name[len("param_"):]: v for name, v in vars(args).items() if name.startswith("param_") and v is not None}
    sweep = None
    if args.sweep:
        param, text = args.sweep
        if param not in specs_of(names):
            raise CLIError(f"--sweep: no policy among {', '.join(names)} takes {param!r}")
        sweep = (param, parse_range("--sweep", text))
    for param in params:
        if param not in specs_of(names):
            raise CLIError(f"{_flag(param)} does not apply to {', '.join(names)}")
    if args.policy and not sweep and len(budgets) == 1 and not POLICIES[args.policy].needs_trace:
        make_policy(args.policy, budget=budgets[0], **params)  # refuse bad parameters before loading a model
    modes = ["closed", "open"] if args.mode == "both" else [args.mode]
    say = None if args.quiet else quality.QUALITY_STDERR  # kvsim.progress.stderr("kvsim quality")
    from .models.record import RecordError, read_text, require_extra

    try:
        text = quality.resolve_text(args.text)
        read_text(text)  # refuse a missing or empty text before loading a model
        if args.model is None:
            require_extra()
        session = quality.open_session(text, args.steps, args.model, progress=say)
        rows = quality.grid(session, names, budgets, modes, params, sweep, use_cache=not args.no_cache,
                            batch=args.batch, progress=say)
    except (quality.QualityError, RecordError) as e:
        raise CLIError(str(e)) from None
    single = args.policy and not sweep and len(budgets) == 1 and len(modes) == 1
    if single:
        if not rows:
            raise CLIError(f"{args.policy} cannot run at budget {budgets[0]} with these parameters")
        return rows[0]
    return rows


def specs_of(names: list[str]) -> set[str]:
    """The parameters that at least one of these policies takes."""
    return {p for n in names for p in policy_params(n)}


def _render_quality(doc) -> str:
    rows = [doc] if isinstance(doc, dict) else doc
    return _aligned(
        ["policy", "params", "budget", "mode", "steps", "nll_full", "nll", "delta_nll", "ppl", "kl", "retained_mass",
         "seconds"],
        [[r["policy"], params_label(r["params"]), r["budget"], r["mode"], r["steps"], r["nll_full"], r["nll"],
          r["delta_nll"], r["ppl"], r["kl"], r["retained_mass"], round(r["seconds"], 1)] for r in rows],
    )


def _render_tune(doc: dict) -> str:
    k, tol = doc["top_k"], doc["tolerance"]
    rows = [[r["layer"], r["head"], r["attention"], r["recommended_window"], r["recommended_mass"], r["recommended_recall"],
             r["best_window"], r["best_mass"], r["sliding_window"]["retained_mass"], r["streaming_llm"]["retained_mass"]]
            for r in doc["layers"]]
    m = doc["model"]
    one, per, head, base = m["one_window"], m["per_layer_windows"], m["per_head_windows"], m["baselines"]
    shared_heads = any(r["kv_heads"] > 1 for r in doc["per_layer"])
    per_layer = [] if not shared_heads else [
        "",
        "One window per layer, shared by its KV heads (on the mean of their curves):",
        "",
        _aligned(["layer", "kv_heads", "recommended", "retained_mass", f"top_{k}_recall", "best", "best_mass"],
                 [[r["layer"], r["kv_heads"], r["recommended_window"], r["recommended_mass"], r["recommended_recall"],
                   r["best_window"], r["best_mass"]] for r in doc["per_layer"]]),
    ]
    by_head = [] if not shared_heads else [
        ["per-KV-head recommended windows", "per head", head["recommended_mass"], head["recommended_recall"]]]
    run = doc["run"]
    how = "serially" if run["executor"] == "serial" else f"on Dask ({run['workers']} workers, {run['scheduler']})"
    return "\n".join([
        f"{doc['policy']} on {doc['trace']} at budget {doc['budget']}: recent_window {doc['windows'][0]}..{doc['windows'][1]}; "
        f"recommended = the smallest window within {tol} of the trace's best retained mass",
        "",
        _aligned(["layer", "kv_head", "attention", "recommended", "retained_mass", f"top_{k}_recall", "best",
                  "best_mass", "sliding_window", "streaming_llm"], rows),
        *per_layer,
        "",
        "Model-wide (mean over every layer and KV head):",
        "",
        _aligned(["setting", "recent_window", "retained_mass", f"top_{k}_recall"], [
            ["per-layer recommended windows", "per layer", per["recommended_mass"], per["recommended_recall"]],
            *by_head,
            ["one window for all layers (recommended)", one["recommended_window"], one["recommended_mass"],
             one["recommended_recall"]],
            ["one window for all layers (best)", one["best_window"], one["best_mass"], one["best_recall"]],
            ["sliding_window", "n/a", base["sliding_window"]["retained_mass"], base["sliding_window"]["top_k_recall"]],
            ["streaming_llm sinks=4", "n/a", base["streaming_llm"]["retained_mass"], base["streaming_llm"]["top_k_recall"]],
        ], text=False),
        "",
        f"{len(doc['layers'])} traces swept {how} in {run['seconds']:.1f} s",
    ])


def _jsonable(x):
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


COMMANDS = {"replay": cmd_replay, "sweep": cmd_sweep, "describe": cmd_describe, "export": cmd_export, "table": cmd_table,
            "record": cmd_record, "bench": cmd_bench, "claims": cmd_claims, "quality": cmd_quality, "tune": cmd_tune}


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help and friends
            return int(e.code or 0)
        doc = COMMANDS[args.command](args)
        text = json.dumps(_jsonable(doc), indent=2, allow_nan=False) if args.json else render(args.command, doc)
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return 0
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130
    except BrokenPipeError:
        # the reader went away (``| head``): point stdout at devnull so the exit flush stays quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:  # CLIError, TraceError, ValueError from policies, OSError, a ContractError
        _fail(_one_line(e))
        return 2 if isinstance(e, CLIError) else 1


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if not isinstance(e, (CLIError, ValueError, OSError)):
        text = f"{type(e).__name__}: {text}"
    return text


def _fail(message: str) -> None:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.stderr.flush()


__all__ = ["build_parser", "main", "parse_range"]

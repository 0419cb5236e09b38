"""``kvsim learn``: fit the ``learned`` policy's linear scorer to the exact optimum's evictions on some traces,
write its weights (JSON), and judge it on held-out traces against the hand-written policies and the optimum
(docs/learned.md). Progress goes to stderr, one line per stage and per Newton iteration.

- ``kvsim learn --trace gemma3-270m-L05 --budget 128,256 --out weights.json``: fit and write the weights;
- ``... --eval gemma3-270m-L11 gemma3-270m-L17 --eval-budget 128,256,512 --study study.json``: then evaluate,
  and write the study (the weights, the figures, the command) as JSON;
- ``kvsim learn --weights FILE --eval ...``: evaluate weights already fitted, without a fit;
- ``kvsim learn --doc docs/learned-study.json``: print docs/learned.md from a study's JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..policykit.base import WINDOW
from .argtypes import positive_int, size_list
from .errors import CLIError


def _features(text: str) -> list[str]:
    return [f.strip() for f in text.split(",") if f.strip()]


def add_learn(sub) -> None:
    from ..policies.learned import ATTENTION_FEATURES, FEATURES

    p = sub.add_parser("learn", help="fit the learned policy's scorer to the exact optimum's evictions; evaluate it on "
                       "held-out traces (docs/learned.md)")
    p.add_argument("--trace", action="append", default=None, metavar="TRACE",
                   help="a trace to fit on (repeat for several; default: gemma3-270m-L05)")
    p.add_argument("--budget", type=size_list, default=[256], metavar="B[,B...]",
                   help="the budgets whose optimal schedules are imitated; the shipped weights used 128,256 "
                   "(default: 256)")
    p.add_argument("--features", type=_features, default=None, metavar="F[,F...]",
                   help=f"the features (default: {','.join(ATTENTION_FEATURES)}; known: {', '.join(FEATURES)})")
    p.add_argument("--recent-window", type=int, default=None, metavar="N",
                   help="the newest positions the policy never evicts (default: the learned policy's default)")
    p.add_argument("--loss", choices=["pairs", "choice"], default="pairs", help="pairs: a candidate the optimum keeps "
                   "against one it evicts soon, pairwise logistic (default); choice: the optimum's victim against the "
                   "step's other candidates, softmax (docs/learned.md)")
    p.add_argument("--horizon", type=int, default=32, metavar="N", help="with --loss pairs: a candidate the optimum "
                   "evicts within N steps (or has evicted) counts as evicted (default: 32)")
    p.add_argument("--dagger", type=int, default=3, metavar="N", help="rounds that walk the fitted policy's own "
                   "schedule, labelled by the optimum, and fit again (default: 3; 0: the optimum's schedule alone)")
    p.add_argument("--l2", type=float, default=1e-3, help="the L2 penalty on the standardised weights (default: 0.001)")
    p.add_argument("--stride", type=positive_int, default=1, metavar="N", help="use every N-th evicting step (default: 1)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the fitted weights (JSON) here")
    p.add_argument("--weights", default=None, metavar="FILE", help="evaluate these weights instead of fitting")
    p.add_argument("--eval", nargs="+", default=None, metavar="TRACE", help="held-out traces to evaluate on")
    p.add_argument("--eval-budget", type=size_list, default=None, metavar="B[,B...]",
                   help="the budgets to evaluate at (default: --budget's)")
    p.add_argument("--study", default=None, metavar="FILE", help="with --eval: write the study (weights, figures, "
                   "command) as JSON here")
    p.add_argument("--add", action="store_true", help="with --weights, --eval and --study: add the rows to that "
                   "study (fitted with these weights), a row of the same trace and budget replaced, and list the command")
    p.add_argument("--doc", default=None, metavar="STUDY", help="print docs/learned.md from a study's JSON and stop")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")


def command_line(args: argparse.Namespace) -> str:
    """The ``kvsim learn`` line that makes this study again."""
    words = ["python", "-m", "kvsim", "learn"]
    if args.weights is not None:
        words += ["--weights", args.weights]
    else:
        for t in args.trace or ["gemma3-270m-L05"]:
            words += ["--trace", t]
        words += ["--budget", ",".join(map(str, args.budget))]
        if args.features is not None:
            words += ["--features", ",".join(args.features)]
        if args.recent_window is not None:
            words += ["--recent-window", str(args.recent_window)]
        if args.loss != "pairs":
            words += ["--loss", args.loss]
        if args.horizon != 32:
            words += ["--horizon", str(args.horizon)]
        if args.dagger != 3:
            words += ["--dagger", str(args.dagger)]
        if args.l2 != 1e-3:
            words += ["--l2", repr(args.l2)]
        if args.stride != 1:
            words += ["--stride", str(args.stride)]
        if args.out:
            words += ["--out", args.out]
    words += ["--eval", *args.eval]
    if args.eval_budget:
        words += ["--eval-budget", ",".join(map(str, args.eval_budget))]
    words += ["--study", args.study]
    if args.add:
        words += ["--add"]
    return " ".join(shlex.quote(w) for w in words)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def cmd_learn(args: argparse.Namespace) -> dict:
    if args.doc is not None:
        from ..views.learned import study_markdown

        try:
            study = json.loads(Path(args.doc).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CLIError(f"--doc {args.doc}: cannot read the study ({e})") from None
        return {"markdown": study_markdown(study)}
    from ..analysis.learn import check_inputs, evaluate, learn
    from ..data.catalog import resolve_trace
    from ..policies.learned import ATTENTION_FEATURES, RECENT_WINDOW, load_weights

    if args.add and (args.weights is None or args.eval is None or args.study is None):
        raise CLIError("--add needs --weights FILE, --eval TRACE ... and --study FILE: the study the rows join")
    if args.weights is not None:
        if args.out or args.trace:
            raise CLIError("--weights evaluates weights already fitted: it takes no --trace or --out")
        if args.eval is None:
            raise CLIError("--weights needs --eval TRACE ...: what to evaluate the weights on")
        weights = load_weights(args.weights)
        if args.features is not None and args.features != weights["features"]:
            raise CLIError(f"--weights {args.weights}: weights for another feature set ({','.join(weights['features'])}, "
                           f"not --features {','.join(args.features)})")
        if args.recent_window is not None and args.recent_window != weights[WINDOW]:
            raise CLIError(f"--weights {args.weights}: fitted with recent window {weights['recent_window']}, "
                           f"not --recent-window {args.recent_window}")
    else:
        features = args.features if args.features is not None else list(ATTENTION_FEATURES)
        rw = RECENT_WINDOW.default if args.recent_window is None else args.recent_window
        if rw < 0:
            raise CLIError(f"--recent-window {rw}: must be non-negative")
        traces = [resolve_trace(s) for s in (args.trace or ["gemma3-270m-L05"])]
        held = [resolve_trace(s) for s in args.eval] if args.eval else []
        check_inputs(held, args.eval_budget or args.budget, features, rw)  # the evaluation's refusals before the fit
        weights = learn(traces, args.budget, features, rw, loss=args.loss, horizon=args.horizon, dagger=args.dagger,
                        l2=args.l2, stride=args.stride, say=_say)
        if args.out:
            Path(args.out).write_text(json.dumps(weights, indent=1) + "\n", encoding="utf-8")
            _say(f"learn: weights written to {args.out}")
    before = _study_to_add_to(args.study, weights) if args.add else None  # refused before the evaluation
    doc = {"weights": weights, "rows": None}
    if args.eval:
        held = [resolve_trace(s) for s in args.eval]
        doc["rows"] = evaluate(held, args.eval_budget or weights.get("budgets") or args.budget, weights, say=_say)
        if args.study:
            if before is not None:  # read again: another --add may have written it while this one evaluated
                study = add_rows(_study_to_add_to(args.study, weights), doc["rows"], command_line(args))
            else:
                study = {"command": command_line(args), "weights": weights, "rows": doc["rows"]}
            Path(args.study).write_text(json.dumps(study, indent=1) + "\n", encoding="utf-8")
            _say(f"learn: study written to {args.study}")
    return doc


def _study_to_add_to(path: str, weights: dict) -> dict:
    """The study ``--add`` adds rows to: readable, and fitted with these very weights."""
    try:
        study = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CLIError(f"--study {path}: cannot read the study to add to ({e})") from None
    if not isinstance(study, dict) or not isinstance(study.get("rows"), list) or "command" not in study:
        raise CLIError(f"--study {path}: not a study of kvsim learn (no command and rows)")
    if study.get("weights") != weights:
        raise CLIError(f"--study {path}: its weights are not --weights': rows of other weights would not add up")
    return study


def add_rows(study: dict, rows: list[dict], command: str) -> dict:
    """The study with ``rows`` added (an old row of the same trace and budget replaced, in its place) and
    ``command`` listed among its ``added_by`` commands (once)."""
    new = {(r["trace"], r["budget"]): r for r in rows}
    old = {(r["trace"], r["budget"]) for r in study["rows"]}
    merged = [new.get((r["trace"], r["budget"]), r) for r in study["rows"]]
    merged += [r for r in rows if (r["trace"], r["budget"]) not in old]
    added = list(study.get("added_by", []))
    if command not in added:
        added.append(command)
    return {**study, "rows": merged, "added_by": added}


def render_learn(doc: dict) -> str:
    if "markdown" in doc:
        return doc["markdown"].rstrip("\n")
    from ..views.learned import rows_table, weights_table

    parts = [weights_table(doc["weights"])]
    if doc.get("rows"):
        parts.append(rows_table(doc["rows"]))
    return "\n\n".join(parts)

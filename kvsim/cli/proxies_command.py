"""``kvsim proxies``: the proxy study (docs/proxies.md). Every proxy of every configuration beside the
model's own loss on real models and texts, reduced to Spearman and regret per proxy
(``kvsim.analysis.study``). Everything measured is cached on disk, so a second run, or one that adds a
model or a text, measures only what is new."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..analysis.study import TRUTH_CHOICES, agreement, ranking, verdict
from ..data.files import atomic_write
from ..policykit.registry import online, study_fixed, study_sweeps
from ..progress import stderr
from . import cluster_flags
from .cluster_flags import add_cluster_flags
from .errors import CLIError

DEFAULT_TEXTS = ("code-heapq.py", "prose-rust-book-introduction.txt", "legal-gpl-3.0.txt")
DEFAULT_MODELS = ("gemma3-270m", "smollm2-135m")


def add_proxies(sub) -> None:
    p = sub.add_parser("proxies", help="the proxy study: each proxy of the loss against the truth (KL, delta NLL) on "
                       "real models and texts, with Spearman and regret per proxy (needs the record extra)")
    # one spelling per idea in every command (--model, --text, --budget); the plural ones are the old spellings, still taken
    p.add_argument("--model", dest="models", default=",".join(DEFAULT_MODELS), metavar="M[,M...]", help="comma-separated: "
                   f"gemma3-270m, smollm2-135m or local model folders (default: {','.join(DEFAULT_MODELS)})")
    p.add_argument("--text", dest="texts", default=",".join(DEFAULT_TEXTS), metavar="T[,T...]", help="comma-separated "
                   f"text files; a bare name is looked up in traces/texts/ (default: {','.join(DEFAULT_TEXTS)})")
    p.add_argument("--budget", dest="budgets", default="64,256", metavar="B[,B...]", help="comma-separated cache budgets "
                   "(default: 64,256)")
    for old in ("models", "texts", "budgets"):
        p.add_argument(f"--{old}", dest=old, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=512, help="decode steps per text (default: 512)")
    p.add_argument("--windows", type=int, default=8, help="recent_windows per sweep, evenly spaced (default: 8)")
    p.add_argument("--sweeps", default=",".join(study_sweeps()), help=f"the policies whose recent_window is swept "
                   f"(default: {','.join(study_sweeps())})")
    p.add_argument("--closed", default="code-heapq.py:64", metavar="[MODEL@]TEXT:BUDGET[,...]", help="where the h2o "
                   "sweep and the fixed policies also get the closed loop, the authority, for every model or MODEL "
                   "only (default: code-heapq.py:64; 'none' for none)")
    p.add_argument("--out", default=None, help="write the rows and the verdict to this JSON file (atomically)")
    p.add_argument("--no-cache", action="store_true", help="measure again instead of reading cached results")
    p.add_argument("--fixed", default=",".join(study_fixed()), help="comma-separated: the policies measured at their "
                   f"defaults in every cell, the scorers' table's rows (default: {','.join(study_fixed())})")
    p.add_argument("--truth", default="kl", choices=tuple(TRUTH_CHOICES), help="the open-loop truth the proxies are "
                   "ranked against per model x text x budget: kl, delta_nll (over every token) or delta_nll_key (over the "
                   "key tokens only, LongPPL's rule: docs/proxies.md); the ranking is in --json and --out, in the text "
                   "output, and, for a truth other than kl, a table of its own in --markdown (default: kl)")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown (docs/proxies.md's)")
    add_cluster_flags(p, "each configuration's proxies and truth")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")


def _list(text: str, flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise CLIError(f"{flag}: nothing listed")
    return items


def _plan(args: argparse.Namespace) -> tuple[list[Path], list[int], dict]:
    from ..models.truth import TEXTS_DIR

    texts = [Path(t) if Path(t).exists() or "/" in t else TEXTS_DIR / t for t in _list(args.texts, "--text")]
    for t in texts:
        if not t.is_file():
            raise CLIError(f"--text: {t}: no such file")
    try:
        budgets = [int(b) for b in _list(args.budgets, "--budget")]
    except ValueError:
        raise CLIError(f"--budget: expected comma-separated integers, got {args.budgets!r}") from None
    if min(budgets) < 4 or args.windows < 2 or args.steps < 16:
        raise CLIError("--budget must be at least 4, --windows at least 2 and --steps at least 16")
    closed = {}
    if args.closed != "none":
        for item in _list(args.closed, "--closed"):
            where, _, budget = item.rpartition(":")
            model, _, name = where.rpartition("@")
            if not name or not budget.isdigit():
                raise CLIError(f"--closed: expected [MODEL@]TEXT:BUDGET, got {item!r}")
            closed[(model or None, Path(name).name, int(budget))] = ["h2o", None]
    return texts, budgets, closed


def cmd_proxies(args: argparse.Namespace) -> dict:
    from ..analysis.proxies import configuration
    from ..models import quality, truth
    from ..models.errors import RecordError

    texts, budgets, closed = _plan(args)
    sweeps = _list(args.sweeps, "--sweeps")
    if set(sweeps) - set(study_sweeps()):
        raise CLIError(f"--sweeps: each of {', '.join(study_sweeps())}, got {args.sweeps!r}")
    fixed = _list(args.fixed, "--fixed")
    if unknown := [f for f in fixed if f not in online()]:
        raise CLIError(f"--fixed: {', '.join(unknown)} is not an online policy ({', '.join(online())})")
    say = None if args.quiet else stderr("kvsim proxies")
    models = _list(args.models, "--model")

    def sessions(fanout):
        for model in models:
            loaded = quality.load(model, say)
            for text in texts:
                session = quality.open_session(text, args.steps, model, model_and_tokenizer=loaded, progress=say,
                                               use_cache=not args.no_cache)
                session.fanout = fanout
                yield session

    try:
        ids = {m: quality.model_id_of(m) for m in models}
        where = {(ids[m], t, b): w for m in models for (only, t, b), w in closed.items() if only in (None, m)}
        with cluster_flags.fanout(args, say) as fanout:  # an unreachable scheduler is refused before a model loads
            rows = truth.study(sessions(fanout), budgets, args.windows, where, proxies=configuration,
                               use_cache=not args.no_cache, progress=say, sweeps=sweeps, fixed=fixed)
    except (quality.QualityError, RecordError) as e:
        raise CLIError(str(e)) from None
    doc = {"plan": {"models": models, "texts": [t.name for t in texts], "budgets": budgets, "steps": args.steps,
                    "windows": args.windows, "sweeps": sweeps, "fixed": fixed, "truth": args.truth,
                    "closed": [f"{m + '@' if m else ''}{t}:{b}" for m, t, b in closed]},
           "verdict": verdict(rows), "ranking": ranking(rows, TRUTH_CHOICES[args.truth]), "open_vs_closed": agreement(rows),
           "rows": rows}
    if args.out:
        blob = json.dumps(doc, indent=1).encode()
        atomic_write(Path(args.out), lambda f: f.write(blob))
    doc["markdown"] = args.markdown
    return doc


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:+.{digits}f}" if digits < 0 else f"{x:.{digits}f}"


def render_proxies(doc: dict) -> str:
    if doc.get("markdown"):
        return markdown(doc)
    v = doc["verdict"]
    lines = [f"{v['configurations']} configurations, {v['cells']} model x text x budget, {v['sweeps']} window sweeps",
             "proxy                     rho all (mean/worst)  rho in sweeps (mean/worst)  KL regret (mean/worst)  "
             "rho closed in sweeps"]
    for name, e in v["proxies"].items():
        o = e.get("kl_open", {})
        c = e.get("kl_closed", {})
        reg = o.get("regret", {})
        lines.append(f"{name:<25} {_f(o.get('spearman_overall', {}).get('mean')):>8} / {_f(o.get('spearman_overall', {}).get('worst')):<8}"
                     f"   {_f(o.get('spearman_within', {}).get('mean')):>8} / {_f(o.get('spearman_within', {}).get('worst')):<8}"
                     f"     {_pct(reg.get('mean')):>7} / {_pct(reg.get('worst')):<8}"
                     f"  {_f(c.get('spearman_within', {}).get('mean'))}")
    lines.append(f"best proxy (least worst within-sweep KL regret): {v['best']}")
    if doc.get("ranking"):
        lines += ["", *ranking_text(doc["ranking"])]
    a = doc.get("open_vs_closed")
    if a:
        lines.append(f"open vs closed KL on {a['configurations']} configurations: Spearman {_f(a['spearman'])}, "
                     f"open/closed {_f(a['open_over_closed_mean'])} on average")
    return "\n".join(lines)


def markdown(doc: dict) -> str:
    """The study's tables in Markdown: per proxy, Spearman with the truth and its regret; per sweep, the
    windows mass and the best proxy recommend against the truth's."""
    v = doc["verdict"]
    out = ["| proxy | rho KL open, all (mean / worst) | rho KL open, in sweeps (mean / worst) | rho delta NLL, in sweeps "
           "(mean) | rho KL closed, in sweeps (mean) | KL regret in sweeps (mean / worst) | worst at |",
           "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, e in v["proxies"].items():
        o, d, c = e.get("kl_open", {}), e.get("delta_nll_open", {}), e.get("kl_closed", {})
        reg = o.get("regret", {})
        at = reg.get("worst_at") or {}
        out.append(f"| {name} | {_f(o['spearman_overall']['mean'])} / {_f(o['spearman_overall']['worst'])} | "
                   f"{_f(o['spearman_within']['mean'])} / {_f(o['spearman_within']['worst'])} | "
                   f"{_f(d.get('spearman_within', {}).get('mean'))} | {_f(c.get('spearman_within', {}).get('mean'))} | "
                   f"{_pct(reg.get('mean'))} / {_pct(reg.get('worst'))} | "
                   f"{' '.join(str(at[k]) for k in ('model', 'text', 'budget', 'sweep')) if at else '-'} |")
    best = v["best"]
    out += ["", f"Per window sweep: the window retained mass and {best} (the best proxy) recommend, against the truth's "
            "(open-loop KL).", "",
            "| model | text | budget | sweep | truth's best (KL) | mass picks | mass regret | "
            f"{best} picks | {best} regret |", "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    mass = {(s["model"], s["text"], s["budget"], s["sweep"]): s
            for s in v["proxies"]["retained_mass"]["kl_open"]["regret"]["sweeps"]}
    for s in v["proxies"][best]["kl_open"]["regret"]["sweeps"]:
        m = mass[(s["model"], s["text"], s["budget"], s["sweep"])]
        out.append(f"| {s['model'].split('-')[0]} | {s['text']} | {s['budget']} | {s['sweep']} | {s['truth_window']} "
                   f"({s['best_truth']:.4f}) | {m['proxy_window']} | {_pct(m['regret'])} | {s['proxy_window']} | "
                   f"{_pct(s['regret'])} |")
    out += ["", *scorers_table(doc["rows"])]
    r = doc.get("ranking")
    if r and r["truth"] != TRUTH_CHOICES["kl"]:
        out += ["", *ranking_table(r)]
    a = doc.get("open_vs_closed")
    if a:
        out += ["", f"Open loop against closed (the authority) on {a['configurations']} configurations: Spearman of KL "
                f"{_f(a['spearman'])}; open / closed KL {_f(a['open_over_closed_mean'])} on average "
                f"({_f(a['open_over_closed_range'][0])} .. {_f(a['open_over_closed_range'][1])})."]
    return "\n".join(out)


def scorers_table(rows: list[dict]) -> list[str]:
    """Which policy at its defaults the truth prefers in each model x text x budget: the fixed policies
    (``--fixed``) ranked by open-loop KL, least first, with retained mass beside (Markdown lines)."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("sweep") is None and r.get("kl_open") is not None:
            cells.setdefault((r["model"], r["text"], r["budget"]), []).append(r)
    out = ["Which scorer the truth prefers: every policy at its defaults (`--fixed`), ranked by open-loop KL in each "
           "model x text x budget (retained mass in brackets).", "",
           "| model | text | budget | truth prefers (KL) | then | last |", "| --- | --- | ---: | --- | --- | --- |"]
    for (model, text, budget), got in cells.items():
        ranked = sorted(got, key=lambda r: (r["kl_open"], r["policy"]))
        name = lambda r: f"{r['policy']} {r['kl_open']:.4f} ({r['retained_mass']:.3f})"  # noqa: E731
        out.append(f"| {model.split('-')[0]} | {text} | {budget} | {name(ranked[0])} | "
                   f"{', '.join(name(r) for r in ranked[1:-1]) or '-'} | {name(ranked[-1]) if len(ranked) > 1 else '-'} |")
    return out


#: how the tables name each truth
TRUTH_LABELS = {"kl_open": "KL", "delta_nll_open": "delta NLL", "delta_nll_key_open": "key-token delta NLL"}


def ranking_text(r: dict) -> list[str]:
    """The ranking (``kvsim.analysis.study.ranking``) as plain lines: per proxy its Spearman with the truth
    over the model x text x budget cells that rank anything, and the cells that rank nothing, with why."""
    label = TRUTH_LABELS.get(r["truth"], r["truth"])
    out = [f"which proxy predicts {label} (Spearman over each model x text x budget's configurations, mean/worst):"]
    for e in r["proxies"]:
        w = e.get("within_sweeps") or {}
        out.append(f"  {e['proxy']:<25} {_f(e['mean']):>8} / {_f(e['worst']):<8} over {e['n']} cells"
                   + (f"; within {w['n']} window sweeps {_f(w['mean'])} / {_f(w['worst'])}" if w.get("n") else ""))
    for c in r["cells"]:
        if c.get("why_none"):
            out.append(f"  {c['model']} {c['text']} {c['budget']}: nothing ranked ({c['why_none']}; key tokens "
                       f"{c['key_tokens']})")
    out.append(f"best by mean: {r['best']}")
    return out


def ranking_table(r: dict) -> list[str]:
    """The ranking as docs/proxies.md's tables: per proxy, and per model x text x budget with the number of
    key tokens the loss averages over."""
    label = TRUTH_LABELS.get(r["truth"], r["truth"])
    beside = [t for t in (r["proxies"][0]["beside_mean"] if r["proxies"] else {})]
    out = [f"Which proxy predicts the {label}: each proxy's Spearman with it over the configurations of each model x "
           f"text x budget (mean and worst over the cells that rank anything), best mean first; beside, its mean "
           f"Spearman with {' and '.join(TRUTH_LABELS.get(t, t) for t in beside)} over the same cells.", "",
           f"| proxy | rho {label} (mean / worst) | cells | "
           + " | ".join(f"rho {TRUTH_LABELS.get(t, t)} (mean)" for t in beside) + " |",
           "| --- | ---: | ---: | " + " | ".join("---:" for _ in beside) + " |"]
    if any(e["within_sweeps"]["n"] for e in r["proxies"]):  # sweeps of 3 windows or more: ranked within each too
        out[-2:] = [out[-2] + f" rho {label} within sweeps (mean / worst, sweeps) |", out[-1] + " ---: |"]
    for e in r["proxies"]:
        w = e["within_sweeps"]
        out.append(f"| {e['proxy']} | {_f(e['mean'])} / {_f(e['worst'])} | {e['n']} | "
                   + " | ".join(_f(e["beside_mean"][t]) for t in beside) + " |"
                   + (f" {_f(w['mean'])} / {_f(w['worst'])}, {w['n']} |" if any(x["within_sweeps"]["n"] for x in r["proxies"])
                      else ""))
    best = r["best"]
    agree = "; ".join(f"with {TRUTH_LABELS.get(t, t)} {_f(a['mean'])} on average (worst {_f(a['worst'])}, {a['n']} cells)"
                      for t, a in r.get("truths_agree", {}).items())
    if agree:
        out += ["", f"The {label} itself ranks each cell's configurations as follows (Spearman): {agree}."]
    out += ["", f"Per model x text x budget: how many key tokens the loss averages over, the Spearman of "
            f"retained mass and of {best} (the best mean) with the {label}, and the proxies that rank best there.", "",
            f"| model | text | budget | key tokens | configurations | retained_mass | {best} | best here |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for c in r["cells"]:
        rhos = {p: v for p, v in c["spearman"].items() if v is not None}
        top = max(rhos.values()) if rhos else None
        here = ", ".join(p for p, v in rhos.items() if v == top) if rhos else None  # every proxy that ties for it
        out.append(f"| {c['model'].split('-')[0]} | {c['text']} | {c['budget']} | {c['key_tokens']} | "
                   f"{c['with_truth']} of {c['configurations']} | {_f(c['spearman'].get('retained_mass'))} | "
                   f"{_f(c['spearman'].get(best)) if best else '-'} | "
                   + (f"{here} {_f(top)} |" if here else f"none: {c['why_none']} |"))
    if r.get("sweeps") and best:
        others = list(r["sweeps"][0]["beside_windows"])
        out += ["", f"Per window sweep: the window the {label} is least at, the windows "
                f"{' and '.join(TRUTH_LABELS.get(t, t) for t in others)} are least at, and the windows retained mass and "
                f"{best} pick, with the {label} there.", "",
                "| model | text | budget | sweep | " + " | ".join(f"{TRUTH_LABELS.get(t, t)}'s best" for t in others)
                + f" | {label}'s best | mass picks | {best} picks |",
                "| --- | --- | ---: | --- | " + " | ".join("---:" for _ in others) + " | ---: | ---: | ---: |"]
        for sw in r["sweeps"]:
            picks = [f"{sw['picks'][p]['window']} ({sw['picks'][p]['truth']:+.3f})" if p in sw["picks"] else "-"
                     for p in ("retained_mass", best)]
            out.append(f"| {sw['model'].split('-')[0]} | {sw['text']} | {sw['budget']} | {sw['sweep']} | "
                       + " | ".join(str(sw["beside_windows"].get(t, "-")) for t in others)
                       + f" | {sw['truth_window']} ({sw['best_truth']:+.3f}) | {' | '.join(picks)} |")
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


__all__ = ["DEFAULT_MODELS", "DEFAULT_TEXTS", "add_proxies", "cmd_proxies", "render_proxies"]

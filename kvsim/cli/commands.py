"""What each command does: parse its flags into calls of the package, return a JSON-ready document.

``kvsim.cli.render`` turns the document into text; ``--json`` prints it as it is. A flag is only passed
to a policy that takes that parameter, and giving it to one that does not is an error naming the flag.
``replay`` and ``sweep`` live in ``replay_command`` (with ``load``, the reading of ``--trace``), so that
their processes import none of what the commands here run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

from .. import progress as protocol
from ..analysis import proxies as px
from ..analysis.metrics import describe, renormalised, repair_note
from ..analysis.table import TABLE_BUDGET, build_table
from ..data.bundle import is_bundle
from ..data.catalog import available_traces
from ..data.qk import DENSE_LIMIT
from ..data.trace import save_npz
from ..policies import POLICIES, PolicySpec, policy_params
from ..policies.registry import suggest
from ..sim.simulate import replay
from . import layout_flags, report
from .errors import CLIError, InputError, flag, read_input
from .parser import parse_range, positive_int
from .replay_command import allocated, cmd_replay, cmd_sweep, load, measured, routed

#: the Streamlit script ``kvsim app`` runs: the thin entry at the checkout's root (a non-editable
#: install does not carry it; the app runs from a checkout)
APP_SCRIPT = Path(__file__).resolve().parents[2] / "app.py"


def cmd_describe(args: argparse.Namespace) -> object:
    """The trace's statistics; a trace whose rows the loader renormalised also carries ``renormalised``
    (rows, min_sum, max_sum, tolerance) and ``note`` (``repair_note``'s sentence)."""
    trace = load(args.trace)
    # a trace past its dense length is described from one pass over every row, kept on disk: said on stderr
    trace.derived.prepare_whole(protocol.stderr("kvsim describe"))
    try:
        doc = {"trace": trace.name, **describe(trace, band=args.band, top_k=args.top_k)}
    except ValueError as e:  # what the row pass does not keep: said in the flag's terms
        raise CLIError(f"--{str(e).replace('_', '-')}") from None
    repaired = renormalised(trace)
    if repaired is not None:
        doc |= {"renormalised": repaired, "note": repair_note(trace)}
    return doc


def cmd_export(args: argparse.Namespace) -> object:
    out = Path(args.out)
    if out.suffix != ".npz":
        raise CLIError(f"--out: {args.out} must end in .npz")
    trace = load(args.trace)
    if trace.derived.no_matrix() is not None:
        raise InputError(f"--trace {args.trace}: a query/key trace of {trace.steps} steps; export writes the dense "
                         f"interchange format only up to {DENSE_LIMIT} steps ({DENSE_LIMIT + 1}^2 weights)")
    try:
        save_npz(trace, out, dtype=np.float32)
    except OSError as e:
        raise InputError(f"cannot write {args.out}: {e.strerror or type(e).__name__}") from None
    return {"trace": trace.name, "out": str(out), "steps": trace.steps, "dtype": "float32", "bytes": out.stat().st_size}


def cmd_table(args: argparse.Namespace) -> object:
    layout, doc = routed(args)
    if doc is not None:
        return doc
    budget = TABLE_BUDGET if args.budget is None else args.budget
    if budget < 1:
        raise CLIError(f"--budget {budget} must be at least 1")
    if layout is not None:  # the notes once (rounding, one KV head); each row the layout refuses says why in the table
        layout_flags.check(layout, "sliding_window", [(budget, {})])
        trace = load(args.trace)
        with report.step("table", f"measuring every row at budget {budget} under {layout.label} on {trace.name}"):
            return build_table(trace, budget=budget, top_k=args.top_k, layout=layout)
    trace = load(args.trace)
    with report.step("table", f"measuring every row at budget {budget} on {trace.name}") as progress:
        report.prepare(POLICIES, progress)
        doc = build_table(trace, budget=budget, top_k=args.top_k)
        if args.proxies:
            for row in doc["rows"]:
                if row["retained_mass"] is not None and row["policy"] in POLICIES:
                    result = replay(trace, row["policy"], budget=budget, top_k=args.top_k, record_kept=True, **row["params"])
                    extra = measured(trace, px.summary(trace, result))
                    row.update({k: extra[k] for k in (*px.VALUE_PROXIES, "not_applicable") if k in extra})
        return doc


def cmd_claims(args: argparse.Namespace) -> object:
    from ..analysis.claims import ledger  # the ledger runs its own replays; nothing of it loads until asked for

    names = available_traces() if args.trace.strip() == "all" else [args.trace]
    records = []
    with report.step("claims", "measuring the cards' claims") as progress:
        report.prepare(POLICIES, progress)
        for i, name in enumerate(names):
            trace = load(name)
            if progress is not None:  # a share only when there are several traces to go through
                several = len(names) > 1
                progress(i / len(names) if several else None,
                         f"measuring the cards' claims on {trace.name}" + (f" ({i + 1}/{len(names)})" if several else ""))
            records += ledger(trace)
    return records


class _Tuning:
    """What ``tune`` tunes: the policy, its budget, its other parameters held (those a plan sets away from their
    defaults, as a model's measurement keys them) and the split (``--plan``'s allocator or rows, or None)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from ..analysis.tune import PARAM

        plan = getattr(args, "run_plan", None)
        if plan is None:  # the flags: the policy at the budget, its window what is tuned
            self.policy, self.budget, self.fixed, self.plan = args.policy, args.budget, {}, None
            return
        spec = plan.policy
        declared = {p.name: p.default for p in POLICIES[spec.name].tunables}
        self.policy, self.budget, self.plan = spec.name, spec.budget, plan
        self.fixed = {k: v for k, v in spec.params if k != PARAM and v != declared[k]}

    def tuned(self, window: int) -> PolicySpec:
        from ..analysis.tune import PARAM

        return PolicySpec.of(self.policy, self.budget, **self.fixed, **{PARAM: window})


def cmd_tune(args: argparse.Namespace) -> object:
    from ..analysis.tune import AUTO, TRUTH_BY, tune
    from ..cluster import LOCAL, dask_available
    from ..data.catalog import resolve_bundle, shipped_bundles

    what = _Tuning(args)
    spec = args.trace.strip()
    bundle = spec in shipped_bundles() or is_bundle(spec)
    _check_tune_allocate(args, bundle, what)
    source = resolve_bundle(spec) if bundle else load(spec)
    if args.workers is not None and (args.serial or args.scheduler):
        raise CLIError("--workers is for local Dask processes; it does not go with --serial or --scheduler")
    if args.scheduler:
        scheduler = args.scheduler
    elif args.serial or not dask_available():
        scheduler = None
    else:
        scheduler = LOCAL
    say = None if args.quiet else protocol.stderr("tune")
    truth, why = None, None
    if args.by in TRUTH_BY:
        truth = _tune_truth(args, source, say, "kl_open" if args.by == "kl" else "delta_nll_open", what)
    elif args.by == AUTO:
        truth, why = _auto_truth(args, source, say, what)
    result = tune(source, what.policy, what.budget, tolerance=args.tolerance, top_k=args.top_k, scheduler=scheduler,
                  workers=args.workers, progress=say, by=args.by, truth=truth, why=why, per_layer=args.per_layer,
                  **what.fixed)
    doc = result.to_dict(curves=args.curves)
    plan = what.plan
    if args.allocate is not None or (plan is not None and plan.allocate is not None):
        import time

        t0 = time.perf_counter()
        doc.update(_tune_allocation(args, source, result, truth, say, what))
        run = doc["run"]  # the summary counts the allocators' time and their truth too
        run["allocate_seconds"] = round(time.perf_counter() - t0, 2)
        run["seconds"] = round(run["seconds"] + run["allocate_seconds"], 2)
        if truth is not None and hasattr(truth, "counts"):
            run["truth"] = dict(truth.counts)
    if args.save_plan is not None:
        _save_tuned(args, what, result.model_window, doc.get("allocation"))
    return doc


def _save_tuned(args: argparse.Namespace, what: _Tuning, window: int, chosen: list[dict] | None) -> None:
    """``tune --save-plan FILE``: what was tuned as a plan, ``generate --plan FILE`` runs it as it is: model_window
    in every layer, the split chosen (``--allocate auto``, or the plan's allocator at that window) or the plan's rows."""
    from ..policies.plan import Plan
    from . import run_plan

    rows = None if chosen is None else tuple(sorted((r["layer"], r["kv_head"], r["budget"]) for r in chosen))
    if rows is None and what.plan is not None:
        rows = what.plan.allocation
    if rows is not None and (low := min(rows, key=lambda r: r[2]))[2] <= window:
        raise CLIError(f"--save-plan: the split gives layer {low[0]} KV head {low[1]} a budget of {low[2]}, not above the "
                       f"tuned recent_window {window}")
    run_plan.write(Plan(what.tuned(window), allocation=rows), args.save_plan)


#: the figures tune --allocate auto chooses an allocator by (kvsim.analysis.tune_allocation.BY, named here
#: so that a refusal imports none of the analysis)
_ALLOCATE_BY = ("retained_mass", "kl", "delta_nll")


def _check_tune_allocate(args: argparse.Namespace, bundle: bool, what: _Tuning) -> None:
    """``tune --allocate auto``'s refusals (and a plan's allocator's, in the same words), one line each, before any
    trace is swept."""
    if args.allocate is None and (what.plan is None or what.plan.allocate is None):
        return
    if not bundle:
        raise InputError(f"--trace: {args.trace}: --allocate auto splits a bundle's memory over its layers and KV heads; "
                         "give a bundle (a recording of every layer), not one trace")
    if args.per_layer:
        raise CLIError("--allocate auto deploys model_window in every layer with the chosen split; it does not go with "
                       "--per-layer")
    if args.by not in (*_ALLOCATE_BY, "auto"):
        raise CLIError(f"--allocate auto chooses by {', '.join(_ALLOCATE_BY)} (or auto: the truth where it is at hand); "
                       f"--by {args.by} is a proxy of one window's figure, not of a split's")


def _tune_allocation(args: argparse.Namespace, source, result, truth, say, what: _Tuning) -> dict:
    """``tune --allocate auto``: each candidate allocator's split at model_window in every layer, by tune's
    figure (retained mass, or the truth, open loop, each split cached), the best chosen
    (``kvsim.analysis.tune_allocation``); the tune file carries the chosen split as ``allocation`` rows. A plan's
    allocator is the one candidate."""
    from ..analysis import allocation as al
    from ..analysis.tune_allocation import CANDIDATES, choose

    by = result.by.get("by", args.by)
    note = None
    if by not in _ALLOCATE_BY:  # --by auto without the truth at hand fell back to a proxy of one window
        note = f"by retained_mass: the truth is not at hand and {by} measures one window, not a split"
        by = "retained_mass"
    window = result.model_window
    spec = what.tuned(window)
    heads = al.load_heads(source)
    candidates = CANDIDATES if what.plan is None or what.plan.allocate is None else (what.plan.allocate,)
    try:
        al.check("optimal" if len(candidates) > 1 else candidates[0], spec, [(h.layer, h.kv_head) for h in heads],
                 heads[0].trace.steps)
    except al.AllocationError as e:
        raise InputError(f"--allocate auto: {source.name}: {e}") from None
    measure = None if by == "retained_mass" else (lambda flat: truth.split(flat, window))
    got = choose(heads, spec, by, measure, candidates=candidates, progress=say)
    chosen = next(c for c in got["candidates"] if c["allocator"] == got["chosen"])
    return {"allocate": {"chosen": got["chosen"], "by": by, "note": note, "recent_window": window,
                         "rule": f"the window first (model_window {window}, at uniform's split), then the allocator at "
                                 f"that window in every layer by {by}: one coordinate at a time, not a joint search",
                         "figure": chosen["figure"], "candidates": got["candidates"], "left_out": got["left_out"]},
            "allocation": got["allocation"]}


def _auto_truth(args: argparse.Namespace, source, say, what: _Tuning):
    """``tune``'s default: the truth (KL, open loop) when ``source`` is a bundle (a recording of the whole
    model) whose model and text are at hand and the record extra is installed, with one line on stderr
    saying so and how to skip it; else no truth and the reason (the study's best proxy then recommends)."""
    import importlib.util

    from ..analysis.tune import BEST_PROXY
    from ..data.bundle import Bundle

    if not isinstance(source, Bundle):  # model_window is every layer's window: the truth is the whole model's
        return None, (f"one trace, not a recording of the whole model: {BEST_PROXY}, the proxy study's best "
                      "(--by kl measures the model's truth)")
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return None, f"the record extra is not installed ({', '.join(missing)}): {BEST_PROXY}, the proxy study's best"
    try:
        truth = _tune_truth(args, source, say, "kl_open", what)
    except InputError as e:
        return None, f"{str(e).split(': ', 1)[-1]}: {BEST_PROXY}, the proxy study's best"
    if say is not None:
        say(None, f"recommending by the truth, the model's KL ({truth.what}); each window is measured once and "
                  f"cached; --by {BEST_PROXY} recommends by the proxy study's best proxy instead, in seconds")
    return truth, f"the truth: {truth.what}"


class _Truth:
    """``tune --by kl``'s truth: a function from candidate windows to the model's loss there, open loop,
    read from the truth documents (shipped, or measured here) where they have it, the rest measured
    (cached on disk) by a session opened on first use; and ``configurations``, the same for windows set
    per layer (``--per-layer``'s search), kept in the same on-disk cache of measurements."""

    def __init__(self, args, meta: dict, model, text, steps: int, key: str, say, what: _Tuning) -> None:
        from ..models.loading import file_sha256

        self.args, self.model, self.text, self.steps, self.key, self.say = args, model, text, steps, key, say
        self.policy, self.budget, self.fixed = what.policy, what.budget, what.fixed
        self.recording = str(meta.get("model") or model)
        self.sha = file_sha256(text)
        self.what = f"{model} on {Path(text).name}, {steps} steps, open loop"
        self.session = None
        #: what the summary says of the truth: configurations read (shipped or cached) and measured
        self.counts = {"read": 0, "measured": 0}

    def _open(self):
        from ..models import quality

        if self.session is None:
            self.session = quality.open_session(self.text, self.steps, self.model, progress=self.say,
                                                use_cache=not self.args.no_cache)
        return self.session

    def __call__(self, windows):
        return [r[self.key] for r in self._uniform(windows)]

    def _uniform(self, windows) -> list[dict]:
        from ..models import quality, truth
        from ..models.errors import RecordError

        args = self.args
        jobs = [(self.policy, self.budget, {**self.fixed, "recent_window": int(w)}) for w in windows]
        rows = [None] * len(jobs) if args.no_cache else truth.known_rows(self.recording, self.sha, self.steps, jobs)
        todo = [w for w, r in zip(windows, rows, strict=True) if r is None]
        self.counts["read"] += len(jobs) - len(todo)
        if todo:
            try:
                got = truth.window_truth(self._open(), self.policy, self.budget, todo, self.fixed, proxies=px.configuration,
                                         use_cache=not args.no_cache, progress=self.say, recording=self.recording)
            except (quality.QualityError, RecordError) as e:
                raise InputError(f"{args.trace}: {e}") from None
            self.counts["measured"] += sum(not r.get("cached_open") for r in got)
            self.counts["read"] += sum(bool(r.get("cached_open")) for r in got)
            got = iter(got)
            rows = [r if r is not None else next(got) for r in rows]
        return rows

    def split(self, flat, window: int) -> dict:
        """The open-loop truth of a split (flat per-head budgets in (layer, KV head) order) at the tuned
        policy's model-wide window, cached on disk per split (``kvsim.models.allocation_truth``)."""
        from ..models import quality
        from ..models.allocation_truth import cached_open_truth
        from ..models.errors import RecordError

        try:
            session = self._open()
            k = session.kv_heads
            grid = [[int(flat[x * k + h]) for h in range(k)] for x in range(len(flat) // k)]
            r = cached_open_truth(session, self.policy, grid, {**self.fixed, "recent_window": int(window)},
                                  use_cache=not self.args.no_cache)
        except (quality.QualityError, RecordError) as e:
            raise InputError(f"{self.args.trace}: {e}") from None
        self.counts["measured" if not r["cached"] else "read"] += 1
        return r

    def configurations(self, configs, figure: str) -> list[float]:
        """``figure`` (``kl`` or ``delta_nll``, open loop) of each configuration, one window per layer; one
        window in every layer is the model-wide measurement (the same row, read where it is known)."""
        from ..models import quality
        from ..models.errors import RecordError

        uniform = sorted({c[0] for c in configs if len(set(c)) == 1})
        known = dict(zip(uniform, self._uniform(uniform), strict=True)) if uniform else {}
        per_layer = [c for c in configs if len(set(c)) > 1]
        measured = {}
        if per_layer:
            try:
                session = self._open()
                jobs = [session.configuration(self.policy, self.budget, {**self.fixed, "recent_window": list(c)})
                        for c in per_layer]
                rows = session.measure_many(jobs, "open", use_cache=not self.args.no_cache)
            except (quality.QualityError, RecordError) as e:
                raise InputError(f"{self.args.trace}: {e}") from None
            self.counts["measured"] += sum(not r["cached"] for r in rows)
            self.counts["read"] += sum(bool(r["cached"]) for r in rows)
            measured = {c: r[figure] for c, r in zip(per_layer, rows, strict=True)}
        return [known[c[0]][f"{figure}_open"] if len(set(c)) == 1 else measured[c] for c in configs]


def _tune_truth(args: argparse.Namespace, source, say, key: str, what: _Tuning) -> _Truth:
    """The truth of ``tune --by kl`` (``key``: the figure read, ``kl_open`` or ``delta_nll_open``) for the
    recording ``source`` is; InputError, one line, when its model or text is not at hand."""
    from ..data.bundle import Bundle
    from ..models import quality, truth
    from ..models.errors import RecordError

    meta, folder = (source.manifest, source.path) if isinstance(source, Bundle) else (source.meta, None)
    try:
        model, text, steps = truth.recording_source(meta, folder, text=args.text, model=args.model)
    except (quality.QualityError, RecordError) as e:
        raise InputError(f"{args.trace}: {e}") from None
    if steps > DENSE_LIMIT:  # a session keeps every layer's full-cache rows: 77 GB for Gemma at 32k
        raise InputError(f"{args.trace}: the truth of {steps} steps is out of reach here: a truth session holds every "
                         f"layer's full-cache rows, dense, so at most {DENSE_LIMIT} steps")
    return _Truth(args, meta, model, text, steps, key, say, what)


def cmd_record(args: argparse.Namespace) -> object:
    # the recorder's extra (torch, transformers) is optional: nothing of it is imported until asked for
    from ..models.loading import RECORD_STDERR, require_extra
    from ..models.record import record
    from ..models.record_cache import cached

    config = _record_config(args)
    doc = cached(config) if args.out is None else None
    progress = None if args.quiet else RECORD_STDERR
    if doc is not None:
        if progress is not None:
            progress(1.0, f"already recorded: {config.out}")
    else:
        if args.model is None:
            require_extra()  # the shipped model's packages; load_hf_model checks torch and transformers itself
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        doc = record(config, device=args.device, progress=progress)
    return {"text": str(config.text), **doc}


def _record_config(args: argparse.Namespace):
    """The ``RecordConfig`` of ``kvsim record``: a preset's with the flags given winning, or the flags'
    own; without ``--out``, in the cache (``kvsim.models.record_cache``)."""
    from ..models.record import RecordConfig
    from ..models.record_cache import in_cache, preset

    fields = {"model": args.model, "steps": args.steps, "layers": args.layers.strip() if args.layers else None,
              "store": args.store, "dtype": args.dtype, "gqa": args.gqa, "prefix": args.prefix, "source": args.source,
              "licence": args.licence, "model_licence": args.model_licence, "out": args.out,
              "vectors": True if args.vectors else None}
    if args.preset is not None:
        if args.text is not None:
            raise CLIError(f"--preset {args.preset} records its own text; give a TEXT or --preset, not both")
        return preset(args.preset, **fields)
    if args.text is None:
        raise CLIError("record needs a TEXT file (or --preset)")
    read_input("TEXT", args.text)  # before the cache key, which hashes it
    config = RecordConfig(args.text, args.out or ".", **{k: v for k, v in fields.items() if v is not None and k != "out"})
    return config if args.out is not None else in_cache(config)


def cmd_app(streamlit_args: list[str]) -> int:
    """``streamlit run`` on the app's script with this interpreter (the one kvsim is installed in), the
    rest of the command line passed on; streamlit's exit status is the command's."""
    if not APP_SCRIPT.is_file():
        raise InputError(f"kvsim app runs the app from a checkout of kvsim (pip install -e . in it); there is no {APP_SCRIPT}")
    return subprocess.run([sys.executable, "-m", "streamlit", "run", str(APP_SCRIPT), *streamlit_args], check=False).returncode


def _budgets(text: str) -> list[int]:
    try:
        return [positive_int(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise CLIError(f"--budget: {e}") from None


def _quality_plan(args: argparse.Namespace) -> tuple[list[str], list[int], dict, tuple | None]:
    """The policies, budgets, fixed parameters and sweep of ``kvsim quality``, each checked."""
    names = [args.policy] if args.policy else [x.strip() for x in args.policies.split(",") if x.strip()]
    if names == ["all"]:  # every policy of the registry, plugins included
        names = list(POLICIES)
    unknown = [x for x in names if x not in POLICIES]
    if unknown or not names:
        raise CLIError(f"--policies: unknown policy {unknown[0]!r}{suggest(unknown[0])}; known: {', '.join(POLICIES)}" if unknown
                       else "--policies: no policy given")
    budgets = _budgets(args.budget)
    params = {name[len("param_"):]: v for name, v in vars(args).items() if name.startswith("param_") and v is not None}
    taken = {p for n in names for p in policy_params(n)}
    swept = None
    if args.sweep:
        param, text = args.sweep
        if param not in taken:
            raise CLIError(f"--sweep: no policy among {', '.join(names)} takes {param!r}")
        swept = (param, parse_range("--sweep", text))
    for param in params:
        if param not in taken:
            raise CLIError(f"{flag(param)} does not apply to {', '.join(names)}")
    if args.policy and not swept and len(budgets) == 1:
        PolicySpec.of(args.policy, budgets[0], **params)  # refuse bad parameters before loading a model
    return names, budgets, params, swept


def cmd_quality(args: argparse.Namespace) -> object:
    if (variant := allocated(args)) is not None:
        return variant(args)
    for given, what in ((args.by, "--by"), (args.measurements, "--measurements")):
        if given is not None:
            raise CLIError(f"{what} chooses how --allocate's split is made: give --allocate optimal")
    # torch and transformers are imported by kvsim.models.quality's functions only when a measurement runs
    from ..models import quality, texts
    from ..models.loading import require_extra

    names, budgets, params, swept = _quality_plan(args)
    layout = layout_flags.of(args)
    if layout is not None:  # the open loop only, one configuration; refused before a model loads
        layout_flags.refuse_with(args, layout)
        if args.mode == "both" or not args.policy or swept or len(budgets) != 1:
            raise CLIError(f"{layout_flags.layout_flags_text(layout)}: quality runs a serving layout for one --policy at "
                           "one --budget, in the open loop or the closed loop (--mode open or closed)")
        layout_flags.check(layout, args.policy, [(budgets[0], params)], heads=None)
    modes = ["closed", "open"] if args.mode == "both" else [args.mode]
    say = None if args.quiet else quality.QUALITY_STDERR
    text = texts.resolve_text(args.text)
    read_input("TEXT", text)  # refuse a missing or empty text before loading a model
    if args.model is None:
        require_extra()
    session = quality.open_session(text, args.steps, args.model, progress=say)
    if layout is not None:
        from ..models.quality_layout import measure_closed, measure_open

        if layout.shared_selection and session.kv_heads == 1:
            layout_flags.say(["shared selection on a model with one KV head per layer: a no-op"])
        if args.mode == "closed":
            return measure_closed(session, args.policy, budgets[0], params, layout, use_cache=not args.no_cache,
                                  progress=say)
        return measure_open(session, args.policy, budgets[0], params, layout, use_cache=not args.no_cache)
    rows = quality.grid(session, names, budgets, modes, params, swept, use_cache=not args.no_cache,
                        batch=args.batch, progress=say)
    if args.policy and not swept and len(budgets) == 1 and len(modes) == 1:
        if not rows:
            raise CLIError(f"{args.policy} cannot run at budget {budgets[0]} with these parameters")
        return rows[0]
    return rows


COMMANDS = {"replay": cmd_replay, "sweep": cmd_sweep, "describe": cmd_describe, "export": cmd_export, "table": cmd_table,
            "claims": cmd_claims, "tune": cmd_tune, "record": cmd_record, "quality": cmd_quality}

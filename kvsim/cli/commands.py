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
from ..data.catalog import available_traces
from ..data.qk import DENSE_LIMIT
from ..data.trace import save_npz
from ..policies import POLICIES, PolicySpec, policy_params
from ..policykit.registry import suggest
from ..sim.simulate import replay
from . import cluster_flags, layout_flags, report, tune_command
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
        _table_turns(trace, doc, budget, args.top_k)
        return doc


def _table_turns(trace, doc: dict, budget: int, top_k: int) -> None:
    """A conversation's trace (``record --conversation``): each measured row's retained mass per turn, replayed again."""
    from ..views.turns import turn_mass, turns_of

    turns = turns_of(trace.meta, trace.steps)
    if turns is None:
        return
    for row in doc["rows"]:
        if row.get("retained_mass") is not None and row["policy"] in POLICIES and "refused" not in row:
            result = replay(trace, row["policy"], budget=budget, top_k=top_k, **row["params"])
            row["turns"] = turn_mass(result.retained_mass_series, turns)


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
    if getattr(args, "conversation", None) is not None:  # the context and every turn, the turns' positions in the meta
        from .conversation_command import read

        for given, name in ((args.preset, "--preset"), (args.steps, "--steps")):
            if given is not None:
                raise CLIError(f"{name} and --conversation: a conversation is recorded whole, its own text")
        read(args, "text", needs_answers=True)
        config = RecordConfig(args.conversation, args.out or ".", conversation=True,
                              **{k: v for k, v in fields.items() if v is not None and k not in ("out", "steps")})
        return config if args.out is not None else in_cache(config)
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
    """``streamlit run`` on the app's script with this interpreter (the one kvsim is installed in), through
    ``kvsim.app.launch`` (the app's modules and first caches loaded before the server answers), the rest of
    the command line passed on; streamlit's exit status is the command's."""
    if not APP_SCRIPT.is_file():
        raise InputError(f"kvsim app runs the app from a checkout of kvsim (pip install -e . in it); there is no {APP_SCRIPT}")
    return subprocess.run([sys.executable, "-m", "kvsim.app.launch", "run", str(APP_SCRIPT), *streamlit_args], check=False).returncode


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
        raise CLIError(f"--policy: unknown policy {unknown[0]!r}{suggest(unknown[0])}; known: {', '.join(POLICIES)}" if unknown
                       else "--policy: no policy given")
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
    if args.conversation is not None:  # each turn's answer teacher-forced on one evicting cache
        from . import conversation_command

        conversation_command.check_quality(args)
        return conversation_command.cmd_quality(args, *_quality_plan(args)[:3])
    if args.text is None:
        raise CLIError("give the TEXT to measure on, or --conversation FILE")
    for given, shown in ((args.prefill_budget, "--prefill-budget"), (args.prefill_policy, "--prefill-policy"),
                         (args.query, "--query")):
        if given is not None:
            raise CLIError(f"{shown} goes with --conversation: quality compresses a conversation's prompt")
    if (on := cluster_flags.wanted(args)) and (args.allocate is not None or layout_flags.of(args) is not None):
        raise CLIError(f"{on} spreads quality's grid of policies, budgets and modes; not --allocate nor a serving layout")
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
    with cluster_flags.fanout(args, say) as fanout:  # an unreachable scheduler is refused before the model loads
        session = quality.open_session(text, args.steps, args.model, progress=say)
        session.fanout = fanout
        rows = _quality_rows(args, session, layout, names, budgets, modes, params, swept, say)
    if layout is not None:  # one measurement's document
        return rows
    if args.policy and not swept and len(budgets) == 1 and len(modes) == 1:
        if not rows:
            raise CLIError(f"{args.policy} cannot run at budget {budgets[0]} with these parameters")
        return rows[0]
    return rows


def _quality_rows(args, session, layout, names, budgets, modes, params, swept, say) -> list[dict] | dict:
    from ..models import quality

    if layout is not None:
        from ..models.quality_layout import measure_closed, measure_open

        if layout.shared_selection and session.kv_heads == 1:
            layout_flags.say(["shared selection on a model with one KV head per layer: a no-op"])
        if args.mode == "closed":
            return measure_closed(session, args.policy, budgets[0], params, layout, use_cache=not args.no_cache,
                                  progress=say)
        return measure_open(session, args.policy, budgets[0], params, layout, use_cache=not args.no_cache)
    return quality.grid(session, names, budgets, modes, params, swept, use_cache=not args.no_cache, batch=args.batch,
                        progress=say)


COMMANDS = {"replay": cmd_replay, "sweep": cmd_sweep, "describe": cmd_describe, "export": cmd_export, "table": cmd_table,
            "claims": cmd_claims, "tune": tune_command.cmd_tune, "record": cmd_record, "quality": cmd_quality}

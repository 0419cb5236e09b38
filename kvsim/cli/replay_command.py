"""``kvsim replay`` and ``kvsim sweep``, and the reading of ``--trace`` every command shares.

A module of their own, importing what a replay runs and no more: the value-aware proxies (``--proxies``),
the window rule of a sweep's rows and the ``--allocate`` variants are imported by the runs that use
them, so a replay's process compiles none of the other commands' analyses (issue 36: no bytecode is kept
on the project's machines, so a process compiles every module it imports from source).
"""

from __future__ import annotations

import argparse

from ..data.catalog import resolve_trace
from ..data.trace import Trace, TraceError
from ..policies import DEFAULT_BUDGET, PolicySpec
from ..sim.simulate import replay, sweep
from . import layout_flags, prefill_command, report
from .errors import flag, input_error
from .parser import sweep_ranges


def load(spec: str, name: str = "--trace") -> Trace:
    """``--trace`` resolved; a first decode or build of a big trace says so once it passes a few seconds.
    A trace that cannot be had is refused as that flag's input (exit 1, ``--trace: PATH: problem``)."""
    with report.step("trace", f"loading {spec.strip()}"):
        try:
            return resolve_trace(spec)
        except (TraceError, OSError) as e:
            raise input_error(name, e) from None


def allocated(args: argparse.Namespace):
    """The ``--allocate`` variant of ``args.command``'s function, or None without the flag (its module is
    imported only then)."""
    if getattr(args, "allocate", None) is None:
        return None
    from . import allocate_command

    return getattr(allocate_command, args.command)


def routed(args: argparse.Namespace, run=None):
    """The one dispatch of ``replay``, ``sweep`` and ``table``: ``(layout, document)``, the document the variant made
    when the prompt is compressed (``kvsim.cli.prefill_command``) or the memory split (``allocate_command``), else
    None for the command's own run under ``layout``. ``run``: the plan replay runs from (what it replays is read from
    it); the grids read theirs from the flags (a --plan FILE's settings among them)."""
    if run is None:
        prefill_command.refuse_none(args)
        layout = layout_flags.of(args)
        layout_flags.refuse_with(args, layout)
        if prefill_command.given(args):
            doc = getattr(prefill_command, args.command)(args, load)
            return layout, mark_choice(*doc) if args.command == "sweep" else doc  # a sweep's rows and its parameter
        variant = allocated(args)
        return layout, None if variant is None else variant(args)
    split = run.allocate is not None or run.allocation is not None
    # what a plan file may hold together and a replay does not take, said as its flags would be
    layout_flags.refuse_with(args, run.layout, split=split, compressed=run.compression is not None)
    if run.compression is not None:
        prefill_command.refuse_with(split, args.proxies)
        return None, prefill_command.replay(args, run, load)
    if split:
        from . import allocate_command

        return None, allocate_command.replay(args, run)
    return run.layout, None


def cmd_replay(args: argparse.Namespace) -> object:
    run = args.run_plan  # made once, from --plan FILE or the flags (kvsim.cli.run_plan.make): what replays
    layout, doc = routed(args, run)
    if doc is not None:
        return doc
    spec = run.policy
    layer = layer_heads(args.trace) if layout is not None and layout.shared_selection else None
    layout_flags.check(layout, spec.name, [(spec.budget, spec.params)], heads=1 if layer is None else len(layer[1]))
    if layer is not None:
        return replay_layer_row(args, spec, layout, *layer)
    trace = load(args.trace)
    with report.step("replay", f"replaying {spec.name} on {trace.name}") as progress:
        if layout is None:  # a layout replays on the reference path: nothing to compile
            report.prepare([spec.name], progress)
        result = replay(trace, spec, top_k=args.top_k, progress=progress, record_kept=args.proxies, layout=layout)
    from ..views.turns import turn_fields  # a conversation's trace: the retained mass per turn beside the whole

    turns = turn_fields(trace, result.retained_mass_series)
    if not args.proxies:
        return {"trace": trace.name, **result.summary(), **turns}
    from ..analysis import proxies as px

    return {"trace": trace.name, **measured(trace, px.summary(trace, result)), **result.layout_fields(), **turns}


def layer_heads(spec: str):
    """``(bundle, heads, layer)`` for a bundle's layer named without a KV head (``BUNDLE:L05``) that has several
    KV heads: what shared selection replays together. None for anything else (one trace, one head)."""
    from ..data.bundle import BundleError, parse_selector
    from ..data.catalog import resolve_bundle

    selector = parse_selector(str(spec).strip())
    if selector is None or selector[2] is not None:
        return None
    try:
        bundle = resolve_bundle(selector[0])
        heads = bundle.heads(selector[1])
    except (BundleError, TraceError, OSError):
        return None  # not a bundle's layer: --trace is read (and refused) as any trace is
    return (bundle, heads, selector[1]) if len(heads) > 1 else None


def replay_layer_row(args: argparse.Namespace, spec: PolicySpec, layout, bundle, heads: list[int], layer: int) -> dict:
    """``replay --shared-selection --trace BUNDLE:L05`` on a layer of several KV heads: its heads replayed together
    (``kvsim.sim.layered.replay_layer``), the row their mean, each head's figures under ``heads``."""
    from ..sim.layered import replay_layer

    if args.proxies:
        from .errors import CLIError

        raise CLIError("--proxies measures one trace; a layer's KV heads under --shared-selection are several")
    traces = []
    for h in heads:
        try:
            traces.append(bundle.load(layer, h))
        except (TraceError, OSError) as e:
            raise input_error("--trace", e) from None
    with report.step("replay", f"replaying {spec.name} on {len(heads)} KV heads of {args.trace} together"):
        out = replay_layer(traces, spec, layout, top_k=args.top_k)
    row = out["heads"][0].summary()
    return {"trace": args.trace, **row, "retained_mass": out["retained_mass"], "top_k_recall": out["top_k_recall"],
            "kv_heads": len(heads), "heads": [{"kv_head": h, "retained_mass": r.retained_mass,
                                                "top_k_recall": r.top_k_recall} for h, r in zip(heads, out["heads"],
                                                                                               strict=True)]}


def measured(trace, row: dict) -> dict:
    """A ``--proxies`` row as the CLI states it: where the value-aware proxies cannot be measured on the
    trace, not a column of nulls and a fallback, but what is not applicable and why (``not_applicable``)."""
    from ..analysis import proxies as px

    why = px.not_applicable(trace)
    if why is None:
        return row
    out = {k: v for k, v in row.items() if k not in (*px.VALUE_PROXIES, "proxy_fallback")}
    return {**out, "not_applicable": {"figures": list(px.VALUE_PROXIES), "why": why}}


def cmd_sweep(args: argparse.Namespace) -> object:
    layout, doc = routed(args)
    if doc is not None:
        return doc
    param, ranges, fixed, budget = sweep_ranges(args)
    if layout is not None:
        base = DEFAULT_BUDGET if budget is None else budget
        layout_flags.check(layout, args.policy, [(v, fixed) if param == "budget" else (base, {**fixed, param: v})
                                                 for v in ranges[param]])
    trace = load(args.trace)
    note = f"sweeping {args.policy} over {flag(param)} ({len(ranges[param])} values) on {trace.name}"
    with report.step("sweep", note) as progress:
        if layout is None:
            report.prepare([args.policy], progress)
        if args.proxies:
            from ..analysis import proxies as px

            rows = px.sweep(trace, args.policy, budget, param, ranges[param], top_k=args.top_k, progress=progress, **fixed)
        else:
            rows = sweep(trace, args.policy, budget, param, ranges[param], top_k=args.top_k, progress=progress,
                         layout=layout, **fixed)
    rows = [measured(trace, r) for r in rows] if args.proxies else rows
    return mark_choice([{"trace": trace.name, **r} for r in rows], param)


def mark_choice(rows: list[dict], param: str) -> list[dict]:
    """The sweep's rows, each told whether it is the best (the largest retained mass, the smallest
    value on ties) and whether it is the recommended one (the smallest value within ``TOLERANCE`` of
    the best): ``kvsim.analysis.windows``, the rule every view names its windows by. The document stays
    a list of rows; the two keys are added to each."""
    from ..analysis.windows import choose_window

    choice = choose_window(rows, param=param)
    return [{**r, "best": r[param] == choice.best, "recommended": r[param] == choice.recommended} for r in rows]

"""A run's plan (``kvsim.policykit.plan``), made once per command line: from ``--plan FILE`` or from the flags, and
``--save-plan FILE`` written from it. One plan file runs the same configuration through ``replay``, ``sweep``,
``table``, ``quality``, ``generate``, ``needle`` and ``tune``, and ``kvsim.hf.cache(plan=FILE)``; a flag the plan
also sets is refused in one line (the plan or the flag: not both), so what runs is what the file says. ``replay``,
``generate`` and ``tune`` run from the plan itself (``args.run_plan``); the grids read a plan file's settings as
their flags."""

from __future__ import annotations

import argparse

from ..allocation.split import ALLOCATORS
from ..policies import DEFAULT_BUDGET, PolicySpec
from ..policykit.plan import GROW, Compression, Plan, PlanError
from .errors import CLIError, InputError, flag


def _defaults(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The command's own sub-parser (its defaults tell a flag the user typed from one left alone)."""
    return parser._subparsers._group_actions[0].choices[command]  # noqa: SLF001 -- argparse keeps them there only


def make(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Plan | None:
    """The run's one plan, made once and kept as ``args.run_plan``: ``--plan FILE`` (a flag it also sets refused),
    or the flags' own (``of_args``) where the command runs one configuration (replay). ``replay``, ``generate`` and
    ``tune`` run from it (generate from flags still reads them: its ``--windows`` are no plan's); the grids (sweep,
    table, quality, needle) read a plan file's settings as their flags. Then, where the command needs ``--policy``,
    check that one came."""
    sub = _defaults(parser, args.command)
    args.run_plan = None
    if args.command == "tune":
        args.run_plan = None if args.plan is None else _tune(args, sub, read(args.plan))
        if args.save_plan is not None and args.per_layer:
            raise CLIError("--save-plan writes one recent_window for every layer; --per-layer's windows deploy from "
                           "the tune file (generate --windows)")
        return args.run_plan
    if getattr(args, "plan", None) is not None:
        args.run_plan = read(args.plan)
        _into(args, sub, args.run_plan, pour=args.command not in ("replay", "generate"))
        if args.command in ("replay", "generate"):
            return args.run_plan
    if args.command in ("replay", "sweep", "generate") and getattr(args, "policy", None) is None:
        raise CLIError("the following arguments are required: --policy (or --plan FILE)")
    if args.command == "quality" and args.policy is None and args.policies is None:
        raise CLIError("the following arguments are required: --policy (or --plan FILE)")
    if args.command == "replay":
        args.run_plan = of_args(args)
    return args.run_plan


def read(path) -> Plan:
    """``--plan FILE``'s plan, or its one line."""
    try:
        return Plan.read(path)
    except PlanError as e:
        raise InputError(f"--plan: {e}") from None


def _tune(args: argparse.Namespace, sub, plan: Plan) -> Plan:
    """The plan ``tune --plan`` tunes within: its policy, budget, split and serving layout; what tune cannot measure
    yet (the prompt's compression) and a flag it also sets refused, one line each."""
    where = f"--plan {args.plan}"
    if plan.policy is None:
        raise CLIError(f"{where}: policy 'none' lets the cache grow after the prompt; tune sweeps a policy's recent_window")
    if plan.compression is not None:
        raise CLIError(f"{where}: sets the prompt's compression, which tune does not measure yet (it sweeps windows over "
                       "the whole trace)")
    flags = (("policy", "--policy"), ("budget", "--budget"))
    if plan.layout is not None:  # the plan's layout is what is tuned under: a layout flag beside it is refused
        flags += (("block_size", "--block-size"), ("shared_selection", "--shared-selection"),
                  ("evict_every", "--evict-every"))
    for dest, shown in flags:
        if getattr(args, dest) != sub.get_default(dest):
            raise CLIError(f"{where} sets {shown} too: give it in one place")
    if args.allocate is not None and (plan.allocate is not None or plan.allocation is not None):
        raise CLIError(f"{where} sets the split, which --allocate auto would choose: give it in one place")
    return plan


#: the flags that set a run's configuration besides the policy's parameters (what a plan holds)
RUN_FLAGS = {"policy": "--policy", "budget": "--budget", "allocate": "--allocate", "prefill_budget": "--prefill-budget",
             "prompt_length": "--prompt-length", "prefill_policy": "--prefill-policy", "block_size": "--block-size",
             "shared_selection": "--shared-selection", "evict_every": "--evict-every",
             "keys": "--keys", "query": "--query"}


def _into(args: argparse.Namespace, sub, plan: Plan, pour: bool = True) -> None:
    """Refuse each flag ``plan`` also sets; with ``pour``, set the rest from it, as if given as flags (the grids:
    their fixed values). Without it (replay, generate: they run from the plan) a setting the plan leaves unset is
    refused beside it too: the plan is the whole run."""
    where = f"--plan {args.plan}"
    seen = set()

    def given(dest: str) -> bool:
        return getattr(args, f"{dest}_given", False) or getattr(args, dest) != sub.get_default(dest)

    def put(dest: str, value, shown: str) -> None:
        if not hasattr(args, dest):
            raise CLIError(f"{where}: sets {shown}, which {args.command} does not take")
        seen.add(dest)
        if given(dest) and args.command == "sweep" and (dest == "budget" or dest.startswith("param_")):
            return  # the swept range given on the command line runs over the plan's value
        if given(dest):
            raise CLIError(f"{where} sets {shown} too: give it in one place")
        if pour:
            setattr(args, dest, value)

    many = args.command in ("needle", "quality")  # they take comma-separated lists
    spec = plan.policy
    if args.command != "table":  # the table measures every policy: the plan gives its budget, split and compression
        if args.command == "needle":
            put("policies", GROW if spec is None else spec.name, "the policy")
        elif args.command == "quality" and getattr(args, "policies", None) is None and spec is not None:
            put("policy", spec.name, "the policy")
        else:
            put("policy", GROW if spec is None else spec.name, "the policy")
    if spec is not None:
        put("budget", str(spec.budget) if many or args.command == "sweep" else spec.budget, "--budget")
        for name, value in spec.params:
            put(f"param_{name}", str(value) if args.command == "sweep" else value, flag(name))
    if plan.allocate is not None:
        put("allocate", plan.allocate, "--allocate")
    elif plan.allocation is not None:
        if args.command == "quality":
            raise CLIError(f"{where}: its split is given as rows; quality --allocate takes an allocator's name")
        put("allocate", str(args.plan), "--allocate")  # a plan with rows is an allocation file itself
        if pour and hasattr(args, "budget_given"):  # generate: the file's split is the memory, not a default budget
            args.budget_given = False
    if plan.layout is not None:
        if not hasattr(args, "block_size"):
            raise CLIError(f"{where}: sets a serving layout, which {args.command} does not take yet")
        lay = plan.layout
        if lay.block_size > 1:
            put("block_size", lay.block_size, "--block-size")
        if lay.shared_selection:
            put("shared_selection", True, "--shared-selection")
        if lay.evict_every > 1:
            put("evict_every", lay.evict_every, "--evict-every")
    if plan.compression is not None:
        c = plan.compression
        put("prefill_budget", str(c.keep), "--prefill-budget")
        put("prefill_policy", c.scorer, "--prefill-policy")
        if c.prompt_length is not None:
            put("prompt_length", c.prompt_length, "--prompt-length")
        if c.query != "aware":
            put("query", c.query, "--query")
    if plan.keys is not None:
        put("keys", plan.keys, "--keys")
    if not pour:
        for dest in sorted(RUN_FLAGS.keys() | {k for k in vars(args) if k.startswith("param_")}):
            if dest not in seen and hasattr(args, dest) and given(dest):
                shown = RUN_FLAGS.get(dest) or flag(dest[len("param_"):])
                raise CLIError(f"{where} is the whole run: give {shown} in the plan, not beside it")


def of_args(args: argparse.Namespace) -> Plan:
    """The plan the flags of ``replay`` or ``generate`` state (the one validation: a bad value is one line).
    ``replay``'s refusals are the run's, in its words and order: the compressed prompt's, the split's (its bundle, file
    and budgets checked as the replay will), the policy's parameters'."""
    if args.command == "replay":
        return _replay(args)
    params = {k[len("param_"):]: v for k, v in vars(args).items() if k.startswith("param_") and v is not None}
    # every parameter flag given, as the command itself takes them: one a policy does not take is refused here,
    # before the plan is written, in the flags' terms (kvsim.cli.entry turns a ParamError into them)
    spec = PolicySpec.of(args.policy, DEFAULT_BUDGET if args.budget is None else args.budget, **params)
    allocate, rows = getattr(args, "allocate", None), None
    if allocate is not None and allocate not in ALLOCATORS:
        from ..allocation.split import AllocationError, read_allocation

        try:
            budgets, _ = read_allocation(allocate)
        except AllocationError as e:
            raise InputError(f"--allocate: {e}") from None
        allocate, rows = None, tuple(sorted((x, h, b) for (x, h), b in budgets.items()))
    return Plan(spec, allocate, rows)


def _replay(args: argparse.Namespace) -> Plan:
    from . import layout_flags, prefill_command
    from .parser import policy_args
    from .prefill_flags import keep, scorer

    prefill_command.refuse_none(args)
    layout = layout_flags.of(args)
    layout_flags.refuse_with(args, layout)
    budget = DEFAULT_BUDGET if args.budget is None else args.budget
    if prefill_command.given(args):
        prefill_command.refuse_with(args.allocate is not None, args.proxies)
        decode = prefill_command.decode_spec(args, args.budget)
        name, scorer_params = scorer(args.prefill_policy)
        compression = Compression(keep(args.prefill_budget), name, tuple(sorted(scorer_params.items())), args.prompt_length)
        return Plan(decode, compression=compression)
    if args.allocate is not None:
        from .allocate_command import checked

        allocate, rows = checked(args)
        return Plan(PolicySpec.of(args.policy, budget, **policy_args(args)), allocate, rows)
    # the one validation: a bad value is refused before the trace loads, and the spec is what replays
    return Plan(PolicySpec.of(args.policy, budget, **policy_args(args)), layout=layout)


def save(args: argparse.Namespace) -> None:
    """``--save-plan FILE``: the run's plan written atomically (before the run, so a long run's plan is kept;
    ``tune`` writes what it tuned, after)."""
    path = getattr(args, "save_plan", None)
    if path is None or args.command == "tune":
        return
    write(args.run_plan if args.run_plan is not None else of_args(args), path)


def write(plan: Plan, path) -> None:
    """``plan`` written to ``path`` atomically, once it reads back as ``--plan`` will read it; one line otherwise."""
    from pathlib import Path

    from ..data.files import atomic_write

    try:  # a plan is written only as --plan will read it: its every field checked as a file's would be
        Plan.from_dict(plan.to_dict(), "--save-plan")
    except PlanError as e:
        raise CLIError(str(e)) from None
    text = plan.to_json()
    try:
        atomic_write(Path(path), lambda f: f.write(text.encode("utf-8")))
    except OSError as e:
        raise InputError(f"--save-plan: {path}: {e.strerror or e}") from None

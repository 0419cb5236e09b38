"""``replay``, ``sweep`` and ``table`` with ``--allocate NAME|FILE``: a bundle's memory split over its
layers and KV heads (``kvsim.allocation.allocators``), at uniform's memory (``--budget B``: ``B x heads``
positions in all), or as a file gives it (the ``allocation`` rows of an earlier ``--json``).

Everything that can be refused is refused before a trace is loaded, in the one shape of
``kvsim.cli.errors``: ``--allocate: BUNDLE_OR_FILE: problem`` (exit 1). Imported only when ``--allocate``
is given, so the other commands load none of it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..allocation import allocators as al
from ..allocation.split import read_allocation
from ..analysis.windows import best_of
from ..data import jsontext, vectors
from ..data.bundle import Bundle, BundleError, is_bundle
from ..data.catalog import resolve_bundle, shipped_bundles
from ..policies import DEFAULT_BUDGET, POLICIES, PolicySpec, policy_params
from ..policykit.registry import suggest
from . import report
from .errors import CLIError, InputError, flag
from .parser import policy_args, positive_int, sweep_ranges


def _bundle(args: argparse.Namespace) -> Bundle:
    spec = args.trace.strip()
    if not (spec in shipped_bundles() or is_bundle(spec)):
        raise InputError(f"--trace: {spec}: --allocate splits a bundle's memory over its layers and KV heads; give a "
                         f"bundle (a recording of a whole model: {', '.join(shipped_bundles()) or 'a folder with a manifest.json'}), "
                         "not one trace")
    try:
        return resolve_bundle(spec)
    except BundleError as e:
        raise InputError(f"--trace: {' '.join(str(e).split())}") from None


def _spec(policy: str, budget: int, params: dict, where: str) -> PolicySpec:
    """The spec at ``budget``; a window not below it is the allocation's refusal (the minimum named)."""
    loose = PolicySpec.of(policy, 10**9, **params)  # the parameters checked, whatever the budget
    low = al.minimum_budget(loose)
    raw = PolicySpec(policy, budget, loose.params)
    if budget < low:
        al_error = al.AllocationError(f"budget {budget} per head is below {al.minimum_why(raw)}")
        raise InputError(f"--allocate: {where}: {al_error}")
    return PolicySpec.of(policy, budget, **params)


def _file(path: str, bundle: Bundle, spec_of, budgets: dict | None = None) -> tuple[dict, PolicySpec]:
    """An allocation file's budgets (``budgets``: a plan's rows, read from ``path`` already), checked against
    ``bundle`` (its shape, each budget's bounds)."""
    if budgets is None:
        try:
            budgets, _ = read_allocation(path)
        except al.AllocationError as e:
            raise InputError(f"--allocate: {e}") from None
    spec = spec_of(min(budgets.values()), path)
    try:
        al.check_split(budgets, spec, [(t.layer, t.head) for t in bundle.traces], bundle.steps, path)
    except al.AllocationError as e:
        raise InputError(f"--allocate: {e}") from None
    return budgets, spec


class Split:
    """What ``--allocate`` asked for on which bundle, checked: an allocator's name, or a file's budgets (``budgets``:
    a plan's rows, ``name`` the file they came from)."""

    def __init__(self, policy: str, name: str, bundle: Bundle, params: dict, budgets: dict | None = None) -> None:
        self.policy, self.bundle = policy, bundle
        #: the policy's parameters (a sweep sets each value's in turn)
        self.params = params
        self.name = name.strip()
        self.budgets = None
        self.shape = [(t.layer, t.head) for t in bundle.traces]
        if budgets is not None or self.name not in al.ALLOCATORS:
            self.budgets, _ = _file(self.name, bundle, lambda b, where: self._spec(b, where), budgets)
        self.heads = None

    def _spec(self, budget: int, where: str | None = None) -> PolicySpec:
        return _spec(self.policy, budget, self.params, where or self.bundle.name)

    def check(self, spec: PolicySpec) -> None:
        """The allocator's refusals for ``spec`` on this bundle, before any trace is read."""
        if self.budgets is not None:
            return
        try:
            al.check(self.name, spec, self.shape, self.bundle.steps)
        except al.AllocationError as e:
            raise InputError(f"--allocate: {self.bundle.name}: {e}") from None

    def run(self, spec: PolicySpec, progress=None) -> al.Measured:
        if self.heads is None:
            self.heads = al.load_heads(self.bundle)
        if self.budgets is not None:
            alloc = al.from_budgets(self.budgets, self.heads, name=Path(self.name).name)
        else:
            alloc = al.allocate(self.name, self.heads, spec, progress=_scaled(progress, 0.0, 0.9))
        return al.measure(self.heads, spec, alloc, progress=_scaled(progress, 0.9, 1.0))


def _scaled(progress, a, b):
    from ..progress import scaled

    return scaled(progress, a, b)


def _doc(plan: Split, m: al.Measured) -> dict:
    spec = m.policy
    a = m.allocation
    # a file's split has no one budget: its mean per head says its memory
    budget = spec.budget if plan.budgets is None else a.total / len(a.budgets)
    return {"bundle": plan.bundle.name, "model": plan.bundle.model, "steps": plan.bundle.steps,
            "policy": spec.name, "budget": budget, **spec.kwargs, "allocate": a.allocator,
            "positions": a.total, "retained_mass": m.retained_mass, "layers": m.layers(),
            "allocation": a.rows(), **({"floor": a.floor, "pooled": True} if a.pooled else {})}


def refuse_proxies(proxies: bool) -> None:
    if proxies:
        raise CLIError("--proxies does not go with --allocate (the allocation's figure is the bundle's retained mass)")


def _checked(args: argparse.Namespace, policy: str, name: str, budget: int | None, params: dict,
             budgets: dict | None = None) -> tuple[Split, PolicySpec]:
    """The split on ``--trace``'s bundle and the spec it replays, every refusal said before a trace is read."""
    bundle = _bundle(args)
    split = Split(policy, name, bundle, params, budgets)
    budget = DEFAULT_BUDGET if budget is None else budget
    if split.budgets is not None:
        budget = min(split.budgets.values())
    spec = split._spec(budget)
    split.check(spec)
    return split, spec


def checked(args: argparse.Namespace) -> tuple[str | None, tuple | None]:
    """``replay --allocate``'s flags checked as the replay will be (the bundle, the file, each budget against the
    policy's minimum), for the run's plan (``kvsim.cli.run_plan.of_args``): the allocator's name, or the file's
    rows."""
    refuse_proxies(args.proxies)
    split, _ = _checked(args, args.policy, args.allocate, args.budget, policy_args(args))
    if split.budgets is None:
        return split.name, None
    return None, tuple(sorted((x, h, b) for (x, h), b in split.budgets.items()))


def replay(args: argparse.Namespace, run) -> dict:
    """``run`` (a ``kvsim.policykit.plan.Plan`` with a split) replayed on ``--trace``'s bundle."""
    refuse_proxies(args.proxies)
    spec = run.policy
    # a split given as rows is named by the file it came from (--allocate FILE, or the plan itself)
    name = run.allocate if run.allocate is not None else (args.allocate or args.plan)
    split, spec = _checked(args, spec.name, name, spec.budget, dict(spec.params), run.budgets)
    with report.step("replay", f"allocating {split.bundle.name} by {split.name} for {spec.name}") as progress:
        report.prepare([spec.name], progress)
        m = split.run(spec, progress)
    return _doc(split, m)


def sweep(args: argparse.Namespace) -> list[dict]:
    if args.proxies:
        raise CLIError("--proxies does not go with --allocate (the allocation's figure is the bundle's retained mass)")
    param, ranges, fixed, budget = sweep_ranges(args)
    bundle = _bundle(args)
    plan = Split(args.policy, args.allocate, bundle, fixed)
    if plan.budgets is not None and param == "budget":
        raise CLIError(f"--allocate {args.allocate} fixes every head's budget; sweep a policy parameter instead")
    specs = []
    for v in ranges[param]:  # every value checked before any replay
        b = v if param == "budget" else (min(plan.budgets.values()) if plan.budgets is not None else budget)
        plan.params = fixed if param == "budget" else {**fixed, param: v}
        spec = plan._spec(b)
        plan.check(spec)
        specs.append(spec)
    rows = []
    with report.step("sweep", f"allocating {bundle.name} by {plan.name}, {len(specs)} values of {flag(param)}") as progress:
        report.prepare([args.policy], progress)
        for i, spec in enumerate(specs):
            m = plan.run(spec, _scaled(progress, i / len(specs), (i + 1) / len(specs)))
            rows.append(_doc(plan, m))
    best = best_of([r["retained_mass"] for r in rows])  # the window rule's: the first of equal ones
    return [{**r, "best": i == best} for i, r in enumerate(rows)]


def table(args: argparse.Namespace) -> dict:
    from ..analysis.table import TABLE_BUDGET

    if args.proxies:
        raise CLIError("--proxies does not go with --allocate (the allocation's figure is the bundle's retained mass)")
    budget = TABLE_BUDGET if args.budget is None else args.budget
    if budget < 1:
        raise CLIError(f"--budget {budget} must be at least 1")
    bundle = _bundle(args)
    name = args.allocate.strip()
    shape = [(t.layer, t.head) for t in bundle.traces]
    if name not in al.ALLOCATORS:
        raise CLIError(f"--allocate: table takes an allocator's name ({', '.join(al.ALLOCATORS)}); a file fixes "
                       "budgets for one policy: give it to replay")
    jobs, rows = [], []
    # what the policies that read keys, values or queries need: the bundle's traces hold them or none do
    first = bundle.traces[0].load() if any(cls.reads for cls in POLICIES.values()) else None
    for policy in POLICIES:
        try:
            spec = PolicySpec.of(policy, budget)
        except ValueError as e:
            rows.append({"policy": policy, "params": {}, "retained_mass": None, "refused": " ".join(str(e).split())})
            continue
        lacking = vectors.missing(first, POLICIES[policy].reads) if first is not None else []
        if lacking:
            rows.append({"policy": policy, "params": spec.kwargs, "retained_mass": None,
                         "refused": f"{policy} reads {lacking[0]}, which {bundle.name}'s traces do not hold"})
            continue
        try:
            al.check(name, spec, shape, bundle.steps)
        except al.AllocationError as e:
            rows.append({"policy": policy, "params": spec.kwargs, "retained_mass": None, "refused": str(e)})
            continue
        jobs.append(spec)
    if not jobs:
        raise InputError(f"--allocate: {bundle.name}: {name} applies to no policy at budget {budget} "
                         f"({rows[0]['refused'] if rows else 'none'})")
    with report.step("table", f"allocating {bundle.name} by {name} for {len(jobs)} policies") as progress:
        report.prepare([s.name for s in jobs], progress)
        heads = al.load_heads(bundle)
        for i, spec in enumerate(jobs):
            part = _scaled(progress, i / len(jobs), (i + 1) / len(jobs))
            alloc = al.allocate(name, heads, spec, progress=part)
            m = al.measure(heads, spec, alloc)
            rows.append({"policy": spec.name, "params": spec.kwargs, "retained_mass": m.retained_mass,
                         "layers": m.layers(), "allocation": alloc.rows()})
    order = list(POLICIES)
    rows.sort(key=lambda r: order.index(r["policy"]))
    return {"bundle": bundle.name, "model": bundle.model, "steps": bundle.steps, "budget": budget, "allocate": name,
            "rows": rows}


#: KV heads per layer of the shipped models (what adakv's refusal needs before a model loads)
SHIPPED_KV_HEADS = {"gemma3-270m": ("Gemma-3-270M", 18, 1), "smollm2-135m": ("SmolLM2-135M-Instruct", 30, 3)}


def _kv_heads_before_loading(model) -> tuple[str, int, int] | None:
    """(name, layers, KV heads per layer) of ``--model`` read without loading it (a shipped model's, a local
    folder's config.json), None when it cannot be read."""

    name = "gemma3-270m" if model is None else str(model)
    if name in SHIPPED_KV_HEADS:
        return SHIPPED_KV_HEADS[name]
    try:
        cfg = jsontext.loads((Path(name) / "config.json").read_text(encoding="utf-8"))
        cfg = cfg.get("text_config", cfg)
        return Path(name).name, int(cfg["num_hidden_layers"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


#: the allocators whose split the truth measures: the static ones (adakv's pool and duo's streaming heads are not)
TRUTH_ALLOCATORS = al.STATIC + ("optimal",)


def _truth_plan(args: argparse.Namespace) -> tuple[list[str], list[str], list[int], dict]:
    """The allocators, policies, budgets and fixed parameters of ``quality --allocate``, each checked
    before a model is loaded."""
    names = [x.strip() for x in args.allocate.split(",") if x.strip()]
    wrong = [x for x in names if x not in TRUTH_ALLOCATORS]
    if wrong or not names:
        raise CLIError(f"--allocate: quality measures a static split ({', '.join(TRUTH_ALLOCATORS)}); "
                       f"{(wrong or [''])[0]!r} is not one (adakv's pool and duo's streaming heads are measured one split at "
                       "a time: --policy h2o --budget B --allocate adakv|duo)")
    if args.sweep:
        raise CLIError("--allocate does not go with --sweep")
    if args.mode != "open":
        raise CLIError("--allocate measures the open loop: give --mode open (each head's schedule, at its own "
                       "budget, masks one teacher-forced pass)")
    policies = [args.policy] if args.policy else [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in POLICIES]
    if unknown or not policies:
        raise CLIError(f"--policy: unknown policy {unknown[0]!r}{suggest(unknown[0])}; known: {', '.join(POLICIES)}" if unknown
                       else "--policy: no policy given")
    try:
        budgets = [positive_int(part.strip()) for part in args.budget.split(",")]
    except argparse.ArgumentTypeError as e:
        raise CLIError(f"--budget: {e}") from None
    params = {k[len("param_"):]: v for k, v in vars(args).items() if k.startswith("param_") and v is not None}
    for param in params:
        if not any(param in policy_params(p) for p in policies):
            raise CLIError(f"{flag(param)} does not apply to {', '.join(policies)}")
    for policy in policies:  # the parameters' own bounds, whatever the budget
        PolicySpec.of(policy, 10**9, **{k: v for k, v in params.items() if k in policy_params(policy)})
    return list(dict.fromkeys(names)), list(dict.fromkeys(policies)), list(dict.fromkeys(budgets)), params


def _open_session(args: argparse.Namespace):
    """``quality --allocate``'s text, progress, model session and (layer, KV head) shape, once the flags are checked."""
    from ..models import quality as q
    from ..models.loading import require_extra
    from ..models.texts import resolve_text
    from .errors import read_input

    text = resolve_text(args.text)
    read_input("TEXT", text)
    if args.model is None:
        require_extra()
    say = None if args.quiet else q.QUALITY_STDERR
    session = q.open_session(text, args.steps, args.model, progress=say)
    return text, say, session, [(x, h) for x in range(session.layers) for h in range(session.kv_heads)]


def quality(args: argparse.Namespace) -> dict | list[dict]:
    """``quality --allocate``: one split beside uniform's (closed or open loop, adakv's pool closed, the split
    searched by the truth with ``--by``), or, open loop, the frontier's grid (``_quality_grid``). An open-loop
    static split goes through the grid's path so the app's frontier document holds it too."""
    names = [x.strip() for x in args.allocate.split(",") if x.strip()]
    lists = len(names) != 1 or not args.policy or "," in str(args.budget)
    by = getattr(args, "by", None) or "retained_mass"
    searched = by != "retained_mass" or getattr(args, "measurements", None) is not None
    if lists and searched:
        raise CLIError("--by and --measurements search one split by the truth: give one --policy, --budget and "
                       "--allocate optimal")
    if lists or (args.mode == "open" and not searched and names[0] in TRUTH_ALLOCATORS):
        return _quality_grid(args)
    return _quality_one(args, names[0], by)


def _quality_one(args: argparse.Namespace, name: str, by: str) -> dict:
    """One split's truth beside uniform's at the same memory (``kvsim.allocation.truth.measure``): closed
    loop through the deployed cache (adakv's pooled layers included) or open loop, each result in the quality
    cache (``--no-cache``); ``--by kl|delta_nll``: the split searched by the truth from the best static one."""
    from ..allocation import truth
    from ..allocation.split import adakv_floor

    if args.sweep:
        raise CLIError("--allocate does not go with --sweep")
    if args.mode not in truth.MODES:
        raise CLIError("--allocate measures one loop: give --mode closed (the deployed cache holding each head's "
                       "budget) or --mode open (each head's schedule masks one teacher-forced pass)")
    if name not in TRUTH_ALLOCATORS + ("adakv", "duo"):
        raise CLIError(f"--allocate: quality measures a split ({', '.join(TRUTH_ALLOCATORS)}, duo) or adakv's pool; "
                       f"{name!r} is not one")
    if name == "adakv" and args.mode != "closed":
        raise CLIError("--allocate adakv: a pool, not a split, has no open-loop schedule here; give --mode closed "
                       "(the deployed pool decodes the text)")
    if by != "retained_mass" and name != "optimal":
        raise CLIError(f"--by {by} searches the split by the truth: it goes with --allocate optimal, not {name}")
    if getattr(args, "measurements", None) is not None and by == "retained_mass":
        raise CLIError("--measurements bounds the search by the truth: give --allocate optimal --by kl (or delta_nll)")
    try:
        budget = positive_int(str(args.budget).strip())
    except argparse.ArgumentTypeError as e:
        raise CLIError(f"--budget: {e}") from None
    params = policy_args(args)
    spec = _spec(args.policy, budget, params, "TEXT")
    if name in ("adakv", "duo"):
        known = _kv_heads_before_loading(args.model)
        shape = [(x, h) for x in range(known[1]) for h in range(known[2])] if known else [(0, 0), (0, 1)]
        try:
            al.check(name, spec, shape, budget)
        except al.AllocationError as e:
            model = f" ({known[0]}: {known[1]} layers x 1 KV head)" if known and known[2] == 1 else ""
            raise InputError(f"--allocate: {e}{model}") from None
    text, say, session, shape = _open_session(args)
    try:
        al.check(name, spec, shape, session.steps)
    except al.AllocationError as e:
        raise InputError(f"--allocate: {text}: {e}") from None
    heads = [al.Head(x, h, session.traces[x][h]) for x, h in shape]

    def truth_of(flat: list[int], pooled: int | None = None, streaming=None) -> dict:  # per head, (layer, KV head) order
        grid = [[int(flat[x * session.kv_heads + h]) for h in range(session.kv_heads)] for x in range(session.layers)]
        return truth.measure(session, spec.name, grid, spec.kwargs, args.mode, pooled=pooled, streaming=streaming,
                             use_cache=not args.no_cache, progress=say)

    even = truth_of([budget] * len(shape))
    head = {"budget": budget, "allocate": name, "model": session.model_id, "text": Path(text).name,
            "uniform": {k: even[k] for k in ("nll", "delta_nll", "kl", "retained_mass", "seconds", "cached")}}
    if by != "retained_mass":
        from ..allocation.search import DEFAULT_MEASUREMENTS, search_from_static

        kinds = getattr(session.model.config, "layer_types", None)
        found = search_from_static(heads, spec, truth_of, figure=by, kinds=kinds, progress=say,
                                   measurements=DEFAULT_MEASUREMENTS if args.measurements is None else args.measurements)
        s = found["search"]
        got = {k: v for k, v in s["result"].items() if k != "cached"}
        return {**got, **head, "by": by, "start": found["start"], "candidates": found["candidates"],
                "groups": found["groups"], "moves": s["moves"],
                "search": {k: s[k] for k in ("tried", "measured", "step", "last_step", "stopped", "seconds")},
                "allocation": found["allocation"].rows()}
    split = al.allocate(name, heads, spec, progress=say)
    pooled = adakv_floor(spec) if split.pooled else None
    streaming = None  # duo's streaming heads run streaming_llm with its sinks, the rest the policy
    if split.streaming is not None:
        streaming = [[{"sinks": al.DUO_SINKS} if split.streaming[x * session.kv_heads + h] else None
                      for h in range(session.kv_heads)] for x in range(session.layers)]
    got = truth_of(list(split.budgets), pooled, streaming)
    return {**got, **head, "allocation": split.rows(), **({"floor": pooled, "pooled": True} if pooled is not None else {})}


def _quality_grid(args: argparse.Namespace) -> dict | list[dict]:
    """``quality --allocate NAME[,NAME...] --mode open``: the model's loss and KL with each (layer, KV head)
    at its own budget (``kvsim.allocation.truth``). One allocator, policy and budget: that split beside
    uniform's at the same memory (a dict). Several (``--policy A,B``, ``--budget B,B``, ``--allocate A,A``): the
    frontier's grid, a row per cell, a cell no policy or trace allows said on stderr and skipped. Every cell is
    cached on disk and gathered in the frontier document the app reads; an interrupted grid resumes;
    ``--batch`` splits share one batched pass."""
    from ..allocation.truth import Cell, measure_cells
    from ..progress import scaled

    names, policies, budgets, params = _truth_plan(args)
    single = len(names) == 1 and len(policies) == 1 and len(budgets) == 1
    if single:
        spec = _spec(policies[0], budgets[0], params, "TEXT")  # refused before the model loads, the minimum named
        if names[0] != "uniform":
            names = [names[0], "uniform"]
    text, say, session, shape = _open_session(args)
    heads = [al.Head(x, h, session.traces[x][h]) for x, h in shape]
    jobs = []
    for policy in policies:
        taken = {k: v for k, v in params.items() if k in policy_params(policy)}
        for budget in budgets:
            for name in names:
                try:
                    spec = PolicySpec.of(policy, budget, **taken)
                    al.check(name, spec, shape, session.steps)
                except (al.AllocationError, ValueError) as e:
                    if single:
                        raise InputError(f"--allocate: {text}: {' '.join(str(e).split())}") from None
                    if say is not None:
                        say(None, f"skipped {policy} {name} at budget {budget}: {' '.join(str(e).split())}")
                    continue
                jobs.append((spec, name))
    if not jobs:
        raise InputError(f"--allocate: {text}: no cell of the grid can run ({session.steps} steps)")
    cells = []
    for i, (spec, name) in enumerate(jobs):  # the splits first (optimal's budget curves), then the passes
        part = scaled(say, 0.5 * i / len(jobs), 0.5 * (i + 1) / len(jobs))
        split = al.allocate(name, heads, spec, progress=part)
        grid = tuple(tuple(split.budgets[x * session.kv_heads + h] for h in range(session.kv_heads))
                     for x in range(session.layers))
        cells.append(Cell(spec.name, name, spec.budget, grid, tuple(sorted(spec.kwargs.items()))))
    rows = measure_cells(session, cells, batch=args.batch, use_cache=not args.no_cache, progress=scaled(say, 0.5, 1.0))
    for row, cell in zip(rows, cells, strict=True):
        row["allocation"] = [{"layer": x, "kv_head": h, "budget": int(cell.budgets[x][h])} for x, h in shape]
        row.pop("split", None)
    if single:
        got = rows[0]
        even = rows[-1]
        return {**got, "uniform": {k: even[k] for k in ("nll", "delta_nll", "kl", "retained_mass", "seconds", "cached")}}
    return rows

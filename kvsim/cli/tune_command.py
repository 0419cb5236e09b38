"""``kvsim tune``: the flags (or ``--plan FILE``) into ``kvsim.analysis.tune``, the truth it recommends by (the
model's open loop, read from the shipped truth where it has the window, else measured and cached), the split
``--allocate auto`` chooses, the serving layout every window is measured under (``--block-size``,
``--shared-selection``, ``--evict-every``, or a plan's ``layout``; ``--search-layout``: which layout costs
least), and ``--save-plan``'s plan of what was tuned."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import progress as protocol
from ..analysis import proxies as px
from ..data.bundle import is_bundle
from ..data.qk import DENSE_LIMIT
from ..policies import POLICIES, PolicySpec
from ..policykit.base import WINDOW
from . import layout_flags
from .errors import CLIError, InputError
from .replay_command import load


class _Tuning:
    """What ``tune`` tunes: the policy, its budget, its other parameters held (those a plan sets away from their
    defaults, as a model's measurement keys them) and the split (``--plan``'s allocator or rows, or None)."""

    def __init__(self, args: argparse.Namespace) -> None:
        #: the parameter tuned: the policy's window (``spec.params.recent_window``)
        self.param = WINDOW
        plan = getattr(args, "run_plan", None)
        #: the serving layout every window is measured under: the plan's, or the flags' (None: none)
        self.layout = layout_flags.of(args) if plan is None or plan.layout is None else plan.layout
        if plan is None:  # the flags: the policy at the budget, its window what is tuned
            self.policy, self.budget, self.fixed, self.plan = args.policy, args.budget, {}, None
            return
        spec = plan.policy
        declared = {p.name: p.default for p in POLICIES[spec.name].tunables}
        self.policy, self.budget, self.plan = spec.name, spec.budget, plan
        self.fixed = {k: v for k, v in spec.params if k != WINDOW and v != declared[k]}

    def at(self, window) -> dict:
        """The parameters a measurement keys at ``window`` (a window, or one per layer): those held, and the window."""
        return {**self.fixed, self.param: window}

    def tuned(self, window: int) -> PolicySpec:
        return PolicySpec.of(self.policy, self.budget, **self.at(window))


def cmd_tune(args: argparse.Namespace) -> object:
    from ..analysis.tune import AUTO, TRUTH_BY, tune
    from ..cluster import LOCAL, dask_available
    from ..data.catalog import resolve_bundle, shipped_bundles

    what = _Tuning(args)
    spec = args.trace.strip()
    bundle = spec in shipped_bundles() or is_bundle(spec)
    layouts = _check_tune_layout(args, what)
    _check_tune_allocate(args, bundle, what)
    source = resolve_bundle(spec) if bundle else load(spec)
    _say_one_head(source, layouts)
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

    def tuned_under(layout) -> dict:
        under = truth if truth is None else truth.under(layout)
        said = f"the truth: {under.what}" if under is not None and why and why.startswith("the truth: ") else why
        return tune(source, what.policy, what.budget, tolerance=args.tolerance, top_k=args.top_k, scheduler=scheduler,
                    workers=args.workers, progress=say, by=args.by, truth=under, why=said, per_layer=args.per_layer,
                    layout=layout, **what.fixed).to_dict(curves=args.curves)

    if args.search_layout is None:
        doc = tuned_under(what.layout)
    else:
        from ..analysis.tune_layout import search

        field, _ = args.search_layout
        doc, table = search(tuned_under, layouts, field, what.policy, what.budget, what.fixed, say)
        doc["layout_search"] = table
    plan = what.plan
    if args.allocate is not None or (plan is not None and plan.allocate is not None):
        import time

        t0 = time.perf_counter()
        doc.update(_tune_allocation(args, source, doc, truth, say, what))
        run = doc["run"]  # the summary counts the allocators' time and their truth too
        run["allocate_seconds"] = round(time.perf_counter() - t0, 2)
        run["seconds"] = round(run["seconds"] + run["allocate_seconds"], 2)
        if truth is not None and hasattr(truth, "counts"):
            run["truth"] = dict(truth.counts)
    if args.save_plan is not None:
        from ..policykit.layouts import Layout

        layout = Layout.from_dict({k: doc[k] for k in ("block_size", "shared_selection", "evict_every")}) if (
            "layout" in doc) else None
        _save_tuned(args, what, doc["model_window"], doc.get("allocation"), layout)
    return doc


def _save_tuned(args: argparse.Namespace, what: _Tuning, window: int, chosen: list[dict] | None, layout) -> None:
    """``tune --save-plan FILE``: what was tuned as a plan, ``generate --plan FILE`` runs it as it is: model_window
    in every layer, the split chosen (``--allocate auto``, or the plan's allocator at that window) or the plan's rows,
    under the serving layout it was tuned under (``layout``: the one given, or the one ``--search-layout`` chose)."""
    from ..policykit.plan import Plan
    from . import run_plan

    rows = None if chosen is None else tuple(sorted((r["layer"], r["kv_head"], r["budget"]) for r in chosen))
    if rows is None and what.plan is not None:
        rows = what.plan.allocation
    if rows is not None and (low := min(rows, key=lambda r: r[2]))[2] <= window:
        raise CLIError(f"--save-plan: the split gives layer {low[0]} KV head {low[1]} a budget of {low[2]}, not above the "
                       f"tuned recent_window {window}")
    run_plan.write(Plan(what.tuned(window), allocation=rows, layout=layout), args.save_plan)


#: the figures tune --allocate auto chooses an allocator by (kvsim.allocation.tune.BY, named here
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


def _check_tune_layout(args: argparse.Namespace, what: _Tuning) -> list:
    """The layouts the run measures under, each refused in one line before any trace or model loads (a block larger
    than the budget, an interval leaving no room for a window of 1, a split or ``--per-layer`` beside it), in the
    layout checks' own words (``kvsim.cli.layout_flags``): ``--search-layout``'s candidates (a candidate the policy
    cannot run is left out of the search with its reason, said in its table), or the one layout (None: none)."""
    from ..analysis.tune_sweep import TuneError

    plan = what.plan
    split = args.allocate is not None or (plan is not None and (plan.allocate is not None or plan.allocation is not None))
    if args.search_layout is None:
        layouts = [what.layout]
    else:
        from ..analysis.tune_layout import candidates, parse

        try:
            field, values = args.search_layout = parse(args.search_layout)
        except TuneError as e:
            raise CLIError(str(e)) from None
        if plan is not None and plan.layout is not None:
            raise CLIError(f"--search-layout: --plan {args.plan} sets the serving layout; search from a plan without one")
        if getattr(args, field) is not None:
            shown = "--" + field.replace("_", "-")
            raise CLIError(f"--search-layout {field} searches {shown}: give one or the other")
        layouts = candidates(what.layout, field, values)
    for layout in layouts:
        if layout is None or layout.plain:
            continue
        layout_flags.refuse_with(args, layout, split=split)
        if args.per_layer:
            raise CLIError(f"{layout_flags.layout_flags_text(layout)}: --per-layer is not measured under a serving layout "
                           "yet; tune deploys model_window in every layer under it")
        if args.search_layout is None:  # the one layout: its refusals and notes (a rounded budget), once
            layout_flags.check(layout, what.policy, [(what.budget, {**what.fixed, WINDOW: 1})], heads=None)
    return layouts


def _say_one_head(source, layouts: list) -> None:
    """Shared selection on a recording of one KV head per layer is a no-op: said once, on stderr."""
    from ..data.bundle import Bundle

    if not any(lay is not None and lay.shared_selection for lay in layouts):
        return
    heads = {(t.layer, t.head) for t in source.traces} if isinstance(source, Bundle) else {(0, 0)}
    if len(heads) == len({x for x, _ in heads}):
        layout_flags.say(["shared selection on a recording with one KV head per layer: a no-op"])


def _tune_allocation(args: argparse.Namespace, source, doc: dict, truth, say, what: _Tuning) -> dict:
    """``tune --allocate auto``: each candidate allocator's split at model_window in every layer, by tune's
    figure (retained mass, or the truth, open loop, each split cached), the best chosen
    (``kvsim.allocation.tune``); the tune file carries the chosen split as ``allocation`` rows. A plan's
    allocator is the one candidate."""
    from ..allocation import allocators as al
    from ..allocation.tune import CANDIDATES, choose

    by = doc["by"]
    note = None
    if by not in _ALLOCATE_BY:  # --by auto without the truth at hand fell back to a proxy of one window
        note = f"by retained_mass: the truth is not at hand and {by} measures one window, not a split"
        by = "retained_mass"
    window = doc["model_window"]
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
    return {"allocate": {"chosen": got["chosen"], "by": by, "note": note, WINDOW: window,
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
        self.at = what.at  # the parameters a measurement keys at a window
        self.recording = str(meta.get("model") or model)
        self.sha = file_sha256(text)
        self.bare_what = f"{model} on {Path(text).name}, {steps} steps, open loop"
        #: the serving layout measured under (None: none, the shipped and cached truth read as today)
        self.layout = what.layout
        self.what = self.bare_what + ("" if self.layout is None else f", under {self.layout.label}")
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

    def under(self, layout) -> _Truth:
        """The same truth (its session shared) measured under ``layout`` (None or plain: none): itself where that is
        its own layout, else a copy counting its own measurements (a search's candidates each count theirs)."""
        import copy

        layout = None if layout is None or layout.plain else layout
        if layout == self.layout:
            return self
        other = copy.copy(self)
        other.layout, other.counts = layout, {"read": 0, "measured": 0}
        if hasattr(self, "bare_what"):
            other.what = self.bare_what + ("" if other.layout is None else f", under {other.layout.label}")
        return other

    def _uniform(self, windows) -> list[dict]:
        from ..models import quality, truth
        from ..models.errors import RecordError

        args = self.args
        if self.layout is not None:
            return self._under_layout(windows)
        jobs = [(self.policy, self.budget, self.at(int(w))) for w in windows]
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

    def _under_layout(self, windows) -> list[dict]:
        """The open loop under the layout (``kvsim.models.quality_layout.measure_open``), one window at a time, each
        cached under the open loop's key plus the layout; the truth documents (shipped or written here) hold no
        layout, so they are neither read nor written."""
        from ..models import quality
        from ..models.errors import RecordError
        from ..models.quality_layout import measure_open

        rows = []
        for i, w in enumerate(windows):
            if self.say is not None:
                self.say(i / max(1, len(windows)), f"the truth under {self.layout.label}: recent_window {int(w)} "
                         f"({i + 1}/{len(windows)})")
            try:
                r = measure_open(self._open(), self.policy, self.budget, self.at(int(w)),
                                 self.layout, use_cache=not self.args.no_cache)
            except (quality.QualityError, RecordError) as e:
                raise InputError(f"{self.args.trace}: {e}") from None
            self.counts["read" if r["cached"] else "measured"] += 1
            rows.append({WINDOW: int(w), "kl_open": r["kl"], "delta_nll_open": r["delta_nll"],
                         "cached_open": r["cached"]})
        return rows

    def split(self, flat, window: int) -> dict:
        """The open-loop truth of a split (flat per-head budgets in (layer, KV head) order) at the tuned
        policy's model-wide window, cached on disk per split (``kvsim.allocation.truth``)."""
        from ..allocation.truth import cached_open_truth
        from ..models import quality
        from ..models.errors import RecordError

        try:
            session = self._open()
            k = session.kv_heads
            grid = [[int(flat[x * k + h]) for h in range(k)] for x in range(len(flat) // k)]
            r = cached_open_truth(session, self.policy, grid, self.at(int(window)),
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
                jobs = [session.configuration(self.policy, self.budget, self.at(list(c)))
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

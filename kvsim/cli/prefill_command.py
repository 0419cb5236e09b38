"""``--prefill-budget`` on replay, sweep and table: compression at the prompt's end (``kvsim.sim.prefill``,
docs/scorers.md "prefill compression").

``--prefill-budget N`` (positions per head) or a ratio in (0, 1) (the share of the prompt kept: kvpress's
compression_ratio is the share evicted, so its 0.25 is 0.75 here); ``--prompt-length P`` (default: the
trace's meta ``prompt_length``; a trace without one needs the flag); ``--prefill-policy NAME`` (default
snapkv, at its default parameters, or ``NAME:param=v,param=v``), any online policy. ``--policy none``
lets the cache grow after the prompt; any other policy decodes from the kept set at ``--budget``.
"""

from __future__ import annotations

import argparse

from ..data import vectors
from ..policies import DEFAULT_BUDGET, POLICIES, ParamError, PolicySpec, policy_params
from ..policykit import registry
from ..sim.prefill import DEFAULT_SCORER, GROW, Prefill, PrefillError, rankers, refuse_model, replay_prefill
from .errors import CLIError, flag, param_message
from .parser import parse_range, sweep_ranges
from .prefill_flags import say as _say
from .prefill_flags import scorer as _scorer


def given(args: argparse.Namespace) -> bool:
    return getattr(args, "prefill_budget", None) is not None


def refuse_none(args: argparse.Namespace) -> None:
    """``--policy none`` means the cache grows after a compressed prompt: without --prefill-budget it means nothing."""
    if getattr(args, "policy", None) == GROW and not given(args):
        raise CLIError("--policy none (the cache growing after the prompt) needs --prefill-budget")
    if not given(args) and (getattr(args, "prompt_length", None) is not None
                            or getattr(args, "prefill_policy", DEFAULT_SCORER) != DEFAULT_SCORER):
        raise CLIError("--prompt-length and --prefill-policy go with --prefill-budget")
    if given(args):  # a scorer that runs the model, refused before the trace loads
        name, _ = _scorer(getattr(args, "prefill_policy", DEFAULT_SCORER))
        try:
            if name in registry.SCORERS:
                refuse_model(name)
        except PrefillError as e:
            raise CLIError(_say(e)) from None


def _prefill(args: argparse.Namespace, trace, keep) -> Prefill:
    name, params = _scorer(args.prefill_policy)
    try:
        return Prefill.of(trace, keep, name, prompt=args.prompt_length, **params)
    except PrefillError as e:
        raise CLIError(_say(e)) from None


def decode_spec(args: argparse.Namespace, budget=None, **params) -> PolicySpec | None:
    """The decode-time spec (None: the cache grows), refusing --budget and parameter flags with none."""
    given_params = {k[len("param_"):]: v for k, v in vars(args).items() if k.startswith("param_") and v is not None}
    if args.policy == GROW:
        if args.budget is not None:
            raise CLIError("--budget does not apply to --policy none: the cache grows after the prompt")
        if given_params:
            raise CLIError(f"{flag(next(iter(given_params)))} does not apply to --policy none")
        return None
    accepted = policy_params(args.policy)
    for p in given_params:
        if p not in accepted:
            raise CLIError(f"{flag(p)} does not apply to policy {args.policy}")
    try:
        return PolicySpec.of(args.policy, DEFAULT_BUDGET if budget is None else budget, **{**given_params, **params})
    except ParamError as e:
        raise CLIError(param_message(e)) from None


def refuse_with(split: bool, proxies: bool) -> None:
    """What a replay's compressed prompt does not go with (its flags, or a plan's split), one line."""
    if split:
        raise CLIError("--allocate does not go with --prefill-budget")
    if proxies:
        raise CLIError("--proxies does not go with --prefill-budget")


def replay(args: argparse.Namespace, run, load) -> dict:
    """``run`` (a ``kvsim.policykit.plan.Plan`` with a compression) replayed on ``--trace``: its prompt compressed once,
    then its policy (None: the cache grows) decoding from the kept set."""
    c = run.compression
    trace = load(args.trace)
    try:
        prefill = Prefill.of(trace, c.keep, c.policy, prompt=c.prompt_length, **dict(c.params))
    except PrefillError as e:
        raise CLIError(_say(e)) from None
    return {"trace": trace.name, **replay_prefill(trace, prefill, run.policy, top_k=args.top_k).summary()}


def _keeps(text: str) -> list:
    """``--prefill-budget``'s values in a sweep: A:B[:STEP], a comma list (integers or ratios), or one value."""
    if "," in text:
        return [x.strip() for x in text.split(",") if x.strip()]
    if ":" in text:
        return parse_range("--prefill-budget", text)
    return [text]


def sweep(args: argparse.Namespace, load) -> list[dict]:
    """A sweep over --prefill-budget (its values a range or a list) with the decode fixed, or over one of the
    decode policy's flags or --budget with the prefill fixed."""
    if getattr(args, "allocate", None) is not None or getattr(args, "proxies", False):
        raise CLIError("--allocate and --proxies do not go with --prefill-budget")
    keeps = _keeps(args.prefill_budget)
    if len(keeps) > 1 or ":" in args.prefill_budget:
        ranged = [flag(k[len("param_"):]) for k, v in vars(args).items() if k.startswith("param_") and v and ":" in v]
        if ranged or (args.budget is not None and ":" in args.budget):
            raise CLIError("sweep needs exactly one range: --prefill-budget is one, so "
                           f"{', '.join(ranged) or '--budget'} must be a single value")
        fixed = {k[len("param_"):]: parse_range(flag(k[len("param_"):]), v)[0] for k, v in vars(args).items()
                 if k.startswith("param_") and v is not None}
        for k in fixed:
            setattr(args, f"param_{k}", None)
        budget = None if args.budget is None else parse_range("--budget", args.budget)[0]
        decode = decode_spec(args, budget, **fixed)
        trace = load(args.trace)
        prefills = [_prefill(args, trace, k) for k in keeps]
        rows = [replay_prefill(trace, pf, decode, top_k=args.top_k).summary() for pf in prefills]
        return [{"trace": trace.name, **r} for r in rows], "prefill_budget"
    if args.policy == GROW:
        raise CLIError("sweep with --policy none sweeps --prefill-budget: give it as A:B[:STEP] or a list")
    param, ranges, fixed, budget = sweep_ranges(args)
    trace = load(args.trace)
    prefill = _prefill(args, trace, keeps[0])
    specs = []
    for v in ranges[param]:
        try:
            specs.append(PolicySpec.of(args.policy, v if param == "budget" else budget,
                                       **{**fixed, **({} if param == "budget" else {param: v})}))
        except ParamError as e:
            raise CLIError(param_message(e)) from None
    rows = [replay_prefill(trace, prefill, s, top_k=args.top_k).summary() for s in specs]
    return [{"trace": trace.name, **r} for r in rows], param


def table(args: argparse.Namespace, load) -> dict:
    """Every policy that can rank the prompt as the one-time scorer, at its defaults (a window it always keeps
    must be below the prefill budget: a row refused otherwise, saying why), the cache growing after."""
    if getattr(args, "allocate", None) is not None or getattr(args, "proxies", False):
        raise CLIError("--allocate and --proxies do not go with --prefill-budget")
    if args.budget is not None:
        raise CLIError("--budget does not go with table --prefill-budget: the cache grows after the prompt")
    if args.prefill_policy != DEFAULT_SCORER:
        raise CLIError("table --prefill-budget measures every scorer; --prefill-policy is for replay and sweep")
    trace = load(args.trace)
    first = _prefill(args, trace, args.prefill_budget)  # the flags checked once, with the default scorer
    rows = []
    for name in rankers():
        cls = POLICIES[name]
        if lacking := vectors.missing(trace, cls.reads, registry.reads_meta(name)):  # what the trace lacks: said
            rows.append({"policy": name, "refused": f"it reads {', '.join(lacking)}, which this trace does not hold"})
            continue
        try:
            prefill = Prefill.of(first.prompt, first.keep, name)
        except PrefillError as e:
            rows.append({"policy": name, "refused": _say(e)})
            continue
        r = replay_prefill(trace, prefill, None, top_k=args.top_k)
        rows.append({"policy": name, "params": prefill.scorer.kwargs, "retained_mass": r.retained_mass,
                     "top_k_recall": r.top_k_recall})
    return {"trace": trace.name, "prompt_length": first.prompt, "prefill_budget": first.keep, "steps": trace.steps,
            "decode_steps": trace.steps - first.prompt + 1, "top_k": args.top_k, "rows": rows}


__all__ = ["decode_spec", "given", "refuse_none", "refuse_with", "replay", "sweep", "table"]

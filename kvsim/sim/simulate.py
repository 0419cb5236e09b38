"""``replay`` and ``sweep``: the one entry point for each, used by the app, the CLI, the table and the
proxies (``sweep(..., summarise=...)``: one reduction per replay, with its kept sets). Which row of a
sweep is best is ``kvsim.analysis.windows``'s rule, not the simulator's.

Both take what to replay as a ``PolicySpec`` or as a registry name with ``budget`` and parameters,
from which they make the spec once (so a bad parameter fails before any work, with a
``ValueError`` naming it) and the policy from the spec once. They then take the fast engine where
it covers the policy (``kvsim.sim.engine.FAST``) and the reference harness (``kvsim.sim.harness``)
otherwise: same results, bit for bit. Progress is ``kvsim.progress``'s protocol; these report the
fraction done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ..data.trace import Trace
from ..policies import DEFAULT_BUDGET, Policy, PolicySpec, policy_params
from ..progress import Progress
from . import engine
from .harness import DEFAULT_TOP_K, ReplayResult, replay_reference


def replay(
    trace: Trace,
    policy: Policy | PolicySpec | str,
    *,
    budget: int | None = None,
    top_k: int = DEFAULT_TOP_K,
    record_kept: bool = False,
    record_scores: bool = False,
    record_victims: bool = False,
    reference: bool = False,
    progress: Progress | None = None,
    layout=None,
    **params,
) -> ReplayResult:
    """Replay ``trace`` through ``policy``: a ``PolicySpec``, a registry name with ``budget``
    (default ``DEFAULT_BUDGET``) and its parameters, or a built instance (always the reference
    harness, which steps that very object). ``reference=True`` forces the reference harness for a
    spec or a name too, and so does a caller inside ``kvsim.jit.compiled_only()`` while the engine's
    kernels for the policy are not compiled yet (``engine.ready``): the same result, without waiting
    for numba. The result carries the spec (``ReplayResult.spec``).

    ``layout`` (``kvsim.policykit.layouts.Layout``): the serving layout the policy runs under, on the
    reference path (``kvsim.sim.layered``); ``optimal`` with blocks is the optimum under blocks. None or
    ``Layout()`` is today's replay, bit for bit."""
    kw = dict(top_k=top_k, record_kept=record_kept, record_scores=record_scores, record_victims=record_victims,
              progress=progress)
    if isinstance(policy, Policy):
        if params:
            raise ValueError("params are only accepted with a policy name")
        if layout is not None and not layout.plain:
            raise ValueError("a layout is given with a policy name or spec (a built policy is wrapped by "
                             "kvsim.policykit.layouts.held.wrap)")
        return replay_reference(trace, policy, budget, **kw)
    spec = _spec(policy, budget, params)
    _check_top_k(top_k)
    if layout is not None and not layout.plain:
        from .layered import replay_layout

        return replay_layout(trace, spec, layout, **kw)
    built = spec.build(trace)
    if not reference and engine.covers(trace, spec.name) and engine.ready(trace, spec.name):
        return engine.replay(trace, built, spec=spec, **kw)
    return replay_reference(trace, built, spec=spec, **kw)


def sweep(
    trace: Trace,
    policy: PolicySpec | str | Sequence[PolicySpec],
    budget: int | None = None,
    param: str | None = None,
    values: Iterable[int] = (),
    *,
    top_k: int = DEFAULT_TOP_K,
    reference: bool = False,
    progress: Progress | None = None,
    summarise: Callable[[ReplayResult], dict] | None = None,
    layout=None,
    **params,
) -> list[dict]:
    """One ``ReplayResult.summary()`` per value of ``param`` (a policy parameter, or ``"budget"``),
    in the order of ``values``, the other parameters those of the spec ``policy``, or of ``params``
    (their defaults where left out) with a name; ``param=None`` replays the one configuration, or,
    given a list of specs of one policy, those configurations as they are (made and checked once by
    the caller: ``tune`` makes them before its workers start). Every value's spec is made (and so
    checked) before any replay, so a bad value fails at once rather than after minutes of work.

    Where the engine covers the policy every configuration advances together, one pass over the
    trace per batch; otherwise each is a reference replay. ``summarise``: each configuration is
    replayed alone (``replay``) with its kept sets recorded, and its row is ``summarise(result)``
    (the value-aware proxies, ``kvsim.analysis.proxies.sweep``: at 1024 steps a replay takes
    milliseconds). ``layout``: every configuration under that serving layout, each a reference replay."""
    specs = _specs(policy, budget, param, values, params)
    _check_top_k(top_k)
    if layout is not None and not layout.plain:
        out = []
        for i, s in enumerate(specs):
            result = replay(trace, s, top_k=top_k, record_kept=summarise is not None, layout=layout)
            out.append(result.summary() if summarise is None else {**summarise(result), **result.layout_fields()})
            if progress is not None:
                progress((i + 1) / len(specs))
        return out
    if summarise is not None:
        rows = (summarise(replay(trace, s, top_k=top_k, record_kept=True, reference=reference)) for s in specs)
    else:
        built = [s.build(trace) for s in specs]
        if not reference and engine.covers(trace, specs[0].name):
            series = engine.sweep(trace, built, top_k=top_k, progress=progress)
            return [_summary(s, trace, top_k, mass, recall) for s, (mass, recall) in zip(specs, series, strict=True)]
        rows = (replay_reference(trace, b, top_k=top_k).summary() for b in built)
    out = []
    for i, row in enumerate(rows):
        out.append(row)
        if progress is not None:
            progress((i + 1) / len(specs))
    return out


def even_windows(budget: int, count: int) -> list[int]:
    """``count`` recent_windows evenly spaced over the budget, centred in equal bins: the candidates a
    costly figure (the truth, a value proxy) is measured at. Budget 64 and 8 windows give 4, 12, ..,
    60; budget 256 and 16 give 8, 24, .., 248."""
    step = budget / count
    return sorted({max(1, min(budget - 1, int(round(step * (i + 0.5))))) for i in range(count)})


def _check_top_k(top_k: int) -> None:
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")


def _spec(policy: PolicySpec | str, budget: int | None, params: dict) -> PolicySpec:
    """The spec a replay was asked for: the one given, or one made from a name."""
    if isinstance(policy, PolicySpec):
        if budget is not None or params:
            raise ValueError("budget and params are only accepted with a policy name; a PolicySpec carries its own")
        return policy
    return PolicySpec.of(policy, DEFAULT_BUDGET if budget is None else budget, **params)


def _summary(spec: PolicySpec, trace: Trace, top_k: int, mass, recall) -> dict:
    return ReplayResult(spec.name, spec.budget, spec.kwargs, trace.steps, top_k, mass, recall).summary()


def _specs(policy: PolicySpec | str, budget: int | None, param: str | None, values, params: dict) -> list[PolicySpec]:
    """The spec of each configuration a sweep replays (a spec's own values, or a name's ``params``,
    with ``param`` at each of ``values``; or the specs given)."""
    if not isinstance(policy, (PolicySpec, str)):
        specs = list(policy)
        if budget is not None or param is not None or params:
            raise ValueError("a sweep of given specs takes no budget, param or params: each spec carries its own")
        if not specs or len({s.name for s in specs}) != 1:
            raise ValueError("a sweep of given specs needs at least one, all of one policy")
        return specs
    if param is None:
        return [_spec(policy, budget, params)]
    values = list(values)
    if not values:
        raise ValueError(f"sweep over {param} needs at least one value")
    if isinstance(policy, PolicySpec):
        base = _spec(policy, budget, params)
        return [base.replace(budget=v) if param == "budget" else base.replace(**{param: v}) for v in values]
    if param == "budget":
        return [PolicySpec.of(policy, v, **params) for v in values]
    if param in params:
        raise ValueError(f"{param} is both swept and fixed")
    accepted = policy_params(policy)
    if param not in accepted:
        raise ValueError(f"{policy} does not take parameter {param}; it takes: {', '.join(accepted) or 'none beyond budget'}")
    budget = DEFAULT_BUDGET if budget is None else budget
    return [PolicySpec.of(policy, budget, **{**params, param: v}) for v in values]

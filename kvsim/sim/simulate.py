"""``replay`` and ``sweep``: the one entry point for each, used by the app, the CLI and the table.

Both take what to replay as a ``PolicySpec`` or as a registry name with ``budget`` and parameters,
from which they make the spec once (so a bad parameter fails before any work, with a
``ValueError`` naming it) and the policy from the spec once. They then take the fast engine where
it covers the policy (``kvsim.sim.engine.FAST``) and the reference harness (``kvsim.sim.harness``)
otherwise: same results, bit for bit. Progress is ``kvsim.progress``'s protocol; these report the
fraction done.
"""

from __future__ import annotations

from collections.abc import Iterable

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
    **params,
) -> ReplayResult:
    """Replay ``trace`` through ``policy``: a ``PolicySpec``, a registry name with ``budget``
    (default ``DEFAULT_BUDGET``) and its parameters, or a built instance (always the reference
    harness, which steps that very object). ``reference=True`` forces the reference harness for a
    spec or a name too, and so does a caller inside ``kvsim.jit.compiled_only()`` while the engine's
    kernels for the policy are not compiled yet (``engine.ready``): the same result, without waiting
    for numba. The result carries the spec (``ReplayResult.spec``)."""
    kw = dict(top_k=top_k, record_kept=record_kept, record_scores=record_scores, record_victims=record_victims,
              progress=progress)
    if isinstance(policy, Policy):
        if params:
            raise ValueError("params are only accepted with a policy name")
        return replay_reference(trace, policy, budget, **kw)
    spec = _spec(policy, budget, params)
    _check_top_k(top_k)
    built = spec.build(trace)
    if not reference and engine.covers(trace, spec.name) and engine.ready(trace, spec.name):
        return engine.replay(trace, built, spec=spec, **kw)
    return replay_reference(trace, built, spec=spec, **kw)


def sweep(
    trace: Trace,
    policy: PolicySpec | str,
    budget: int | None = None,
    param: str | None = None,
    values: Iterable[int] = (),
    *,
    top_k: int = DEFAULT_TOP_K,
    reference: bool = False,
    progress: Progress | None = None,
    **params,
) -> list[dict]:
    """One ``ReplayResult.summary()`` per value of ``param`` (a policy parameter, or ``"budget"``),
    in the order of ``values``, the other parameters those of the spec ``policy``, or of ``params``
    (their defaults where left out) with a name; ``param=None`` replays the one configuration. Every
    value's spec is made (and so checked) before any replay, so a bad value fails at once rather
    than after minutes of work.

    Where the engine covers the policy every configuration advances together, one pass over the
    trace per batch; otherwise each is a reference replay."""
    specs = _specs(policy, budget, param, values, params)
    _check_top_k(top_k)
    built = [s.build(trace) for s in specs]
    if not reference and engine.covers(trace, specs[0].name):
        series = engine.sweep(trace, built, top_k=top_k, progress=progress)
        return [_summary(s, trace, top_k, mass, recall) for s, (mass, recall) in zip(specs, series, strict=True)]
    out = []
    for i, b in enumerate(built):
        out.append(replay_reference(trace, b, top_k=top_k).summary())
        if progress is not None:
            progress((i + 1) / len(built))
    return out


def sweep_coarse_to_fine(
    trace: Trace,
    policy: str,
    budget: int,
    param: str,
    low: int,
    high: int,
    *,
    marks: Iterable[int] = (),
    points: int = 32,
    refine: bool = True,
    top_k: int = DEFAULT_TOP_K,
    progress: Progress | None = None,
    **params,
) -> list[dict]:
    """A sweep of ``param`` over ``low .. high`` that costs a few times ``points`` replays however
    wide the range: an even grid of about ``points`` values plus ``marks`` (values a view must show
    exactly: a default, a band, the current setting); then, with ``refine``, grids eight times
    finer around the best so far, down to every value next to it. The maximum is found exactly when
    the curve has one peak (else the best of the values tried). Rows come back sorted by ``param``;
    when the range has at most ``points`` values it is simply the full sweep.
    """
    if high < low:
        raise ValueError(f"sweep over {param} needs low <= high, got {low}..{high}")
    points = max(2, points)
    stride = max(1, -(-(high - low + 1) // points))
    done: dict[int, dict] = {}
    todo = sorted(set(range(low, high + 1, stride)) | {high} | {m for m in marks if low <= m <= high})
    rounds = 1
    while stride > 1 and refine:  # how many refinements will follow: for the progress fraction
        stride = max(1, stride // 8)
        rounds += 1
    stride = max(1, -(-(high - low + 1) // points))
    for r in range(rounds):
        report = None if progress is None else (lambda f, r=r: progress((r + f) / rounds))
        for row in sweep(trace, policy, budget, param, todo, top_k=top_k, progress=report, **params) if todo else []:
            done[row[param]] = row
        if r == rounds - 1:
            break
        peak = best([done[v] for v in sorted(done)])[param]
        finer = max(1, stride // 8)
        todo = [v for v in range(max(low, peak - stride + 1), min(high, peak + stride - 1) + 1, finer) if v not in done]
        stride = finer
    if progress is not None:
        progress(1.0)
    return [done[v] for v in sorted(done)]


def best(rows: list[dict], metric: str = "retained_mass") -> dict:
    """The row with the largest ``metric``; the first such row on ties (the smallest swept value
    when the values ascend)."""
    if not rows:
        raise ValueError("no rows")
    return max(rows, key=lambda r: r[metric])  # max keeps the first of equal keys


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
    with ``param`` at each of ``values``)."""
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

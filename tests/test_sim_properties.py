"""Property-based tests on small random traces (up to 60 steps, budgets 1 .. T + 2): the contract for
every registered policy, each reference policy's kept set against its definition, and the metrics'
bounds."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from random_traces import with_members
from tolerance import rounding

import kvsim
from kvsim.sim.harness import observe

NAMES = list(kvsim.POLICIES)
SETTINGS = settings(max_examples=300, deadline=None)


@st.composite
def cases(draw, names=tuple(NAMES)):
    """(trace spec, policy name, budget, params): every integer parameter drawn below the budget,
    falling back to the policy's fitted defaults if the draw is refused."""
    steps = draw(st.integers(1, 60))
    spec = (steps, draw(st.integers(0, 2**16)), draw(st.booleans()))
    name = draw(st.sampled_from(names))
    budget = draw(st.integers(1, steps + 2))
    params = {p.name: draw(st.integers(0, budget - 1)) for p in kvsim.tunables(name)}
    return spec, name, budget, params


def run(make_trace, fit_args, case, **record):
    (steps, seed, ties), name, budget, params = case
    trace = with_members(make_trace(steps, seed=seed, ties=ties), seed, levels=2 if ties else 0)  # what scorers read
    try:
        kvsim.make_policy(name, budget=budget, trace=trace, **params)
    except ValueError:
        params = fit_args(name, budget, trace)
    return trace, params, kvsim.replay(trace, name, budget=budget, record_kept=True, **record, **params)


def kept_after(result, t):
    row = result.kept_history[t - 1]
    return row[row >= 0].tolist()


@SETTINGS
@given(case=cases())
def test_contract_and_metric_bounds_for_every_policy(make_trace, fit_args, case):
    trace, _, result = run(make_trace, fit_args, case, record_victims=True)  # the harness checks victims
    budget = result.budget
    for t in range(1, trace.steps + 1):
        kept = kept_after(result, t)
        assert len(kept) == min(t + 1, budget)
        assert kept == sorted(set(kept)) and kept[-1] <= t
    whole = 1 + rounding(trace.steps + 1)  # a whole row's float32 weights sum to 1 within one rounding each
    assert np.all(result.retained_mass_series >= 0) and np.all(result.retained_mass_series <= whole)
    assert np.all(result.top_k_recall_series >= 0) and np.all(result.top_k_recall_series <= 1)
    assert 0.0 <= result.retained_mass <= whole


@SETTINGS
@given(case=cases(names=("sliding_window",)))
def test_sliding_window_keeps_the_newest(make_trace, fit_args, case):
    trace, _, result = run(make_trace, fit_args, case)
    for t in range(1, trace.steps + 1):
        assert kept_after(result, t) == list(range(max(0, t + 1 - result.budget), t + 1))


@SETTINGS
@given(case=cases(names=("streaming_llm",)))
def test_streaming_llm_keeps_the_sinks_and_the_newest(make_trace, fit_args, case):
    trace, params, result = run(make_trace, fit_args, case)
    sinks, budget = params["sinks"], result.budget
    for t in range(1, trace.steps + 1):
        held = list(range(t + 1))
        expected = held if len(held) <= budget else held[:sinks] + held[len(held) - (budget - sinks) :]
        assert kept_after(result, t) == expected


def h2o_model(trace, budget, recent_window):
    """H2O from its card, written the slow obvious way: a dict of scores, eviction by sorting."""
    score = {0: 0.0}
    history = []
    for t in range(1, trace.steps + 1):
        kept = np.array(sorted(score))
        for p, w in zip(kept.tolist(), observe(trace.attention[t][kept]).tolist(), strict=True):
            score[p] += w  # float32 weight, float64 sum
        score[t] = 0.0
        order = sorted(score)
        evictable = order[: len(order) - recent_window]
        for p in sorted(evictable, key=lambda p: (score[p], p))[: max(0, len(order) - budget)]:
            del score[p]
        history.append(sorted(score))
    return history


@SETTINGS
@given(case=cases(names=("h2o",)))
def test_h2o_matches_its_card_and_keeps_the_recent_window(make_trace, fit_args, case):
    trace, params, result = run(make_trace, fit_args, case)
    rw = params["recent_window"]
    model = h2o_model(trace, result.budget, rw)
    for t in range(1, trace.steps + 1):
        kept = kept_after(result, t)
        assert set(range(max(0, t - rw + 1), t + 1)) <= set(kept)
        assert kept == model[t - 1]


@SETTINGS
@given(case=cases(), extra=st.integers(0, 3))
def test_a_budget_that_holds_everything_retains_everything(make_trace, fit_args, case, extra):
    (steps, seed, ties), name, _, params = case
    budget = steps + 1 + extra
    params = {p: min(v, budget - 1) for p, v in params.items()}
    _, _, result = run(make_trace, fit_args, ((steps, seed, ties), name, budget, params))
    # every row whole: its float32 weights sum to 1 within one rounding each, at most steps of them
    assert np.allclose(result.retained_mass_series, 1.0, rtol=0, atol=rounding(steps))
    assert np.all(result.top_k_recall_series == 1.0)

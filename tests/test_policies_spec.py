"""Typed parameters through the core: ``kvsim.replay``/``kvsim.sweep`` take a ``PolicySpec`` as
well as a name, make the spec and the policy once, and hand the spec back on the result; the engine
reads each policy through its ``engine_inputs`` hook."""

from __future__ import annotations

import numpy as np
import pytest

import kvsim
from kvsim.policies import PolicySpec


@pytest.fixture
def trace(make_trace):
    return make_trace(60, seed=4, ties=True)


@pytest.mark.parametrize("reference", [False, True])
def test_a_spec_replays_as_its_name_does_and_comes_back_on_the_result(trace, reference):
    spec = PolicySpec.of("h2o", 8, recent_window=3)
    by_spec = kvsim.replay(trace, spec, reference=reference, record_kept=True)
    by_name = kvsim.replay(trace, "h2o", budget=8, recent_window=3, reference=reference, record_kept=True)
    assert by_spec.summary() == by_name.summary()
    assert np.array_equal(by_spec.retained_mass_series, by_name.retained_mass_series)
    assert np.array_equal(by_spec.kept_history, by_name.kept_history)
    assert by_spec.spec == by_name.spec == spec
    # the name form's spec holds the defaults it left out: two ways of asking for one thing are equal
    assert kvsim.replay(trace, "scissorhands", budget=8, recent_window=3).spec == PolicySpec.of(
        "scissorhands", 8, recent_window=3, history_window=0)


def test_a_spec_carries_its_own_budget_and_parameters(trace):
    spec = PolicySpec.of("h2o", 8, recent_window=3)
    with pytest.raises(ValueError, match="PolicySpec carries its own"):
        kvsim.replay(trace, spec, budget=8)
    with pytest.raises(ValueError, match="PolicySpec carries its own"):
        kvsim.replay(trace, spec, recent_window=2)
    built = kvsim.make_policy("h2o", budget=8, recent_window=3)
    assert kvsim.replay(trace, built).spec is None  # a built instance: it may not be a registered one


def test_sweeping_a_spec_is_sweeping_its_name(trace):
    spec = PolicySpec.of("snapkv", 8, recent_window=2, observation_window=5)
    assert kvsim.sweep(trace, spec, param="recent_window", values=range(8)) == kvsim.sweep(
        trace, "snapkv", 8, "recent_window", range(8), observation_window=5)
    assert kvsim.sweep(trace, spec, param="budget", values=[3, 8, 20]) == kvsim.sweep(
        trace, "snapkv", 3, "budget", [3, 8, 20], recent_window=2, observation_window=5)
    assert kvsim.sweep(trace, spec) == [kvsim.replay(trace, spec).summary()]
    with pytest.raises(ValueError, match="recent_window must be less than budget"):
        kvsim.sweep(trace, spec, param="recent_window", values=[1, 8])
    with pytest.raises(ValueError, match="does not take parameter"):
        kvsim.sweep(trace, spec, param="sinks", values=[1])


@pytest.mark.parametrize("reference", [False, True])
def test_the_spec_is_made_once_and_the_policy_built_once(trace, reference, monkeypatch):
    made, built = [], []
    real_of, real_build = PolicySpec.of.__func__, PolicySpec.build

    def of(cls, *a, **kw):
        made.append(a)
        return real_of(cls, *a, **kw)

    def build(self, *a, **kw):
        built.append(self)
        return real_build(self, *a, **kw)

    monkeypatch.setattr(PolicySpec, "of", classmethod(of))
    monkeypatch.setattr(PolicySpec, "build", build)
    kvsim.replay(trace, "h2o", budget=8, recent_window=3, reference=reference)
    assert len(made) == 1 and len(built) == 1
    made.clear(), built.clear()
    kvsim.sweep(trace, "h2o", 8, "recent_window", range(5), reference=reference)
    assert len(made) == 5 and len(built) == 5


def test_make_policy_is_the_spec_built():
    assert repr(kvsim.make_policy("snapkv", 64, observation_window=3)) == repr(
        PolicySpec.of("snapkv", 64, observation_window=3).build())
    with pytest.raises(ValueError, match="does not take parameter") as by_name:
        kvsim.make_policy("h2o", 16, sinks=2)
    with pytest.raises(ValueError) as by_spec:
        PolicySpec.of("h2o", 16, sinks=2)
    assert str(by_name.value) == str(by_spec.value)

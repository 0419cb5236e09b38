"""The policy contract (docs/domain.md, "The policy interface"), for every policy in the registry.

Parametrised over ``kvsim.POLICIES`` at collection time, so a policy that joins the registry is
covered without touching this file. Offline policies (``needs_trace``) get the trace.
"""

from __future__ import annotations

import numpy as np
import pytest
from random_traces import with_members
from tolerance import rounding

import kvsim
from kvsim.data import vectors
from kvsim.sim.harness import observe

NAMES = list(kvsim.POLICIES)
BUDGETS = [1, 2, 3, 5, 16, 40]


def build(fit_args, name, budget, trace, rng=None, **params):
    return kvsim.make_policy(name, budget=budget, rng=rng, trace=trace, **fit_args(name, budget, trace, **params))


def drive(policy, trace, attention="observed"):
    """Run ``policy`` over ``trace`` the way the harness does, checking the contract at every step.

    ``attention``: "observed" (the row renormalised over kept), None (no information), or "poison"
    (an object that fails the test if it is read at all). Returns (kept after each step, victims).
    """
    kept_history, victims_history = [], []
    hand_over(policy, trace, 0)
    for t in range(1, trace.steps + 1):
        hand_over(policy, trace, t)
        before = np.asarray(policy.kept)
        assert before.ndim == 1 and np.all(np.diff(before) > 0), f"step {t}: kept {before} not ascending"
        assert before.size == 0 or before[-1] < t, f"step {t}: holds a position >= {t}"
        if attention == "observed":
            attn = observe(trace.attention[t][before])
        elif attention == "poison":
            attn = Poison()
        else:
            attn = None
        policy.on_decode_step(t, attn)
        admitted = np.asarray(policy.kept)
        # the call admits t and evicts nothing: eviction is the harness's separate request
        assert admitted.tolist() == [*before.tolist(), t], f"step {t}: on_decode_step changed more than admitting {t}"
        assert admitted.size <= policy.budget + 1
        victims = policy.evict(policy.budget)
        after = np.asarray(policy.kept)
        assert isinstance(victims, list)
        assert all(isinstance(v, (int, np.integer)) for v in victims)
        assert victims == sorted(set(victims)), f"step {t}: victims {victims} not strictly ascending"
        assert set(victims) <= set(admitted.tolist()), f"step {t}: victims {victims} were not held"
        assert after.size == min(t + 1, policy.budget), f"step {t}: holds {after.size}"
        assert sorted(set(after.tolist()) | set(victims)) == admitted.tolist(), f"step {t}: cache changed otherwise"
        kept_history.append(after.tolist())
        victims_history.append(list(victims))
    return kept_history, victims_history


def hand_over(policy, trace, pos):
    """What the harness does before admitting ``pos``: position ``pos``'s rows of the members the policy
    reads besides attention (keys, values, ...), handed to ``see``; nothing for a policy that reads none."""
    if policy.reads:
        policy.see(pos, vectors.at(vectors.require(trace, policy.reads, policy.name), pos))


class Poison:
    """Stands in for the attention vector of a policy that must never read it."""

    def __getattribute__(self, name):
        pytest.fail(f"a policy that does not read attention touched attn.{name}")

    def __array__(self, *args, **kwargs):
        pytest.fail("a policy that does not read attention converted attn to an array")

    def __len__(self):
        pytest.fail("a policy that does not read attention asked len(attn)")

    def __getitem__(self, key):
        pytest.fail("a policy that does not read attention indexed attn")

    def __iter__(self):
        pytest.fail("a policy that does not read attention iterated attn")


@pytest.fixture(scope="module")
def trace(make_trace):
    return with_members(make_trace(90, seed=11), 11)


@pytest.fixture(scope="module")
def tie_trace(make_trace):
    return with_members(make_trace(60, seed=5, ties=True), 5, levels=2)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("budget", [1, 2, 7, 512])
def test_starts_holding_position_zero(name, budget, trace, fit_args):
    policy = build(fit_args, name, budget, trace)
    assert np.asarray(policy.kept).tolist() == [0]
    assert policy.budget == budget


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("budget", BUDGETS)
def test_budget_respected_and_victims_contract(name, budget, trace, tie_trace, fit_args):
    for tr in (trace, tie_trace):
        kept, victims = drive(build(fit_args, name, budget, tr), tr)
        assert sum(map(len, victims)) == max(0, tr.steps + 1 - budget)  # every surplus position went


@pytest.mark.parametrize("name", NAMES)
def test_replay_harness_accepts_every_policy(name, trace, fit_args):
    """The harness's own contract checks pass, and its kept history is what the policy held."""
    params = fit_args(name, 16, trace)
    result = kvsim.replay(trace, name, budget=16, record_kept=True, record_victims=True, **params)
    kept, victims = drive(build(fit_args, name, 16, trace), trace)
    for t, k in enumerate(kept):
        row = result.kept_history[t]
        assert row[row >= 0].tolist() == k
    assert result.victims_history == victims
    assert 0.0 <= result.retained_mass <= 1.0 + rounding(trace.steps + 1)  # a whole row's float32 weights sum to 1 within this
    assert 0.0 <= result.top_k_recall <= 1.0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("budget", [3, 20])
def test_deterministic(name, budget, trace, tie_trace, fit_args):
    for tr in (trace, tie_trace):
        first = drive(build(fit_args, name, budget, tr, rng=np.random.default_rng(3)), tr)
        second = drive(build(fit_args, name, budget, tr, rng=np.random.default_rng(3)), tr)
        assert first == second


@pytest.mark.parametrize("name", NAMES)
def test_rng_accepted_and_untouched_by_deterministic_policies(name, trace, fit_args):
    rng = np.random.default_rng(1234)
    state = rng.bit_generator.state
    policy = build(fit_args, name, 12, trace, rng=rng)
    drive(policy, trace)
    if not getattr(type(policy), "uses_rng", False):  # a policy that draws says so with uses_rng = True
        assert rng.bit_generator.state == state, f"{name} drew from its rng"


@pytest.mark.parametrize("name", NAMES)
def test_none_attention_runs_the_whole_contract(name, trace, fit_args):
    drive(build(fit_args, name, 10, trace), trace, attention=None)


@pytest.mark.parametrize("name", [n for n in NAMES if not kvsim.POLICIES[n].reads_attention])
def test_policies_that_do_not_read_attention_never_touch_it(name, trace, fit_args):
    poisoned = drive(build(fit_args, name, 10, trace), trace, attention="poison")
    blind = drive(build(fit_args, name, 10, trace), trace, attention=None)
    seen = drive(build(fit_args, name, 10, trace), trace)
    assert poisoned == blind == seen


# (a score from the keys or queries, expected_attention's, moves with every position admitted: no attention to leave out)
@pytest.mark.parametrize("name", [n for n in NAMES if kvsim.POLICIES[n].keeps_scores and kvsim.POLICIES[n].reads_attention])
def test_none_attention_leaves_scores_unchanged(name, trace, fit_args):
    policy = build(fit_args, name, 24, trace)
    hand_over(policy, trace, 0)
    for t in range(1, 40):  # real attention first, so there are scores to disturb
        hand_over(policy, trace, t)
        policy.on_decode_step(t, observe(trace.attention[t][policy.kept]))
        policy.evict(policy.budget)
    for t in range(40, 46):
        kept, scores = policy.kept.copy(), np.asarray(policy.scores).copy()
        hand_over(policy, trace, t)
        policy.on_decode_step(t, None)
        assert policy.kept.tolist() == [*kept.tolist(), t]
        # bit for bit: None is "no information", not a vector of zeros added in some other order
        assert np.array_equal(np.asarray(policy.scores)[:-1], scores)
        victims = policy.evict(policy.budget)
        survivors = ~np.isin(kept, victims)
        assert np.array_equal(np.asarray(policy.scores)[: survivors.sum()], scores[survivors])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("budget", [0, -1, -512])
def test_refuses_budget_below_one(name, budget, trace):
    with pytest.raises(ValueError, match="budget"):
        kvsim.make_policy(name, budget=budget, trace=trace)


@pytest.mark.parametrize("name", NAMES)
def test_refuses_unknown_parameter(name, trace):
    with pytest.raises(ValueError, match="window_size_typo"):
        kvsim.make_policy(name, budget=64, window_size_typo=3, trace=trace)


@pytest.mark.parametrize(
    ("name", "param"),
    [
        (n, p.name) for n in NAMES for p in kvsim.tunables(n)
    ],
)
def test_refuses_negative_integer_parameters(name, param, trace):
    with pytest.raises(ValueError, match=param):
        kvsim.make_policy(name, budget=64, **{param: -1}, trace=trace)


@pytest.mark.parametrize(("name", "param"), [(n, p) for n in NAMES for p in kvsim.tunables(n) if p.below_budget])
def test_the_registry_bounds_are_the_policies_own(name, param, trace, fit_args):
    """What the registry lists as the largest value at a budget is accepted, one more is refused:
    the CLI and the app read these bounds, so they must be the ones the policy enforces. The policy's
    other parameters are fitted to the budget (vatp's recent_window 32 while its sinks are tried at 16)."""
    top = param.upper(16)
    others = {k: v for k, v in fit_args(name, 16, trace, **{param.name: 0}).items() if k != param.name}
    assert kvsim.make_policy(name, budget=16, trace=trace, **others, **{param.name: top}).params[param.name] == top
    with pytest.raises(ValueError, match=param.name):
        kvsim.make_policy(name, budget=16, trace=trace, **others, **{param.name: top + 1})


def test_offline_references_refuse_to_be_built_without_the_trace():
    offline = [n for n, cls in kvsim.POLICIES.items() if cls.needs_trace]
    assert offline
    for name in offline:
        with pytest.raises(ValueError, match="trace"):
            kvsim.make_policy(name, budget=8)


@pytest.mark.parametrize(
    ("name", "param", "budget", "value"),
    [
        ("h2o", "recent_window", 32, 32),  # the default at a budget that cannot hold it
        ("h2o", "recent_window", 64, 100),
        ("h2o", "recent_window", 1, 1),
        ("h2o", "recent_window", 64, -1),
        ("streaming_llm", "sinks", 4, 4),  # the default at budget 4: nothing left to slide
        ("streaming_llm", "sinks", 8, 9),
        ("streaming_llm", "sinks", 1, 1),
        ("streaming_llm", "sinks", 8, -2),
    ],
)
def test_reference_policies_refuse_their_parameters(name, param, budget, value):
    with pytest.raises(ValueError, match=param):
        kvsim.make_policy(name, budget=budget, **{param: value})


@pytest.mark.parametrize("budget", [1.5, "8", True, None])
@pytest.mark.parametrize("name", ["sliding_window", "streaming_llm", "h2o"])
def test_refuses_a_budget_that_is_not_an_integer(name, budget):
    with pytest.raises(ValueError, match="budget"):
        kvsim.make_policy(name, budget=budget)


def test_largest_legal_parameters_are_accepted():
    assert kvsim.make_policy("h2o", budget=8, recent_window=7).params == {"recent_window": 7}
    assert kvsim.make_policy("streaming_llm", budget=8, sinks=7).params == {"sinks": 7}
    assert kvsim.make_policy("h2o", budget=8, recent_window=0).params == {"recent_window": 0}
    assert kvsim.make_policy("streaming_llm", budget=8, sinks=0).params == {"sinks": 0}


def test_defaults_are_the_cards():
    assert kvsim.DEFAULT_BUDGET == 256
    assert kvsim.make_policy("sliding_window").budget == 256
    assert kvsim.policy_params("h2o") == {"recent_window": 32}
    assert kvsim.policy_params("streaming_llm") == {"sinks": 4}
    assert kvsim.policy_params("sliding_window") == {}


def test_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="no_such_policy"):
        kvsim.make_policy("no_such_policy")


class _OutOfOrder(kvsim.Policy):
    """A broken policy: evicts two positions at once and returns them newest first."""

    name = "out_of_order_for_test"

    def __init__(self, budget=3, rng=None):
        super().__init__(budget, rng)
        self._kept = [0]

    @property
    def kept(self):
        return np.asarray(self._kept, dtype=np.int64)

    def on_decode_step(self, pos, attn):
        self._kept.append(pos)

    def evict(self, budget):
        if len(self._kept) <= budget:
            return []
        victims, self._kept = self._kept[:2], self._kept[2:]
        return victims[::-1]


class _Hoarder(_OutOfOrder):
    """A broken policy: never evicts."""

    def evict(self, budget):
        return []


@pytest.mark.parametrize(("cls", "problem"), [(_OutOfOrder, "ascending"), (_Hoarder, "holds 4 positions")])
def test_harness_catches_a_policy_that_breaks_the_contract(cls, problem, make_trace):
    with pytest.raises(kvsim.ContractError, match=problem):
        kvsim.replay(make_trace(12, seed=2), cls(budget=3))

"""One place per policy (issue 32, point 1): a policy is one module, registered through
``kvsim.policies.register``; the CLI, the app's lists, the curve's styles and the engine read it off the
registry with nothing else edited, and a policy with no kernel replays through the reference."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap

import numpy as np
import pytest
from random_traces import random_trace

import kvsim
from kvsim import cli
from kvsim.cli.parser import build_parser
from kvsim.data.trace import save_npz
from kvsim.policies import POLICIES, Display, EngineBinding, register
from kvsim.sim import engine
from kvsim.views.figures import curve as curve_figures
from kvsim.views.figures import scores as score_figures

#: a whole policy, as a user would write it in a file of their own: reference code, parameters and
#: display in one module, no kernel (the engine falls back to the reference harness)
NEW_POLICY = '''
"""Least recently attended: evict the position that last drew more than a fair share (1/n of the
kept mass) longest ago; the newest recent_window positions are never evicted. Ties: the lower position."""

import numpy as np

from kvsim.policies import Display, register
from kvsim.policykit.base import DEFAULT_BUDGET, SlotPolicy
from kvsim.policies.h2o import RECENT_WINDOW


@register
class LeastRecentlyAttended(SlotPolicy):
    name = "least_recently_attended"
    summary = "evict the position that last drew more than a fair share longest ago"
    reads_attention = True
    tunables = (RECENT_WINDOW,)
    window = RECENT_WINDOW.name
    display = Display("#17a589", "6px,2px,2px,2px", 3, "square", score_name="step of the last fair share")

    def __init__(self, budget=DEFAULT_BUDGET, rng=None, recent_window=RECENT_WINDOW.default):
        super().__init__(budget, rng)
        self.recent_window = RECENT_WINDOW.check(recent_window, self.budget)
        self._last = np.zeros(self.budget + 1, dtype=np.int64)

    def _slot_arrays(self):
        return [self._last]

    def on_decode_step(self, pos, attn):
        attn = self._step_attention(attn)
        n = self._len
        if attn is not None:
            self._last[:n][attn.astype(np.float32) > np.float32(1.0 / n)] = pos
        self._last[self._admit(pos)] = pos

    def evict(self, budget):
        return self._evict_lowest(budget, self._last[: max(self._len - self.recent_window, 0)])
'''


def _import_file(path, module_name):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def registered(tmp_path):
    """The module above, written to a file and imported: its ``@register`` is the only hook used."""
    path = tmp_path / "least_recently_attended.py"
    path.write_text(textwrap.dedent(NEW_POLICY))
    module = _import_file(path, "kvsim_test_least_recently_attended")
    yield module.LeastRecentlyAttended
    POLICIES.pop("least_recently_attended", None)
    sys.modules.pop("kvsim_test_least_recently_attended", None)


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.npz"
    save_npz(random_trace(60, seed=5), path)
    return path


def test_a_policy_registered_from_one_module_is_in_the_cli_and_replays(registered, small, capsys):
    name = registered.name
    replay = build_parser()._subparsers._group_actions[0].choices["replay"]
    choices = next(a.choices for a in replay._actions if "--policy" in a.option_strings)
    assert name in choices
    assert cli.main(["replay", "--trace", str(small), "--policy", name, "--budget", "8", "--recent-window", "2",
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    want = kvsim.replay(kvsim.load_trace(small), name, budget=8, recent_window=2, reference=True).summary()
    assert doc["policy"] == name and doc["retained_mass"] == want["retained_mass"]
    assert cli.main(["sweep", "--trace", str(small), "--policy", name, "--budget", "8", "--recent-window", "1:7",
                     "--json"]) == 0
    assert [row["recent_window"] for row in json.loads(capsys.readouterr().out)] == list(range(1, 8))


def test_a_policy_without_a_kernel_replays_through_the_reference(registered, monkeypatch):
    trace = random_trace(80, seed=9)
    assert registered.name not in engine.FAST and not engine.covers(trace, registered.name)
    assert engine.on_disk(registered.name)  # nothing to compile: the app's warm-up has no job for it
    engine.prepare(registered.name)  # and preparing it is nothing
    want = kvsim.replay(trace, registered.name, budget=10, recent_window=3, reference=True, record_victims=True)
    monkeypatch.setattr(engine, "run", lambda *a, **k: pytest.fail("the engine ran a policy it has no kernel for"))
    got = kvsim.replay(trace, registered.name, budget=10, recent_window=3, record_victims=True)
    assert got.summary() == want.summary() and got.victims_history == want.victims_history
    assert sum(map(len, got.victims_history)) == trace.steps + 1 - 10  # it did evict, one a step once full
    rows = kvsim.sweep(trace, registered.name, 10, "recent_window", [0, 3, 9])
    assert rows[1] == want.summary()


def test_a_registered_policy_is_in_the_apps_lists_and_the_curves_styles(registered):
    from kvsim.app import state

    name = registered.name
    assert name in state.curve_policies()  # it has a recent_window: the curve and the model view sweep it
    assert name in kvsim.POLICIES and name not in state.dense_only()
    assert curve_figures.style_of(name) == registered.display
    assert curve_figures.POLICY_STYLES[name] == registered.display
    assert score_figures.score_name(name) == "step of the last fair share"


def test_a_registered_policy_can_bind_an_existing_kernel(tmp_path):
    """A policy that replays with a kernel already there names it in its binding: the engine runs it,
    bit for bit the reference."""
    path = tmp_path / "h2o_again.py"
    path.write_text(textwrap.dedent('''
        from kvsim.policies import Display, EngineBinding, register
        from kvsim.policies.h2o import H2O

        @register
        class H2OAgain(H2O):
            name = "h2o_again"
            display = Display("#5d6d7e", "solid", 2, "square")
            engine_binding = EngineBinding("kvsim.policies.h2o:STEPS")
        '''))
    _import_file(path, "kvsim_test_h2o_again")
    try:
        trace = random_trace(90, seed=4)
        assert "h2o_again" in engine.FAST and engine.covers(trace, "h2o_again") == engine.AVAILABLE
        kw = dict(budget=12, recent_window=4, record_kept=True, record_scores=True, record_victims=True)
        fast, ref = kvsim.replay(trace, "h2o_again", **kw), kvsim.replay(trace, "h2o_again", reference=True, **kw)
        assert np.array_equal(fast.retained_mass_series, ref.retained_mass_series)
        assert np.array_equal(fast.score_history, ref.score_history, equal_nan=True)
        assert fast.victims_history == ref.victims_history
    finally:
        POLICIES.pop("h2o_again", None)
        sys.modules.pop("kvsim_test_h2o_again", None)


def test_register_refuses_what_would_break_a_table_in_one_line():
    from kvsim.policies.h2o import H2O

    class Taken(H2O):
        name = "h2o"

    class BadName(H2O):
        name = "Not A Name"

    class BadDisplay(H2O):
        name = "bad_display"
        display = ("#000000", "solid", 2)

    for cls, words in ((Taken, "taken by kvsim.policies.h2o.H2O"), (BadName, "not a lower-case identifier"),
                       (BadDisplay, "display must be a Display"), (int, "not a subclass")):
        with pytest.raises(ValueError, match=words) as e:
            register(cls)
        assert "\n" not in str(e.value)
    assert POLICIES["h2o"] is H2O and "bad_display" not in POLICIES


def test_an_engine_binding_that_names_no_kernel_fails_by_the_policys_name():
    from kvsim.policies.h2o import H2O

    class Unbound(H2O):
        name = "unbound_h2o"
        display = None  # h2o's colour is h2o's: register refuses it
        engine_binding = EngineBinding("kvsim.sim.kernels:NO_SUCH_KERNEL")

    register(Unbound)
    try:
        with pytest.raises(ValueError, match="policy 'unbound_h2o': engine_binding 'kvsim.sim.kernels:NO_SUCH_KERNEL'"):
            engine.FAST["unbound_h2o"]
    finally:
        POLICIES.pop("unbound_h2o")


def test_every_table_of_policies_is_read_off_the_registry():
    """The engine's, the curve's and the scores' tables hold exactly what the classes declare."""
    assert set(engine.FAST) == {n for n, c in POLICIES.items() if c.engine_binding is not None}
    assert dict(curve_figures.POLICY_STYLES) == {n: c.display for n, c in POLICIES.items() if c.display is not None}
    for name, cls in POLICIES.items():
        assert score_figures.score_name(name) == (cls.display or Display("", "", 0)).score_name

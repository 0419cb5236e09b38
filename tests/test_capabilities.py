"""What a policy can do, declared once on its class and answered by the registry (issue 55, item 1): one query
per capability answers for every policy; a run that needs what a policy does not declare is refused in one line
naming the policy and the capability before any trace or model loads; ``register`` refuses a colour that is
taken. The plugin is docs/architecture.md's own ("Adding a policy"), which declares every capability."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import textwrap

import numpy as np
import pytest
from random_traces import random_trace
from test_plugins import NEWEST, kvsim_cli

import kvsim
from kvsim.policies import POLICIES, Capabilities, Display, Policy, register
from kvsim.policykit import registry
from kvsim.policykit.layouts import Layout, LayoutError
from kvsim.sim.layered import replay_layer

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
#: the page's plugin with its layout score taken back: everything else declared as the page declares it
NO_LAYOUT = (textwrap.dedent(NEWEST).replace("layout_score = True", "layout_score = False")
             .replace('name = "newest"', 'name = "newest_unpaged"').replace("#6a3d9a", "#6a3d9b"))
REFUSED = "newest_unpaged declares no layout score (layout_score: layout_priorities() and layout_drop())"


def _load(tmp_path, text: str, stem: str):
    path = tmp_path / f"{stem}.py"
    path.write_text(text)
    registry.load_plugin(str(path))
    return path


@pytest.fixture
def plugins(tmp_path):
    """The page's plugin (``newest``) and the one without a layout score (``newest_unpaged``), loaded here."""
    paths = (_load(tmp_path, textwrap.dedent(NEWEST), "newest"), _load(tmp_path, NO_LAYOUT, "newest_unpaged"))
    yield paths
    for name in ("newest", "newest_unpaged"):
        POLICIES.pop(name, None)
        sys.modules.pop(f"kvsim_plugin_{name}", None)


QUERIES = {"window": registry.window_param, "layout_score": registry.layout_ready, "pools_heads": registry.can_pool,
           "reads_meta": registry.reads_meta, "offline": registry.is_offline, "optimum": registry.is_optimum,
           "engine": registry.has_engine, "tensor": lambda n: registry.tensor_step(n) is not None,
           "needs_model": registry.needs_model, "walks": lambda n: registry.walks_prompt(n) is not None}


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_capability_query_answers_for_every_policy(name):
    """One query per capability, each the class's declaration, of its type, and backed by its code."""
    cls, caps = POLICIES[name], registry.capabilities(name)
    assert isinstance(caps, Capabilities)
    assert set(QUERIES) == {f.name for f in dataclasses.fields(Capabilities)}
    for field, query in QUERIES.items():
        assert query(name) == getattr(caps, field), field
        assert isinstance(query(name), str if field == "window" else bool) or query(name) is None, field
    assert caps.window is None or caps.window in {p.name for p in cls.tunables}
    assert (name in registry.windowed()) == (caps.window is not None)
    assert (name in registry.poolers()) == caps.pools_heads
    assert (name in registry.online()) != caps.offline and (name in registry.offline()) == caps.offline
    assert not caps.optimum or caps.offline
    if caps.layout_score:
        assert cls.layout_priorities is not Policy.layout_priorities and cls.layout_drop is not Policy.layout_drop
    assert (registry.tensor_step(name) is cls.tensor_step) and (caps.engine == (cls.engine_binding is not None))


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_layout_takes_every_online_policy_with_a_layout_score_and_the_optimum_under_blocks(name):
    blocks, intervals = Layout(block_size=4), Layout(evict_every=2)
    ok = registry.layout_ready(name) and not registry.is_offline(name) or registry.is_optimum(name)
    if ok:
        blocks.check(name, 64)
    else:
        with pytest.raises(LayoutError) as e:
            blocks.check(name, 64)
        assert name in str(e.value) and "\n" not in str(e.value)
    if registry.is_offline(name):
        with pytest.raises(LayoutError):
            intervals.check(name, 64)


def test_register_refuses_a_walk_without_engine_hooks_in_one_line():
    """A tensor step that declares ``walk`` steps the class's engine hooks: a class without them is refused."""
    import dataclasses

    class NoEngine(Policy):
        name = "walks_without_engine"
        tensor_step = dataclasses.replace(POLICIES["h2o"].tensor_step, name="walks_without_engine")

    with pytest.raises(ValueError) as e:
        register(NoEngine)
    assert str(e.value) == ("register: NoEngine.tensor_step declares walk, which steps its engine hooks: give it "
                            "an engine_binding")
    assert "walks_without_engine" not in POLICIES


def test_register_refuses_a_walk_map_without_functions_in_one_line():
    """A ``WalkMap`` (snapkv's: its engine keeps ring rows) reads the tensor state in and writes it back: both must be
    functions."""
    import dataclasses

    from kvsim.policykit.tensor_hooks import WalkMap

    class HalfMap(Policy):
        name = "walks_by_half_a_map"
        engine_binding = POLICIES["snapkv"].engine_binding
        tensor_step = dataclasses.replace(POLICIES["snapkv"].tensor_step, name="walks_by_half_a_map",
                                          walk=WalkMap(POLICIES["snapkv"].tensor_step.walk.read, None))

    with pytest.raises(ValueError) as e:
        register(HalfMap)
    assert str(e.value) == "register: HalfMap.tensor_step.walk: a WalkMap's read and write must be functions"
    assert "walks_by_half_a_map" not in POLICIES


def test_register_refuses_a_walk_of_a_class_that_reads_vectors_without_its_rows_in_one_line():
    """A class that reads vectors (vatp: values) walks with one engine state per (row, KV head), each handed its rows
    of every call by ``walk_rows``: a walk without it is refused."""
    import dataclasses

    class NoRows(Policy):
        name = "walks_without_rows"
        reads = ("values",)
        engine_binding = POLICIES["vatp"].engine_binding
        tensor_step = dataclasses.replace(POLICIES["vatp"].tensor_step, name="walks_without_rows", walk_rows=None)

    with pytest.raises(ValueError) as e:
        register(NoRows)
    assert str(e.value) == ("register: NoRows.tensor_step declares walk, and walks_without_rows reads values: give it "
                            "walk_rows, which puts a call's rows into the engine's state")
    assert "walks_without_rows" not in POLICIES


def test_register_refuses_a_colour_another_policy_has_in_one_line():
    class Copy(Policy):
        name = "copy_of_h2o_colour"
        display = Display(POLICIES["h2o"].display.colour.upper(), "1px,9px", 1)

    with pytest.raises(ValueError) as e:
        register(Copy)
    assert str(e.value) == (f"register: Copy.display's colour {Copy.display.colour} is h2o's; give it a colour no "
                            "other policy has")
    assert "copy_of_h2o_colour" not in POLICIES
    shipped = [c.display.colour.lower() for c in POLICIES.values() if c.display is not None]
    assert len(shipped) == len(set(shipped))


def test_register_holds_each_declaration_to_its_code():
    class NoMethods(Policy):
        name = "declares_a_layout_score_only"
        layout_score = True

    class NoSuchWindow(Policy):
        name = "declares_a_window_it_lacks"
        window = "recent_window"

    class PoolsNoWindow(Policy):
        name = "pools_without_a_window"
        pools_heads = True

    for cls, words in ((NoMethods, "declares layout_score but defines no layout_priorities()"),
                       (NoSuchWindow, "window 'recent_window' is none of its tunables"),
                       (PoolsNoWindow, "declares pools_heads, which protects its window in every head")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
            register(cls)
        assert "\n" not in str(e.value) and cls.name not in POLICIES


def test_a_plugin_without_a_layout_score_is_refused_by_replay_before_the_trace_loads(tmp_path):
    """``--block-size 16``: one line naming the policy and the capability; the trace, a file that is no trace at
    all, is never read (its own error would be another line)."""
    plugin = tmp_path / "newest_unpaged.py"
    plugin.write_text(NO_LAYOUT)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a trace")
    done = kvsim_cli("replay", "--trace", str(junk), "--policy", "newest_unpaged", "--budget", "64", "--block-size",
                     "16", plugins=str(plugin), check=False)
    assert done.returncode != 0
    assert done.stderr.splitlines() == [f"kvsim: error: --block-size 16: {REFUSED}: a serving layout (block_size=16) "
                                        "cannot run it"]


def test_the_pages_plugin_runs_in_every_layout_as_sliding_window(plugins):
    """It declares its layout score: blocks, intervals, both, and shared selection over a layer's heads give
    sliding_window's figures, position for position."""
    trace = random_trace(120, seed=5)
    for layout in (Layout(block_size=8), Layout(evict_every=4), Layout(block_size=4, evict_every=3)):
        got = {p: kvsim.replay(trace, p, budget=32, layout=layout, record_kept=True) for p in ("newest", "sliding_window")}
        assert np.array_equal(got["newest"].retained_mass_series, got["sliding_window"].retained_mass_series), layout
        assert all(np.array_equal(x, y) for x, y in zip(got["newest"].kept_history, got["sliding_window"].kept_history,
                                                         strict=True)), layout
    heads = [random_trace(120, seed=s) for s in (6, 7)]
    shared = Layout(block_size=4, shared_selection=True)
    a, b = (replay_layer(heads, kvsim.PolicySpec.of(p, 32), shared) for p in ("newest", "sliding_window"))
    assert a["retained_mass"] == b["retained_mass"] and a["top_k_recall"] == b["top_k_recall"]
    with pytest.raises(LayoutError, match=r"newest_unpaged declares no layout score \(layout_score"):
        kvsim.replay(trace, "newest_unpaged", budget=32, layout=Layout(block_size=8))


@pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (the record extra)")
def test_the_deployed_cache_refuses_a_plugin_without_a_layout_score_and_runs_the_pages(plugins):
    """``kvsim.hf.cache(..., block_size=4)``: an HFError in one line naming the capability, from the call itself
    (nothing decoded); the page's plugin decodes the tokens sliding_window decodes under the same layout."""
    from test_hf import _prompt, _tiny

    import kvsim.hf as hf

    model, ids = _tiny("llama"), _prompt()
    with pytest.raises(hf.HFError) as e:
        hf.cache(model, "newest_unpaged", 12, block_size=4)
    assert type(e.value) is hf.HFError and not isinstance(e.value, LayoutError)
    assert str(e.value) == f"block_size=4: {REFUSED}: a serving layout (block_size=4) cannot run it"
    out = {}
    for name in ("newest", "sliding_window"):
        cache = hf.cache(model, name, 12, block_size=4)
        out[name] = model.generate(ids, cache=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0].tolist()
    assert out["newest"] == out["sliding_window"]


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_specs_window_is_its_declared_parameters_value(name):
    """``spec.window``: the value of the parameter the policy declares as its window (``spec.params.recent_window``),
    None for a policy without one."""
    spec = kvsim.PolicySpec.of(name, 64)
    param = registry.window_param(name)
    assert spec.window == (None if param is None else dict(spec.params)[param])
    if param is not None:
        assert spec.replace(**{param: 5}).window == 5 == spec.replace(**{param: 5}).params.recent_window

"""The first start of a brand-new install: the page is drawn on the reference and
NumPy paths while numba compiles the fast engine elsewhere, says so in one line, and uses the engine
once it is compiled. Each test imports what it tests inside itself, so each fails on its own on the
code before the fix."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

import kvsim

APP = str(Path(__file__).resolve().parent.parent / "app.py")
DEFAULT = ("sliding_window", "streaming_llm", "h2o")


def _fresh_app(monkeypatch, compiled: set[str], on_disk: bool) -> list:
    """The app's caches emptied (so the page replays again), ``compiled`` the kernels this process
    has, ``on_disk`` whether numba's disk cache holds the rest; returns the list that records what
    the page asks the warm-up to compile (nothing is compiled: no thread, no child process)."""
    import streamlit as st

    from kvsim import jit
    from kvsim.app import services
    from kvsim.sim import engine
    from kvsim.views.figures import pooling

    st.cache_resource.clear()
    # raising=False: on the code before the fix these are not there, and the page's own behaviour fails the test
    monkeypatch.setattr(jit, "_compiled", set(compiled), raising=False)
    monkeypatch.setattr(engine, "on_disk", lambda name: on_disk, raising=False)
    monkeypatch.setattr(pooling, "on_disk", lambda: on_disk, raising=False)
    wanted: list = []
    if hasattr(services, "Warmup"):
        monkeypatch.setattr(services.Warmup, "want", lambda self, names: wanted.append(list(names)))
        monkeypatch.setattr(services.Warmup, "load", lambda self, names: None)
    return wanted


def _kept_images(at: AppTest) -> list[str]:
    (kept,) = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    return [t["name"] for t in kept["data"] if t["type"] == "image" and t["name"] in kvsim.POLICIES]


def test_a_brand_new_install_draws_the_default_view_without_any_kernel_and_says_why(monkeypatch):
    """Nothing compiled, nothing on disk: the kept view of the three default policies is drawn, no
    kernel is called (the engine's passes, the top-k kernel and the pooling kernels all raise), one
    line says that the fast engine is compiling and for about how long, and once the page is drawn
    the warm-up is asked for exactly what the page uses."""
    from kvsim.data import derived
    from kvsim.sim import engine
    from kvsim.views.figures import pooling

    wanted = _fresh_app(monkeypatch, compiled=set(), on_disk=False)

    def no_kernel(*a, **k):
        raise AssertionError("a kernel was called on the first page of a brand-new install")

    for module, name in ((engine, "run"), (derived, "_topk_positions"), (pooling, "_pool_kept"), (pooling, "_exists")):
        monkeypatch.setattr(module, name, no_kernel)
    at = AppTest.from_file(APP, default_timeout=120).run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    assert _kept_images(at) == list(DEFAULT)
    notes = [i.value for i in at.info if "fast engine" in i.value]
    assert len(notes) == 1, [i.value for i in at.info]
    assert notes[0].startswith("Compiling the fast engine once for this install (about ")
    assert " s)" in notes[0] and "reference path" in notes[0] and "\n" not in notes[0]
    assert wanted == [[*DEFAULT, "pooling", "h2o"]]


def test_once_compiled_the_page_uses_the_engine_and_says_nothing(monkeypatch):
    """Every kernel compiled in this process: the replays go through the engine and the pooling
    through its kernels, and no note is shown."""
    from kvsim.sim import engine
    from kvsim.views.figures import pooling

    groups = {f"engine.{n}.float32" for n in engine.FAST} | {pooling.KERNELS}
    wanted = _fresh_app(monkeypatch, compiled=groups, on_disk=True)
    runs, pooled = [], []
    real_run, real_pool = engine.run, pooling._pool_panel_fast
    monkeypatch.setattr(engine, "run", lambda trace, policies, *a, **k: runs.append(policies[0].name) or
                        real_run(trace, policies, *a, **k))
    monkeypatch.setattr(pooling, "_pool_panel_fast", lambda *a, **k: pooled.append(1) or real_pool(*a, **k))
    at = AppTest.from_file(APP, default_timeout=120).run()
    assert [e.value for e in at.exception] == []
    assert _kept_images(at) == list(DEFAULT)
    assert sorted(runs) == sorted(DEFAULT) and len(pooled) == 3
    assert [i.value for i in at.info if "fast engine" in i.value] == [] and wanted == []


def test_a_replay_inside_compiled_only_takes_the_reference_path_until_the_engine_is_compiled(monkeypatch):
    """``kvsim.replay`` inside ``jit.compiled_only()``: the reference harness while the policy's
    kernels are neither compiled in this process nor in numba's disk cache, the engine once they are
    either; outside it, the engine always. The two results are the same, bit for bit, in every array
    the views read."""
    from kvsim import jit
    from kvsim.sim import engine, simulate

    if not jit.AVAILABLE:
        pytest.skip("no numba: every replay is a reference one")
    trace = kvsim.from_array(np.tril(np.random.default_rng(3).random((120, 120)), -1))
    monkeypatch.setattr(jit, "_compiled", set())
    on_disk = {"h2o": False}
    monkeypatch.setattr(engine, "on_disk", lambda name: on_disk.get(name, True))
    paths = []
    real = simulate.replay_reference
    monkeypatch.setattr(simulate, "replay_reference", lambda *a, **k: paths.append("reference") or real(*a, **k))
    with jit.compiled_only():
        assert not engine.ready(trace, "h2o")
        ref = kvsim.replay(trace, "h2o", budget=16, recent_window=4, record_kept=True, record_scores=True)
    assert paths == ["reference"]
    fast = kvsim.replay(trace, "h2o", budget=16, recent_window=4, record_kept=True, record_scores=True)  # outside: the engine
    assert paths == ["reference"] and jit.compiled("engine.h2o.float32")
    with jit.compiled_only():
        assert engine.ready(trace, "h2o")
        again = kvsim.replay(trace, "h2o", budget=16, recent_window=4, record_kept=True, record_scores=True)
    assert paths == ["reference"]
    monkeypatch.setattr(jit, "_compiled", set())  # not compiled here, but on disk: loading is cheap, so the engine
    on_disk["h2o"] = True
    with jit.compiled_only():
        assert engine.ready(trace, "h2o")
    for name in ("retained_mass_series", "top_k_recall_series", "kept_history", "score_history", "score_positions"):
        a, b, c = (getattr(r, name) for r in (ref, fast, again))
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(b, c)
    assert ref.summary() == fast.summary()


def test_the_pooling_takes_numpy_inside_compiled_only_until_its_kernels_are_compiled(monkeypatch):
    from kvsim import jit
    from kvsim.views.figures import pooling
    from kvsim.views.selection import Region

    if not jit.AVAILABLE:
        pytest.skip("no numba: the NumPy pooling always")
    monkeypatch.setattr(jit, "_compiled", set())
    h = np.array([[0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3]], dtype=np.int32)
    calls = []
    real = pooling._pool_panel_fast
    monkeypatch.setattr(pooling, "_pool_panel_fast", lambda *a, **k: calls.append(1) or real(*a, **k))
    with jit.compiled_only():
        slow = pooling.panel_layers([h], Region.whole(4), 1, 2, 8)
    assert calls == []
    fast = pooling.panel_layers([h], Region.whole(4), 1, 2, 8)
    assert calls == [1] and slow == fast and jit.compiled(pooling.KERNELS)
    with jit.compiled_only():
        pooling.panel_layers([h], Region.whole(4), 1, 2, 8)
    assert calls == [1, 1]


def _job(log: list, name: str, cached: bool = False, fail: bool = False, delay: float = 0.0):
    from kvsim.app import services

    def prepare(progress):
        time.sleep(delay)
        log.append(name)
        if fail:
            raise RuntimeError("no compiler")

    return services.Job(prepare, lambda: cached, 4, shared=True)


def test_the_warmup_runs_each_job_once_in_order_and_says_so_only_while_compiling():
    from kvsim.app import services

    log: list = []
    elsewhere: list = []
    jobs = {"a": _job(log, "a", delay=0.2), "b": _job(log, "b"), "c": _job(log, "c", cached=True),
            "bad": _job(log, "bad", fail=True)}
    warm = services.Warmup(jobs, shared_s=8, elsewhere=elsewhere.append)
    assert warm.cached(["c"]) and not warm.cached(["a", "c"])
    note = warm.note(["a", "b", "unknown"])
    assert note.startswith("Compiling the fast engine once for this install (about 15 s)")  # 4 + 4 + 8 shared
    assert warm.note(["c"]) is None  # on disk: loaded, not compiled
    warm.compiling_since = time.monotonic() - 40  # a compile slower than estimated says the time it has taken
    assert "(40 s so far; what is left takes about 16 s on two idle cores, longer on a busy machine)" in warm.note(["a", "b"])
    warm.compiling_since = None
    threads = [threading.Thread(target=warm.want, args=(["a", "b", "bad", "a"],)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 10
    while warm.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not warm.busy()
    assert log == ["a", "b", "bad"] and elsewhere[0] == ["a", "b", "bad"] and len(elsewhere) == 1
    assert warm.failed == {"bad": "RuntimeError: no compiler"}
    assert warm.pending(["a", "b", "bad", "c"]) == ["c"] and warm.note(["a", "b", "bad"]) is None
    warm.load(["c", "a"])
    assert log == ["a", "b", "bad", "c"] and warm.pending(["a", "b", "c"]) == []


def test_the_browser_benchmark_times_the_first_page_of_a_brand_new_install(tmp_path):
    """A step of its own, against 10 s, on a server whose numba and trace caches are empty."""
    from kvsim.bench import browser as bb

    assert bb.INSTALL.name == "first page of a brand-new install" and bb.INSTALL.target_s == 10.0
    assert isinstance(bb.INSTALL.action, bb.Open) and bb.INSTALL.action.new_session and bb.INSTALL.min_images == 3
    (tmp_path / "install" / "numba").mkdir(parents=True)
    (tmp_path / "install" / "numba" / "old.nbi").write_text("left by an earlier round")
    env = bb.install_env(tmp_path / "install")
    for var in ("NUMBA_CACHE_DIR", "KVSIM_CACHE_DIR"):
        folder = Path(env[var])
        assert folder.is_dir() and list(folder.iterdir()) == [] and tmp_path in folder.parents

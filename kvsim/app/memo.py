"""The work the views share, cached per server: a trace is hashed by its fingerprint (a digest of its
data, computed once per trace), and a policy by its ``PolicySpec`` (frozen, validated once per run),
so equal data and settings share results across sessions. Results are treated as read-only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import streamlit as st

import kvsim
from kvsim.analysis import windows
from kvsim.analysis.metrics import describe_cached
from kvsim.data import qk, store
from kvsim.data.catalog import resolve_bundle, resolve_trace
from kvsim.policies import PolicySpec
from kvsim.policykit.base import WINDOW
from kvsim.policykit.upper_bound import upper_bound_summary
from kvsim.sim import engine, summaries
from kvsim.views import figures
from kvsim.views import support as views
from kvsim.views.figures import pooling

from . import services

TOP_K = kvsim.DEFAULT_TOP_K
#: the caches key a trace by its fingerprint; Streamlit matches hash_funcs by exact type, so each kind is named
BY_TRACE = {kind: lambda trace: trace.fingerprint for kind in (kvsim.Trace, qk.QKTrace)}


def replay(trace: kvsim.Trace, spec: PolicySpec, **record) -> kvsim.ReplayResult:
    """The one way the app replays: the spec's policy, budget and parameters, at the app's top_k."""
    return kvsim.replay(trace, spec, top_k=TOP_K, **record)


@st.cache_resource(max_entries=4, show_spinner="loading the trace")
def load_named_trace(spec: str) -> kvsim.Trace:
    """The trace ``spec`` names, all of it: a query/key trace too long for its dense matrix is drawn
    from one pass over its rows (``row_stats``), its replays compute only the weights they hold."""
    return resolve_trace(spec)


def row_stats(trace: kvsim.Trace) -> None:
    """For a trace too long for its dense matrix, the one pass over its rows that its features,
    statistics and picture are drawn from, with a progress bar the first time on this machine (about
    a minute at 32k steps; then read from the disk cache). Other traces: nothing."""
    bar = []

    def progress(fraction, note=""):
        if not bar:
            bar.append(st.progress(0.0))
        bar[0].progress(min(1.0, fraction or 0.0), text=f"{trace.steps} steps: reading every row once, for the picture and "
                                                         "the statistics (kept on disk after: once per machine)")

    trace.derived.prepare_whole(progress)
    if bar:
        bar[0].empty()


@st.cache_resource(max_entries=2, show_spinner="reading the uploaded trace")
def load_uploaded_trace(digest: str, filename: str, _data: bytes) -> kvsim.Trace:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / (Path(filename).name or "upload.npz")
        path.write_bytes(_data)
        try:
            return kvsim.load_trace(path)
        except kvsim.TraceError as e:  # name the file as the user knows it, not our temp path
            raise kvsim.TraceError(str(e).replace(str(path), filename)) from None


@st.cache_resource(ttl=60)
def bundle_traces() -> list[str]:
    """The shipped bundles' traces, then those of the recordings in the cache directory (looked for
    again each minute: a recording made while the server runs is offered without a restart)."""
    return views.bundle_trace_names(recorded=True)


@st.cache_resource(max_entries=4, show_spinner="reading the bundle")
def cached_bundle(name: str):
    return resolve_bundle(name)


@st.cache_resource(max_entries=24, show_spinner="replaying", hash_funcs=BY_TRACE)
def cached_replay(trace: kvsim.Trace, spec: PolicySpec, scores: bool = False, layout=None) -> kvsim.ReplayResult:
    """One replay with its kept sets recorded, and its scores too with ``scores`` (the score view's:
    T x budget floats that the kept view never reads). ``layout``: under that serving layout (the kept
    view's; ``kvsim.policykit.layouts.Layout``, None for none), on the reference path."""
    return replay(trace, spec, record_kept=True, record_scores=scores, layout=layout)


def replays(trace: kvsim.Trace, runs, scores: bool = False, layout=None) -> list[kvsim.ReplayResult]:
    return [cached_replay(trace, spec, scores, layout) for spec in runs]


def kept_history(trace: kvsim.Trace, spec: PolicySpec, layout=None):
    """The replay's kept positions after each step, ``(T, budget)``: what the kept view's images,
    heavy-hitter fates and difference counts are all drawn from (no ``(T, T + 1)`` mask is built)."""
    return cached_replay(trace, spec, False, layout).kept_history


@st.cache_resource(max_entries=64, show_spinner=False, hash_funcs=BY_TRACE)
def cached_summary(trace: kvsim.Trace, spec: PolicySpec) -> dict:
    """One replay's summary, nothing recorded: what a line on the curve needs (a fraction of the
    memory and time of ``cached_replay``), shared by every session, and kept on disk beside a shipped or
    canonical trace's cache entry, so a fresh server reads it (``kvsim.sim.summaries``)."""
    return summaries.summary(trace, spec, TOP_K)


@st.cache_resource(max_entries=4, show_spinner=False, hash_funcs=BY_TRACE)
def cached_features(trace: kvsim.Trace) -> figures.TraceFeatures:
    """The trace's features, held per server; a fresh server reads them from beside the trace's disk
    cache entry (a shipped or canonical trace) instead of measuring the attention again."""
    return figures.trace_features_cached(trace)


@st.cache_resource(max_entries=4, show_spinner=False, hash_funcs=BY_TRACE)
def cached_describe(trace: kvsim.Trace, band: int, sinks: int) -> dict:
    """The trace's statistics, held per server and, for a trace with a disk cache entry, on disk."""
    return describe_cached(trace, band=band, top_k=TOP_K, sinks=max(1, sinks))


def describe(trace: kvsim.Trace, features: figures.TraceFeatures) -> dict:
    """The statistics the views quote, measured at the trace's own band and sinks."""
    return cached_describe(trace, features.band, max(1, features.sinks))


@st.cache_resource(max_entries=8, show_spinner="computing the upper bound", hash_funcs=BY_TRACE)
def cached_upper_bound(trace: kvsim.Trace, budget: int) -> dict:
    return upper_bound_summary(trace, budget, TOP_K)


#: the upper bound's file beside the trace (``<stem>-upper-bound-<digest>.json``)
UPPER_BOUND = "upper-bound"


def kept_upper_bound(trace: kvsim.Trace, budget: int, top_k: int, compute: bool = False) -> dict | None:
    """The upper bound's summary, kept beside the trace's cache entry (``kvsim.data.store.derived``),
    keyed by the module that computes it: read where an earlier server computed it, else None, or
    with ``compute`` computed (and kept). A curve drawn coarse first computed it in the background
    after every server start, and the page ran again when it ended. (Where the curve is quick, its
    line is computed in the run, ``cached_upper_bound``: 0.1 s on a shipped trace.)"""
    import kvsim.policykit.upper_bound as module

    params, version = {"budget": budget, "top_k": top_k}, store.source_version(module.__file__)
    if not compute:
        return store.derived_stored(trace, UPPER_BOUND, params, version)
    return store.derived(trace, UPPER_BOUND, params, version, lambda: upper_bound_summary(trace, budget, top_k))


class _NotKept(Exception):
    """A sweep asked of ``_kept_run`` that no earlier process kept."""


def kept_sweep(trace: kvsim.Trace, spec: PolicySpec, values: list[int]) -> list[dict] | None:
    """``summaries.sweep(trace, spec, None, WINDOW, values, top_k=TOP_K)``'s rows where an
    earlier process kept them on disk, else None: nothing is replayed."""
    values = [int(v) for v in values]
    key = {"policy": spec.name, "budget": spec.budget,
           "params": {k: v for k, v in spec.kwargs.items() if k != WINDOW},
           "param": WINDOW, "values": values, "top_k": TOP_K}

    def decode(record: dict) -> list[dict]:  # as ``summaries.sweep`` reads its own
        rows = record["rows"]
        if not isinstance(rows, list) or [r.get(WINDOW) if isinstance(r, dict) else None for r in rows] != values:
            raise ValueError("not this sweep's rows")
        return rows

    return store.derived_stored(trace, summaries.SWEEP, key, summaries.code_version(spec.name), decode)


def kept_refined(trace: kvsim.Trace, spec: PolicySpec, marks: tuple[int, ...], points: int) -> list[dict] | None:
    """The curve view's sweep of ``spec`` over recent_window 1 .. budget - 1, refined around its peak
    (``sweep_coarse_to_fine`` of ``points`` with ``marks``, each grid through ``summaries.sweep``), where
    every grid of it was kept by an earlier process, else None: nothing is replayed."""
    return _kept_run(lambda run: windows.sweep_coarse_to_fine(trace, spec, None, WINDOW, 1, spec.budget - 1,
                                                               marks=marks, points=points, top_k=TOP_K, run=run))


def _kept_run(sweep) -> list[dict] | None:
    """``sweep(run)``'s rows (a coarse-to-fine sweep, ``run`` its sweep of each grid) where every grid it
    asks for was kept by an earlier process (``kept_sweep``), else None: nothing is replayed."""

    def run(trace, spec, budget, param, values, *, top_k, progress=None):
        if budget is not None or param != WINDOW or top_k != TOP_K:
            raise _NotKept
        rows = kept_sweep(trace, spec, values)
        if rows is None:
            raise _NotKept
        return rows

    try:
        return sweep(run)
    except _NotKept:
        return None


# --------------------------------------------------------------------------------------------
# the shared services, one per server

#: how much lower the background work is scheduled than the pages' runs (the compile child's ``nice -n 10``)
BACKGROUND_NICE = 10


@st.cache_resource
def background() -> services.Background:
    """Replays too slow to wait for on a redraw (a curve's refinement, a reference line at a large
    budget), one at a time: each already keeps every core busy. Below the pages' priority
    (``BACKGROUND_NICE``)."""
    return services.Background(workers=1, bound=128, name="kvsim-background", nice=BACKGROUND_NICE)


@st.cache_resource
def sweeps() -> services.SweepStore:
    """The recent_window curves by (trace, policy spec, top_k): a store rather than st.cache_data
    so that the progress bar is drawn by the run that sweeps, never replayed from a cache."""
    return services.SweepStore(bound=64, background=background())


@st.cache_resource
def solves() -> services.Background:
    """Background solves of the exact optimum, by (trace, budget): one at a time (a solve holds a
    large table), shared by all sessions, so a slow solve never blocks a page."""
    return services.Background(workers=1, name="kvsim-optimal", nice=BACKGROUND_NICE)


@st.cache_resource
def tunings() -> services.Shared:
    """Tunings by (bundle, policy, budget): the progress bar is drawn by the run that computes one."""
    return services.Shared(bound=16)


def tuned(name: str, policy: str, budget: int):
    """The bundle's tuning, once per server, each trace's sweep read from the cache directory where an earlier
    server swept it (``keep``), else swept with the progress bar drawn by the run that does it."""
    from kvsim.analysis.tune import tune  # the bundle's engine work loads with the first tuning

    def compute():
        bundle = cached_bundle(name)
        bar = st.progress(0.0, text=f"tuning {policy}'s recent_window (1 .. {budget - 1}) on {bundle.describe()}")
        result = tune(bundle, policy, budget, top_k=TOP_K, by="retained_mass", keep=True,  # kept on disk; per layer
                      progress=lambda fraction, note="": bar.progress(fraction or 0.0, text=note))
        bar.empty()
        return result

    return tunings().get((name, policy, budget, TOP_K), compute,
                         waiting=lambda: st.spinner(f"another session is tuning {policy} on {name}"))


@st.cache_resource
def curve_figures() -> services.BoundedStore:
    """Built curve figures by what they draw, shared by every session: under load the figure's
    Plotly validation, not the sweep, was most of a redraw."""
    return services.BoundedStore(32)


#: how long a compile from nothing takes, per job, on the two-core machine this app is developed on
#: (13.5 s in all for the default view; a policy's own figure is its ``engine_binding.compile_s``), and
#: what the first engine job compiles for all of them (the top-k positions, numba's partition and sort)
POOLING_S = 3
SHARED_S = 8


@st.cache_resource
def warmup() -> services.Warmup:
    """The fast engine's kernels, once per server (each policy's, and the kept view's pooling):
    loaded at once where numba's disk cache holds them, else compiled in the background while the
    pages take the reference or NumPy paths (``kvsim.jit.compiled_only``), the same results."""
    jobs = {name: services.Job(lambda progress, name=name: engine.prepare(name, progress),
                               lambda name=name: engine.on_disk(name), kvsim.POLICIES[name].engine_binding.compile_s,
                               shared=True)
            for name in engine.FAST}
    jobs["pooling"] = services.Job(lambda progress: pooling.prepare(), pooling.on_disk, POOLING_S)
    return services.Warmup(jobs, shared_s=SHARED_S, elsewhere=compile_in_child)


#: what the child process runs: each job's prepare, the kernels written to numba's disk cache
_CHILD = ("import sys\nfrom kvsim.sim import engine\nfrom kvsim.views.figures import pooling\n"
          "for name in sys.argv[1:]:\n    pooling.prepare() if name == 'pooling' else engine.prepare(name)\n")


def compile_in_child(names: list[str]) -> None:
    """Compile the kernels of ``names`` in a child process of lower priority, this kvsim first on its
    path: numba's compiler holds the interpreter lock, which the server's threads then keep."""
    root = str(Path(kvsim.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    nice = [which, "-n", "10"] if (which := shutil.which("nice")) else []
    subprocess.run([*nice, sys.executable, "-c", _CHILD, *names], env=env, cwd=root, check=True, timeout=900,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

"""The sweeps behind ``kvsim.analysis.tune``: every trace of a source swept over the windows (and the recency
baselines beside them), one after another or on Dask, each alone or, under a serving layout with shared
selection, a layer's KV heads together; and what a layout leaves of the windows. Nothing here reads the
truth: ``tune`` turns these curves into its recommendation."""

from __future__ import annotations

import contextlib
import io
import os
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cluster import ClusterError, dask_client
from ..data.trace import Trace, load_npz
from ..policies import PolicySpec
from ..policykit.base import WINDOW
from ..policykit.layouts import Layout
from ..policykit.registry import baselines
from ..sim.harness import DEFAULT_TOP_K
from . import proxies as px

if TYPE_CHECKING:
    from ..data.bundle import Bundle

#: how many candidate windows a costly figure (the truth, a value proxy) is measured at
CANDIDATES = 16


class TuneError(ValueError):
    """Tuning cannot run as asked; one line."""


@dataclass(frozen=True)
class Unit:
    """One trace to sweep: where to get it (a file's bytes, so a remote worker needs no shared disk,
    or the Trace itself) and how to label it."""

    layer: int
    head: int
    name: str
    attention: str
    payload: bytes | Trace | str


def units_of(source: Bundle | Trace | Sequence[Trace]) -> list[Unit]:
    from ..data.bundle import Bundle

    if isinstance(source, Bundle):
        return [Unit(t.layer, t.head, t.name, t.attention, str(t.path)) for t in source.traces]
    traces = [source] if isinstance(source, Trace) else list(source)
    units = []
    for i, tr in enumerate(traces):
        layer, head = tr.meta.get("layer", i), tr.meta.get("head", 0)
        scope = "sliding" if str(tr.meta.get("attention", "global")).startswith("sliding") else "global"
        units.append(Unit(int(layer) if isinstance(layer, int) else i, int(head) if isinstance(head, int) else 0,
                           tr.name, scope, tr))
    return units


def load_unit(payload: bytes | Trace | str, name: str) -> Trace:
    from ..data.qk_files import is_qk_path, load_qk

    if isinstance(payload, Trace):
        return payload
    if isinstance(payload, bytes):  # a query/key file is a zip holding 'q.npy'
        qk = zipfile.is_zipfile(io.BytesIO(payload)) and "q.npy" in zipfile.ZipFile(io.BytesIO(payload)).namelist()
        return (load_qk if qk else load_npz)(io.BytesIO(payload), source=name)
    return load_qk(payload) if is_qk_path(payload) else load_npz(payload)


def window_specs(policy: str, budget: int, windows: Sequence[int], params: dict) -> list[PolicySpec]:
    """The configuration of each window a tune sweeps, made (and so checked) once, before any trace
    is read: a bad value fails here, in the spec's one line, not in a worker."""
    return [PolicySpec.of(policy, budget, **params, **{WINDOW: int(w)}) for w in windows]


def tune_trace(trace: Trace, specs: Sequence[PolicySpec], top_k: int = DEFAULT_TOP_K, layout: Layout | None = None) -> dict:
    """One trace's sweep of ``specs`` (``window_specs``) and the baselines at their budget, as plain
    lists and floats (what a Dask worker sends back). ``layout``: every configuration, baselines included,
    under that serving layout (each a reference replay); a baseline the layout refuses is left out."""
    from ..sim.simulate import sweep

    rows = sweep(trace, specs, top_k=top_k, layout=layout)
    budget = specs[0].budget
    base = {}
    for p in _baselines(budget, layout):  # a one-value sweep over budget: the fast engine, the policy's defaults
        r = sweep(trace, p, budget, "budget", [budget], top_k=top_k, layout=layout)[0]
        base[p] = (float(r["retained_mass"]), float(r["top_k_recall"]))
    return {"retained_mass": [float(r["retained_mass"]) for r in rows],
            "top_k_recall": [float(r["top_k_recall"]) for r in rows], "baselines": base}


def tune_layer(traces: Sequence[Trace], specs: Sequence[PolicySpec], top_k: int, layout: Layout) -> list[dict]:
    """A layer's KV heads under a layout with shared selection: every configuration replayed over the heads
    together (``kvsim.sim.layered.replay_layer``: one selection for the layer), one ``tune_trace`` dict per head."""
    from ..sim.layered import replay_layer

    budget = specs[0].budget
    runs = [replay_layer(list(traces), s, layout, top_k=top_k)["heads"] for s in specs]
    base = {p: replay_layer(list(traces), PolicySpec.of(p, budget), layout, top_k=top_k)["heads"]
            for p in _baselines(budget, layout)}
    return [{"retained_mass": [float(r[h].retained_mass) for r in runs],
             "top_k_recall": [float(r[h].top_k_recall) for r in runs],
             "baselines": {p: (float(r[h].retained_mass), float(r[h].top_k_recall)) for p, r in base.items()}}
            for h in range(len(traces))]


def _baselines(budget: int, layout: Layout | None) -> list[str]:
    """The recency baselines measured beside the tuned policy; under a layout, those it accepts at ``budget``."""
    return [p for p in baselines() if layout is None or _runs(layout, p, budget, {})]


def _run_unit(payload, name: str, specs: list[PolicySpec], top_k: int, keep: bool = False) -> dict:
    if keep and isinstance(payload, str):
        return kept_unit(payload, name, specs, top_k)
    return tune_trace(load_unit(payload, name), specs, top_k=top_k)


#: the layout of a kept unit's file (``kept_unit``); another one is swept again
KEPT_VERSION = 1


def kept_unit(path: str, name: str, specs: list[PolicySpec], top_k: int) -> dict:
    """``tune_trace`` of the trace file ``path``, kept in the cache directory (``tuning/unit-<digest>.json``),
    keyed by the file's bytes, the configurations, the top-k and the code that replays and tunes: the app's
    *Your model* view tuned the shipped bundle again after every server start (3.4 s of its first visit).
    A missing, damaged or foreign file is swept again and rewritten; an unwritable cache only costs the sweep."""
    import hashlib
    import json

    from ..data.files import atomic_write
    from ..data.store import cache_dir, source_version
    from ..sim.summaries import code_version

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    key = {"version": KEPT_VERSION, "file": digest.hexdigest(), "top_k": top_k,
           "specs": [[s.name, s.budget, json.loads(json.dumps(s.kwargs, sort_keys=True))] for s in specs],
           "code": code_version(specs[0].name) + "-" + source_version(__file__)}
    where = cache_dir() / "tuning" / f"unit-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]}.json"
    from ..data import kept

    def read(doc) -> dict | None:
        try:
            if doc["key"] == key:
                r = doc["result"]
                if len(r["retained_mass"]) == len(r["top_k_recall"]) == len(specs):
                    return {"retained_mass": [float(x) for x in r["retained_mass"]],
                            "top_k_recall": [float(x) for x in r["top_k_recall"]],
                            "baselines": {p: (float(m), float(k)) for p, (m, k) in r["baselines"].items()}}
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # damaged: swept again below
        return None

    try:
        found = read(json.loads(where.read_text(encoding="utf-8")))
    except (OSError, ValueError, UnicodeDecodeError):
        found = None  # missing or damaged: swept again below
    if found is None:  # shipped with the repo under the same name (kvsim.data.kept)
        found = read(kept.tuning(where.name) or {})
    if found is not None:
        return found
    result = tune_trace(load_unit(path, name), specs, top_k=top_k)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"key": key, "trace": name, "result": result}, allow_nan=False)
        atomic_write(where, lambda f: f.write(text.encode("utf-8")))
    except (OSError, ValueError):
        pass
    return result


def run_group(payloads: list, names: list[str], specs: list[PolicySpec], top_k: int, layout: Layout | None,
              keep: bool = False) -> list[dict]:
    """A group of traces (``groups_of``): one trace, or under shared selection a layer's KV heads together.
    ``keep``: a lone trace file's sweep is kept on disk (``kept_unit``)."""
    if len(payloads) == 1 and layout is None:
        return [_run_unit(payloads[0], names[0], specs, top_k, keep)]
    traces = [load_unit(p, n) for p, n in zip(payloads, names, strict=True)]
    if len(traces) == 1:
        return [tune_trace(traces[0], specs, top_k=top_k, layout=layout)]
    return tune_layer(traces, specs, top_k, layout)


def groups_of(units: list[Unit], layout: Layout | None) -> list[list[int]]:
    """The units swept together: each alone, or under shared selection each layer's KV heads together."""
    if layout is None or not layout.shared_selection:
        return [[i] for i in range(len(units))]
    by_layer: dict[int, list[int]] = {}
    for i, u in enumerate(units):
        by_layer.setdefault(u.layer, []).append(i)
    return list(by_layer.values())


def layout_windows(policy: str, budget: int, layout: Layout, params: dict) -> list[int]:
    """The windows tune sweeps under a layout by default: the ``CANDIDATES`` evenly spaced windows the truth is
    measured at (each window is a reference replay per trace, not one pass of the fast engine), those the
    layout leaves room for (below the fewest positions held right after a decision, ``Layout.floor``); where none
    of them fits, every window that does."""
    def fits(w: int) -> bool:
        return _runs(layout, policy, budget, {**params, WINDOW: int(w)})

    # so little room that no evenly spaced window fits: every window that does (1 always does: check_layout)
    return [w for w in px.even_windows(budget, CANDIDATES) if fits(w)] or [w for w in range(1, budget) if fits(w)]


def _runs(layout: Layout, policy: str, budget: int, params: dict) -> bool:
    """Whether ``layout`` runs ``policy`` at ``budget`` with ``params`` (``Layout.check`` refuses nothing)."""
    try:
        layout.check(policy, budget, params, heads=None)
    except ValueError:
        return False
    return True


def check_layout(policy: str, budget: int, layout: Layout, params: dict, windows: Sequence[int] | None = None) -> None:
    """Refuse, in one line (TuneError), a layout that cannot run ``policy`` at ``budget`` with any window (a block
    larger than the budget, an interval that leaves no room, an offline policy) or one of ``windows`` it
    refuses; the layout's own words (``Layout.check``)."""
    for w in (1, *(windows or ())):
        try:
            layout.check(policy, budget, {**params, WINDOW: int(w)}, heads=None)
        except ValueError as e:
            raise TuneError(f"{layout.label}: {' '.join(str(e).split())}") from None


@contextlib.contextmanager
def _client(scheduler: str, workers: int | None):
    """``cluster.dask_client``, its refusals as TuneError (the tune's one-line errors)."""
    try:
        with dask_client(scheduler, workers) as got:
            yield got
    except ClusterError as e:
        raise TuneError(str(e)) from None


def run_dask(units, groups, scheduler, workers, say, specs, top_k, layout) -> tuple[list[dict], dict]:
    from distributed import as_completed

    with _client(scheduler, workers) as (client, address):
        n_workers = len(client.scheduler_info().get("workers", {}))
        futures = []
        for g in groups:
            payloads = []
            for i in g:  # a file goes as its bytes: a worker on another machine does not share this disk
                payload = units[i].payload
                if isinstance(payload, str):
                    with open(payload, "rb") as f:
                        payload = f.read()
                # sent to a worker once, not embedded in the task graph (64 MB at 4096 steps)
                payloads.append(client.scatter(payload))
            names = [units[i].name for i in g]
            futures.append(client.submit(run_group, payloads, names, specs, top_k, layout,
                                         pure=False, key=f"kvsim-tune-{names[0]}-{os.getpid()}-{time.time_ns()}"))
        index = {f.key: n for n, f in enumerate(futures)}
        results: list[dict | None] = [None] * len(units)
        done = 0
        for fut in as_completed(futures):
            g = groups[index[fut.key]]
            for i, r in zip(g, fut.result(), strict=True):
                results[i] = r
            done += len(g)
            say(done, units[g[-1]].name)
    return results, {"executor": "dask", "workers": n_workers, "scheduler": address}


__all__ = ["CANDIDATES", "TuneError", "check_layout", "layout_windows", "tune_layer", "tune_trace",
           "window_specs"]

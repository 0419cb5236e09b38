"""Tune a policy's ``recent_window`` per layer and KV head of a recorded model (a bundle).

The H2O card's advice is "tune it to your model, not to this table". For every (layer, KV head) trace
of a bundle, ``tune`` sweeps ``recent_window`` over ``1 .. budget - 1`` with ``kvsim.sweep`` (the fast
engine) and reports:

- per trace, the best window and the *recommended* one (``kvsim.analysis.windows``, the rule every view
  uses): the smallest window whose retained mass is within ``tolerance`` (0.005) of that trace's best
  (past it the curve is flat, and a smaller window leaves more of the cache to the heavy hitters); per
  layer, the same on the mean of its KV heads' curves (one window per layer, as a serving stack sets it);
- model-wide, the mean over all traces for one window shared by every layer (the best shared window
  and the smallest within ``tolerance`` of it), for per-layer windows and for per-KV-head windows;
- sliding_window and streaming_llm at the same budget beside them.

Under a serving layout (``layout=``; docs/serving.md, "Tuning under a layout") every window and baseline is
replayed under it (``kvsim.analysis.tune_sweep``) and the truth handed in measures under it;
``kvsim.analysis.tune_layout`` searches over layouts with whole tunes.

The sweeps are independent, so they can run on Dask (``scheduler="local"`` for local processes, or a
scheduler's address): the same function runs per trace, so the results are identical to the serial
run. Dask is in the optional extra (``pip install -e '.[record]'``); nothing here imports it until asked.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..data.trace import Trace
from ..policies import POLICIES, policy_params
from ..policykit.base import WINDOW
from ..policykit.layouts import Layout
from ..policykit.registry import suggest
from ..progress import Progress
from ..sim.harness import DEFAULT_TOP_K
from . import proxies as px
from .layer_search import GROUPS, SEARCH_STEP, layer_groups, search_layer_windows
from .tune_sweep import (
    CANDIDATES,
    TuneError,
    Unit,
    check_layout,
    groups_of,
    layout_windows,
    load_unit,
    run_dask,
    run_group,
    tune_layer,
    tune_trace,
    units_of,
    window_specs,
)
from .windows import TOLERANCE, WindowChoice, best_of, covers, pick

if TYPE_CHECKING:  # bundles, query/key files and the engine load when a tune runs: the CLI's parser reads BY
    from ..data.bundle import Bundle

#: the truth: measured by a model (``tune(..., truth=...)``; ``kvsim tune --by kl`` opens one)
TRUTH_BY = ("kl", "delta_nll")
#: the proxy the study ranks best (docs/proxies.md: the least worst-case and mean within-sweep regret
#: over both models, three texts, two budgets and four swept policies); what ``auto`` falls back to
BEST_PROXY = "output_error_late"
#: the default: the truth (``kl``) when the caller hands ``tune`` one (``kvsim tune`` does whenever the
#: recording's model and text are at hand), else ``BEST_PROXY``. No proxy's worst within-sweep regret is
#: under 5% in the study, so the truth is the recommendation path wherever it can be measured
AUTO = "auto"
DEFAULT_BY = AUTO
#: what a recommendation by a proxy says of itself (the study's finding)
PROXY_CAVEAT = ("no proxy's worst within-sweep regret is under 5% in the proxy study (docs/proxies.md: the best, "
                "output_error_late, +89% KL in its worst of 48 sweeps, +14% on average); with the model at hand, "
                "--by kl recommends by the truth")
#: a proxy averaged over the deeper half of the layers only (``output_error_late``)
LATE = "_late"
BY = (AUTO, *(f"{p}{late}" for p in px.PROXIES for late in ("", LATE)), *TRUTH_BY)


@dataclass(frozen=True)
class TraceTuning:
    """One (layer, KV head): its curve over the windows and what it recommends."""

    layer: int
    head: int
    name: str
    #: "global" or "sliding" (the model's own window), from the bundle's manifest
    attention: str
    retained_mass: np.ndarray  # float64, one per window
    top_k_recall: np.ndarray  # float64, one per window
    best_window: int
    best_mass: float
    recommended_window: int
    recommended_mass: float
    recommended_recall: float
    #: baseline policy -> (retained mass, top-k recall) at the same budget
    baselines: dict[str, tuple[float, float]]

    @property
    def label(self) -> str:
        return f"L{self.layer:02d}H{self.head}"


@dataclass(frozen=True)
class TuneResult:
    source: str
    policy: str
    budget: int
    windows: list[int]
    tolerance: float
    top_k: int
    params: dict
    traces: tuple[TraceTuning, ...]
    #: how it ran: {"executor": "serial" | "dask", "workers": n, "scheduler": address, "seconds": s}
    run: dict = field(default_factory=dict)
    #: what ``model_window`` was chosen by, with its curve (``by_model_window``)
    by: dict = field(default_factory=dict)
    #: the recorded model's identity (``recording_identity``): what a deployed tune file is checked against
    recording: dict = field(default_factory=dict)
    #: the windows a tune file deploys (``deployment``), filled in by ``tune``
    deploy: dict = field(default_factory=dict)
    #: the serving layout every window was measured under (None: none, and no layout key in ``to_dict``)
    layout: Layout | None = None

    def choice(self, t: TraceTuning) -> WindowChoice:
        """One trace's best and recommended windows as ``kvsim.analysis.windows`` names them everywhere
        (exact when the windows swept are every one 1 .. budget - 1, as by default)."""
        return WindowChoice(best=t.best_window, best_mass=t.best_mass, recommended=t.recommended_window,
                            recommended_mass=t.recommended_mass, tolerance=self.tolerance,
                            exact=covers(self.windows, self.budget))

    def mass_matrix(self) -> np.ndarray:
        """float64 ``(traces, windows)``: retained mass of each trace at each window."""
        return np.stack([t.retained_mass for t in self.traces])

    def _pick(self, mass: np.ndarray, recall: np.ndarray) -> dict:
        best, rec = pick(mass, self.tolerance)
        return {"best_window": self.windows[best], "best_mass": float(mass[best]), "best_recall": float(recall[best]),
                "recommended_window": self.windows[rec], "recommended_mass": float(mass[rec]),
                "recommended_recall": float(recall[rec])}

    def per_layer(self) -> list[dict]:
        """One window per layer, shared by its KV heads (a serving stack sets the window per layer): the
        best and recommended windows of the mean of the layer's curves. With one KV head per layer these
        are that trace's own."""
        out = []
        for layer in sorted({t.layer for t in self.traces}):
            ts = [t for t in self.traces if t.layer == layer]
            mass = np.mean([t.retained_mass for t in ts], axis=0)
            recall = np.mean([t.top_k_recall for t in ts], axis=0)
            out.append({"layer": layer, "kv_heads": len(ts), **self._pick(mass, recall)})
        return out

    def model_wide(self) -> dict:
        """Means over all traces: one shared window (best, and the smallest within ``tolerance``), one
        window per layer (``per_layer``), one per KV head, and the baselines."""
        mass, recall = self.mass_matrix(), np.stack([t.top_k_recall for t in self.traces])
        at = {w: i for i, w in enumerate(self.windows)}
        layer_window = {r["layer"]: at[r["recommended_window"]] for r in self.per_layer()}
        rows = np.arange(len(self.traces))
        cols = np.array([layer_window[t.layer] for t in self.traces])
        return {
            "one_window": self._pick(mass.mean(axis=0), recall.mean(axis=0)),
            "per_layer_windows": {
                "recommended_mass": float(mass[rows, cols].mean()),
                "recommended_recall": float(recall[rows, cols].mean()),
            },
            "per_head_windows": {
                "recommended_mass": float(np.mean([t.recommended_mass for t in self.traces])),
                "recommended_recall": float(np.mean([t.recommended_recall for t in self.traces])),
                "best_mass": float(np.mean([t.best_mass for t in self.traces])),
            },
            "baselines": {
                p: {"retained_mass": float(np.mean([t.baselines[p][0] for t in self.traces])),
                    "top_k_recall": float(np.mean([t.baselines[p][1] for t in self.traces]))}
                for p in self.traces[0].baselines
            },
        }

    def to_dict(self, curves: bool = False) -> dict:
        """JSON-ready. ``curves`` adds every trace's retained mass and recall per window."""
        rows = []
        for t in self.traces:
            row = {
                "layer": t.layer, "head": t.head, "trace": t.name, "attention": t.attention,
                "best_window": t.best_window, "best_mass": t.best_mass,
                "recommended_window": t.recommended_window, "recommended_mass": t.recommended_mass,
                "recommended_recall": t.recommended_recall,
                **{p: {"retained_mass": m, "top_k_recall": r} for p, (m, r) in t.baselines.items()},
            }
            if curves:
                row["curve"] = {"retained_mass": t.retained_mass.tolist(), "top_k_recall": t.top_k_recall.tolist()}
            rows.append(row)
        return {
            "trace": self.source, "policy": self.policy, "budget": self.budget, "param": WINDOW, "params": self.params,
            "windows": [self.windows[0], self.windows[-1]], "tolerance": self.tolerance, "top_k": self.top_k,
            "layers": rows, "per_layer": self.per_layer(), "model": self.model_wide(), "run": self.run,
            "by": self.by.get("by", "retained_mass"), "model_window": self.model_window, "by_detail": self.by,
            "by_caveat": None if self.by.get("by") in TRUTH_BY else PROXY_CAVEAT,
            "recording": self.recording, "deploy": self.deploy, **self.layout_fields(),
        }

    def layout_fields(self) -> dict:
        """The layout's keys of the document, as a replay's row has them (none without a layout)."""
        if self.layout is None:
            return {}
        return {"layout": self.layout.label, **self.layout.to_dict(), "memory": self.layout.memory(self.budget)[0],
                "swept_windows": list(self.windows)}

    @property
    def model_window(self) -> int:
        """The one recent_window recommended for every layer: by retained mass, the model-wide curve's
        recommended window (the rule of ``kvsim.analysis.windows``); by any other figure, the best of
        its model-wide curve over the candidate windows (``by``)."""
        if self.by.get("windows"):
            return int(self.by["model_window"])
        return int(self.model_wide()["one_window"]["recommended_window"])


def recording_identity(source: Bundle | Trace | Sequence[Trace]) -> dict:
    """What identifies the recorded model, as its recording says it: its name and its sliding layers'
    window (None where no layer slides or the recording does not say). A tune file carries it, so that
    deploying it on another model is refused for what that model is, never for the window tuned on it
    (the layer count, KV heads and layer kinds are in the tune file's rows)."""
    from ..data.bundle import Bundle

    if isinstance(source, Bundle):
        model = source.manifest.get("model")
        windows = {t.sliding_window for t in source.traces if t.attention == "sliding"}
    else:
        traces = [source] if isinstance(source, Trace) else list(source)
        model = next((t.meta.get("model") for t in traces if t.meta.get("model")), None)
        windows = {t.meta.get("sliding_window") for t in traces if str(t.meta.get("attention", "")).startswith("sliding")}
    windows.discard(None)
    return {"model": model, "sliding_window": int(next(iter(windows))) if len(windows) == 1 else None}


def _check(policy: str, budget: int, windows: list[int], tolerance: float, params: dict) -> None:
    if policy not in POLICIES:
        raise TuneError(f"unknown policy {policy!r}{suggest(policy)}; the registry has {', '.join(POLICIES)}")
    if WINDOW not in policy_params(policy):
        takes = [p for p in POLICIES if WINDOW in policy_params(p)]
        raise TuneError(f"tune sweeps {WINDOW}; policy {policy} does not take it (these do: {', '.join(takes)})")
    if WINDOW in params:
        raise TuneError(f"{WINDOW} is what tune sweeps; do not fix it")
    if budget < 2:
        raise TuneError(f"budget must be at least 2 to leave room for a recent_window of 1, got {budget}")
    if not windows:
        raise TuneError("no windows to sweep")
    if not 0 <= tolerance < 1:
        raise TuneError(f"tolerance must be in [0, 1), got {tolerance}")


def tune(
    source: Bundle | Trace | Sequence[Trace],
    policy: str = "h2o",
    budget: int = 256,
    *,
    windows: Sequence[int] | None = None,
    tolerance: float = TOLERANCE,
    top_k: int = DEFAULT_TOP_K,
    scheduler: str | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    by: str = DEFAULT_BY,
    truth=None,
    why: str | None = None,
    per_layer: bool = False,
    layout: Layout | None = None,
    keep: bool = False,
    **params,
) -> TuneResult:
    """Sweep ``recent_window`` (default ``1 .. budget - 1``) on every trace of ``source`` (a bundle, a
    trace or a list of traces); see the module docstring for what is reported.

    ``scheduler``: ``None`` runs here, one trace after another; ``"local"`` starts a Dask cluster of
    ``workers`` local processes (default: one per core); anything else is the address of a running
    Dask scheduler (``tcp://host:8786``). ``progress(fraction, note)`` (``kvsim.progress``) is told
    the share of traces swept as each finishes, the note naming it (``3/18 traces swept (...-L02)``).

    ``by`` (``BY``): what ``model_window`` is chosen by. ``kl`` and ``delta_nll`` need ``truth``, a
    function from candidate windows to the model's loss at each (``kvsim.models.truth.window_truth``
    behind ``kvsim tune --by kl``); a value proxy needs traces with values (else retained mass, said in
    ``by_detail["note"]``). ``auto`` is ``kl`` when ``truth`` is given, else ``BEST_PROXY``; ``why``
    (one line: why the truth was or was not at hand) is kept as ``by_detail["auto"]``.

    What a tune file deploys (``deploy``) follows ``by``: ``model_window`` in every layer; with
    ``per_layer``, one window per layer found by the same figure: by the truth, ``search_layer_windows``
    from ``model_window`` (``truth`` then also measures a configuration of per-layer windows:
    ``truth.configurations(configs, figure)``), by retained mass, each layer's recommended window.
    Where ``truth`` is given, the deployed windows' KL is measured too.

    ``layout`` (``kvsim.policykit.layouts.Layout``; docs/serving.md): every window, and the baselines, measured
    under that serving layout: the traces replayed under it (a layer's KV heads together under shared
    selection), ``truth`` measuring under it too (the caller's: ``kvsim tune``'s is built with the layout).
    The windows swept default to ``layout_windows`` (each is a reference replay); ``per_layer`` is refused.
    ``None`` or ``Layout()``: no layout, today's tune exactly.

    ``keep``: run here, each trace file's sweep is kept in the cache directory and read back by a later tune of
    the same file, configurations and code (``tune_sweep.kept_unit``; the app's *Your model* view).
    """
    if layout is not None and layout.plain:
        layout = None
    asked, by = by, _chosen_by(by, truth, why, layout, per_layer)
    from ..data.bundle import Bundle

    if per_layer and by in TRUTH_BY and not isinstance(source, Bundle):
        raise TuneError("--per-layer needs a bundle (a recording of every layer): the truth changes every layer's window")
    _check(policy, budget, [1] if windows is None else [int(w) for w in windows], tolerance, params)
    if layout is not None:
        check_layout(policy, budget, layout, params, windows)
    if windows is None:
        windows = list(range(1, budget)) if layout is None else layout_windows(policy, budget, layout, params)
    windows = [int(w) for w in windows]
    specs = window_specs(policy, budget, windows, params)
    units = units_of(source)
    if not units:
        raise TuneError("nothing to tune: no traces")
    name = source.name if isinstance(source, Bundle) else ", ".join(u.name for u in units[:3]) + (
        "" if len(units) <= 3 else f" and {len(units) - 3} more")
    t0 = time.perf_counter()
    results, run = _sweep(units, specs, top_k, layout, keep, scheduler, workers, progress)
    run["sweep_seconds"] = round(time.perf_counter() - t0, 2)
    tunings = tuple(_tuning(u, r, windows, tolerance) for u, r in zip(units, results, strict=True))
    result = TuneResult(source=name, policy=policy, budget=budget, windows=windows, tolerance=tolerance, top_k=top_k,
                        params=dict(params), traces=tunings, run=run, recording=recording_identity(source), layout=layout)
    _choose(result, units, by, asked == AUTO, truth, why, per_layer, progress)
    # the whole run, the truth's measurements included: the summary counts what the user waited for
    run["seconds"] = round(time.perf_counter() - t0, 2)
    if truth is not None and hasattr(truth, "counts"):
        run["truth"] = dict(truth.counts)
    return result


def _chosen_by(by: str, truth, why: str | None, layout: Layout | None, per_layer: bool) -> str:
    """The figure ``tune`` chooses by (``auto`` resolved), each refusal of ``by`` said before any sweep."""
    if by not in BY:
        raise TuneError(f"--by must be one of {', '.join(BY)}, got {by!r}")
    asked = by
    if by == AUTO:
        by = "kl" if truth is not None else BEST_PROXY
    if by in TRUTH_BY and truth is None:
        raise TuneError(f"--by {by} needs the model and the text the traces were recorded from")
    if truth is not None and getattr(truth, "layout", layout) != layout:  # a truth that says what it measures under
        raise TuneError(f"the truth is measured under {getattr(truth.layout, 'label', 'no layout')}, the sweep under "
                        f"{'no layout' if layout is None else layout.label}")
    if per_layer and by not in (*TRUTH_BY, "retained_mass"):
        raise TuneError(f"--per-layer windows are searched by the truth (kl, delta_nll) or read off retained mass's "
                        f"per-layer curves; by {by} " + ("(the truth is not at hand: " + why + ")" if asked == AUTO and why
                                                         else "has no per-layer search"))
    if layout is not None and per_layer:
        raise TuneError(f"--per-layer under a serving layout ({layout.label}): not measured yet; tune deploys "
                        "model_window in every layer under it")
    return by


def _sweep(units, specs, top_k: int, layout: Layout | None, keep: bool, scheduler: str | None, workers: int | None,
           progress: Progress | None) -> tuple[list, dict]:
    """Every unit swept over ``specs``, here one group after another or on Dask: the rows and how they ran."""
    def say(done: int, name: str) -> None:
        if progress is not None:
            progress(done / len(units), f"{done}/{len(units)} traces swept ({name})")

    groups = groups_of(units, layout)
    if scheduler is not None:
        return run_dask(units, groups, scheduler, workers, say, specs, top_k, layout)
    results: list[dict | None] = [None] * len(units)
    done = 0
    for g in groups:
        got = run_group([units[i].payload for i in g], [units[i].name for i in g], specs, top_k, layout, keep)
        for i, r in zip(g, got, strict=True):
            results[i] = r
        done += len(g)
        say(done, units[g[-1]].name)
    return results, {"executor": "serial", "workers": 1}


def _choose(result: TuneResult, units, by: str, auto: bool, truth, why: str | None, per_layer: bool,
            progress: Progress | None) -> None:
    """``result``'s figure (``result.by``) and what it deploys (``result.deploy``), each timed in ``result.run``."""
    t1 = time.perf_counter()
    if by != "retained_mass":
        result.by.update(_by_curve(result, units, by, truth, result.params))
    else:
        result.by["by"] = by
    result.run["by_seconds"] = round(time.perf_counter() - t1, 2)
    if auto:
        result.by["auto"] = why or ("the truth: measured by the model" if by in TRUTH_BY else
                                    f"no model at hand: {BEST_PROXY}, the proxy study's best")
    t2 = time.perf_counter()
    result.deploy.update(_deployment(result, by, truth, per_layer, progress))
    result.run["deploy_seconds"] = round(time.perf_counter() - t2, 2)


def _deployment(result: TuneResult, by: str, truth, per_layer: bool, progress: Progress | None) -> dict:
    """What a tune file deploys (``kvsim generate --windows``, ``kvsim.hf.cache(windows=...)``): one
    window per layer, by ``by``, and its KL where the truth is at hand."""
    layers = sorted({t.layer for t in result.traces})
    search = None
    if not per_layer:
        windows = [result.model_window] * len(layers)
        rule = f"model_window {result.model_window} in every layer (by {result.by.get('by', by)})"
    elif by in TRUTH_BY:
        figure = "kl" if by == "kl" else "delta_nll"
        kinds = {t.layer: t.attention for t in result.traces}
        toward = [r["recommended_window"] for r in result.per_layer()]
        search = search_layer_windows(result.model_window, layer_groups([kinds[layer] for layer in layers]),
                                      result.budget, lambda configs: truth.configurations(configs, figure),
                                      figure=figure, toward=toward, progress=progress)
        windows = search["windows"]
        rule = (f"per layer, searched by the truth ({figure}) from model_window {result.model_window} in "
                f"{len(search['groups'])} groups of layers: {search['measurements']} measurements, "
                f"{len(search['moves'])} of them moved")
    else:
        windows = [r["recommended_window"] for r in result.per_layer()]
        rule = "per layer, each layer's recommended window by retained mass"
    kl, note = None, None
    if truth is not None and hasattr(truth, "configurations"):
        kl = float(truth.configurations([tuple(windows)], "kl")[0])  # measured already: read from the cache
    else:
        note = ("not measured: the truth is not at hand here (the recording's model or text), or --by chose a proxy; "
                "--by kl measures it")
    if result.layout is not None:  # a tune file's windows carry no layout: the plan does
        rule += (f", tuned under {result.layout.label} (--save-plan's plan carries it; with generate --windows, give "
                 "the same layout flags)")
    return {"by": result.by.get("by", by), "rule": rule,
            "per_layer": [{"layer": layer, WINDOW: int(w)} for layer, w in zip(layers, windows, strict=True)],
            "kl": kl, "kl_note": note, "search": search}


def _by_curve(result: TuneResult, units: list[Unit], by: str, truth, params: dict) -> dict:
    """``model_window`` by ``by``: the model-wide curve of the figure over the candidate windows (every
    window swept for retained mass and top-k recall; ``CANDIDATES`` evenly spaced, plus retained mass's
    recommendation, for the costly ones), and the best of it. A ``_late`` figure is the mean over the
    traces of the deeper half of the bundle's layers only, as the proxy study defines it."""
    mass_pick = result.model_wide()["one_window"]["recommended_window"]
    windows = candidate_windows(result)
    if by in TRUTH_BY:
        losses = [float(x) for x in truth(windows)]
        return _best(by, windows, losses, -1, None)
    base, late = (by[: -len(LATE)], True) if by.endswith(LATE) else (by, False)
    keep = _deeper_half(result.traces) if late else [True] * len(result.traces)
    chosen = [t for t, k in zip(result.traces, keep, strict=True) if k]
    if base in ("retained_mass", "top_k_recall"):
        curve = np.stack([getattr(t, base) for t in chosen]).mean(axis=0).tolist()
        return _best(by, result.windows, curve, +1, None)
    traces = [load_unit(u.payload, u.name) for u, k in zip(units, keep, strict=True) if k]
    note = next((n for n in (px.fallback_note(t, base) for t in traces) if n), None)
    if note is not None:
        out = _best("retained_mass", result.windows, result.mass_matrix().mean(axis=0).tolist(), +1, note)
        out.update(by=by, fell_back_to="retained_mass", model_window=mass_pick)
        return out
    rows = [px.sweep(t, result.policy, result.budget, WINDOW, windows, layout=result.layout, **params) for t in traces]
    curve = [float(np.mean([r[i][base] for r in rows])) for i in range(len(windows))]
    return _best(by, windows, curve, px.PROXIES[base].sign, None)


def candidate_windows(result: TuneResult) -> list[int]:
    """The windows a costly figure (the truth, a value proxy) is measured at for ``model_window``:
    ``CANDIDATES`` evenly spaced and retained mass's model-wide recommendation; under a layout, the windows
    swept (``layout_windows``: those of the even ones the layout leaves room for)."""
    if result.layout is not None:
        return list(result.windows)
    return sorted(set(px.even_windows(result.budget, CANDIDATES)) | {result.model_wide()["one_window"]["recommended_window"]})


def _deeper_half(traces: Sequence[TraceTuning]) -> list[bool]:
    """Which traces are of the deeper half of the layers present (layers from the middle one on, as
    ``kvsim.models.truth.aggregate`` takes them for the study)."""
    layers = sorted({t.layer for t in traces})
    first = layers[len(layers) // 2]
    return [t.layer >= first for t in traces]


def _best(by: str, windows: list[int], curve: list[float], sign: int, note: str | None) -> dict:
    i = best_of(curve, sign)
    return {"by": by, "windows": list(windows), "curve": list(curve), "model_window": int(windows[i]),
            "value": float(curve[i]), "note": note}


def _tuning(u: Unit, r: dict, windows: list[int], tolerance: float) -> TraceTuning:
    mass, recall = np.asarray(r["retained_mass"], dtype=np.float64), np.asarray(r["top_k_recall"], dtype=np.float64)
    best, rec = pick(mass, tolerance)
    return TraceTuning(
        layer=u.layer, head=u.head, name=u.name, attention=u.attention, retained_mass=mass, top_k_recall=recall,
        best_window=windows[best], best_mass=float(mass[best]), recommended_window=windows[rec],
        recommended_mass=float(mass[rec]), recommended_recall=float(recall[rec]),
        baselines={p: (float(m), float(k)) for p, (m, k) in r["baselines"].items()},
    )


__all__ = ["AUTO", "BEST_PROXY", "BY", "DEFAULT_BY", "GROUPS", "PROXY_CAVEAT", "SEARCH_STEP", "TOLERANCE",
           "TRUTH_BY", "TraceTuning", "TuneError", "TuneResult", "candidate_windows", "check_layout",
           "layer_groups", "layout_windows", "recording_identity", "search_layer_windows", "tune", "tune_layer",
           "tune_trace", "window_specs"]

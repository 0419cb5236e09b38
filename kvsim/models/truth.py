"""The truth over candidate windows, and the proxies of the same configurations: what ``kvsim tune --by
kl``, the curve view and the proxy study (``kvsim proxies``, docs/proxies.md) measure.

A truth measurement is ``Session.measure_many`` (open loop by default: one masked teacher-forced pass
per configuration, the output layer's full-cache half shared by all; cached on disk per
configuration). The proxies of a configuration come from the same full-cache traces, replayed with
their kept sets recorded, per layer and KV head, and are cached too (they cost a replay per trace: 90
of them for SmolLM2-135M). What a replay reduces to is the analysis layer's (``kvsim.analysis.proxies``,
on this layer's level, so not imported here): the entry point hands it in as ``proxies``, a function of
(trace, ``PolicySpec``) to ``{figure: value}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..data.files import atomic_write
from ..data.store import cache_dir
from ..data.trace import Trace
from ..policies import PolicySpec
from ..policykit.base import WINDOW
from ..policykit.registry import missing, study_fixed, study_sweeps, window_param
from ..progress import Progress, scaled
from ..sim.simulate import even_windows
from .fanout import compute
from .loading import no_progress
from .quality import Configuration, Session, read_cached, write_cached

#: what a cached proxy record means; bump it when the proxies change meaning
PROXY_VERSION = 1
#: the proxies of one configuration on one trace: ``{figure: value}`` (``kvsim.analysis.proxies.configuration``)
Proxies = Callable[[Trace, PolicySpec], dict]


def proxies_key(session: Session, c: Configuration) -> dict:
    """What a configuration's proxies are cached under (``quality/proxies-<hash>.json``)."""
    return {"version": PROXY_VERSION, "model": session.model_id, "tokens": session.tokens_id, "steps": session.steps,
            "policy": c.policy, "budget": c.budget, "params": dict(sorted(c.asked.items()))}


def replay_proxies(session: Session, c: Configuration, proxies: Proxies) -> dict:
    """``{figure: (layers, kv heads) list}`` for every figure ``proxies`` gives, from one replay per
    (layer, KV head) of the session's full-cache traces (which carry their values); no cache."""
    grid: dict[str, np.ndarray] = {}
    for layer, heads in enumerate(session.traces):
        for h, trace in enumerate(heads):
            for f, value in proxies(trace, c.specs[layer]).items():
                grid.setdefault(f, np.zeros((session.layers, session.kv_heads)))[layer, h] = value
    return {f: g.tolist() for f, g in grid.items()}


def configuration_proxies(session: Session, c: Configuration, *, proxies: Proxies, use_cache: bool = True) -> dict:
    """``replay_proxies`` through the on-disk cache."""
    key = proxies_key(session, c)
    cached = read_cached(key, "proxies", "proxies") if use_cache else None
    if cached is not None:
        return cached
    out = replay_proxies(session, c, proxies)
    if use_cache:
        write_cached(key, out, "proxies", "proxies")
    return out


def aggregate(per_head: dict) -> dict:
    """One figure per proxy for the model: the mean over every layer and KV head, and, suffixed
    ``_late``, over the deeper half of the layers only (early layers attend diffusely and may matter
    least to the output)."""
    out = {}
    for f, grid in per_head.items():
        g = np.asarray(grid, dtype=np.float64)
        out[f] = float(g.mean())
        out[f"{f}_late"] = float(g[g.shape[0] // 2 :].mean())
    return out


def measure(session: Session, jobs: Sequence[Configuration], modes: Sequence[str] = ("open",), *,
            proxies: Proxies, use_cache: bool = True, batch: int = 8, progress: Progress | None = None) -> list[dict]:
    """Per configuration (``Session.configuration``): the truth in each of ``modes`` (``kl_open``,
    ``delta_nll_open``, ``delta_nll_key_open`` with ``key_tokens``, ... and ``seconds_*``) beside the
    model-level proxies (``aggregate``), one flat row. Closed loops decode ``batch`` at once."""
    say = progress or no_progress
    found = [read_cached(proxies_key(session, c), "proxies", "proxies") if use_cache else None for c in jobs]
    missing = [i for i, f in enumerate(found) if f is None]
    # each configuration's replays a cell: here in order, or on the session's Dask workers (kvsim.models.fanout)
    for done, (k, out) in enumerate(compute(session, [(replay_proxies, (jobs[i], proxies)) for i in missing]), start=1):
        c = jobs[missing[k]]
        found[missing[k]] = out
        if use_cache:
            write_cached(proxies_key(session, c), out, "proxies", "proxies")
        say(done / max(1, len(missing)) * 0.05, f"proxies of {c.policy} {c.asked} budget={c.budget}")
    rows = [{"policy": c.policy, "budget": c.budget, "params": dict(c.asked), **aggregate(f)} for c, f in zip(jobs, found,
                                                                                                            strict=True)]
    for k, mode in enumerate(modes):
        part = scaled(progress, 0.05 + 0.95 * k / len(modes), 0.05 + 0.95 * (k + 1) / len(modes))
        for row, r in zip(rows, session.measure_many(list(jobs), mode, use_cache=use_cache, batch=batch, progress=part),
                          strict=True):
            row.update({f"kl_{mode}": r["kl"], f"delta_nll_{mode}": r["delta_nll"], f"seconds_{mode}": r["seconds"],
                        f"cached_{mode}": r["cached"],
                        # the key-token loss (None where the rule selects no position) and how many it averages over
                        f"delta_nll_key_{mode}": r.get("delta_nll_key"), "key_tokens": r.get("key_tokens"),
                        "key_rule": r.get("key_rule")})
    for row in rows:
        row.update(model=session.model_id, text=session.text_path.name, steps=session.steps)
    return rows


def window_truth(session: Session, policy: str, budget: int, windows: Sequence[int], params: dict | None = None, *,
                 proxies: Proxies, mode: str = "open", use_cache: bool = True, progress: Progress | None = None,
                 recording: str | None = None) -> list[dict]:
    """The truth and proxies of ``policy`` at each recent_window of ``windows`` (one row each, with
    ``recent_window``), for ``tune --by kl`` and the curve view. ``recording``: the model as the
    recording names it (its manifest's ``model``); with it the rows are also kept in the truth
    document the views read (``save_truth``)."""
    param = window_param(policy)  # the parameter swept: the policy's declared window (recent_window)
    if param is None:
        raise ValueError(missing(policy, "window", "a window sweep"))
    base = {k: v for k, v in (params or {}).items() if k != param}
    jobs = [session.configuration(policy, budget, {**base, param: int(w)}) for w in windows]  # all checked first
    rows = measure(session, jobs, (mode,), proxies=proxies, use_cache=use_cache, progress=progress)
    for row, w in zip(rows, windows, strict=True):
        row[param] = int(w)
    if recording is not None:
        save_truth(session, rows, recording, mode)
    return rows


#: what a truth document is (the views read it: ``kvsim.views.window_truth``)
TRUTH_FORMAT = "kvsim-truth"


def truth_path(model_id: str, text_sha256: str, steps: int) -> Path:
    return cache_dir() / "truth" / f"{model_id}-{text_sha256[:16]}-{steps}.json"


def save_truth(session: Session, rows: list[dict], recording: str, mode: str = "open") -> Path:
    """Merge ``rows`` into the truth document of the session's model, text and steps (atomically; a
    row measured again replaces the old one): ``{"format", "meta": {model, model_id, text,
    text_sha256, steps, mode}, "results": [...]}``, what ``traces/truth-*.json`` ship."""
    from .loading import file_sha256

    sha = file_sha256(session.text_path)
    path = truth_path(session.model_id, sha, session.steps)
    try:
        old = json.loads(path.read_text(encoding="utf-8")).get("results", [])
    except (OSError, ValueError, AttributeError):
        old = []
    ident = lambda r: (r["policy"], r["budget"], json.dumps(r["params"], sort_keys=True))  # noqa: E731
    merged = {ident(r): r for r in [*old, *rows] if isinstance(r, dict) and "params" in r}
    doc = {"format": TRUTH_FORMAT, "version": 1,
           "meta": {"model": recording, "model_id": session.model_id, "text": session.text_path.name,
                    "text_sha256": sha, "steps": session.steps, "mode": mode},
           "results": sorted(merged.values(), key=lambda r: (r["policy"], r["budget"], r.get(WINDOW, 0)))}
    blob = json.dumps(doc, indent=1).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(blob))
    except OSError:
        pass
    return path


def documents() -> list[tuple[Path, dict]]:
    """Every readable truth document: the shipped ones (``traces/truth-*.json``) first, then those
    measured here (the disk cache's ``truth/``); damaged ones are skipped."""
    from ..data.catalog import TRACES_DIR

    out = []
    for path in sorted(TRACES_DIR.glob("truth-*.json")) + sorted((cache_dir() / "truth").glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if doc.get("format") == TRUTH_FORMAT and isinstance(doc.get("results"), list):
                out.append((path, doc))
        except (OSError, ValueError, UnicodeDecodeError, AttributeError):
            continue
    return out


def known_rows(recording: str, text_sha256: str, steps: int, jobs: Sequence[tuple[str, int, dict]],
               mode: str = "open") -> list[dict | None]:
    """Per job ``(policy, budget, params)``: its row from a truth document of the same recording (the
    model as the recording names it), text and steps, measured in ``mode``; None where none has it. What
    lets ``tune --by kl`` on the shipped bundle answer from the shipped document, with no model run."""
    found: dict[str, dict] = {}
    for _, doc in documents():
        m = doc.get("meta") or {}
        if (str(m.get("model")), str(m.get("text_sha256")), m.get("steps"), m.get("mode", "open")) != (
                recording, text_sha256, steps, mode):
            continue
        for r in doc["results"]:
            if isinstance(r, dict) and isinstance(r.get("params"), dict) and f"kl_{mode}" in r:
                found.setdefault(_ident(r["policy"], r["budget"], r["params"]), r)
    return [found.get(_ident(*job)) for job in jobs]


def _ident(policy: str, budget: int, params: dict) -> str:
    return json.dumps([policy, int(budget), params], sort_keys=True)


def recording_source(meta: dict, folder: Path | None = None, *, text: str | Path | None = None,
                     model: str | None = None) -> tuple[str | None, Path, int]:
    """(model spec for ``quality.load``, text path, steps) of a recording (a bundle's manifest or a
    trace's meta), for measuring its truth; ``text`` and ``model`` override what the recording names.
    QualityError, one line, when the text or the model is not at hand."""
    from .loading import MODEL, SMOLLM2, file_sha256
    from .quality import QualityError
    from .texts import HEAPQ_SHA256, heapq_path

    steps = int(meta.get("steps") or 0)
    if steps < 2:
        raise QualityError("the recording does not say how many steps it has")
    named = str(meta.get("model") or "")
    if model is None:
        if named == MODEL:
            model = "gemma3-270m"
        elif named == SMOLLM2:
            model = "smollm2-135m"
        else:
            spec = named.split(" (")[0]
            if not spec or not Path(spec).is_dir():
                raise QualityError(f"the recording's model ({named or 'not named'}) is not at hand; pass --model FOLDER")
            model = spec
    if text is not None:
        return model, Path(text), steps
    info = meta.get("text") if isinstance(meta.get("text"), dict) else {}
    sha = info.get("sha256") or meta.get("source_sha256")
    name = info.get("file") or ""
    recorded = info.get("path") or meta.get("source_path")  # where it was recorded from (recordings since 2 Dec 2026)
    candidates = [folder / name] if folder is not None and name else []
    if recorded and sha is not None:  # found by its path only when its sha256 says it is the same text
        candidates.insert(0, Path(recorded))
    candidates += sorted(TEXTS_DIR.glob("*")) if TEXTS_DIR.is_dir() else []
    if sha == HEAPQ_SHA256:
        try:
            candidates.insert(0, heapq_path())
        except QualityError:
            pass
    if sha is None:  # nothing to recognise the text by: only the file the bundle names, beside it
        candidates = candidates[:1] if folder is not None and name else []
    for c in candidates:
        if c.is_file() and (sha is None or file_sha256(c) == sha):
            return model, c, steps
    where = ""
    if recorded:
        where = (f" ({recorded} has changed since: its sha256 differs)" if Path(recorded).is_file()
                 else f" ({recorded} is gone)")
    raise QualityError(f"the recording's text ({name or 'not named'}, sha256 {str(sha)[:12]}...) is not at hand{where}; "
                       "pass --text FILE")


#: the shipped texts (traces/texts/README.md)
TEXTS_DIR = Path(__file__).resolve().parents[2] / "traces" / "texts"

#: the study's policies come from the registry (``kvsim.policykit.registry.study_fixed`` and ``study_sweeps``):
#: every compared policy at its defaults, and those with a recent_window swept


def study_jobs(budget: int, windows: Sequence[int], sweeps: Sequence[str] | None = None,
               fixed: Sequence[str] | None = None) -> list[tuple[str, int, dict, str | None]]:
    """(policy, budget, params, sweep) of one model x text x budget of the study: ``sweep`` names the
    window sweep a configuration belongs to (None for the ``fixed`` policies, at their defaults). Left
    out, the registry's: ``study_sweeps()`` and ``study_fixed()``."""
    sweeps = study_sweeps() if sweeps is None else sweeps
    fixed = study_fixed() if fixed is None else fixed
    jobs = [(p, budget, {}, None) for p in fixed]
    jobs += [(p, budget, {window_param(p): w}, p) for p in sweeps for w in windows]
    return jobs


def study(sessions, budgets: Sequence[int], windows: int, closed: dict | None = None, *, proxies: Proxies,
          use_cache: bool = True, progress: Progress | None = None, sweeps: Sequence[str] | None = None,
          fixed: Sequence[str] | None = None) -> list[dict]:
    """The proxy study's rows: for each session (a model on a text, opened lazily: ``sessions`` yields
    them) and budget, every job of ``study_jobs`` with its proxies and open-loop truth; where
    ``closed`` (``{(model_id, text name, budget): [sweep names or None]}``) lists a sweep, its
    configurations get the closed loop too."""
    say = progress or no_progress
    rows = []
    for session in sessions:
        for budget in budgets:
            jobs = study_jobs(budget, even_windows(budget, windows), sweeps, fixed)
            say(None, f"{session.model_id} on {session.text_path.name}, budget {budget}: {len(jobs)} configurations")
            configurations = [session.configuration(*j[:3]) for j in jobs]
            part = measure(session, configurations, ("open",), proxies=proxies, use_cache=use_cache,
                           progress=progress)
            for row, job in zip(part, jobs, strict=True):
                row["sweep"] = job[3]
            wanted = (closed or {}).get((session.model_id, session.text_path.name, budget), [])
            pick = [i for i, j in enumerate(jobs) if j[3] in wanted]
            if pick:
                extra = measure(session, [configurations[i] for i in pick], ("closed",), proxies=proxies, use_cache=use_cache,
                                progress=progress)
                for i, r in zip(pick, extra, strict=True):
                    part[i].update({k: v for k, v in r.items() if k.endswith("_closed")})
            rows += part
    return rows


__all__ = ["TEXTS_DIR", "TRUTH_FORMAT", "Proxies", "recording_source", "save_truth", "truth_path",
           "aggregate", "configuration_proxies", "measure", "proxies_key", "replay_proxies", "study",
           "study_jobs", "window_truth"]

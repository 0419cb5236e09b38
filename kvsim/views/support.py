"""What the app's claims, model and quality views need besides their figures, kept out of
``kvsim.app`` (which is UI only) so that it is tested without Streamlit:

- claims: a mark per verdict, and the link (``?`` + the claim's URL query parameters) that opens the
  view and settings showing a claim, with the trace the app is on;
- model: the trace selectors of the shipped bundles (``gemma3-270m-heapq:L05``) that the trace
  selector offers, and the (layer, KV head) a click on ``model_figures.tune_heatmap`` chose;
- quality: the shipped results of ``python -m kvsim quality`` (``traces/quality-heapq.json``) and
  their rank correlations. Reading them needs no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

from ..analysis.tune import TuneResult
from ..data import catalog, jsontext
from ..policykit.base import WINDOW
from .quality_figures import spearman

# --- claims --------------------------------------------------------------------------------------

#: one mark per verdict of ``claims.VERDICTS``, shown before the claim's id: Streamlit's Material icons
#: (its own font, so they draw in any browser, where emoji need a system font)
VERDICT_MARKS = {"holds": ":material/check_circle:", "fails": ":material/cancel:",
                 "not applicable": ":material/do_not_disturb_on:", "not measured": ":material/help:"}
#: Streamlit's coloured-text names, one per verdict
VERDICT_COLOURS = {"holds": "green", "fails": "red", "not applicable": "gray", "not measured": "orange"}


def claim_link(view: dict, trace: str | None = None) -> str:
    """``?view=...&trace=...``: the claim's view as a relative link to the app. ``trace``: the name
    the app knows the trace by (the ledger writes the trace's own name, which for a bundle's layer
    is not its selector)."""
    params = {k: str(v) for k, v in view.items()}
    if trace is not None and "trace" in params:
        params["trace"] = trace
    return "?" + urlencode(params)


def link_params(link: str) -> dict[str, str]:
    """The query parameters of a link, one value each (the inverse of ``claim_link``)."""
    return {k: v[-1] for k, v in parse_qs(urlsplit(link).query, keep_blank_values=True).items()}


# --- model ---------------------------------------------------------------------------------------


def bundle_trace_names(recorded: bool = False) -> list[str]:
    """Every shipped bundle's traces as ``resolve_trace`` selectors: ``BUNDLE:L05`` where each layer
    has one KV head, else ``BUNDLE:L05H1``; with ``recorded``, then those of the recordings kept in
    the cache directory (``catalog.recorded_bundles``: the long recording, once made)."""
    names = []
    for name in [*catalog.available_bundles(), *(catalog.recorded_bundles() if recorded else ())]:
        try:
            bundle = catalog.resolve_bundle(name)
        except catalog.TraceError:  # a damaged bundle is left out of the selector, not fatal
            continue
        names += [trace_selector(name, t.layer, t.head, len(bundle.heads(t.layer)) == 1) for t in bundle.traces]
    return names


def trace_selector(bundle: str, layer: int, head: int = 0, one_head: bool = True) -> str:
    return f"{bundle}:L{layer:02d}" if one_head else f"{bundle}:L{layer:02d}H{head}"


def selected_row(selection, result: TuneResult) -> tuple[int, int] | None:
    """(layer, KV head) of the first point chosen on ``tune_heatmap`` (its y is the row), or None."""
    try:
        points = selection["selection"]["points"]
    except (KeyError, TypeError):
        return None
    for p in points or []:
        row = p.get("y")
        if isinstance(row, (int, float)) and not isinstance(row, bool) and float(row).is_integer():
            if 0 <= int(row) < len(result.traces):
                t = result.traces[int(row)]
                return t.layer, t.head
    return None


# --- quality -------------------------------------------------------------------------------------

#: the shipped results (read at call time, so tests can point it elsewhere)
QUALITY_RESULTS = catalog.TRACES_DIR / "quality-heapq.json"
#: the command that produced them (and that produces them again, or for another text or budget)
QUALITY_COMMAND = ("python -m kvsim quality heapq --policies sliding_window,streaming_llm,h2o,tova "
                   "--sweep recent_window 8:56:8 --budget 64 --steps 256 --mode both --json")


class QualityResultsError(ValueError):
    """The results file is there but unusable; one line."""


_KEYS = ("policy", "budget", "mode", "params", "steps", "delta_nll", "kl", "retained_mass")


def quality_results(path: str | Path | None = None) -> tuple[list[dict], dict] | None:
    """(results, meta) from a results file (``{"meta": {...}, "results": [...]}``, or the bare list
    that ``--json`` prints); None when there is no file. Raises QualityResultsError when it is
    damaged."""
    path = Path(QUALITY_RESULTS if path is None else path)
    if not path.is_file():
        return None
    try:
        doc = jsontext.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise QualityResultsError(f"{path.name}: not readable JSON ({e})") from None
    results, meta = (doc, {}) if isinstance(doc, list) else (doc.get("results"), doc.get("meta") or {})
    if not isinstance(results, list) or not results:
        raise QualityResultsError(f"{path.name}: no results in it")
    for i, r in enumerate(results):
        missing = [k for k in _KEYS if not isinstance(r, dict) or k not in r]
        if missing:
            raise QualityResultsError(f"{path.name}: result {i} lacks {', '.join(missing)}")
    return results, meta


def cached_quality_results(folder: str | Path | None = None) -> list[dict]:
    """Every result in the quality disk cache (``<cache_dir>/quality/*.json``, written by
    ``python -m kvsim quality``), for the text, model and steps that most of them share (points of
    different runs are not comparable). Damaged files are skipped."""
    from ..data.store import cache_dir

    folder = Path(cache_dir() / "quality" if folder is None else folder)
    if not folder.is_dir():
        return []
    found = []
    for f in sorted(folder.glob("*.json")):
        try:
            record = json.loads(f.read_text(encoding="utf-8"))
            key, result = record["key"], record["result"]
            if all(k in result for k in _KEYS):
                found.append(((key["model"], key["tokens"], key["steps"]), result))
        except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError):
            continue
    if not found:
        return []
    groups: dict[tuple, int] = {}
    for g, _ in found:
        groups[g] = groups.get(g, 0) + 1
    top = max(groups, key=lambda g: (groups[g], g[2]))
    return [r for g, r in found if g == top]


def truth_as_quality(doc: dict, source: str) -> tuple[list[dict], dict, str] | None:
    """A truth document (``kvsim.models.truth``) as quality results: its windows measured open loop (the
    simulator's schedule as masks), each with its delta NLL, KL and retained mass; with its meta and where
    it came from. None when no row carries the three."""
    m = doc.get("meta") or {}
    rows = []
    for r in doc.get("results") or ():
        try:
            rows.append({"policy": str(r["policy"]), "budget": int(r["budget"]), "mode": m.get("mode", "open"),
                         "params": dict(r.get("params") or {}), "steps": int(m.get("steps") or r["steps"]),
                         "delta_nll": float(r["delta_nll_open"]), "kl": float(r["kl_open"]),
                         "retained_mass": float(r["retained_mass"])})
        except (KeyError, TypeError, ValueError):
            continue
    if not rows:
        return None
    return rows, {"what": f"the truth's sweep of {m.get('model')} over {m.get('text')}"}, source


def measured_at(budget: int, sets: Sequence[tuple[list[dict], dict, str]]) -> tuple[list[dict], dict, str, bool]:
    """Of the measured sets ``(results, meta, source)``, the results at ``budget`` (the set with the most
    there), and True; where none is at ``budget``, those at the measured budget nearest it, and False."""
    if not sets:
        raise ValueError("no results to choose from")
    budgets = {r["budget"] for results, _, _ in sets for r in results}
    exact = budget in budgets
    chosen = budget if exact else min(budgets, key=lambda b: (abs(b - budget), b))
    at = [([r for r in results if r["budget"] == chosen], meta, source) for results, meta, source in sets]
    results, meta, source = max((s for s in at if s[0]), key=lambda s: len(s[0]))
    return results, meta, source, exact


def rank_correlations(results: list[dict]) -> dict[str, tuple[float, int]]:
    """Per mode: Spearman's rank correlation of delta NLL against retained mass, and the points.
    A good proxy is close to -1 (more mass kept, less loss)."""
    out = {}
    for mode in ("closed", "open"):
        pts = [r for r in results if r["mode"] == mode]
        if pts:
            out[mode] = (spearman([r["retained_mass"] for r in pts], [r["delta_nll"] for r in pts]), len(pts))
    return out


def swept_policies(results: list[dict], param: str = WINDOW) -> list[str]:
    """The policies with more than one value of ``param`` among the results: the ones with a curve."""
    values: dict[str, set] = {}
    for r in results:
        if param in r["params"]:
            values.setdefault(r["policy"], set()).add(r["params"][param])
    return [p for p, v in values.items() if len(v) > 1]


def rho_text(rho: float) -> str:
    return f"{rho:.3f}" if math.isfinite(rho) else "n/a"


#: the reading of a rank correlation of loss against retained mass: (upper end, verdict, what it means), in
#: order; the sign to hope for is negative (more mass kept, less loss), -1 the best
RHO_READINGS = (
    (-0.7, "a good proxy here", "strong agreement: the runs that keep more mass lose less, nearly always"),
    (-0.4, "a fair proxy here", "moderate agreement: more mass kept mostly goes with less loss, with exceptions"),
    (-0.2, "a weak proxy here", "weak agreement: more mass kept goes with less loss only loosely"),
    (0.2, "no useful agreement", "near 0: retained mass ranks these runs by their loss little better than chance"),
    (1.0, "the wrong way round", "more mass kept goes with *more* loss in these runs"),
)


def rho_reading(rho: float) -> str:
    """What a rank correlation of delta NLL against retained mass says, in words beside its number:
    the verdict, what it means, and which way is good (-1: more mass kept is always less loss)."""
    if not math.isfinite(rho):
        return "**No reading**: too few points, or all alike, to rank."
    upper, verdict, meaning = next(r for r in RHO_READINGS if rho <= r[0])
    side = "" if rho < 0 else f" ({rho:.3f} is on the wrong side of 0)"
    return (f"**{verdict[0].upper()}{verdict[1:]}**: {meaning}{side}. A good proxy is near -1, more mass kept always "
            "less loss; 0 is no relation.")


__all__ = [
    "QUALITY_COMMAND", "QUALITY_RESULTS", "VERDICT_COLOURS", "VERDICT_MARKS", "QualityResultsError",
    "bundle_trace_names", "cached_quality_results", "claim_link", "link_params", "quality_results", "rank_correlations",
    "rho_reading", "rho_text",
    "measured_at", "selected_row", "swept_policies", "trace_selector", "truth_as_quality",
]

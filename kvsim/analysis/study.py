"""The proxy study's verdict (``kvsim proxies``, docs/proxies.md): how well each proxy ranks
configurations as the truth does, and what tuning a window by it costs.

Rows are ``kvsim.models.truth.study``'s: one configuration each, with its model, text, budget, the
window sweep it belongs to (``sweep``, or None), the model-level proxies (``retained_mass``,
``output_error_late``, ...) and the truth (``kl_open``, ``delta_nll_open``, ``kl_closed`` where
measured). A proxy's *score* is the proxy times its sign, so larger always means "keeps more of what
matters"; a good proxy's score falls as the truth's loss rises, and its Spearman with ``-truth`` is near 1.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..policykit.base import WINDOW
from .proxies import PROXIES
from .windows import best_of, regret, spearman

#: the losses the study checks the proxies against (regret is defined for the non-negative ones, the KLs).
#: ``delta_nll_key_*``: delta NLL on the key tokens only (LongPPL's rule, ``kvsim.models.quality``), None in a
#: row whose text has none under the rule
TRUTHS = ("kl_open", "kl_closed", "delta_nll_open", "delta_nll_key_open", "delta_nll_key_closed")
#: what ``kvsim proxies --truth`` names: the open-loop truth each choice ranks the proxies against
TRUTH_CHOICES = {"kl": "kl_open", "delta_nll": "delta_nll_open", "delta_nll_key": "delta_nll_key_open"}


def proxy_names(rows: list[dict]) -> list[str]:
    """The proxies the rows carry (a proxy, or one suffixed ``_late``), in ``PROXIES`` order."""
    keys = set().union(*(r.keys() for r in rows)) if rows else set()
    return [n for base in PROXIES for n in (base, f"{base}_late") if n in keys]


def sign(proxy: str) -> int:
    return PROXIES[proxy.removesuffix("_late")].sign


def _score(row: dict, proxy: str) -> float:
    return sign(proxy) * float(row[proxy])


def _groups(rows: list[dict], by) -> dict:
    out = defaultdict(list)
    for r in rows:
        out[by(r)].append(r)
    return out


def verdict(rows: list[dict]) -> dict:
    """Per proxy and truth: Spearman over each model x text x budget (``overall``: mean and worst) and
    within each window sweep (mean and worst); per proxy and KL truth, the regret of every sweep
    (mean, worst, and which); ``best``: the proxy with the least worst within-sweep open-loop KL regret."""
    cells = _groups(rows, lambda r: (r["model"], r["text"], r["budget"]))
    sweeps = _groups([r for r in rows if r.get("sweep")], lambda r: (r["model"], r["text"], r["budget"], r["sweep"]))
    out = {"proxies": {}, "sweeps": len(sweeps), "cells": len(cells), "configurations": len(rows)}
    for proxy in proxy_names(rows):
        entry = {"sign": sign(proxy)}
        for truth in TRUTHS:
            over = _rhos(cells, proxy, truth)
            within = _rhos(sweeps, proxy, truth)
            if not over and not within:
                continue
            entry[truth] = {"spearman_overall": _stat(over), "spearman_within": _stat(within)}
            if truth.startswith("kl"):
                entry[truth]["regret"] = _regrets(sweeps, proxy, truth)
        out["proxies"][proxy] = entry
    ranked = [(v["kl_open"]["regret"]["worst"], v["kl_open"]["regret"]["mean"], p)
              for p, v in out["proxies"].items() if "kl_open" in v and v["kl_open"]["regret"]["worst"] is not None]
    out["best"] = min(ranked)[2] if ranked else None
    return out


def _rho(members: list[dict], proxy: str, truth: str) -> float | None:
    """Spearman of the proxy's score with ``-truth`` over the rows holding both; None under 3 such rows
    or where either side is constant."""
    have = [r for r in members if r.get(truth) is not None and r.get(proxy) is not None]
    rho = spearman([_score(r, proxy) for r in have], [-float(r[truth]) for r in have]) if len(have) >= 3 else None
    return rho if rho is not None and rho == rho else None  # NaN: constant


def _rho_truths(members: list[dict], a: str, b: str) -> float | None:
    """Spearman of two truths over the rows holding both (None as ``_rho``)."""
    have = [r for r in members if r.get(a) is not None and r.get(b) is not None]
    rho = spearman([float(r[a]) for r in have], [float(r[b]) for r in have]) if len(have) >= 3 else None
    return rho if rho is not None and rho == rho else None


def _rhos(groups: dict, proxy: str, truth: str) -> list[float]:
    return [rho for members in groups.values() if (rho := _rho(members, proxy, truth)) is not None]


def ranking(rows: list[dict], truth: str = "kl_open", beside: tuple[str, ...] = ("kl_open", "delta_nll_open")) -> dict:
    """Which proxy predicts ``truth``: per model x text x budget (a cell), each proxy's Spearman with the
    truth over the cell's configurations (every row of it, sweeps and fixed policies alike, as the
    verdict's ``spearman_overall``), and per proxy the mean and worst over the cells that rank anything,
    best mean first. A cell ranks nothing when fewer than 3 of its rows carry the truth (the key-token
    loss is None where the rule selects no token) or the truth is the same in all of them; it is listed
    with why. Each cell states its ``key_tokens`` (how many positions the key-token loss averages over).
    ``beside``: other truths whose mean Spearman is given over the same cells (``beside_mean``), so that a
    proxy's rank against ``truth`` can be read against how it ranks those; ``truths_agree``: the Spearman
    of ``truth`` with each of them per cell (how far the truths themselves agree), and its mean and worst;
    ``within_sweeps``: each proxy's Spearman with ``truth`` within each window sweep of 3 or more windows
    (the verdict's ``spearman_within``); ``sweeps``: in each such sweep, the window the truth prefers
    against those the other truths and each proxy prefer (``_sweep_picks``)."""
    if truth not in TRUTHS:
        raise ValueError(f"unknown truth {truth!r}; known: {', '.join(TRUTHS)}")
    names = proxy_names(rows)
    cells = []
    for (model, text, budget), members in sorted(_groups(rows, lambda r: (r["model"], r["text"], r["budget"])).items()):
        have = [r for r in members if r.get(truth) is not None]
        counts = sorted({r["key_tokens"] for r in members if r.get("key_tokens") is not None})
        rhos = {p: _rho(members, p, truth) for p in names}
        cell = {"model": model, "text": text, "budget": budget, "configurations": len(members), "with_truth": len(have),
                "key_tokens": counts[0] if len(counts) == 1 else counts or None, "spearman": rhos}
        # how the truth itself ranks the cell's configurations against each of ``beside``
        cell["truths_agree"] = {t: _rho_truths(members, truth, t) for t in beside if t != truth}
        if all(v is None for v in rhos.values()):
            cell["why_none"] = ("the key-token rule selects no position of this text" if truth.startswith("delta_nll_key")
                                and counts == [0] else f"{len(have)} of {len(members)} configurations carry {truth}"
                                if len(have) < 3 else f"{truth} is the same in every configuration")
        cells.append(cell)
    per = []
    groups = _groups(rows, lambda r: (r["model"], r["text"], r["budget"]))
    sweeps = _groups([r for r in rows if r.get("sweep")], lambda r: (r["model"], r["text"], r["budget"], r["sweep"]))
    for p in names:
        used = [c for c in cells if c["spearman"][p] is not None]
        other = {}
        for t in (b for b in beside if b != truth):
            got = [rho for c in used if (rho := _rho(groups[(c["model"], c["text"], c["budget"])], p, t)) is not None]
            other[t] = float(np.mean(got)) if got else None
        per.append({"proxy": p, **_stat([c["spearman"][p] for c in used]), "beside_mean": other,
                    "within_sweeps": _stat(_rhos(sweeps, p, truth))})
    per.sort(key=lambda e: (e["mean"] is None, -(e["mean"] or 0.0), -(e["worst"] or 0.0), e["proxy"]))
    agree = {t: [a for c in cells if (a := c["truths_agree"][t]) is not None] for t in beside if t != truth}
    return {"truth": truth, "proxies": per, "cells": cells, "best": per[0]["proxy"] if per and per[0]["n"] else None,
            "truths_agree": {t: _stat(v) for t, v in agree.items()}, "sweeps": _sweep_picks(sweeps, names, truth, beside)}


def _sweep_picks(sweeps: dict, names: list[str], truth: str, beside: tuple[str, ...]) -> list[dict]:
    """Per window sweep of 3 or more windows holding ``truth``: the window ``truth`` is least at, the
    windows each of ``beside`` is least at, and the window each proxy ranks best with ``truth`` there (the
    first of equal ones, windows ascending: ``best_of``). Not a regret: the key-token loss may be negative."""
    out = []
    for (model, text, budget, name), members in sorted(sweeps.items()):
        have = sorted((r for r in members if r.get(truth) is not None), key=lambda r: r["params"][WINDOW])
        if len(have) < 3:
            continue
        windows = [r["params"][WINDOW] for r in have]
        losses = [float(r[truth]) for r in have]
        least = best_of(losses, -1)
        others = {t: windows[best_of([float(r[t]) for r in have], -1)] for t in beside
                  if t != truth and all(r.get(t) is not None for r in have)}
        picks = {}
        for p in names:
            if all(r.get(p) is not None for r in have):
                i = best_of([_score(r, p) for r in have])
                picks[p] = {"window": windows[i], "truth": losses[i]}
        out.append({"model": model, "text": text, "budget": budget, "sweep": name, "windows": windows,
                    "truth_window": windows[least], "best_truth": losses[least], "beside_windows": others, "picks": picks})
    return out


def _stat(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "worst": None, "n": 0}
    return {"mean": float(np.mean(values)), "worst": float(np.min(values)), "n": len(values)}


def _regrets(sweeps: dict, proxy: str, truth: str) -> dict:
    """Every sweep's regret of ``proxy`` against ``truth``: the windows it recommends and the truth's best."""
    per = []
    for (model, text, budget, name), members in sorted(sweeps.items()):
        have = sorted((r for r in members if r.get(truth) is not None), key=lambda r: r["params"][WINDOW])
        if len(have) < 2:
            continue
        scores = [_score(r, proxy) for r in have]
        losses = [float(r[truth]) for r in have]
        windows = [r["params"][WINDOW] for r in have]
        per.append({"model": model, "text": text, "budget": budget, "sweep": name,
                    "proxy_window": windows[int(np.argmax(scores))], "truth_window": windows[int(np.argmin(losses))],
                    "best_truth": min(losses), "regret": regret(scores, losses)})
    if not per:
        return {"mean": None, "worst": None, "worst_at": None, "sweeps": []}
    worst = max(per, key=lambda x: x["regret"])
    return {"mean": float(np.mean([x["regret"] for x in per])), "worst": worst["regret"],
            "worst_at": {k: worst[k] for k in ("model", "text", "budget", "sweep")}, "sweeps": per}


def agreement(rows: list[dict]) -> dict | None:
    """Open loop against closed where both were measured: Spearman of their KL and the mean ratio."""
    both = [r for r in rows if r.get("kl_closed") is not None and r.get("kl_open") is not None]
    if not both:
        return None
    ratio = [r["kl_open"] / r["kl_closed"] for r in both if r["kl_closed"] > 0]
    rho = spearman([r["kl_open"] for r in both], [r["kl_closed"] for r in both])
    return {"configurations": len(both), "spearman": None if rho != rho else rho,
            "open_over_closed_mean": float(np.mean(ratio)) if ratio else None,
            "open_over_closed_range": [float(min(ratio)), float(max(ratio))] if ratio else None}


__all__ = ["TRUTHS", "TRUTH_CHOICES", "agreement", "proxy_names", "ranking", "sign", "verdict"]

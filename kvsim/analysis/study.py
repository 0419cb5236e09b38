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

from .proxies import PROXIES
from .windows import regret, spearman

#: the losses the study checks the proxies against (regret is defined for the non-negative ones)
TRUTHS = ("kl_open", "kl_closed", "delta_nll_open")


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


def _rhos(groups: dict, proxy: str, truth: str) -> list[float]:
    rhos = []
    for members in groups.values():
        have = [r for r in members if r.get(truth) is not None and r.get(proxy) is not None]
        rho = spearman([_score(r, proxy) for r in have], [-float(r[truth]) for r in have]) if len(have) >= 3 else None
        if rho is not None and rho == rho:  # NaN: constant, or under 3 points
            rhos.append(rho)
    return rhos


def _stat(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "worst": None, "n": 0}
    return {"mean": float(np.mean(values)), "worst": float(np.min(values)), "n": len(values)}


def _regrets(sweeps: dict, proxy: str, truth: str) -> dict:
    """Every sweep's regret of ``proxy`` against ``truth``: the windows it recommends and the truth's best."""
    per = []
    for (model, text, budget, name), members in sorted(sweeps.items()):
        have = sorted((r for r in members if r.get(truth) is not None), key=lambda r: r["params"]["recent_window"])
        if len(have) < 2:
            continue
        scores = [_score(r, proxy) for r in have]
        losses = [float(r[truth]) for r in have]
        windows = [r["params"]["recent_window"] for r in have]
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


__all__ = ["TRUTHS", "agreement", "proxy_names", "sign", "verdict"]

"""Why the canonical trace meets each calibration target: the figures traces/README.md quotes.

    python traces/canonical_anatomy.py            # readable
    python traces/canonical_anatomy.py --json     # one JSON document

What each row is made of, how much of the old attention clears a 256-position cache's fair share, what a
row's top 32 holds, what h2o, scissorhands and streaming_llm hold by kind of position, and the
scissorhands vote counts at the moment a position enters the evictable range. ``--config`` takes
``field=value`` overrides of ``CanonicalConfig`` (``band_noise=0.3 anchors=0 anchor_share=0`` ...), so
the same figures can be compared across versions of the generator. Needs only the core.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, nothing installed
from kvsim import replay  # noqa: E402
from kvsim.data import canonical  # noqa: E402

BUDGET, FROM = 256, 600  # the table's budget; "steady state" figures average steps FROM .. T
KINDS = ["sinks", "ages 1-32", "ages 33-64", "ages 65-256", "old heavy hitters", "opening (< 256)", "other"]


def kinds(t: int, heavy: np.ndarray) -> np.ndarray:
    p = np.arange(t)
    age = t - p
    return np.select([p < 4, age <= 32, age <= 64, age <= 256, np.isin(p, heavy), p < 256], range(6), 6)


def anatomy(config: canonical.CanonicalConfig) -> dict:
    trace = canonical.generate(config)
    A, T = trace.attention, trace.steps
    heavy = np.array(trace.meta["heavy_hitters"])
    anchors = np.array(trace.meta.get("anchors", []), dtype=int)
    out: dict = {"config": {f.name: getattr(config, f.name) for f in fields(config)}}

    at = {}
    for t in (1000, 3000):
        row = A[t, :t].astype(np.float64)
        live = heavy[(heavy < t) & (heavy >= t - config.epoch)]
        at[t] = {"sinks": row[:4].sum(), "newest 64": row[t - 64 :].sum(), "anchors": row[anchors].sum(),
                 "live heavy hitters": row[live].sum(), "ages 65-256": row[t - 256 : t - 64].sum()}
    out["row shares"] = at

    below = above = count = 0.0
    steps = range(300, T + 1, 3)
    for t in steps:
        row = A[t, :t].astype(np.float64)
        old = np.zeros(t, dtype=bool)
        old[4 : max(4, t - 64)] = True
        fair = row >= 1 / BUDGET
        below += row[old & ~fair].sum()
        above += row[old & fair].sum()
        count += (old & fair).sum()
    n = len(steps)
    out["old attention past step 300"] = {"below 1/256": below / n, "above 1/256": above / n, "positions above": count / n}

    top = np.zeros(6)
    steps = range(FROM, T + 1, 3)
    for t in steps:
        row = A[t, :t].astype(np.float64)
        k = np.argsort(-row, kind="stable")[:32]
        age = t - k
        special = np.isin(k, anchors) | np.isin(k, heavy)
        top += [(k < 4).sum(), np.isin(k, anchors).sum(), (np.isin(k, heavy) & (age > 64)).sum(),
                ((age <= 32) & (k >= 4) & ~special).sum(), ((age > 32) & (age <= 64) & ~special).sum(),
                ((age > 252) & (k >= 4)).sum()]
    out["top 32 (mean count)"] = dict(zip(["sinks", "anchors", "heavy hitters older than 64", "band ages 1-32",
                                            "band ages 33-64", "older than 252 (not sinks)"], (top / len(steps)).tolist(),
                                           strict=True))

    band = [(A[t, t - 64 : t][~np.isin(np.arange(t - 64, t), np.concatenate([anchors, heavy]))] > 1 / BUDGET).mean()
            for t in range(300, T + 1, 7)]
    out["band weights above 1/256"] = float(np.mean(band))

    held = {}
    steps = range(FROM, T + 1, 13)
    avail = np.zeros(7)
    for name, params in (("streaming_llm", {}), ("h2o", {"recent_window": 32}), ("scissorhands", {"recent_window": 32}),
                         ("h2o", {"recent_window": 64}), ("scissorhands", {"recent_window": 64})):
        r = replay(trace, name, budget=BUDGET, record_kept=True, **params)
        acc = np.zeros(7)
        for t in steps:
            row = A[t, :t].astype(np.float64)
            kept = r.kept_history[t - 2]
            mask = np.zeros(t, dtype=bool)
            mask[kept[kept >= 0]] = True
            c = kinds(t, heavy)
            for j in range(7):
                acc[j] += row[(c == j) & mask].sum()
                if not held:
                    avail[j] += row[c == j].sum()
        if not held:
            held["available"] = dict(zip(KINDS, (avail / len(steps)).tolist(), strict=True))
        held[f"{name} {params.get('recent_window', '')}".strip()] = dict(zip(KINDS, (acc / len(steps)).tolist(), strict=True))
    out["held, by kind of position"] = held

    r = replay(trace, "scissorhands", budget=BUDGET, recent_window=32, record_scores=True)
    band_in, heavy_in, weakest = [], [], []
    for t in range(FROM, T + 1):
        pos, votes = r.score_positions[t - 1], r.score_history[t - 1]
        ok = pos >= 0
        pos, votes = pos[ok][: ok.sum() - 32], votes[ok][: ok.sum() - 32]  # the evictable range
        entering = pos == t - 32
        if entering.any():
            (heavy_in if (t - 32) in set(heavy.tolist()) else band_in).append(votes[entering][0])
            weakest.append(votes[~entering].min())
    out["scissorhands 32: votes on entering the evictable range"] = {
        "band position (mean)": float(np.mean(band_in)), "heavy hitter (mean)": float(np.mean(heavy_in)) if heavy_in else None,
        "weakest already there (median)": float(np.median(weakest)),
        "steps where the weakest has under 32": float(np.mean(np.array(weakest) < 32))}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--config", nargs="*", default=[], metavar="FIELD=VALUE")
    args = parser.parse_args()
    config = canonical.CanonicalConfig()
    types = {f.name: type(getattr(config, f.name)) for f in fields(config)}
    for item in args.config:
        key, _, value = item.partition("=")
        if key not in types or types[key] is tuple:
            parser.error(f"--config: {key!r} is not a numeric CanonicalConfig field")
        config = replace(config, **{key: types[key](value)})
    doc = anatomy(config)
    if args.json:
        print(json.dumps(doc, indent=1, default=float))
        return 0
    for section, value in doc.items():
        if section == "config":
            continue
        print(section + ":")
        items = value.items() if isinstance(value, dict) else [("", value)]
        for k, v in items:
            if isinstance(v, dict):
                print(f"  {k}: " + ", ".join(f"{kk} {vv:.4f}" for kk, vv in v.items()))
            else:
                print(f"  {k}: {v:.4f}" if k else f"  {v:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

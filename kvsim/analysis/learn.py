"""Fit the ``learned`` policy's linear scorer to the exact optimum's evictions, and judge it on held-out traces
(docs/learned.md; ``kvsim learn``).

The examples: a schedule walked step by step with the learned policy's feature state (``Learned``), so each
step's features are exactly what the online policy computes in that cache. The first round walks the
optimum's own schedule (``kvsim.policies.optimal``); each DAgger round walks the schedule of the policy fitted
so far, so the fit also sees the caches the learner itself reaches, which the optimum never holds. At each
evicting step the candidates are the held positions outside the newest ``recent_window``; the optimum labels
them: doomed (it evicts the position within ``horizon`` steps, or has evicted it already) or kept.

The losses: ``pairs`` (the default), a pairwise logistic loss on (kept, doomed) pairs of one step, the kept one
to score higher; ``choice``, a softmax choice over each step's candidates with the optimum's victim the label
(on its own schedule only). Both are convex, plus ``l2 / 2 * |w|^2``, and minimised by Newton's method with a
backtracking line search (a handful of features: the Hessian is tiny).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data import vectors
from ..data.trace import Trace
from ..policies.learned import (
    ATTENTION_FEATURES,
    FEATURES,
    NEEDS,
    WEIGHTS_ENV,
    WEIGHTS_FORMAT,
    WEIGHTS_VERSION,
    Learned,
    check_weights,
    feature_params,
)
from ..policies.optimal import optimal_schedule
from ..policykit import registry
from ..policykit.base import WINDOW
from ..sim.harness import kept_sum, observe

#: what the fit and the evaluation say as they go: one line each (the CLI prints them on stderr)
Say = Callable[[str], None]


class LearnError(ValueError):
    """Bad input to ``kvsim learn``, said in one line before any fit."""


@dataclass
class Examples:
    """The examples of one or more (trace, budget) walks: each evicting step's candidates' features stacked,
    ``starts[k]`` the first row of step k's candidates (``starts[-1]``: the total), ``victim[k]`` the row of its
    victim (-1 when the optimum's victim was inside the recent window), ``doomed`` per row: whether the optimum
    evicts that candidate within ``horizon`` steps of the step (its victim included)."""

    X: np.ndarray
    starts: np.ndarray
    victim: np.ndarray
    doomed: np.ndarray

    @property
    def steps(self) -> int:
        return self.victim.size

    @property
    def skipped(self) -> int:
        """Steps whose victim was inside the recent window: the choice loss leaves them out."""
        return int((self.victim < 0).sum())

    def chosen(self) -> Examples:
        """The steps whose victim is a candidate (the choice loss's examples)."""
        keep = self.victim >= 0
        sizes = np.diff(self.starts)
        rows = np.repeat(keep, sizes)
        new_sizes = sizes[keep]
        starts = np.concatenate([[0], np.cumsum(new_sizes)]).astype(np.int64)
        victim = starts[:-1] + (self.victim[keep] - self.starts[:-1][keep])
        return Examples(self.X[rows], starts, victim, self.doomed[rows])


def check_inputs(traces: Sequence[Trace], budgets: Sequence[int], features: Sequence[str], recent_window: int) -> None:
    """Every bad input refused in one line before any work: unknown or repeated features, a feature needing a
    member a trace lacks, a budget a trace cannot evict at, a recent window the budget cannot hold."""
    if not features:
        raise LearnError("--features: at least one feature")
    for f in features:
        if f not in FEATURES:
            raise LearnError(f"--features: unknown feature {f!r} (known: {', '.join(FEATURES)})")
    if len(set(features)) != len(features):
        raise LearnError("--features: a feature named twice")
    for b in budgets:
        if b < 1:
            raise LearnError(f"--budget {b}: must be at least 1")
        if recent_window >= b:
            raise LearnError(f"--recent-window {recent_window} must be below --budget {b}")
    for tr in traces:
        for f in features:
            lacking = vectors.missing(tr, NEEDS.get(f, ()))
            if lacking:
                raise LearnError(f"{tr.name}: feature {f} needs {lacking[0]}, which this trace does not hold; "
                                 f"{vectors.HOW[lacking[0]]} (or leave {f} out of --features)")
        for b in budgets:
            if tr.steps < b:
                raise LearnError(f"{tr.name}: budget {b} is never reached in its {tr.steps} steps, so nothing is "
                                 f"evicted to learn from (a budget of at most {tr.steps})")


def weights_template(features: Sequence[str], recent_window: int) -> dict:
    n = len(features)
    return {"format": WEIGHTS_FORMAT, "version": WEIGHTS_VERSION, "features": list(features),
            "feature_params": feature_params(), "mean": [0.0] * n, "scale": [1.0] * n, "weights": [0.0] * n,
            WINDOW: recent_window}


def walk(trace: Trace, budget: int, features: Sequence[str], recent_window: int, stride: int = 1,
         horizon: int = 32, behaviour: dict | None = None) -> Examples:
    """A schedule of ``trace`` at ``budget`` walked with the learned policy's feature state: the optimum's own
    (``behaviour`` None), or that of the learned policy with the weights ``behaviour`` (a DAgger round: the
    caches the learner itself reaches, labelled by the optimum). One example per evicting step with at least two
    candidates (every ``stride``-th step kept), as ``Examples``; a candidate is doomed when the optimum evicts it
    within ``horizon`` steps or has evicted it already."""
    schedule = optimal_schedule(trace, budget)
    victims, evicted_at = schedule.victims, schedule.evicted_at()
    if behaviour is not None and list(behaviour["features"]) != list(features):
        raise LearnError("a DAgger round walks with weights of the same features")
    policy = Learned(budget, recent_window=recent_window,
                     weights=behaviour if behaviour is not None else weights_template(features, recent_window))
    members = vectors.require(trace, policy.reads, policy.name)
    store = trace.derived
    out = store.row_scratch()
    if members:
        policy.see(0, vectors.at(members, 0))
    blocks, starts, vict, doomed, row0 = [], [], [], [], 0
    for t in range(1, trace.steps + 1):
        kept = policy.kept
        row = store.row(t, kept, out)
        if members:
            policy.see(t, vectors.at(members, t))
        policy.on_decode_step(t, observe(row[kept], kept_sum(row, kept)))
        if t < budget:
            continue
        v = int(victims[t - budget])
        held = policy.kept
        m = policy.evictable()
        if (t - budget) % stride == 0 and m > 1:
            i = int(np.searchsorted(held, v))
            blocks.append(policy.feature_matrix()[:m])
            doomed.append(evicted_at[held[:m]] <= t + horizon)
            starts.append(row0)
            vict.append(row0 + i if i < m and held[min(i, m - 1)] == v else -1)
            row0 += m
        if behaviour is None:
            policy.evict_position(v)
        else:
            policy.evict(budget)
    X = np.concatenate(blocks) if blocks else np.zeros((0, len(features)))
    return Examples(X, np.asarray([*starts, row0], dtype=np.int64), np.asarray(vict, dtype=np.int64),
                    np.concatenate(doomed) if doomed else np.zeros(0, dtype=bool))


def merge(parts: Sequence[Examples]) -> Examples:
    X, starts, vict, off = [], [], [], 0
    for e in parts:
        X.append(e.X)
        starts.append(e.starts[:-1] + off)
        vict.append(np.where(e.victim >= 0, e.victim + off, -1))
        off += e.X.shape[0]
    return Examples(np.concatenate(X), np.concatenate([*starts, [off]]).astype(np.int64), np.concatenate(vict),
                    np.concatenate([e.doomed for e in parts]))


def _objective(w: np.ndarray, Z: np.ndarray, starts: np.ndarray, victim: np.ndarray, l2: float, hessian: bool):
    """Mean negative log-likelihood of the victims under ``P(i) ∝ exp(-z_i . w)`` per step, plus ``l2/2 |w|^2``;
    its gradient and (with ``hessian``) its Hessian."""
    k = victim.size
    s = -(Z @ w)  # the logit of being evicted
    seg = starts[:-1]
    mx = np.maximum.reduceat(s, seg)
    counts = np.diff(starts)
    e = np.exp(s - np.repeat(mx, counts))
    tot = np.add.reduceat(e, seg)
    p = e / np.repeat(tot, counts)
    nll = float(np.sum(np.log(tot) + mx - s[victim])) / k + 0.5 * l2 * float(w @ w)
    # d(-s_v + lse)/dw = z_v - sum p_j z_j  (s = -z.w)
    pz = np.add.reduceat(p[:, None] * Z, seg, axis=0)  # (k, F): each step's expected z
    grad = (Z[victim].sum(axis=0) - pz.sum(axis=0)) / k + l2 * w
    if not hessian:
        return nll, grad, None
    H = (Z.T @ (p[:, None] * Z) - pz.T @ pz) / k + l2 * np.eye(w.size)
    return nll, grad, H


def pairs(ex: Examples, per_step: int = 64, seed: int = 0) -> np.ndarray:
    """``(n, 2)`` rows of ``ex``: (one the optimum keeps past the horizon, one it evicts within it), from the same
    step, up to ``per_step`` per step drawn without replacement (a seeded draw: the fit is deterministic)."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(ex.steps):
        lo, hi = int(ex.starts[k]), int(ex.starts[k + 1])
        d = ex.doomed[lo:hi]
        gone, kept = np.flatnonzero(d) + lo, np.flatnonzero(~d) + lo
        if not gone.size or not kept.size:
            continue
        n = gone.size * kept.size
        pick = rng.choice(n, size=min(per_step, n), replace=False) if n > per_step else np.arange(n)
        out.append(np.stack([kept[pick % kept.size], gone[pick // kept.size]], axis=1))
    return np.concatenate(out) if out else np.zeros((0, 2), dtype=np.int64)


def _pair_objective(w: np.ndarray, D: np.ndarray, l2: float, hessian: bool):
    """Mean ``log(1 + exp(-d . w))`` over the pairs' differences ``d = z_kept - z_evicted`` (the kept one should
    score higher), plus ``l2/2 |w|^2``; its gradient and (with ``hessian``) its Hessian."""
    m = D @ w
    loss = float(np.mean(np.logaddexp(0.0, -m))) + 0.5 * l2 * float(w @ w)
    q = 0.5 * (1.0 - np.tanh(m / 2))  # sigma(-m), without overflow
    grad = -(D.T @ q) / D.shape[0] + l2 * w
    if not hessian:
        return loss, grad, None
    H = (D.T @ ((q * (1 - q))[:, None] * D)) / D.shape[0] + l2 * np.eye(w.size)
    return loss, grad, H


@dataclass
class Fit:
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    loss: float
    iterations: int
    examples: int  # steps (choice) or pairs (pairs) fitted on


#: the losses ``fit`` minimises (docs/learned.md says why each)
LOSSES = ("pairs", "choice")


def _newton(objective, w: np.ndarray, iterations: int, say: Say | None):
    loss, g, H = objective(w, True)
    it = 0
    for it in range(1, iterations + 1):
        step = np.linalg.solve(H, g)
        dec = float(g @ step)
        if dec / 2 < 1e-10:
            break
        a = 1.0
        while True:
            cand = w - a * step
            new, _, _ = objective(cand, False)
            if new <= loss - 0.25 * a * dec or a < 1e-6:
                break
            a /= 2
        w = cand
        loss, g, H = objective(w, True)
        if say:
            say(f"learn: Newton iteration {it}: loss {loss:.4f} (step {a:g})")
    return w, loss, it


def fit(ex: Examples, loss: str = "pairs", l2: float = 1e-3, per_step: int = 64, iterations: int = 30,
        say: Say | None = None) -> Fit:
    """Newton's method on ``loss`` over standardised features (``Fit``); ``say`` hears one line per iteration."""
    if loss not in LOSSES:
        raise LearnError(f"--loss {loss!r}: one of {', '.join(LOSSES)}")
    if ex.steps == 0:
        raise LearnError("no evicting step with two candidates outside the recent window to learn from")
    mean = ex.X.mean(axis=0)
    scale = ex.X.std(axis=0)
    scale[scale <= 1e-12] = 1.0
    Z = (ex.X - mean) / scale
    w0 = np.zeros(Z.shape[1])
    if loss == "choice":
        ch = ex.chosen()
        if ch.steps == 0:
            raise LearnError("every victim of the optimum is inside the recent window: nothing to choose from")
        Zc = (ch.X - mean) / scale
        w, value, it = _newton(lambda v, h: _objective(v, Zc, ch.starts, ch.victim, l2, h), w0, iterations, say)
        n = ch.steps
    else:
        P = pairs(ex, per_step)
        if not P.size:
            raise LearnError("no step where the optimum both keeps and evicts a candidate within the horizon")
        D = Z[P[:, 0]] - Z[P[:, 1]]
        w, value, it = _newton(lambda v, h: _pair_objective(v, D, l2, h), w0, iterations, say)
        n = P.shape[0]
    return Fit(mean, scale, w, value, it, n)


def learn(traces: Sequence[Trace], budgets: Sequence[int], features: Sequence[str] = ATTENTION_FEATURES,
          recent_window: int = 16, loss: str = "pairs", horizon: int = 32, dagger: int = 3, l2: float = 1e-3,
          stride: int = 1, per_step: int = 64, say: Say | None = None) -> dict:
    """Fit on every (trace, budget): the weights document (``kvsim.policies.learned``'s format). The first fit is
    on the optimum's own schedules; each of ``dagger`` further rounds walks the schedules of the policy fitted so
    far, labels the caches it reaches by the optimum (``walk``), adds them to the examples and fits again."""
    check_inputs(traces, budgets, features, recent_window)
    if loss not in LOSSES:
        raise LearnError(f"--loss {loss!r}: one of {', '.join(LOSSES)}")
    if dagger < 0 or horizon < 0:
        raise LearnError("--dagger and --horizon must be non-negative")
    say = say or (lambda line: None)
    parts: list[Examples] = []
    weights = None
    f = None
    for rnd in range(dagger + 1):
        whose = "the optimum's schedule" if weights is None else f"the schedule of round {rnd - 1}'s fit (DAgger)"
        for tr in traces:
            for b in budgets:
                start = time.perf_counter()
                e = walk(tr, b, features, recent_window, stride, horizon, behaviour=weights)
                parts.append(e)
                say(f"learn: round {rnd}: {tr.name} at budget {b}, along {whose}: {e.steps} steps, {e.X.shape[0]} "
                    f"candidates ({time.perf_counter() - start:.1f} s)")
        ex = merge(parts)
        start = time.perf_counter()
        f = fit(ex, loss=loss, l2=l2, per_step=per_step, say=say)
        say(f"learn: round {rnd}: fitted in {time.perf_counter() - start:.1f} s on {f.examples} "
            f"{'pairs' if loss == 'pairs' else 'steps'}: loss {f.loss:.4f}")
        weights = {**weights_template(features, recent_window), "mean": [float(x) for x in f.mean],
                   "scale": [float(x) for x in f.scale], "weights": [float(x) for x in f.weights]}
    words = {"pairs": f"pairwise logistic: at one step, a candidate the optimum holds past {horizon} more steps "
                      f"against one it evicts within them or has evicted already; up to {per_step} pairs a step",
             "choice": "softmax choice over the evictable positions, the optimum's victim the label"}
    first = parts[: len(traces) * len(budgets)]
    doc = {**weights, "budgets": list(budgets), "fitted_on": [tr.name for tr in traces],
           "fit": {"loss": loss, "loss_words": words[loss], "horizon": horizon, "dagger": dagger, "l2": l2,
                   "stride": stride, "per_step": per_step, "steps": ex.steps, "candidates": int(ex.X.shape[0]),
                   "examples": f.examples, "optimum_steps": sum(e.steps for e in first),
                   "skipped_inside_window": sum(e.skipped for e in first), "final_loss": round(f.loss, 6),
                   "iterations": f.iterations}}
    return check_weights(doc)


# --------------------------------------------------------------------------------------------
# held-out evaluation

#: the hand-written policies the learned one is compared with, where the trace holds what they read
BASELINES = ("h2o", "tova", "snapkv", "keydiff", "critical", "expected_attention")


def runnable(trace: Trace, name: str) -> bool:
    return not vectors.missing(trace, registry.policy_class(name).reads, meta=registry.reads_meta(name))


#: the page size of the serving layout the study also measures (vLLM's 16; docs/serving.md)
PAGE = 16
#: the policies measured in pages too (the scorers beyond attention are slow on the layered reference path)
PAGED = ("learned", "h2o", "tova", "snapkv", "optimal")


@contextmanager
def _weights_by_name(weights: dict):
    """While open, ``make_policy("learned", ...)`` (what a layout's replay builds) reads ``weights``."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "weights.json"
        path.write_text(json.dumps(weights), encoding="utf-8")
        before = os.environ.get(WEIGHTS_ENV)
        os.environ[WEIGHTS_ENV] = str(path)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(WEIGHTS_ENV, None)
            else:
                os.environ[WEIGHTS_ENV] = before


def _closed(mass: dict) -> float:
    gap = mass["optimal"] - mass["h2o"]
    return (mass["learned"] - mass["h2o"]) / gap if gap > 0 else math.nan


def evaluate(traces: Sequence[Trace], budgets: Sequence[int], weights: dict, say: Say | None = None,
             pages: bool = True) -> list[dict]:
    """For each trace and budget: the retained mass of ``learned`` (these weights, their recent window), of each
    baseline that runs on the trace (at its defaults) and of the optimum, and the share of the h2o-to-optimum gap
    the learned policy closes; with ``pages``, the same for ``PAGED`` in pages of ``PAGE`` positions (the optimum
    under pages)."""
    from ..policykit.layouts import Layout
    from ..sim.simulate import replay

    say = say or (lambda line: None)
    rows = []
    rw = weights[WINDOW]
    for tr in traces:
        for b in budgets:
            if rw >= b or tr.steps < b:
                raise LearnError(f"{tr.name}: cannot evaluate at budget {b} (recent window {rw}, {tr.steps} steps)")
            start = time.perf_counter()
            mass = {}
            mass["learned"] = replay(tr, Learned(b, recent_window=rw, weights=weights)).retained_mass
            for name in BASELINES:
                if runnable(tr, name):
                    mass[name] = replay(tr, name, budget=b).retained_mass
            mass["optimal"] = optimal_schedule(tr, b).retained_mass
            closed = _closed(mass)
            best = max((n for n in mass if n not in ("learned", "optimal")), key=mass.get)
            row = {"trace": tr.name, "model": tr.meta.get("model"), "text": tr.meta.get("source"),
                   "budget": b, "retained_mass": {k: round(v, 6) for k, v in mass.items()},
                   "gap_closed": round(closed, 6), "best_hand_written": best}
            if pages and b >= 2 * PAGE:
                with _weights_by_name(weights):
                    paged = {n: replay(tr, n, budget=b, layout=Layout(PAGE),
                                       **({WINDOW: rw} if n == "learned" else {})).retained_mass for n in PAGED}
                row["pages"] = {"block_size": PAGE, "retained_mass": {k: round(v, 6) for k, v in paged.items()},
                                "gap_closed": round(_closed(paged), 6),
                                "best_hand_written": max((n for n in paged if n not in ("learned", "optimal")),
                                                         key=paged.get)}
            rows.append(row)
            say(f"learn: evaluated {tr.name} at budget {b} ({time.perf_counter() - start:.1f} s): learned "
                f"{mass['learned']:.4f}, h2o {mass['h2o']:.4f}, optimal {mass['optimal']:.4f}, gap closed {closed:.1%}"
                + (f"; in pages of {PAGE}: gap closed {row['pages']['gap_closed']:.1%}" if "pages" in row else ""))
    return rows

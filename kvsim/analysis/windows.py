"""The one rule that names a recent_window "best" and "recommended", wherever one is shown (the app's
curve, ``kvsim sweep``, ``table``, ``claims``, ``tune``, the truth view and the model view).

- **best**: the window with the largest retained mass, the smallest of equal ones (``best_of``: of any
  figure, larger or smaller better; ``best_row``: of a sweep's rows; ``sweep_coarse_to_fine`` searches
  a wide range by it);
- **recommended**: the smallest window whose retained mass is within ``tolerance`` (``TOLERANCE``,
  0.005) of the best's. Past it the curve is flat, and a smaller window leaves more of the cache to
  the heavy hitters.

Both are *exact* only when every window ``1 .. budget - 1`` was measured: the top of a curve is often
flat and noisy, so a grid (even one refined around its peak) can stop on a local maximum. A choice
made from a sample says so (``exact`` False; ``sentence`` calls its best the peak so far).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..policykit.base import WINDOW
from ..progress import Progress
from ..sim.harness import DEFAULT_TOP_K

#: a window is recommended when its retained mass is within this much of the best's
TOLERANCE = 0.005


@dataclass(frozen=True)
class WindowChoice:
    best: int
    best_mass: float
    recommended: int
    recommended_mass: float
    tolerance: float
    #: every window 1 .. budget - 1 was measured (else the choice is of the windows sampled)
    exact: bool

    def sentence(self, digits: int = 3) -> str:
        """The choice in words, labelled: ``best 196 (0.776); recommended 134 (0.771): the smallest
        within 0.005 of it``, or for a sample ``peak so far 211 (0.775), of the windows sampled``."""
        if not self.exact:
            return (f"peak so far {self.best} ({self.best_mass:.{digits}f}), of the windows sampled; "
                    f"the smallest sampled within {self.tolerance:g} of it: {self.recommended}")
        return (f"best {self.best} ({self.best_mass:.{digits}f}); recommended {self.recommended} "
                f"({self.recommended_mass:.{digits}f}): the smallest within {self.tolerance:g} of it")

    def to_dict(self) -> dict:
        return asdict(self)


def best_of(figure: Sequence[float] | np.ndarray, sign: int = +1) -> int:
    """The index of the best of ``figure`` (ordered by ascending window): the largest ``sign * figure``
    (``sign`` -1 for a loss such as the truth's KL), the first of equal ones."""
    f = np.asarray(figure, dtype=np.float64)
    if f.size == 0:
        raise ValueError("no windows to choose from")
    return int(np.argmax(sign * f))


def best_row(rows: Sequence[Mapping], metric: str = "retained_mass") -> Mapping:
    """The row of a sweep with the largest ``metric``; the first such row on ties (the smallest swept
    value when the values ascend)."""
    if not rows:
        raise ValueError("no rows")
    return rows[best_of([r[metric] for r in rows])]


def pick(mass: Sequence[float] | np.ndarray, tolerance: float = TOLERANCE) -> tuple[int, int]:
    """Indices into ``mass`` (ordered by ascending window): the best (the first of equal masses) and
    the recommended (the first within ``tolerance`` of the best)."""
    m = np.asarray(mass, dtype=np.float64)
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be at least 0, got {tolerance}")
    best = best_of(m)
    return best, int(np.flatnonzero(m >= m[best] - tolerance)[0])


def sweep_coarse_to_fine(
    trace,
    policy,
    budget: int,
    param: str,
    low: int,
    high: int,
    *,
    marks: Iterable[int] = (),
    points: int = 32,
    refine: bool = True,
    top_k: int = DEFAULT_TOP_K,
    progress: Progress | None = None,
    run=None,
    **params,
) -> list[dict]:
    """A sweep (``kvsim.sim.simulate.sweep``, or ``run`` with its signature) of ``param`` over ``low .. high`` that costs a few times
    ``points`` replays however wide the range: an even grid of about ``points`` values plus ``marks``
    (values a view must show exactly: a default, a band, the current setting); then, with ``refine``,
    grids eight times finer around the best so far (``best_row``), down to every value next to it. The
    maximum is found exactly when the curve has one peak (else the best of the values tried). Rows come
    back sorted by ``param``; when the range has at most ``points`` values it is simply the full sweep.
    ``policy``: a ``PolicySpec`` (its ``param`` replaced at each value) or a registry name.
    """
    if run is None:
        from ..sim.simulate import sweep  # the engine loads with the first sweep, not with the rule
    else:
        sweep = run
    if high < low:
        raise ValueError(f"sweep over {param} needs low <= high, got {low}..{high}")
    points = max(2, points)
    stride = max(1, -(-(high - low + 1) // points))
    done: dict[int, dict] = {}
    todo = sorted(set(range(low, high + 1, stride)) | {high} | {m for m in marks if low <= m <= high})
    rounds = 1
    while stride > 1 and refine:  # how many refinements will follow: for the progress fraction
        stride = max(1, stride // 8)
        rounds += 1
    stride = max(1, -(-(high - low + 1) // points))
    for r in range(rounds):
        report = None if progress is None else (lambda f, r=r: progress((r + f) / rounds))
        for row in sweep(trace, policy, budget, param, todo, top_k=top_k, progress=report, **params) if todo else []:
            done[row[param]] = row
        if r == rounds - 1:
            break
        peak = best_row([done[v] for v in sorted(done)])[param]
        finer = max(1, stride // 8)
        todo = [v for v in range(max(low, peak - stride + 1), min(high, peak + stride - 1) + 1, finer) if v not in done]
        stride = finer
    if progress is not None:
        progress(1.0)
    return [done[v] for v in sorted(done)]


def covers(windows: Iterable[int], budget: int) -> bool:
    """Whether ``windows`` hold every recent_window a budget allows (1 .. budget - 1)."""
    return set(range(1, budget)) <= {int(w) for w in windows}


def choose_window(
    rows: Sequence[Mapping] | None = None,
    *,
    windows: Sequence[int] | None = None,
    mass: Sequence[float] | np.ndarray | None = None,
    tolerance: float = TOLERANCE,
    budget: int | None = None,
    exact: bool | None = None,
    param: str = WINDOW,
    metric: str = "retained_mass",
) -> WindowChoice:
    """The best and recommended windows of a sweep: ``rows`` (dicts with ``param`` and ``metric``) or
    ``windows`` with their ``mass``. ``exact``: as given, else whether the windows cover ``1 .. budget
    - 1`` (False without a ``budget``)."""
    if rows is not None:
        windows = [int(r[param]) for r in rows]
        mass = [float(r[metric]) for r in rows]
    if windows is None or mass is None:
        raise ValueError("choose_window needs rows, or windows with their mass")
    w = np.asarray(windows, dtype=np.int64)
    m = np.asarray(mass, dtype=np.float64)
    if w.shape != m.shape:
        raise ValueError(f"{w.size} windows but {m.size} masses")
    order = np.argsort(w, kind="stable")
    w, m = w[order], m[order]
    best, rec = pick(m, tolerance)
    if exact is None:
        exact = budget is not None and covers(w.tolist(), budget)
    return WindowChoice(best=int(w[best]), best_mass=float(m[best]), recommended=int(w[rec]),
                        recommended_mass=float(m[rec]), tolerance=float(tolerance), exact=bool(exact))


def ranks(x: Sequence[float] | np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing the mean of the ranks they span."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    r = np.empty(x.size, dtype=np.float64)
    r[order] = np.arange(1, x.size + 1)
    values, inverse = np.unique(x, return_inverse=True)
    if values.size < x.size:
        r = (np.bincount(inverse, weights=r) / np.bincount(inverse))[inverse]
    return r


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank); NaN with fewer than 3 points or when
    either side is constant."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"spearman needs two 1-D sequences of one length, got {x.shape} and {y.shape}")
    if x.size < 3:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def regret(score: Sequence[float], truth: Sequence[float]) -> float:
    """docs/domain.md, "The truth": ``truth(the window the proxy recommends) / best truth - 1``, where the proxy
    recommends the window with the largest ``score`` (the first of equal ones: windows ascending) and
    the truth is a loss (KL: smaller is better, never negative). 0 when the best truth is 0 and the
    proxy found it; infinite when it is 0 and the proxy did not."""
    s, t = np.asarray(score, dtype=np.float64), np.asarray(truth, dtype=np.float64)
    if s.size == 0 or s.shape != t.shape:
        raise ValueError("regret needs one truth per score, at least one")
    picked, best = float(t[best_of(s)]), float(t[best_of(t, -1)])
    if best <= 0:
        return 0.0 if picked <= best else float("inf")
    return picked / best - 1.0


__all__ = ["TOLERANCE", "WindowChoice", "best_of", "best_row", "choose_window", "covers", "pick", "ranks", "regret",
           "spearman", "sweep_coarse_to_fine"]

"""Proxies of what an eviction costs the model, computed from a replay's kept sets (docs/proxies.md).

Retained mass asks how much of each row's attention the cache still holds. The model reads more
than that: it reads the attention *output*, the weights times the values. With each position's value
vector beside the attention (a trace's optional ``values``, ``(T + 1, d)``), the kept cache's output
can be compared with the full cache's at every step:

- ``retained_mass``: the share of row t's weight on the kept set (what the replay reports);
- ``value_mass``: the same share with each position weighted by the norm of its value (a position
  the model attends to but whose value is near zero moves the output little);
- ``output_error``: ``|o_kept - o_full| / |o_full|``, where ``o_full = sum_p a_t(p) v_p`` over the
  whole past and ``o_kept`` is the same sum over the kept set with the kept weights renormalised
  (what a softmax over the kept keys gives). The trace's row is the mean of the query heads sharing
  the KV head, so this is the error of the mean of their outputs (the sum is linear in the weights);
- ``output_shift``: ``|o_kept - o_full|`` unnormalised: layers and heads with large outputs count more.

Everything is computed by ``step_proxies`` from a per-step kept set (``kept_history``, as
``replay(..., record_kept=True)`` gives it for the engine and the reference harness alike), so the two
paths agree by construction, and a long trace can feed it in chunks of steps. A trace without values
falls back to retained mass, and says so (``fallback_note``).

They reduce replays to figures, so they are analysis: the replays come from ``kvsim.sim.simulate``
(``sweep(..., summarise=summary)``), and the model side (``kvsim.models.truth``, on the same level)
is handed ``configuration`` by the entry point that asks it for a configuration's proxies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.trace import Trace
from ..policies import PolicySpec
from ..sim import simulate
from ..sim.harness import DEFAULT_TOP_K, ReplayResult
from ..sim.simulate import even_windows


@dataclass(frozen=True)
class Proxy:
    name: str
    label: str
    #: +1: larger is better (a mass); -1: smaller is better (an error)
    sign: int
    needs_values: bool


PROXIES: dict[str, Proxy] = {p.name: p for p in (
    Proxy("retained_mass", "retained attention mass", +1, False),
    Proxy("top_k_recall", "top-k recall", +1, False),
    Proxy("value_mass", "value-norm-weighted mass", +1, True),
    Proxy("output_error", "attention-output error (relative L2)", -1, True),
    Proxy("output_shift", "attention-output shift (absolute L2)", -1, True),
)}
#: the proxies ``step_proxies`` computes (the other two come with every replay)
VALUE_PROXIES = tuple(n for n, p in PROXIES.items() if p.needs_values)
#: rows of the trace handled at once: (rows x T) weights in float64
_CHUNK = 256


def check_proxy(name: str) -> Proxy:
    """The proxy called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PROXIES[name]
    except KeyError:
        raise ValueError(f"unknown proxy {name!r}; known: {', '.join(PROXIES)}") from None


def fallback_note(trace: Trace, proxy: str) -> str | None:
    """One line when ``proxy`` cannot be computed on ``trace`` (the figure is then retained mass,
    labelled so): it needs values the trace does not carry, or whole rows a long query/key trace does
    not form here; None when it can be."""
    if not check_proxy(proxy).needs_values:
        return None
    if getattr(trace, "values", None) is None:
        return (f"{trace.name}: the trace carries no values, so {PROXIES[proxy].label} falls back to retained mass "
                f"(record it again with kvsim record to store them)")
    if trace.derived.no_matrix() is not None:
        return (f"{trace.name}: a query/key trace of {trace.steps} steps has no dense matrix here, so "
                f"{PROXIES[proxy].label} (it reads whole rows) falls back to retained mass")
    return None


def not_applicable(trace: Trace) -> str | None:
    """Why the value-aware proxies are not measured on ``trace``, plainly (no fallback named: the CLI
    reports them as not applicable and shows what is measured); None when they are."""
    if getattr(trace, "values", None) is None:
        return (f"{trace.name} carries attention only, no values: the value-aware proxies weigh what is kept by the "
                "values; a recording by kvsim record stores them")
    if trace.derived.no_matrix() is not None:
        return (f"{trace.name}, a query/key trace of {trace.steps} steps, forms no dense matrix here, and the value-aware "
                "proxies read whole rows")
    return None


def kept_before(kept_history: np.ndarray, t0: int = 1, t1: int | None = None) -> np.ndarray:
    """bool ``(t1 - t0, T + 1)``: row ``t - t0`` holds the positions kept when query t came (steps
    ``t0 .. t1 - 1``): ``[0]`` for step 1, else what was kept after step t - 1."""
    kept = np.asarray(kept_history)
    T = kept.shape[0]
    t1 = T + 1 if t1 is None else t1
    out = np.zeros((t1 - t0, T + 1), dtype=bool)
    for i, t in enumerate(range(t0, t1)):
        if t == 1:
            out[i, 0] = True
        else:
            row = kept[t - 2]
            out[i, row[row >= 0]] = True
    return out


def step_proxies(attention: np.ndarray, values: np.ndarray, kept_history: np.ndarray) -> dict[str, np.ndarray]:
    """Per-step series (steps 1 .. T, float64) of each of ``VALUE_PROXIES``, from the full-cache rows
    ``attention`` ``(T + 1, T + 1)``, the values ``(T + 1, d)`` and a replay's ``kept_history``."""
    A = np.asarray(attention)
    V = np.asarray(values, dtype=np.float64)
    T = A.shape[0] - 1
    if V.shape[0] != T + 1:
        raise ValueError(f"values have {V.shape[0]} rows, the trace {T + 1}")
    norms = np.linalg.norm(V, axis=1)
    out = {name: np.empty(T) for name in VALUE_PROXIES}
    for t0 in range(1, T + 1, _CHUNK):
        t1 = min(t0 + _CHUNK, T + 1)
        rows = A[t0:t1].astype(np.float64)
        kept = kept_before(kept_history, t0, t1)
        w = np.where(kept, rows, 0.0)
        total, held = rows.sum(axis=1), w.sum(axis=1)  # a float32 row sums to 1 only to 1e-7: divide both
        o_full = (rows @ V) / np.where(total > 0, total, 1.0)[:, None]
        o_kept = (w @ V) / np.where(held > 0, held, 1.0)[:, None]
        shift = np.linalg.norm(o_kept - o_full, axis=1)
        full_norm = np.linalg.norm(o_full, axis=1)
        vn_all = rows @ norms
        s = slice(t0 - 1, t1 - 1)
        out["value_mass"][s] = np.divide(w @ norms, vn_all, out=np.ones(t1 - t0), where=vn_all > 0)
        out["output_error"][s] = np.divide(shift, full_norm, out=np.zeros(t1 - t0), where=full_norm > 0)
        out["output_shift"][s] = shift
    return out


def summary(trace: Trace, result: ReplayResult) -> dict:
    """``result.summary()`` with the mean of each value proxy beside the mass (``result`` replayed
    with ``record_kept``); where they cannot be computed (``fallback_note``), each is None (``score``
    then ranks by retained mass) and ``proxy_fallback`` says why."""
    out = result.summary()
    note = fallback_note(trace, VALUE_PROXIES[0])
    if note is not None:
        out.update({name: None for name in VALUE_PROXIES})
        out["proxy_fallback"] = note
        return out
    if result.kept_history is None:
        raise ValueError("proxies need a replay run with record_kept=True")
    series = step_proxies(trace.attention, trace.values, result.kept_history)
    out.update({name: float(s.mean()) for name, s in series.items()})
    return out


def score(row: dict, proxy: str) -> float:
    """The figure of ``row`` (a ``summary``) by which ``proxy`` ranks, larger better: the proxy times
    its sign; the retained mass where the proxy could not be computed (the trace has no values)."""
    p = check_proxy(proxy)
    value = row.get(proxy)
    if value is None:
        return float(row["retained_mass"])
    return p.sign * float(value)


def sweep(trace: Trace, policy: PolicySpec | str, budget: int | None, param: str, values, *, reference: bool = False,
          progress=None, top_k: int = DEFAULT_TOP_K, layout=None, **params) -> list[dict]:
    """``summary`` of one replay per value of ``param``: ``kvsim.sim.simulate.sweep`` with the proxies
    (each replay records its kept sets, so it runs alone rather than batched); ``layout``: under that serving
    layout."""
    return simulate.sweep(trace, policy, budget, param, values, reference=reference, progress=progress, top_k=top_k,
                          summarise=lambda result: summary(trace, result), layout=layout, **params)


def configuration(trace: Trace, spec: PolicySpec) -> dict[str, float]:
    """Every figure of ``PROXIES`` for ``spec`` on ``trace``, in that order: one replay with its kept sets
    (what ``kvsim.models.truth`` measures per layer and KV head of a model's recording)."""
    row = summary(trace, simulate.replay(trace, spec, record_kept=True))
    return {name: row[name] for name in PROXIES}


__all__ = ["PROXIES", "VALUE_PROXIES", "Proxy", "check_proxy", "configuration", "even_windows", "fallback_note",
           "kept_before", "not_applicable", "score", "step_proxies", "summary", "sweep"]

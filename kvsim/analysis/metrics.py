"""Statistics of a trace alone, no policy involved: how much of each row the sinks and the recency band
take, and how concentrated attention is. ``python -m kvsim describe`` prints them.

Every figure is a mean over rows (steps), each row weighted equally, over the steps where it is
defined: the sink share over t > sinks (every sink exists), the recent share over t > band (the band is
full), the top-k share over t > k (otherwise the top k is the whole row). A figure with no such step is
``None``.
"""

from __future__ import annotations

import numpy as np

from ..data.row_stats import CORNER, MAX_AGE, TOP, RowStats
from ..data.trace import RENORMALISED_KEY, Trace

DEFAULT_BAND = 64
DEFAULT_SINKS = 4
DEFAULT_TOP_K = 32


def describe(
    trace: Trace, band: int = DEFAULT_BAND, top_k: int = DEFAULT_TOP_K, sinks: int | None = None, chunk: int = 256
) -> dict:
    """steps, sinks, sink_share (the share of each row on positions 0 .. sinks - 1: by default the
    trace's own sinks, as the app finds them, ``trace_sinks``), recent_share (the last ``band`` positions), top_k_share (the mass held by
    each row's ``top_k`` largest weights) and effective_positions (exp of each row's entropy: how many
    positions a row spreads over; uniform over n positions gives n).

    Vectorised over blocks of ``chunk`` rows, so memory stays at a few ``chunk x T`` float64 blocks. A
    trace too long for its dense matrix is described from one pass over its rows (``described_from_sums``).
    """
    sinks = trace_sinks(trace) if sinks is None else sinks
    for name, value in (("band", band), ("top_k", top_k), ("sinks", sinks)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return trace.derived.whole(lambda A: _described(A, band, top_k, sinks, chunk),
                               lambda stats: described_from_sums(stats, band, top_k, sinks))


def _described(A: np.ndarray, band: int, top_k: int, sinks: int, chunk: int) -> dict:
    """``describe`` of a dense matrix, ``chunk`` rows at a time."""
    n = A.shape[0]
    T = n - 1
    sink = np.full(n, np.nan)
    recent = np.full(n, np.nan)
    top = np.full(n, np.nan)
    effective = np.full(n, np.nan)
    for t0 in range(1, n, chunk):
        t1 = min(t0 + chunk, n)
        block = A[t0:t1, : t1 - 1].astype(np.float64)  # rows t0..t1-1 reach at most position t1-2
        sink[t0:t1] = block[:, :sinks].sum(axis=1)
        # the band: each row's weights at ages 1 .. band, zeros elsewhere (rows of the block's width,
        # so each sum adds the same values in the same order as over the whole row)
        window = np.zeros_like(block)
        for i, t in enumerate(range(t0, t1)):
            lo = max(0, t - band)
            window[i, lo:t] = block[i, lo:t]
        recent[t0:t1] = window.sum(axis=1)
        logs = window  # reused: every cell is written (0 where the weight is 0)
        logs[:] = 0.0
        np.log(block, out=logs, where=block > 0)
        effective[t0:t1] = np.exp(-(block * logs).sum(axis=1))
        # last, in place: ``np.partition`` is this on a copy, so the same order and the same sums
        k = min(top_k, block.shape[1])
        block.partition(block.shape[1] - k, axis=1)
        top[t0:t1] = block[:, block.shape[1] - k :].sum(axis=1)
    steps = np.arange(n)
    return {
        "steps": T,
        "sinks": int(sinks),
        "sink_share": _mean(sink[steps > sinks]),
        "band": int(band),
        "recent_share": _mean(recent[steps > band]),
        "top_k": int(top_k),
        "top_k_share": _mean(top[steps > top_k]),
        "effective_positions": _mean(effective[1:]),
    }


def described_from_sums(stats: RowStats, band: int, top_k: int, sinks: int) -> dict:
    """``describe``'s figures from the sums of one pass over the rows (``kvsim.data.row_stats``), equal
    to it up to the order of float64 additions. The pass keeps what a band of up to ``MAX_AGE``,
    ``TOP`` top weights and ``CORNER - 1`` sinks need; more is refused (ValueError, one line)."""
    for name, value, most in (("band", band, MAX_AGE), ("top_k", top_k, TOP), ("sinks", sinks, CORNER - 1)):
        if value > most:
            raise ValueError(f"{name} {value} is more than a trace past its dense length is described at (at most {most})")
    T = stats.steps
    sink = float(stats.columns_from(sinks + 1, sinks).sum()) if T > sinks else 0.0
    recent = sum(stats.diagonal_from(a, band + 1) for a in range(1, band + 1)) if T > band else 0.0
    top = stats.top[top_k + 1 :, :top_k].astype(np.float64).sum(axis=1)
    return {
        "steps": T,
        "sinks": int(sinks),
        "sink_share": sink / (T - sinks) if T > sinks else None,
        "band": int(band),
        "recent_share": recent / (T - band) if T > band else None,
        "top_k": int(top_k),
        "top_k_share": _mean(top),
        "effective_positions": _mean(stats.effective[1:]),
    }


def trace_sinks(trace: Trace) -> int:
    """The positions ``describe`` counts as sinks by default: the trace's own (its metadata's, or
    those measured, ``trace_features``), at least one, so the app's sink share and ``describe``'s name
    the same positions (a trace's first position on a real model; 4 on the canonical trace)."""
    from .features import trace_features_cached

    return max(1, trace_features_cached(trace).sinks)


def describe_cached(
    trace: Trace, band: int = DEFAULT_BAND, top_k: int = DEFAULT_TOP_K, sinks: int | None = None
) -> dict:
    """``describe(trace, band=band, top_k=top_k, sinks=sinks)``, kept on disk beside the trace's
    cache entry when it has one (the canonical trace, a shipped trace), so a fresh process reads it
    instead of passing over the whole attention (~0.13-0.19 s at 4096 steps). Keyed by the
    arguments and a hash of this module's source (``describe_version``): an edit of the analysis
    never reads a stale value. A trace without a cache entry is described and nothing is stored."""
    from ..data import store as cache

    params = {"band": band, "top_k": top_k, "sinks": trace_sinks(trace) if sinks is None else sinks}
    for name, value in params.items():  # refused as ``describe`` refuses them, before any file is named
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    params = {k: int(v) for k, v in params.items()}
    want = {"steps": trace.steps, "sinks": params["sinks"], "band": params["band"], "top_k": params["top_k"]}

    def decode(record: dict) -> dict:
        if not isinstance(record, dict) or set(record) != _DESCRIBE_KEYS:
            raise ValueError("not a describe record: wrong keys")
        if any(type(record[k]) is not int or record[k] != v for k, v in want.items()):
            raise ValueError("not a describe record of this trace and these arguments")
        if not all(record[k] is None or type(record[k]) is float for k in _DESCRIBE_KEYS - set(want)):
            raise ValueError("not a describe record: a share is neither a float nor None")
        return record

    return cache.derived(trace, "describe", params, describe_version(), lambda: describe(trace, **params),
                         decode=decode)


#: the keys of ``describe``'s dict
_DESCRIBE_KEYS = frozenset(
    ("steps", "sinks", "sink_share", "band", "recent_share", "top_k", "top_k_share", "effective_positions")
)


def describe_version() -> str:
    """The version of ``describe`` kept on disk: a hash of this file."""
    from ..data import store as cache

    return cache.source_version(__file__)


def _mean(x: np.ndarray) -> float | None:
    return float(x.mean()) if x.size else None


def renormalised(trace: Trace) -> dict | None:
    """What the loader renormalised (``kvsim.data.trace.from_array``): ``{"rows", "min_sum", "max_sum",
    "tolerance"}`` over the rows whose sum was further than the tolerance from 1, or None for a trace
    whose rows already summed to 1 (or whose record is not one the loader writes)."""
    meta = trace.meta if isinstance(trace.meta, dict) else {}
    record = meta.get(RENORMALISED_KEY)
    if not isinstance(record, dict):
        return None
    try:
        rows, lo, hi = int(record["rows"]), float(record["min_sum"]), float(record["max_sum"])
    except (KeyError, TypeError, ValueError):
        return None
    return {"rows": rows, "min_sum": lo, "max_sum": hi, "tolerance": float(record.get("tolerance", 0.0))} if rows > 0 else None


def repair_note(trace: Trace) -> str | None:
    """One sentence for a trace whose rows the loader renormalised, None for one it took as it was:
    how many of the rows and how far their sums were from 1, e.g. "Renormalised 4096 of 4096 rows:
    their weights summed to 1.5-315, not 1; every figure uses the rows divided by their sums."
    The app and ``kvsim describe`` print it."""
    record = renormalised(trace)
    if record is None:
        return None
    lo, hi = _sum_text(record["min_sum"]), _sum_text(record["max_sum"])
    span = lo if lo == hi else f"{lo}-{hi}"
    n = record["rows"]
    return (f"Renormalised {n} of {trace.steps} rows: {'its weights' if n == 1 else 'their weights'} summed to "
            f"{span}, not 1; every figure uses the rows divided by their sums.")


def _sum_text(x: float) -> str:
    """A row sum in four significant figures (0.25, 1.5, 315, 1.002, 1.2e+04): enough to differ from 1
    at the tolerance."""
    return f"{x:.4g}"

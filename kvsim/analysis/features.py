"""What a trace is made of, from its attention alone (no policy involved): its attention sinks, its
recency band and its heavy hitters (``trace_features``), then what one replay did with those heavy
hitters (``heavy_fates``) and where a recent_window sweep peaks (``curve_peak``).

The views draw these and the page's sentences quote them; nothing here draws. ``trace_features_cached``
keeps a trace's features on disk through the data layer's store, keyed by a hash of this module's
source, so an edit of the analysis is never read stale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

from ..data import store
from ..data.row_stats import RowStats
from ..data.trace import Trace
from ..policykit.base import WINDOW


@dataclass(frozen=True)
class TraceFeatures:
    """What a trace is made of, as the views draw it and the page's sentences describe it. Each
    feature either comes from the trace's metadata, or is measured on the attention itself, or is
    absent (``sinks == 0``, ``band_known`` False, ``heavy`` empty): the page then says so."""

    steps: int  # T
    sinks: int  # positions 0 .. sinks-1 are attention sinks; 0: the trace has none
    band: int  # the recency band's width when ``band_known``; otherwise the width assumed for the controls
    heavy: tuple  # ((position, first step, last live step), ...) of each heavy hitter
    heavy_source: str  # where ``heavy`` came from, said in the page
    live_known: bool = False  # True when the spans say when each heavy hitter goes stale
    band_known: bool = False  # True when the trace has a band (from its metadata or measured), False when assumed
    band_source: str = ""  # where ``band`` came from, or why there is none, said in the page
    sink_source: str = ""  # where ``sinks`` came from

    @property
    def stale(self) -> tuple:
        """The heavy hitters that stop drawing attention before the trace ends."""
        return tuple(h for h in self.heavy if h[2] < self.steps) if self.live_known else ()

    def to_record(self) -> dict:
        """The features as JSON takes them (``heavy`` as lists); ``from_record`` reads them back."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        record["heavy"] = [list(h) for h in self.heavy]
        return record

    @classmethod
    def from_record(cls, record: dict) -> TraceFeatures:
        """The features ``to_record`` wrote, with ``heavy`` a tuple of 3-tuples of ints again.
        Raises ValueError unless ``record`` has exactly the fields, each of its type."""
        if not isinstance(record, dict) or set(record) != {f.name for f in fields(cls)}:
            raise ValueError("not a TraceFeatures record: wrong fields")
        for key, kind in _RECORD_TYPES.items():
            if not _is(record[key], kind):
                raise ValueError(f"not a TraceFeatures record: {key} is {record[key]!r}")
        heavy = record["heavy"]
        if not isinstance(heavy, list) or not all(
            isinstance(h, list) and len(h) == 3 and all(_is(x, int) for x in h) for h in heavy
        ):
            raise ValueError("not a TraceFeatures record: heavy is not a list of [position, first, last]")
        return cls(**{**record, "heavy": tuple(tuple(h) for h in heavy)})


#: the type of each field but ``heavy`` in a ``TraceFeatures`` record
_RECORD_TYPES = {
    "steps": int, "sinks": int, "band": int, "heavy_source": str, "live_known": bool, "band_known": bool,
    "band_source": str, "sink_source": str,
}


def _is(value, kind: type) -> bool:
    """``isinstance``, except that a bool is not an int."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


#: a recency band is a cliff in the mean weight by age: the last SHOULDER ages in the band hold at
#: least CLIFF times the first SHOULDER ages past it
CLIFF, SHOULDER = 4.0, 16
#: a sink takes at least this share of every late row, and SINK_RATIO times a typical position's
SINK_SHARE, SINK_RATIO, MAX_SINKS = 0.02, 10.0, 16
#: a heavy hitter draws, outside the band, HEAVY_RATIO times a uniform row's weight on average;
#: it is live while its weight, averaged over LIVE_SMOOTH steps, stays above that
HEAVY_RATIO, LIVE_SMOOTH = 5.0, 64


class _Matrix:
    """What the detectors read of a dense attention matrix."""

    def __init__(self, attention: np.ndarray) -> None:
        self.A = np.asarray(attention)
        self.steps = self.A.shape[0] - 1

    def profile(self, max_age: int) -> np.ndarray:
        return age_profile(self.A, max_age)

    def late(self) -> np.ndarray:
        T = self.steps
        return self.A[T // 2 + 1 :, : T // 2].astype(np.float64).mean(axis=0)

    def column_sums(self) -> np.ndarray:
        return self.A.sum(axis=0, dtype=np.float64)

    def column(self, p: int) -> np.ndarray:
        return self.A[:, p]


class _Sums:
    """The same, finished from one pass over the rows (``kvsim.data.row_stats``): a trace too long for
    its dense matrix. Equal to ``_Matrix``'s up to the order of float64 additions."""

    def __init__(self, stats: RowStats) -> None:
        self.stats, self.steps = stats, stats.steps

    def profile(self, max_age: int) -> np.ndarray:
        T = self.steps
        skip = max_age if T > 2 * max_age else 0
        out = np.zeros(max_age + 1)
        for a in range(1, max_age + 1):
            first = max(a, skip + 1)  # age_profile's rows: a + i for i >= skip - a + 1
            out[a] = self.stats.diagonal_from(a, first) / (T - first + 1) if first <= T else 0.0
        return out

    def late(self) -> np.ndarray:
        return self.stats.late / (self.steps - self.steps // 2)

    def column_sums(self) -> np.ndarray:
        return self.stats.column.copy()

    def column(self, p: int) -> np.ndarray:
        return self.stats.column_of(p)


def attention_of(trace: Trace, progress=None):
    """What the detectors read of ``trace``: its matrix, or, past the length where the matrix can be
    had (a long query/key trace), the sums of one pass over its rows (``progress`` told during it)."""
    return trace.derived.whole(_Matrix, _Sums, progress)


def _read(attention):
    return attention if isinstance(attention, (_Matrix, _Sums)) else _Matrix(attention)


def age_profile(attention: np.ndarray, max_age: int) -> np.ndarray:
    """Mean weight at each age 1 .. ``max_age`` (index = age; index 0 is 0), over the rows where
    every such age exists once the trace is long enough, else over every row that has it."""
    A = np.asarray(attention)
    T = A.shape[0] - 1
    out = np.zeros(max_age + 1)
    skip = max_age if T > 2 * max_age else 0
    for a in range(1, max_age + 1):
        diag = np.diagonal(A, -a)  # A[a + i, i]: row a + i at age a
        diag = diag[max(0, skip - a + 1):]
        out[a] = float(diag.mean(dtype=np.float64)) if diag.size else 0.0
    return out


def detect_band(attention, max_width: int = 512) -> tuple[int, float] | None:
    """``(width, drop)`` of the trace's recency band: the width ``w`` where the mean weight by age
    falls off a cliff, the last SHOULDER ages up to ``w`` holding ``drop`` >= CLIFF times what the
    next SHOULDER hold, per age. None when attention fades with age without one (a power law, as
    in real models, falls by a few percent per age, nowhere near a cliff). ``attention``: a matrix,
    or what ``attention_of`` gives."""
    source = _read(attention)
    T = source.steps
    max_width = min(max_width, T // 4)
    if max_width < 2 * SHOULDER:
        return None
    prof = source.profile(max_width + SHOULDER)
    best, width = 0.0, 0
    for w in range(SHOULDER, max_width + 1):
        inside = prof[w - SHOULDER + 1 : w + 1].mean()
        past = prof[w + 1 : w + SHOULDER + 1].mean()
        drop = inside / past if past > 0 else (np.inf if inside > 0 else 0.0)
        if drop > best:
            best, width = drop, w
    return (width, float(best)) if best >= CLIFF else None


def detect_sinks(attention) -> int:
    """How many leading positions (0, 1, ...) each take at least SINK_SHARE of the late rows and
    SINK_RATIO times what the median early position takes: the trace's attention sinks."""
    source = _read(attention)
    if source.steps < 8:
        return 0
    late = source.late()
    floor = max(SINK_SHARE, SINK_RATIO * float(np.median(late)))
    n = 0
    while n < min(MAX_SINKS, late.size) and late[n] >= floor:
        n += 1
    return n


def detect_heavy(attention, sinks: int, band: int, n_heavy: int) -> tuple:
    """Up to ``n_heavy`` heavy hitters, largest total attention first among the positions past the
    sinks that, outside the band, draw HEAVY_RATIO times a uniform row's weight on average. Each
    comes with its live span: from its birth to the last step its smoothed weight is still that
    high (the end of the trace if it never falls below it for good)."""
    source = _read(attention)
    T = source.steps
    col = source.column_sums()
    col[: min(sinks, col.size)] = -np.inf
    col[T:] = -np.inf
    found = []
    for p in np.argsort(-col, kind="stable")[: 4 * n_heavy].tolist():
        if len(found) == n_heavy or not np.isfinite(col[p]):
            break
        rows = np.arange(p + band + 1, T + 1)
        if rows.size < 16:
            continue
        column = source.column(p)
        weight = column[rows].astype(np.float64)
        if weight.mean() < HEAVY_RATIO * float((1.0 / rows).mean()):
            continue
        own = column[p + 1 :].astype(np.float64)
        k = min(LIVE_SMOOTH, own.size)
        smooth = np.convolve(own, np.ones(k) / k, mode="valid")  # smooth[i]: steps p+1+i .. p+i+k
        steps_at = np.arange(p + k, p + k + smooth.size)  # the last step of each average
        live = np.flatnonzero(smooth >= HEAVY_RATIO / steps_at)
        last = int(steps_at[live[-1]]) if live.size else p + k
        found.append((int(p), int(p) + 1, T if last >= T - LIVE_SMOOTH else last))
    return tuple(sorted(found))


def trace_features(
    trace: Trace, *, sinks: int | None = None, band: int | None = None, n_heavy: int = 8, assumed_band: int = 64,
    progress=None,
) -> TraceFeatures:
    """Sinks, band and heavy hitters of ``trace``.

    The canonical trace says what it was built from (``meta["config"]``, ``meta["heavy_hitters"]``):
    those are used as they are. Anything the metadata does not say is measured (``detect_sinks``,
    ``detect_band``, ``detect_heavy``), and may be found absent. ``sinks`` and ``band``, if given,
    override both. Without a band, ``assumed_band`` is the width the controls and marks use. A trace
    too long for its dense matrix is read through one pass over its rows (``attention_of``).
    """
    T = trace.steps
    A = attention_of(trace, progress)
    meta = trace.meta if isinstance(trace.meta, dict) else {}
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    if sinks is not None:
        sink_source = "as given"
    elif _int_or(cfg.get("sinks"), None) is not None:
        sinks, sink_source = _int_or(cfg.get("sinks"), None), "from the trace's metadata"
    else:
        sinks, sink_source = detect_sinks(A), "measured: leading positions that take a steady share of every row"
    band_known = True
    if band is not None:
        band_source = "as given"
    elif _int_or(cfg.get("band_width"), None) is not None:
        band, band_source = _int_or(cfg.get("band_width"), None), "from the trace's metadata"
    else:
        found = detect_band(A)
        if found is not None:
            band, drop = found
            band_source = f"measured: past age {band} the mean weight drops {drop:.0f}-fold"
        else:
            band, band_known = assumed_band, False
            band_source = "no sharp recency band: attention fades with age without a cliff"
    epoch = _int_or(cfg.get("epoch"), None)
    listed = meta.get("heavy_hitters")
    if isinstance(listed, list) and listed and all(isinstance(p, int) and 0 <= p <= T for p in listed):
        heavy = tuple((p, p + 1, min(T, p + epoch) if epoch else T) for p in sorted(listed))
        source = "the ones the trace's metadata lists"
        live_known = epoch is not None
    else:
        # an assumed band can be longer than a short trace: then judge outside a band of T / 8
        heavy = detect_heavy(A, sinks, band if band_known else min(band, max(1, T // 8)), n_heavy)
        source = (
            f"measured: the {len(heavy)} positions past the sinks with the most attention that draw, outside the "
            f"band, at least {HEAVY_RATIO:.0f}x a uniform row's share"
        )
        live_known = True
    return TraceFeatures(
        steps=T, sinks=sinks, band=band, heavy=heavy, heavy_source=source, live_known=live_known,
        band_known=band_known, band_source=band_source, sink_source=sink_source,
    )


def trace_features_cached(trace: Trace) -> TraceFeatures:
    """``trace_features(trace)`` with its defaults, kept on disk beside the trace's cache entry when
    it has one (the canonical trace, a shipped trace): a fresh process reads it instead of measuring
    the whole attention again (~0.13 s on a 4096-step real trace). Keyed by a hash of this module's
    source (``features_version``), so an edit of the analysis never reads a stale value."""
    return store.derived(
        trace, "features", {}, features_version(), lambda: trace_features(trace),
        encode=TraceFeatures.to_record, decode=TraceFeatures.from_record,
    )


def features_version() -> str:
    """The version of ``trace_features`` kept on disk: a hash of this file."""
    return store.source_version(__file__)


def _int_or(value, default):
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


@dataclass(frozen=True)
class HeavyFate:
    """What one policy did with one heavy hitter: ``evicted_at`` is the step it was let go (None:
    held to the end of the trace); it was lost while still wanted if that is within its live span."""

    position: int
    first: int
    last: int
    evicted_at: int | None

    @property
    def lost_while_live(self) -> bool:
        return self.evicted_at is not None and self.evicted_at <= self.last


def heavy_fates(kept_history: np.ndarray, features: TraceFeatures) -> list[HeavyFate]:
    """Each heavy hitter's fate under the policy whose kept history (``(T, budget)``, row t - 1 the
    positions held after step t, -1 padded) is ``kept_history``. A position is held from its birth
    without a gap until it is evicted (nothing evicted comes back), so the number of steps that
    hold it says when it went."""
    kept = np.asarray(kept_history)
    T = kept.shape[0]
    held = np.bincount(kept[kept >= 0].astype(np.int64), minlength=T + 1)  # steps holding each position
    out = []
    for p, first, last in features.heavy:
        until = max(p, 1) + int(held[p]) - 1
        out.append(HeavyFate(p, first, last, None if until >= T else until + 1))
    return out


def curve_peak(rows: Sequence[Mapping]) -> tuple[int, float]:
    """``(recent_window, retained_mass)`` where the sweep keeps the most; the smallest such window."""
    best = max(sorted(rows, key=lambda r: r[WINDOW]), key=lambda r: r["retained_mass"])
    return int(best[WINDOW]), float(best["retained_mass"])

"""The canonical trace: a deterministic synthetic attention trace (docs/domain.md, "The canonical trace").

Each row t (the query at position t) mixes five features, each there for a reason that
``traces/README.md`` explains with the arithmetic that forces it:

- **attention sinks**: positions 0-3 take a fixed share of every row;
- **a recency band**: the most recent ``band_width`` positions take most of each row, so a position
  passes through the band for exactly ``band_width`` steps. Each band weight is drawn afresh every
  step and spiky (log-normal, sigma 1.5): a band position clears the fair share ``1/n`` on under half
  of its steps, so a count of such steps (scissorhands) ranks it below a heavy hitter, as a sum does;
- **heavy hitters**: each ``epoch`` steps a few positions are born that hold a large weight for a
  whole epoch and then go stale (drop back to the background);
- **prompt anchors**: a few positions of the opening hold a steady weight, above the fair share 1/256,
  in every row to the end (an instruction or a retrieved fact the generation keeps consulting);
- **a diffuse background** over the rest of the history, with a fixed per-position salience that
  leans gently toward the opening of the context (a power law in position).

The numbers below are calibration constants: with them the trace reproduces the policy cards'
figures at budget 256 (``python -m kvsim table``: all eight targets of docs/domain.md).
Changing any of them changes ``VERSION``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .trace import Trace

#: bump whenever the generator's output changes (it keys the on-disk cache)
VERSION = 2


@dataclass(frozen=True)
class CanonicalConfig:
    steps: int = 4096  # decode steps T; the trace covers positions 0 .. T
    seed: int = 20230614  # the one seed everything random is drawn from
    sinks: int = 4  # attention sinks: positions 0 .. sinks-1
    sink_share: float = 0.15  # share of every row on the sinks (sets streaming_llm - sliding_window)
    sink_split: tuple = (0.55, 0.2, 0.13, 0.12)  # how that share divides among the sinks
    band_width: int = 64  # the local-attention span: the recency band is this many positions wide
    band_share: float = 0.5417  # raw share of the band (measured share on the last 64 is 0.548)
    band_noise: float = 1.5  # log-normal sigma of each band weight, drawn afresh every step (spiky)
    epoch: int = 512  # steps a heavy hitter holds its weight before going stale
    heavy_per_epoch: int = 3  # heavy hitters born at the start of each epoch
    heavy_share: float = 0.045  # share of a row held by the live heavy hitters
    heavy_birth_span: int = 32  # heavy hitters are born within this many positions of the epoch start
    heavy_noise: float = 0.2  # log-normal sigma of each heavy hitter's weight per step
    anchors: int = 14  # prompt anchors: positions of the opening that every row attends, start to end
    anchor_span: int = 32  # anchors are drawn from positions sinks .. sinks + anchor_span - 1
    anchor_share: float = 0.2  # share of a row held by the anchors together (about 0.014 each)
    anchor_noise: float = 0.2  # log-normal sigma of each anchor's weight per step
    background_noise: float = 0.5  # log-normal sigma of each position's background salience
    background_lean: float = 0.5  # salience ~ (position + offset) ** -lean: leans gently on the opening
    background_offset: float = 16.0  # softens the lean for the very first positions


def generate(config: CanonicalConfig = CanonicalConfig(), chunk: int = 256) -> Trace:
    """Build the canonical trace from ``config`` (deterministic: same config, same bytes)."""
    c = config
    _check(c)
    rng = np.random.default_rng(c.seed)
    n = c.steps + 1
    positions = np.arange(n)

    salience = np.exp(c.background_noise * rng.standard_normal(n))
    salience /= (positions + c.background_offset) ** c.background_lean
    salience[: c.sinks] = 0.0

    # heavy hitters: (position, weight within the live set, first step, last step)
    heavy = []
    for start in range(0, c.steps, c.epoch):
        lo = max(c.sinks, start + 1)
        born = np.sort(rng.choice(np.arange(lo, min(lo + c.heavy_birth_span, n)), c.heavy_per_epoch, replace=False))
        w = rng.dirichlet(np.full(c.heavy_per_epoch, 8.0))
        heavy += [(int(p), float(wi), int(p) + 1, int(p) + c.epoch) for p, wi in zip(born, w, strict=True)]
    heavy_pos = np.array([h[0] for h in heavy])
    heavy_w = np.array([h[1] for h in heavy])
    heavy_first = np.array([h[2] for h in heavy])
    heavy_last = np.array([h[3] for h in heavy])
    # prompt anchors: drawn after the heavy hitters (so those stay as they were) and never on one
    candidates = np.setdiff1d(np.arange(c.sinks, c.sinks + c.anchor_span), heavy_pos)
    anchor_pos = np.sort(rng.choice(candidates, c.anchors, replace=False))
    anchor_w = rng.dirichlet(np.full(c.anchors, 8.0)) if c.anchors else np.zeros(0)
    anchor_w, anchor_pos = anchor_w[anchor_pos < n], anchor_pos[anchor_pos < n]  # a trace shorter than the opening

    sink_split = np.asarray(c.sink_split, dtype=np.float64)
    sink_split = sink_split / sink_split.sum()
    A = np.zeros((n, n), dtype=np.float32)
    for t0 in range(1, n, chunk):
        t1 = min(t0 + chunk, n)
        rows = np.arange(t0, t1)[:, None]
        age = rows - positions[None, :]
        past = age >= 1
        # recency band
        in_band = past & (age <= c.band_width) & (positions[None, :] >= c.sinks)
        band = np.where(in_band, np.exp(c.band_noise * rng.standard_normal(in_band.shape)), 0.0)
        # background over the rest of the history
        bg = np.where(past & (age > c.band_width), salience[None, :], 0.0)
        # live heavy hitters
        live = (heavy_first[None, :] <= rows) & (rows <= heavy_last[None, :])
        hw = np.where(live, heavy_w[None, :] * np.exp(c.heavy_noise * rng.standard_normal(live.shape)), 0.0)
        hh = np.zeros_like(bg)
        np.add.at(hh, (np.repeat(np.arange(t1 - t0), len(heavy)), np.tile(heavy_pos, t1 - t0)), hw.ravel())
        hh[~past] = 0.0
        an = np.zeros_like(bg)
        an[:, anchor_pos] = anchor_w[None, :] * np.exp(c.anchor_noise * rng.standard_normal((t1 - t0, len(anchor_pos))))
        an[~past] = 0.0
        sinks = np.zeros_like(bg)
        sinks[:, : c.sinks] = sink_split
        sinks[~past] = 0.0
        row = (
            c.sink_share * _unit(sinks)
            + c.band_share * _unit(band)
            + c.heavy_share * _unit(hh)
            + c.anchor_share * _unit(an)
            + (1.0 - c.sink_share - c.band_share - c.heavy_share - c.anchor_share) * _unit(bg)
        )
        A[t0:t1] = (row / row.sum(axis=1, keepdims=True)).astype(np.float32)
    meta = {
        "name": "canonical",
        "source": "kvsim.canonical.generate",
        "licence": "CC0-1.0 (synthetic)",
        "generator_version": VERSION,
        "config": asdict(c),
        "heavy_hitters": heavy_pos.tolist(),
        "anchors": anchor_pos.tolist(),
    }
    return Trace(A, name="canonical", meta=meta)


def _check(c: CanonicalConfig) -> None:
    """Refuse a config the generator cannot honour, with one line naming the field."""
    for name in ("sink_share", "band_share", "heavy_share", "anchor_share"):
        if not 0.0 <= getattr(c, name) <= 1.0:
            raise ValueError(f"CanonicalConfig.{name} must be between 0 and 1, got {getattr(c, name)}")
    total = c.sink_share + c.band_share + c.heavy_share + c.anchor_share
    if total > 1.0:
        raise ValueError(f"CanonicalConfig: sink_share + band_share + heavy_share + anchor_share = {total:.4f} exceeds 1 "
                         "(the background takes what is left)")
    if not 0 <= c.anchors <= c.anchor_span - c.heavy_per_epoch:
        raise ValueError(f"CanonicalConfig.anchors must be between 0 and anchor_span - heavy_per_epoch "
                         f"({c.anchor_span - c.heavy_per_epoch}), got {c.anchors}")


def _unit(x: np.ndarray) -> np.ndarray:
    """Scale each row to sum 1 (rows with nothing in them stay zero)."""
    s = x.sum(axis=1, keepdims=True)
    return np.divide(x, s, out=np.zeros_like(x), where=s > 0)

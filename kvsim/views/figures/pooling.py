"""The kept view's images: which positions each step's cache holds, pooled into blocks of about the
pixels the screen shows and sent as PNGs (a few kilobytes a panel, never a 4096 x 4097 picture).

The kernels (``_pool_kept``, ``_exists``) count straight from a replay's kept history, a step
costing its held positions; ``_pool_panel`` is the same pooling in NumPy over full masks, the
reference the tests hold the kernels to and the path taken without numba, or while the kernels are
not compiled yet for a caller that will not wait for numba (``kvsim.jit.compiled_only``: the app's
page on a brand-new install; ``prepare`` compiles them meanwhile).
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

from ... import jit
from ...jit import AVAILABLE, kernel, mark_compiled, use
from ...sim.harness import ReplayResult, kept_mask_of
from ..selection import Region

#: the name ``kvsim.jit`` knows these kernels by
KERNELS = "figures.pooling"


def _fast() -> bool:
    """Pool with the kernels (numba there and, for a ``compiled_only`` caller, compiled), else in NumPy."""
    return AVAILABLE and use(KERNELS)


def prepare() -> None:
    """Compile (or load from numba's disk cache) the kernels, on tiny histories, outside any page."""
    if AVAILABLE:
        h = np.array([[0, -1], [0, 1], [1, 2]], dtype=np.int32)
        panel_layers([h], Region.whole(3), 1, 2, 8)
        panel_layers([h, h], Region.whole(3), 1, 2, 8)
        difference_counts(h, h)


def on_disk() -> bool:
    """Whether numba's disk cache holds the kernels (``prepare`` would only load them)."""
    return jit.on_disk(_pool_kept, _exists)


#: grey levels of the kept-position image: kept cells dark, evicted white, not-yet-generated light
KEPT, EVICTED, FUTURE = 30, 255, 222


def kept_image(result: ReplayResult) -> np.ndarray:
    """uint8 ``(T, T + 1)``: row t - 1 is the cache after step t; KEPT where position p is held,
    EVICTED where it existed but was let go, FUTURE where it does not exist yet (p > t)."""
    mask = result.kept_mask()
    img = np.where(mask.astype(bool), np.uint8(KEPT), np.uint8(EVICTED))
    T = result.steps
    future = np.arange(T + 1)[None, :] > np.arange(1, T + 1)[:, None]
    img[future] = FUTURE
    return img


#: grey level of a pooled block where some of the positions that exist are kept and some are not
PARTIAL = 140
#: colours of the difference view (RGB): kept by the first policy only, the second only, both
#: (blocks holding some of each), kept by both, by neither, not generated yet
ONLY_A, ONLY_B, MIXED = (31, 119, 180), (255, 127, 14), (148, 103, 189)
BOTH, NEITHER, NOT_YET = (150, 150, 150), (255, 255, 255), (222, 222, 222)


def difference_counts(history_a: np.ndarray, history_b: np.ndarray) -> tuple[float, float]:
    """Mean over steps of how many positions the first cache holds that the second does not, and
    the reverse, from the two replays' kept histories."""
    T = history_a.shape[0]
    if _fast():  # one block per step over every position: each step's counts
        only_a, only_b, _ = _pool_kept(history_a, history_b, True, 1, T, 0, T + 1, 1, T + 1, False)
    else:
        masks = [kept_mask_of(history_a), kept_mask_of(history_b)]
        only_a, only_b, _ = _pool_panel(masks, Region.whole(T), 0, 0, 1, T + 1, 1)[0][0]
    return float(only_a.sum(axis=1).mean()), float(only_b.sum(axis=1).mean())


def _pool(a: np.ndarray, br: int, bc: int) -> np.ndarray:
    """Sum of ``a`` over blocks of ``br x bc`` (the edges padded with zeros)."""
    h, w = a.shape
    H, W = -(-h // br), -(-w // bc)
    padded = np.zeros((H * br, W * bc), dtype=np.int32)
    padded[:h, :w] = a
    return padded.reshape(H, br, W, bc).sum(axis=(1, 3))


def _levels(kept: np.ndarray, exists: np.ndarray) -> np.ndarray:
    """Grey levels of pooled blocks: a block is KEPT if every position in it that exists is held,
    PARTIAL if some are, so a single kept column stays visible when thousands of positions share
    a few hundred pixels."""
    img = np.full(kept.shape, EVICTED, dtype=np.uint8)
    img[kept > 0] = PARTIAL
    img[(kept == exists) & (exists > 0)] = KEPT
    img[exists == 0] = FUTURE
    return img


def _shares(kept: np.ndarray, exists: np.ndarray) -> np.ndarray:
    """Grey levels of pooled blocks by the share of their existing positions held: KEPT when all
    are, EVICTED when none, between in proportion. The age strip's shading: widened, it needs no
    single column kept visible, and there "mid-grey when any is held" drew a score-keeping
    policy's few survivors past its window as a dense hatch."""
    share = np.divide(kept, exists, out=np.zeros(kept.shape), where=exists > 0)
    img = np.rint(EVICTED - share * (EVICTED - KEPT)).astype(np.uint8)
    img[exists == 0] = FUTURE
    return img


def _split(a: np.ndarray, b: np.ndarray, exists: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Held by the first only, by the second only, by both."""
    return a & ~b & exists, b & ~a & exists, a & b & exists


def _difference_rgb(counts: tuple, exists: np.ndarray) -> np.ndarray:
    """RGB of pooled blocks in the difference view: a block holding any position kept by one policy
    and not the other shows that colour, so a single such column stays visible."""
    only_a, only_b, both = counts
    rgb = np.empty((*exists.shape, 3), dtype=np.uint8)
    rgb[:] = NEITHER
    rgb[both > 0] = BOTH
    rgb[only_a > 0] = ONLY_A
    rgb[only_b > 0] = ONLY_B
    rgb[(only_a > 0) & (only_b > 0)] = MIXED
    rgb[exists == 0] = NOT_YET
    return rgb


def _pool_panel(masks: Sequence[np.ndarray], region: Region, sinks: int, ages: int, br: int, bc: int, ba: int):
    """The reference pooling of one panel, in NumPy: for the main image, the sink strip and the age
    strip, ``(counts, exists)`` pooled over blocks, ``counts`` being ``(kept,)`` for one mask and
    ``(only_a, only_b, both)`` for two; None for a strip that is not drawn. ``panel_layers`` uses the
    kernels below (``_pool_kept``, ``_exists``), which give the same sums from the kept histories,
    never building a mask (the tests hold them to this)."""
    r = region
    steps = np.arange(r.t0, r.t1 + 1)
    bands = [m[r.t0 - 1 : r.t1].astype(bool) for m in masks]

    def pooled(parts, exist, bc_):
        if len(parts) == 1:
            return (_pool(parts[0] & exist, br, bc_),), _pool(exist, br, bc_)
        return tuple(_pool(x, br, bc_) for x in _split(*parts, exist)), _pool(exist, br, bc_)

    cols = np.arange(r.p0, r.p1 + 1)
    main = pooled([b[:, r.p0 : r.p1 + 1] for b in bands], cols[None, :] <= steps[:, None], bc)
    s = min(sinks, r.t1 + 1)
    sink = pooled([b[:, :s] for b in bands], np.arange(s)[None, :] <= steps[:, None], 1) if s else None
    age = None
    if ages:
        pos = steps[:, None] - np.arange(1, ages + 1)[None, :]  # column a - 1 is position t - a
        rows = np.arange(steps.size)[:, None]
        age = pooled([b[rows, np.clip(pos, 0, None)] for b in bands], pos >= 0, ba)
    return main, sink, age


@kernel
def _pool_kept(a, b, two, t0, t1, lo, width, br, bw, by_age):
    """Block counts of kept positions straight from kept histories (``(T, budget)`` int, row t - 1
    the positions held after step t, -1 padded): ``a``, and ``b`` when ``two``. Steps t0 .. t1 are
    pooled br to a block row; a position's column is ``p - lo`` (positions lo .. lo + width - 1) or,
    ``by_age``, its age less one (``t - p - 1``, ages 1 .. width), bw columns to a block.
    ``counts[0]`` is kept (one history) or kept by ``a`` only, ``counts[1]`` by ``b`` only,
    ``counts[2]`` by both. A step costs its held positions, not the trace's length: no
    ``(T, T + 1)`` mask is ever built."""
    H = (t1 - t0 + br) // br
    W = (width + bw - 1) // bw
    counts = np.zeros((3, H, W), dtype=np.int64)
    stamp = np.full(max(a.shape[0], b.shape[0]) + 2, -1, dtype=np.int64)  # stamp[p] == t: a holds p after step t
    for t in range(t0, t1 + 1):
        R = (t - t0) // br
        for i in range(a.shape[1]):
            p = a[t - 1, i]
            if p < 0:
                continue
            stamp[p] = t
            c = t - p - 1 if by_age else p - lo
            if 0 <= c < width:
                counts[0, R, c // bw] += 1
        if two:
            for i in range(b.shape[1]):
                p = b[t - 1, i]
                if p < 0:
                    continue
                c = t - p - 1 if by_age else p - lo
                if 0 <= c < width:
                    counts[2 if stamp[p] == t else 1, R, c // bw] += 1
    if two:
        counts[0] -= counts[2]  # held by a, less those b holds too
    return counts


@kernel
def _exists(t0, t1, lo, width, br, bw, by_age):
    """How many of each block's cells exist (a position exists after step t once p <= t): the
    geometry of ``_pool_kept``'s blocks, whatever is kept."""
    H = (t1 - t0 + br) // br
    W = (width + bw - 1) // bw
    exists = np.zeros((H, W), dtype=np.int64)
    for t in range(t0, t1 + 1):
        R = (t - t0) // br
        last = min(width, t) - 1 if by_age else min(lo + width - 1, t) - lo  # the last column that exists
        for j in range(W):
            c0 = j * bw
            if c0 > last:
                break
            exists[R, j] += min(c0 + bw - 1, last) - c0 + 1
    return exists


def _pool_panel_fast(histories: Sequence[np.ndarray], region: Region, sinks: int, ages: int, br: int, bc: int, ba: int):
    """``_pool_panel`` of the histories' masks, by the kernels: the same sums, from the kept
    histories themselves."""
    r = region
    two = len(histories) == 2
    a, b = histories[0], histories[-1]
    n = 3 if two else 1

    def pool(lo, width, bw, by_age):
        counts = _pool_kept(a, b, two, r.t0, r.t1, lo, width, br, bw, by_age)
        return tuple(counts[:n]), _exists(r.t0, r.t1, lo, width, br, bw, by_age)

    main = pool(r.p0, r.p1 - r.p0 + 1, bc, False)
    s = min(sinks, r.t1 + 1)
    sink = pool(0, s, 1, False) if s else None
    age = pool(0, ages, ba, True) if ages else None
    return main, sink, age


def panel_layers(histories: Sequence[np.ndarray], region: Region, sinks: int, ages: int, size: int,
                 block_size: int = 1) -> dict:
    """The three images of one panel, pooled to about ``size`` pixels across the main image: the
    main image (the region), the sink strip (positions 0 .. sinks-1, one column each, widened) and
    the age strip (the newest ``ages`` positions of every step, by age, widened). One kept history
    (a replay's ``kept_history``): grey levels; two: the difference's colours. Returns the blocks
    and each image as a PNG data URI (with its column count for the strips): small, and cheap to
    keep per replay and region.

    ``block_size`` s > 1 (a replay under a serving layout in blocks, ``kvsim.policykit.layouts``): the main
    image's cells are whole blocks of the cache, one block at the zoom where a pooled cell would be at most s
    positions wide (every zoom closer than that too), else as many whole blocks as the pixels ask; its first
    cell starts at the first position of the block holding ``region.p0`` (``origin``), which may lie left of
    the region. Blocks leave whole, so a cell is then all kept or all evicted (the filling block: its
    positions that exist)."""
    r = region
    br = max(1, math.ceil(r.height / size))
    bc = max(1, math.ceil(r.width / size))
    ba = max(1, math.ceil(ages / max(1, size // 4)))
    if block_size > 1:  # the strips read only the region's steps: widening its positions moves the main image alone
        bc = block_size * math.ceil(bc / block_size)
        r = Region(r.p0 - r.p0 % block_size, r.p1, r.t0, r.t1)
    if _fast():
        main, sink, age = _pool_panel_fast(histories, r, sinks, ages, br, bc, ba)
        mark_compiled(KERNELS)  # both kernels have run: compiled (the histories are always int32)
    else:
        main, sink, age = _pool_panel([kept_mask_of(h) for h in histories], r, sinks, ages, br, bc, ba)

    def image(pooled, shade=_levels):
        counts, exists = pooled
        return shade(counts[0], exists) if len(counts) == 1 else _difference_rgb(counts, exists)

    main_img = image(main)
    sink_img = None if sink is None else image(sink)
    age_img = None if age is None else image(age, _shares)
    return {
        "block": (br, bc, ba),
        "origin": r.p0,
        "block_size": block_size,
        "main": _source(main_img),
        "sink": None if sink_img is None else (_source(sink_img), sink_img.shape[1]),
        "age": None if age_img is None else (_source(age_img), age_img.shape[1]),
    }


def _source(img: np.ndarray) -> str:
    """A uint8 image (grey or RGB) as the PNG data URI a Plotly image trace draws (what
    ``px.imshow(img, binary_string=True)`` makes, without building a figure around it)."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(img)).save(buf, format="png", compress_level=6)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


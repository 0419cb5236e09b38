"""The tests' one maker of random traces: ``random_trace(steps, seed, shape=...)``.

Each shape is there for a corner of the arithmetic a test needs:

- ``"gamma"`` (the default): heavy-tailed rows with most weight on the newest position, like attention;
  ``ties=True`` draws weights from {0, 1, 2} instead, so positions share scores exactly (the
  lower-position-first rules);
- ``"heavy"``: cubed exponential weights with a share ``zero_share`` of exact zeros, so the kept part
  of a row is often all but empty; ``ties=True`` draws from {0, 1, 2} (the optimum's tie cases);
- ``"levels"``: integer weights 1..``levels`` with ``zero_share`` zeros, so rows and cumulative scores
  tie exactly (the engine against the reference).

``seed`` may be a ``numpy.random.Generator`` to draw several traces from one stream. ``members=True`` gives
the trace random keys, values, queries (2 heads of 8 dimensions) and output norms, and a RoPE in its meta
(``with_members``): what the policies that read them need, so that every registered policy replays it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import kvsim


def random_trace(steps: int, seed: int | np.random.Generator = 0, *, shape: str = "gamma", ties: bool = False,
                 zero_share: float = 0.3, levels: int = 3, name: str = "random", members: bool = False) -> kvsim.Trace:
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    n = steps + 1
    if shape == "gamma":
        a = _gamma(rng, n, ties)
    elif shape == "heavy":
        a = _heavy(rng, n, zero_share, ties)
    elif shape == "levels":
        a = _levels(rng, n, levels, zero_share)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    trace = kvsim.from_array(np.tril(a, -1), name=name)
    return with_members(trace, rng) if members else trace


def with_members(trace: kvsim.Trace, seed: int | np.random.Generator = 0, *, heads: int = 2, dim: int = 8,
                 levels: int = 0) -> kvsim.Trace:
    """``trace`` carrying every member the scorers beyond attention read (``kvsim.data.vectors``): random
    keys and values ``(T + 1, dim)``, queries ``(T + 1, heads, dim)`` and positive output norms
    ``(T + 1, heads)``, float32, and a RoPE in its meta (theta 1e4, rotate_half, the recorder's fields).
    ``levels`` > 0 draws values and norms from 1..levels instead, so products of scores tie exactly (the
    engine against the reference)."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    n = trace.steps + 1
    if levels:
        values = rng.integers(-levels, levels + 1, size=(n, dim)).astype(np.float32)
        out_norms = rng.integers(1, levels + 1, size=(n, heads)).astype(np.float32)
    else:
        values = rng.standard_normal((n, dim)).astype(np.float32)
        out_norms = (rng.random((n, heads)) + 0.05).astype(np.float32)
    keys = rng.standard_normal((n, dim)).astype(np.float32)
    queries = rng.standard_normal((n, heads, dim)).astype(np.float32)
    rope = {"rope_inv_freq": (1e4 ** (-np.arange(0, dim, 2) / dim)).tolist(), "rope_layout": "rotate_half",
            "rope_theta": 1e4, "rope_attention_scaling": 1.0}
    return dataclasses.replace(trace, meta={**trace.meta, **rope}, keys=keys, values=values, queries=queries,
                               out_norms=out_norms)


def _gamma(rng: np.random.Generator, n: int, ties: bool) -> np.ndarray:
    if ties:  # mostly zeros, the rest 1 or 2: many positions share a score exactly
        a = np.tril(rng.choice([0.0, 0.0, 0.0, 1.0, 2.0], size=(n, n)), k=-1)
        empty = np.flatnonzero(a.sum(axis=1) == 0)[1:]
        a[empty, empty - 1] = 1.0  # a row must have some weight: put it on the newest position
        return a
    a = np.tril(rng.gamma(0.3, size=(n, n)) + 1e-6, k=-1)
    a[np.arange(1, n), np.arange(n - 1)] += 1.0  # and most of it on the newest position
    return a


def _heavy(rng: np.random.Generator, n: int, zero_share: float, ties: bool) -> np.ndarray:
    if ties:
        a = rng.choice([0.0, 0.0, 1.0, 2.0], size=(n, n))
    else:
        a = rng.exponential(size=(n, n)) ** 3
        a[rng.random(a.shape) < zero_share] = 0.0
    a[np.arange(1, n), 0] += 1e-3  # every row needs some mass
    return a


def _levels(rng: np.random.Generator, n: int, levels: int, zero_share: float) -> np.ndarray:
    a = rng.integers(1, levels + 1, size=(n, n)).astype(np.float64)
    a[rng.random((n, n)) < zero_share] = 0.0
    for t in range(1, n):  # from_array refuses an all-zero row; keep one weight
        if a[t, :t].sum() == 0:
            a[t, rng.integers(0, t)] = 1.0
    return a

"""The suite's tolerances (tests/tolerance.py) hold what they claim: float32 computations in orders a
library or a machine might pick stay within them, and a real mistake does not."""

from __future__ import annotations

import numpy as np
from tolerance import attention_rows, logit_magnitude, rounding


def _rows(q, k, scale, dtype, reverse=False):
    """Causal softmax rows of ``q`` ``(G, T, d)`` against ``k`` ``(T, d)``, in ``dtype``, the head dimension
    summed forwards or backwards, the query heads averaged and each row renormalised without its diagonal."""
    q, k = q.astype(dtype), k.astype(dtype)
    if reverse:
        q, k = q[..., ::-1], k[..., ::-1]
    s = np.zeros((q.shape[0], q.shape[1], k.shape[0]), dtype=dtype)
    for i in range(q.shape[2]):  # one term at a time: the order is this loop's
        s += q[:, :, i : i + 1] * k[None, :, i]
    s *= dtype(scale)
    n = k.shape[0]
    s = np.where(np.tril(np.ones((n, n), dtype=bool)), s, dtype(-np.inf))
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True, dtype=dtype)
    rows = np.tril(w.mean(axis=0, dtype=dtype), -1)
    rows[1:] /= rows[1:].sum(axis=1, keepdims=True, dtype=dtype)
    return rows.astype(np.float64)


def test_float32_rows_in_any_order_stay_within_the_bound_and_a_wrong_scale_does_not():
    rng = np.random.default_rng(0)
    g, t, d, scale = 4, 300, 64, 64 ** -0.5
    q, k = (rng.normal(size=(g, t, d)) * 2).astype(np.float32), (rng.normal(size=(t, d)) * 2).astype(np.float32)
    exact = _rows(q, k, scale, np.float64)
    bound = attention_rows(d, logit_magnitude(q, k, scale), t, g)
    for reverse in (False, True):
        assert np.abs(_rows(q, k, scale, np.float32, reverse) - exact).max() <= bound
    assert np.abs(_rows(q, k, scale * (1 + 1e-2), np.float64) - exact).max() > bound  # a 1% error of the scale shows


def test_a_float32_sum_in_any_order_stays_within_rounding():
    rng = np.random.default_rng(1)
    x = rng.random(10_000).astype(np.float32)
    exact = float(np.sum(x.astype(np.float64)))
    bound = rounding(x.size, float(np.abs(x).sum(dtype=np.float64)))
    serial = np.float32(0)
    for v in x:  # left to right, the order with the largest worst case
        serial += v
    for got in (float(serial), float(np.sum(x)), float(np.sum(x[::-1])), float(np.cumsum(x)[-1])):
        assert abs(got - exact) <= bound

"""The scorers' long sums taken four terms per pass (expected_attention's ``key_logits``, keydiff's
``_keydiff_cosines``) are the same additions in the same order as the one-term-per-pass loops they replaced,
so the same bits: each checked here against that order written out in plain Python (one ``+`` at a time), on
shapes whose lengths are and are not multiples of four (the remainder loops)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.policies.expected_attention import key_logits
from kvsim.policies.keydiff import _keydiff_admit, _keydiff_cosines, _keydiff_state, cosines, unit_keys
from kvsim.policies.knorm import kernel_keys
from kvsim.policykit.slot_hooks import Shape


def _logits_by_hand(keys, rows, n, sinks, adv, cols, count, logits, stamp, period):
    """``key_logits``'s definition, one addition at a time in the stated order."""
    G, d = adv.shape
    for i in range(sinks, n):
        if stamp[i] == period:
            continue
        k = keys[rows[i]]
        for g in range(G):
            lin = 0.0
            for x in range(d):
                lin += k[x] * adv[g, x]
            logits[i, g] = lin / np.sqrt(np.float64(d))
            if count > 0:
                quad = 0.0
                for j in range(count):
                    z = 0.0
                    for x in range(d):
                        z += k[x] * cols[g, x, j]
                    quad += z * z
                logits[i, g] += quad / count / (2.0 * d)
        stamp[i] = period


@pytest.mark.parametrize("d,count,n", [(8, 7, 13), (5, 3, 9), (13, 1, 20), (4, 0, 6), (3, 12, 11), (1, 2, 3)])
def test_expected_attentions_key_logits_are_the_sums_in_order(d, count, n):
    rng = np.random.default_rng(d * 100 + count)
    G, window, sinks = 3, 12, 2
    keys = rng.normal(size=(40, d))
    rows = rng.permutation(40)[:n].astype(np.int64)
    adv, cols = rng.normal(size=(G, d)), rng.normal(size=(G, d, window))
    stamp = np.where(rng.random(n) < 0.3, 5, -1).astype(np.int64)  # some slots already scored this period
    got, want = np.full((n, G), 7.0), np.full((n, G), 7.0)
    got_stamp, want_stamp = stamp.copy(), stamp.copy()
    key_logits(keys, rows, n, sinks, adv, cols, count, got, got_stamp, 5)
    _logits_by_hand(keys, rows, n, sinks, adv, cols, count, want, want_stamp, 5)
    assert np.array_equal(got, want) and np.array_equal(got_stamp, want_stamp)
    assert (got[stamp == 5] == 7.0).all() and (got[:sinks] == 7.0).all()  # left alone: stamped, or a sink


@pytest.mark.parametrize("d", [1, 4, 5, 8, 13])
@pytest.mark.parametrize("n", [1, 2, 4, 5, 9])
def test_keydiffs_cosines_are_the_references_bits(d, n):
    """The engine's cosines of n held slots (held in a shuffled slot order, as after evictions) against the
    reference's ``cosines`` (NumPy's cumulative sums: kept order, one addition at a time)."""
    rng = np.random.default_rng(d * 10 + n)
    keys = rng.normal(size=(30, d)).astype(np.float16)
    keys[3] = 0  # a zero key: a zero unit key
    shape = Shape(1, 12, 29)
    state = _keydiff_state(shape, kernel_keys(keys))  # the keys as the engine is handed them
    p_c = np.sort(rng.permutation(30)[:n]).astype(np.int64)
    state[2][0] = np.r_[rng.permutation(n), np.arange(n, 12)]  # each slot's column, scrambled
    for i in range(n):
        _keydiff_admit(state, 0, p_c, i)
    _keydiff_cosines(state, 0, p_c, n)
    want = cosines(unit_keys(keys.astype(np.float64))[p_c])
    assert np.array_equal(state[5][:n], want)

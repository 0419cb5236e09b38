"""The open-loop truth of an allocation (kvsim.models.allocation_truth): equal budgets are exactly the
session's own open-loop measurement, and an uneven split of the same memory is measured, not assumed."""

from __future__ import annotations

import pytest
from test_quality import HAS_TORCH, _private_cache, session, text_path  # noqa: F401  (the tiny model's session)

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")


def test_equal_budgets_are_the_sessions_open_loop(session):  # noqa: F811
    from kvsim.models.allocation_truth import open_truth

    even = [[12] * session.kv_heads for _ in range(session.layers)]
    got = open_truth(session, "h2o", even, {"recent_window": 4})
    want = session.evaluate("h2o", 12, "open", recent_window=4)
    for key in ("nll", "kl", "delta_nll", "retained_mass", "retained_mass_by_layer"):
        assert got[key] == want[key], key


def test_an_uneven_split_of_the_same_memory_is_measured(session):  # noqa: F811
    from kvsim.models.allocation_truth import open_truth
    from kvsim.models.errors import QualityError

    n = session.layers * session.kv_heads
    flat = [6 if i % 2 else 18 for i in range(n)]
    flat[-1] += 12 * n - sum(flat)
    uneven = [flat[x * session.kv_heads:(x + 1) * session.kv_heads] for x in range(session.layers)]
    got = open_truth(session, "h2o", uneven, {"recent_window": 4})
    even = open_truth(session, "h2o", [[12] * session.kv_heads for _ in range(session.layers)], {"recent_window": 4})
    assert got["kl"] != even["kl"] and got["kl"] > 0
    with pytest.raises(QualityError, match="an allocation for 1 layers"):
        open_truth(session, "h2o", [[12] * session.kv_heads], {"recent_window": 4})

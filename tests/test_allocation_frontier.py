"""The frontier's truth (kvsim.allocation.truth): several splits masking ONE batched pass give what
each gives alone, every cell is kept on disk (read back, not measured again, by a resumed grid) and
gathered in the document the app reads."""

from __future__ import annotations

import pytest
from test_quality import HAS_TORCH, _nll_bound, _private_cache, session, text_path  # noqa: F401  (the tiny model's session)

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")


def _splits(session):  # noqa: F811
    """Three splits of the same memory (12 per head on average): even, and two uneven ones."""
    n = session.layers * session.kv_heads
    out = [[12] * n]
    for lo, hi in ((6, 18), (9, 15)):
        flat = [lo if i % 2 else hi for i in range(n)]
        flat[-1] += 12 * n - sum(flat)
        out.append(flat)
    return [tuple(tuple(f[x * session.kv_heads:(x + 1) * session.kv_heads]) for x in range(session.layers)) for f in out]


def test_a_batched_pass_gives_each_split_what_it_gives_alone(session):  # noqa: F811
    from kvsim.allocation.truth import open_truth, open_truths

    splits = _splits(session)
    batched = open_truths(session, "h2o", [[list(r) for r in s] for s in splits], {"recent_window": 4})
    # the batch orders its sums otherwise than one pass: each token's NLL within _nll_bound (tests/test_quality.py:
    # two float32 passes' log-softmax apart by the forward pass's rounding), so the mean NLL and delta NLL within
    # it too, and the KL (a difference of two such log-probabilities, weighed by probabilities summing to 1)
    # within twice it; the schedules are the same replays, so the retained mass is equal exactly
    bound = _nll_bound(session.model, session.ids)
    for split, got in zip(splits, batched, strict=True):
        want = open_truth(session, "h2o", [list(r) for r in split], {"recent_window": 4})
        assert got["retained_mass"] == want["retained_mass"]
        assert abs(got["nll"] - want["nll"]) <= bound and abs(got["delta_nll"] - want["delta_nll"]) <= bound
        assert abs(got["kl"] - want["kl"]) <= 2 * bound
    assert len({round(r["kl"], 12) for r in batched}) == 3  # three schedules, three figures: the rows are not one


def test_cells_are_cached_resumed_and_gathered_for_the_app(session, monkeypatch):  # noqa: F811
    from kvsim.allocation import truth as at
    from kvsim.models.loading import file_sha256

    splits = _splits(session)
    cells = [at.Cell("h2o", name, 12, s, (("recent_window", 4),)) for name, s in zip(("uniform", "a", "b"), splits, strict=True)]
    passes = []
    real = at.open_truths
    monkeypatch.setattr(at, "open_truths", lambda s, p, grids, params: passes.append(len(grids)) or real(s, p, grids, params))
    first = at.measure_cells(session, cells[:1], batch=4)  # an interrupted grid: one cell done
    assert passes == [1] and first[0]["cached"] is False
    rows = at.measure_cells(session, cells, batch=4)  # resumed: the two left, in one batched pass
    assert passes == [1, 2]
    assert [r["cached"] for r in rows] == [True, False, False]
    assert rows[0]["kl"] == first[0]["kl"] and rows[1]["batch"] == 2
    again = at.measure_cells(session, cells, batch=4)
    assert passes == [1, 2] and all(r["cached"] for r in again)
    assert [r["kl"] for r in again] == [r["kl"] for r in rows]
    doc = at.read_document(at.document_path(session.model_id, file_sha256(session.text_path), session.steps))
    assert sorted((r["allocate"], r["kl"]) for r in doc) == sorted((r["allocate"], r["kl"]) for r in rows)
    assert all(r["positions"] == 12 * session.layers * session.kv_heads for r in doc)

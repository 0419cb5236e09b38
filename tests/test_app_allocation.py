"""The allocation view through Streamlit's AppTest: each allocator's budget grid on the shipped bundle at
the same memory, the masses and the gap each closes, and a budget the policy refuses said, not raised."""

from __future__ import annotations

import json

import numpy as np
from streamlit.testing.v1 import AppTest
from test_app import APP, TIMEOUT, values

from kvsim.allocation import allocators as al
from kvsim.data.catalog import resolve_bundle
from kvsim.policies import PolicySpec


def open_view(budget: int) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT * 2)
    at.query_params.update({"budget": str(budget), "view": "Allocation"})
    return at.run()


def test_the_view_draws_each_allocators_split_and_mass():
    at = open_view(64)
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    grids, bars = [json.loads(c.proto.spec) for c in at.get("plotly_chart")][:2]  # then the frontier's (test_app_frontier.py)
    heatmaps = [t for t in grids["data"] if t["type"] == "heatmap"]
    assert len(heatmaps) == 4  # uniform, pyramidkv, cake, optimal: adakv and duo need several KV heads per layer
    heads = al.load_heads(resolve_bundle("gemma3-270m-heapq"))
    spec = PolicySpec.of("h2o", 64)
    best = al.optimal(heads, spec)
    shown = np.asarray(values(heatmaps[-1]["z"]), dtype=np.float64).ravel()
    assert shown.tolist() == [float(b) for b in best.budgets]
    assert sum(shown) == 64 * 18
    gains = values(bars["data"][0]["y"])  # each allocator's mass minus uniform's, on a zero-based axis
    assert gains[0] == 0 and gains[-1] == max(gains)  # the optimum bounds every static split
    low, high = bars["layout"]["yaxis"]["range"]
    assert low < min(gains) and low <= 0 <= high
    table = at.table[0].value
    assert list(table["against uniform"])[0] == "the baseline"
    assert all(w.startswith(("better than uniform by", "worse than uniform by", "level with uniform", "the optimum: "))
               for w in list(table["against uniform"])[1:])
    caption = " ".join(c.value for c in at.caption)
    assert "adakv is uniform within a layer" in caption and "duo splits" in caption


def test_a_budget_the_policy_refuses_is_said():
    at = open_view(16)
    assert [e.value for e in at.exception] == []
    assert any("recent_window must be less than budget (16)" in e.value for e in at.error)

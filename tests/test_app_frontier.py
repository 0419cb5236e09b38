"""The allocation view's frontier through Streamlit's AppTest: memory against KL for policies x
allocators at budgets 32-512, drawn from the measured cells only (the shipped study's and the disk
cache's), the Pareto-best ringed, every cell not measured said with the command that measures it, a
cell the policy cannot run said as such; and the Pareto rule itself."""

from __future__ import annotations

import json

from streamlit.testing.v1 import AppTest
from test_app import APP, TIMEOUT, values

from kvsim.data.catalog import resolve_bundle
from kvsim.views.figures.frontier import pareto


def test_pareto_keeps_what_no_cell_beats_with_as_little_memory():
    pts = [{"positions": 100, "kl": 0.5}, {"positions": 100, "kl": 0.4}, {"positions": 200, "kl": 0.45},
           {"positions": 200, "kl": 0.3}, {"positions": 400, "kl": 0.3}, {"positions": 400, "kl": 0.1}]
    assert [(p["positions"], p["kl"]) for p in pareto(pts)] == [(100, 0.4), (200, 0.3), (400, 0.1)]
    assert pareto([]) == []


def _measured(steps: int) -> dict:
    from kvsim.allocation.truth import documents_for
    from kvsim.app.allocation_tab import FRONTIER_ALLOCATORS, _source, frontier_policies

    _, sha, model_id, why = _source(resolve_bundle("gemma3-270m-heapq"))
    assert why == ""
    rows = documents_for(model_id, sha).get(steps, [])
    return {(r["policy"], r["allocate"], r["budget"]): r for r in rows
            if r["policy"] in frontier_policies(rows) and r["allocate"] in FRONTIER_ALLOCATORS}


def test_the_frontier_draws_measured_cells_and_says_how_to_measure_the_rest():
    at = AppTest.from_file(APP, default_timeout=TIMEOUT * 3)
    at.query_params.update({"budget": "64", "view": "Allocation"})
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    box = at.selectbox(key="frontier_steps")
    steps = max(box.options, key=lambda s: int(s.split(" cells")[0].rsplit(": ", 1)[1]))  # the most cells measured
    at = box.set_value(int(steps.split(" ")[0])).run()
    assert [e.value for e in at.exception] == []
    want = _measured(int(steps.split(" ")[0]))
    assert want, "the shipped study (traces/allocation-*.json) gives the frontier cells to draw"
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    frontier = next(c for c in charts if "KL" in c["layout"]["yaxis"]["title"]["text"])
    drawn = {}
    for t in frontier["data"]:
        if t["name"] in ("Pareto frontier", "Pareto-best"):
            continue
        policy, allocate = t["name"].split(", ")
        for x, y, c in zip(values(t["x"]), values(t["y"]), t["customdata"], strict=True):
            drawn[(policy, allocate, int(c[0]))] = (x, y)
    assert drawn == {k: (r["positions"], r["kl"]) for k, r in want.items()}  # every measured cell, nothing else
    ringed = next(t for t in frontier["data"] if t["name"] == "Pareto-best")
    best = pareto(list(want.values()))
    assert list(zip(values(ringed["x"]), values(ringed["y"]), strict=True)) == [(p["positions"], p["kl"]) for p in best]
    table = at.dataframe[-1].value  # the frontier's table, below the allocators' masses
    assert len(table) == 16  # 4 policies x 4 allocators, a column per budget
    h2o = table[table["policy"] == "h2o"]
    assert (h2o["budget 32: 576 positions"] == "cannot run: below h2o's minimum of 33 per head").all()
    caption = " ".join(c.value for c in at.caption)
    assert "h2o at 32: h2o's minimum of 33 positions per head (recent_window 32 + 1)" in caption
    shown = [v for budget in (32, 64, 128, 256, 512) for v in table[f"budget {budget}: {budget * 18} positions"]]
    missing = [v for v in shown if v.startswith("KL not measured")]
    refused = [v for v in shown if v.startswith("cannot run")]
    assert len(shown) - len(missing) - len(refused) == len(want)
    commands = [c.value for c in at.code if c.value.startswith("python -m kvsim quality ")]
    assert bool(commands) == bool(missing)  # where a cell is not measured, the command that measures it
    assert all("--mode open --allocate" in c for c in commands)

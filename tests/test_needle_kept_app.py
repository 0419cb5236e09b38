"""A needle cell opens its trial in the kept-positions view (issue 35, item 2), through AppTest: a real
grid of the tiny Gemma 3 (tests/test_needle.py) measured with ``--attention``, the needle view's button,
then the kept view replaying the trial's attention with the key's columns marked and each key token's
eviction step shown, which must be the step the trial's own cache let it go (its recorded departures);
and the control's attention opened with the exact optimum, whose steps must be the run's optimum fate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_needle import HAS_TORCH, folder  # noqa: F401  (the tiny model, a module fixture)

from kvsim import cli

APP = str(Path(__file__).resolve().parent.parent / "app.py")
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")


def measured_grid(folder, capsys) -> dict:  # noqa: F811
    """A grid measured into ``KVSIM_CACHE_DIR`` with --attention and --optimum (h2o and streaming_llm at 24)."""
    code = cli.main(["needle", "--model", str(folder), "--policies", "h2o,streaming_llm", "--budget", "24",
                     "--recent-window", "4", "--sinks", "2", "--lengths", "120", "--depths", "0.5", "--quiet", "--json",
                     "--attention", "--optimum"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_a_cell_opens_its_trial_in_the_kept_view_with_the_trials_own_eviction_steps(folder, tmp_path, monkeypatch,  # noqa: F811
                                                                                   capsys):
    from kvsim.app import memo
    from kvsim.models.needle import departures

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    doc = measured_grid(folder, capsys)
    cell = doc["cells"][0]
    memo.bundle_traces.clear()  # the trace list is kept a minute; this test's bundles are new
    at = AppTest.from_file(APP, default_timeout=300)
    at.query_params["view"] = "Pass key"
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    (table,) = [d.value for d in at.dataframe if "key lost at step" in d.value.columns]  # not the conversation's
    assert "exact optimum: key lost at step" in table.columns  # --optimum's column beside each policy's
    for policy in ("h2o", "streaming_llm"):
        run = next(r for r in cell["runs"] if r["policy"] == policy)
        at.selectbox(key="needle_policy").set_value(run["label"]).run()
        at.selectbox(key="needle_layer").set_value(1).run()
        at.selectbox(key="needle_head").set_value(1).run()
        (button,) = [b for b in at.button if b.key == "needle_open_kept"]
        assert f"open layer 1 of this trial in the kept-positions view ({run['label']})" == button.label
        button.click().run()
        assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == [], policy
        assert at.session_state["view"] == "Kept positions"
        assert at.session_state["trace"] == f"{run['attention']['bundle']}:L01H1"
        assert at.session_state["policies"] == [policy] and at.session_state["budget"] == 24
        (steps,) = [d.value for d in at.dataframe if "policy" in d.value.columns and "position" in " ".join(d.value.columns)]
        left = departures(run)[1, 1]
        want = ["held" if left[p] < 0 else str(left[p]) for p in cell["key_positions"]]
        assert [str(v) for v in steps.iloc[0, 1:].tolist()] == want, policy
        spec = json.loads(at.get("plotly_chart")[0].proto.spec)
        gone = [t for t in spec["data"] if t.get("name", "").endswith("key token left")]
        shown = {int(x): int(y) for t in gone for x, y in zip(t["x"], t["y"], strict=True)}
        assert shown == {p: int(left[p]) for p in cell["key_positions"] if left[p] >= 0}
        shaded = [s for s in spec["layout"]["shapes"] if s.get("fillcolor") == "#d62728"]
        assert sorted(s["x0"] + 0.5 for s in shaded) == sorted(cell["key_positions"])  # the key's columns marked
        at.query_params["view"] = "Pass key"
        at.session_state["view"] = "Pass key"
        at.run()
    # the exact optimum's kept sets: the control's attention opened with optimal at the head's budget
    run = cell["runs"][0]
    at.selectbox(key="needle_policy").set_value(run["label"]).run()
    at.selectbox(key="needle_layer").set_value(1).run()
    at.selectbox(key="needle_head").set_value(1).run()
    (button,) = [b for b in at.button if b.key == "needle_open_optimum"]
    button.click().run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    assert at.session_state["policies"] == ["optimal"] and at.session_state["budget"] == 24
    assert at.session_state["trace"] == f"{run['optimal_attention']['bundle']}:L01H1"
    (steps,) = [d.value for d in at.dataframe if "policy" in d.value.columns and "position" in " ".join(d.value.columns)]
    shown = [str(v) for v in steps.iloc[0, 1:].tolist()]
    gone = [int(v) for v in shown if v != "held"]
    last, first = run["optimal_key_left"][1][1], run["optimal_key_first_left"][1][1]
    assert (last is None) == ("held" in shown) and (last is None or max(gone) == last)
    assert (first is None) == (not gone) and (first is None or min(gone) == first)

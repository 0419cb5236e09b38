"""The policy lab: presets do what they say, stepping matches the harness, the editable table is
validated, the figures show each policy's step, and the app's lab tab runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from random_traces import with_members
from tolerance import rounding

import kvsim
from kvsim.analysis import lab
from kvsim.data import vectors
from kvsim.data.trace import TraceError
from kvsim.policies import PolicySpec
from kvsim.views import lab as lab_figures

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def victims(steps, side):
    return [s.sides[side].victims for s in steps]


# --- the presets: the cards' distinguishing vectors and the pitfall --------------------------------


def test_sliding_window_evicts_0_1_2_where_streaming_llm_evicts_4():
    steps = lab.run_preset("sliding_window vs streaming_llm")
    assert victims(steps, 0)[4:7] == [[0], [1], [2]]
    assert victims(steps, 1)[4] == [4]
    assert all(s.sides[1].kept_after[:4].tolist() == [0, 1, 2, 3] for s in steps[3:])


def test_h2o_defends_the_early_spike_scissorhands_evicts_it():
    steps = lab.run_preset("h2o vs scissorhands")
    first = steps[3]  # step 4, the first eviction
    h2o, sh = first.sides
    assert first.t == 4 and h2o.victims == [2] and sh.victims == [0]
    # 1 + 0.98 + 0.01 + 0.01: four float32 weights (half an ulp each) summed in float32
    assert h2o.scores[0] == pytest.approx(2.0, abs=rounding(8, 2.0)) and h2o.scores[0] == h2o.scores.max()
    assert sh.scores[0] == 1 and sh.scores[1] == 2  # a single vote against two
    assert all(0 in s.sides[0].kept_after for s in steps)


def test_h2o_recent_window_zero_evicts_the_newest_and_never_advances():
    steps = lab.run_preset("h2o recent_window 0 pitfall")
    for s in steps[3:]:
        assert s.sides[0].victims == [s.t]  # the position just admitted, at once
        assert s.sides[0].kept_after.tolist() == [0, 1, 2, 3]
        assert s.sides[1].kept_after[-1] == s.t  # with a recent window the cache moves on
    assert lab.step_table(steps[5])[lambda d: d.position == 6].iloc[0, 2] == "evicted at once"


def test_tova_drops_a_position_after_one_quiet_step_h2o_remembers():
    steps = lab.run_preset("tova vs h2o")
    assert steps[5].sides[0].victims == [1]
    assert all(1 in s.sides[1].kept_after for s in steps)


def test_first_divergence_is_the_step_the_preset_is_about():
    assert [lab.first_divergence(lab.run_preset(n)) for n in lab.PRESETS] == [5, 4, 4, 4]
    same = lab.side_by_side(lab.PRESETS["tova vs h2o"].trace(), lab.LabPolicy("tova"), lab.LabPolicy("tova"), 4)
    assert lab.first_divergence(same) == 1


# --- stepping is the harness ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(lab.PRESETS))
def test_side_by_side_matches_replay(name):
    p = lab.PRESETS[name]
    steps = lab.run_preset(name)
    tr = p.trace()
    for side, spec in enumerate((p.left, p.right)):
        r = kvsim.replay(tr, spec.name, budget=p.budget, record_kept=True, record_scores=True, **spec.params)
        np.testing.assert_array_equal([s.sides[side].retained_mass for s in steps], r.retained_mass_series)
        for i, s in enumerate(steps):
            k = s.sides[side].kept_after
            assert k.tolist() == r.kept_history[i, : k.size].tolist()
            if s.sides[side].scores is not None:
                n = s.sides[side].scores.size
                np.testing.assert_array_equal(s.sides[side].scores, r.score_history[i, :n])


def test_side_by_side_runs_every_registry_policy_including_the_offline_ones():
    tr = with_members(lab.PRESETS["h2o vs scissorhands"].trace())  # keys, queries... for the query-aware policies
    for name in kvsim.POLICIES:
        params = {"recent_window": 1} if "recent_window" in kvsim.policy_params(name) else {}
        if vectors.missing(tr, kvsim.POLICIES[name].reads):  # a preset has attention only: refused in one line ...
            with pytest.raises(TraceError, match=f"^{tr.name}: policy {name} reads "):
                lab.side_by_side(tr, lab.LabPolicy(name, params), lab.LabPolicy("greedy_future"), budget=5)
            tr = with_members(kvsim.from_array(tr.attention, name=tr.name))  # ... and run where a copy has them
        steps = lab.side_by_side(tr, lab.LabPolicy(name, params), lab.LabPolicy("greedy_future"), budget=5)
        assert [s.t for s in steps] == list(range(1, 13))
        assert all(s.sides[0].kept_after.size == min(s.t + 1, 5) for s in steps)
    with pytest.raises(ValueError, match="^h2o: recent_window"):
        lab.side_by_side(tr, lab.LabPolicy("h2o", {"recent_window": 3}), lab.LabPolicy("tova"), budget=3)


def test_a_lab_policy_is_the_house_spec_at_the_labs_budget():
    side = lab.LabPolicy("scissorhands", {"recent_window": 2})
    assert side.spec(4) == PolicySpec.of("scissorhands", 4, recent_window=2)
    assert side.spec(4).kwargs == {"recent_window": 2, "history_window": 0}  # the defaults filled in
    assert side.label == "scissorhands (recent_window=2)"  # the label names only what the controls set
    with pytest.raises(ValueError, match=r"^scissorhands: recent_window must be less than budget \(2\), got 2$"):
        side.spec(2)
    with pytest.raises(ValueError, match="^tova: tova does not take parameter"):
        lab.LabPolicy("tova", {"recent_window": 1}).spec(4)


# --- the editable trace --------------------------------------------------------------------------


def test_table_round_trip():
    tr = lab.PRESETS["tova vs h2o"].trace()
    table = lab.preset_table(tr)
    assert table.shape == (12, 12) and np.isnan(table.iloc[0, 1]) and table.index[0] == "step 1"
    np.testing.assert_array_equal(lab.trace_from_table(table).attention, tr.attention)


def test_edited_table_is_normalised_and_ignores_the_upper_triangle():
    table = pd.DataFrame([[2.0, 9.0], [1.0, 3.0]], columns=["0", "1"])
    tr = lab.trace_from_table(table)
    np.testing.assert_array_equal(tr.attention[1, :1], [1.0])  # 1/1, 1/4 and 3/4: exact in binary, no rounding
    np.testing.assert_array_equal(tr.attention[2, :2], [0.25, 0.75])


@pytest.mark.parametrize(
    "cells, problem",
    [
        ([[1.0, None], [-1.0, 2.0]], "step 2: attention has negative weights"),
        ([[1.0, None], [0.0, 0.0]], "step 2: attention row sums to zero"),
        ([[1.0, None], ["x", 1.0]], "step 2, position 0: not a number"),
        ([[1.0, None], [None, 1.0]], "step 2, position 0: empty"),
        ([[1.0, None], [float("inf"), 1.0]], "step 2: attention has NaN or infinite"),
    ],
)
def test_bad_tables_get_one_line_naming_step_and_problem(cells, problem):
    with pytest.raises(kvsim.TraceError, match=problem) as e:
        lab.trace_from_table(pd.DataFrame(cells, columns=["0", "1"]))
    assert "\n" not in str(e.value) and str(e.value).startswith("lab table: ")


def test_table_size_is_refused_by_name():
    with pytest.raises(kvsim.TraceError, match="1 to 24 steps"):
        lab.trace_from_table(pd.DataFrame(np.ones((25, 25))))
    with pytest.raises(kvsim.TraceError, match="3 steps need 3 position columns"):
        lab.trace_from_table(pd.DataFrame(np.ones((3, 2))))


# --- figures -------------------------------------------------------------------------------------


def test_step_figure_colours_each_position_by_what_the_policy_did():
    steps = lab.run_preset("h2o vs scissorhands")
    fig = lab_figures.step_figure(steps[4], side=1)  # scissorhands at step 5: 0 gone, 3 the victim
    bars = {tr.name: tr for tr in fig.data if tr.type == "bar"}
    assert list(bars["evicted earlier"].x) == [0]
    assert list(bars["victim (evicted this step)"].x) == [3]
    assert list(bars["held"].x) == [1, 2, 4]
    np.testing.assert_allclose(bars["held"].y, steps[4].row[[1, 2, 4]], rtol=rounding(1))  # the row's weights, as drawn
    text = next(tr for tr in fig.data if getattr(tr, "mode", None) == "text")
    # votes as counts; step 5 gives none (0.2475 each is below the fair share 0.25)
    assert list(text.x) == [1, 2, 3, 4, 5] and list(text.text) == ["2", "2", "1", "0", "0"]
    assert "evicts 3" in fig.layout.title.text


def test_step_figure_marks_the_newest_evicted_at_once():
    steps = lab.run_preset("h2o recent_window 0 pitfall")
    fig = lab_figures.step_figure(steps[6], side=0)
    new = next(tr for tr in fig.data if tr.type == "scatter" and tr.name.startswith("new position"))
    assert new.name == "new position 7 (evicted at once)" and list(new.x) == [7]
    no_scores = lab_figures.step_figure(lab.run_preset("tova vs h2o")[6], side=0)
    assert not any(getattr(tr, "mode", None) == "text" for tr in no_scores.data)  # tova keeps none


def test_timeline_figure_grid():
    steps = lab.run_preset("sliding_window vs streaming_llm")
    fig = lab_figures.timeline_figure(steps, side=1, current=5)
    z = np.asarray(fig.data[0].z)
    assert z.shape == (12, 13)
    assert z[4, 4] == 3 and z[4, :4].tolist() == [2, 2, 2, 2]  # step 5: 4 the victim, sinks held
    assert z[5, 4] == 1 and z[0, 5] == 0  # gone afterwards; not yet generated
    assert fig.layout.shapes[0].y0 == 4.5


# --- the app's lab tab ---------------------------------------------------------------------------


def lab_app():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["view"] = "Policy lab"
    return at.run()


def titles(at) -> list[str]:
    return [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]


def test_app_lab_tab_steps_a_preset_and_reports_refusals():
    at = lab_app()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    assert at.selectbox(key="lab_preset").value == "sliding_window vs streaming_llm"
    assert at.slider(key="lab_step").value == 5  # opens where the two first evict differently
    # each step is measured before its eviction, and says so (a bare "retained 1.000, evicts 0" beside a
    # red victim bar read as if the eviction came first)
    assert titles(at)[0] == ("sliding_window, step 5: retained 1.000, then evicts 0<br><sup>retained: query 5's "
                             "attention on the cache it found, measured before this step's eviction</sup>")
    assert titles(at)[2].startswith("streaming_llm (sinks=4), step 5: retained 1.000, then evicts 4<br>")

    at.selectbox(key="lab_preset").set_value("h2o vs scissorhands").run()
    assert at.number_input(key="lab_budget").value == 4 and at.slider(key="lab_step").value == 4
    assert [titles(at)[0].split("<br>")[0], titles(at)[2].split("<br>")[0]] == [
        "h2o (recent_window=2), step 4: retained 1.000, then evicts 2",
        "scissorhands (recent_window=2), step 4: retained 1.000, then evicts 0",
    ]
    at.slider(key="lab_step").set_value(6).run()
    assert titles(at)[0].startswith("h2o (recent_window=2), step 6:")
    at.number_input(key="lab_left_rw").set_value(4).run()
    assert [e.value for e in at.error] == ["h2o: recent_window must be less than budget (4), got 4. Change the setting above."]
    assert titles(at) == []  # nothing drawn from a refused setting


def test_app_lab_tab_runs_every_preset():
    at = lab_app()
    for name in lab.PRESETS:
        at.selectbox(key="lab_preset").set_value(name).run()
        assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == [], name
        assert len(at.get("plotly_chart")) == 4
        assert at.slider(key="lab_step").value == lab.first_divergence(lab.run_preset(name))


def test_one_sides_step_table_has_short_headers_and_the_same_cells():
    steps = lab.run_preset("h2o recent_window 0 pitfall")
    both = lab.step_table(steps[5])
    for i, side in enumerate(steps[5].sides):
        one = lab.step_table(steps[5], side=i)
        assert list(one.columns[:3]) == ["position", "weight", "state"]
        assert all(": " not in c for c in one.columns)
        assert one["state"].tolist() == both[f"{side.label}: state"].tolist()


def test_app_lab_tables_say_something_in_every_cell():
    """Issue 31, item 5: the lab's tables showed a raw "None" (the new position's weight; the shown share and
    score of a position not held). Every cell of every preset's tables, on every step, is text a reader
    can read, and the new position's and an unheld position's cells say what they are."""
    at = lab_app()
    for name in lab.PRESETS:
        at.selectbox(key="lab_preset").set_value(name).run()
        for step in range(1, len(lab.run_preset(name)) + 1):
            at.slider(key="lab_step").set_value(step).run()
            frames = [d.value for d in at.dataframe][-2:]  # the step tables, one per side (first: the editor)
            assert len(frames) == 2 and all("state" in f.columns for f in frames), name
            for frame in frames:
                cells = frame.astype(object).to_numpy().ravel().tolist()
                assert not any(c is None or (isinstance(c, float) and np.isnan(c)) or str(c) in ("None", "nan", "")
                               for c in cells), (name, step, frame)
                assert frame["weight"].iloc[-1] == lab.NEW_WEIGHT
    steps = lab.run_preset("h2o vs scissorhands")
    table = lab.step_table(steps[-1])
    held_nowhere = [c for c in table.columns if c.endswith(": score")]
    assert held_nowhere and any((table[c] == lab.NOT_HELD).any() for c in held_nowhere)

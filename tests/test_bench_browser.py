"""The browser benchmark's bookkeeping, without a browser: how runs become a verdict, how the table
reads, and how the CLI routes its flags. The timing itself is a benchmark, never asserted here."""

from __future__ import annotations

import json

import pytest

from kvsim import cli
from kvsim.bench import browser as bb


def T(seconds, error=None):
    return bb.Timing(seconds, error)


def test_a_step_passes_only_when_every_run_is_within_its_target():
    ok = bb.summarize([T(0.4), T(0.9), T(0.6)], 1.0)
    assert ok == {"median_s": 0.6, "worst_s": 0.9, "count": 3, "failed_runs": 0, "result": "PASS",
                  "median_server_s": None, "median_sent_mb": None}
    # the median is within the target, the worst is not: a miss
    slow = bb.summarize([T(0.4), T(1.2), T(0.6)], 1.0)
    assert slow["result"] == "FAIL" and slow["median_s"] == 0.6 and slow["worst_s"] == 1.2
    assert bb.summarize([T(1.0)], 1.0)["result"] == "PASS"  # "within": the target itself is met


def test_a_run_without_a_time_is_a_miss_not_a_crash():
    s = bb.summarize([T(0.2), T(None, "TimeoutError: never idle"), T(0.3)], 1.0)
    assert s["result"] == "FAIL" and s["failed_runs"] == 1 and s["worst_s"] == 0.3 and s["median_s"] == 0.25
    none = bb.summarize([T(None, "x"), T(None, "y")], 5.0)
    assert none["result"] == "FAIL" and none["median_s"] is None and none["worst_s"] is None
    assert bb.summarize([], 1.0)["result"] == "FAIL"  # a step that never ran proves nothing


def test_upload_isolation():
    assert bb.upload_isolation(True, [False] * 7)["result"] == "PASS"
    assert bb.upload_isolation(True, [False, True, False])["result"] == "FAIL"
    assert bb.upload_isolation(True, [False, None])["result"] == "FAIL"  # a session that could not be read
    # when the uploader itself does not show the file, the others' silence means nothing
    assert bb.upload_isolation(False, [False] * 7)["result"] == "FAIL"


def test_the_server_share_and_the_bytes_are_medians_over_the_runs_that_finished():
    runs = [bb.Timing(0.9, None, 0.3, 12.0), bb.Timing(1.5, None, 1.1, 14.0), bb.Timing(None, "timeout", 2.0, 99.0),
            bb.Timing(0.8, None, 0.2, 10.0)]
    s = bb.summarize(runs, 1.0)
    assert s["median_server_s"] == 0.3 and s["median_sent_mb"] == 12.0 and s["result"] == "FAIL"


def _doc(load_iso="PASS", round_runs=((0.5, None), (0.7, None), (None, "TimeoutError: never idle"))):
    rep = bb.StepReport("budget 256 -> 128", 1.0, [bb.Timing(s, e, 0.25, 3.0) for s, e in round_runs])
    fast = bb.StepReport("a new session, default view", 2.0, [T(1.0), T(1.5), T(1.9)])
    load = bb.StepReport("open the default view", 3.0, [T(2.0)] * 8)
    doc = {"kind": "browser", "cold_cache": False, "rounds": 3, "server_start_s": [3.0, 2.5, 2.7],
           "machine": {"cpus": 2, "python": "3.11", "streamlit": "1.x", "load_average_at_start": [9.5, 8.0, 7.0],
                       "load_average_at_end": [1.0, 2.0, 3.0]},
           "steps": [fast.to_dict(), rep.to_dict()],
           "load": {"sessions": 8, "steps": [load.to_dict()],
                    "upload_isolation": {"result": load_iso, "detail": "..."},
                    "server_peak_rss_mb": {"sampled_tree": 700.0, "sample_interval_s": 0.2, "vmhwm": 710.0,
                                           "before_load": 70.0}}}
    return bb.overall(doc)


def test_the_verdict_counts_missed_steps_and_the_isolation_check():
    doc = _doc()
    assert doc["result"] == "FAIL" and doc["failed_steps"] == 1 and doc["total_steps"] == 4
    ok = _doc(round_runs=((0.5, None), (0.7, None), (0.9, None)))
    assert ok["result"] == "PASS" and ok["failed_steps"] == 0
    leak = _doc(load_iso="FAIL", round_runs=((0.5, None), (0.7, None), (0.9, None)))
    assert leak["result"] == "FAIL" and leak["failed_steps"] == 1
    json.loads(bb.dumps(doc))  # --json: one plain JSON document


def test_the_table_shows_each_step_against_its_target_and_why_a_run_failed():
    text = bb.render(_doc())
    line = next(x for x in text.splitlines() if x.startswith("budget 256 -> 128"))
    assert "1.00s" in line and "0.60s" in line and "0.70s" in line and line.rstrip().endswith("without a time)")
    assert " FAIL " in line and " 0.25s " in line and " 3.0MB " in line
    assert "error: TimeoutError: never idle" in text
    assert " PASS " in next(x for x in text.splitlines() if x.startswith("a new session"))
    assert "load average (1, 5, 15 min) at the start 9.5, 8.0, 7.0; at the end 1.0, 2.0, 3.0" in text
    assert "VmHWM 710.00 MB" in text and "uploads stay in their session: PASS" in text
    assert text.rstrip().endswith("overall: FAIL (1 of 4 steps missed)")


def test_the_step_lists_are_well_formed():
    for steps in (bb.ROUND, bb.EXPLORATION):
        names = [s.name for s in steps]
        assert len(names) == len(set(names))
        for s in steps:
            assert s.target_s > 0 and s.min_figures >= 0 and s.min_images >= 0
            assert isinstance(s.action, bb.Open | bb.SetNumber | bb.Tab | bb.Upload)
    # each round starts from a new session, so the rounds see the same state
    assert isinstance(bb.ROUND[0].action, bb.Open) and bb.ROUND[0].action.new_session
    assert isinstance(bb.EXPLORATION[0].action, bb.Open) and bb.EXPLORATION[0].action.new_session
    six = next(s for s in bb.ROUND if "six" in s.name)
    assert all(p in six.action.query for p in bb.SIX_POLICIES) and six.min_images == 6


def test_each_step_is_measured_against_the_same_action_on_the_bare_page():
    floors = {s.name: s for s in bb.FLOOR}
    for step in bb.ROUND:
        floor = floors[step.floor]  # every step of a round has its floor
        assert type(floor.action) is type(step.action)
        if isinstance(step.action, bb.Open):
            assert (floor.action.new_session, floor.action.new_tab) == (step.action.new_session, step.action.new_tab)
            assert bool(floor.action.query) == bool(step.action.query)
        if isinstance(step.action, bb.SetNumber):  # the bare page has the input the step types into
            assert f'number_input("{step.action.label}"' in bb.FLOOR_SCRIPT
    compile(bb.FLOOR_SCRIPT, "floor_page.py", "exec")
    assert floors[bb.ROUND[0].floor] is bb.FLOOR[0]  # a fresh server's first page against a fresh bare server's


def test_a_steps_target_is_its_floors_worst_run_plus_the_margin_and_the_table_says_how_far_beyond():
    floor = bb.StepReport("floor: a link", 1.0, [T(0.7), T(0.9), T(0.8)])
    step = bb.StepReport("a link with all six policies", 1.0, [T(1.0), T(1.3), T(1.1)])
    step.measure_against(floor, 0.3)
    assert step.target_s == 1.2 and step.floor == {"name": "floor: a link", "median_s": 0.8, "worst_s": 0.9,
                                                   "margin_s": 0.3}
    doc = {"kind": "browser", "cold_cache": False, "rounds": 3, "server_start_s": [1.0], "floor": [floor.to_dict()],
           "floor_margin_s": 0.3, "steps": [step.to_dict()], "load": None,
           "machine": {"cpus": 2, "python": "3.11", "streamlit": "x"}}
    text = bb.render(bb.overall(doc))
    line = next(x for x in text.splitlines() if x.startswith("a link with all six policies"))
    assert " FAIL " in line and " 0.80s " in line and line.rstrip().endswith("+0.30s")  # median 1.1 vs the floor's 0.8
    floor_line = next(x for x in text.splitlines() if x.startswith("floor: a link"))
    assert " PASS " not in floor_line and " FAIL " not in floor_line  # the floor is the measure, not measured
    assert "the floor's worst run + 0.3 s" in text and doc["failed_steps"] == 1 and doc["total_steps"] == 1
    missing = bb.StepReport("budget 256 -> 128", 1.0, [T(0.5)])
    missing.measure_against(bb.StepReport("floor: a control change", 1.0, [T(None, "TimeoutError")]), 0.3)
    assert missing.target_s == 1.0 and missing.floor["worst_s"] is None  # no floor measured: the fixed target


@pytest.mark.parametrize("argv, message", [
    (["bench", "--rounds", "2"], "--rounds only applies with --browser"),
    (["bench", "--cold-cache"], "--cold-cache only applies with --browser"),
    (["bench", "--browser", "--full-reference"], "--full-reference applies to the speed benchmark, not to --browser"),
    (["bench", "--browser", "--no-load", "--only-load"], "exclude each other"),
    (["bench", "--browser", "--rounds", "0"], "positive integer"),
])
def test_the_cli_refuses_flags_that_do_not_go_together(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsim: error:") and message in err and err.count("\n") == 1


def test_the_cli_renders_a_browser_document_with_the_browser_table():
    assert cli.render("bench", _doc()) == bb.render(_doc())


def test_the_run_reports_progress_as_the_share_of_steps_timed():
    from kvsim.bench.browser.driver import _Tally

    calls = []
    say = _Tally(lambda f, note="": calls.append((f, note)), total=4)
    say("round 1 of 2: a fresh server")
    for name in ("  first page", "  second page", "under load", "past the end"):
        say(name)
        say.advance()
    say.advance()
    say("after every step")  # never over 1
    assert calls == [(0.0, "round 1 of 2: a fresh server"), (0.0, "  first page"), (0.25, "  second page"),
                     (0.5, "under load"), (0.75, "past the end"), (1.0, "after every step")]
    _Tally(None, total=0)("nobody listens")  # no callback, no steps: nothing to divide or call

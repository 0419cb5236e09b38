"""The class benchmark (``kvsim bench --load``): its verdicts and table without a server, its client
against a real server (two sessions: one's control change and one's upload stay in that session),
and the sampler that profiles the server. The timing itself is a benchmark, never asserted here."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvsim import cli
from kvsim.bench import client, load, sampler
from kvsim.bench.browser.server import Server, server_env


def figures(seconds, target=3.0, files=None):
    return load.StepFigures("tour 1: attention sinks", target, list(seconds), [], 0.05, files)


def test_a_step_passes_only_when_every_session_is_within_its_target():
    assert figures([0.5, 2.9, 1.0]).doc()["result"] == "PASS"
    slow = figures([0.5, 3.2, 1.0]).doc()
    assert slow["result"] == "FAIL" and slow["median_s"] == 1.0 and slow["worst_s"] == 3.2
    # a session without a time is a miss: the step fails, its median is over those that finished
    missed = load.StepFigures("x", 3.0, [0.5, None, 1.5], ["TimeoutError: never finished"], 0.1).doc()
    assert missed["result"] == "FAIL" and missed["misses"] == 1 and missed["worst_s"] is None and missed["median_s"] == 1.0


def _doc():
    open_step = load.StepFigures("open the default view", 5.0, [4.0, 4.5], [], 0.12, [1.0, 2.0]).doc()
    tour = figures([0.5, 3.5]).doc()
    return {"kind": "load", "machine": "2 cores", "load_before": [1.0, 2.0, 3.0], "load_after": [1.5, 2.0, 3.0],
            "result": "FAIL", "classes": [{"sessions": 2, "steps": [open_step, tour], "warm_s": 9.0, "idle_mb": 380.0,
                                           "peak_rss_mb": 400.0, "vmhwm_mb": 401.0, "isolation": "PASS", "bench_cpu_s": 0.2}]}


def test_the_table_shows_each_step_its_page_files_and_the_server_memory():
    text = cli.render("bench", _doc())
    row = next(x for x in text.splitlines() if x.strip().startswith("open the default view"))
    assert "4.25" in row and "4.50" in row and "5.0" in row and "0.12s" in row and row.rstrip().endswith("PASS")
    assert "of which the page's files" in text and "1.50" in text and "of which its first run" in text
    assert " FAIL" in next(x for x in text.splitlines() if "tour 1" in x)
    assert "peak 400.00 MB resident, VmHWM 401.00 MB" in text and "load average before [1.0, 2.0, 3.0]" in text
    assert "upload offered in that session only: PASS" in text and text.rstrip().endswith("overall: FAIL")


@pytest.mark.parametrize("argv, message", [
    (["bench", "--load", "0"], "positive integer"),
    (["bench", "--load", "8,x"], "expected N[,N...]"),
    (["bench", "--load", "8", "--browser"], "--browser and --load are separate benchmarks; run one at a time"),
    (["bench", "--load", "8", "--rounds", "2"], "--rounds only applies with --browser"),
    (["bench", "--long", "--lengths", "2048"], "--lengths only applies with --generate"),
    (["bench", "--generate", "--full-reference"], "--full-reference applies to the speed benchmark, not to --generate"),
    (["bench", "--profile", "p.txt"], "--profile only applies with --load"),
])
def test_the_cli_refuses_load_flags_that_do_not_go_together(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsim: error:") and message in err and err.count("\n") == 1


def test_the_lesson_is_well_formed():
    assert isinstance(load.LESSON[0].action, client.Open) and load.LESSON[0].target_s == load.OPEN_TARGET_S
    assert all(s.target_s == load.STEP_TARGET_S and not isinstance(s.action, client.Open) for s in load.LESSON[1:])
    assert len({s.name for s in load.LESSON}) == len(load.LESSON) and all(s.expect for s in load.LESSON)


def test_two_sessions_on_a_real_server_keep_their_settings_and_uploads_to_themselves(tmp_path):
    """The client speaks the real protocol: each session opens the default view, one changes the budget
    and uploads a trace, and the other's page shows neither."""
    server = Server(server_env(None), tmp_path / "server.log")

    async def lesson():
        a, b = client.Student(server.url), client.Student(server.url)
        try:
            for s in (a, b):
                seconds, error = await s.timed(load.LESSON[0].action, load.LESSON[0].expect)
                assert seconds is not None, error
            assert "budget=256" in a.query and a.files_bytes > 1_000_000  # the page's scripts came too
            seconds, error = await a.timed(client.Number("budget", 128), "budget=128")
            assert seconds is not None, error
            assert await load.isolation([a, b]) == ""
            assert "budget=256" in b.query and f"uploaded: {client.UPLOAD_NAME}" not in b.texts
        finally:
            await asyncio.gather(a.close(), b.close(), return_exceptions=True)

    try:
        asyncio.run(lesson())
    finally:
        server.stop()


def test_the_sampler_charges_a_busy_thread_cpu_to_its_stack(tmp_path):
    out = tmp_path / "stacks.txt"
    s = sampler.Sampler(str(out))
    s.start()
    s.on.set()

    def spin_for_the_test():
        end = time.thread_time() + 0.4
        while time.thread_time() < end:
            pass

    busy = threading.Thread(target=spin_for_the_test)
    busy.start()
    idle = threading.Thread(target=time.sleep, args=(0.5,))  # waits: charged nothing
    idle.start()
    busy.join()
    idle.join()
    s.write()
    text = sampler.summary(str(out))
    share = next(float(line.split("%")[0]) for line in text.splitlines() if "spin_for_the_test" in line)
    assert share > 50 and "sleep" not in text


def test_the_app_server_does_not_collect_all_its_garbage_after_every_run():
    """Streamlit's default gc.collect(2) after each script run was a third of the server's CPU under a
    class of thirty (docs/classroom.md): the app's server settings turn it off."""
    import tomllib
    from pathlib import Path

    config = tomllib.loads((Path(__file__).resolve().parents[1] / ".streamlit" / "config.toml").read_text())
    assert config["runner"]["postScriptGC"] is False

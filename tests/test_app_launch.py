"""``kvsim.app.launch``: the app's server process (``kvsim app``, ``kvsim serve``) loads what a first page
needs before Streamlit starts, and starts Streamlit whatever the preload met."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvsim.app import launch


def test_preload_fills_the_caches_the_default_view_reads_first(monkeypatch):
    from kvsim.app import memo, state, trace_tab

    launch.preload()
    assert "kvsim.app.main" in sys.modules and "pandas" in sys.modules
    first = state.defaults()
    trace = memo.load_named_trace(first["trace"])
    assert memo.load_named_trace(first["trace"]) is trace  # the resource cache holds it: no second read
    assert trace.steps > 0
    drawn = []  # the Trace view's picture of the default trace is there too: its first visit draws nothing
    monkeypatch.setattr(trace_tab.figures, "trace_matrix", lambda *a: drawn.append(a))
    assert trace_tab.cached_trace_matrix(trace) is not None and drawn == []


def test_preload_loads_every_policys_kernel_on_disk_not_only_the_default_views(monkeypatch):
    from kvsim.app import memo
    from kvsim.sim import engine

    warm, loaded = memo.warmup(), []  # the server's one Warmup (st.cache_resource): the one preload uses
    monkeypatch.setattr(warm, "cached", lambda names: True)  # as if every kernel were on disk
    monkeypatch.setattr(warm, "load", loaded.extend)
    launch.preload()
    assert set(engine.FAST) <= set(loaded) and "pooling" in loaded


def test_streamlit_gets_the_command_line_as_given(monkeypatch):
    got = []
    monkeypatch.setattr(launch, "preload", lambda: 0.0)
    import streamlit.web.cli as cli

    def fake_main(prog_name):
        got.append((prog_name, list(sys.argv)))
        raise SystemExit(0)

    monkeypatch.setattr(cli, "main", fake_main)
    monkeypatch.setattr(sys, "argv", ["launch"])
    assert launch.main(["run", "app.py", "--server.port", "8502"]) == 0
    assert got == [("streamlit", ["streamlit", "run", "app.py", "--server.port", "8502"])]


def test_a_failed_preload_is_one_line_and_the_server_still_starts(monkeypatch, capsys):
    def broken():
        raise OSError("canonical.npz: no such file")

    started = []
    monkeypatch.setattr(launch, "preload", broken)
    import streamlit.web.cli as cli

    monkeypatch.setattr(cli, "main", lambda prog_name: started.append(sys.argv[1:]))
    monkeypatch.setattr(sys, "argv", ["launch"])
    assert launch.main(["run", "app.py"]) == 0
    err = capsys.readouterr().err
    assert started == [["run", "app.py"]]
    assert err.count("\n") == 1 and "nothing preloaded" in err and "canonical.npz: no such file" in err


@pytest.mark.parametrize("argv", [["--version"]])
def test_the_module_runs_streamlits_own_command_line(argv):
    done = subprocess.run([sys.executable, "-m", "kvsim.app.launch", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Streamlit, version" in done.stdout


QUIET = """
import sys
from kvsim.app.launch import OUTSIDE_A_RUN, outside_a_run
from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx
import logging, streamlit as st
with outside_a_run():
    get_script_run_ctx()                      # 'missing ScriptRunContext!'
    st.cache_data(lambda: 1)                  # 'No runtime found'
    logging.getLogger(OUTSIDE_A_RUN[0]).error("a real error is still said")
sys.stderr.write("--after--\\n")
get_script_run_ctx()                          # said again: the levels are put back
"""


def test_the_preloads_streamlit_warnings_are_quiet_and_nothing_else():
    """Every ``kvsim app`` start printed five Streamlit WARNING lines about running outside a script run
    (issue 56); the preload silences those two loggers, for itself only, and an error is still said."""
    done = subprocess.run([sys.executable, "-c", QUIET], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    during, after = done.stderr.split("--after--\n")
    assert "WARNING" not in during and "ERROR" in during and "a real error is still said" in during
    assert "missing ScriptRunContext" in after


def test_a_whole_preload_prints_no_streamlit_warning():
    done = subprocess.run([sys.executable, "-c", "from kvsim.app import launch; launch.preload()"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "WARNING" not in done.stderr, done.stderr

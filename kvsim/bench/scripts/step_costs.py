"""What each of ``kvsim bench --browser``'s steps pays beyond the bare page's, taken apart (issue 56 item 3).

    python kvsim/bench/scripts/step_costs.py [--rounds 1] [--sections]  the browser: each step's parts, the floor's in the same run
    python kvsim/bench/scripts/step_costs.py --server STEP [--top 30]  the server: STEP's script run under cProfile, cold then warm

The browser part runs ``FLOOR`` on a bare page, then ``ROUND`` on a fresh app server, as the benchmark does,
and every link once more at once (``again``: the same page with the server's caches warm, so what is left is
the page's own cost). For each step it prints the seconds to the idle page and the server's share, the script
runs the step caused (counted for 2 s after it), the messages and kilobytes the server sent, the elements and
blocks drawn, the address changes (``page_info_changed``: each one a history entry and a re-render of
Streamlit's App in the browser), and the renderer's main-thread CPU by script (Chrome's sampling profiler:
``PlotlyChart`` draws the figure, ``(program)`` is style, layout and paint, ``react-dom`` the page's elements).
With ``--sections``, each server is started through ``SECTIONS``, which times every script run the step
caused on the server, by part, and a second line under each step gives the sums: ``script`` (the runs' whole
time), the sidebar (``tour_box``, ``choose_trace``, ``follow_trace``, ``controls``, ``write_link``,
``Settings.read``, ``memory_panel``, ``plan_download``), ``warm_up``, ``tabs`` (the tab bar), the open
view (``kept_view``, ``curve_view``), within it ``figure`` (the kept or curve figure's build, cached or not)
and ``chart`` (``st.plotly_chart``: the figure serialised and queued); the bare page has ``script`` and
``chart`` only.

``--server STEP`` (default, six, curve1024, real: the default view and the three links) runs the app's script
in Streamlit's AppTest in one process: the default view twice (a fresh server's first page, then a new
session), then STEP cold (profiled: what its first visit computes) and warm (profiled again), and prints the
script times, the figures' sizes and the profiles' top lines by cumulative time. With ``--preload``, the process
first loads what ``kvsim app``'s server loads before it answers (``kvsim.app.launch.preload``), as a served step finds it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import io
import json
import os
import pstats
import tempfile
import time
from pathlib import Path

from browser_parts import by_script
from checkout import this_checkout

from kvsim.bench import browser as bb
from kvsim.bench.browser.driver import CHROMIUM, CHROMIUM_ARGS
from kvsim.bench.browser.server import server_env

ROOT = this_checkout(__file__)
LINKS = {"default": {}, "six": {"policies": ",".join(bb.SIX_POLICIES)},
         "curve1024": {"budget": "1024", "view": "Choosing recent_window"}, "real": {"trace": bb.REAL_TRACE}}
SETTLE_S = 2.0
#: ``python -c SECTIONS run SCRIPT ...``: the server, its script runs timed by part into ``STEP_COSTS_SECTIONS``
#: (a JSON line a run, seconds by part); the app (``STEP_COSTS_APP`` set) is started as ``kvsim app`` starts it
SECTIONS = """import functools, json, os, sys, threading, time
from streamlit.runtime.scriptrunner import script_runner
LOG, local = os.environ["STEP_COSTS_SECTIONS"], threading.local()
def timed(name, f):
    @functools.wraps(f)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            if getattr(local, "acc", None) is not None:
                local.acc[name] = local.acc.get(name, 0.0) + time.perf_counter() - t0
    return wrapper
run_script = script_runner.exec_func_with_error_handling
def exec_timed(func, ctx):
    local.acc, t0 = {}, time.perf_counter()
    try:
        return run_script(func, ctx)
    finally:
        acc, local.acc = local.acc, None
        acc["script"] = time.perf_counter() - t0
        with open(LOG, "a") as out:
            out.write(json.dumps(acc) + "\\n")
script_runner.exec_func_with_error_handling = exec_timed
import streamlit as st
from streamlit.elements.plotly_chart import PlotlyMixin
PlotlyMixin.plotly_chart = timed("chart", PlotlyMixin.plotly_chart)
st.plotly_chart, st.tabs = st._main.plotly_chart, timed("tabs", st.tabs)
if os.environ.get("STEP_COSTS_APP"):
    from kvsim.app import curve_tab, kept_tab, launch, main, state
    for name in ("tour_box", "controls", "memory_panel", "plan_download", "warm_up", "kept_view", "curve_view"):
        setattr(main, name, timed(name, getattr(main, name)))
    for name in ("choose_trace", "follow_trace", "write_link"):
        setattr(state, name, timed(name, getattr(state, name)))
    main.Settings.read = staticmethod(timed("Settings.read", main.Settings.read))
    kept_tab.cached_kept_figure = timed("figure", kept_tab.cached_kept_figure)
    curve_tab.curve_figure = timed("figure", curve_tab.curve_figure)
    sys.exit(launch.main(sys.argv[1:]))
from streamlit.web import cli
sys.argv = ["streamlit", *sys.argv[1:]]
cli.main(prog_name="streamlit")
"""
SIDEBAR = ("tour_box", "choose_trace", "follow_trace", "controls", "write_link", "Settings.read", "memory_panel",
           "plan_download")
WRAPPER = """import cProfile, os
from kvsim.app.main import run
profile = cProfile.Profile()
profile.enable()
try:
    run()
finally:
    profile.disable()
    profile.dump_stats(os.environ["STEP_COSTS_PROFILE"])
"""


class Counting(bb.Session):
    """A benchmark session that also counts the server's messages by kind, and their bytes."""

    def _watch(self, ws) -> None:
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        super()._watch(ws)

        def frame(payload) -> None:
            if isinstance(payload, str):
                return
            try:
                msg = ForwardMsg.FromString(payload)
            except Exception:  # not a ForwardMsg: counted in bytes only
                return
            kind = msg.WhichOneof("type")
            if kind == "delta":
                kind = msg.delta.WhichOneof("type")
            self.kinds[kind] += 1
            self.sent += len(payload)

        ws.on("framereceived", frame)


def section_sums(log: Path, skip: int) -> tuple[int, str]:
    """The script runs logged in ``log`` after its first ``skip`` lines, summed by part: (lines, a line to print)."""
    lines = log.read_text().splitlines() if log.exists() else []
    acc: collections.Counter = collections.Counter()
    for line in lines[skip:]:
        acc.update(json.loads(line))
    sidebar = sum(acc[k] for k in SIDEBAR)
    view = acc["kept_view"] + acc["curve_view"]
    parts = {"script": acc["script"], "sidebar": sidebar, "warm_up": acc["warm_up"], "tabs": acc["tabs"], "view": view,
             "figure": acc["figure"], "chart": acc["chart"]}
    return len(lines), "    server, s: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items() if v or k == "script")


async def _step(session: Counting, step: bb.Step, log: Path | None = None) -> None:
    session.kinds, session.sent = collections.Counter(), 0
    skip = section_sums(log, 0)[0] if log is not None else 0
    runs = session.finished
    cdp = None
    replaced = isinstance(step.action, bb.Open) and (step.action.new_session or step.action.new_tab)
    if session.page is not None and not replaced:  # a new session or tab is a new page: its start not profiled
        cdp = await session.context.new_cdp_session(session.page)
        await cdp.send("Profiler.enable")
        await cdp.send("Profiler.setSamplingInterval", {"interval": 500})
        await cdp.send("Profiler.start")
    t = await session.timed(step)
    cpu = by_script((await cdp.send("Profiler.stop"))["profile"]) if cdp is not None else {}
    await asyncio.sleep(SETTLE_S)
    k = session.kinds
    busy = sorted(((n, ms) for n, ms in cpu.items() if n != "(idle)"), key=lambda kv: -kv[1])
    seconds = "miss" if t.seconds is None else f"{t.seconds:5.2f}"
    server = "-" if t.server_s is None else f"{t.server_s:4.2f}"
    print(f"{step.name[:46]:46s} {seconds:>5s} {server:>5s} {session.finished - runs:4d} {sum(k.values()):4d} "
          f"{session.sent / 1024:5.0f} {k['new_element']:4d} {k['add_block']:4d} {k['page_info_changed']:4d}  "
          + (f"{sum(ms for _, ms in busy):5.0f}: " + ", ".join(f"{n} {ms:.0f}" for n, ms in busy[:8]) if cpu else "-"),
          flush=True)
    if log is not None:
        print(section_sums(log, skip)[1], flush=True)


def _server(tmp: Path, bare: Path | None, sections: bool) -> tuple[bb.Server, Path | None]:
    """A fresh server of the bare page (``bare``: its folder) or the app, with its script runs timed by part
    (``SECTIONS``) if ``sections``; and where they are logged."""
    env, log, launcher = server_env(None), None, None
    if sections:
        log = tmp / f"sections-{time.monotonic_ns()}.jsonl"
        env = {**env, "STEP_COSTS_SECTIONS": str(log), **({} if bare else {"STEP_COSTS_APP": "1"})}
        launcher = ("-c", SECTIONS)
    if bare is not None:
        return bb.Server(env, tmp / "floor.log", root=bare, script="floor_page.py", launcher=launcher), log
    return bb.Server(env, tmp / "app.log", launcher=launcher), log


async def browser_steps(rounds: int, sections: bool = False) -> None:
    from playwright.async_api import async_playwright

    print(f"{'step':46s} {'s':>5s} {'srv':>5s} {'runs':>4s} {'msgs':>4s} {'KB':>5s} {'elem':>4s} {'blk':>4s} "
          f"{'addr':>4s}  renderer CPU ms (new sessions and tabs: not profiled)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        bare = tmp / "floor"
        bare.mkdir()
        (bare / "floor_page.py").write_text(bb.FLOOR_SCRIPT)
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                for i in range(rounds):
                    for name, folder, steps in (("the bare page", bare, bb.FLOOR), ("the app", None, bb.ROUND)):
                        print(f"-- round {i + 1}: {name}, load average {os.getloadavg()[0]:.1f}")
                        server, log = _server(tmp, folder, sections)
                        session = Counting(browser, server.url)
                        try:
                            for step in steps:
                                await _step(session, step, log)
                                if isinstance(step.action, bb.Open) and step.action.query:
                                    await _step(session, bb.Step(step.name + ", again", step.action, 1.0,
                                                                 step.min_figures, step.min_images), log)
                        finally:
                            await session.close()
                            server.stop()
            finally:
                await browser.close()


def server_step(name: str, top: int, preload: bool = False) -> None:
    from streamlit.testing.v1 import AppTest

    if preload:
        from kvsim.app import launch

        print(f"preloaded as kvsim app's server does: {launch.preload():.2f} s")

    with tempfile.TemporaryDirectory() as tmp:
        wrapper = Path(tmp) / "profiled_app.py"
        wrapper.write_text(WRAPPER)

        def run(query: dict, profile: str | None = None) -> float:
            os.environ["STEP_COSTS_PROFILE"] = str(Path(tmp) / (profile or "unused.prof"))
            at = AppTest.from_file(str(wrapper), default_timeout=600)
            at.query_params.update(query)
            t0 = time.perf_counter()
            at.run()
            seconds = time.perf_counter() - t0
            if at.exception:
                raise SystemExit(f"step_costs.py: the app raised: {at.exception[0].value}")
            sizes = [len(c.proto.spec) for c in at.get("plotly_chart")]
            print(f"{name if profile else 'the default view':16s} {profile or '':6s} script {seconds:.3f} s, figures' "
                  f"JSON {sizes} bytes")
            return seconds

        run(LINKS["default"])
        run(LINKS["default"])
        for kind in ("cold", "warm"):
            run(LINKS[name], kind)
        for kind in ("cold", "warm"):
            out = io.StringIO()
            stats = pstats.Stats(str(Path(tmp) / kind), stream=out)
            stats.sort_stats("cumulative").print_stats(top)
            print(f"\n{name}, {kind}:\n" + "\n".join(line for line in out.getvalue().splitlines()[5:] if line.strip()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="browser rounds, each on fresh servers (default: 1)")
    ap.add_argument("--sections", action="store_true", help="also time each step's script runs on the server by part")
    ap.add_argument("--server", choices=list(LINKS), help="instead: this step's script run under cProfile")
    ap.add_argument("--top", type=int, default=30, help="with --server: the profile's lines (default: 30)")
    ap.add_argument("--preload", action="store_true", help="with --server: first load what kvsim app's server loads")
    args = ap.parse_args()
    if args.server:
        server_step(args.server, args.top, args.preload)
    else:
        asyncio.run(browser_steps(args.rounds, args.sections))


if __name__ == "__main__":
    main()

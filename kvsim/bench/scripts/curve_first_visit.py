"""The first visit of *Choosing recent_window* on each shipped real trace with an empty cache (issue 56): the
AppTest script time of the first run, when its first chart reached the page (the chart so far, or the finished
one), and the time until nothing is left in the background (the whole curve and every reference line drawn),
each trace in its own process (a fresh server) with its own empty ``KVSIM_CACHE_DIR``.

    python kvsim/bench/scripts/curve_first_visit.py [TREE] [--traces gemma3-270m-L05,...] [--budget 256] [--no-shipped]
    python kvsim/bench/scripts/curve_first_visit.py [TREE] --browser       # the same visits in a real headless Chromium

``--browser`` opens the view's link in a new browser session (Debian's chromium, as ``kvsim bench --browser``) on
a fresh ``kvsim app``-style server per trace, each with its own empty ``KVSIM_CACHE_DIR``: ``idle_s`` is the
benchmark's idle page (the script run over, the figures laid out and painted), ``complete_s`` the time until the
page also says nothing is left in the background. ``--after-first-page`` opens the default view first and then
follows the view's link in the same tab (the page a visitor meets after the app's first screen).

``--no-shipped`` reads nothing of ``traces/kept/`` (``KVSIM_NO_SHIPPED_CACHE``): a trace met for the first time, as
an unshipped one is; the first run then draws what is quick and the rest comes in the background.

The compiled kernels are numba's, kept beside the tree's sources: run it once to compile them, then again
to measure (``--warm`` does one throwaway visit first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from checkout import this_checkout

_CHILD = """
import json, sys, time
from streamlit.testing.v1 import AppTest
tree, trace, budget = sys.argv[1], sys.argv[2], sys.argv[3]  # argv[4]: "all" waits for the background
from streamlit.runtime.forward_msg_queue import ForwardMsgQueue
from kvsim.app.launch import preload
preload()
charted = []  # when the first chart of the trace reached the page (a chart so far, or the finished one)
enqueue = ForwardMsgQueue.enqueue
def timed(self, msg):
    if not charted and msg.HasField("delta") and msg.delta.WhichOneof("type") == "new_element" and \
            msg.delta.new_element.WhichOneof("type") == "plotly_chart":
        charted.append(time.perf_counter() - t)
    return enqueue(self, msg)
ForwardMsgQueue.enqueue = timed
t = time.perf_counter()
at = AppTest.from_file(tree + "/app.py", default_timeout=1800)
at.query_params.update({"view": "Choosing recent_window", "trace": trace, "budget": budget})
at.run()
first = time.perf_counter() - t
def busy():
    words = " ".join([c.value for c in at.caption] + [i.value for i in at.info])
    return "Still replaying" in words or "being solved" in words
runs = 1
while busy() and time.perf_counter() - t < 1800 and sys.argv[4] == "all":
    time.sleep(0.25)
    at.run()
    runs += 1
print(json.dumps({"trace": trace, "first_chart_s": round(charted[0], 2) if charted else None,
                  "first_run_s": round(first, 2), "complete_s": round(time.perf_counter() - t, 2),
                  "runs": runs, "exceptions": [e.value for e in at.exception], "errors": [e.value for e in at.error],
                  "charts": len(at.get("plotly_chart"))}))
"""


def visit(tree: Path, trace: str, budget: int, shipped: bool = True, wait: bool = True) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvsim-cold-") as cache:
        env = {**os.environ, "KVSIM_CACHE_DIR": cache, **({} if shipped else {"KVSIM_NO_SHIPPED_CACHE": "1"}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-c", _CHILD, str(tree), trace, str(budget), "all" if wait else "first"], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return {"trace": trace, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


#: what the curve view says while something is still computed in the background (the AppTest child reads the same)
_BUSY = ("Still replaying", "being solved", "is solved once the other lines are known")


def browser_visits(tree: Path, traces: list[str], budget: int, shipped: bool = True,
                   after_first_page: bool = False) -> list[dict]:
    """Each trace's first visit in headless Chromium, on a fresh server with an empty cache of its own: a new
    browser session opening the view's link, or (``after_first_page``) the link followed in the tab that
    opened the default view first."""
    import asyncio
    import time
    import urllib.parse

    from playwright.async_api import async_playwright

    from kvsim.bench import checkout_env
    from kvsim.bench.browser import CHROMIUM, CHROMIUM_ARGS, Open, Server, Session, Step
    from kvsim.bench.browser.page import JS_IDLE

    out: list[dict] = []

    async def one(browser, trace: str, cache: str, log: Path) -> dict:
        env = checkout_env(KVSIM_CACHE_DIR=cache, **({} if shipped else {"KVSIM_NO_SHIPPED_CACHE": "1"}))
        server = Server(env, log, root=tree)
        session = Session(browser, server.url)
        query = "?" + urllib.parse.urlencode({"view": "Choosing recent_window", "trace": trace, "budget": budget})
        try:
            first = None
            if after_first_page:  # the default view first, as a visitor who then follows the link in the same tab
                first = await session.timed(Step("first page", Open(new_session=True), 5.0, min_images=3), timeout_s=600)
            t0 = time.perf_counter()
            timing = await session.timed(Step(trace, Open(query, new_session=not after_first_page), 5.0, min_figures=1),
                                         timeout_s=1800)
            complete = None
            while timing.seconds is not None and time.perf_counter() - t0 < 1800:
                words = await session.text()
                if not any(b in words for b in _BUSY) and await session.page.evaluate(JS_IDLE, [1, 0]):
                    complete = time.perf_counter() - t0
                    break
                await asyncio.sleep(0.1)
            figures = await session.page.evaluate("() => document.querySelectorAll('.js-plotly-plot').length")
        finally:
            await session.close()
            server.stop()
        return {"trace": trace, "server_start_s": round(server.start_s, 2),
                **({"first_page_s": first.seconds and round(first.seconds, 2)} if first is not None else {}),
                "idle_s": None if timing.seconds is None else round(timing.seconds, 2),
                "script_s": None if timing.server_s is None else round(timing.server_s, 2),
                "complete_s": None if complete is None else round(complete, 2), "figures": figures,
                "sent_mb": None if timing.sent_mb is None else round(timing.sent_mb, 2), "error": timing.error}

    async def main() -> None:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                for trace in traces:
                    with tempfile.TemporaryDirectory(prefix="kvsim-cold-") as cache, \
                            tempfile.TemporaryDirectory(prefix="kvsim-log-") as logs:
                        out.append(await one(browser, trace, cache, Path(logs) / "server.log"))
                        print(json.dumps(out[-1]), flush=True)
            finally:
                await browser.close()

    asyncio.run(main())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", nargs="?", default=str(Path(__file__).resolve().parents[3]))
    parser.add_argument("--traces", help="comma-separated (default: every shipped real trace)")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--warm", action="store_true", help="one throwaway visit first (numba's kernels compiled)")
    parser.add_argument("--no-shipped", action="store_true", help="read nothing shipped in traces/kept/")
    parser.add_argument("--first", action="store_true", help="time the first run alone (not what it leaves running)")
    parser.add_argument("--browser", action="store_true", help="in headless Chromium, on a fresh server per trace")
    parser.add_argument("--after-first-page", action="store_true",
                        help="with --browser: open the default view first, then follow the view's link in that tab")
    args = parser.parse_args()
    root = this_checkout(__file__)
    if args.browser and Path(args.tree).resolve() != root:
        parser.error(f"--browser serves this checkout's app ({root}): run {args.tree}/bench/curve_first_visit.py")
    from kvsim.data.catalog import shipped_traces

    traces = args.traces.split(",") if args.traces else list(shipped_traces())
    if args.warm:
        visit(Path(args.tree), traces[0], args.budget)
    if args.browser:
        browser_visits(Path(args.tree).resolve(), traces, args.budget, shipped=not args.no_shipped,
                       after_first_page=args.after_first_page)
        return 0
    for trace in traces:
        print(json.dumps(visit(Path(args.tree), trace, args.budget, shipped=not args.no_shipped, wait=not args.first)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

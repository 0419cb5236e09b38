"""The browser's floor on this machine: the same timing as ``python -m kvsim bench --browser``,
on a Streamlit page that holds nothing but one Plotly chart.

    python kvsim/bench/scripts/browser_floor.py [--runs 3] [--figure small|kept3|kept6|curve]

Prints each run of three steps: a new browser context opening the page (a new user: Streamlit's and
Plotly's JavaScript fetched, parsed and run from nothing), a new tab of that context (a new session,
the JavaScript from the browser's cache) and a link opened in that tab (the page reloaded).

The chart is a three-point line (``small``, the default), kvsim's own kept-position figure of the
canonical trace at budget 256 with three or six policies (``kept3``, ``kept6``), or the app's first
paint of the recent_window curve at budget 1024 (``curve``: its coarse grid, the chart exactly as the
app sends it), built once before the server starts and only read by the page, so the figures are
Streamlit and the browser drawing that chart, nothing else. What kvsim's own steps take beyond them
is its script and the rest of its page.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from checkout import this_checkout

from kvsim.bench import browser as bb
from kvsim.bench import checkout_env

this_checkout(__file__)

APP = """import json
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st

st.title("one chart")
spec = Path(__file__).with_name("figure.json")
if spec.exists():  # read as it was built, not validated again: the server's share stays near nothing
    fig = go.Figure(json.loads(spec.read_text()), _validate=False)
    st.plotly_chart(fig, config={"scrollZoom": True})
else:
    st.plotly_chart(go.Figure(go.Scatter(x=[1, 2, 3], y=[1, 3, 2])))
"""
POLICIES = {"kept3": ("sliding_window", "streaming_llm", "h2o"), "kept6": bb.SIX_POLICIES}


def kept_figure_json(policies: tuple[str, ...]) -> tuple[str, int]:
    """The kept view's figure of ``policies`` at the app's defaults, as JSON, and its image count."""
    import plotly.io as pio

    import kvsim
    from kvsim.data.catalog import resolve_trace
    from kvsim.views import figures

    trace = resolve_trace("canonical")
    features = figures.trace_features(trace)
    results = [kvsim.replay(trace, name, budget=256, top_k=8, record_kept=True) for name in policies]
    fig = figures.kept_heatmap(results, features, step=trace.steps, size=1024 // min(3, len(policies)))
    return pio.to_json(fig), sum(1 for t in fig.data if t.type == "image")


#: one run of the app's script on the curve at budget 1024 (AppTest), printing the chart's spec as the page
#: receives it; it leaves at once (``os._exit``), not waiting for the refinement it started in the background
CURVE_SPEC = """import os, sys
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=120)
at.query_params.update({"budget": "1024", "view": "Choosing recent_window"})
at.run()
(chart,) = at.get("plotly_chart")
sys.stdout.write(chart.proto.spec)
sys.stdout.flush()
os._exit(0)
"""


def curve_figure_json() -> str:
    """The curve view's first paint at budget 1024 (the coarse grid and the lines known at once) as
    the app sends it, from a run of the app's own script in a child process."""
    out = subprocess.run([sys.executable, "-c", CURVE_SPEC, str(bb.ROOT / "app.py")], env=checkout_env(),
                         cwd=bb.ROOT, check=True, capture_output=True, text=True, timeout=300)
    return out.stdout


async def main(runs: int, figure: str) -> None:
    from playwright.async_api import async_playwright

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "app.py").write_text(APP)
        images = 0
        if figure == "curve":
            (Path(tmp) / "figure.json").write_text(curve_figure_json())
        elif figure != "small":
            spec, images = kept_figure_json(POLICIES[figure])
            (Path(tmp) / "figure.json").write_text(spec)
        server = bb.Server(dict(os.environ), Path(tmp) / "server.log", root=Path(tmp))  # runs tmp's app.py
        try:
            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=bb.CHROMIUM, args=bb.CHROMIUM_ARGS)
                fresh, tab, link = [], [], []
                for i in range(runs + 1):  # the first new context warms the server: not counted
                    session = bb.Session(browser, server.url)
                    t = await session.timed(bb.Step("new", bb.Open(f"?run={i}", new_session=True), 2.0, min_images=images))
                    if i:
                        fresh.append(t.seconds)
                        t = await session.timed(bb.Step("tab", bb.Open(f"?tab={i}", new_tab=True), 2.0, min_images=images))
                        tab.append(t.seconds)
                        t = await session.timed(bb.Step("link", bb.Open(f"?link={i}"), 1.0, min_images=images))
                        link.append(t.seconds)
                    await session.close()
                await browser.close()
        finally:
            server.stop()
    print(f"chart: {figure}" + (f" ({images} images)" if images else ""))
    for name, xs in (("a new browser context", fresh), ("a new tab, same context", tab), ("a link in the same tab", link)):
        shown = ", ".join(f"{x:.2f}" if x is not None else "missed" for x in xs)
        done = [x for x in xs if x is not None]
        print(f"{name:24s} {shown} s" + (f"  (median {statistics.median(done):.2f} s)" if done else ""))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--figure", choices=("small", *POLICIES, "curve"), default="small",
                    help="the chart: a three-point line, kvsim's kept figure with 3 or 6 policies, or the curve's first paint at 1024")
    args = ap.parse_args()
    asyncio.run(main(args.runs, args.figure))

"""The browser's floor on this machine: the same timing as ``python -m kvsim bench --browser``,
on a Streamlit page that holds nothing but one three-point Plotly chart.

    python bench/browser_floor.py [--runs 3]

Prints each run of two steps: a new browser context opening the page (a new user: Streamlit's and
Plotly's JavaScript fetched, parsed and run from nothing) and a link opened in the same tab (the
page reloaded). What kvsim's own steps take beyond these figures is its script and its drawing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsim import bench_browser as bb  # noqa: E402

APP = """import plotly.graph_objects as go
import streamlit as st

st.title("one chart")
st.plotly_chart(go.Figure(go.Scatter(x=[1, 2, 3], y=[1, 3, 2])))
"""


async def main(runs: int) -> None:
    from playwright.async_api import async_playwright

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "app.py").write_text(APP)
        bb.ROOT = Path(tmp)  # the server runs `streamlit run app.py` in ROOT
        server = bb.Server(dict(os.environ), Path(tmp) / "server.log")
        try:
            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=bb.CHROMIUM, args=bb.CHROMIUM_ARGS)
                fresh, link = [], []
                for i in range(runs + 1):  # the first new context warms the server: not counted
                    session = bb.Session(browser, server.url)
                    t = await session.timed(bb.Step("new", bb.Open(f"?run={i}", new_session=True), 2.0))
                    if i:
                        fresh.append(t.seconds)
                        t = await session.timed(bb.Step("link", bb.Open(f"?link={i}"), 1.0))
                        link.append(t.seconds)
                    await session.close()
                await browser.close()
        finally:
            server.stop()
    for name, xs in (("a new browser context", fresh), ("a link in the same tab", link)):
        shown = ", ".join(f"{x:.2f}" if x is not None else "missed" for x in xs)
        done = [x for x in xs if x is not None]
        print(f"{name:24s} {shown} s" + (f"  (median {statistics.median(done):.2f} s)" if done else ""))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    asyncio.run(main(ap.parse_args().runs))

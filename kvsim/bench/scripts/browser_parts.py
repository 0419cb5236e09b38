"""What each part of the app's default page costs the browser: the floor's page (``browser_floor.py
--figure kept3``: the kept figure of three policies, read from a file) with the app's own parts added,
one part or a set of parts per page, timed as the floor is, the pages taken in turn in every run.

    python kvsim/bench/scripts/browser_parts.py [--runs 3] [--profile | --network] [PAGE ...]   e.g.  bare sidebar tabs text controls all

A page is a comma-separated list of parts (``bare``: none, the floor itself):

- ``sidebar``: the sidebar's widgets as the app draws them: the tour's button and the heading
  (``s_basic``), the trace selector (``s_select``), the uploader (``s_upload``), the policies
  (``s_multi``), budget, recent_window and sinks (``s_nums``), the folded "more policy parameters"
  (``s_more``) and the step slider (``s_slider``), each with its help;
- ``tabs``: the eight view tabs, the chart in the first;
- ``text``: the view's markdown and captions, the app's own (read from one run of its script);
- ``controls``: the mode radio, the folded zoom panel and the two download buttons;
- ``eager``: the two folded panels' inputs built although folded, as the app did before issue 20's
  item 6 (the zoom's caption, two range sliders and button; two policy parameters);
- ``late``: the sidebar's widgets sent after the view instead of before it (the page looks the same;
  a new context then asks for Plotly's chunk before the widgets' chunks);
- ``all``: every part but ``eager`` and ``late`` (the app's default view now); ``all,eager``: the app before.

Prints each page's median new context, new tab and link, and what each adds to the first page given.
With ``--profile``: instead, the renderer's CPU over one new tab of each page, by script; with
``--network``: each page once as a new context, when Plotly's chunk was asked for and had arrived.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import browser_floor as floor
from checkout import this_checkout

from kvsim.bench import browser as bb
from kvsim.bench import checkout_env

this_checkout(__file__)

PAGE = """import json
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st

st.set_page_config(page_title="parts", layout="wide")
here = Path(__file__).parent
parts = set(st.query_params.get("parts", "").split(","))
if "all" in parts:
    parts |= {"sidebar", "tabs", "text", "controls"}
if "sidebar" in parts:
    parts |= {"s_basic", "s_select", "s_upload", "s_multi", "s_nums", "s_more", "s_slider"}
text = json.loads((here / "text.json").read_text())
POLICIES = ["sliding_window", "streaming_llm", "h2o", "scissorhands", "tova", "h2o_normalized", "snapkv", "random",
            "greedy_future", "optimal"]
HELP = "what the control does, as the app says it"

st.title("kvsim: what a KV cache keeps")
if "text" in parts:
    st.caption(text["caption"][0])


def sidebar():
    side = st.sidebar
    if "s_basic" in parts:
        side.button("start the guided tour", help=HELP)
        side.header("settings")
    if "s_select" in parts:
        side.selectbox("trace", ["canonical", "gemma3-270m-L11"], help=HELP)
    if "s_upload" in parts:
        side.file_uploader("or upload a trace (.npz)", type=["npz"], help=HELP)
    if "s_multi" in parts:
        side.multiselect("policies", POLICIES, default=POLICIES[:3], help=HELP)
    if "s_nums" in parts:
        for name, value in (("budget", 256), ("recent_window", 32), ("sinks", 4)):
            side.number_input(name, min_value=0, max_value=16384, step=1, value=value, help=HELP)
    if "s_more" in parts:
        more = side.expander("more policy parameters")
        if "eager" in parts:
            for name, value in (("history_window", 0), ("observation_window", 32)):
                more.number_input(name, min_value=0, max_value=16384, step=1, value=value, help=HELP)
    if "s_slider" in parts:
        side.slider("step", min_value=1, max_value=4096, value=4096, help=HELP)


if "late" not in parts:
    sidebar()
views = ("Kept positions", "Cumulative scores", "Choosing recent_window", "The trace", "Policy lab", "Claims",
         "Your model", "Proxy against truth")
with st.tabs(list(views))[0] if "tabs" in parts else st.container():
    if "controls" in parts:
        mode, zoom = st.columns([2, 3])
        mode.radio("show", ["a panel per policy", "difference of the first two"], horizontal=True, help=HELP)
        zoom = zoom.expander("zoom to single positions (re-drawn from the replay at full resolution)")
        if "eager" in parts:
            zoom.caption("At most 1024 positions across (fewer with several panels) show each position on its own.")
            zoom.slider("positions", 0, 4096, (0, 4096))
            zoom.slider("steps", 1, 4096, (1, 4096))
            zoom.button("the whole run")
    if "text" in parts:
        st.markdown(text["markdown"][0])
    fig = go.Figure(json.loads((here / "figure.json").read_text()), _validate=False)
    st.plotly_chart(fig, config={"scrollZoom": True})
    if "text" in parts:
        for column, note in zip(st.columns(3), text["markdown"][1:4]):
            column.markdown(note)
        st.caption(text["caption"][1])
    if "controls" in parts:
        csv, html = st.columns(2)
        csv.download_button("per-step metrics (CSV)", data="policy,step\\n", file_name="per-step.csv")
        html.download_button("this figure (HTML)", data="<html></html>", file_name="kept.html")
    if "text" in parts:
        st.markdown(text["markdown"][4])
if "late" in parts:
    sidebar()
"""

#: one run of the app's script on its default view (AppTest), printing the view's markdown and captions
TEXT = """import json, os, sys
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=120).run()
sys.stdout.write(json.dumps({"markdown": [m.value for m in at.main.markdown], "caption": [c.value for c in at.main.caption]}))
sys.stdout.flush()
os._exit(0)
"""


def app_text() -> str:
    out = subprocess.run([sys.executable, "-c", TEXT, str(bb.ROOT / "app.py")], env=checkout_env(), cwd=bb.ROOT,
                         check=True, capture_output=True, text=True, timeout=300)
    return out.stdout


def _query(page: str) -> str:
    """The link that serves ``page`` (``bare``: no parts)."""
    return f"?parts={'' if page == 'bare' else page}"


@contextlib.asynccontextmanager
async def _warmed(url: str, images: int):
    """Chromium, with a session that has opened the whole page once (it warms the server: not
    counted); both closed on the way out."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=bb.CHROMIUM, args=bb.CHROMIUM_ARGS)
        session = bb.Session(browser, url)
        await session.timed(bb.Step("warm", bb.Open(_query("all,eager"), new_session=True), 2.0, min_images=images))
        try:
            yield browser, session
        finally:
            await session.close()
            await browser.close()


async def measure(url: str, pages: list[str], runs: int, images: int) -> dict[str, dict[str, list[float]]]:
    """Each page's three steps (new context, new tab, link), the pages in turn within each run."""
    times = {page: {"new": [], "tab": [], "link": []} for page in pages}
    async with _warmed(url, images) as (browser, warm):
        await warm.close()  # not left open beside the pages timed
        for i in range(runs):
            for page in pages:
                session = bb.Session(browser, url)
                q = _query(page)
                for step, action in (("new", bb.Open(f"{q}&run={i}", new_session=True)),
                                     ("tab", bb.Open(f"{q}&tab={i}", new_tab=True)), ("link", bb.Open(f"{q}&link={i}"))):
                    t = await session.timed(bb.Step(step, action, 2.0, min_images=images))
                    times[page][step].append(t.seconds)
                await session.close()
    return times


async def profile(url: str, pages: list[str], images: int) -> dict[str, dict[str, float]]:
    """Each page's renderer CPU over one new-tab step (Chrome's sampling profiler, through the DevTools
    protocol), in ms by script (Streamlit's chunks by name; "(program)" is the browser's own work:
    style, layout, paint; "(idle)" waiting), after one unprofiled new tab of the same page."""
    spent = {}
    async with _warmed(url, images) as (_, session):
        for page in pages:
            q = _query(page)
            await session.timed(bb.Step("tab", bb.Open(f"{q}&warm=1", new_tab=True), 2.0, min_images=images))
            await session.page.close()  # a new tab, its profiler started before it navigates
            session.page = await session.context.new_page()
            session.page.on("websocket", session._watch)
            cdp = await session.context.new_cdp_session(session.page)
            await cdp.send("Profiler.enable")
            await cdp.send("Profiler.setSamplingInterval", {"interval": 200})
            await cdp.send("Profiler.start")
            await session.timed(bb.Step("tab", bb.Open(f"{q}&profiled=1"), 2.0, min_images=images))
            spent[page] = by_script((await cdp.send("Profiler.stop"))["profile"])
    return spent


async def network(url: str, pages: list[str], images: int) -> dict[str, dict]:
    """Each page as a new browser context, once: when Plotly's chunk (``PlotlyChart.*.js``) was asked
    for and had arrived, how many files came before it, and when the page was idle (s from the action)."""
    seen = {}
    async with _warmed(url, images) as (_, session):
        for page in pages:
            await session._new_page(new_context=True)
            t0, log = time.perf_counter(), []
            for event in ("request", "requestfinished"):
                session.page.on(event, lambda r, e=event, log=log, t0=t0:
                                log.append((e, r.url.rsplit("/", 1)[-1], time.perf_counter() - t0)))
            q = f"{_query(page)}&network=1"
            t = await session.timed(bb.Step("new", bb.Open(q), 2.0, min_images=images))
            asked = next(at for e, name, at in log if e == "request" and name.startswith("PlotlyChart."))
            came = next(at for e, name, at in log if e == "requestfinished" and name.startswith("PlotlyChart."))
            before = sum(1 for e, name, at in log if e == "requestfinished" and at < came)
            seen[page] = {"asked": asked, "arrived": came, "files_before": before, "idle": t.seconds,
                          "files": sum(1 for e, *_ in log if e == "requestfinished")}
    return seen


def by_script(prof: dict) -> dict[str, float]:
    """A CPU profile's self time in ms by script (its file name up to the first dot) or category."""
    frames = {n["id"]: n["callFrame"] for n in prof["nodes"]}
    spent: dict[str, float] = {}
    for sample, dt in zip(prof["samples"], prof["timeDeltas"], strict=True):
        frame = frames[sample]
        name = frame["url"].rsplit("/", 1)[-1].split(".")[0] or frame["functionName"]
        spent[name] = spent.get(name, 0.0) + dt / 1000
    return spent


def main(pages: list[str], runs: int, mode: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "app.py").write_text(PAGE)
        (folder / "text.json").write_text(app_text())
        spec, images = floor.kept_figure_json(floor.POLICIES["kept3"])
        (folder / "figure.json").write_text(spec)
        server = bb.Server(dict(os.environ), folder / "server.log", root=folder)
        try:
            if mode == "profile":
                return print_profiles(asyncio.run(profile(server.url, pages, images)))
            if mode == "network":
                for page, n in asyncio.run(network(server.url, pages, images)).items():
                    print(f"{page:24s} Plotly's chunk asked for at {n['asked']:.2f} s, arrived {n['arrived']:.2f} s "
                          f"({n['files_before']} of {n['files']} files before it); idle at {n['idle']:.2f} s")
                return None
            times = asyncio.run(measure(server.url, pages, runs, images))
        finally:
            server.stop()
    medians = {page: [statistics.median(x for x in times[page][s] if x is not None) for s in ("new", "tab", "link")]
               for page in pages}
    base = medians[pages[0]]
    print(f"{runs} runs, medians in s; the last three columns: beyond the page {pages[0]!r}")
    print(f"{'page':24s} {'new':>6s} {'tab':>6s} {'link':>6s}  {'new':>6s} {'tab':>6s} {'link':>6s}")
    for page, m in medians.items():
        print(f"{page:24s} " + " ".join(f"{x:6.2f}" for x in m) + "  " + " ".join(f"{x - b:+6.2f}" for x, b in zip(m, base, strict=True)))
    print(json.dumps(times))


def print_profiles(spent: dict[str, dict[str, float]]) -> None:
    """Each page's profiled total and its largest scripts, and what each script adds to the first page's."""
    base = next(iter(spent.values()))
    for page, by in spent.items():
        top = sorted(by.items(), key=lambda kv: -kv[1])[:10]
        more = sorted(((k, v - base.get(k, 0.0)) for k, v in by.items()), key=lambda kv: -kv[1])[:8]
        busy = sum(v for k, v in by.items() if k != "(idle)")
        print(f"{page}: {busy:.0f} ms busy of {sum(by.values()):.0f} profiled; " + ", ".join(f"{k} {v:.0f}" for k, v in top))
        if by is not base:
            print("   beyond the first page: " + ", ".join(f"{k} {v:+.0f}" for k, v in more))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="*", default=["bare", "sidebar", "tabs", "text", "controls", "all", "all,eager"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", dest="mode", action="store_const", const="profile",
                    help="instead: the renderer's CPU over one new tab of each page, by script (one run, not timed)")
    ap.add_argument("--network", dest="mode", action="store_const", const="network",
                    help="instead: each page once as a new context, when Plotly's chunk was asked for and arrived")
    args = ap.parse_args()
    main(args.pages, args.runs, args.mode)

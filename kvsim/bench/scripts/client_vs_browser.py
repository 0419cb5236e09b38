"""The class benchmark's client beside a real browser: one student's first page of the default view,
on one server of the checkout's app, as ``kvsim bench --load 1`` times it (``kvsim.bench.client``)
and as headless Chromium opens it in a new browser context (``kvsim.bench.browser``), the two taken
in turn, ``--runs`` times each.

    python kvsim/bench/scripts/client_vs_browser.py [--runs 5]

The server is warmed and left quiet first, as ``bench --load`` leaves it (one student's whole
lesson, then ``settle``). For each run it prints:

- the client: the page's files (up to the websocket), and the whole step (its first run finished
  and the chunks of what it drew fetched); HTTP requests, bytes, connections;
- Chromium: the whole first page (the server's run finished, then the page idle and painted, as
  ``bench --browser`` times it); when the server's run finished; when its last HTTP file arrived;
  its HTTP requests (``data:`` images not counted), bytes and connections.

The client draws nothing, so its step ends before Chromium's: what is left of Chromium's time is the
browser's own work (parsing about 7 MB of script, laying out and painting), done on a student's
machine, not on the server. Traffic goes only to the server on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from checkout import this_checkout

from kvsim.bench import browser as bb
from kvsim.bench import client, load
from kvsim.bench.browser.server import Server, server_env

this_checkout(__file__)


async def client_run(url: str) -> dict:
    student = client.Student(url)
    try:
        seconds, error = await student.timed(load.LESSON[0].action, load.LESSON[0].expect)
    finally:
        await student.close()
    t = student.http.tally
    return {"seconds": seconds, "error": error, "files_s": student.files_s, "requests": t.requests,
            "mb": t.wire_bytes / 2**20, "connections": t.most_open}


async def browser_run(browser, url: str, i: int) -> dict:
    session = bb.Session(browser, url)
    try:
        await session._new_page(new_context=True)
        cdp = await session.context.new_cdp_session(session.page)
        await cdp.send("Network.enable")
        sent: dict[str, str] = {}
        done: dict[str, tuple[float, float]] = {}
        conns: set = set()
        t0 = time.perf_counter()
        cdp.on("Network.requestWillBeSent", lambda e: sent.__setitem__(e["requestId"], e["request"]["url"]))
        cdp.on("Network.responseReceived", lambda e: conns.add(e["response"].get("connectionId"))
               if e["response"]["url"].startswith("http") else None)
        cdp.on("Network.loadingFinished", lambda e: done.__setitem__(e["requestId"], (time.perf_counter() - t0, e["encodedDataLength"])))
        step = bb.Step("first page", bb.Open(f"?compare={i}"), 5.0)
        timing = await session.timed(step)
        files = [done[r] for r, u in sent.items() if u.startswith("http") and r in done]
        return {"seconds": timing.seconds, "error": timing.error, "server_s": timing.server_s,
                "files_s": max((at for at, _ in files), default=None), "requests": len(files),
                "mb": sum(n for _, n in files) / 2**20, "connections": len(conns - {0, None})}
    finally:
        await session.close()


async def compare(url: str, runs: int) -> tuple[list[dict], list[dict]]:
    from playwright.async_api import async_playwright

    ours, theirs = [], []
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=bb.CHROMIUM, args=bb.CHROMIUM_ARGS)
        try:
            await browser_run(browser, url, -1)  # the browser's own first start: not counted
            for i in range(runs):
                ours.append(await client_run(url))
                theirs.append(await browser_run(browser, url, i))
        finally:
            await browser.close()
    return ours, theirs


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(runs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(server_env(None), Path(tmp) / "server.log")
        try:
            asyncio.run(load.warm(server.url, server.proc.pid))
            load.settle(server.proc.pid)
            before = os.getloadavg()
            ours, theirs = asyncio.run(compare(server.url, runs))
            after = os.getloadavg()
        finally:
            server.stop()
    print(f"load average before {[round(x, 2) for x in before]}, after {[round(x, 2) for x in after]}; {runs} runs each, in turn")
    print("the client (bench --load):  files   step   requests    MB  connections")
    for r in ours:
        print(f"  {'':24}{_s(r['files_s']):>6} {_s(r['seconds']):>6} {r['requests']:>10} {r['mb']:>5.2f} {r['connections']:>12}"
              + (f"  missed: {r['error']}" if r["error"] else ""))
    print("Chromium, a new context:   server  files   page   requests    MB  connections")
    for r in theirs:
        print(f"  {'':23}{_s(r['server_s']):>6} {_s(r['files_s']):>6} {_s(r['seconds']):>6} {r['requests']:>10} {r['mb']:>5.2f} "
              f"{r['connections']:>12}" + (f"  missed: {r['error']}" if r["error"] else ""))

    def median(rows, key):
        xs = [r[key] for r in rows if r[key] is not None]
        return statistics.median(xs) if xs else None

    print(f"medians: the client's step {_s(median(ours, 'seconds'))} s (its files {_s(median(ours, 'files_s'))} s); "
          f"Chromium's first page {_s(median(theirs, 'seconds'))} s (the server's run finished at {_s(median(theirs, 'server_s'))} s, "
          f"its last file at {_s(median(theirs, 'files_s'))} s)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if not 1 <= args.runs <= 50:
        sys.exit(f"client_vs_browser.py: error: --runs {args.runs}: expected 1 to 50")
    main(args.runs)

"""The app's trace views on a long query/key trace, in headless Chromium, with the browser benchmark's
idle rule (``kvsim.bench.browser``): each view opened in a new browser context on a fresh server, from
the link to the idle page, twice (the second round reads what the first computed).

    python kvsim/bench/scripts/long_views.py [--trace BUNDLE:L05] [--rounds 2]

By default the trace is layer 5 (global) of the long recording in the cache directory (``python -m
kvsim record --preset long``: Gemma-3-270M, 32,767 steps). Its row pass (``kvsim.data.row_stats``) is
read from the cache when it is there; the first open on a machine runs it (about a minute a global
layer at 32k), which the first view's figure then includes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path
from urllib.parse import quote

from checkout import this_checkout

from kvsim.bench import browser as bb
from kvsim.data import catalog

this_checkout(__file__)

VIEWS = ("Kept positions", "The trace", "Choosing recent_window", "Cumulative scores")
#: the images the idle page must show: one panel per default policy; the attention matrix
IMAGES = {"Kept positions": 3, "The trace": 1}


def default_trace() -> str:
    long = [name for name in catalog.recorded_bundles() if "-long-32767-qk-" in name]
    if not long:
        raise SystemExit("no long recording in the cache directory: run `python -m kvsim record --preset long` first "
                         "or name one with --trace")
    return f"{long[0]}:L05"


async def main(trace: str, rounds: int) -> None:
    from playwright.async_api import async_playwright

    with tempfile.TemporaryDirectory() as tmp:
        server = bb.Server(dict(os.environ), Path(tmp) / "server.log")
        try:
            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=bb.CHROMIUM, args=bb.CHROMIUM_ARGS)
                for r in range(1, rounds + 1):
                    for view in VIEWS:
                        session = bb.Session(browser, server.url)
                        query = f"?trace={quote(trace)}&view={quote(view)}"
                        step = bb.Step(view, bb.Open(query, new_session=True), 10.0, min_images=IMAGES.get(view, 0))
                        t = await session.timed(step, timeout_s=600)
                        shown = f"{t.seconds:.1f} s (server {t.server_s:.1f} s)" if t.seconds is not None else f"missed: {t.error}"
                        print(f"round {r}  {view:24s} {shown}", flush=True)
                        await session.close()
                await browser.close()
        finally:
            server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="a trace of the app's selector (default: the long recording's L05)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    asyncio.run(main(args.trace or default_trace(), args.rounds))

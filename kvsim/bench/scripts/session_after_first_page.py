"""A new session's default view, timed on an idle server and right after the server's first page, beside the
same two steps on the bare page ``kvsim bench --browser`` measures its floor on (issue 43).

    python kvsim/bench/scripts/session_after_first_page.py [--rounds 3] [--settle 4]

``kvsim bench --browser`` opens a new session right after a fresh server's first page, while whatever that first
page started in the background may still be running. This runs, per round and per server (the bare page, then
the app, each fresh): the first page, a new session at once, then, after ``--settle`` seconds of nothing, another
new session; and it counts the script runs the server reported for each (one a session: no rerun). The difference
between the two new sessions is what the first page's background work costs the next visitor.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from checkout import this_checkout

from kvsim.bench import browser as bb
from kvsim.bench.browser.server import server_env

this_checkout(__file__)


async def _one(browser, server, steps, settle: float) -> list[tuple[float | None, float | None, int]]:
    """Each step's seconds, server share and the script runs it caused; before the last, ``settle`` s of nothing."""
    session = bb.Session(browser, server.url)
    out = []
    try:
        for i, step in enumerate(steps):
            if i == len(steps) - 1:
                await asyncio.sleep(settle)
            before = session.finished
            t = await session.timed(step)
            await asyncio.sleep(1.0)  # a rerun the page asked for would be reported by now
            out.append((t.seconds, t.server_s, session.finished - before))
    finally:
        await session.close()
    return out


async def _main(rounds: int, settle: float) -> None:
    from playwright.async_api import async_playwright

    names = ("first page of a fresh server", "a new session at once", f"a new session after {settle:g} s idle")
    got: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="kvsim-session-") as tmp:
        tmp = Path(tmp)
        (tmp / "floor_page.py").write_text(bb.FLOOR_SCRIPT)
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=bb.CHROMIUM, args=bb.CHROMIUM_ARGS)
            try:
                for r in range(rounds):
                    for page, root, script, steps in (
                            ("bare page", tmp, "floor_page.py", [bb.FLOOR[0], bb.FLOOR[1], bb.FLOOR[1]]),
                            ("kvsim", bb.ROOT, "app.py", [bb.ROUND[0], bb.ROUND[1], bb.ROUND[1]])):
                        server = bb.Server(server_env(None), tmp / f"{page}-{r}.log", root=root, script=script)
                        try:
                            for name, timing in zip(names, await _one(browser, server, steps, settle), strict=True):
                                got.setdefault((page, name), []).append(timing)
                        finally:
                            server.stop()
            finally:
                await browser.close()
    print(f"{rounds} round(s), medians; script runs reported per step in brackets")
    for (page, name), runs in got.items():
        secs = [s for s, _, _ in runs if s is not None]
        server = [v for _, v, _ in runs if v is not None]
        med = f"{statistics.median(secs):.2f} s" if secs else "-"
        srv = f"{statistics.median(server):.2f} s" if server else "-"
        print(f"{page:<10} {name:<34} {med:>8}  server {srv:>8}  ({', '.join(str(n) for _, _, n in runs)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=4.0, help="seconds of nothing before the last new session")
    args = ap.parse_args()
    asyncio.run(_main(args.rounds, args.settle))


if __name__ == "__main__":
    main()

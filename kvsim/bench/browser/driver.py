"""``run``: the rounds, each on a fresh server, then the concurrent sessions on one more, as the
document ``render`` prints."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from ...progress import Progress
from .page import Session
from .report import StepReport, Timing, overall, upload_isolation
from .server import PeakSampler, Server, install_env, server_env
from .steps import EXPLORATION, FLOOR, FLOOR_MARGIN_S, FLOOR_SCRIPT, INSTALL, LOAD_SESSIONS, ROUND, UPLOAD_STEP, Step

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def _small_trace(path: Path) -> Path:
    from ...data import canonical
    from ...data.trace import save_npz

    save_npz(canonical.generate(canonical.CanonicalConfig(steps=300)), path)
    return path


class _Tally:
    """The run's progress as the share of its steps timed (the load counts as one step): each step is
    announced as it starts, with the share done before it."""

    def __init__(self, progress: Progress | None, total: int):
        self.progress, self.total, self.done = progress, max(1, total), 0

    def __call__(self, note: str) -> None:
        if self.progress is not None:
            self.progress(min(1.0, self.done / self.total), note)

    def advance(self) -> None:
        self.done += 1


async def _round(browser, server: Server, steps: list[Step], say: _Tally) -> list[Timing]:
    session = Session(browser, server.url)
    out = []
    try:
        for step in steps:
            say(f"  {step.name}")
            out.append(await session.timed(step))
            say.advance()
    finally:
        await session.close()
    return out


async def _explore(browser, url: str, steps: list[Step], upload: Path | None, uploaded_name: str) -> dict:
    session = Session(browser, url)
    session.upload = upload
    timings: dict[str, Timing] = {}
    try:
        for step in steps:
            timings[step.name] = await session.timed(step)
        shows_upload = uploaded_name in await session.text() if session.page is not None else None
    except Exception as e:  # the page died: the missing figures say so
        shows_upload = None
        timings.setdefault("session", Timing(None, f"{type(e).__name__}: {e}"))
    finally:
        await session.close()
    return {"timings": timings, "shows_upload": shows_upload}


async def _rounds(browser, tmp: Path, cache_dir: Path | None, rounds: int, doc: dict, say: _Tally) -> None:
    """``FLOOR`` (a bare page), ``INSTALL`` then ``ROUND``, ``rounds`` times, each on a fresh server
    (``INSTALL``'s with empty numba and trace caches); the step reports go into ``doc``, each ``ROUND`` step
    measured against its floor."""
    reports = [StepReport(s.name, s.target_s) for s in (INSTALL, *ROUND)]
    floors = [StepReport(s.name, s.target_s) for s in FLOOR]
    bare = tmp / "floor"
    bare.mkdir(exist_ok=True)
    (bare / "floor_page.py").write_text(FLOOR_SCRIPT)
    for i in range(rounds):
        say(f"round {i + 1} of {rounds}: the floor, a bare Streamlit page")
        server = Server(server_env(cache_dir), tmp / f"server-floor-{i}.log", root=bare, script="floor_page.py")
        try:
            for rep, timing in zip(floors, await _round(browser, server, FLOOR, say), strict=True):
                rep.runs.append(timing)
        finally:
            server.stop()
        say(f"round {i + 1} of {rounds}: a brand-new install")
        server = Server(install_env(tmp / "install"), tmp / f"server-install-{i}.log")
        doc["install_server_start_s"].append(server.start_s)
        try:
            reports[0].runs += await _round(browser, server, [INSTALL], say)
        finally:
            server.stop()
        if cache_dir is not None:  # every round as cold as the first
            shutil.rmtree(cache_dir, ignore_errors=True)
        say(f"round {i + 1} of {rounds}: a fresh server")
        server = Server(server_env(cache_dir), tmp / f"server-{i}.log")
        doc["server_start_s"].append(server.start_s)
        try:
            for rep, timing in zip(reports[1:], await _round(browser, server, ROUND, say), strict=True):
                rep.runs.append(timing)
        finally:
            server.stop()
    by_name = {r.name: r for r in floors}
    for step, rep in zip(ROUND, reports[1:], strict=True):
        if step.floor is not None:
            rep.measure_against(by_name[step.floor], FLOOR_MARGIN_S)
    doc["rounds"] = rounds
    doc["floor"] = [r.to_dict() for r in floors]
    doc["floor_margin_s"] = FLOOR_MARGIN_S
    doc["steps"] = [r.to_dict() for r in reports]


def _machine() -> dict:
    import streamlit

    return {"cpus": os.cpu_count(), "python": sys.version.split()[0], "streamlit": streamlit.__version__,
            "load_average_at_start": _load_average()}


def run(rounds: int = 3, sessions: int = LOAD_SESSIONS, cold_cache: bool = False, load: bool = True,
        single: bool = True, progress: Progress | None = None) -> dict:
    """The rounds (unless not ``single``) and the load (unless not ``load``), as one document;
    ``progress(fraction, note)`` is told each step as it starts and ends."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        raise RuntimeError("the browser benchmark needs playwright (pip install -r requirements-dev.txt)") from None
    if not os.path.exists(CHROMIUM):
        raise RuntimeError(f"the browser benchmark needs Debian's chromium at {CHROMIUM} (apt-get install chromium)")
    say = _Tally(progress, (rounds * (1 + len(FLOOR) + len(ROUND)) if single else 0) + (1 if load else 0))
    doc: dict = {"kind": "browser", "cold_cache": cold_cache, "steps": [], "load": None, "rounds": 0,
                 "server_start_s": [], "install_server_start_s": [], "machine": _machine()}
    with tempfile.TemporaryDirectory(prefix="kvsim-bench-browser-") as tmp:
        tmp = Path(tmp)
        cache_dir = tmp / "cache" if cold_cache else None
        upload = _small_trace(tmp / f"bench-upload-{os.getpid()}.npz")

        async def main() -> None:
            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                try:
                    if single:
                        await _rounds(browser, tmp, cache_dir, rounds, doc, say)
                    if load:
                        doc["load"] = await _load(browser, tmp, cache_dir, upload, sessions, say)
                finally:
                    await browser.close()

        _run_stopping_on_sigterm(main)
    doc["machine"]["load_average_at_end"] = _load_average()
    return overall(doc)


def _run_stopping_on_sigterm(main) -> None:
    """``asyncio.run(main())``, with a SIGTERM (``timeout``, a CI runner) unwinding like Ctrl-C, so
    every server started here stops."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)
    if on_main:
        signal.signal(signal.SIGTERM, _interrupted)
    try:
        asyncio.run(main())
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def _load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages: on a shared machine, what else was running."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _interrupted(signum, frame):
    raise KeyboardInterrupt


async def _load(browser, tmp: Path, cache_dir: Path | None, upload: Path, sessions: int, say: _Tally) -> dict:
    say(f"under load: a fresh server, {sessions} sessions at once")
    server = Server(server_env(cache_dir), tmp / "server-load.log")
    try:
        before = server.rss_mb()
        with PeakSampler(server.rss_mb) as sampler:
            plans = [([EXPLORATION[0], UPLOAD_STEP, *EXPLORATION[1:]] if i == 0 else EXPLORATION) for i in range(sessions)]
            results = await asyncio.gather(*(
                _explore(browser, server.url, plan, upload if i == 0 else None, upload.name)
                for i, plan in enumerate(plans)))
        vmhwm = server.vmhwm_mb()
    finally:
        server.stop()
    names = [UPLOAD_STEP.name if s is UPLOAD_STEP else s.name for s in plans[0]]
    targets = {s.name: s.target_s for s in plans[0]}
    reports = []
    for name in names:
        rep = StepReport(name, targets[name])
        rep.runs = [r["timings"][name] for r in results if name in r["timings"]]
        reports.append(rep)
    uploader, others = results[0]["shows_upload"], [r["shows_upload"] for r in results[1:]]
    isolation = upload_isolation(uploader, others)
    say.advance()
    return {"sessions": sessions, "steps": [r.to_dict() for r in reports], "upload_isolation": isolation,
            "server_peak_rss_mb": {"sampled_tree": sampler.peak, "sample_interval_s": sampler.interval_s,
                                   "vmhwm": vmhwm, "before_load": before}}

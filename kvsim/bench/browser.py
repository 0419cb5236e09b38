"""``python -m kvsim bench --browser``: the app in a real headless Chromium, timed from each action
until the page is idle again, against the targets of issue 11.

What "idle" means here, all of it, in this order:

1. the server says the script run is over: a ``script_finished`` message (read from the page's own
   websocket frames, decoded with Streamlit's protobuf classes) newer than the action, with a status
   other than "finished early for a rerun"; this closes the race where the page still looks idle
   because the rerun has not started;
2. the page agrees: no element marked stale (``[data-stale="true"]``), no running indicator in
   ``[data-testid="stStatusWidget"]``, at least the step's number of Plotly figures
   (``.js-plotly-plot``), each laid out by plotly.js (``_fullLayout``, its ``main-svg`` drawn), and
   every ``<image>`` of a figure decoded (``SVGImageElement`` has no ``complete``, so each source is
   decoded once through ``new Image().decode()`` and remembered);
3. two animation frames have gone by, so the browser has painted what it has.

The steps are data (``ROUND``, ``EXPLORATION``): a name, an action and a target in seconds, so they
follow the app's controls when those change. Each round starts a fresh server and runs ``ROUND`` in
order (the first page of that server, a new session, a new tab, the control changes, links), so
every round sees the same caches; a step's figures are the median and the worst of the rounds.
Then eight sessions at once (one Chromium, eight contexts) each run ``EXPLORATION`` on one more
fresh server; one of them uploads a small trace and the others must not see it; the server's peak
memory is sampled throughout (resident set of the server and its children) and read at the end
(VmHWM).

A step PASSES when its worst run is within its target; a run that times out or raises counts as a
miss (reported, never a crash). Nothing here is a test: the figures depend on the machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1500, "height": 1250}
SERVER_START_S = 120  # a fresh server on a busy two-core machine
STEP_TIMEOUT_S = 180.0  # past this a run is a miss, reported as such (the curve at 1024 took 23 s)
SIX_POLICIES = ("sliding_window", "streaming_llm", "h2o", "scissorhands", "tova", "greedy_future")
REAL_TRACE = "gemma3-270m-L11"


# --------------------------------------------------------------------------------------------
# the steps, as data


@dataclass(frozen=True)
class Open:
    """Open the app at ``query`` (a link). ``new_session``: in a new browser context (a new user,
    whose browser has cached nothing); ``new_tab``: in a new tab of the same context (a new
    Streamlit session, the JavaScript from the browser's cache); else in the same tab."""

    query: str = ""
    new_session: bool = False
    new_tab: bool = False

    def describe(self) -> str:
        where = " (new browser session)" if self.new_session else " (new tab)" if self.new_tab else ""
        return f"open /{self.query}" + where


@dataclass(frozen=True)
class SetNumber:
    """Type ``value`` into the number input labelled ``label`` (in the sidebar unless ``sidebar`` is
    False) and press Enter."""

    label: str
    value: int
    sidebar: bool = True

    def describe(self) -> str:
        return f"set {self.label} to {self.value}"


@dataclass(frozen=True)
class Tab:
    """Click the view's tab."""

    name: str

    def describe(self) -> str:
        return f"open the tab {self.name!r}"


@dataclass(frozen=True)
class Upload:
    """Give the sidebar's uploader the benchmark's small trace file."""

    def describe(self) -> str:
        return "upload a small trace"


@dataclass(frozen=True)
class Step:
    name: str
    action: Open | SetNumber | Tab | Upload
    target_s: float
    #: Plotly figures the idle page must show (a view that draws none gives 0)
    min_figures: int = 1
    #: images inside those figures (the kept view draws one per policy, as panels of one figure)
    min_images: int = 0


def _query(**params) -> str:
    return "?" + urllib.parse.urlencode(params)


#: one round, in order, on a fresh server; every control change starts from the state before it
ROUND: list[Step] = [
    Step("first page of a fresh server", Open(new_session=True), 5.0, min_images=3),
    Step("a new session, default view", Open(new_session=True), 2.0, min_images=3),
    Step("a new tab of the same browser, default view", Open(new_tab=True), 2.0, min_images=3),
    Step("sidebar recent_window 32 -> 64", SetNumber("recent_window", 64), 1.0, min_images=3),
    Step("budget 256 -> 128", SetNumber("budget", 128), 1.0, min_images=3),
    Step("budget back to 256 (cached)", SetNumber("budget", 256), 1.0, min_images=3),
    Step("a link with all six policies", Open(_query(policies=",".join(SIX_POLICIES))), 1.0, min_images=6),
    Step("recent_window curve at budget 1024 (cold cache)",
         Open(_query(budget=1024, view="Choosing recent_window")), 1.0, min_figures=1),
    Step("a shipped real trace, kept view", Open(_query(trace=REAL_TRACE)), 1.0, min_images=3),
]

#: what each of the eight concurrent sessions does (the first one also uploads a trace)
EXPLORATION: list[Step] = [
    Step("open the default view", Open(new_session=True), 3.0, min_images=3),
    Step("recent_window 32 -> 64", SetNumber("recent_window", 64), 3.0, min_images=3),
    Step("budget 256 -> 128", SetNumber("budget", 128), 3.0, min_images=3),
    Step("the recent_window curve", Tab("Choosing recent_window"), 3.0, min_figures=1),
    Step("budget 128 -> 256 on the curve", SetNumber("budget", 256), 3.0, min_figures=1),
    Step("the trace itself", Tab("The trace"), 3.0, min_figures=1),
]
UPLOAD_STEP = Step("upload a small trace (session 1 only)", Upload(), 3.0, min_images=3)
LOAD_SESSIONS = 8


# --------------------------------------------------------------------------------------------
# figures: pure functions, tested without a browser


@dataclass
class Timing:
    """One run of one step: its seconds, or why it has none."""

    seconds: float | None
    error: str | None = None
    #: from the action until the server reported the script run finished (the rest is the browser's)
    server_s: float | None = None
    #: websocket bytes the server sent the page during the step, in MB
    sent_mb: float | None = None


@dataclass
class StepReport:
    name: str
    target_s: float
    runs: list[Timing] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"name": self.name, "target_s": self.target_s, **summarize(self.runs, self.target_s),
                "runs": [{"seconds": r.seconds, "error": r.error, "server_s": r.server_s, "sent_mb": r.sent_mb}
                         for r in self.runs]}


def summarize(runs: list[Timing], target_s: float) -> dict:
    """Median and worst of a step's runs and whether it met its target. A step passes when every
    run finished within the target; a run without a time (timeout, error) is a miss, and the
    median and worst are then over the runs that have one (None when none has)."""
    times = [r.seconds for r in runs if r.seconds is not None]
    failed = len(runs) - len(times)
    median = statistics.median(times) if times else None
    worst = max(times) if times else None
    ok = bool(runs) and failed == 0 and worst is not None and worst <= target_s
    server = [r.server_s for r in runs if r.seconds is not None and r.server_s is not None]
    sent = [r.sent_mb for r in runs if r.seconds is not None and r.sent_mb is not None]
    return {"median_s": median, "worst_s": worst, "count": len(runs), "failed_runs": failed,
            "result": "PASS" if ok else "FAIL",
            "median_server_s": statistics.median(server) if server else None,
            "median_sent_mb": statistics.median(sent) if sent else None}


def render(doc: dict) -> str:
    """The readable table of a ``run`` document."""

    def sec(x) -> str:
        return "-" if x is None else f"{x:.2f}"

    def table(title: str, steps: list[dict]) -> list[str]:
        width = max([len(s["name"]) for s in steps] + [4])
        out = [title, "", f"{'step':<{width}}  {'target':>7}  {'median':>7}  {'worst':>7}  {'runs':>5}  result  "
               f"{'server':>7}  {'sent':>7}",
               f"{'-' * width}  {'-' * 7}  {'-' * 7}  {'-' * 7}  {'-' * 5}  ------  {'-' * 7}  {'-' * 7}"]
        for s in steps:
            note = f" ({s['failed_runs']} run(s) without a time)" if s["failed_runs"] else ""
            server = s.get("median_server_s")
            server = "-" if server is None else f"{server:.2f}s"
            mb = "-" if s.get("median_sent_mb") is None else f"{s['median_sent_mb']:.1f}MB"
            out.append(f"{s['name']:<{width}}  {s['target_s']:>6.1f}s  {sec(s['median_s']):>6}s  "
                       f"{sec(s['worst_s']):>6}s  {s['count']:>5}  {s['result']:<6}  {server:>7}  {mb:>7}{note}")
            out += [f"{'':<{width}}    error: {r['error']}" for r in s["runs"] if r["error"]][:3]
        return out

    m = doc["machine"]
    lines = [f"kvsim bench --browser: headless Chromium against `streamlit run app.py` "
             f"({m['cpus']} CPUs, Python {m['python']}, Streamlit {m['streamlit']}, "
             f"trace cache {'fresh' if doc['cold_cache'] else 'as left by earlier runs'})",
             "timed from the action until the page is idle (script finished, nothing stale, figures drawn); "
             "PASS when the worst run is within the target",
             "server: median time from the action until the server reported the script run finished (the rest is "
             "transfer and the browser's drawing); sent: median websocket MB from the server during the step"]
    load_avg = [m.get(k) for k in ("load_average_at_start", "load_average_at_end")]
    if all(load_avg):
        lines.append("load average (1, 5, 15 min) at the start " + ", ".join(map(str, load_avg[0]))
                     + "; at the end " + ", ".join(map(str, load_avg[1])))
    lines.append("")
    if doc.get("rounds"):
        starts = ", ".join(f"{s:.1f}" for s in doc["server_start_s"])
        lines += table(f"one session at a time: {doc['rounds']} round(s), each on a fresh server "
                       f"(server start-up, not counted: {starts} s)", doc["steps"])
    load = doc.get("load")
    if load:
        lines += [""] + table(f"under load: {load['sessions']} sessions at once, each step over all sessions",
                              load["steps"])
        rss = load["server_peak_rss_mb"]
        lines += ["", f"server memory: peak resident {sec(rss['sampled_tree'])} MB (server and children, sampled "
                  f"every {rss['sample_interval_s']} s), VmHWM {sec(rss['vmhwm'])} MB; "
                  f"at the start of the load {sec(rss['before_load'])} MB",
                  f"uploads stay in their session: {load['upload_isolation']['result']} "
                  f"({load['upload_isolation']['detail']})"]
    lines += ["", f"overall: {doc['result']} ({doc['failed_steps']} of {doc['total_steps']} steps missed)"]
    return "\n".join(lines)


def overall(doc: dict) -> dict:
    """Fill the document's verdict from its step reports and the isolation check."""
    steps = list(doc.get("steps", [])) + list((doc.get("load") or {}).get("steps", []))
    failed = sum(s["result"] != "PASS" for s in steps)
    iso = (doc.get("load") or {}).get("upload_isolation")
    if iso is not None and iso["result"] != "PASS":
        failed += 1
    total = len(steps) + (iso is not None)
    doc.update(failed_steps=failed, total_steps=total, result="PASS" if failed == 0 and total else "FAIL")
    return doc


# --------------------------------------------------------------------------------------------
# the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``streamlit run app.py`` on a free localhost port, in its own process group."""

    def __init__(self, env: dict, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
               "--server.port", str(self.port), "--server.address", "127.0.0.1",
               "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"]
        self.log = log
        t0 = time.perf_counter()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {self.proc.returncode}: {log.read_text()[-1000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"streamlit did not answer on {self.url} within {SERVER_START_S} s")
            time.sleep(0.2)
        self.start_s = time.perf_counter() - t0

    def rss_mb(self) -> float | None:
        """Resident set of the server and its children now."""
        try:
            import psutil

            proc = psutil.Process(self.proc.pid)
            procs = [proc, *proc.children(recursive=True)]
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            return total / 2**20
        except Exception:  # psutil missing or the process gone: the figure is simply unknown
            return None

    def vmhwm_mb(self) -> float | None:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                kb = next((line.split()[1] for line in f if line.startswith("VmHWM:")), None)
            return int(kb) / 1024 if kb else None
        except OSError:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class PeakSampler:
    """The largest ``sample()`` seen, polled in a thread."""

    def __init__(self, sample: Callable[[], float | None], interval_s: float = 0.2):
        self.sample, self.interval_s, self.peak = sample, interval_s, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            value = self.sample()
            if value is not None and (self.peak is None or value > self.peak):
                self.peak = value
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------------------------
# the browser side

#: true when the page shows no running script (the status widget offers "Stop" while one runs), nothing
#: stale, and at least ``minFigures`` Plotly figures holding ``minImages`` images, each figure laid out
#: and every image decoded (decoding is started here once per source and remembered)
JS_IDLE = """([minFigures, minImages]) => {
  if (document.querySelector('[data-stale="true"]')) return false;
  const sw = document.querySelector('[data-testid="stStatusWidget"]');
  if (sw && /stop|running|connecting/i.test(sw.innerText || '')) return false;
  const figs = [...document.querySelectorAll('.js-plotly-plot')];
  if (figs.length < minFigures) return false;
  if (figs.reduce((n, d) => n + d.querySelectorAll('image').length, 0) < minImages) return false;
  const done = (window.__kvsimDecoded = window.__kvsimDecoded || new Map());
  for (const d of figs) {
    if (!d._fullLayout || !d.querySelector('.main-svg')) return false;
    for (const im of d.querySelectorAll('image')) {
      const src = im.getAttribute('href') || im.getAttribute('xlink:href');
      if (!src) continue;
      if (!done.has(src)) {
        done.set(src, false);
        const probe = new Image();
        probe.src = src;
        probe.decode().then(() => done.set(src, true), () => done.set(src, true));
      }
      if (!done.get(src)) return false;
    }
  }
  return true;
}"""
JS_TWO_FRAMES = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))"
JS_STATE = """() => ({
  exception: (document.querySelector('[data-testid="stException"]') || {}).innerText || '',
  stale: [...document.querySelectorAll('[data-stale="true"]')].map(e => e.getAttribute('data-testid') || e.tagName).join(','),
  status: (document.querySelector('[data-testid="stStatusWidget"]') || {}).innerText || '',
  figures: document.querySelectorAll('.js-plotly-plot').length,
  spinners: document.querySelectorAll('[data-testid="stSpinner"]').length,
})"""
JS_EXCEPTION = "() => { const e = document.querySelector('[data-testid=\"stException\"]'); return e ? e.innerText : null; }"


class Session:
    """One browser context (one user) with one tab, counting the script runs its websocket reports."""

    def __init__(self, browser, base_url: str):
        self.browser, self.base_url = browser, base_url
        self.context = self.page = None
        self.finished = 0  # script runs reported finished on this tab, over all its page loads
        self.finished_at = 0.0  # perf_counter() when the last one was reported
        self.received = 0  # websocket bytes from the server, over all its page loads
        self._changed = asyncio.Event()
        self.upload: Path | None = None  # the file ``Upload`` gives the uploader

    async def _new_page(self, new_context: bool, new_tab: bool = False) -> None:
        if new_context or self.context is None:
            if self.context is not None:
                await self.context.close()
            self.context = await self.browser.new_context(viewport=VIEWPORT)
        elif new_tab:
            await self.page.close()
        else:
            return
        self.page = await self.context.new_page()
        self.page.on("websocket", self._watch)

    def _watch(self, ws) -> None:
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        def frame(payload) -> None:
            if isinstance(payload, str):
                return
            self.received += len(payload)
            try:
                msg = ForwardMsg.FromString(payload)
            except Exception:  # not a ForwardMsg (a future protocol): the DOM checks still apply
                return
            if msg.WhichOneof("type") == "script_finished" and \
                    msg.script_finished != ForwardMsg.ScriptFinishedStatus.FINISHED_EARLY_FOR_RERUN:
                self.finished += 1
                self.finished_at = time.perf_counter()
                self._changed.set()

        ws.on("framereceived", frame)

    async def _script_finished_after(self, seen: int, deadline: float) -> None:
        while self.finished <= seen:
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the server never reported the script run finished")
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except TimeoutError:
                pass

    async def act(self, action) -> None:
        if isinstance(action, Open):
            await self._new_page(action.new_session, action.new_tab)
            await self.page.goto(self.base_url + "/" + action.query, wait_until="commit")
        elif isinstance(action, SetNumber):
            scope = '[data-testid="stSidebar"] ' if action.sidebar else ""
            box = self.page.locator(f'{scope}input[aria-label="{action.label}"]').first
            await box.fill(str(action.value))
            await box.press("Enter")
        elif isinstance(action, Tab):
            await self.page.get_by_role("tab", name=action.name).click()
        elif isinstance(action, Upload):
            await self.page.locator('[data-testid="stSidebar"] input[type="file"]').set_input_files(str(self.upload))
        else:
            raise TypeError(f"unknown action {action!r}")

    async def timed(self, step: Step, timeout_s: float = STEP_TIMEOUT_S) -> Timing:
        """Run the step's action and wait for the idle page; a miss is a Timing with an error."""
        seen, received = self.finished, self.received
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        try:
            await self.act(step.action)
            await self._script_finished_after(seen, deadline)
            server_s = self.finished_at - t0
            left_ms = max(1.0, (deadline - time.monotonic()) * 1000)
            await self.page.wait_for_function(JS_IDLE, arg=[step.min_figures, step.min_images], timeout=left_ms, polling="raf")
            await self.page.evaluate(JS_TWO_FRAMES)
            seconds = time.perf_counter() - t0
        except Exception as e:  # a timeout or a broken page is this run's result, not the benchmark's end
            return Timing(None, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}{await self._state()}")
        shown = await self.page.evaluate(JS_EXCEPTION)
        if shown:
            return Timing(None, "the app shows an exception: " + " ".join(shown.split())[:200])
        return Timing(seconds, server_s=server_s, sent_mb=(self.received - received) / 2**20)

    async def _state(self) -> str:
        """What the page showed when a step failed (an exception, stale elements, the status, the
        figures), so that a miss says why; empty when the page cannot be read."""
        try:
            state = await self.page.evaluate(JS_STATE)
        except Exception:  # the page itself is gone
            return ""
        return " (page: " + "; ".join(f"{k} {' '.join(str(v).split())[:160]}" for k, v in state.items() if v) + ")"

    async def text(self) -> str:
        return await self.page.locator("body").inner_text()

    async def close(self) -> None:
        if self.context is not None:
            await self.context.close()


# --------------------------------------------------------------------------------------------
# the run


def _server_env(cache_dir: Path | None) -> dict:
    env = dict(os.environ)
    path = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONPATH"] = path
    if cache_dir is not None:
        env["KVSIM_CACHE_DIR"] = str(cache_dir)
    return env


def _small_trace(path: Path) -> Path:
    from ..data import canonical
    from ..data.trace import save_npz

    save_npz(canonical.generate(canonical.CanonicalConfig(steps=300)), path)
    return path


async def _round(browser, server: Server, steps: list[Step], say) -> list[Timing]:
    session = Session(browser, server.url)
    out = []
    try:
        for step in steps:
            say(f"  {step.name}")
            out.append(await session.timed(step))
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


def run(rounds: int = 3, sessions: int = LOAD_SESSIONS, cold_cache: bool = False, load: bool = True,
        single: bool = True, progress=None) -> dict:
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        raise RuntimeError("the browser benchmark needs playwright (pip install -r requirements-dev.txt)") from None
    if not os.path.exists(CHROMIUM):
        raise RuntimeError(f"the browser benchmark needs Debian's chromium at {CHROMIUM} (apt-get install chromium)")
    import streamlit

    say = progress or (lambda _msg: None)
    doc: dict = {"kind": "browser", "cold_cache": cold_cache, "steps": [], "load": None, "rounds": 0,
                 "server_start_s": [],
                 "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "streamlit": streamlit.__version__,
                             "load_average_at_start": _load_average()}}
    with tempfile.TemporaryDirectory(prefix="kvsim-bench-browser-") as tmp:
        tmp = Path(tmp)
        cache_dir = tmp / "cache" if cold_cache else None
        upload = _small_trace(tmp / f"bench-upload-{os.getpid()}.npz")

        async def main() -> None:
            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                try:
                    if single:
                        reports = [StepReport(s.name, s.target_s) for s in ROUND]
                        for i in range(rounds):
                            if cache_dir is not None:  # every round as cold as the first
                                shutil.rmtree(cache_dir, ignore_errors=True)
                            say(f"round {i + 1} of {rounds}: a fresh server")
                            server = Server(_server_env(cache_dir), tmp / f"server-{i}.log")
                            doc["server_start_s"].append(server.start_s)
                            try:
                                for rep, timing in zip(reports, await _round(browser, server, ROUND, say), strict=True):
                                    rep.runs.append(timing)
                            finally:
                                server.stop()
                        doc["rounds"] = rounds
                        doc["steps"] = [r.to_dict() for r in reports]
                    if load:
                        doc["load"] = await _load(browser, tmp, cache_dir, upload, sessions, say)
                finally:
                    await browser.close()

        # a SIGTERM (``timeout``, a CI runner) unwinds like Ctrl-C, so every server started here stops
        previous = signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _interrupted)
        try:
            asyncio.run(main())
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, previous)
    doc["machine"]["load_average_at_end"] = _load_average()
    return overall(doc)


def _load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages: on a shared machine, what else was running."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _interrupted(signum, frame):
    raise KeyboardInterrupt


async def _load(browser, tmp: Path, cache_dir: Path | None, upload: Path, sessions: int, say) -> dict:
    say(f"under load: a fresh server, {sessions} sessions at once")
    server = Server(_server_env(cache_dir), tmp / "server-load.log")
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
    return {"sessions": sessions, "steps": [r.to_dict() for r in reports], "upload_isolation": isolation,
            "server_peak_rss_mb": {"sampled_tree": sampler.peak, "sample_interval_s": sampler.interval_s,
                                   "vmhwm": vmhwm, "before_load": before}}


def upload_isolation(uploader_sees: bool | None, others_see: list[bool | None]) -> dict:
    """PASS when the uploading session shows its file and no other session does; unknown counts as a
    miss (a check that could not look proves nothing)."""
    leaked = sum(x is True for x in others_see)
    unknown = sum(x is None for x in others_see) + (uploader_sees is None)
    if uploader_sees is not True:
        return {"result": "FAIL", "detail": "the uploading session does not show its own file, so nothing was checked"}
    if leaked or unknown:
        return {"result": "FAIL", "detail": f"{leaked} other session(s) show the upload, {unknown} could not be read"}
    return {"result": "PASS", "detail": f"shown in the uploading session, in none of the other {len(others_see)}"}


def dumps(doc: dict) -> str:
    return json.dumps(doc, indent=2, allow_nan=False)

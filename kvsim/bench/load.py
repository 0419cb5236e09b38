"""``python -m kvsim bench --load N``: a class on one server. N students run the same lesson at once
against a real ``streamlit run app.py``, each a lightweight client that speaks Streamlit's own
websocket protocol (``/_stcore/stream``: protobuf ``BackMsg`` out, ``ForwardMsg`` in), as the page's
JavaScript does, without drawing anything. So every figure is the server's work per session: its
script runs, its caches, the serialising and sending of each figure, the page's files.

What one client does, as the browser does it: GET the page, the files it names and Plotly's chunk
(every view draws a Plotly chart); open the websocket; send ``rerun_script`` with the URL's query
string and the widget states it changed; follow the server's ``page_info_changed`` (the link the
app writes) and ``auto_rerun`` (the curve view's background refinement, a fragment run every few
tenths of a second) exactly as the page would; a step is over when the server reports a whole
script run finished (``script_finished``, not cut short for a rerun, not a fragment's run).

The lesson (``LESSON``): open the default view; the guided tour's three steps (the third opens the
recent_window curve); one control change (recent_window 32 -> 64, on the curve); the curve at
budget 1024 (a coarse grid first). Each step checks the page it got says what that step shows,
so a lesson that went astray is a failure, not a fast figure. Every student does step k at the same
moment; between steps all wait for every session to be quiet.

For each N (``--load 1,8,30``: each on a fresh server that one student's whole lesson warmed first,
as a teacher's rehearsal would) it prints each step's median and worst latency against its
target, the server's CPU seconds per session for that step (psutil, the server process and its
children, from the step's start to its last finish, divided by N), and the server's peak resident
memory (sampled, and VmHWM at the end). After the lesson one student uploads a small trace; the
step checks that the upload is offered in that session and in no other.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .browser.server import PeakSampler, Server, server_env

#: the default classes: one student, a small group, a class
SIZES = (1, 8, 30)
OPEN_TARGET_S = 5.0
STEP_TARGET_S = 3.0
STEP_TIMEOUT_S = 120.0
#: what the students wait between steps (once every session is quiet): reading the page
THINK_S = 0.5


@dataclass(frozen=True)
class Open:
    """A new student opens the link: the page's files, then the websocket's first run."""


@dataclass(frozen=True)
class Click:
    """Press the button labelled ``label``, or the one whose key is ``key``."""

    label: str = ""
    key: str = ""


@dataclass(frozen=True)
class Number:
    """Type ``value`` into the number input keyed ``key`` (the sidebar's controls are keyed by name)."""

    key: str
    value: int


@dataclass(frozen=True)
class LessonStep:
    name: str
    action: Open | Click | Number
    target_s: float
    #: what the page of this step must show, in its text or its link, beside at least one chart (a
    #: lesson that went astray fails, not passes fast)
    expect: str


LESSON = (
    LessonStep("open the default view", Open(), OPEN_TARGET_S, "Each panel is one policy's cache"),
    LessonStep("tour 1: attention sinks", Click(label="start the guided tour"), STEP_TARGET_S, "step 1 of 3"),
    LessonStep("tour 2: heavy hitters", Click(key="tour_next"), STEP_TARGET_S, "step 2 of 3"),
    LessonStep("tour 3: the recent window (the curve)", Click(key="tour_next"), STEP_TARGET_S, "step 3 of 3"),
    LessonStep("recent_window 32 -> 64", Number("recent_window", 64), STEP_TARGET_S, "recent_window=64"),
    LessonStep("the curve at budget 1024", Number("budget", 1024), STEP_TARGET_S, "budget=1024"),
)


def _pb():
    """Streamlit's protobuf classes, imported when a client first needs them."""
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
    from streamlit.proto.WidgetStates_pb2 import WidgetState

    return BackMsg, ForwardMsg, WidgetState


class Student:
    """One browser tab's conversation with the server, without the browser."""

    def __init__(self, url: str):
        self.url = url
        self.query = ""
        self.widgets: dict[str, object] = {}  # element id -> its proto, the latest delivered last
        self.texts: list[str] = []  # markdown, captions and labels of the latest whole run
        self.charts = 0  # Plotly charts of the latest whole run
        self.finished = 0  # whole runs finished
        self.running = False
        self.fragments: dict[str, asyncio.Task] = {}
        self.session_id = ""
        self.upload_urls: asyncio.Future | None = None
        self.files_bytes, self.files_s = 0, None
        self.cpu = None  # the server's CPU seconds so far, for a session alone on it (its files' share is then its own)
        self.files_cpu_s = None
        self.xsrf = ""  # the XSRF cookie the page was given: an upload sends it back
        self._changed = asyncio.Event()

    # --- the page's files ---------------------------------------------------------------------

    async def fetch_page(self) -> None:
        """GET the page, every file it names, and Plotly's chunk, gzip accepted, as a browser with
        an empty cache does (in threads: the reads are blocking)."""
        t0, cpu0 = time.perf_counter(), self.cpu() if self.cpu else None
        index = await asyncio.to_thread(self._get, "/")
        names = re.findall(r'(?:src|href)="\./([^"]+\.(?:js|css|woff2))"', index.decode())
        names += [f"static/js/{p.name}" for p in _static().glob("PlotlyChart.*.js")]
        for name in names:
            await asyncio.to_thread(self._get, "/" + name)
        for path in ("/_stcore/health", "/_stcore/host-config"):  # the health check sets the XSRF cookie
            await asyncio.to_thread(self._get, path)
        self.files_s = time.perf_counter() - t0
        self.files_cpu_s = None if cpu0 is None else self.cpu() - cpu0

    def _get(self, path: str) -> bytes:
        req = urllib.request.Request(self.url + path, headers={"Accept-Encoding": "gzip, deflate"})
        with urllib.request.urlopen(req, timeout=60) as r:
            data = r.read()
            cookie = re.search(r"_streamlit_xsrf=([^;]+)", r.headers.get("Set-Cookie") or "")
        self.xsrf = cookie.group(1) if cookie else self.xsrf
        self.files_bytes += len(data)
        return data

    def put_file(self, url: str, name: str, data: bytes) -> None:
        """PUT ``data`` to the upload URL as the page does: multipart, with the XSRF cookie and header."""
        boundary = "kvsimloadboundary"
        body = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        if self.xsrf:
            headers |= {"X-Xsrftoken": self.xsrf, "Cookie": f"_streamlit_xsrf={self.xsrf}"}
        url = url if url.startswith("http") else self.url + "/" + url.lstrip("/")
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers, method="PUT"), timeout=60):
            pass


    # --- the websocket ------------------------------------------------------------------------

    async def connect(self) -> None:
        import websockets

        ws_url = self.url.replace("http://", "ws://") + "/_stcore/stream"
        self.ws = await websockets.connect(ws_url, subprotocols=["streamlit"], max_size=None, open_timeout=60)
        self.reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        for task in self.fragments.values():
            task.cancel()
        await self.ws.close()
        self.reader.cancel()

    async def _read(self) -> None:
        _, ForwardMsg, _ = _pb()
        early, fragment = ForwardMsg.FINISHED_EARLY_FOR_RERUN, ForwardMsg.FINISHED_FRAGMENT_RUN_SUCCESSFULLY
        async for payload in self.ws:
            msg = ForwardMsg.FromString(payload)
            kind = msg.WhichOneof("type")
            if kind == "new_session":
                self.session_id = msg.new_session.initialize.session_id or self.session_id
                if not msg.metadata.run.fragment_ids:
                    self.texts, self.charts = [], 0
            elif kind == "delta":
                self._element(msg.delta)
            elif kind == "page_info_changed":
                self.query = msg.page_info_changed.query_string
            elif kind == "session_status_changed":
                self.running = msg.session_status_changed.script_is_running
            elif kind == "auto_rerun":
                self._auto_rerun(msg.auto_rerun.fragment_id, msg.auto_rerun.interval)
            elif kind == "stop_auto_rerun":
                for fid in msg.stop_auto_rerun.fragment_ids or list(self.fragments):
                    if (task := self.fragments.pop(fid, None)) is not None:
                        task.cancel()
            elif kind == "file_urls_response" and self.upload_urls is not None:
                self.upload_urls.set_result(msg.file_urls_response)
            elif kind == "script_finished" and msg.script_finished not in (early, fragment):
                self.finished += 1
            self._changed.set()

    def _element(self, delta) -> None:
        if delta.WhichOneof("type") != "new_element":
            return
        element = delta.new_element
        kind = element.WhichOneof("type")
        if kind is None:
            return
        proto = getattr(element, kind)
        for name in ("body", "label"):
            text = getattr(proto, name, None)
            if isinstance(text, str) and text:
                self.texts.append(text)
        if kind == "selectbox":
            self.texts.extend(proto.options)
        self.charts += kind == "plotly_chart"
        wid = getattr(proto, "id", "")
        if isinstance(wid, str) and wid.startswith("$$ID"):
            self.widgets.pop(wid, None)
            self.widgets[wid] = (kind, proto)

    def _auto_rerun(self, fragment_id: str, interval: float) -> None:
        """Run the fragment every ``interval`` seconds, as the page's timer does."""
        if (task := self.fragments.pop(fragment_id, None)) is not None:
            task.cancel()

        async def tick():
            while True:
                await asyncio.sleep(interval)
                await self.rerun([], fragment_id=fragment_id)

        self.fragments[fragment_id] = asyncio.create_task(tick())

    async def rerun(self, states: list, fragment_id: str = "") -> None:
        BackMsg, _, _ = _pb()
        msg = BackMsg()
        client = msg.rerun_script
        client.query_string = self.query
        client.widget_states.widgets.extend(states)
        if fragment_id:  # the page's timer: a fragment's own run
            client.fragment_id, client.is_auto_rerun = fragment_id, True
        await self.ws.send(msg.SerializeToString())

    # --- the lesson's actions -----------------------------------------------------------------

    def find(self, kind: str, label: str = "", key: str = ""):
        """The latest delivered widget of ``kind`` with that label or whose id ends with that key."""
        for wid, (k, proto) in reversed(self.widgets.items()):
            if k == kind and ((key and wid.endswith("-" + key)) or (label and proto.label == label)):
                return wid, proto
        raise LookupError(f"no {kind} {'labelled ' + repr(label) if label else 'keyed ' + repr(key)} on the page")

    def states_for(self, action) -> list:
        _, _, WidgetState = _pb()
        if isinstance(action, Click):
            wid, _ = self.find("button", action.label, action.key)
            return [WidgetState(id=wid, trigger_value=True)]
        if isinstance(action, Number):
            wid, proto = self.find("number_input", key=action.key)
            as_int = proto.data_type == type(proto).INT
            return [WidgetState(id=wid, int_value=action.value) if as_int else WidgetState(id=wid, double_value=action.value)]
        return []

    async def act(self, action) -> None:
        if isinstance(action, Open):
            await self.fetch_page()
            await self.connect()
        await self.rerun(self.states_for(action))

    async def finish_after(self, seen: int, deadline: float) -> None:
        while self.finished <= seen:
            self._changed.clear()
            if time.monotonic() > deadline:
                raise TimeoutError("the server never reported the run finished")
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                pass

    async def quiet(self, timeout_s: float = STEP_TIMEOUT_S) -> None:
        """Wait while a run of this session (a fragment's included) is in progress."""
        deadline = time.monotonic() + timeout_s
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def timed(self, step: LessonStep) -> tuple[float | None, str]:
        """Run the step; its seconds (None on a miss) and what went wrong."""
        seen, t0 = self.finished, time.perf_counter()
        try:
            await self.act(step.action)
            await self.finish_after(seen, time.monotonic() + STEP_TIMEOUT_S)
        except Exception as e:  # a timeout or a lost page is this session's result, not the benchmark's end
            return None, f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - t0
        if not self.charts or not (step.expect in self.query or any(step.expect in text for text in self.texts)):
            return None, f"the page does not show {step.expect!r} beside a chart"
        return seconds, ""


def _static() -> Path:
    import streamlit

    return Path(streamlit.__file__).parent / "static" / "static" / "js"


# --- one student's upload, seen by nobody else ------------------------------------------------


def small_trace_npz(steps: int = 64, seed: int = 0) -> bytes:
    """A small valid trace file (each row a distribution over the positions so far)."""
    rng = np.random.default_rng(seed)
    a = np.tril(rng.random((steps + 1, steps + 1)).astype(np.float32))
    a /= a.sum(axis=1, keepdims=True)
    out = io.BytesIO()
    np.savez(out, attention=a)
    return out.getvalue()


UPLOAD_NAME = "class-upload.npz"


async def upload(student: Student, data: bytes, name: str = UPLOAD_NAME) -> None:
    """What the page's uploader does: ask for an upload URL, PUT the file there (multipart, with the
    XSRF cookie and header), then rerun with the uploader's state naming the file."""
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from streamlit.proto.Common_pb2 import FileUploaderState, FileURLs, UploadedFileInfo
    from streamlit.proto.WidgetStates_pb2 import WidgetState

    wid, _ = student.find("file_uploader", label="or upload a trace (.npz)")
    student.upload_urls = asyncio.get_running_loop().create_future()
    msg = BackMsg()
    msg.file_urls_request.request_id, msg.file_urls_request.session_id = "load-upload", student.session_id
    msg.file_urls_request.file_names.append(name)
    await student.ws.send(msg.SerializeToString())
    response = await asyncio.wait_for(student.upload_urls, STEP_TIMEOUT_S)
    urls = response.file_urls[0]
    await asyncio.to_thread(student.put_file, urls.upload_url, name, data)
    info = UploadedFileInfo(name=name, size=len(data), file_id=urls.file_id,
                            file_urls=FileURLs(file_id=urls.file_id, upload_url=urls.upload_url, delete_url=urls.delete_url))
    await student.rerun([WidgetState(id=wid, file_uploader_state_value=FileUploaderState(uploaded_file_info=[info]))])



async def isolation(students: list[Student]) -> str:
    """The first student uploads; every session draws its page again. Returns "" when the upload is
    offered in the uploader's session only, else what went wrong."""
    seen = [s.finished for s in students]
    await upload(students[0], small_trace_npz())
    await students[0].finish_after(seen[0], time.monotonic() + STEP_TIMEOUT_S)
    for s, n in zip(students[1:], seen[1:], strict=True):
        await s.rerun([])
        await s.finish_after(n, time.monotonic() + STEP_TIMEOUT_S)
    label = f"uploaded: {UPLOAD_NAME}"
    if label not in students[0].texts:
        return f"the uploader's own page does not offer {label!r}"
    leaked = sum(label in s.texts for s in students[1:])
    return f"{leaked} other session(s) offer {label!r}" if leaked else ""


# --- the class: N students, step by step ------------------------------------------------------


def server_cpu_s(pid: int) -> float:
    """CPU seconds of the server process and its live children (a kernel compile) so far."""
    import psutil

    total = 0.0
    proc = psutil.Process(pid)
    for p in (proc, *proc.children(recursive=True)):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


@dataclass
class StepFigures:
    name: str
    target_s: float
    seconds: list[float | None]
    errors: list[str]
    cpu_per_session_s: float
    #: for the first step: each session's seconds spent on the page's files (the rest is its first run)
    files_s: list[float | None] | None = None
    #: for the first step of a session alone on the server: the server's CPU for its page's files
    files_cpu_s: float | None = None

    def doc(self) -> dict:
        doc = {"step": self.name, "target_s": self.target_s, **spread(self.seconds), "cpu_per_session_s": self.cpu_per_session_s,
               "errors": sorted(set(self.errors))[:3]}
        doc["result"] = "PASS" if doc["worst_s"] is not None and doc["worst_s"] <= self.target_s else "FAIL"
        if self.files_s is not None:  # the first step in two parts: the page's files, then the first run
            runs = [None if t is None or f is None else t - f for t, f in zip(self.seconds, self.files_s, strict=True)]
            doc["parts"] = {"the page's files": spread(self.files_s), "its first run": spread(runs)}
            if self.files_cpu_s is not None:
                doc["files_cpu_s"] = self.files_cpu_s
        return doc


def spread(seconds: list[float | None]) -> dict:
    """The median of the sessions that finished, and the worst (None when any did not)."""
    done = [s for s in seconds if s is not None]
    return {"median_s": statistics.median(done) if done else None,
            "worst_s": max(done) if done and len(done) == len(seconds) else None, "misses": len(seconds) - len(done)}


async def lesson(url: str, n: int, pid: int, progress=None) -> tuple[list[StepFigures], str]:
    """``n`` students through ``LESSON`` in step, then the upload's isolation (with two or more)."""
    students = [Student(url) for _ in range(n)]
    if n == 1:  # alone on the server: the CPU of its page's files is told apart from its first run's
        students[0].cpu = lambda: server_cpu_s(pid)
    figures = []
    try:
        for step in LESSON:
            await asyncio.gather(*(s.quiet() for s in students if hasattr(s, "ws")))
            await asyncio.sleep(THINK_S)
            cpu0 = server_cpu_s(pid)
            timings = await asyncio.gather(*(s.timed(step) for s in students))
            cpu = (server_cpu_s(pid) - cpu0) / n
            files = [s.files_s for s in students] if isinstance(step.action, Open) else None
            figures.append(StepFigures(step.name, step.target_s, [t for t, _ in timings], [e for _, e in timings if e], cpu, files,
                                       students[0].files_cpu_s if files and n == 1 else None))
            if progress:
                done = [t for t, _ in timings if t is not None]
                progress(None, f"{n} sessions: {step.name}: worst {max(done, default=float('nan')):.2f} s, "
                               f"{len(timings) - len(done)} missed")
        separate = (await isolation(students) or "PASS") if n > 1 else None
    finally:
        await asyncio.gather(*(s.close() for s in students if hasattr(s, "ws")), return_exceptions=True)
    return figures, separate


async def warm(url: str, pid: int, timeout_s: float = 300) -> float:
    """One student's whole lesson, then waiting until its curve is exact (the refinement done): the
    server's caches as a teacher's rehearsal leaves them. Returns its seconds."""
    t0 = time.perf_counter()
    student = Student(url)
    try:
        for step in LESSON:
            await student.quiet()
            seconds, error = await student.timed(step)
            if seconds is None:
                raise RuntimeError(f"the warm-up's lesson failed at {step.name!r}: {error}")
        deadline = time.monotonic() + timeout_s
        while any("Still replaying" in t for t in student.texts) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
    finally:
        await student.close()
    return time.perf_counter() - t0


def one_class(n: int, progress=None, profile: Path | None = None) -> dict:
    """A fresh server, warmed by one lesson, then ``n`` students at once; its figures as a dict. With
    ``profile``, the server runs under ``sampler`` and its stacks are written there."""
    with tempfile.TemporaryDirectory() as tmp:
        launcher = ("-m", "streamlit") if profile is None else ("-m", "kvsim.bench.sampler", str(profile))
        server = Server(server_env(None), Path(tmp) / "server.log", launcher=launcher)
        try:
            warm_s = asyncio.run(warm(server.url, server.proc.pid))
            idle_mb = server.rss_mb()
            if profile is not None:
                os.kill(server.proc.pid, signal.SIGUSR1)  # the sampler starts now: the lesson, not the warm-up
            bench0 = time.process_time()
            with PeakSampler(server.rss_mb, interval_s=0.5) as peak:
                steps, separate = asyncio.run(lesson(server.url, n, server.proc.pid, progress))
            return {"sessions": n, "steps": [s.doc() for s in steps], "warm_s": warm_s, "idle_mb": idle_mb,
                    "peak_rss_mb": peak.peak, "vmhwm_mb": server.vmhwm_mb(), "isolation": separate,
                    "bench_cpu_s": time.process_time() - bench0}
        finally:
            server.stop()


def machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown CPU"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({model}), {mem:.0f} GB"


def run(sizes=SIZES, progress=None, profile: Path | None = None) -> dict:
    """Each class size on a fresh server (``profile``: the last size's server sampled, the warm-up
    included; its stacks written there and summarised in the document)."""
    load0 = os.getloadavg()
    classes = []
    for i, n in enumerate(sizes):
        if progress:
            progress(None, f"{n} sessions: a fresh server, warmed by one lesson")
        classes.append(one_class(n, progress, profile if i == len(sizes) - 1 else None))
    if profile is not None:
        from .sampler import summary

        classes[-1]["profile"] = summary(str(profile))
    ok = all(s["result"] == "PASS" for c in classes for s in c["steps"]) and all(c["isolation"] in ("PASS", None) for c in classes)
    return {"kind": "load", "machine": machine(), "load_before": [round(x, 2) for x in load0],
            "load_after": [round(x, 2) for x in os.getloadavg()], "classes": classes, "result": "PASS" if ok else "FAIL"}


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(doc: dict) -> str:
    lines = [f"kvsim bench --load: {doc['machine']}; load average before {doc['load_before']}, after {doc['load_after']}"]
    for c in doc["classes"]:
        lines += ["", f"{c['sessions']} session(s) at once (server warmed by one lesson in {c['warm_s']:.1f} s; "
                      f"idle {_s(c['idle_mb'])} MB, peak {_s(c['peak_rss_mb'])} MB resident, VmHWM {_s(c['vmhwm_mb'])} MB; "
                      f"this benchmark's own CPU {c['bench_cpu_s']:.1f} s)",
                  f"  {'step':40} {'median':>7} {'worst':>7} {'target':>7} {'CPU/session':>12}  verdict"]
        for s in c["steps"]:
            miss = f" ({s['misses']} missed: {'; '.join(s['errors'])})" if s["misses"] else ""
            lines.append(f"  {s['step']:40} {_s(s['median_s']):>7} {_s(s['worst_s']):>7} {s['target_s']:>7.1f} "
                         f"{s['cpu_per_session_s']:>11.2f}s  {s['result']}{miss}")
            for i, (part, t) in enumerate(s.get("parts", {}).items()):
                cpu = s.get("files_cpu_s") if i == 0 else None if "files_cpu_s" not in s else s["cpu_per_session_s"] - s["files_cpu_s"]
                lines.append(f"    {'of which ' + part:38} {_s(t['median_s']):>7} {_s(t['worst_s']):>7} {'':>7} "
                             f"{'' if cpu is None else f'{cpu:11.2f}s'}".rstrip())
        if c["isolation"] is not None:
            lines.append(f"  one session's upload offered in that session only: {c['isolation']}")
        if "profile" in c:
            lines += ["", f"  where the server's threads spent the lesson ({c['sessions']} sessions):",
                      *("  " + row for row in c["profile"].splitlines())]
    lines += ["", f"overall: {doc['result']}"]
    return "\n".join(lines)

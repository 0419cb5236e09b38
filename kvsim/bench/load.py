"""``python -m kvsim bench --load N``: a class on one server. N students run the same lesson at once
against a real ``streamlit run app.py``, each a lightweight client (``client.Student``) that speaks
Streamlit's own websocket protocol without drawing anything, so every figure is the server's work
per session: its script runs, its caches, the serialising and sending of each figure, the page's
files.

The lesson (``LESSON``): open the default view; the guided tour's three steps (the third opens the
recent_window curve); one control change (recent_window 32 -> 64, on the curve); the curve at
budget 1024 (a coarse grid first). Each step checks the page it got shows what that step shows,
so a lesson that went astray is a failure, not a fast figure. Every student does step k at the same
moment; between steps all wait for every session to be quiet.

For each N (``--load 1,8,30``: each on a fresh server that one student's whole lesson warmed first,
as a teacher's rehearsal would, and then left until it is quiet, its background work done) it
prints each step's median and worst latency against its target (the first step also in its two
parts: the page's files, then the first run), the server's CPU seconds per session for that step
(psutil, the server process and its children, from the step's start to its last finish, divided by
N), and the server's peak resident memory (sampled, and VmHWM at the end). After the lesson one
student uploads a small trace; the step checks that the upload is offered in that session and in
no other.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..policykit.base import WINDOW
from .browser.server import PeakSampler, Server, server_env
from .client import STEP_TIMEOUT_S, UPLOAD_NAME, Click, Number, Open, Student, small_trace_npz, upload

#: the default classes: one student, a small group, a class
SIZES = (1, 8, 30)
OPEN_TARGET_S = 5.0
STEP_TARGET_S = 3.0
#: what the students wait between steps (once every session is quiet): reading the page
THINK_S = 0.5


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
    LessonStep("recent_window 32 -> 64", Number(WINDOW, 64), STEP_TARGET_S, "recent_window=64"),
    LessonStep("the curve at budget 1024", Number("budget", 1024), STEP_TARGET_S, "budget=1024"),
)


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


def server_cpu_s(pid: int | list[int]) -> float:
    """CPU seconds of the server process and its live children (a kernel compile) so far; with a list,
    of every one of those processes (behind ``kvsim serve``: nginx and each Streamlit process)."""
    import psutil

    total = 0.0
    for one in [pid] if isinstance(pid, int) else pid:
        try:
            proc = psutil.Process(one)
            procs = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
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
    #: behind ``kvsim serve``: nginx's share of ``cpu_per_session_s``
    proxy_cpu_per_session_s: float | None = None

    def doc(self) -> dict:
        doc = {"step": self.name, "target_s": self.target_s, **spread(self.seconds), "cpu_per_session_s": self.cpu_per_session_s,
               "errors": sorted(set(self.errors))[:3]}
        doc["result"] = "PASS" if doc["worst_s"] is not None and doc["worst_s"] <= self.target_s else "FAIL"
        if self.files_s is not None:  # the first step in two parts: the page's files, then the first run
            runs = [None if t is None or f is None else t - f for t, f in zip(self.seconds, self.files_s, strict=True)]
            doc["parts"] = {"the page's files": spread(self.files_s), "its first run": spread(runs)}
            if self.files_cpu_s is not None:
                doc["files_cpu_s"] = self.files_cpu_s
        if self.proxy_cpu_per_session_s is not None:
            doc["proxy_cpu_per_session_s"] = self.proxy_cpu_per_session_s
        return doc


def spread(seconds: list[float | None]) -> dict:
    """The median of the sessions that finished, and the worst (None when any did not)."""
    done = [s for s in seconds if s is not None]
    return {"median_s": statistics.median(done) if done else None,
            "worst_s": max(done) if done and len(done) == len(seconds) else None, "misses": len(seconds) - len(done)}


async def lesson(url: str, n: int, pid: int | list[int], progress=None, proxy_pid: int | None = None,
                 sessions: dict | None = None) -> tuple[list[StepFigures], str]:
    """``n`` students through ``LESSON`` in step, then the upload's isolation (with two or more).
    ``pid``: the server's process, or every one of them (``proxy_pid``: nginx's among them, whose share
    of the CPU is told apart); ``sessions`` gets how many students each process served, by its address."""
    students = [Student(url) for _ in range(n)]  # each its own browser: six connections and a cache of its own
    if n == 1:  # alone on the server: the CPU of its page's files is told apart from its first run's
        students[0].cpu = lambda: server_cpu_s(pid)
    figures = []
    try:
        for step in LESSON:
            await asyncio.gather(*(s.quiet() for s in students if hasattr(s, "ws")))
            await asyncio.sleep(THINK_S)
            cpu0, proxy0 = server_cpu_s(pid), proxy_pid and server_cpu_s(proxy_pid)
            timings = await asyncio.gather(*(s.timed(step.action, step.expect) for s in students))
            cpu = (server_cpu_s(pid) - cpu0) / n
            proxy = None if proxy_pid is None else (server_cpu_s(proxy_pid) - proxy0) / n
            files = [s.files_s for s in students] if isinstance(step.action, Open) else None
            figures.append(StepFigures(step.name, step.target_s, [t for t, _ in timings], [e for _, e in timings if e], cpu, files,
                                       students[0].files_cpu_s if files and n == 1 else None, proxy))
            if sessions is not None and isinstance(step.action, Open):
                for s in students:
                    sessions[s.http.process or "?"] = sessions.get(s.http.process or "?", 0) + 1
            if progress:
                done = [t for t, _ in timings if t is not None]
                progress(None, f"{n} session{'s' if n > 1 else ''}: {step.name}: worst {max(done, default=float('nan')):.2f} s, "
                               f"{len(timings) - len(done)} missed")
        separate = (await isolation(students) or "PASS") if n > 1 else None
    finally:
        await asyncio.gather(*(s.close() for s in students), return_exceptions=True)
    return figures, separate


async def warm(url: str, pid: int, timeout_s: float = 300) -> float:
    """One student's whole lesson, then waiting until its curve is exact (the refinement done): the
    server's caches as a teacher's rehearsal leaves them. Returns its seconds."""
    t0 = time.perf_counter()
    student = Student(url)
    try:
        for step in LESSON:
            await student.quiet()
            seconds, error = await student.timed(step.action, step.expect)
            if seconds is None:
                raise RuntimeError(f"the warm-up's lesson failed at {step.name!r}: {error}")
        deadline = time.monotonic() + timeout_s
        while any("Still replaying" in t for t in student.texts) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
    finally:
        await student.close()
    return time.perf_counter() - t0


def settle(pid: int, timeout_s: float = 120, idle_share: float = 0.05) -> None:
    """Wait until the server uses under ``idle_share`` of a core over a second (the warm-up's
    background work, a refinement or a compile, done), so the lesson's CPU is the lesson's."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = server_cpu_s(pid)
        time.sleep(1.0)
        if server_cpu_s(pid) - before < idle_share:
            return


def served_class(n: int, processes: int, progress=None) -> dict:
    """``kvsim serve --processes K`` on a free loopback port: each Streamlit process warmed by one lesson
    of its own (straight to its port, all at once), then ``n`` students at once through nginx; the CPU
    is every process's, nginx's included (and said apart)."""
    from .. import serve

    server = serve.Serve(processes, port=serve.free_port(), address="127.0.0.1")
    server.start()
    try:
        if not server.proxied:
            raise RuntimeError("kvsim serve did not start nginx (is it installed?): --serve measures the proxy")
        pids = server.pids()
        sts = server.procs

        async def warm_all() -> list[float]:
            pairs = zip(server.upstreams, sts, strict=True)
            return await asyncio.gather(*(warm(f"http://127.0.0.1:{port}", proc.pid) for port, proc in pairs))

        warm_s = max(asyncio.run(warm_all()))
        settle(pids)

        def rss() -> float | None:
            return _sum(_rss_mb(pid) for pid in pids)

        idle_mb = rss()
        bench0 = time.process_time()
        sessions: dict[str, int] = {}
        with PeakSampler(rss, interval_s=0.5) as peak:
            steps, separate = asyncio.run(lesson(server.url, n, pids, progress, proxy_pid=pids[0], sessions=sessions))
        return {"sessions": n, "serve": {"processes": len(sts), "proxy": "nginx", "sessions_per_process": sessions,
                                         "start_s": server.start_s},
                "steps": [s.doc() for s in steps], "warm_s": warm_s, "idle_mb": idle_mb, "peak_rss_mb": peak.peak,
                "vmhwm_mb": _sum(_vmhwm_mb(pid) for pid in pids), "isolation": separate,
                "bench_cpu_s": time.process_time() - bench0}
    finally:
        server.stop()


def _sum(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def _rss_mb(pid: int) -> float | None:
    try:
        import psutil

        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in (proc, *proc.children(recursive=True))) / 2**20
    except Exception:  # psutil missing or the process gone: the figure is simply unknown
        return None


def _vmhwm_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next((line.split()[1] for line in f if line.startswith("VmHWM:")), None)
        return int(kb) / 1024 if kb else None
    except OSError:
        return None


def one_class(n: int, progress=None, profile: Path | None = None) -> dict:
    """A fresh server, warmed by one lesson, then ``n`` students at once; its figures as a dict. With
    ``profile``, the server runs under ``sampler`` and its stacks are written there."""
    with tempfile.TemporaryDirectory() as tmp:
        launcher = None if profile is None else ("-m", "kvsim.bench.sampler", str(profile))
        server = Server(server_env(None), Path(tmp) / "server.log", launcher=launcher)
        try:
            warm_s = asyncio.run(warm(server.url, server.proc.pid))
            settle(server.proc.pid)
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


def run(sizes=SIZES, progress=None, profile: Path | None = None, serve: int | None = None) -> dict:
    """Each class size on a fresh server (``profile``: the last size's server sampled, the warm-up
    included; its stacks written there and summarised in the document); with ``serve``, on a fresh
    ``kvsim serve --processes SERVE`` (nginx in front) instead of one plain Streamlit process."""
    load0 = os.getloadavg()
    classes = []
    for i, n in enumerate(sizes):
        if progress:
            what = f"kvsim serve --processes {serve}, each process" if serve else "a fresh server"
            progress(None, f"{n} session{'s' if n > 1 else ''}: {what} warmed by one lesson")
        if serve:
            classes.append(served_class(n, serve, progress))
        else:
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
        if "serve" in c:
            per = ", ".join(f"{k}: {v}" for k, v in sorted(c["serve"]["sessions_per_process"].items()))
            lines += ["", f"behind kvsim serve: nginx in front of {c['serve']['processes']} Streamlit processes (sessions per "
                          f"process: {per}); memory and CPU are all of them together, nginx's share of the CPU in brackets"]
        lines += ["", f"{c['sessions']} session(s) at once (server warmed by one lesson in {c['warm_s']:.1f} s; "
                      f"idle {_s(c['idle_mb'])} MB, peak {_s(c['peak_rss_mb'])} MB resident, VmHWM {_s(c['vmhwm_mb'])} MB; "
                      f"this benchmark's own CPU {c['bench_cpu_s']:.1f} s)",
                  f"  {'step':40} {'median':>7} {'worst':>7} {'target':>7} {'CPU/session':>12}  verdict"]
        for s in c["steps"]:
            miss = f" ({s['misses']} missed: {'; '.join(s['errors'])})" if s["misses"] else ""
            nginx = f" (nginx {s['proxy_cpu_per_session_s']:.3f}s)" if "proxy_cpu_per_session_s" in s else ""
            lines.append(f"  {s['step']:40} {_s(s['median_s']):>7} {_s(s['worst_s']):>7} {s['target_s']:>7.1f} "
                         f"{s['cpu_per_session_s']:>11.2f}s  {s['result']}{miss}{nginx}")
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

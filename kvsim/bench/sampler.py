"""A whole-process CPU profile of the app's server, for ``kvsim bench --load N --profile FILE``:

    python -m kvsim.bench.sampler FILE run app.py [streamlit options]

runs ``streamlit`` in this process with a thread that, from the first SIGUSR1 on (the benchmark
sends it once the server is warm), every few milliseconds reads each Python thread's CPU time
(Linux's ``/proc/self/task/ID/schedstat``, nanoseconds) and charges what it used since the last
look to the stack it is in now; on exit the charges are written to ``FILE`` as collapsed stacks
(``frame;frame;frame microseconds``, the format flame-graph tools read); ``summary`` reads them.
pyinstrument and cProfile follow one thread; a Streamlit server runs each session's script in its
own thread and sends from its event loop, so its cost per session is only seen across threads.
Weighting by CPU time, not by samples, leaves out a thread that waits (for a lock, a socket, the
interpreter lock): only what runs is counted. What a thread used after its last look (a script
run's thread ends right after its last work) is read as it ends and charged to the stack last seen,
or, for a thread never seen, to ``(a thread that ended before it was seen: NAME)``; CPU of threads
Python does not know (numba's workers) is charged to ``(threads outside Python)``. The CPU between
two looks is charged to the stack seen at the second: a thread that works and then waits is charged
at its wait (the event loop at its ``select``), so read small shares as approximate.
"""

from __future__ import annotations

import atexit
import collections
import os
import runpy
import signal
import sys
import threading
import time

INTERVAL_S = 0.01


def frame_name(code) -> str:
    path = code.co_filename
    for marker in ("site-packages/", "kvsim/", "lib/python3"):
        if marker in path:
            path = path[path.index(marker) + len(marker) if marker != "kvsim/" else path.index(marker):]
            break
    return f"{path}:{code.co_name}"


class Sampler:
    def __init__(self, out: str):
        self.out, self.counts = out, collections.Counter()
        self._stop, self.on = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvsim-sampler", daemon=True)
        self.ended: dict[int, tuple[str, int]] = {}  # native id -> (name, CPU ns) of each thread as it ended
        self.stacks: dict[int, str] = {}  # native id -> the stack last seen
        self.last: dict[int, int] = {}  # native id -> its CPU ns at the last look
        self._watch_thread_ends()

    def _watch_thread_ends(self) -> None:
        """Every thread started from now on reports its CPU time as it ends."""
        inner, ended = threading.Thread._bootstrap_inner, self.ended

        def bootstrap_inner(thread):
            try:
                inner(thread)
            finally:
                ended[threading.get_native_id()] = (thread.name, time.thread_time_ns())

        threading.Thread._bootstrap_inner = bootstrap_inner

    def _charge_ended(self) -> None:
        for nid in list(self.ended):
            name, used = self.ended.pop(nid)
            stack = self.stacks.pop(nid, f"(a thread that ended before it was seen: {name.split('-')[0]})")
            spent = used - self.last.pop(nid, 0)
            if spent > 0 and self.on.is_set():
                self.counts[stack] += spent // 1000

    def _loop(self) -> None:
        me, last = threading.get_ident(), self.last
        self.on.wait()
        self.ended.clear()  # threads of the warm-up
        process0, own0 = _process_ns(), time.thread_time_ns()
        for thread in threading.enumerate():  # what ran before the start is not the lesson's
            if thread.native_id is not None:
                last[thread.native_id] = _thread_ns(thread.native_id)
        while not self._stop.wait(INTERVAL_S):
            frames = sys._current_frames()
            for thread in threading.enumerate():
                nid = thread.native_id
                if thread.ident == me or nid is None or nid in self.ended:
                    continue
                used = _thread_ns(nid)
                spent, last[nid] = used - last.get(nid, 0), used
                frame = frames.get(thread.ident)
                if frame is None:
                    continue
                stack = []
                while frame is not None:
                    stack.append(frame_name(frame.f_code))
                    frame = frame.f_back
                self.stacks[nid] = ";".join(reversed(stack))
                if spent > 0:
                    self.counts[self.stacks[nid]] += spent // 1000
            self._charge_ended()
        self._charge_ended()
        python, own = sum(self.counts.values()), (time.thread_time_ns() - own0) // 1000  # the sampler's own is left out
        self.counts["(threads outside Python)"] += max(0, (_process_ns() - process0) // 1000 - python - own)

    def start(self) -> None:
        self._thread.start()

    def write(self) -> None:
        self._stop.set()
        self.on.set()
        self._thread.join(timeout=5)
        with open(self.out, "w") as f:
            for stack, n in self.counts.most_common():
                f.write(f"{stack} {n}\n")


#: where a stack passes, the first that matches: the groups ``summary`` adds up (a stack that matches
#: none is "the rest": the event loop, the background replays, the executor)
GROUPS = (
    ("Streamlit's gc.collect(2) after a script run", lambda s: s.endswith("script_runner.py:_on_script_finished")
     or "_on_script_finished;.11/weakref.py" in s),
    ("threads that ended before they were seen, and threads outside Python", lambda s: s.startswith("(")),
    ("st.plotly_chart (the figure to a dict, JSON, its id)", lambda s: "plotly_chart.py:plotly_chart" in s),
    ("the rest of the app's script", lambda s: "kvsim/app/main.py:run" in s),
    ("HTTP: the page's files and requests", lambda s: any(k in s for k in ("staticfiles", "static_routes", "responses.py", "h11"))),
    ("websocket: receive and send", lambda s: "websocket" in s.lower()),
)


def summary(path: str, top: int = 30) -> str:
    """The server's CPU by ``GROUPS``, then the frames that most CPU passes through (inclusive), each
    as a share of all the server's CPU."""
    inclusive, groups, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, n = line.rsplit(" ", 1)
            total += int(n)
            groups[next((label for label, match in GROUPS if match(stack)), "the rest")] += int(n)
            for name in set(stack.split(";")):
                inclusive[name] += int(n)
    if not total:
        return "no CPU charged"
    head = [f"{total / 1e6:.1f} CPU seconds, charged every {INTERVAL_S * 1000:.0f} ms; by where the stack passes:"]
    head += [f"{n / 1e6:7.2f} s {n / total:6.1%}  {label}" for label, n in groups.most_common()]
    frames = [f"{n / total:6.1%}  {name}" for name, n in inclusive.most_common(top)]
    return "\n".join([*head, "the frames most CPU passes through:", *frames])


def _thread_ns(native_id: int) -> int:
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # the thread has ended
        return 0


def _process_ns() -> int:
    return time.process_time_ns()


def main(argv: list[str]) -> None:
    sampler = Sampler(argv[0])
    atexit.register(sampler.write)
    signal.signal(signal.SIGUSR1, lambda *_: sampler.on.set())
    sampler.start()
    sys.argv = ["streamlit", *argv[1:]]
    runpy.run_module("streamlit", run_name="__main__")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])

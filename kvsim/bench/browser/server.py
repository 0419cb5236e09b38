"""The app's server for the browser benchmark: ``streamlit run app.py`` on a free localhost port, in
its own process group, and a sampler of its memory."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from .. import ROOT, checkout_env

SERVER_START_S = 120  # a fresh server on a busy two-core machine
#: how ``kvsim app`` and ``kvsim serve`` run the app's server (``python -m kvsim.app.launch run app.py ...``)
APP_LAUNCHER = ("-m", "kvsim.app.launch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``streamlit run app.py`` (in ``root``, the checkout unless told; ``script``, another page there) on a
    free localhost port, in its own process group; ``launcher``: what runs streamlit, after ``python``
    (``bench --load --profile`` gives its sampler). The checkout's app is started as ``kvsim app`` starts
    it (``kvsim.app.launch``: its modules and first caches loaded before the server answers), any other
    page by Streamlit alone."""

    def __init__(self, env: dict, log: Path, root: Path = ROOT, launcher: tuple[str, ...] | None = None,
                 script: str = "app.py"):
        if launcher is None:
            launcher = APP_LAUNCHER if (Path(root).resolve(), script) == (ROOT.resolve(), "app.py") else ("-m", "streamlit")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, *launcher, "run", script, "--server.headless", "true",
               "--server.port", str(self.port), "--server.address", "127.0.0.1",
               "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"]
        self.log = log
        t0 = time.perf_counter()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
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


def server_env(cache_dir: Path | None) -> dict:
    """The checkout's environment (``checkout_env``) and, when given, the server's own trace cache."""
    return checkout_env(**({} if cache_dir is None else {"KVSIM_CACHE_DIR": str(cache_dir)}))


def install_env(folder: Path) -> dict:
    """A brand-new install's environment: the checkout's, with an empty numba cache and an empty trace
    cache (made under ``folder``), so the server compiles every kernel and builds every trace."""
    dirs = {"NUMBA_CACHE_DIR": folder / "numba", "KVSIM_CACHE_DIR": folder / "kvsim"}
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    return checkout_env(**{k: str(v) for k, v in dirs.items()})

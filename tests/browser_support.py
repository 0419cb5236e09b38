"""What the tests that drive a real server or browser share: Debian's Chromium and the flags it runs
with here, a free localhost port, a Streamlit server started, waited for and stopped (its own
process group, so the whole server goes), and what tests/conftest.py's fixtures start once for many
tests instead of once per test or file: Chromium under Playwright (``launched_chromium``, shared by
consecutive browser tests, each closing the pages it opened: ``opened``) and ``streamlit run app.py``
(``app_command``, one server for the session)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvsim.bench.browser.server import free_port  # noqa: F401  (the benchmark's server picks its port the same way)

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
#: without the background-networking flags Chromium's own connections are refused by this machine's closed network
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def app_command(port: int) -> list[str]:
    """``streamlit run app.py`` headless on ``port`` of localhost, started as ``kvsim app`` starts it
    (``kvsim.app.launch``): no usage statistics, no file watcher."""
    return [sys.executable, "-m", "kvsim.app.launch", "run", "app.py", "--server.headless", "true", "--server.port", str(port),
            "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"]


@contextmanager
def launched_chromium() -> Iterator:
    """Playwright started and Debian's Chromium launched through it (skips the test where either is
    missing); both stopped on the way out. A test opens its own pages (``browser.new_page``: each in a
    fresh context, no cookies or storage shared with another test's) and closes them."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Debian's chromium is not installed at {CHROMIUM} (apt-get install chromium; .ci/run does this)")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    playwright = sync_playwright().start()
    try:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
    finally:
        playwright.stop()


@contextmanager
def opened(browser) -> Iterator:
    """``browser`` for the block, every page opened in it (``browser.new_page``: a context of its own)
    closed on the way out, the browser itself left running for the next test."""
    before = set(browser.contexts)
    try:
        yield browser
    finally:
        for context in browser.contexts:
            if context not in before:
                context.close()


@contextmanager
def serving(cmd: list[str], port: int, log: Path, *, cwd: Path, env: dict | None = None,
            timeout_s: float = 90) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start ``cmd`` (a Streamlit server on ``port``), yield its URL and process once its health check
    answers "ok", and stop it (SIGTERM to its group, SIGKILL after 15 s). The test fails, with the
    end of ``log``, if the server exits or does not answer within ``timeout_s``."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                pytest.fail(f"streamlit exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"streamlit did not answer on {url} within {timeout_s} s:\n{log.read_text()[-2000:]}")
            time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

"""End to end: ``streamlit run app.py`` in a real headless Chromium (Debian's ``chromium`` package,
driven by Playwright through ``executable_path``; ``playwright install`` is never needed).

Checks that the page loads, the three main views are drawn, moving recent_window (in the sidebar,
and by clicking the curve) moves the curve's marker, and the URL reopens the same view. Saves
screenshots to ``artifacts/`` (git-ignored), or to ``docs/`` with ``KVSIM_UPDATE_DOCS=1`` (to refresh
the README's pictures on purpose, so an ordinary run never dirties the checkout), and prints how
long the first render and one interaction took (printed, not asserted: the machine's speed is not
the app's behaviour).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
#: where the screenshots go: docs/ only when asked to update the tracked pictures
SHOTS = ROOT / ("docs" if os.environ.get("KVSIM_UPDATE_DOCS") == "1" else "artifacts")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LOAD_TIMEOUT_MS = 180_000  # a cold first render on a busy two-core machine, JIT compile included
STEP_TIMEOUT_MS = 60_000

if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"Debian's chromium is not installed at {CHROMIUM} (apt-get install chromium; .ci/run does this)",
        allow_module_level=True,
    )
sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("streamlit") / "server.log"
    cmd = [
        sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
        "--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
        "--server.fileWatcherType", "none",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
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
                pytest.fail(f"streamlit did not answer on {url} within 90 s:\n{log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# what the page's Plotly charts hold, read from the plotly.js graph divs themselves
JS_TRACES = "() => [...document.querySelectorAll('.js-plotly-plot')].flatMap(d => (d.data || []))"
JS_IMAGES = "() => document.querySelectorAll('.js-plotly-plot .imagelayer image').length"
JS_MARKER = """() => {
  for (const d of document.querySelectorAll('.js-plotly-plot'))
    for (const t of (d.data || []))
      if (String(t.name || '').startsWith('current recent_window')) return Array.from(t.x)[0];
  return null;
}"""
JS_POINT = """(rw) => {
  // the screen position of the curve's point at recent_window = rw, on the retained-mass panel
  for (const d of document.querySelectorAll('.js-plotly-plot')) {
    // _fullData: the traces as plotly.js decoded them (typed arrays, axes filled in)
    const t = (d._fullData || []).find(t => t.name === 'h2o' && t.yaxis === 'y');
    if (!t) continue;
    const xs = Array.from(t.x), ys = Array.from(t.y), i = xs.indexOf(rw);
    const xa = d._fullLayout.xaxis, ya = d._fullLayout.yaxis, box = d.getBoundingClientRect();
    return {x: box.left + xa._offset + xa.l2p(xs[i]), y: box.top + ya._offset + ya.l2p(ys[i])};
  }
  return null;
}"""


def wait_marker(page, value: int) -> None:
    page.wait_for_function(f"() => ({JS_MARKER})() === {value}", timeout=STEP_TIMEOUT_MS)


def no_exceptions(page) -> None:
    shown = page.locator('[data-testid="stException"]')
    assert shown.count() == 0, shown.first.inner_text()


def test_the_app_in_a_real_browser(server):
    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1250})
            page_errors: list[str] = []
            page.on("pageerror", lambda e: page_errors.append(str(e)))

            # 1. first render: the kept-position heatmaps, one image per default policy
            t0 = time.monotonic()
            page.goto(server + "/", wait_until="domcontentloaded")
            page.wait_for_function(f"() => ({JS_IMAGES})() >= 3", timeout=LOAD_TIMEOUT_MS)
            first_render = time.monotonic() - t0
            no_exceptions(page)
            page.wait_for_timeout(1000)  # let the fonts and the legend settle before the picture
            page.screenshot(path=str(SHOTS / "screenshot.png"), full_page=True)

            # 2. cumulative scores: a scatter by position and a histogram
            page.get_by_role("tab", name="Cumulative scores").click()
            page.wait_for_function(f"() => ({JS_TRACES})().some(t => t.type === 'histogram')", timeout=STEP_TIMEOUT_MS)
            no_exceptions(page)
            page.wait_for_timeout(500)
            page.screenshot(path=str(SHOTS / "screenshot-scores.png"), full_page=True)

            # 3. the recent_window curve, marker at the shipped default
            page.get_by_role("tab", name="Choosing recent_window").click()
            wait_marker(page, 32)
            no_exceptions(page)

            # one interaction: recent_window 32 -> 64 in the sidebar moves the marker
            box = page.locator('[data-testid="stSidebar"] input[aria-label="recent_window"]')
            box.fill("64")
            t1 = time.monotonic()
            box.press("Enter")
            wait_marker(page, 64)
            interaction = time.monotonic() - t1

            # choosing a point on the curve sets recent_window everywhere
            page.wait_for_timeout(500)
            point = page.evaluate(JS_POINT, 48)
            assert point is not None, "the h2o curve is not on the page"
            page.mouse.click(point["x"], point["y"])
            wait_marker(page, 48)
            page.wait_for_function(
                """() => document.querySelector('[data-testid="stSidebar"] input[aria-label="recent_window"]').value === '48'""",
                timeout=STEP_TIMEOUT_MS,
            )
            no_exceptions(page)
            page.wait_for_timeout(500)
            page.screenshot(path=str(SHOTS / "screenshot-curve.png"), full_page=True)

            # 4. the trace itself
            page.get_by_role("tab", name="The trace").click()
            page.wait_for_function(
                f"() => ({JS_TRACES})().some(t => t.name === 'heavy hitter (born here)')", timeout=STEP_TIMEOUT_MS
            )
            page.wait_for_function(f"() => ({JS_IMAGES})() >= 1", timeout=STEP_TIMEOUT_MS)
            no_exceptions(page)
            page.wait_for_timeout(500)
            page.screenshot(path=str(SHOTS / "screenshot-trace.png"), full_page=True)

            # 5. the address bar is a link to this state: a fresh page opens it identically
            link = page.url
            assert "recent_window=48" in link and "view=" in link
            again = browser.new_page(viewport={"width": 1500, "height": 1250})
            again.goto(link.replace("The+trace", "Choosing+recent_window").replace("The%20trace", "Choosing%20recent_window"))
            wait_marker(again, 48)
            no_exceptions(again)
            assert page_errors == []
        finally:
            browser.close()
    print(f"\nfirst render (page load to three heatmaps drawn): {first_render:.1f} s")
    print(f"one interaction (recent_window 32 -> 64, curve marker redrawn): {interaction:.2f} s")
    print(f"screenshots in {SHOTS}")

"""The pass-key view in headless Chromium: the grids drawn, a click on a cell opening its trial, and a
screenshot of each (artifacts/screenshot-needle.png, artifacts/screenshot-needle-trial.png) to look at.
``KVSIM_NEEDLE_CACHE`` names a cache directory with measured grids to draw instead of the test's own."""

from __future__ import annotations

import os

import pytest
from browser_support import app_command, free_port, opened, serving
from test_browser import ARTIFACTS, LOAD_TIMEOUT_MS, ROOT, VIEWPORT  # its module skips without Chromium or Playwright

pytestmark = pytest.mark.browser

JS_CELL = """() => {
  // the screen position of the first policy grid's last row's first cell (the control's is the first heatmap)
  const d = document.querySelector('.js-plotly-plot'), L = d._fullLayout, b = d.getBoundingClientRect();
  const xa = L.xaxis2, ya = L.yaxis, rows = Array.from(d._fullData[0].y).length;
  return {x: b.left + xa._offset + xa.l2p(0), y: b.top + ya._offset + ya.l2p(rows - 1)};
}"""


def test_the_needle_view_in_a_browser_and_a_cell_opens_its_trial(tmp_path, monkeypatch, chromium):
    """Its own server (on the grid's cache directory, not the suite's); the session's Chromium."""
    cache = os.environ.get("KVSIM_NEEDLE_CACHE")
    if cache is None:
        from test_needle_app import saved_grid

        cache = str(tmp_path)
        monkeypatch.setenv("KVSIM_CACHE_DIR", cache)
        saved_grid()
    port = free_port()
    cmd = app_command(port)
    ARTIFACTS.mkdir(exist_ok=True)
    with serving(cmd, port, tmp_path / "server.log", cwd=ROOT, env={**os.environ, "KVSIM_CACHE_DIR": cache}) as (url, _):
        with opened(chromium) as browser:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(f"{url}/?view=Pass+key", timeout=LOAD_TIMEOUT_MS)
            page.get_by_text("One trial", exact=False).first.wait_for(timeout=LOAD_TIMEOUT_MS)
            page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot')].length >= 2 && "
                                   "document.querySelector('.js-plotly-plot')._fullLayout.xaxis2", timeout=LOAD_TIMEOUT_MS)
            page.wait_for_timeout(2000)
            assert page.locator('[data-testid="stException"]').count() == 0
            page.screenshot(path=str(ARTIFACTS / "screenshot-needle.png"))
            at = page.evaluate(JS_CELL)
            page.mouse.click(at["x"], at["y"])
            page.wait_for_timeout(6000)
            if os.environ.get("KVSIM_NEEDLE_CACHE") is None:  # the last row is depth 1: its key sits at 36-37
                page.screenshot(path=str(ARTIFACTS / "screenshot-needle-click.png"))
                page.get_by_text("positions 36-37", exact=False).first.wait_for(timeout=60_000)
            assert page.locator('[data-testid="stException"]').count() == 0
            trial = page.locator(".js-plotly-plot").nth(1)
            trial.scroll_into_view_if_needed()
            page.wait_for_timeout(1000)
            page.screenshot(path=str(ARTIFACTS / "screenshot-needle-trial.png"), full_page=True)

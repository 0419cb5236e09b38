"""A needle trial opened in the kept-positions view, in headless Chromium: a grid of the tiny Gemma 3
measured with ``--attention`` (tests/test_needle_kept_app.py), the needle view's button clicked, and
screenshots of the needle view's trial, of the kept view it opens and of the exact optimum on the control's
attention (artifacts/screenshot-needle-open.png, screenshot-needle-kept.png, screenshot-needle-optimum.png)
to look at."""

from __future__ import annotations

import os
from urllib.parse import unquote

import pytest
from browser_support import app_command, free_port, opened, serving
from test_browser import ARTIFACTS, LOAD_TIMEOUT_MS, ROOT, VIEWPORT  # its module skips without Chromium or Playwright
from test_needle import HAS_TORCH, folder  # noqa: F401  (the tiny model, a module fixture)

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")]


def test_a_needle_trial_opens_in_the_kept_view_in_a_browser(folder, tmp_path, monkeypatch, capsys, chromium):  # noqa: F811
    from test_needle_kept_app import measured_grid

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    doc = measured_grid(folder, capsys)
    run = doc["cells"][0]["runs"][0]
    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    env = {**os.environ, "KVSIM_CACHE_DIR": str(tmp_path)}
    with serving(app_command(port), port, tmp_path / "server.log", cwd=ROOT, env=env) as (url, _):
        with opened(chromium) as browser:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(f"{url}/?view=Pass+key", timeout=LOAD_TIMEOUT_MS)
            button = page.get_by_role("button", name=f"open layer 0 of this trial in the kept-positions view ({run['label']})")
            button.wait_for(timeout=LOAD_TIMEOUT_MS)
            assert page.locator('[data-testid="stException"]').count() == 0
            button.scroll_into_view_if_needed()
            page.wait_for_timeout(1500)
            page.screenshot(path=str(ARTIFACTS / "screenshot-needle-open.png"))
            button.click()
            page.get_by_text("A pass-key trial", exact=False).first.wait_for(timeout=LOAD_TIMEOUT_MS)
            page.wait_for_function("() => document.querySelector('.js-plotly-plot') && "
                                   "document.querySelector('.js-plotly-plot')._fullLayout", timeout=LOAD_TIMEOUT_MS)
            page.wait_for_timeout(3000)
            assert page.locator('[data-testid="stException"]').count() == 0
            page.screenshot(path=str(ARTIFACTS / "screenshot-needle-kept.png"), full_page=True)
            assert f"trace={run['attention']['bundle']}:L00H0" in unquote(page.url)  # the link names the trial's trace
            # the exact optimum on the control's attention, opened the same way
            page.goto(f"{url}/?view=Pass+key", timeout=LOAD_TIMEOUT_MS)
            best = page.get_by_role("button", name="open layer 0 of the full cache's attention with the exact optimum at 24")
            best.wait_for(timeout=LOAD_TIMEOUT_MS)
            best.click()
            page.get_by_text("A pass-key trial", exact=False).first.wait_for(timeout=LOAD_TIMEOUT_MS)
            page.wait_for_timeout(3000)
            assert page.locator('[data-testid="stException"]').count() == 0
            page.screenshot(path=str(ARTIFACTS / "screenshot-needle-optimum.png"), full_page=True)
            assert f"trace={run['optimal_attention']['bundle']}:L00H0" in unquote(page.url)

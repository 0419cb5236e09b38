"""The Pass key view's conversation in headless Chromium at 1280 x 800 on a fresh install (its own server on an
empty cache directory): the shipped conversation's turns and every key's fate drawn, no exception, and a
screenshot of it (artifacts/screenshot-conversation.png; docs/screenshot-conversation.png with
KVSIM_UPDATE_DOCS=1, the picture docs/needle.md shows)."""

from __future__ import annotations

import os

import pytest
from browser_support import app_command, free_port, opened, serving
from test_browser import ARTIFACTS, DOCS, LOAD_TIMEOUT_MS, ROOT, UPDATE_DOCS  # its module skips without Chromium

pytestmark = pytest.mark.browser

VIEWPORT = {"width": 1280, "height": 800}
NAME = "screenshot-conversation.png"
#: the fates figure drawn: a heatmap per key, each with its cells' steps
JS_FATES = """() => [...document.querySelectorAll('.js-plotly-plot')].some(d => (d.layout.annotations || [])
  .some(a => (a.text || '').includes('asked at turn')) && d.data.filter(t => t.type === 'heatmap').length === 2)"""


def test_the_conversation_in_a_browser_on_a_fresh_install(tmp_path, chromium):
    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    env = {**os.environ, "KVSIM_CACHE_DIR": str(tmp_path)}
    with serving(app_command(port), port, tmp_path / "server.log", cwd=ROOT, env=env) as (url, _):
        with opened(chromium) as browser:
            page = browser.new_page(viewport=VIEWPORT)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{url}/?view=Pass+key", timeout=LOAD_TIMEOUT_MS)
            page.wait_for_function(JS_FATES, timeout=LOAD_TIMEOUT_MS)
            page.get_by_text("asks for", exact=False).first.wait_for(timeout=LOAD_TIMEOUT_MS)
            assert page.locator('[data-testid="stException"]').count() == 0
            page.evaluate("() => document.fonts.ready.then(() => true)")
            # the turns' table and the whole fates figure below it in one window: the figure's bottom at the window's
            page.locator(".js-plotly-plot").last.evaluate("e => e.scrollIntoView({block: 'end'})")
            page.wait_for_timeout(2500)
            page.screenshot(path=str(ARTIFACTS / NAME))
            if UPDATE_DOCS:
                page.screenshot(path=str(DOCS / NAME))
            assert errors == []

"""The allocation view in a real browser (Debian's Chromium): the budget grids of each allocator on the
shipped bundle at the same memory, drawn, then the frontier below them (memory against KL for policies x
allocators on the bundle's recording, the Pareto-best ringed, drawn from the measured cells), one page load
and a screenshot of each to look at (artifacts/, or docs/ with KVSIM_UPDATE_DOCS=1). The app's server and
the browser are the session's (tests/conftest.py), the ones test_browser.py drives."""

from __future__ import annotations

import pytest
from browser_support import opened
from test_browser import ARTIFACTS, JS_TRACES, LOAD_TIMEOUT_MS, VIEWPORT, shoot, wait_text

pytestmark = pytest.mark.browser


def test_the_allocation_view_and_its_frontier_in_a_real_browser(server, chromium):
    ARTIFACTS.mkdir(exist_ok=True)
    with opened(chromium) as browser:
        page = browser.new_page(viewport=VIEWPORT)
        page_errors: list[str] = []
        page.on("pageerror", lambda e: page_errors.append(str(e)))
        page.goto(f"{server}/?view=Allocation&budget=64", wait_until="domcontentloaded")
        page.wait_for_function(f"() => ({JS_TRACES})().filter(t => t.type === 'heatmap').length === 4",
                               timeout=LOAD_TIMEOUT_MS)
        wait_text(page, "than uniform by")
        shoot(page, "screenshot-allocation.png")
        page.wait_for_function(f"() => ({JS_TRACES})().filter(t => t.name === 'Pareto-best').length === 1",
                               timeout=LOAD_TIMEOUT_MS)
        wait_text(page, "Pareto-best")
        wait_text(page, "cells measured")
        page.get_by_text("Memory against the truth").scroll_into_view_if_needed()
        shoot(page, "screenshot-allocation-frontier.png")
        assert page_errors == []

"""Issue 56, item 2, in a real browser (Debian's Chromium): every view fits at 1280 x 800 and 1500 x 1100.
With a serving layout set (block size 16, whose panels' titles take a third line) no row of the kept view's
key lies on a panel's title; the tab bar shows every tab, none behind a scroll arrow; the Allocation view's
panel titles keep apart and its table shows every column whole. The window as the reader sees it goes to
artifacts/. The app's server and the browser are the session's (tests/conftest.py)."""

from __future__ import annotations

import pytest
from browser_support import opened
from test_browser import ARTIFACTS, JS_IMAGES, JS_TRACES, LOAD_TIMEOUT_MS, SMALL_VIEWPORT, VIEWPORT, no_exceptions

from kvsim.app.state import TABS

pytestmark = pytest.mark.browser

SIZES = [SMALL_VIEWPORT, VIEWPORT]
IDS = ["1280x800", "1500x1100"]

#: each Plotly figure's legends and annotations, as boxes on the screen
JS_PARTS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(d => {
  const box = e => { const b = e.getBoundingClientRect(); return {x0: b.left, x1: b.right, y0: b.top, y1: b.bottom, text: e.textContent}; };
  return {kinds: (d.data || []).map(t => t.type + ':' + (t.name || '')),
          legends: [...d.querySelectorAll('g.legend, g.legend2, g.legend3')].map(box),
          notes: [...d.querySelectorAll('g.annotation')].map(box)};
})"""
#: the tab bar: its widths, and each tab's box against the bar's
JS_TABS = """() => {
  const bar = document.querySelector('[role=tablist]'), b = bar.getBoundingClientRect();
  return {scroll: bar.scrollWidth, client: bar.clientWidth, bar: {x0: b.left, x1: b.right},
          tabs: [...bar.querySelectorAll('[role=tab]')].map(t => { const r = t.getBoundingClientRect();
            return {text: t.textContent, x0: r.left, x1: r.right, y0: r.top, y1: r.bottom}; })};
}"""
#: the cells of the page's static tables: each one's text, and whether any of it is cut
JS_CELLS = """() => [...document.querySelectorAll('[data-testid="stTable"] td, [data-testid="stTable"] th')].map(c => (
  {text: c.textContent, cut: c.scrollWidth > c.clientWidth + 1, right: c.getBoundingClientRect().right}))"""


def _apart(a: dict, b: dict) -> bool:
    return a["x1"] <= b["x0"] or b["x1"] <= a["x0"] or a["y1"] <= b["y0"] or b["y1"] <= a["y0"]


def whole_tab_bar(page, width: int) -> None:
    """Every tab on screen, inside the bar, none scrolled out of sight."""
    bar = page.evaluate(JS_TABS)
    assert [t["text"] for t in bar["tabs"]] == list(TABS)
    assert bar["scroll"] <= bar["client"], bar
    for t in bar["tabs"]:
        assert bar["bar"]["x0"] - 1 <= t["x0"] and t["x1"] <= min(bar["bar"]["x1"], width) + 1, t


@pytest.mark.parametrize("viewport", SIZES, ids=IDS)
def test_under_a_layout_no_key_lies_on_a_title_and_every_tab_shows(server, chromium, viewport):
    """Before: with block size 16 the kept panels' titles took three lines and the key's second row sat on
    them (at 1280 x 800 and 1500 x 1100); at 1280 x 800 Pass key and Allocation were behind a scroll arrow."""
    ARTIFACTS.mkdir(exist_ok=True)
    w, h = viewport["width"], viewport["height"]
    with opened(chromium) as browser:
        page = browser.new_page(viewport=viewport)
        page.goto(f"{server}/?block_size=16", wait_until="domcontentloaded")
        page.wait_for_function(f"() => ({JS_IMAGES})() >= 3", timeout=LOAD_TIMEOUT_MS)
        page.get_by_text("serving layout block_size=16", exact=False).first.wait_for(timeout=LOAD_TIMEOUT_MS)
        page.wait_for_timeout(1500)  # fonts and legends settle
        no_exceptions(page)
        page.screenshot(path=str(ARTIFACTS / f"layout-kept-{w}x{h}.png"))  # the window only: the first screen
        whole_tab_bar(page, w)
        (kept,) = [c for c in page.evaluate(JS_PARTS) if any(k.startswith("image:") for k in c["kinds"])]
        page.locator(".js-plotly-plot").first.hover()  # the tool bar (the box select is there) shows while hovered
        bar = page.locator(".js-plotly-plot .modebar").first.bounding_box()
    assert bar is not None
    bar = {"x0": bar["x"], "x1": bar["x"] + bar["width"], "y0": bar["y"], "y1": bar["y"] + bar["height"]}
    assert all(_apart(bar, legend) for legend in kept["legends"]), (bar, kept["legends"])
    titles = [n for n in kept["notes"] if "mass" in n["text"]]
    assert len(titles) == 3 and any("block_size=16" in t["text"] for t in titles)
    assert kept["legends"], "the kept figure has no legend on the page"
    for legend in kept["legends"]:
        assert legend["y1"] <= h, legend  # on the first screen
        for title in titles:
            assert _apart(legend, title), (legend, title)


@pytest.mark.parametrize("viewport", SIZES, ids=IDS)
def test_the_allocation_views_titles_keep_apart_and_its_table_shows_whole(server, chromium, viewport):
    """Before: at 1280 x 800 "worse than uniform by 0.0171" ran into the next panel's title, and the table's
    "what it does" column was cut at both sizes."""
    ARTIFACTS.mkdir(exist_ok=True)
    w, h = viewport["width"], viewport["height"]
    with opened(chromium) as browser:
        page = browser.new_page(viewport=viewport)
        page.goto(f"{server}/?view=Allocation&budget=64", wait_until="domcontentloaded")
        page.wait_for_function(f"() => ({JS_TRACES})().filter(t => t.type === 'heatmap').length === 4",
                               timeout=LOAD_TIMEOUT_MS)
        page.locator('[data-testid="stTable"]').first.wait_for(timeout=LOAD_TIMEOUT_MS)
        page.wait_for_timeout(1500)
        no_exceptions(page)
        whole_tab_bar(page, w)
        (grids,) = [c for c in page.evaluate(JS_PARTS) if any(k.startswith("heatmap:") for k in c["kinds"])]
        cells = page.evaluate(JS_CELLS)
        page.locator('[data-testid="stTable"]').first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / f"allocation-table-{w}x{h}.png"))
    titles = [n for n in grids["notes"] if "mass" in n["text"]]
    assert len(titles) == 4
    for i, a in enumerate(titles):
        for b in titles[i + 1:]:
            assert _apart(a, b), (a, b)
    assert any("what it does" == c["text"] for c in cells) and any("dynamic programme" in c["text"] for c in cells)
    assert not [c for c in cells if c["cut"] or c["right"] > w], "a table cell is cut"


#: the two views whose key was below the fold at 1280 x 800, and a trace kind only their figure has
KEYED = {"Cumulative scores": "histogram:", "Choosing recent_window": "scatter:current recent_window"}


@pytest.mark.parametrize("view", list(KEYED))
@pytest.mark.parametrize("viewport", SIZES, ids=IDS)
def test_the_curves_and_the_scores_key_is_on_the_first_screen(server, chromium, viewport, view):
    """Before: at 1280 x 800 the scores' key was under its axis and the curve's legends under its lower panel,
    both below the fold. Now, nothing scrolled, every legend lies inside the window and clear of every title
    and note of its figure."""
    ARTIFACTS.mkdir(exist_ok=True)
    w, h = viewport["width"], viewport["height"]
    with opened(chromium) as browser:
        page = browser.new_page(viewport=viewport)
        page.goto(f"{server}/?view={view.replace(' ', '+')}", wait_until="domcontentloaded")
        kind = KEYED[view]
        page.wait_for_function(f"() => ({JS_TRACES})().some(t => (t.type + ':' + (t.name || '')).startsWith({kind!r}))",
                               timeout=LOAD_TIMEOUT_MS)
        page.wait_for_timeout(1500)
        no_exceptions(page)
        page.screenshot(path=str(ARTIFACTS / f"key-{view.split()[-1]}-{w}x{h}.png"))
        whole_tab_bar(page, w)
        (chart,) = [c for c in page.evaluate(JS_PARTS) if any(k.startswith(kind) for k in c["kinds"])]
    assert chart["legends"], f"the {view} figure has no legend on the page"
    for legend in chart["legends"]:
        assert 0 <= legend["y0"] and legend["y1"] <= h and legend["x1"] <= w, legend
        for note in chart["notes"]:
            assert _apart(legend, note), (legend, note)

"""The browser side of the benchmark: one browser context with one tab (``Session``), its actions,
and the wait for an idle page (see the package's docstring for what "idle" means)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from .report import Timing
from .steps import Open, SetNumber, Step, Tab, Upload

VIEWPORT = {"width": 1500, "height": 1250}
STEP_TIMEOUT_S = 180.0  # past this a run is a miss, reported as such (the curve at 1024 took 23 s)

#: true when the page shows no running script (the status widget offers "Stop" while one runs), nothing
#: stale, and at least ``minFigures`` Plotly figures holding ``minImages`` images, each figure laid out
#: and every image decoded (decoding is started here once per source and remembered)
JS_IDLE = """([minFigures, minImages]) => {
  if (document.querySelector('[data-stale="true"]')) return false;
  const sw = document.querySelector('[data-testid="stStatusWidget"]');
  if (sw && /stop|running|connecting/i.test(sw.innerText || '')) return false;
  const figs = [...document.querySelectorAll('.js-plotly-plot')];
  if (figs.length < minFigures) return false;
  if (figs.reduce((n, d) => n + d.querySelectorAll('image').length, 0) < minImages) return false;
  const done = (window.__kvsimDecoded = window.__kvsimDecoded || new Map());
  for (const d of figs) {
    if (!d._fullLayout || !d.querySelector('.main-svg')) return false;
    for (const im of d.querySelectorAll('image')) {
      const src = im.getAttribute('href') || im.getAttribute('xlink:href');
      if (!src) continue;
      if (!done.has(src)) {
        done.set(src, false);
        const probe = new Image();
        probe.src = src;
        probe.decode().then(() => done.set(src, true), () => done.set(src, true));
      }
      if (!done.get(src)) return false;
    }
  }
  return true;
}"""
JS_TWO_FRAMES = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))"
JS_STATE = """() => ({
  exception: (document.querySelector('[data-testid="stException"]') || {}).innerText || '',
  stale: [...document.querySelectorAll('[data-stale="true"]')].map(e => e.getAttribute('data-testid') || e.tagName).join(','),
  status: (document.querySelector('[data-testid="stStatusWidget"]') || {}).innerText || '',
  figures: document.querySelectorAll('.js-plotly-plot').length,
  spinners: document.querySelectorAll('[data-testid="stSpinner"]').length,
})"""
JS_EXCEPTION = "() => { const e = document.querySelector('[data-testid=\"stException\"]'); return e ? e.innerText : null; }"


class Session:
    """One browser context (one user) with one tab, counting the script runs its websocket reports."""

    def __init__(self, browser, base_url: str):
        self.browser, self.base_url = browser, base_url
        self.context = self.page = None
        self.finished = 0  # script runs reported finished on this tab, over all its page loads
        self.finished_at = 0.0  # perf_counter() when the last one was reported
        self.received = 0  # websocket bytes from the server, over all its page loads
        self._changed = asyncio.Event()
        self.upload: Path | None = None  # the file ``Upload`` gives the uploader

    async def _new_page(self, new_context: bool, new_tab: bool = False) -> None:
        if new_context or self.context is None:
            if self.context is not None:
                await self.context.close()
            self.context = await self.browser.new_context(viewport=VIEWPORT)
        elif new_tab:
            await self.page.close()
        else:
            return
        self.page = await self.context.new_page()
        self.page.on("websocket", self._watch)

    def _watch(self, ws) -> None:
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        def frame(payload) -> None:
            if isinstance(payload, str):
                return
            self.received += len(payload)
            try:
                msg = ForwardMsg.FromString(payload)
            except Exception:  # not a ForwardMsg (a future protocol): the DOM checks still apply
                return
            if msg.WhichOneof("type") == "script_finished" and \
                    msg.script_finished != ForwardMsg.ScriptFinishedStatus.FINISHED_EARLY_FOR_RERUN:
                self.finished += 1
                self.finished_at = time.perf_counter()
                self._changed.set()

        ws.on("framereceived", frame)

    async def _script_finished_after(self, seen: int, deadline: float) -> None:
        while self.finished <= seen:
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the server never reported the script run finished")
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except TimeoutError:
                pass

    async def act(self, action) -> None:
        if isinstance(action, Open):
            await self._new_page(action.new_session, action.new_tab)
            await self.page.goto(self.base_url + "/" + action.query, wait_until="commit")
        elif isinstance(action, SetNumber):
            scope = '[data-testid="stSidebar"] ' if action.sidebar else ""
            box = self.page.locator(f'{scope}input[aria-label="{action.label}"]').first
            await box.fill(str(action.value))
            await box.press("Enter")
        elif isinstance(action, Tab):
            await self.page.get_by_role("tab", name=action.name).click()
        elif isinstance(action, Upload):
            await self.page.locator('[data-testid="stSidebar"] input[type="file"]').set_input_files(str(self.upload))
        else:
            raise TypeError(f"unknown action {action!r}")

    async def timed(self, step: Step, timeout_s: float = STEP_TIMEOUT_S) -> Timing:
        """Run the step's action and wait for the idle page; a miss is a Timing with an error."""
        seen, received = self.finished, self.received
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        try:
            await self.act(step.action)
            await self._script_finished_after(seen, deadline)
            server_s = self.finished_at - t0
            left_ms = max(1.0, (deadline - time.monotonic()) * 1000)
            await self.page.wait_for_function(JS_IDLE, arg=[step.min_figures, step.min_images], timeout=left_ms, polling="raf")
            await self.page.evaluate(JS_TWO_FRAMES)
            seconds = time.perf_counter() - t0
        except Exception as e:  # a timeout or a broken page is this run's result, not the benchmark's end
            return Timing(None, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}{await self._state()}")
        shown = await self.page.evaluate(JS_EXCEPTION)
        if shown:
            return Timing(None, "the app shows an exception: " + " ".join(shown.split())[:200])
        return Timing(seconds, server_s=server_s, sent_mb=(self.received - received) / 2**20)

    async def _state(self) -> str:
        """What the page showed when a step failed (an exception, stale elements, the status, the
        figures), so that a miss says why; empty when the page cannot be read."""
        try:
            state = await self.page.evaluate(JS_STATE)
        except Exception:  # the page itself is gone
            return ""
        return " (page: " + "; ".join(f"{k} {' '.join(str(v).split())[:160]}" for k, v in state.items() if v) + ")"

    async def text(self) -> str:
        return await self.page.locator("body").inner_text()

    async def close(self) -> None:
        """Close the context (a second call does nothing)."""
        if self.context is not None:
            await self.context.close()
            self.context = self.page = None

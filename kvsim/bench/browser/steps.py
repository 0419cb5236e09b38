"""The browser benchmark's steps, as data: a name, an action and a target in seconds, so they follow
the app's controls when those change. ``ROUND`` is one session's steps, run in order on a fresh
server every round; ``EXPLORATION`` is what each of the concurrent sessions of the load does."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

SIX_POLICIES = ("sliding_window", "streaming_llm", "h2o", "scissorhands", "tova", "greedy_future")
REAL_TRACE = "gemma3-270m-L11"


@dataclass(frozen=True)
class Open:
    """Open the app at ``query`` (a link). ``new_session``: in a new browser context (a new user,
    whose browser has cached nothing); ``new_tab``: in a new tab of the same context (a new
    Streamlit session, the JavaScript from the browser's cache); else in the same tab."""

    query: str = ""
    new_session: bool = False
    new_tab: bool = False

    def describe(self) -> str:
        where = " (new browser session)" if self.new_session else " (new tab)" if self.new_tab else ""
        return f"open /{self.query}" + where


@dataclass(frozen=True)
class SetNumber:
    """Type ``value`` into the number input labelled ``label`` (in the sidebar unless ``sidebar`` is
    False) and press Enter."""

    label: str
    value: int
    sidebar: bool = True

    def describe(self) -> str:
        return f"set {self.label} to {self.value}"


@dataclass(frozen=True)
class Tab:
    """Click the view's tab."""

    name: str

    def describe(self) -> str:
        return f"open the tab {self.name!r}"


@dataclass(frozen=True)
class Upload:
    """Give the sidebar's uploader the benchmark's small trace file."""

    def describe(self) -> str:
        return "upload a small trace"


@dataclass(frozen=True)
class Step:
    name: str
    action: Open | SetNumber | Tab | Upload
    target_s: float
    #: Plotly figures the idle page must show (a view that draws none gives 0)
    min_figures: int = 1
    #: images inside those figures (the kept view draws one per policy, as panels of one figure)
    min_images: int = 0


def _query(**params) -> str:
    return "?" + urllib.parse.urlencode(params)


#: before each round, on a server of its own whose numba cache (``NUMBA_CACHE_DIR``) and trace cache
#: (``KVSIM_CACHE_DIR``) are empty: what a brand-new install shows first (the page is drawn while the
#: fast engine compiles in the background)
INSTALL = Step("first page of a brand-new install", Open(new_session=True), 10.0, min_images=3)

#: one round, in order, on a fresh server; every control change starts from the state before it
ROUND: list[Step] = [
    Step("first page of a fresh server", Open(new_session=True), 5.0, min_images=3),
    Step("a new session, default view", Open(new_session=True), 2.0, min_images=3),
    Step("a new tab of the same browser, default view", Open(new_tab=True), 2.0, min_images=3),
    Step("sidebar recent_window 32 -> 64", SetNumber("recent_window", 64), 1.0, min_images=3),
    Step("budget 256 -> 128", SetNumber("budget", 128), 1.0, min_images=3),
    Step("budget back to 256 (cached)", SetNumber("budget", 256), 1.0, min_images=3),
    Step("a link with all six policies", Open(_query(policies=",".join(SIX_POLICIES))), 1.0, min_images=6),
    Step("recent_window curve at budget 1024 (cold cache)",
         Open(_query(budget=1024, view="Choosing recent_window")), 1.0, min_figures=1),
    Step("a shipped real trace, kept view", Open(_query(trace=REAL_TRACE)), 1.0, min_images=3),
]

#: what each of the eight concurrent sessions does (the first one also uploads a trace)
EXPLORATION: list[Step] = [
    Step("open the default view", Open(new_session=True), 3.0, min_images=3),
    Step("recent_window 32 -> 64", SetNumber("recent_window", 64), 3.0, min_images=3),
    Step("budget 256 -> 128", SetNumber("budget", 128), 3.0, min_images=3),
    Step("the recent_window curve", Tab("Choosing recent_window"), 3.0, min_figures=1),
    Step("budget 128 -> 256 on the curve", SetNumber("budget", 256), 3.0, min_figures=1),
    Step("the trace itself", Tab("The trace"), 3.0, min_figures=1),
]
UPLOAD_STEP = Step("upload a small trace (session 1 only)", Upload(), 3.0, min_images=3)
LOAD_SESSIONS = 8

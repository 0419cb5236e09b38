"""The browser benchmark's steps, as data: a name, an action and a target in seconds, so they follow
the app's controls when those change. ``ROUND`` is one session's steps, run in order on a fresh
server every round; ``EXPLORATION`` is what each of the concurrent sessions of the load does."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from ...policykit.base import WINDOW

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
    #: the name of the ``FLOOR`` step this one is measured against (the same action on a bare page)
    floor: str | None = None


def _query(**params) -> str:
    return "?" + urllib.parse.urlencode(params)


#: the floor: a bare Streamlit page (one three-point Plotly chart, the two sidebar number inputs the round
#: changes), served by the same Streamlit in the same run. What a step of kvsim's takes beyond the same
#: action on this page is what kvsim's script and page add; a step PASSES within ``FLOOR_MARGIN_S`` of it
FLOOR_SCRIPT = """import plotly.graph_objects as go
import streamlit as st

st.set_page_config(page_title="a bare Streamlit page", layout="wide")
st.sidebar.number_input("recent_window", value=32, step=1)
st.sidebar.number_input("budget", value=256, step=1)
st.title("A bare Streamlit page")
st.plotly_chart(go.Figure(go.Scatter(x=[1, 2, 3], y=[1, 3, 2])))
"""
FLOOR_MARGIN_S = 0.3
FIRST_PAGE, NEW_SESSION, NEW_TAB, CONTROL, LINK = (
    "floor: first page of a fresh server", "floor: a new session", "floor: a new tab", "floor: a control change",
    "floor: a link")
#: the same actions on the bare page, on a fresh server of its own before each round (their targets are
#: only for the bare page itself)
FLOOR: list[Step] = [
    Step(FIRST_PAGE, Open(new_session=True), 5.0),
    Step(NEW_SESSION, Open(new_session=True), 2.0),
    Step(NEW_TAB, Open(new_tab=True), 2.0),
    Step(CONTROL, SetNumber("budget", 128), 1.0),
    Step(LINK, Open(_query(x=1)), 1.0),
]

#: before each round, on a server of its own whose numba cache (``NUMBA_CACHE_DIR``) and trace cache
#: (``KVSIM_CACHE_DIR``) are empty: what a brand-new install shows first (the page is drawn while the
#: fast engine compiles in the background)
INSTALL = Step("first page of a brand-new install", Open(new_session=True), 10.0, min_images=3)

#: one round, in order, on a fresh server; every control change starts from the state before it
ROUND: list[Step] = [
    Step("first page of a fresh server", Open(new_session=True), 5.0, min_images=3, floor=FIRST_PAGE),
    Step("a new session, default view", Open(new_session=True), 2.0, min_images=3, floor=NEW_SESSION),
    Step("a new tab of the same browser, default view", Open(new_tab=True), 2.0, min_images=3, floor=NEW_TAB),
    Step("sidebar recent_window 32 -> 64", SetNumber(WINDOW, 64), 1.0, min_images=3, floor=CONTROL),
    Step("budget 256 -> 128", SetNumber("budget", 128), 1.0, min_images=3, floor=CONTROL),
    Step("budget back to 256 (cached)", SetNumber("budget", 256), 1.0, min_images=3, floor=CONTROL),
    Step("a link with all six policies", Open(_query(policies=",".join(SIX_POLICIES))), 1.0, min_images=6, floor=LINK),
    Step("recent_window curve at budget 1024 (cold cache)",
         Open(_query(budget=1024, view="Choosing recent_window")), 1.0, min_figures=1, floor=LINK),
    Step("a shipped real trace, kept view", Open(_query(trace=REAL_TRACE)), 1.0, min_images=3, floor=LINK),
]

#: what each of the eight concurrent sessions does (the first one also uploads a trace)
EXPLORATION: list[Step] = [
    Step("open the default view", Open(new_session=True), 3.0, min_images=3),
    Step("recent_window 32 -> 64", SetNumber(WINDOW, 64), 3.0, min_images=3),
    Step("budget 256 -> 128", SetNumber("budget", 128), 3.0, min_images=3),
    Step("the recent_window curve", Tab("Choosing recent_window"), 3.0, min_figures=1),
    Step("budget 128 -> 256 on the curve", SetNumber("budget", 256), 3.0, min_figures=1),
    Step("the trace itself", Tab("The trace"), 3.0, min_figures=1),
]
UPLOAD_STEP = Step("upload a small trace (session 1 only)", Upload(), 3.0, min_images=3)
LOAD_SESSIONS = 8

"""The page: the title, the tour, the sidebar, and one tab per view (only the open tab is drawn).

UI only: widgets in, calls into ``kvsim``, figures (from ``kvsim.views``) out. Every replay and sweep
is cached by trace and policy spec, so moving a control re-draws from results already computed. The
state of the controls lives in the URL's query parameters: a link reopens the same view.

The views are drawn with compiled kernels only (``kvsim.jit.compiled_only``): on a brand-new install
numba compiles the fast engine in the background (``memo.warmup``) while the page is drawn on the
reference path (the same results), and one line says so.
"""

from __future__ import annotations

# Imported here, at the top of every run, and never first inside a view: Plotly's JSON encoder reads
# ``sys.modules["pandas"]`` without importing it, so a session that serialises a figure while another
# is halfway through importing pandas fails ("partially initialized module 'pandas' has no attribute
# 'Series'": seen under the eight-session load). Every run passes this line before it draws anything,
# and a second importer waits here for the first to finish.
import pandas  # noqa: F401
import streamlit as st

from kvsim import jit
from kvsim.policykit import registry as policy_registry

from . import memo, services, state
from .allocation_tab import allocation_view
from .claims_tab import claims_view
from .controls import Settings, controls, tour_box
from .curve_tab import curve_view
from .kept_tab import kept_view
from .lab_tab import lab_view
from .memory_panel import memory_panel
from .model_tab import model_view
from .needle_tab import needle_view
from .plan_download import plan_download
from .quality_tab import quality_view
from .scores_tab import score_view
from .trace_tab import trace_view

#: Streamlit's page starts 6rem down and its title is 2.75rem: at 1280 x 800 that put the kept figure's
#: top at y = 600 and its legend below the fold. Its sides are 5rem each: at 1280 x 800 the views were
#: 820 px wide and the tab bar, 918 px of names and gaps, hid Pass key and Allocation behind a scroll
#: arrow; with sides of 2.5rem and gaps of 0.625rem between the tabs (16 px before) they are 900 px and
#: 864 px, every tab on one row. Where a window is narrower still (a wider sidebar), the tabs wrap onto
#: a second row rather than scroll out of sight. Style only (sent to Streamlit's event container, no
#: space taken, no script run).
PAGE_CSS = """<style>
[data-testid="stMainBlockContainer"] { padding-top: 4rem; padding-left: 2.5rem; padding-right: 2.5rem; }
[data-testid="stMainBlockContainer"] h1 { font-size: 2.1rem; padding: 0 0 0.25rem 0; }
.st-key-view [role="tablist"] { gap: 0.25rem 0.625rem; flex-wrap: wrap; overflow-x: visible; }
</style>"""


def run() -> None:
    st.set_page_config(page_title="kvsim: KV-cache eviction, step by step", layout="wide")
    st.html(PAGE_CSS)
    if "_link_read" not in st.session_state:
        st.session_state["_link_problems"] = state.read_link()
        st.session_state["_link_read"] = True
    if not state.touring():  # a tour step is a slide: its box is the heading, so the figure fits the screen
        st.title("kvsim: what a KV cache keeps")
        # one line at 1280 x 800 (two pushed the kept figure's bottom past the fold)
        st.caption("Replay an attention trace through KV-cache eviction policies: what each keeps, step by step, "
                   "and how much attention it holds.")
    for problem in st.session_state.pop("_link_problems", []):
        st.warning(problem)

    tour_box()
    sidebar_top = st.sidebar.container()  # the compile's note, if any: read at once, never above the figure
    st.sidebar.header("settings")
    for problem in policy_registry.PROBLEMS:  # a plugin that failed to load (KVSIM_PLUGINS, an entry point): one line each
        st.sidebar.warning(problem.removeprefix("kvsim: "))
    trace = state.choose_trace()
    state.follow_trace(trace)
    controls(trace)
    state.write_link()

    settings = Settings.read(trace)
    for problem in settings.problems:
        st.error(problem)
    memory_panel(trace.meta, trace.steps, settings.budget, settings.layout)
    with st.sidebar:
        plan_download(settings.laid_out, settings.layout)

    views = (
        lambda: kept_view(trace, settings), lambda: score_view(trace, settings), lambda: curve_view(trace, settings),
        lambda: trace_view(trace), lab_view, lambda: claims_view(trace), lambda: model_view(settings.budget),
        lambda: quality_view(settings.budget), needle_view, lambda: allocation_view(settings.budget),
    )
    needs = [*settings.chosen, "pooling", st.session_state.get("curve_policy", "h2o")]
    compile_later = warm_up(needs, sidebar_top)
    tabs = st.tabs(list(state.TABS), key="view", bind="query-params")
    try:  # the background work the view asks for starts once its page is drawn
        with jit.compiled_only(), services.starting_after():
            for tab, view in zip(tabs, views, strict=True):
                with tab:
                    if tab.open:
                        view()
    finally:  # also when a rerun cuts this one short: the compile is in another process, never in the way
        compile_later()


def warm_up(needs: list[str], where=None):
    """The kernels this page may use (``needs``: the policies shown, the kept view's pooling, the
    curve's policy): loaded now where numba's disk cache holds them (a fraction of a second), else
    said in one line at the top of the sidebar (``where``; above the views it pushed a brand-new
    install's first figure and its key past the fold at 1280 x 800) and, once the page is drawn,
    compiled in the background (the views meanwhile take the reference path). Returns what starts
    that compile."""
    warm = memo.warmup()
    if warm.cached(needs):
        warm.load(needs)
        return lambda: None
    if warm.note(needs):  # in the sidebar, so the first figure (and a tour step's) still fits the screen
        with where or st.sidebar:
            compile_banner(warm, needs)
    return lambda: warm.want(needs)


def compile_banner(warm, needs: list[str]) -> None:
    """The compile's one line, redrawn every second with the time it has taken and what is left; when the
    compile ends the line goes and the page is drawn again, now on the engine, with nothing touched."""

    @st.fragment(run_every=1.0)
    def banner() -> None:
        note = warm.note(needs)
        if note is None:  # compiled (or failed: the reference path stays): the page again, without the line
            if st.session_state.pop("_compiling", False):
                st.rerun()
            return
        st.session_state["_compiling"] = True
        st.info(note, icon=":material/hourglass_top:")

    banner()

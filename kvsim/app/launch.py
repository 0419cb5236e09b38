"""The app's server process: Streamlit's own command line, run in this process once what every first page
needs is loaded. ``kvsim app`` and ``kvsim serve`` start the app so:

    python -m kvsim.app.launch run app.py [streamlit run's options]

Streamlit runs a page's script inside the server's process, so a module the script imports, or an
``st.cache_resource`` it fills, is ready for every later session. A plain ``streamlit run app.py`` made a
fresh server's first visitor wait while their script run imported pandas, Plotly and kvsim's views,
loaded the engine's kernels from numba's disk cache and read the canonical trace (docs/speed.md, "A
fresh server's first page, and each view's first visit"). Here that happens before the server answers, so the first page costs what
any new session's does, and a link to other policies loads no kernel either. A kernel that is not on disk
yet is not compiled here: the page compiles it in the background, as before, and says so.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

#: the two Streamlit loggers that warn about what the preload does by design, outside any script run: an
#: ``st.cache_data`` decorated at import, before the runtime exists ("No runtime found, using
#: MemoryCacheStorageManager": only its parameters are checked then), and each ``st.cache_*`` call made with no
#: session ("missing ScriptRunContext! This warning can be ignored when running in bare mode"). Streamlit
#: gives each of its loggers its own level and no propagation, so the parent "streamlit" logger's level
#: does not reach them: each is raised to ERROR by name, for the preload only, and put back after it.
OUTSIDE_A_RUN = ("streamlit.runtime.caching.cache_data_api", "streamlit.runtime.scriptrunner_utils.script_run_context")


@contextlib.contextmanager
def outside_a_run():
    """Streamlit's two warnings about running outside a script run silenced (ERROR and above still said)."""
    import streamlit  # noqa: F401  (creates its loggers, at the configured level, before they are raised here)

    loggers = [logging.getLogger(name) for name in OUTSIDE_A_RUN]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(max(log.level, logging.ERROR))
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def preload() -> float:
    """Import the app, fill the caches its default view reads first and load every policy's kernel that
    numba's disk cache holds; the seconds it took."""
    t0 = time.perf_counter()
    with outside_a_run():
        import plotly.graph_objects as go

        from kvsim.data import kept as shipped
        from kvsim.sim import engine

        from . import main, memo, state, trace_tab  # noqa: F401  (main: streamlit, pandas, Plotly, every view)

        first = state.defaults()
        needs = [*first["policies"], "pooling", first["curve_policy"]]
        warm = memo.warmup()
        # the default view's kernels first, then every other policy's, each that numba's disk cache holds (0.15 s
        # for twelve here): a link naming other policies, or another curve, then loads none on a fresh server
        warm.load([n for n in (*needs, *engine.FAST) if warm.cached([n])])
        trace = memo.load_named_trace(first["trace"])
        trace_tab.cached_trace_matrix(trace)  # the Trace view's picture of it: 0.3 s of that view's first visit
        memo.bundle_traces()
        # the shipped derived data (traces/kept/, 0.6 MB of JSON) is decoded whole on a shipped trace's first
        # derived read: 0.36 s of the first link to a real trace (issue 56 item 3), paid here instead
        shipped.documents()
        # Plotly reads a trace type's validators on its first figure: the kept view's kinds
        go.Figure([go.Image(z=[[[0, 0, 0]]]), go.Scatter(x=[0], y=[0])],
                  layout={"annotations": [{"text": ""}], "shapes": [{"type": "line"}]})
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        preload()
    except Exception as e:  # the page says what is wrong when it is opened; the server starts regardless
        sys.stderr.write(f"kvsim app: nothing preloaded ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                         "the first page loads it\n")
    from streamlit.web import cli

    sys.argv = ["streamlit", *argv]
    try:
        cli.main(prog_name="streamlit")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

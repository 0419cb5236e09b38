"""``python -m kvsim bench --browser``: the app in a real headless Chromium, timed from each action
until the page is idle again, each step against its target.

What "idle" means here, all of it, in this order:

1. the server says the script run is over: a ``script_finished`` message (read from the page's own
   websocket frames, decoded with Streamlit's protobuf classes) newer than the action, with a status
   other than "finished early for a rerun"; this closes the race where the page still looks idle
   because the rerun has not started;
2. the page agrees: no element marked stale (``[data-stale="true"]``), no running indicator in
   ``[data-testid="stStatusWidget"]``, at least the step's number of Plotly figures
   (``.js-plotly-plot``), each laid out by plotly.js (``_fullLayout``, its ``main-svg`` drawn), and
   every ``<image>`` of a figure decoded (``SVGImageElement`` has no ``complete``, so each source is
   decoded once through ``new Image().decode()`` and remembered);
3. two animation frames have gone by, so the browser has painted what it has.

The steps are data (``ROUND``, ``EXPLORATION``): a name, an action and a target in seconds, so they
follow the app's controls when those change. Each round starts a fresh server and runs ``ROUND`` in
order (the first page of that server, a new session, a new tab, the control changes, links), so
every round sees the same caches; before it, ``INSTALL`` is the first page of one more server whose
numba and trace caches are empty (a brand-new install: every kernel and trace still to build). A
step's figures are the median and the worst of the rounds.
Then eight sessions at once (one Chromium, eight contexts) each run ``EXPLORATION`` on one more
fresh server; one of them uploads a small trace and the others must not see it; the server's peak
memory is sampled throughout (resident set of the server and its children) and read at the end
(VmHWM).

Before each round, ``FLOOR`` runs the same kinds of action (a first page, a new session, a new tab, a
control change, a link) on a bare Streamlit page (``FLOOR_SCRIPT``: one small chart and two number
inputs) served by a fresh server of its own: the floor of this machine, this Streamlit and this browser,
measured in the same run. Each ``ROUND`` step names its floor (``Step.floor``) and its target is then
the floor's worst run plus ``FLOOR_MARGIN_S`` (0.3 s); the table prints the floor's median beside each
step and how far beyond it the step went.

A step PASSES when its worst run is within its target; a run that times out or raises counts as a
miss (reported, never a crash). Nothing here is a test: the figures depend on the machine.

The package: ``steps`` (the steps, as data), ``server`` (the app's server and its memory), ``page``
(a browser session, its actions and the idle wait), ``driver`` (``run``: the rounds and the load)
and ``report`` (verdicts and the table, pure functions tested without a browser).
"""

from .driver import CHROMIUM, CHROMIUM_ARGS, run
from .page import Session
from .report import StepReport, Timing, dumps, overall, render, summarize, upload_isolation
from .server import ROOT, PeakSampler, Server, install_env
from .steps import (
    EXPLORATION,
    FLOOR,
    FLOOR_MARGIN_S,
    FLOOR_SCRIPT,
    INSTALL,
    LOAD_SESSIONS,
    REAL_TRACE,
    ROUND,
    SIX_POLICIES,
    UPLOAD_STEP,
    Open,
    SetNumber,
    Step,
    Tab,
    Upload,
)

__all__ = [
    "CHROMIUM", "CHROMIUM_ARGS", "EXPLORATION", "FLOOR", "FLOOR_MARGIN_S", "FLOOR_SCRIPT",
    "INSTALL", "LOAD_SESSIONS", "REAL_TRACE", "ROOT", "ROUND", "SIX_POLICIES", "UPLOAD_STEP",
    "Open", "PeakSampler", "Server", "Session", "SetNumber", "Step", "StepReport", "Tab", "Timing", "Upload", "dumps", "install_env",
    "overall", "render", "run", "summarize", "upload_isolation",
]

"""kvsim in the browser: see what each KV-cache eviction policy keeps, and choose recent_window by eye.

    streamlit run app.py

UI only: widgets in, calls into ``kvsim``, figures (from ``kvsim.views.figures``) out. Every replay and
sweep is cached by trace and parameters, so moving a control re-draws from results already computed.
The state of the controls lives in the URL's query parameters: a link reopens the same view.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
from pathlib import Path

# Imported here, at the top of every run, and never first inside a view: Plotly's JSON encoder reads
# ``sys.modules["pandas"]`` without importing it, so a session that serialises a figure while another
# is halfway through importing pandas fails ("partially initialized module 'pandas' has no attribute
# 'Series'": seen under the eight-session load). Every run passes this line before it draws anything,
# and a second importer waits here for the first to finish.
import pandas  # noqa: F401
import streamlit as st

import kvsim
from kvsim.analysis import lab
from kvsim.analysis.claims import BUDGET as CLAIMS_BUDGET
from kvsim.analysis.claims import VERDICTS, ledger
from kvsim.analysis.metrics import describe_cached
from kvsim.analysis.tune import tune
from kvsim.data.catalog import CANONICAL, available_bundles, available_traces, resolve_bundle, resolve_trace
from kvsim.policies import all_tunables, describe_policy
from kvsim.policies.upper_bound import upper_bound_summary
from kvsim.views import figures, model_figures, quality_figures, story, tour
from kvsim.views import support as views

TOP_K = kvsim.DEFAULT_TOP_K
#: the largest upload, refused by Streamlit before any of it is held, so one file cannot take the
#: server's memory (the loader then checks every array's size from its header before reading it)
MAX_UPLOAD_MB = 200
#: the budget the policy cards measure at; the app opens there so the cards' story is on screen
APP_BUDGET = 256
#: the largest value any count control takes (the trace loader's own limit on steps)
MAX_VALUE = 16384
STORY_POLICIES = ("sliding_window", "streaming_llm", "h2o")
#: the per-step upper bound's line on the curve: not a policy, so not in the registry
UPPER_BOUND = "upper bound (offline reference)"
TABS = ("Kept positions", "Cumulative scores", "Choosing recent_window", "The trace", "Policy lab", "Claims",
        "Your model", "Proxy against truth")
#: the kept view's two modes: a panel per policy, or one panel of what the first two keep differently
KEPT_MODES = {"each": "a panel per policy", "difference": "difference of the first two"}
#: pixels across the kept images, shared among the panels of a row
KEPT_PIXELS = 1024


# --------------------------------------------------------------------------------------------
# the registry, read once per run: new policies and parameters appear in every control


def all_params() -> dict[str, int]:
    """Every tunable parameter of any registered policy, with its default: one control each."""
    return {name: p.default for name, p in all_tunables().items()}


def defaults() -> dict:
    return {
        "trace": CANONICAL,
        "policies": [p for p in STORY_POLICIES if p in kvsim.POLICIES],
        "budget": APP_BUDGET,
        **all_params(),
        "curve_policy": "h2o" if "h2o" in kvsim.POLICIES else next(iter(kvsim.POLICIES)),
        "kept_mode": "each",
        "bundle": next(iter(available_bundles()), None),
    }


def trace_names() -> list[str]:
    """What the trace selector offers: the shipped traces, then every layer of the shipped bundles
    (``gemma3-270m-heapq:L05``), so the model view can open a layer in the other views."""
    return available_traces() + bundle_traces()


@st.cache_resource
def bundle_traces() -> list[str]:
    return views.bundle_trace_names()


# --------------------------------------------------------------------------------------------
# state <-> URL


#: the link's keys that name one of a set: what they may be, and what the page says when they are not
CHOICES = {
    "trace": (lambda: trace_names(), "is not available here"),
    "bundle": (lambda: available_bundles(), "is not shipped here"),
    "kept_mode": (lambda: list(KEPT_MODES), f"is not one of {', '.join(KEPT_MODES)}"),
    "curve_policy": (lambda: [n for n in kvsim.POLICIES if "recent_window" in kvsim.policy_params(n)],
                     "has no recent_window"),
}


def read_link() -> list[str]:
    """Once per session, seed the controls from the URL. Returns a message per unusable value."""
    problems: list[str] = []
    qp = st.query_params
    for key, default in defaults().items():
        if key not in qp:
            st.session_state[key] = default
            continue
        raw = qp[key]
        if key in CHOICES:
            allowed, why = CHOICES[key]
            ok = raw in allowed()
            value = raw if ok else default
            if not ok:
                problems.append(f"{key} {raw!r} from the link {why}; showing {default}.")
        elif key == "policies":
            asked = [p for p in raw.split(",") if p]
            value = [p for p in asked if p in kvsim.POLICIES]
            unknown = sorted(set(asked) - set(value))
            if unknown:
                problems.append(f"unknown policies in the link ignored: {', '.join(unknown)}.")
        else:
            value = _parse_count(key, raw, default, problems)
        st.session_state[key] = value
    if "step" in qp:
        st.session_state["step"] = _parse_count("step", qp["step"], None, problems, low=1)
    if "lab_preset" in qp:  # the claims' links open the lab on the card's own vector
        if qp["lab_preset"] in lab.PRESETS:
            st.session_state["_lab_preset"] = qp["lab_preset"]
            lab_reset()
        else:
            problems.append(f"lab_preset {qp['lab_preset']!r} from the link is not one of {', '.join(lab.PRESETS)}.")
    if "tour" in qp:
        if qp["tour"] in tour.BY_KEY:
            apply_tour(qp["tour"])
        else:
            problems.append(f"tour step {qp['tour']!r} from the link does not exist; the steps are "
                            f"{', '.join(tour.BY_KEY)}.")
    return problems


def apply_tour(key: str) -> None:
    """Set the controls and the open view to a tour step's, and remember the step for its box."""
    step = tour.BY_KEY[key]
    for name, value in step.settings.items():
        if name == "policies":
            value = [p for p in value if p in kvsim.POLICIES]
        if name == "trace":
            if value not in trace_names():
                continue
            # the step is about this trace: an upload in use would replace it, so drop the upload
            st.session_state["_upload_gen"] = st.session_state.get("_upload_gen", 0) + 1
        st.session_state[name] = value
    st.session_state["view"] = step.view  # the tabs are bound to the URL's view; set through the state
    st.session_state["tour"] = key


def _parse_count(key: str, raw: str, default, problems: list[str], low: int = 0):
    try:
        value = int(raw)
    except ValueError:
        problems.append(f"{key}={raw!r} in the link is not a whole number; using {default}.")
        return default
    if not low <= value <= MAX_VALUE:
        problems.append(f"{key}={value} in the link is outside {low}..{MAX_VALUE}; using {default}.")
        return default
    return value


def write_link(keys: list[str]) -> None:
    """Mirror the controls into the URL, so the address bar is always a link to this view."""
    for key in keys:
        value = st.session_state.get(key)
        if value is None:
            if key in st.query_params:
                del st.query_params[key]
            continue
        text = ",".join(value) if isinstance(value, list) else str(value)
        if st.query_params.get(key) != text:
            st.query_params[key] = text


# --------------------------------------------------------------------------------------------
# cached work: a trace is hashed by its fingerprint (a digest of its data, computed once per trace),
# so every function takes the trace itself and equal data shares results across sessions

BY_TRACE = {kvsim.Trace: lambda trace: trace.fingerprint}


@st.cache_resource(max_entries=4, show_spinner="loading the trace")
def load_named_trace(spec: str) -> kvsim.Trace:
    return resolve_trace(spec)


@st.cache_resource(max_entries=2, show_spinner="reading the uploaded trace")
def load_uploaded_trace(digest: str, filename: str, _data: bytes) -> kvsim.Trace:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / (Path(filename).name or "upload.npz")
        path.write_bytes(_data)
        try:
            return kvsim.load_trace(path)
        except kvsim.TraceError as e:  # name the file as the user knows it, not our temp path
            raise kvsim.TraceError(str(e).replace(str(path), filename)) from None


@st.cache_resource(max_entries=24, show_spinner="replaying", hash_funcs=BY_TRACE)
def cached_replay(trace: kvsim.Trace, policy: str, budget: int, params: tuple, scores: bool = False):
    """One replay with its kept sets recorded, and its scores too with ``scores`` (the score view's:
    T x budget floats that the kept view never reads). Treated as read-only by every view."""
    return kvsim.replay(trace, policy, budget=budget, top_k=TOP_K, record_kept=True, record_scores=scores,
                        **dict(params))


def kept_history(trace: kvsim.Trace, policy: str, budget: int, params: tuple):
    """The replay's kept positions after each step, ``(T, budget)``: what the kept view's images,
    heavy-hitter fates and difference counts are all drawn from (no ``(T, T + 1)`` mask is built)."""
    return cached_replay(trace, policy, budget, params, False).kept_history


@st.cache_resource(max_entries=64, show_spinner=False, hash_funcs=BY_TRACE)
def cached_fates(trace: kvsim.Trace, policy: str, budget: int, params: tuple) -> list:
    """When the replay held and lost each heavy hitter of the trace (the kept view's notes)."""
    return figures.heavy_fates(kept_history(trace, policy, budget, params), cached_features(trace))


@st.cache_resource(max_entries=48, show_spinner="drawing the kept positions", hash_funcs=BY_TRACE)
def cached_layers(trace: kvsim.Trace, runs: tuple, budget: int, region: tuple, ages: int, size: int) -> dict:
    """One panel's pooled images (``runs``: one run, or two for the difference), encoded once."""
    kept = [kept_history(trace, name, budget, params) for name, params in runs]
    return figures.panel_layers(kept, figures.Region(*region), cached_features(trace).sinks, ages, size)


def kept_layers(trace: kvsim.Trace, runs: tuple, budget: int, region: tuple, ages: int, size: int,
                compare: bool) -> list[dict]:
    """Each kept panel's pooled images: one panel per run, or one for the first two's difference."""
    panels = [tuple(runs[:2])] if compare else [(r,) for r in runs]
    return [cached_layers(trace, panel, budget, region, ages, size) for panel in panels]


@st.cache_resource(max_entries=32, show_spinner=False, hash_funcs=BY_TRACE)
def cached_kept_figure(trace: kvsim.Trace, runs: tuple, budget: int, step: int, region: tuple, ages: int, size: int,
                       compare: bool):
    """The kept view's figure, built once per server for these settings: a new session, or a view
    opened again, sends it without rebuilding (read-only: Streamlit copies it to send it)."""
    layers = kept_layers(trace, runs, budget, region, ages, size, compare)
    fates = None if compare else [cached_fates(trace, n, budget, p) for n, p in runs]
    results = replays(trace, budget, list(runs))
    return figures.kept_heatmap(results, cached_features(trace), step=step, region=figures.Region(*region), size=size,
                                compare=compare, layers=layers, fates=fates)


@st.cache_resource(max_entries=4, show_spinner=False, hash_funcs=BY_TRACE)
def cached_features(trace: kvsim.Trace) -> figures.TraceFeatures:
    """The trace's features, held per server; a fresh server reads them from beside the trace's disk
    cache entry (a shipped or canonical trace) instead of measuring the attention again."""
    return figures.trace_features_cached(trace)


@st.cache_resource(max_entries=4, show_spinner=False, hash_funcs=BY_TRACE)
def cached_describe(trace: kvsim.Trace, band: int, sinks: int) -> dict:
    """The trace's statistics, held per server and, for a trace with a disk cache entry, on disk."""
    return describe_cached(trace, band=band, top_k=TOP_K, sinks=max(1, sinks))


@st.cache_resource(max_entries=4, show_spinner="drawing the attention matrix", hash_funcs=BY_TRACE)
def cached_trace_matrix(trace: kvsim.Trace):
    return figures.trace_matrix(trace, cached_features(trace))


@st.cache_resource(max_entries=8, show_spinner="computing the upper bound", hash_funcs=BY_TRACE)
def cached_upper_bound(trace: kvsim.Trace, budget: int) -> dict:
    return upper_bound_summary(trace, budget, TOP_K)


@st.cache_resource(max_entries=64, show_spinner=False, hash_funcs=BY_TRACE)
def cached_summary(trace: kvsim.Trace, policy: str, budget: int, params: tuple) -> dict:
    """One replay's summary, nothing recorded: what a line on the curve needs (a fraction of the
    memory and time of ``cached_replay``), shared by every session."""
    return kvsim.replay(trace, policy, budget=budget, top_k=TOP_K, **dict(params)).summary()


@st.cache_resource
def sweep_locks() -> dict:
    """A lock per sweep key: a session that asks for a sweep another is computing waits for it."""
    return {}


@st.cache_resource
def sweep_store() -> dict:
    """Sweeps by (trace, policy, budget, fixed params): a dict of recent_window -> row that grows as
    views ask for more windows. A plain dict rather than st.cache_data so that the progress bar is
    drawn by this run, never replayed from a cache."""
    return {}


def curve_points(budget: int) -> int:
    """Windows on a curve's even grid. A replay costs about the budget, so above 512 the grid is
    halved; the refinement around the peak (``sweep_coarse_to_fine``) still finds it exactly."""
    return 32 if budget <= 512 else 16


def sweep_curves(trace: kvsim.Trace, budget: int, wanted: dict[str, tuple[dict, tuple]]) -> dict[str, list[dict]]:
    """Each policy's curve over recent_window 1 .. budget - 1 (``wanted``: policy -> (fixed params,
    marks)): an even grid refined around the peak (found exactly), plus the marks (the default, the
    band, the current setting), each window replayed once per server however many sessions ask.
    (The policies are swept one after another: each sweep already keeps every core busy.)"""
    store, locks = sweep_store(), sweep_locks()
    out = {}
    for name, (fixed, marks) in wanted.items():
        key = (trace.fingerprint, name, budget, tuple(sorted(fixed.items())), TOP_K)
        lock = locks.setdefault(key, threading.Lock())  # one sweep per key, however many sessions ask at once
        held = lock.acquire(blocking=False)
        try:
            if not held:  # any Streamlit call may end the run (a rerun): the lock is released below, whatever happens
                with st.spinner(f"another session is replaying {name} over recent_window 1 .. {budget - 1}"):
                    held = lock.acquire()
            rows = store.get(key)
            if rows is None:
                bar = st.progress(0.0, text=f"replaying {name} over recent_window 1 .. {budget - 1}")
                found = kvsim.sim.simulate.sweep_coarse_to_fine(
                    trace, name, budget, "recent_window", 1, budget - 1, marks=marks, points=curve_points(budget),
                    top_k=TOP_K, progress=lambda f, bar=bar: bar.progress(min(1.0, f)), **fixed)
                bar.empty()
                while len(store) >= 64:
                    oldest = next(iter(store))
                    store.pop(oldest)
                    locks.pop(oldest, None)
                rows = store[key] = {r["recent_window"]: r for r in found}
            missing = [m for m in marks if 1 <= m <= budget - 1 and m not in rows]
            if missing:  # a mark the first sweep did not include (a new current setting): one replay each
                for r in kvsim.sweep(trace, name, budget, "recent_window", missing, top_k=TOP_K, **fixed):
                    rows[r["recent_window"]] = r
            out[name] = [rows[w] for w in sorted(rows)]
        finally:
            if held:
                lock.release()
    return out


@st.cache_resource
def optimal_jobs() -> dict:
    """Background solves of the exact optimum, by (trace, budget): a future each, shared by all
    sessions, so a slow solve never blocks a page and is done once per server."""
    return {}


def optimal_line(trace: kvsim.Trace, budget: int) -> tuple[dict | None, float]:
    """The optimum's summary when it is known (from the disk cache or a finished background solve),
    else ``(None, fraction solved)`` with the solve started in the background."""
    from kvsim.policies import optimal

    jobs = optimal_jobs()
    key = (trace.fingerprint, budget)
    with optimal_lock():  # sessions asking at once start one solve, not one each
        job = jobs.get(key)
        if job is None:
            if trace.steps < optimal.CACHE_MIN_STEPS or optimal.cached(trace, budget) is not None:
                job = None
            else:
                progress = [0.0]
                solve = optimal_pool().submit(optimal.optimal_schedule, trace, budget,
                                              progress=lambda f: progress.__setitem__(0, f))
                job = jobs[key] = (solve, progress)
    if job is None:
        return cached_summary(trace, "optimal", budget, ()), 1.0
    future, progress = job
    if not future.done():
        return None, progress[0]
    if future.exception() is not None:  # said on the page in one line, and tried again on the next redraw
        jobs.pop(key, None)
        raise ValueError(f"the exact optimum could not be solved: {' '.join(str(future.exception()).split())}")
    return cached_summary(trace, "optimal", budget, ()), 1.0


@st.cache_resource
def optimal_lock():
    return threading.Lock()


@st.cache_resource
def optimal_pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsim-optimal")


# --------------------------------------------------------------------------------------------
# controls


def params_for(name: str) -> dict[str, int]:
    return {k: int(st.session_state[k]) for k in kvsim.policy_params(name)}


def check(name: str, budget: int, params: dict, trace: kvsim.Trace) -> str | None:
    """The policy's own refusal of these settings (recent_window >= budget, ...), or None."""
    try:
        kvsim.make_policy(name, budget=budget, trace=trace, **params)
    except ValueError as e:
        return f"{name}: {e}"
    return None


def choose_trace() -> kvsim.Trace:
    """The trace selector and the uploader. While an upload is in use the selector names it; choosing
    a shipped trace there drops the upload. A refused upload says which trace is shown instead."""
    side = st.sidebar
    names = trace_names()
    if st.session_state.get("trace") not in names:
        st.session_state["trace"] = CANONICAL
    slot = side.empty()  # the selector, filled once the upload is read
    gen = st.session_state.setdefault("_upload_gen", 0)
    upload = side.file_uploader(
        "or upload a trace (.npz)", type=["npz"], key=f"upload_{gen}", max_upload_size=MAX_UPLOAD_MB,
        help=f"the interchange format: 'attention' (T+1, T+1) float, optional 'meta' JSON string; at most "
             f"{MAX_UPLOAD_MB} MB (a packed float16 trace of 8192 steps is about 70 MB)",
    )
    uploaded, label = None, None
    if upload is not None:
        data = upload.getvalue()
        digest = hashlib.sha256(data).hexdigest()[:16]
        try:
            uploaded = load_uploaded_trace(digest, upload.name, data)
            label = f"uploaded: {upload.name}"
        except kvsim.TraceError as e:
            st.error(f"{e}; showing {st.session_state['trace']} instead.")
    st.session_state["trace_pick"] = label if uploaded is not None else st.session_state["trace"]

    def picked() -> None:
        choice = st.session_state["trace_pick"]
        if choice in names:
            st.session_state["trace"] = choice
            if upload is not None:  # a new key empties the uploader: the shipped trace replaces the upload
                st.session_state["_upload_gen"] = gen + 1

    slot.selectbox(
        "trace", ([label] if uploaded is not None else []) + names, key="trace_pick", on_change=picked,
        help="canonical: the calibrated synthetic trace the cards measure on; BUNDLE:L05 is one layer of a recorded "
             "model (the view *Your model* tunes them all)",
    )
    if uploaded is not None:
        side.caption(f"using the uploaded file {upload.name} ({uploaded.steps} steps); links cannot carry it")
        return uploaded
    spec = st.session_state["trace"]
    try:
        return load_named_trace(spec)
    except kvsim.TraceError as e:
        st.error(f"{e}; showing {CANONICAL} instead")
        return load_named_trace(CANONICAL)


def stem(trace: kvsim.Trace) -> str:
    """The trace's name as a file-name prefix for downloads."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in trace.name) or "trace"


def sync_recent_window(source: str) -> None:
    st.session_state["recent_window"] = int(st.session_state[source])


def pick_from_curve() -> None:
    chosen = figures.selected_recent_window(st.session_state.get("curve"))
    if chosen is not None:
        st.session_state["recent_window"] = chosen


def controls(trace: kvsim.Trace) -> None:
    side = st.sidebar
    side.multiselect(
        "policies", list(kvsim.POLICIES), key="policies",
        help="every policy in kvsim's registry; each gets a panel in the views that apply to it",
    )
    side.number_input("budget", min_value=1, max_value=MAX_VALUE, step=1, key="budget",
                      help="positions the cache holds after each eviction")
    extra = {k: p for k, p in all_tunables().items() if k not in ("recent_window", "sinks")}
    side.number_input("recent_window", min_value=0, max_value=MAX_VALUE, step=1, key="recent_window",
                      help="h2o (and its relatives) never evict the newest recent_window positions")
    side.number_input("sinks", min_value=0, max_value=MAX_VALUE, step=1, key="sinks",
                      help="streaming_llm pins the first sinks positions forever")
    if extra:
        with side.expander("more policy parameters"):
            for k, param in extra.items():
                owners = ", ".join(n for n in kvsim.POLICIES if k in kvsim.policy_params(n))
                st.number_input(k, min_value=0, max_value=MAX_VALUE, step=1, key=k, help=f"{param.help} ({owners})")
    T = trace.steps
    step = st.session_state.get("step")
    st.session_state["step"] = T if step is None else min(max(1, int(step)), T)
    side.slider("step", min_value=1, max_value=T, key="step",
                help="the decode step the score view shows, drawn as a dashed line on the kept positions")


# --------------------------------------------------------------------------------------------
# the page


def main() -> None:
    st.set_page_config(page_title="kvsim: KV-cache eviction, step by step", layout="wide")
    if "_link_read" not in st.session_state:
        st.session_state["_link_problems"] = read_link()
        st.session_state["_link_read"] = True
    st.title("kvsim: what a KV cache keeps")
    st.caption(
        "Replay one attention trace through KV-cache eviction policies and see, step by step, which "
        "positions each keeps and how much of the model's attention that cache still holds."
    )
    for problem in st.session_state.pop("_link_problems", []):
        st.warning(problem)

    tour_box()
    st.sidebar.header("settings")
    trace = choose_trace()
    controls(trace)
    write_link(["trace", "policies", "budget", *all_params(), "step", "curve_policy", "kept_mode", "bundle", "tour"])

    budget = int(st.session_state["budget"])
    features = cached_features(trace)
    runs, problems = [], []
    for name in st.session_state["policies"]:
        params = params_for(name)
        problem = check(name, budget, params, trace)
        if problem:
            problems.append(problem)
        else:
            runs.append((name, tuple(sorted(params.items()))))
    for problem in problems:
        st.error(f"{problem}. Change the setting in the sidebar; this policy is left out until then.")

    tabs = st.tabs(list(TABS), key="view", bind="query-params")
    with tabs[0]:
        if tabs[0].open:
            kept_view(trace, budget, runs, features)
    with tabs[1]:
        if tabs[1].open:
            score_view(trace, budget, runs, features)
    with tabs[2]:
        if tabs[2].open:
            curve_view(trace, budget, features)
    with tabs[3]:
        if tabs[3].open:
            trace_view(trace, features)
    with tabs[4]:
        if tabs[4].open:
            lab_view()
    with tabs[5]:
        if tabs[5].open:
            claims_view(trace)
    with tabs[6]:
        if tabs[6].open:
            model_view(budget)
    with tabs[7]:
        if tabs[7].open:
            quality_view()


def tour_box() -> None:
    """The guided tour: a start button in the sidebar; while a step is open, its text and the way on."""
    side = st.sidebar
    key = st.session_state.get("tour")
    if key not in tour.BY_KEY:
        side.button("start the guided tour", on_click=apply_tour, args=(tour.TOUR[0].key,),
                    help="a few steps, each a link: sinks, heavy hitters, the recent window")
        return
    step = tour.BY_KEY[key]
    before, after = tour.neighbours(key)
    number = [s.key for s in tour.TOUR].index(key) + 1
    with st.container(border=True):
        st.markdown(f"**Guided tour, step {number} of {len(tour.TOUR)}: {step.title}** (view: *{step.view}*). "
                    f"{step.look}")
        cols = st.columns([1, 1, 1, 3])
        if before is not None:
            cols[0].button(f"← {before.title}", on_click=apply_tour, args=(before.key,), key="tour_back")
        if after is not None:
            cols[1].button(f"{after.title} →", on_click=apply_tour, args=(after.key,), key="tour_next")
        cols[2].button("leave the tour", on_click=lambda: st.session_state.update(tour=None), key="tour_leave")
        cols[3].caption(f"Link to this step, for a slide: add `?tour={key}` to the app's address.")


def replays(trace: kvsim.Trace, budget: int, runs: list, scores: bool = False):
    return [cached_replay(trace, name, budget, params, scores) for name, params in runs]


def html_button(label: str, fig, filename: str, key: str) -> None:
    st.download_button(
        label, data=lambda: fig.to_html(include_plotlyjs=True, full_html=True), file_name=filename,
        mime="text/html", key=key,
    )


def kept_view(trace: kvsim.Trace, budget: int, runs: list, features) -> None:
    if not runs:
        st.info("Choose at least one policy (with valid settings) in the sidebar.")
        return
    note = story.budget_note(trace.steps, budget)
    if note:
        st.warning(note)
    results = replays(trace, budget, runs)
    step = int(st.session_state["step"])
    info = cached_describe(trace, features.band, max(1, features.sinks))
    T = trace.steps
    top = st.columns([2, 3])
    with top[0]:
        st.session_state["kept_mode_choice"] = st.session_state["kept_mode"]
        st.radio(
            "show", list(KEPT_MODES), format_func=KEPT_MODES.get, key="kept_mode_choice", horizontal=True,
            on_change=lambda: st.session_state.update(kept_mode=st.session_state["kept_mode_choice"]),
            help="the difference colours what the first two chosen policies keep differently",
        )
    compare = st.session_state["kept_mode"] == "difference"
    if compare and len(runs) < 2:
        st.info("The difference needs two policies: choose a second one in the sidebar. Showing each policy instead.")
        compare = False
    with top[1]:
        with st.expander("zoom to single positions (re-drawn from the replay at full resolution)"):
            region = zoom_controls(T)
    windows = [int(dict(p).get("recent_window", 0)) for _, p in runs]
    ages = figures.age_span(features, windows, budget)
    cols = 1 if compare else min(len(runs), 3)
    size = KEPT_PIXELS // cols
    box = (region.p0, region.p1, region.t0, region.t1)
    layers = kept_layers(trace, tuple(runs), budget, box, ages, size, compare)
    st.markdown(
        "**Each panel is one policy's cache over the whole run.** Row *t* is what the cache holds after decode step "
        "*t*: dark is kept, mid-grey a block of positions where some are kept, white evicted, light grey not "
        f"generated yet. The picture is pooled to about the pixels on screen (blocks of "
        f"{layers[0]['block'][1]} positions x {layers[0]['block'][0]} steps here). For single positions, draw a box "
        "with the chart's **box select** tool (or set the ranges under *zoom*): that region is re-drawn from the "
        "replay, one pixel per position once it is narrow enough."
        if not compare else
        "**One panel: what the first two chosen policies keep differently**, pooled so that a single differing "
        "column stays visible. Drag a box to zoom (double-click to reset)."
    )
    fig = cached_kept_figure(trace, tuple(runs), budget, step, box, ages, size, compare)
    # a box drawn with the select tool re-draws that region from the replay, at full resolution
    # once it is narrow enough; the zoom tool (the default) only magnifies the pooled picture
    st.plotly_chart(fig, key="kept_chart", config={"scrollZoom": True}, on_select=lambda: zoom_to_box(T),
                    selection_mode="box")
    # what to look for, under the picture: each note quotes this trace, or says it lacks the feature
    sinks, band, heavy = st.columns(3)
    sinks.markdown(story.sink_text(features, info, difference=compare))
    band.markdown(story.band_text(features, info, ages))
    fates = {} if compare else {
        figures.policy_label(r): cached_fates(trace, n, budget, p) for r, (n, p) in zip(results, runs, strict=True)
    }
    heavy.markdown(story.heavy_text(features, fates))
    if compare:
        a, b = results[0], results[1]
        counts = cached_difference(trace, tuple(runs[:2]), budget)
        st.markdown(story.difference_text(a.policy, b.policy, a.retained_mass, b.retained_mass, counts))
    st.caption(f"The dashed line is the sidebar's **step** ({step}).")
    c1, c2 = st.columns(2)
    with c1:
        st.download_button(
            "per-step metrics (CSV)", data=lambda: figures.per_step_table(results).to_csv(index=False),
            file_name=f"{stem(trace)}-per-step.csv",
            mime="text/csv", key="csv_steps",
        )
    with c2:
        html_button("this figure (HTML)", fig, f"{stem(trace)}-kept.html", "html_kept")
    st.markdown(
        f"| policy | retained_mass | top_{TOP_K}_recall |\n| --- | ---: | ---: |\n"
        + "\n".join(f"| {figures.policy_label(r)} | {r.retained_mass:.4f} | {r.top_k_recall:.4f} |" for r in results)
    )


def zoom_to_box(T: int) -> None:
    """Set the zoom ranges to the box drawn on the kept chart (clipped to the run)."""
    region = figures.selected_region(st.session_state.get("kept_chart"), T)
    if region is not None:
        st.session_state["zoom_positions"] = (region.p0, region.p1)
        st.session_state["zoom_steps"] = (region.t0, region.t1)


def zoom_controls(T: int) -> figures.Region:
    """Two ranges: the positions and the steps the kept view draws. Below KEPT_PIXELS positions
    across, every position has its own pixel column."""
    st.caption(f"At most {KEPT_PIXELS} positions across (fewer with several panels) show each position on its "
               "own; wider regions are pooled.")
    for key, low in (("zoom_positions", 0), ("zoom_steps", 1)):  # a shorter trace than the last one
        a, b = st.session_state.get(key, (low, T))
        st.session_state[key] = (min(max(low, a), T), min(max(low, b), T))
    p = st.slider("positions", 0, T, key="zoom_positions")
    s = st.slider("steps", 1, T, key="zoom_steps")
    st.button("the whole run", key="zoom_reset",
              on_click=lambda: st.session_state.update(zoom_positions=(0, T), zoom_steps=(1, T)))
    return figures.Region(p[0], p[1], s[0], s[1]).clip(T)


@st.cache_resource(max_entries=8, show_spinner=False, hash_funcs=BY_TRACE)
def cached_difference(trace: kvsim.Trace, runs: tuple, budget: int) -> tuple[float, float]:
    (a, pa), (b, pb) = runs
    return figures.difference_counts(kept_history(trace, a, budget, pa), kept_history(trace, b, budget, pb))


def score_view(trace: kvsim.Trace, budget: int, runs: list, features) -> None:
    scoring = [(n, p) for n, p in runs if getattr(kvsim.POLICIES[n], "keeps_scores", False)]
    st.markdown(story.score_text(features, scoring[0][0] if scoring else "h2o"))
    if not scoring:
        names = ", ".join(n for n, c in kvsim.POLICIES.items() if getattr(c, "keeps_scores", False))
        st.info(f"None of the chosen policies keeps a score. Add one of: {names}.")
        return
    step = int(st.session_state["step"])
    for (name, _), result in zip(scoring, replays(trace, budget, scoring, scores=True), strict=True):
        fig = figures.score_distribution(result, step, features)
        st.plotly_chart(fig, key=f"score_{name}")
        html_button(f"{name} scores at step {step} (HTML)", fig, f"{stem(trace)}-{name}-scores-{step}.html", f"html_score_{name}")


def curve_view(trace: kvsim.Trace, budget: int, features) -> None:
    curve_policies = [n for n in kvsim.POLICIES if "recent_window" in kvsim.policy_params(n)]
    if not curve_policies:
        st.info("No registered policy takes a recent_window.")
        return
    if st.session_state.get("curve_policy") not in curve_policies:
        st.session_state["curve_policy"] = curve_policies[0]
    info = cached_describe(trace, features.band, max(1, features.sinks))
    text, chart = st.columns([1, 3])
    with text:
        # widget state is dropped while its tab is closed, so the lasting value lives under another key
        st.session_state["curve_policy_choice"] = st.session_state["curve_policy"]
        policy = st.selectbox(
            "policy the markers follow", curve_policies, key="curve_policy_choice",
            help="every policy with a recent_window is drawn; this one carries the markers and the notes",
            on_change=lambda: st.session_state.update(curve_policy=st.session_state["curve_policy_choice"]),
        )
        explain = st.empty()  # filled once the sweeps say what this trace does
        explain.markdown(story.window_text(policy, features.band, info["recent_share"], features.band_known))
        rw = int(st.session_state["recent_window"])
        if budget >= 2:
            st.session_state["rw_curve"] = min(max(1, rw), budget - 1)
            st.number_input(
                "recent_window", min_value=1, max_value=budget - 1, step=1, key="rw_curve",
                on_change=sync_recent_window, args=("rw_curve",),
            )
    if budget < 2:
        st.error(f"the curve needs a budget of at least 2 (recent_window runs from 1 to budget - 1); budget is {budget}.")
        return
    # the chosen policy first: it is the primary curve, the others are drawn beside it
    wanted = {}
    for name in [policy] + [n for n in curve_policies if n != policy]:
        fixed = {k: v for k, v in params_for(name).items() if k != "recent_window"}
        problem = check(name, budget, {"recent_window": 1, **fixed}, trace)
        if problem:
            st.error(f"{problem}. Change the setting in the sidebar to draw {name}'s curve.")
            continue
        wanted[name] = (fixed, (kvsim.policy_params(name)["recent_window"], features.band, rw))
    curves = sweep_curves(trace, budget, wanted)
    if policy not in curves:
        return
    rows = curves[policy]
    lines = reference_lines(trace, budget)
    if not 1 <= rw <= budget - 1:
        st.error(f"recent_window {rw} is outside 1..{budget - 1} (it must be below the budget); no point is marked.")
    explain.markdown(
        story.window_text(policy, features.band, info["recent_share"], features.band_known)
        + "\n\n" + story.curve_verdict(rows, features.band, features.band_known)
        + f"\n\nEach point of a curve is a full replay at budget {budget}: about {curve_points(budget)} windows evenly "
        "spaced, every window next to the peak, and the marked ones (with fewer than "
        f"{curve_points(budget)} windows in all, every one). The markers and notes follow {policy}. **Click a point** (or "
        "use the box below) to set recent_window everywhere."
    )
    fig = curve_figure(curves, policy, tuple(lines), rw, features)
    with chart:
        st.plotly_chart(fig, key="curve", on_select=pick_from_curve, selection_mode=("points", "box"))
        st.markdown(story.lines_story(policy, curves, lines, budget))
        c1, c2 = st.columns(2)
        with c1:
            st.download_button(
                f"sweep of {', '.join(curves)} (CSV)", data=lambda: figures.sweep_table(curves, top_k=TOP_K).to_csv(index=False),
                file_name=f"{stem(trace)}-budget{budget}-recent_window-sweep.csv", mime="text/csv", key="csv_sweep",
            )
        with c2:
            html_button("this figure (HTML)", fig, f"{stem(trace)}-budget{budget}-curve.html", "html_curve")


@st.cache_resource
def curve_figures() -> dict:
    """Built curve figures by what they draw, shared by every session: under load the figure's
    Plotly validation, not the sweep, was most of a redraw."""
    return {}


def curve_figure(curves: dict[str, list[dict]], policy: str, lines: tuple, rw: int, features):
    """The recent_window chart of these curves and lines, built once per server for what it draws
    (read-only: Streamlit copies a figure to send it)."""
    default = kvsim.policy_params(policy)["recent_window"]
    key = (policy, rw, default, features.band, features.band_known, lines,
           tuple((n, tuple(tuple(sorted(r.items())) for r in rows)) for n, rows in curves.items()))  # flat rows
    store = curve_figures()
    fig = store.get(key)
    if fig is None:
        fig = figures.recent_window_curve(
            curves[policy], list(lines), current=rw, default=default, band=features.band, top_k=TOP_K, policy=policy,
            band_known=features.band_known, companions={n: r for n, r in curves.items() if n != policy},
        )
        while len(store) >= 32:
            store.pop(next(iter(store)))
        store[key] = fig
    return fig


def reference_lines(trace: kvsim.Trace, budget: int) -> list[figures.Line]:
    """The curve's horizontal lines: every registered policy without a recent_window (the ones that
    read the trace as offline references), plus the per-step upper bound. The exact optimum is
    solved in the background where that is slow; until it is known the page says so."""
    lines = []
    for name, cls in kvsim.POLICIES.items():
        if "recent_window" in kvsim.policy_params(name):
            continue
        params = params_for(name)
        problem = check(name, budget, params, trace)
        if problem:
            st.error(f"{problem}; its reference line is left out.")
            continue
        inner = ", ".join(f"{k}={v}" for k, v in params.items())
        label = f"{name} ({inner})" if inner else name
        if name == "optimal":
            try:
                summary, done = optimal_line(trace, budget)
            except (ValueError, MemoryError) as e:
                st.error(f"{e}; its line is left out.")
                continue
            if summary is None:
                st.info(f"The exact optimum at budget {budget} is being solved in the background ({done:.0%} done); "
                        "its line appears on the next redraw once it is known.")
                continue
        else:
            summary = cached_summary(trace, name, budget, tuple(sorted(params.items())))
        if cls.needs_trace:
            lines.append(figures.Line.of(summary, f"{label} (offline reference)", "offline", name, note=describe_policy(cls)))
        else:
            lines.append(figures.Line.of(summary, label, "policy", name))
    lines.append(figures.Line.of(cached_upper_bound(trace, budget), UPPER_BOUND, "bound"))
    return lines


def trace_view(trace: kvsim.Trace, features) -> None:
    info = cached_describe(trace, features.band, max(1, features.sinks))
    chart, text = st.columns([3, 1])
    with chart:
        fig = cached_trace_matrix(trace)
        st.plotly_chart(fig, key="trace_chart")
        html_button("this figure (HTML)", fig, f"{stem(trace)}-attention.html", "html_trace")
    with text:
        st.markdown(story.trace_text(features, info))
        st.dataframe(
            {
                "figure": [
                    "decode steps",
                    "share on position 0" if info["sinks"] == 1 else f"share on the sinks (positions 0-{info['sinks'] - 1})",
                    f"share on the newest {info['band']} positions",
                    f"share on each row's top {info['top_k']}",
                    "effective positions per row",
                ],
                "value": [
                    f"{info['steps']}",
                    _fmt(info["sink_share"]),
                    _fmt(info["recent_share"]),
                    _fmt(info["top_k_share"]),
                    _fmt(info["effective_positions"], ".1f"),
                ],
            },
            hide_index=True,
        )
        st.caption(
            "Shares are means over rows. Effective positions is exp(entropy) of a row: how many positions "
            "its attention spreads over (uniform over n gives n)."
        )
        name = trace.meta.get("name", trace.name) if isinstance(trace.meta, dict) else trace.name
        st.caption(f"trace: {name}. Sinks: {features.sink_source}. Band: {features.band_source}. "
                   f"Heavy hitters: {features.heavy_source}.")


def _fmt(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def lasting(widget, label: str, key: str, default, then=None, **kw):
    """A widget whose value outlives its tab being closed (Streamlit drops closed widgets' state)."""
    store = "_" + key
    st.session_state.setdefault(store, default)
    st.session_state[key] = st.session_state[store]

    def keep():
        st.session_state[store] = st.session_state[key]
        if then is not None:
            then()

    return widget(label, key=key, on_change=keep, **kw)


def lab_reset() -> None:
    """A new preset brings its own budget, policies and recent windows."""
    p = lab.PRESETS[st.session_state["_lab_preset"]]
    st.session_state["_lab_budget"] = p.budget
    for side, spec in (("left", p.left), ("right", p.right)):
        st.session_state[f"_lab_{side}"] = spec.name
        st.session_state[f"_lab_{side}_rw"] = spec.params.get("recent_window", 0)
    st.session_state.pop("_lab_step", None)  # the view opens at the first step where they differ


def lab_policy(side: str, preset: lab.Preset) -> lab.PolicySpec:
    spec = preset.left if side == "left" else preset.right
    name = lasting(st.selectbox, f"{side} policy", f"lab_{side}", spec.name, options=list(kvsim.POLICIES))
    params = dict(spec.params) if name == spec.name else {}
    if "recent_window" in kvsim.policy_params(name):
        params["recent_window"] = int(lasting(st.number_input, "recent_window", f"lab_{side}_rw",
                                              spec.params.get("recent_window", 0), min_value=0, step=1))
    return lab.PolicySpec(name, params)


def lab_view() -> None:
    st.markdown(
        "**Two policies, one tiny trace, one step at a time.** The bars are what the query at this step "
        "wants, its attention over every earlier position; their colour is what each policy did with that "
        "position. Numbers above the bars are the policy's scores (h2o: attention summed; scissorhands: votes)."
    )
    names = list(lab.PRESETS)
    top = st.columns([3, 1])
    with top[0]:
        preset = lab.PRESETS[lasting(st.selectbox, "preset", "lab_preset", names[0], then=lab_reset, options=names)]
    with top[1]:
        budget = int(lasting(st.number_input, "lab budget", "lab_budget", preset.budget, min_value=1, step=1))
    st.info(preset.watch)
    with st.expander("edit the trace (row t: the attention of step t over positions 0 .. t-1; rows are normalised)"):
        table = st.data_editor(lab.preset_table(preset.trace()), key=f"lab_table_{preset.title}")
    try:
        trace = lab.trace_from_table(table, name=preset.title)
    except kvsim.TraceError as e:
        st.error(str(e))
        return
    sides = st.columns(2)
    specs = []
    for col, side in zip(sides, ("left", "right"), strict=True):
        with col:
            specs.append(lab_policy(side, preset))
    try:
        steps = lab.side_by_side(trace, specs[0], specs[1], budget)
    except ValueError as e:
        st.error(f"{e}. Change the setting above.")
        return
    st.session_state["_lab_step"] = min(int(st.session_state.get("_lab_step", lab.first_divergence(steps))), len(steps))
    t = int(lasting(st.slider, "lab step", "lab_step", 1, min_value=1, max_value=len(steps)))
    for i, col in enumerate(st.columns(2)):
        with col:
            st.plotly_chart(lab.step_figure(steps[t - 1], i), key=f"lab_step_{i}")
            st.plotly_chart(lab.timeline_figure(steps, i, current=t), key=f"lab_timeline_{i}")
            # one table per side, under its own figures: the two side by side fit their columns
            st.dataframe(lab.step_table(steps[t - 1], side=i), hide_index=True, width="stretch")



# --------------------------------------------------------------------------------------------
# the claims ledger: every checkable claim of the two cards, measured on the trace on screen


@st.cache_resource(max_entries=4, show_spinner="measuring every claim of the two cards on this trace",
                   hash_funcs=BY_TRACE)
def cached_ledger(trace: kvsim.Trace) -> list[dict]:
    return ledger(trace)


def claims_view(trace: kvsim.Trace) -> None:
    records = cached_ledger(trace)
    counts = ", ".join(f"{views.VERDICT_MARKS[v]} {sum(r['verdict'] == v for r in records)} {v}" for v in VERDICTS)
    st.markdown(
        f"**Every checkable claim of the h2o and sliding_window cards, measured on {trace.name}** at budget "
        f"{CLAIMS_BUDGET}: {counts}. Each quotes the card's words, says what is measured and how that decides it, "
        "and links to the view and settings that show it (`python -m kvsim claims` prints the same ledger)."
    )
    present = [v for v in VERDICTS if any(r["verdict"] == v for r in records)]
    shown = st.multiselect("show the claims whose verdict is", present, default=present, key="claims_verdicts")
    upload = st.session_state.get("trace_pick", "") != st.session_state.get("trace")
    spec = None if upload else st.session_state.get("trace")
    if upload:
        st.caption("The links open the views on the shipped trace they name: an upload cannot travel in a link.")
    for r in records:
        if r["verdict"] not in shown:
            continue
        with st.container(border=True):
            colour = views.VERDICT_COLOURS[r["verdict"]]
            st.markdown(f":{colour}[{views.VERDICT_MARKS[r['verdict']]} **{r['verdict']}**] · `{r['id']}` · "
                        f"the {r['card']} card · scope: {r['scope']}")
            st.markdown(f"> {r['words']}")
            st.markdown(f"**Measured:** {r['measurement']}")
            if r["figures"]:
                st.markdown("**Figures:** " + "; ".join(f"`{k}` = {v}" for k, v in r["figures"].items()))
            if r["note"]:
                st.caption(r["note"])
            link = views.claim_link(r["view"], spec)
            st.markdown(f"[open the view “{r['view']['view']}” with the settings that show it]({link})")


# --------------------------------------------------------------------------------------------
# your model: recent_window tuned per layer of a recorded model (a bundle)


@st.cache_resource(max_entries=4, show_spinner="reading the bundle")
def cached_bundle(name: str):
    return resolve_bundle(name)


@st.cache_resource
def tune_store() -> dict:
    """Tunings by (bundle, policy, budget): a plain dict so the progress bar is drawn by the run that
    computes one, never replayed from a cache; shared by every session."""
    return {}


def tuned(name: str, policy: str, budget: int):
    store = tune_store()
    key = (name, policy, budget, TOP_K)
    if key not in store:
        bundle = cached_bundle(name)
        bar = st.progress(0.0, text=f"tuning {policy}'s recent_window (1 .. {budget - 1}) on {bundle.describe()}")
        result = tune(bundle, policy, budget, top_k=TOP_K,
                      progress=lambda done, total, label: bar.progress(done / total, text=f"tuned {label} ({done} of {total})"))
        bar.empty()
        if len(store) >= 16:
            store.pop(next(iter(store)))
        store[key] = result
    return store[key]


def open_layer(selector: str, recent_window: int, policy: str) -> None:
    """Open one layer's trace in the kept-position views, with the window recommended for it."""
    st.session_state["_upload_gen"] = st.session_state.get("_upload_gen", 0) + 1  # an upload would replace it
    st.session_state.update(trace=selector, recent_window=recent_window, curve_policy=policy, view=TABS[0])
    if policy not in st.session_state["policies"]:
        st.session_state["policies"] = [*st.session_state["policies"], policy]


def model_view(budget: int) -> None:
    names = available_bundles()
    if not names:
        st.info("No recorded model is shipped here. Record one with `python -m kvsim record` "
                "(needs requirements-record.txt), into traces/<name>/.")
        return
    curve_policies = [n for n in kvsim.POLICIES if "recent_window" in kvsim.policy_params(n)]
    top = st.columns([2, 2, 3])
    with top[0]:
        if st.session_state.get("bundle") not in names:
            st.session_state["bundle"] = names[0]
        st.session_state["bundle_choice"] = st.session_state["bundle"]
        name = st.selectbox("recorded model (bundle)", names, key="bundle_choice",
                            on_change=lambda: st.session_state.update(bundle=st.session_state["bundle_choice"]))
    with top[1]:
        if st.session_state.get("curve_policy") not in curve_policies:
            st.session_state["curve_policy"] = curve_policies[0]
        st.session_state["model_policy"] = st.session_state["curve_policy"]
        policy = st.selectbox("policy (one with a recent_window)", curve_policies, key="model_policy",
                              on_change=lambda: st.session_state.update(curve_policy=st.session_state["model_policy"]))
    bundle = cached_bundle(name)
    with top[2]:
        st.markdown(f"**{bundle.model}**, {bundle.describe()}. Budget {budget} (the sidebar's): every layer's cache "
                    f"holds {budget} positions.")
    if budget < 2:
        st.error(f"tuning needs a budget of at least 2 (recent_window runs from 1 to budget - 1); budget is {budget}.")
        return
    result = tuned(name, policy, budget)
    one = len(result.traces) == len(bundle.layers)
    wide = result.model_wide()
    st.markdown(
        f"**Where should each layer's recent window be?** Each row is one layer's replay of {policy} at every "
        f"recent_window from 1 to {budget - 1}; colour is retained mass. The circle is the layer's *recommended* "
        f"window, the smallest within {result.tolerance} of its best (the cross): past it the curve is flat, and a "
        f"smaller window leaves more of the cache to the heavy hitters. One window for all layers: "
        f"**{wide['one_window']['recommended_window']}**. **Click a layer's circle or cross** (or choose the layer below) for its curve."
    )
    fig = model_figures.tune_heatmap(result)
    st.plotly_chart(fig, key="tune_chart", on_select=lambda: pick_layer(result), selection_mode="points")
    labels = {(t.layer, t.head): views.trace_selector(name, t.layer, t.head, one).split(":")[1] for t in result.traces}
    rows = list(labels)
    if tuple(st.session_state.get("model_layer") or ()) not in labels:
        st.session_state["model_layer"] = rows[0]
    st.session_state["model_layer_choice"] = tuple(st.session_state["model_layer"])
    left, right = st.columns([1, 3])
    with left:
        layer, head = st.selectbox(
            "layer", rows, key="model_layer_choice", format_func=labels.get,
            on_change=lambda: st.session_state.update(model_layer=st.session_state["model_layer_choice"]))
        t = next(x for x in result.traces if (x.layer, x.head) == (layer, head))
        st.markdown(f"**{labels[(layer, head)]}** ({t.attention} attention): recommended recent_window "
                    f"**{t.recommended_window}** (retained mass {t.recommended_mass:.4f}); best {t.best_window} "
                    f"({t.best_mass:.4f}). " + ", ".join(f"{p} {m:.4f}" for p, (m, _r) in t.baselines.items())
                    + " at the same budget.")
        selector = views.trace_selector(name, layer, head, one)
        st.button(f"open {labels[(layer, head)]} in the kept-position views", key="open_layer", on_click=open_layer,
                  args=(selector, t.recommended_window, policy),
                  help=f"sets the trace to {selector} and recent_window to {t.recommended_window}")
    with right:
        st.plotly_chart(model_figures.tune_curve(result, layer, head), key="tune_curve")
    st.dataframe(
        {"layer": [labels[(x.layer, x.head)] for x in result.traces],
         "attention": [x.attention for x in result.traces],
         "recommended recent_window": [x.recommended_window for x in result.traces],
         "retained mass there": [round(x.recommended_mass, 4) for x in result.traces],
         "best recent_window": [x.best_window for x in result.traces],
         "best retained mass": [round(x.best_mass, 4) for x in result.traces]},
        hide_index=True, key="tune_table", height=35 * (len(result.traces) + 1) + 3,
    )
    st.caption(f"Computed once per server ({result.run.get('seconds', 0):.0f} s). The same from the command line: "
               f"`python -m kvsim tune --trace {name} --policy {policy} --budget {budget} --serial`.")


def pick_layer(result) -> None:
    chosen = views.selected_row(st.session_state.get("tune_chart"), result)
    if chosen is not None:
        st.session_state["model_layer"] = chosen


# --------------------------------------------------------------------------------------------
# proxy against truth: what the model loses beside what the simulator measures


def quality_view() -> None:
    st.markdown(
        "**Is retained mass a good proxy for what the model loses?** For a recording that carries its text (the "
        "shipped Gemma-3-270M bundle over CPython's heapq.py), `python -m kvsim quality` runs the model itself with "
        "every layer's cache evicted by a policy and measures the change in its next-token loss (delta NLL, nats per "
        "token) and how far its next-token distribution moves (KL), beside the simulator's retained mass. "
        "*closed*: decoding with the evicted cache (the truth); *open*: the simulator's schedule replayed as masks."
    )
    try:
        found = views.quality_results()
    except views.QualityResultsError as e:
        st.error(f"{e}. Produce it again with the command below.")
        found = None
    source = f"`{views.QUALITY_RESULTS.name}` (shipped)"
    if found is None:
        cached = views.cached_quality_results()
        if cached:
            found, source = (cached, {}), "the quality disk cache"
    if found is None:
        st.info(
            "No quality results here yet. They need a real model run (torch and transformers: "
            "`pip install -r requirements-record.txt`; a few minutes on two cores). Produce them with\n\n"
            f"`{views.QUALITY_COMMAND}`\n\nand save the printed JSON as `traces/{views.QUALITY_RESULTS.name}` "
            "(or leave them in the disk cache, which this view also reads)."
        )
        return
    results, meta = found
    rhos = views.rank_correlations(results)
    cols = st.columns(max(1, len(rhos)))
    for col, (mode, (rho, n)) in zip(cols, rhos.items(), strict=False):
        col.metric(f"Spearman rank correlation, {mode} ({n} points)", views.rho_text(rho),
                   help="of delta NLL against retained mass across policies and windows: -1 means more mass "
                        "kept is always less loss")
    st.plotly_chart(quality_figures.scatter_figure(results), key="quality_scatter")
    for policy in views.swept_policies(results):
        st.plotly_chart(quality_figures.curve_figure(results, policy=policy), key=f"quality_curve_{policy}")
    st.dataframe(
        {"policy": [r["policy"] for r in results], "params": [", ".join(f"{k}={v}" for k, v in r["params"].items())
                                                              for r in results],
         "budget": [r["budget"] for r in results], "mode": [r["mode"] for r in results],
         "delta NLL": [round(r["delta_nll"], 4) for r in results], "KL": [round(r["kl"], 4) for r in results],
         "retained mass": [round(r["retained_mass"], 4) for r in results]},
        hide_index=True, key="quality_table",
    )
    command = meta.get("command") if isinstance(meta, dict) else None
    st.caption(f"From {source}, {results[0]['steps']} steps" + (f"; produced by `{command}`" if command else "") + ".")


main()

"""The page's state: the session's defaults, the URL's query parameters read once per session and
written back every run (so the address bar is always a link to this view), the guided tour's steps
applied to the controls, and which trace is on screen (a shipped one, or an upload).
"""

from __future__ import annotations

import hashlib

import streamlit as st

import kvsim
from kvsim.analysis import lab
from kvsim.analysis.metrics import repair_note
from kvsim.data import qk, vectors
from kvsim.data.catalog import CANONICAL, available_bundles, available_traces
from kvsim.policies import all_tunables
from kvsim.policykit import registry
from kvsim.policykit.base import WINDOW
from kvsim.views import tour

from . import memo

#: the largest upload, refused by Streamlit before any of it is held, so one file cannot take the
#: server's memory (the loader then checks every array's size from its header before reading it)
MAX_UPLOAD_MB = 200
#: the budget the policy cards measure at; the app opens there so the cards' story is on screen
APP_BUDGET = 256
#: the largest value any count control takes (the trace loader's own limit on steps)
MAX_VALUE = 16384
STORY_POLICIES = ("sliding_window", "streaming_llm", "h2o")
TABS = ("Kept positions", "Cumulative scores", "Choosing recent_window", "The trace", "Policy lab", "Claims",
        "Your model", "Proxy against truth", "Pass key", "Allocation")
#: the kept view's two modes: a panel per policy, or one panel of what the first two keep differently
KEPT_MODES = {"each": "a panel per policy", "difference": "difference of the first two"}
#: the serving layout's controls (``layout_control``) and their values for none: the link states them only when set
LAYOUT_KEYS = {"block_size": 1, "shared_selection": False, "evict_every": 1}
#: the block sizes the layout control offers (1: none; vLLM's page is 16)
BLOCK_SIZES = (1, 8, 16, 32)
#: the settings that belong to one trace: the kept view's zoom into its positions and steps
ZOOM_KEYS = ("zoom_positions", "zoom_steps")


def all_params() -> dict[str, int]:
    """Every tunable parameter of any registered policy, with its default: one control each."""
    return {name: p.default for name, p in all_tunables().items()}


def curve_policies(trace: kvsim.Trace | None = None) -> list[str]:
    """The registered policies with a recent_window: the ones the curve and the model view sweep; with
    ``trace``, those it can replay (a scorer reading values the trace lacks is left out); without, those
    that read attention alone (a recorded bundle's traces carry nothing more)."""
    names = registry.windowed()
    if trace is None:
        return [n for n in names if not kvsim.POLICIES[n].reads]
    return [n for n in names if not vectors.missing(trace, kvsim.POLICIES[n].reads, registry.reads_meta(n))]


def defaults() -> dict:
    return {
        "trace": CANONICAL,
        "policies": [p for p in STORY_POLICIES if p in kvsim.POLICIES],
        "budget": APP_BUDGET,
        **all_params(),
        "curve_policy": "h2o" if "h2o" in kvsim.POLICIES else next(iter(kvsim.POLICIES)),
        "kept_mode": "each",
        "bundle": next(iter(available_bundles()), None),
        **LAYOUT_KEYS,
    }


def trace_names() -> list[str]:
    """What the trace selector offers: the shipped traces, then every layer of the shipped bundles
    (``gemma3-270m-heapq:L05``), so the model view can open a layer in the other views."""
    return available_traces() + memo.bundle_traces()


# --------------------------------------------------------------------------------------------
# state <-> URL


#: the link's keys that name one of a set: what they may be, and what the page says when they are not
CHOICES = {
    "trace": (trace_names, "is not available here"),
    "bundle": (available_bundles, "is not shipped here"),
    "kept_mode": (lambda: list(KEPT_MODES), f"is not one of {', '.join(KEPT_MODES)}"),
    "curve_policy": (curve_policies, "has no recent_window"),
}
#: the link's yes-or-no keys and the words they take
FLAGS = {"1": True, "true": True, "0": False, "false": False}


def read_link() -> list[str]:
    """Once per session, seed the controls from the URL. Returns a message per unusable value."""
    problems: list[str] = []
    qp = st.query_params
    for key, default in defaults().items():
        st.session_state[key] = default if key not in qp else _from_link(key, qp[key], default, problems)
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


def _from_link(key: str, raw: str, default, problems: list[str]):
    """The value the link gives ``key``, or ``default`` with a problem said."""
    if key in CHOICES:
        allowed, why = CHOICES[key]
        if raw in allowed():
            return raw
        problems.append(f"{key} {raw!r} from the link {why}; showing {default}.")
        return default
    if key == "block_size":
        value = _parse_count(key, raw, default, problems, low=1)
        if value in BLOCK_SIZES:
            return value
        problems.append(f"block_size {value} from the link is not one of {', '.join(map(str, BLOCK_SIZES))}; showing "
                        f"{default}.")
        return default
    if key == "shared_selection":
        if raw.lower() in FLAGS:
            return FLAGS[raw.lower()]
        problems.append(f"shared_selection={raw!r} in the link is not 1 or 0; using {int(default)}.")
        return default
    if key == "evict_every":
        return _parse_count(key, raw, default, problems, low=1)
    if key == "policies":
        asked = [p for p in raw.split(",") if p]
        value = [p for p in asked if p in kvsim.POLICIES]
        unknown = sorted(set(asked) - set(value))
        if unknown:
            problems.append(f"unknown policies in the link ignored: {', '.join(unknown)}.")
        return value
    return _parse_count(key, raw, default, problems)


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


def write_link() -> None:
    """Mirror the controls into the URL, so the address bar is always a link to this view. The changed
    parameters go in one ``update`` (one message to the browser): set one by one, a new session's first run
    sent the browser 13 address changes (issue 56 item 3)."""
    changed: dict[str, str] = {}
    for key in ("trace", "policies", "budget", *all_params(), "step", "curve_policy", "kept_mode", "bundle", "tour"):
        value = st.session_state.get(key)
        if value is None:
            if key in st.query_params:
                del st.query_params[key]
            continue
        text = ",".join(value) if isinstance(value, list) else str(value)
        if st.query_params.get(key) != text:
            changed[key] = text
    for key, none in LAYOUT_KEYS.items():  # only when set: a link of no layout is as before
        value = st.session_state.get(key, none)
        if value == none:
            if key in st.query_params:
                del st.query_params[key]
        elif st.query_params.get(key) != (text := str(int(value))):
            changed[key] = text
    if changed:
        st.query_params.update(changed)


def apply_tour(key: str) -> None:
    """Set the controls and the open view to a tour step's, and remember the step for its box."""
    step = tour.BY_KEY[key]
    for name, value in step.settings.items():
        if name == "policies":
            value = [p for p in value if p in kvsim.POLICIES]
        if name == "trace":
            if value not in trace_names():
                continue
            drop_upload()  # the step is about this trace: an upload in use would replace it
        st.session_state[name] = value
    for name in ZOOM_KEYS:  # a slide shows the whole run
        st.session_state.pop(name, None)
    st.session_state.update(LAYOUT_KEYS)  # the tour tells of the policies as they are, in no serving layout
    if "step" in step.settings:
        st.session_state["_step_given"] = True  # the step is the tour's, whatever trace was on screen before
    st.session_state["view"] = step.view  # the tabs are bound to the URL's view; set through the state
    st.session_state["tour"] = key


def follow_trace(trace: kvsim.Trace) -> bool:
    """When the trace on screen is another one than the last run's (another shipped trace, an upload,
    a refused upload's fallback), the settings that belong to a trace start again on the new one: the
    zoom is the whole run and the step its last, unless the change brought its own step (a tour step).
    Returns True when the trace changed."""
    seen = st.session_state.get("_trace_seen")
    given = st.session_state.pop("_step_given", False)
    st.session_state["_trace_seen"] = trace.fingerprint
    if seen is None or seen == trace.fingerprint:  # the first run keeps the link's step
        return False
    zoom_reset(trace.steps)
    if not given:
        st.session_state["step"] = trace.steps
    return True


def zoom_reset(T: int) -> None:
    """The kept view's zoom back to the whole run of ``T`` steps."""
    st.session_state.update(zoom_positions=(0, T), zoom_steps=(1, T))


def touring() -> bool:
    """True while a tour step is open: the page is then laid out as a slide (its figure on screen)."""
    return st.session_state.get("tour") in tour.BY_KEY


def drop_upload() -> None:
    """Empty the uploader (a new key makes a new, empty one), so the chosen shipped trace is shown."""
    st.session_state["_upload_gen"] = st.session_state.get("_upload_gen", 0) + 1


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


def mirrored(widget, label: str, options: list, store: str, key: str, **kw):
    """A choice widget bound to the session's ``store`` value, which outlives the widget (a closed
    tab's widgets lose their state); a value no longer offered becomes the first option."""
    if st.session_state.get(store) not in options:
        st.session_state[store] = options[0]
    st.session_state[key] = st.session_state[store]
    return widget(label, options, key=key, on_change=lambda: st.session_state.update({store: st.session_state[key]}), **kw)


def lab_reset() -> None:
    """A new lab preset brings its own budget, policies and recent windows."""
    p = lab.PRESETS[st.session_state["_lab_preset"]]
    st.session_state["_lab_budget"] = p.budget
    for side, spec in (("left", p.left), ("right", p.right)):
        st.session_state[f"_lab_{side}"] = spec.name
        st.session_state[f"_lab_{side}_rw"] = spec.params.get(WINDOW, 0)
    for side in ("left", "right"):
        st.session_state.pop(f"_lab_{side}_rw_note", None)
    st.session_state.pop("_lab_step", None)  # the view opens at the first step where they differ


# --------------------------------------------------------------------------------------------
# the trace on screen


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
    uploaded = _read_upload(upload)
    label = f"uploaded: {upload.name}" if uploaded is not None else None
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
        repaired = repair_note(uploaded)
        if repaired:  # a file whose rows did not sum to 1 is used divided by their sums: say so, every view
            side.warning(f"{upload.name}: {repaired}")
        return uploaded
    try:
        trace = memo.load_named_trace(st.session_state["trace"])
    except kvsim.TraceError as e:
        st.error(f"{e}; showing {CANONICAL} instead")
        return memo.load_named_trace(CANONICAL)
    if trace.derived.no_matrix() is not None:
        memo.row_stats(trace)
        out = dense_only()
        left = (f" {' and '.join(out)} {'reads' if len(out) == 1 else 'read'} the whole matrix (at most {qk.DENSE_LIMIT} steps) "
                f"and {'is' if len(out) == 1 else 'are'} left out." if out else "")
        side.caption(f"{trace.steps} steps, stored as queries and keys: replays compute the weights they hold, the "
                     "picture and the statistics come from one pass over every row (kept on disk)." + left)
    return trace


def dense_only() -> list[str]:
    """The registered policies that read the whole attention matrix (``needs_matrix``: the exact
    optimum): left out on a trace too long to have it."""
    return [name for name, cls in kvsim.POLICIES.items() if cls.needs_matrix]


def _read_upload(upload) -> kvsim.Trace | None:
    """The uploaded trace, or None (none given, or refused: the page then says why in one line)."""
    if upload is None:
        return None
    data = upload.getvalue()
    try:
        return memo.load_uploaded_trace(hashlib.sha256(data).hexdigest()[:16], upload.name, data)
    except kvsim.TraceError as e:
        st.error(f"{e}; showing {st.session_state['trace']} instead.")
        return None


def showing_upload() -> bool:
    """True while the trace on screen is an upload (a link cannot carry it)."""
    return st.session_state.get("trace_pick", "") != st.session_state.get("trace")

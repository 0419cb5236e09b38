"""The truth under the recent_window curve: the model's KL over the windows, with both optima and the
sentence (``kvsim.views.window_truth``), where truth is known for the trace's recording; where it is not,
one line saying how to get it, and for a recording whose model and text are at hand a button that
measures it in the background (open loop, cached, with progress)."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import streamlit as st

import kvsim
from kvsim.analysis.windows import best_of, choose_window
from kvsim.cluster import INSTALL_HINT
from kvsim.data.catalog import available_bundles
from kvsim.policykit import registry
from kvsim.views import window_truth as vt

from .memo import BY_TRACE, cached_bundle, tuned  # tuned: the model view's tuning, cached per server

#: measurements running in this server's background: (model, text sha, policy, budget) -> state
_JOBS: dict[tuple, dict] = {}
_LOCK = threading.Lock()
#: candidate windows the background measurement takes (as ``tune --by kl``)
CANDIDATES = 16
#: the value-aware proxy drawn beside retained mass where the trace carries values
VALUE_PROXY = "attention-output error"


@st.cache_data(max_entries=16, show_spinner="the attention-output error at the truth's windows",
               hash_funcs=BY_TRACE)
def _output_error_pick(trace: kvsim.Trace, policy: str, budget: int, windows: tuple[int, ...],
                       values_key: str | None) -> int | None:
    """The window of ``windows`` with the least attention-output error on this trace (one replay per
    window, kept sets recorded), or None when it cannot be computed on the trace (``fallback_note``: no
    values, or no whole rows) or a window is refused. ``values_key`` (``_values_key``) keys the cache by
    the values too: a trace's fingerprint is of its attention only."""
    from kvsim.analysis import proxies as px

    if px.fallback_note(trace, "output_error") is not None:
        return None
    try:
        rows = px.sweep(trace, policy, budget, registry.window_param(policy), list(windows))
    except ValueError:
        return None
    return int(windows[best_of([r["output_error"] for r in rows], px.PROXIES["output_error"].sign)])


def _values_key(trace: kvsim.Trace) -> str | None:
    values = getattr(trace, "values", None)
    if values is None:
        return None
    return hashlib.blake2b(np.ascontiguousarray(values).data, digest_size=16).hexdigest()


def bundle_of(truth: vt.Truth) -> str | None:
    """The recorded model (bundle) the truth was measured on: the same model, text and steps."""
    who = (str(truth.meta.get("model")), str(truth.meta.get("text_sha256")))
    for name in available_bundles():
        manifest = cached_bundle(name).manifest
        if vt.recording(manifest) == who and manifest.get("steps") == truth.meta.get("steps"):
            return name
    return None


def model_answer(truth: vt.Truth) -> vt.ProxyPick | None:
    """The answer to "which one window for all layers does retained mass pick on the recording the truth
    was measured on?": the bundle's tuning (once per server, as the model view's) and its one window.
    Both views that state it read it here, so they give the same answer. None without the bundle."""
    name = bundle_of(truth)
    if name is None or truth.budget is None or truth.budget < 2:
        return None
    return vt.model_wide_pick(tuned(name, truth.policy, truth.budget), cached_bundle(name).steps)


def trace_label(trace: kvsim.Trace) -> str:
    """``L11`` for one layer's trace of a recording, else the trace's name."""
    layer = trace.meta.get("layer") if isinstance(trace.meta, dict) else None
    return f"L{int(layer):02d}" if isinstance(layer, int) else trace.name


TRUTH_HELP = ("KL(full || evicted) of the next-token distributions, averaged over the text's positions, with every "
              "layer's cache held to the budget by the policy at that recent_window (open loop: the simulator's schedule "
              "as masks on one pass)")


def truth_panel(trace: kvsim.Trace, policy: str, budget: int, rows: list[dict], exact: bool) -> None:
    """Below the curve: the truth beside the proxy, or why it is not there. Where the trace's recording
    has its bundle here, first the answer for one window for all layers (the model view's, from
    ``model_answer``), then this trace's own window's, each sentence naming what it compares."""
    choice = choose_window(rows, budget=budget, exact=exact)
    truth = vt.truth_for(trace.meta, policy, budget)
    if truth is not None:
        label = trace_label(trace)
        rule = None if choice.exact else "the peak of the windows sampled"
        own = vt.layer_pick(choice.recommended, label, trace.steps, choice.tolerance, rule=rule)
        wide = model_answer(truth)
        error = None
        if getattr(trace, "values", None) is not None:  # one replay per window with its kept sets: asked for, not run
            asked = f"_output_error_asked:{trace.fingerprint}:{policy}:{budget}"
            if st.session_state.get(asked) or st.button(
                    f"Add the attention-output error's pick ({len(truth.windows)} replays with their kept sets on "
                    f"{trace.steps} steps: a minute or more)", key="output_error_button"):
                st.session_state[asked] = True
                error = _output_error_pick(trace, policy, budget, truth.windows, _values_key(trace))
        value = (None if error is None else
                 vt.layer_pick(error, label, trace.steps, choice.tolerance, VALUE_PROXY, "the least error at the truth's windows"))
        picks = [p for p in (wide, own, value) if p is not None]
        st.plotly_chart(vt.truth_figure(truth, picks[0], others=picks[1:]), key="truth_curve")
        if wide is not None:
            st.markdown(vt.sentence(truth, wide) + " (The *Your model* view gives the same answer.)", help=TRUTH_HELP)
        st.markdown(vt.sentence(truth, own), help=TRUTH_HELP)
        if value is not None:
            st.markdown(vt.sentence(truth, value), help="The relative error of this layer's attention output, "
                        "the kept weights renormalised times the values, against the full cache's, averaged over the "
                        "steps (kvsim.analysis.proxies), at each window the truth was measured at: the value-aware proxy "
                        "docs/proxies.md finds best (over the deeper half of a model's layers)")
        elif getattr(trace, "values", None) is None:
            st.caption("This trace carries no values, so the value-aware proxies (docs/proxies.md) fall back to "
                       "retained mass; `kvsim record` stores them.")
        return
    who = vt.recording(trace.meta)
    if who is None:
        st.caption("No truth for this trace: it names no model and text to measure it with (the canonical trace "
                   "teaches the shapes; a recording made by `kvsim record` carries both).")
        return
    _offer(trace, policy, budget, who)


def _offer(trace: kvsim.Trace, policy: str, budget: int, who: tuple[str, str]) -> None:
    key = (*who, policy, budget)
    with _LOCK:
        job = _JOBS.get(key)
    if job is not None and job.get("error"):
        st.warning(f"The truth could not be measured: {job['error']}")
        return
    if job is not None and not job.get("done"):
        _watch(job)
        return
    if job is not None:  # done, yet truth_for found nothing: the document could not be written
        st.warning("The truth was measured, but its document could not be written to the disk cache (truth/).")
        return
    st.caption(f"No truth measured yet for {policy} at budget {budget} on this recording. "
               f"`python -m kvsim tune --trace BUNDLE --policy {policy} --budget {budget} --by kl` measures it "
               f"({CANDIDATES} windows, open loop, cached), or:")
    if st.button("measure the truth in the background", key="truth_measure"):
        _start(key, trace.meta, policy, budget)
        st.rerun()


def _watch(job: dict) -> None:
    """The background measurement's progress, redrawn every second; the page is drawn again when it ends."""

    @st.fragment(run_every=1.0)
    def watch() -> None:
        if job.get("done") or job.get("error"):
            st.rerun()
        st.progress(job.get("fraction", 0.0), text=f"Measuring the truth in the background: {job.get('note', '')}")

    watch()


def _start(key: tuple, meta: dict, policy: str, budget: int) -> None:
    state = {"fraction": 0.0, "note": "starting"}
    with _LOCK:
        if key in _JOBS and not _JOBS[key].get("error"):
            return
        _JOBS[key] = state

    def progress(fraction, note=""):
        if fraction is not None:
            state["fraction"] = max(0.0, min(1.0, float(fraction)))
        if note:
            state["note"] = note

    def work():
        try:
            from kvsim.analysis.proxies import configuration, even_windows
            from kvsim.models import quality, truth
            from kvsim.models.errors import RecordError

            try:
                model, text, steps = truth.recording_source(meta)
                session = quality.open_session(text, steps, model, progress=progress)
                truth.window_truth(session, policy, budget, even_windows(budget, CANDIDATES), proxies=configuration,
                                   progress=progress, recording=str(meta.get("model")))
            except (quality.QualityError, RecordError, ValueError, OSError) as e:
                state["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
                return
            state["done"] = True
        except ImportError as e:
            state["error"] = f"the truth needs the record extra ({INSTALL_HINT}): {e}"

    threading.Thread(target=work, daemon=True, name=f"kvsim-truth-{policy}-{budget}").start()


__all__ = ["bundle_of", "model_answer", "truth_panel"]

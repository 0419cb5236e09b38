"""The pass-key view: the accuracy grids ``kvsim needle`` saved (docs/needle.md), side by side with the
control's, and one trial's cache in one layer with the key's columns marked and each eviction's step.

A trial is the model's own cache, kept as each position's departure step, so its picture is drawn here
from those. With ``--attention`` the trial also kept the attention each step showed its policy (a
bundle, ``kvsim.models.needle_traces``), and a button opens that layer in the kept-positions view,
whose replay of the same policy keeps what the trial's cache kept (``needle_kept``).
"""

from __future__ import annotations

import json
from pathlib import Path

import streamlit as st

from kvsim.cluster import INSTALL_HINT
from kvsim.models import needle, needle_prompt
from kvsim.views.figures import needle as figures

from . import needle_kept
from .charts import selectable
from .needle_conversation_tab import conversation_view

COMMAND = ("python -m kvsim needle --policies streaming_llm,h2o --budget 64 --lengths 512,1024 "
           "--depths 0.1:0.9:0.4 --trials 2")


def needle_view() -> None:
    docs = {}
    for path in needle.saved_grids():
        try:
            docs[path] = needle.read_grid(path)
        except needle_prompt.NeedleError as e:
            st.warning(str(e))
    if not docs:  # a fresh install: the measured leaderboard, and how to add a grid of one's own
        board_view(docs)
        st.info("No pass-key grids of your own here yet; the leaderboard above is the one docs/needle.md measured. "
                f"Yours need a real model run (torch and transformers: `{INSTALL_HINT}`); "
                f"measure one with\n\n`{COMMAND}`\n\nand it joins the leaderboard, with each trial's cache drawn below "
                "it (it is kept in the cache directory, `kvsim cache list`: needle).")
        conversation_view()
        return
    path = st.selectbox("grid", list(docs), format_func=lambda p: _grid_name(docs[p]), key="needle_grid_file")
    doc = docs[path]
    _headline(doc, Path(path))
    event = st.plotly_chart(selectable(figures.needle_heatmaps(doc), "points"), key="needle_heatmaps", on_select="rerun",
                            selection_mode="points")
    _follow(event, doc)
    _trial(doc)
    board_view(docs)
    conversation_view()


@st.cache_resource(max_entries=16, show_spinner=False)
def board_figure(table: str):
    """A leaderboard table's figure (``table``: its JSON), built once per server (read-only: Streamlit
    copies a figure to send it), so a new session's Pass key tab does not build it again."""
    return figures.leaderboard_figure(json.loads(table))


def board_view(docs: dict) -> None:
    """The leaderboard: the tables docs/needle.md measured (shipped) and every grid saved here (``docs``,
    by path), one at a time, each labelled with its model, lengths, budgets, depths, trials and date."""
    from datetime import UTC, datetime

    from kvsim.views import leaderboard as lb

    st.subheader("Leaderboard: which policy still finds the key")
    try:
        tables = lb.shipped_tables()
    except lb.LeaderboardError as e:
        st.warning(str(e))
        tables = []
    for path, doc in docs.items():
        try:
            when = datetime.fromtimestamp(Path(path).stat().st_mtime, tz=UTC).strftime("%d %b %Y %H:%M UTC")
            tables.append(lb.from_grid(doc, Path(path).name, when))
        except (OSError, KeyError, TypeError, ValueError) as e:
            st.warning(f"{Path(path).name}: left out of the leaderboard ({' '.join(str(e).split())})")
    if not tables:
        st.info("No leaderboard here: this install has no traces/needle-leaderboard.json and no grid of its own.")
        return
    i = st.selectbox("table", range(len(tables)), key="needle_board",
                     format_func=lambda k: f"{tables[k]['title']} ({'shipped' if tables[k]['shipped'] else 'yours'})")
    table = tables[i]
    st.markdown(f"**{lb.label(table)}**, {table['origin']}. Each cell is one depth of the key in the prompt: *found* "
                "where the policy's cache still let the model write the key, *-* where it did not; the full cache (the "
                "control) comes first, and a policy's trial counts only where the control found the key.")
    st.plotly_chart(board_figure(json.dumps(table)), key="needle_board_chart")  # its rows in their order, not sorted
    if table.get("command"):
        st.caption(f"Measured with `{table['command']}`" + (f" (docs/needle.md, \"{table['section']}\")"
                                                             if table.get("section") else "") + ".")


def _grid_name(doc: dict) -> str:
    policies = ", ".join(g["label"] for g in doc["grids"])
    return f"{doc['model']}: {policies}; lengths {','.join(map(str, doc['lengths']))}, {doc['trials']} trial(s) a cell"


def _headline(doc: dict, path: Path) -> None:
    c = doc["control"]
    t = doc["template"]
    overall = "no trial" if c["overall"] is None else f"{100 * c['overall']:.0f}% of the trials"
    st.markdown(
        f"**Does {doc['model']} still find the pass key with its cache held to the budget?** A five-digit key hides "
        f"in filler (*{t['filler_start'][:60]}...*{' repeated' if t['filler_repeated'] else ''}) as *{t['needle']}*, at "
        f"each depth of each prompt length; the prompt ends *{t['question']}* and the model writes {doc['new_tokens']} "
        f"tokens greedily. The full cache (the control) retrieves the key in {overall}. Each policy's cell counts only "
        "the trials the control got right; a grey cell is one where the control got none right: labelled, not counted. "
        "Click a cell to open its trial below.")
    if c["fails"]:
        st.warning("The control fails every trial of this grid: the model does not retrieve the key even with its "
                   "whole cache, so no policy's grid is counted.", icon=":material/warning:")
    st.caption(f"from `{path}`; {doc['run']['executor']}, {doc['run']['seconds']:.0f} s")


def _follow(event, doc: dict) -> None:
    """A clicked cell sets the trial's depth and length (the selectboxes below are drawn after this)."""
    points = (event or {}).get("selection", {}).get("points", []) if isinstance(event, dict) else \
        getattr(getattr(event, "selection", None), "points", []) or []
    if not points:
        return
    p = points[0]
    try:
        depth, length = float(p["y"]), int(p["x"])
    except (KeyError, TypeError, ValueError):
        return
    if depth in doc["depths"] and length in doc["lengths"]:
        st.session_state["needle_depth"], st.session_state["needle_length"] = depth, length


def _open_button(run: dict, layer: int, head: int, heads: int) -> None:
    """The button that opens this layer of the trial in the kept-positions view, where the trial's
    attention was kept (``kvsim needle --attention``); else the line that says how to keep it."""
    from kvsim.data.catalog import recorded_bundles
    from kvsim.views.support import trace_selector

    kept = run.get("attention") or {}
    name = kept.get("bundle")
    if name is None or name not in recorded_bundles():
        st.caption("To replay this trial in the kept-positions view, run the grid's command again with `--attention`: "
                   "it keeps the attention each step showed the cache's policy.")
        return
    if [layer, head] in kept.get("skipped", []):
        st.caption(f"Layer {layer}'s attention was not kept: some step of it showed its policy no weight at all "
                   "(every held position outside its sliding window).")
        return
    budget = run["budgets"][layer][head] if run.get("budgets") else run["budget"]  # a split: this head's own
    selector = trace_selector(name, layer, head, heads == 1)
    st.button(f"open layer {layer} of this trial in the kept-positions view ({run['label']})", key="needle_open_kept",
              on_click=needle_kept.open_trial, args=(selector, run["policy"], budget, run["params"]),
              help="replays the attention the trial showed its cache, through the same policy at the same budget: "
              "its kept sets are the trial's own")
    best = (run.get("optimal_attention") or {}).get("bundle")
    if best is not None and best in recorded_bundles():
        st.button(f"open layer {layer} of the full cache's attention with the exact optimum at {budget}",
                  key="needle_open_optimum", on_click=needle_kept.open_trial,
                  args=(trace_selector(best, layer, head, heads == 1), "optimal", budget, {}),
                  help="the control's attention replayed through the offline optimal at this head's budget: what the "
                  "best possible cache of that size keeps of the key (kvsim needle --optimum --attention)")


def _trial(doc: dict) -> None:
    st.subheader("One trial: where each layer's cache lost the key")
    cols = st.columns(4)
    depth = cols[0].selectbox("depth", doc["depths"], key="needle_depth", format_func=lambda d: f"{d:g}")
    length = cols[1].selectbox("length", doc["lengths"], key="needle_length")
    trial = cols[2].selectbox("trial", list(range(doc["trials"])), key="needle_trial", format_func=lambda i: str(i + 1))
    cell = next(c for c in doc["cells"] if c["depth"] == depth and c["length"] == length and c["trial"] == trial)
    runs = cell["runs"]
    label = cols[3].selectbox("policy", [r["label"] for r in runs], key="needle_policy")
    run = next(r for r in runs if r["label"] == label)
    control = cell["control"]
    st.markdown(
        f"Key **{cell['key']}** at positions {cell['key_positions'][0]}-{cell['key_positions'][-1]} of "
        f"{cell['prompt_tokens']} (both mentions). The control wrote *{control['text'].strip()}* "
        f"({'found it' if control['correct'] else 'missed it: this trial is not counted'}); **{run['label']}** wrote "
        f"*{run['text'].strip()}* ({'found it' if run['correct'] else 'missed it'}).")
    st.dataframe(figures.fate_rows(cell), hide_index=True, key="needle_fates")
    left = needle.departures(run)
    if left is None:
        st.info("This trial's cache is no longer in the cache directory (cleared?); run the grid's command again to "
                "draw it.")
        return
    layers, heads = left.shape[:2]
    c1, c2 = st.columns(2)
    layer = c1.selectbox("layer", list(range(layers)), key="needle_layer")
    head = c2.selectbox("KV head", list(range(heads)), key="needle_head") if heads > 1 else 0
    _open_button(run, layer, head, heads)
    title = f"{run['label']}, layer {layer}" + (f" KV head {head}" if heads > 1 else "")
    st.plotly_chart(figures.trial_kept(left[layer, head], cell["key_positions"], cell["prompt_tokens"],
                                       run["positions"], title=title), key="needle_trial_kept")
    st.caption(
        "Held positions dark, the key's columns red, an x where a key token left the cache. A policy that reads "
        "attention (h2o and its kin) keeps what drew attention so far: a key in the middle of the text drew little "
        "before the question came, so it goes; one that keeps the start and the newest (streaming_llm) loses a key "
        "anywhere but at the very end. This picture is drawn here, from the trial's own cache; the button above "
        "replays the trial's own attention in the kept-positions view (kept with `--attention`).")

"""What the learned policy looks at, in words and a picture: its fitted weights as a table and a bar chart, the
held-out study as a table, and docs/learned.md printed from the study's JSON (``kvsim learn --doc``).

Pure functions: the app and the CLI call them; nothing here reads a file."""

from __future__ import annotations

import math

import numpy as np

#: what each feature is, in a few words (the weights' table and the bar chart's hover)
FEATURE_WORDS = {
    "log_cum": "cumulative attention (h2o's score), log",
    "log_mean": "cumulative attention per row shown, log",
    "log_recent": "attention of the last 8 rows shown, log",
    "log_decayed": "attention decayed by 0.95 per row, log",
    "log_last": "weight in the latest row (tova's score), log",
    "vote_rate": "share of rows above the fair share 1/n",
    "log_age": "rows shown since admitted, log(1 + n)",
    "log_position": "position, log(1 + p)",
    "log_key_norm": "key norm, log",
}

#: the columns of the study's table, in order: the learned policy, the hand-written ones, the optimum
COLUMNS = ("learned", "h2o", "tova", "snapkv", "keydiff", "critical", "expected_attention", "optimal")


def weights_rows(weights: dict) -> list[tuple[str, float, str]]:
    """(feature, weight on the standardised feature, what it is), in the weights' order."""
    return [(f, float(w), FEATURE_WORDS.get(f, f)) for f, w in zip(weights["features"], weights["weights"], strict=True)]


def weights_table(weights: dict) -> str:
    """The fitted weights as a Markdown table (a higher score is kept; the lowest outside the window goes)."""
    lines = ["| feature | weight | what it is |", "| --- | ---: | --- |"]
    lines += [f"| `{f}` | {w:+.3f} | {words} |" for f, w, words in weights_rows(weights)]
    return "\n".join(lines)


def _cell(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def rows_table(rows: list[dict]) -> str:
    """Retained mass per held-out (trace, budget): the learned policy, each hand-written one that ran, the optimum,
    and the share of the h2o-to-optimum gap the learned policy closed."""
    cols = [c for c in COLUMNS if any(c in r["retained_mass"] for r in rows)]
    head = ["trace", "budget", *cols, "gap closed", "best hand-written (its gap closed)"]
    lines = ["| " + " | ".join(head) + " |", "| --- | ---: | " + " | ".join("---:" for _ in cols) + " | ---: | --- |"]
    for r in rows:
        mass = r["retained_mass"]
        gap = r["gap_closed"]
        closed = "-" if gap is None or (isinstance(gap, float) and math.isnan(gap)) else f"{gap:.1%}"
        best = r["best_hand_written"]
        span = mass["optimal"] - mass["h2o"]
        theirs = f" ({(mass[best] - mass['h2o']) / span:.1%})" if span > 0 else ""
        lines.append("| " + " | ".join([r["trace"], str(r["budget"]), *(_cell(mass.get(c)) for c in cols), closed,
                                        best + theirs]) + " |")
    return "\n".join(lines)


def paged_rows(rows: list[dict]) -> list[dict]:
    """The rows measured in pages, in the shape of ``rows`` (``rows_table`` and ``verdict`` read either)."""
    return [{"trace": r["trace"], "model": r.get("model"), "text": r.get("text"), "budget": r["budget"], **r["pages"]}
            for r in rows if r.get("pages")]


def verdict(rows: list[dict]) -> list[str]:
    """One sentence per (trace, budget) where a hand-written policy beats the learned one, with the figures."""
    out = []
    for r in rows:
        mass = r["retained_mass"]
        best = r["best_hand_written"]
        if mass[best] > mass["learned"]:
            digits = 4 if f"{mass[best]:.4f}" != f"{mass['learned']:.4f}" else 6
            out.append(f"- {r['trace']} at budget {r['budget']}: the learned policy ({mass['learned']:.{digits}f}) loses "
                       f"to {best} ({mass[best]:.{digits}f}).")
    return out


def family(row: dict) -> str:
    """The model family a row's trace was recorded from (a row without the field: the fit's, Gemma-3-270M)."""
    model = row.get("model") or ""
    if "smollm2" in model.lower():
        return "SmolLM2-135M"
    return "Gemma-3-270M" if not model or "gemma" in model.lower() else model


def groups(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """The rows by model and text, in their order, each with its heading: the fit's model and text first (rows
    without a text: the study's first command), then another text, then the other model family."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((family(r), r.get("text")), []).append(r)

    def heading(key: tuple) -> str:
        model, text = key
        if text is None:
            return f"{model} on heapq.py, the text the weights were fitted on: other layers"
        if model == "Gemma-3-270M":
            return f"{model}, the model the weights were fitted on, on another text: {text}"
        return f"{model}, the other model family, on {text}"

    order = sorted(out, key=lambda k: (k[0] != "Gemma-3-270M", k[1] is not None))  # stable: first seen first
    return [(heading(k), out[k]) for k in order]


def _held_out(rows: list[dict], where: str) -> list[str]:
    """One table per model and text, the range of the gap closed and where a hand-written policy wins."""
    parts = []
    for title, mine in groups(rows):
        closed = [r["gap_closed"] for r in mine if r["gap_closed"] is not None and not math.isnan(r["gap_closed"])]
        losses = verdict(mine)
        parts += [f"### {title}", "", rows_table(mine), ""]
        summary = (f"The learned policy closes {min(closed):.1%} to {max(closed):.1%} of the h2o-to-optimum gap here"
                   if closed else "The gap is not defined here")
        if losses:
            parts += [f"{summary}, and matches or beats the best hand-written policy in {len(mine) - len(losses)} of "
                      f"{len(mine)} rows. Where it loses to a hand-written policy{where}:", "", *losses, ""]
        else:
            parts += [f"{summary}, and beats or matches every hand-written policy that runs on these traces at these "
                      "budgets.", ""]
    return parts


#: the model families' names in the measures' commands, as the doc says them
MODEL_NAMES = {"gemma3-270m": "Gemma-3-270M", "smollm2-135m": "SmolLM2-135M"}


def _num(v, digits: int = 4) -> str:
    return "-" if v is None else f"{v:+.{digits}f}" if digits < 0 else f"{v:.{digits}f}"


def quality_table(entry: dict) -> str:
    """One open-loop quality grid: per policy its KL, delta NLL and retained mass, the learned policy's first."""
    lines = ["| policy | KL | delta NLL | delta NLL, key tokens | retained mass |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in entry["results"]:
        key = r.get("delta_nll_key")
        lines.append(f"| {r['policy']} | {r['kl']:.4f} | {r['delta_nll']:+.4f} | {'-' if key is None else f'{key:+.4f}'} "
                     f"| {r['retained_mass']:.4f} |")
    return "\n".join(lines)


def quality_verdict(entry: dict) -> str:
    """Where the learned policy ranks by KL among the online policies of the grid (the optimum apart)."""
    online = sorted((r for r in entry["results"] if r["policy"] != "optimal"), key=lambda r: r["kl"])
    names = [r["policy"] for r in online]
    if "learned" not in names:
        return ""
    rank = names.index("learned") + 1
    best = online[0]
    mine = online[rank - 1]
    opt = next((r for r in entry["results"] if r["policy"] == "optimal"), None)
    tail = (f"; the optimum (by retained mass, not by KL) has KL {opt['kl']:.4f}" if opt else "")
    keyed = sorted((r for r in online if r.get("delta_nll_key") is not None), key=lambda r: r["delta_nll_key"])
    if mine.get("delta_nll_key") is not None and keyed:
        k = [r["policy"] for r in keyed].index("learned") + 1
        tail += (f". On the key tokens it ranks {k} of {len(keyed)} (delta NLL {mine['delta_nll_key']:+.4f}; the "
                 f"lowest: {keyed[0]['policy']}, {keyed[0]['delta_nll_key']:+.4f})")
    head = (f"learned has the lowest KL of the {len(names)} online policies ({mine['kl']:.4f})" if rank == 1 else
            f"learned ranks {rank} of {len(names)} online policies by KL ({mine['kl']:.4f}; the lowest: "
            f"{best['policy']}, {best['kl']:.4f})")
    return head[0].upper() + head[1:] + tail + "."


def _found(share) -> str:
    return "n/a" if share is None else "found" if share == 1.0 else "-" if share == 0.0 else f"{share:.0%}"


def needle_table(entry: dict) -> str:
    """One pass-key grid: found at each depth, the (layer, KV head)s that held a key token to the end, and the exact
    optimum's on the control's attention at the same budget."""
    depths = entry["depths"]
    lines = ["| policy | " + " | ".join(f"depth {d:g}" for d in depths) + " | key token held to the end | the optimum's |",
             "| --- | " + " | ".join("---" for _ in depths) + " | ---: | ---: |",
             "| full cache (control) | " + " | ".join(_found(v) for v in entry["control"]) + " | | |"]
    for p in entry["policies"]:
        lines.append(f"| {p['label']} | " + " | ".join(_found(v) for v in p["found"]) +
                     f" | {p['key_held']} of {p['heads']} | {p['optimum_key_held']} of {p['heads']} |")
    return "\n".join(lines)


def model_measures(measures: dict | None) -> list[str]:
    """docs/learned.md's section on the model's own measures (``kvsim/bench/scripts/learned_measures.py`` writes them)."""
    if not measures or not (measures.get("quality") or measures.get("needle")):
        return []
    parts = ["## The model's own measures", "",
             "Retained mass is the simulator's figure; the model's own are what it predicts with the evicted cache. "
             "The learned policy runs with the shipped weights (fitted on Gemma-3-270M's layer 5, by retained mass, "
             "not by KL), on SmolLM2-135M unchanged; every other policy at its defaults.", ""]
    if measures.get("quality"):
        parts += ["Open loop (`kvsim quality --mode open`, docs/proxies.md): one teacher-forced pass over the text, "
                  "every layer's attention masked by the policy's schedule replayed on the full cache's own attention, "
                  "every layer and KV head at the budget; KL of the next-token distribution against the full cache's "
                  "and delta NLL, averaged over the decode steps; delta NLL on the key tokens alone (LongPPL's: the "
                  "tokens whose NLL the long context lowers most against a short window, the same tokens for every "
                  "policy, docs/proxies.md). The optimum's schedule is the retained-mass optimum per (layer, KV head), "
                  "not the KL optimum.", ""]
        for q in measures["quality"]:
            name = MODEL_NAMES.get(q["model"], q["model"])
            parts += [f"### {name}, budget {q['budget']}, {q['steps']} steps of {q['text']} (full-cache NLL "
                      f"{q['nll_full']:.4f})", "", quality_table(q), "", quality_verdict(q), "", "```", q["command"],
                      "```", ""]
    if measures.get("needle"):
        parts += ["The pass key (`kvsim needle`, docs/needle.md): a key hidden at a depth of a filler prompt, the model "
                  "asked for it at the end, decoded with each policy's evicting cache; found (every trial right), `-` "
                  "(none), counted only where the full cache found it. Beside: the (layer, KV head)s over the trials "
                  "that held a key token to the end of the prompt, and the exact optimum's on the control's "
                  "attention at the same budget (`--optimum`).", ""]
        for n in measures["needle"]:
            name = MODEL_NAMES.get(n["model"], n["model"])
            lengths = ", ".join(map(str, n["lengths"]))
            parts += [f"### The pass key, {name}, {lengths} tokens, budget {n['budget']}, {n['trials']} trial(s) a cell",
                      "", needle_table(n), "", "```", n["command"], "```", ""]
    hows = dict.fromkeys(e["how"] for kind in ("quality", "needle") for e in measures.get(kind, []) if e.get("how"))
    parts += ["Written into the study by:", "", "```", *hows,
              "python -m kvsim learn --doc docs/learned-study.json > docs/learned.md", "```", ""]
    return parts


def measured_and_not(study: dict) -> list[str]:
    """What this study measures of issue 58's list, and what it still does not."""
    rows = study["rows"]
    families = sorted({family(r) for r in rows})
    texts = {r.get("text") for r in rows if family(r) == "Gemma-3-270M"}
    m = study.get("model_measures") or {}
    q_models = sorted({MODEL_NAMES.get(q["model"], q["model"]) for q in m.get("quality", [])})
    q_budgets = sorted({q["budget"] for q in m.get("quality", [])})
    n_models = sorted({MODEL_NAMES.get(n["model"], n["model"]) for n in m.get("needle", [])})
    done = [f"retained mass and the gap closed on {' and '.join(families)}"
            + (f", Gemma-3-270M on {len(texts)} texts" if len(texts) > 1 else "")]
    if q_models:
        done.append(f"open-loop KL and delta NLL on {' and '.join(q_models)} at budget "
                    f"{', '.join(map(str, q_budgets))}")
    if n_models:
        done.append(f"the pass key on {' and '.join(n_models)}")
    missing = ["closed-loop KL and delta NLL (the truth, decoded token by token with the evicted cache)",
               "the model's measures in pages of 16",
               "weights fitted on SmolLM2-135M, or on keys as well (`log_key_norm`: the fit's trace holds no keys)",
               "the pass key over several trials a cell and other lengths (one trial a cell is a first reading)"]
    for n in m.get("needle", []):
        if len(n["depths"]) < 3:
            missing.insert(0, f"the pass key on {MODEL_NAMES.get(n['model'], n['model'])} at depths other than "
                              f"{', '.join(f'{d:g}' for d in n['depths'])} (its runs did not finish here)")
    if q_budgets:
        missing.append(f"the open-loop grids at budgets other than {', '.join(map(str, q_budgets))}")
    left = [c for c in COLUMNS if m.get("quality") and any(c not in {r["policy"] for r in q["results"]}
                                                           for q in m["quality"])]
    if left:
        missing.insert(0, f"{', '.join(left)} in the open-loop grids above (its measurement did not finish here: "
                          "the reference path's cost on a loaded 2-core machine)")
    for what, models in (("the pass key", n_models), ("open-loop KL and delta NLL", q_models)):
        if not models:
            missing.insert(0, what)
        elif len(models) < 2:
            missing.insert(0, f"{what} on the other model family")
    return ["## Measured here, and not", "", "Measured: " + "; ".join(done) + ".", "",
            "Not measured here yet: " + "; ".join(missing) + ".", ""]


def _recordings(study: dict) -> list[str]:
    """How the recordings the added rows read were made (a recorded bundle lives in the cache directory under a
    name its settings give: kvsim record --json prints it)."""
    lines = study.get("recorded_by", [])
    if not lines:
        return []
    return ["The recordings the `--add` rows read, made first: each goes into the cache directory under the name "
            "it prints (`kvsim cache list`), its tail a digest of the text, the model, the settings and the torch "
            "and transformers versions, so on another machine the `--eval` names take that machine's name:", "",
            "```", *lines, "```", ""]


def _label_and_loss() -> list[str]:
    """The study page's account of the label and the loss, which no figure changes."""
    return [
        "## The label and the loss",
        "",
        "The teacher is the exact optimum (`optimal`): for a trace and a budget it gives the step at which each "
        "position leaves the best cache. The fit walks a schedule step by step with the learned policy's own "
        "feature state (the same code the policy runs), so the features at each evicting step are exactly what "
        "the online policy computes in that cache. The candidates are the held positions outside the newest "
        "`recent_window`. The optimum labels each candidate at step t: *doomed* if it evicts the position by step "
        "t + horizon (or has evicted it already), *kept* if it still holds it then.",
        "",
        "The loss (`--loss pairs`, the default) is pairwise logistic: for pairs (kept, doomed) drawn from one step, "
        "log(1 + exp(-(score(kept) - score(doomed)))), averaged, plus a small L2 penalty on the weights of the "
        "standardised features. Why pairs within a step: the policy's whole decision is an argmin among one step's "
        "candidates, so only score differences within a step matter, and that is all this loss sees. Why doomed "
        "within a horizon rather than the one victim: many candidates are worth nothing more to the optimum (no "
        "attention still to come), and which of them it names first is close to arbitrary; the alternative "
        "(`--loss choice`: a softmax over the step's candidates with the optimum's victim as the label) fits that "
        "arbitrary choice and did worse. Both losses are convex, so Newton's method finds the optimum in a few "
        "iterations, deterministically (the pairs are drawn with a fixed seed).",
        "",
        "Why DAgger rounds: the first round walks the optimum's own schedule, whose cache holds only positions worth "
        "holding; a policy fitted there never sees the junk its own cache fills with once it departs from the "
        "optimum, and it did poorly (h2o-level retained mass). Each further round (`--dagger`, default 3) walks "
        "the schedule of the policy fitted so far, labels the caches it reaches by the optimum (a position the "
        "optimum has already evicted is doomed), adds them to the examples and fits again. The label is the "
        "optimum's schedule from the start, not the best continuation from the learner's cache, which `optimal` "
        "does not solve.",
        "",
    ]


def study_markdown(study: dict) -> str:
    """docs/learned.md: the study as measured, from its JSON (``kvsim learn --study``)."""
    w = study["weights"]
    fit = w.get("fit", {})
    rows = study["rows"]
    fitted_on = ", ".join(w.get("fitted_on", []))
    budgets = ", ".join(map(str, w.get("budgets", [])))
    parts = [
        "# A policy learned from the optimum",
        "",
        "<!-- printed by `python -m kvsim learn --doc docs/learned-study.json > docs/learned.md` from the study's JSON; "
        "edit kvsim/views/learned.py, not this file -->",
        "",
        "`learned` (kvsim/policies/learned.py) is an online policy: at each step it scores every held position with a "
        "linear function of features it computes from the attention rows it has been shown, and evicts the lowest "
        "score outside the newest `recent_window` positions (lower position first on ties). Its weights are data, a "
        "JSON file fitted by `kvsim learn` to the exact optimum's evictions (`optimal`); the shipped default is "
        "`kvsim/policies/learned_weights.json`, and `KVSIM_LEARNED_WEIGHTS=FILE` points every `learned` at another.",
        "",
        *_label_and_loss(),
        "## The fit",
        "",
        f"Fitted on {fitted_on} at budgets {budgets}, recent window {w['recent_window']}, horizon "
        f"{fit.get('horizon')}, {fit.get('dagger')} DAgger rounds: {fit.get('steps')} evicting steps in all, "
        f"{fit.get('candidates')} candidates, {fit.get('examples')} pairs; on the optimum's own schedule "
        f"{fit.get('skipped_inside_window')} of {fit.get('optimum_steps')} steps evict inside the recent window. "
        f"Final loss {fit.get('final_loss')} after {fit.get('iterations')} Newton iterations.",
        "",
        "Weights on the standardised features (a higher score is kept):",
        "",
        weights_table(w),
        "",
        "## Held out",
        "",
        "Mean retained mass per step, each policy at its defaults and the budget shown; `-` where the trace lacks "
        "what a policy reads (keys, values, queries, output norms, RoPE). Gap closed: (learned - h2o) / (optimal - h2o). "
        "A trace named `BUNDLE-Lnn` is a layer of a recorded bundle (traces/README.md), `BUNDLE-Lnn-kvH` its KV head "
        "H; the shipped bundle gemma3-270m-heapq holds 1024 steps of every layer, and its layers 2, 8 and 14 attend "
        "over a sliding window of 512 positions, a kind of layer the fit never saw (it was fitted on a global layer). "
        "The weights are the same in every table: fitted on Gemma-3-270M's layer 5 over heapq.py, never refitted.",
        "",
    ]
    parts += _held_out(rows, "")
    paged = paged_rows(rows)
    if paged:
        size = paged[0]["block_size"]
        parts += [f"## In pages of {size}", "",
                  f"The same, with the cache in pages of {size} positions (docs/serving.md: a whole page leaves, the "
                  "one whose positions' scores add up lowest, never the page still filling; `optimal` is the optimum "
                  "under pages). A page's learned score is the sum of its positions' exp(score) "
                  "(`Learned.layout_priorities`): the exponential keeps the single positions' order and puts the "
                  "score on the scale of attention, where a sum means something (summing the raw scores, which are "
                  "signed sums of log-features, lost to h2o in pages). The weights were fitted on single positions, "
                  "not on pages.", ""]
        parts += _held_out(paged, " in pages")
    parts += model_measures(study.get("model_measures"))
    parts += measured_and_not(study)
    parts += ["## The commands", "", "The study and this page:", "", "```", study["command"],
              *study.get("added_by", []),
              "python -m kvsim learn --doc docs/learned-study.json > docs/learned.md", "```", "",
              *_recordings(study),
              "Weights of your own (`--out`) replace the shipped ones for every `learned` a process builds, in every "
              "command and the app:", "", "```",
              "python -m kvsim learn --trace gemma3-270m-L11 --budget 256 --out my-weights.json",
              "KVSIM_LEARNED_WEIGHTS=my-weights.json python -m kvsim replay --policy learned --trace gemma3-270m-L17 "
              "--budget 256", "```", ""]
    return "\n".join(parts)


def weights_figure(weights: dict, height: int = 320):
    """The fitted weights as horizontal bars, one per feature (positive: kept; negative: evicted first)."""
    import plotly.graph_objects as go

    rows = weights_rows(weights)
    names = [f for f, _, _ in rows][::-1]
    values = [w for _, w, _ in rows][::-1]
    words = [t for _, _, t in rows][::-1]
    fig = go.Figure(go.Bar(x=values, y=names, orientation="h", customdata=words,
                           marker_color=["#1b9e77" if v >= 0 else "#d95f02" for v in values],
                           hovertemplate="%{y}: %{x:+.3f}<br>%{customdata}<extra></extra>"))
    fitted = ", ".join(weights.get("fitted_on", [])) or "?"
    fig.update_layout(title=f"learned: weights on standardised features (fitted on {fitted})", height=height,
                      margin=dict(l=10, r=10, t=40, b=30), xaxis_title="weight (higher score: kept)")
    return fig


# --------------------------------------------------------------------------------------------
# the learned policy's kept positions beside the optimum's and h2o's (the scores view)

#: the policies the learned one is drawn beside, in the order of the picture's rows
BESIDE = ("learned", "optimal", "h2o")


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, how many positions two ``(T, budget)`` kept histories (-1 padded, positions unique in a row)
    share: the equal neighbours of the two rows sorted together."""
    both = np.sort(np.concatenate([a, b], axis=1), axis=1)
    return ((both[:, 1:] == both[:, :-1]) & (both[:, 1:] >= 0)).sum(axis=1)


def kept_beside(kept: dict[str, np.ndarray], step: int) -> dict:
    """At ``step`` (1-based: the kept set after it), each policy's kept positions and which of them the other two
    do not keep; over the run, the share of the optimum's kept positions that each other policy keeps too.
    ``kept``: name -> ``(T, budget)`` kept history (``ReplayResult.kept_history``) of ``BESIDE``."""
    row = min(max(step, 1), min(k.shape[0] for k in kept.values())) - 1
    sets = {n: set(int(p) for p in kept[n][row] if p >= 0) for n in BESIDE}
    alone = {n: sorted(sets[n] - set().union(*(sets[m] for m in BESIDE if m != n))) for n in BESIDE}
    held = (kept["optimal"] >= 0).sum(axis=1)
    share = {n: _overlap(kept[n], kept["optimal"]) / np.maximum(held, 1) for n in BESIDE if n != "optimal"}
    return {"step": row + 1, "sets": {n: sorted(s) for n, s in sets.items()}, "alone": alone,
            "with_optimal": {n: len(sets[n] & sets["optimal"]) for n in BESIDE if n != "optimal"},
            "share_of_optimal": share, "mean_share_of_optimal": {n: float(v.mean()) for n, v in share.items()}}


def beside_sentence(b: dict) -> str:
    """The picture in words: what each keeps alone at the step, and how much of the optimum's cache each keeps."""
    alone = "; ".join(f"{n} {len(b['alone'][n])}" for n in BESIDE)
    mean = ", ".join(f"{n} {v:.1%}" for n, v in b["mean_share_of_optimal"].items())
    return (f"After step {b['step']}, positions that one policy keeps and the other two do not: {alone}. "
            f"Of the optimum's kept positions, learned keeps {b['with_optimal']['learned']} and h2o "
            f"{b['with_optimal']['h2o']}; over the whole run, on average: {mean}.")


def kept_beside_figure(b: dict, height: int = 420):
    """Top: each policy's kept positions after the step, one row each, a position none of the other two keeps
    marked apart; bottom: per step, the share of the optimum's kept positions that learned and h2o keep too."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, row_heights=[0.45, 0.55], vertical_spacing=0.16,
                        subplot_titles=(f"positions kept after step {b['step']}: one the other two do not keep in colour",
                                        "share of the optimum's kept positions each keeps too, per step"))
    for n in BESIDE:
        alone = set(b["alone"][n])
        shared = [p for p in b["sets"][n] if p not in alone]
        fig.add_trace(go.Scatter(x=shared, y=[n] * len(shared), mode="markers", name="kept by another too",
                                 marker=dict(symbol="line-ns-open", size=10, color="#bbbbbb"), showlegend=n == BESIDE[0],
                                 legendgroup="shared", hovertemplate=f"{n} keeps %{{x}}<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Scatter(x=sorted(alone), y=[n] * len(alone), mode="markers", name=f"{n} alone",
                                 marker=dict(symbol="line-ns-open", size=14, line_width=2, color=COLOURS[n]),
                                 hovertemplate=f"only {n} keeps %{{x}}<extra></extra>"), row=1, col=1)
    for n, share in b["share_of_optimal"].items():
        fig.add_trace(go.Scatter(x=list(range(1, share.size + 1)), y=share.round(4).tolist(), mode="lines", name=f"{n} ∩ optimal",
                                 line=dict(color=COLOURS[n], width=1.5),
                                 hovertemplate=f"step %{{x}}: {n} keeps %{{y:.1%}} of the optimum's<extra></extra>"),
                      row=2, col=1)
    fig.add_vline(x=b["step"], line_dash="dot", line_color="#666666", row=2, col=1)
    fig.update_yaxes(categoryorder="array", categoryarray=list(BESIDE[::-1]), row=1, col=1)
    fig.update_yaxes(tickformat=".0%", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(title="learned beside the optimum and h2o", height=height, margin=dict(l=10, r=10, t=70, b=30),
                      legend=dict(orientation="h", y=-0.15))
    return fig


#: a colour per policy drawn beside the others
COLOURS = {"learned": "#1b9e77", "optimal": "#7570b3", "h2o": "#d95f02"}

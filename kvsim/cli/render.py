"""The readable form of each command's document: aligned tables, numbers right-aligned on the point.

``--json`` prints the document itself instead (``jsondoc.as_json``), with NaN and infinities as null.
What a renderer needs of the analyses (a policy's parameters as a label, the window rule) and the
renderers of the commands with modules of their own are imported when a document is rendered, so that
``kvsim.cli``, which names ``render``, imports none of them (issue 36).
"""

from __future__ import annotations

import importlib

from ..policykit.base import WINDOW
from .tables import aligned, prose

#: the value-aware proxies a ``--proxies`` document carries (``kvsim.analysis.proxies.VALUE_PROXIES``)
PROXY_COLUMNS = ("value_mass", "output_error", "output_shift")


def params_label(params: dict) -> str:
    """``kvsim.analysis.table.params_label``: a policy's parameters as the tables label them."""
    from ..analysis.table import params_label as label

    return label(params)


def _summary_params(r: dict) -> dict:
    skip = {"trace", "policy", "budget", "retained_mass", "top_k_recall", "top_k", "steps", "best", "recommended",
            *PROXY_COLUMNS, "proxy_fallback", "not_applicable", "turns", *LAYOUT_KEYS}
    return {k: v for k, v in r.items() if k not in skip}


#: a row's serving-layout keys (kvsim.policykit.layouts): shown as the layout and memory columns, not as parameters
LAYOUT_KEYS = ("layout", "block_size", "shared_selection", "evict_every", "memory", "kv_heads", "heads")


def _layout_cols(rows: list[dict]) -> list[str]:
    return ["layout", "memory"] if any("layout" in r for r in rows) else []


def _proxy_cols(rows: list[dict]) -> list[str]:
    """The proxy columns to show: those the rows carry (``--proxies``), else none."""
    return [c for c in PROXY_COLUMNS if any(c in r for r in rows)]


def _proxy_note(rows: list[dict]) -> list[str]:
    """The one line saying what is measured and what is not applicable (the value-aware proxies on a
    trace without values), and why, once."""
    whys = sorted({r["not_applicable"]["why"] for r in rows if r.get("not_applicable")})
    k = rows[0].get("top_k", "k") if rows else "k"
    return [f"measured: retained_mass, top_{k}_recall; not applicable: {', '.join(PROXY_COLUMNS)} ({why})" for why in whys]


def _allocated(doc: dict) -> str:
    """``replay --allocate``: each layer's retained mass and budgets, then the bundle's mean."""
    by: dict[int, list[int]] = {}
    for r in doc["allocation"]:
        by.setdefault(r["layer"], []).append(r["budget"])
    table = aligned(["layer", "budgets (per KV head)", "retained_mass"],
                    [[x["layer"], " ".join(map(str, by[x["layer"]])), x["retained_mass"]] for x in doc["layers"]])
    pooled = f", pooled per layer (floor {doc['floor']})" if doc.get("pooled") else ""
    return (f"{doc['policy']} {params_label(_allocation_params(doc))} on {doc['bundle']} ({doc['steps']} steps), "
            f"allocated by {doc['allocate']}{pooled}: {doc['positions']} positions (budget {doc['budget']:g} x "
            f"{len(doc['allocation'])} heads)\n\n{table}\n\nbundle mean retained mass {doc['retained_mass']:.4f}")


def _allocation_params(doc: dict) -> dict:
    skip = {"bundle", "model", "steps", "policy", "budget", "allocate", "positions", "retained_mass", "layers",
            "allocation", "floor", "pooled", "best"}
    return {k: v for k, v in doc.items() if k not in skip}


def _allocated_sweep(doc: list[dict]) -> str:
    return aligned(["bundle", "policy", "params", "budget", "allocate", "retained_mass", "choice"],
                   [[r["bundle"], r["policy"], params_label(_allocation_params(r)), r["budget"], r["allocate"],
                     r["retained_mass"], "best" if r.get("best") else ""] for r in doc])


def _allocated_table(doc: dict, width: int | None = None) -> str:
    rows = [[r["policy"], params_label(r["params"]), r["retained_mass"]] for r in doc["rows"] if "refused" not in r]
    return "\n".join([prose(f"Bundle mean retained mass at budget {doc['budget']} per head on {doc['bundle']} "
                            f"({doc['steps']} steps), allocated by {doc['allocate']}:", width), "",
                      aligned(["policy", "params", "retained_mass"], rows, width=width),
                      *(prose(f"{r['policy']}: refused ({r['refused']})", width) for r in doc["rows"] if "refused" in r)])


def _replay(doc: dict) -> str:
    if "allocate" in doc:
        return _allocated(doc)
    cols = _proxy_cols([doc])
    lay = _layout_cols([doc])
    heads = [] if "heads" not in doc else ["", f"{doc['kv_heads']} KV heads of the layer, replayed together "
                                           "(retained_mass and recall above: their mean):", aligned(
        ["kv_head", "retained_mass", f"top_{doc['top_k']}_recall"],
        [[h["kv_head"], h["retained_mass"], h["top_k_recall"]] for h in doc["heads"]])]
    return "\n".join([aligned(
        ["trace", "policy", "params", *lay, "budget", "steps", "retained_mass", f"top_{doc['top_k']}_recall", *cols],
        [[doc["trace"], doc["policy"], params_label(_summary_params(doc)), *(doc[c] for c in lay), doc["budget"],
          doc["steps"], doc["retained_mass"], doc["top_k_recall"], *(doc[c] for c in cols)]],
    ), *_proxy_note([doc]), *heads, *_turn_lines(doc)])


def _turn_lines(doc: dict) -> list[str]:
    """A conversation's trace (``record --conversation``): the retained mass over each turn's queries."""
    if "turns" not in doc:
        return []
    return ["", "Per turn (positions: the question from question_start, the answer from answer_start to end):", aligned(
        ["turn", "question_start", "answer_start", "end", "retained_mass", "answer_retained_mass"],
        [[t["turn"], t["question_start"], t["answer_start"], t["end"], t["retained_mass"], t["answer_retained_mass"]]
         for t in doc["turns"]])]


def _swept(doc: list[dict]) -> str:
    """The parameter the rows vary: the first that differs between them (a one-row sweep: its first)."""
    names = [*(["prefill_budget"] if "prefill_budget" in doc[0] else []), "budget", *_summary_params(doc[0])]
    return next((k for k in names if len({r[k] for r in doc}) > 1), names[-1])


def _sweep(doc: list[dict]) -> str:
    """The rows, the best and the recommended one marked (``cmd_sweep`` says which), and the choice in
    words under them: exact over recent_window only when every window 1..budget - 1 was swept."""
    from ..analysis.windows import TOLERANCE, covers

    if doc and "allocate" in doc[0]:
        return _allocated_sweep(doc)
    param = _swept(doc)
    cols = _proxy_cols(doc)
    lay = _layout_cols(doc)
    table = "\n".join([aligned(
        ["trace", "policy", "params", *lay, "budget", "retained_mass", f"top_{doc[0]['top_k']}_recall", *cols, "choice"],
        [[r["trace"], r["policy"], params_label(_summary_params(r)), *(r[c] for c in lay), r["budget"],
          r["retained_mass"], r["top_k_recall"],
          *(r[c] for c in cols), ", ".join(w for w in ("best", "recommended") if r.get(w))] for r in doc],
    ), *_proxy_note(doc)])
    best = next((r for r in doc if r.get("best")), None)
    rec = next((r for r in doc if r.get("recommended")), None)
    if best is None or rec is None:
        return table
    every = param == WINDOW and covers((r[param] for r in doc), doc[0]["budget"])
    what = "every window 1..budget - 1" if every else f"the {len(doc)} values swept"
    return (f"{table}\n\nbest {param} {best[param]} (retained mass {best['retained_mass']:.4f}); recommended "
            f"{rec[param]} ({rec['retained_mass']:.4f}): the smallest within {TOLERANCE:g} of the best, of {what}")


def _describe(doc: dict) -> str:
    labels = {
        "trace": "trace",
        "steps": "steps",
        "sink_share": f"sink share (positions 0-{doc['sinks'] - 1}, steps t > {doc['sinks']})",
        "recent_share": f"recent share (last {doc['band']} positions, steps t > {doc['band']})",
        "top_k_share": f"top-{doc['top_k']} share (steps t > {doc['top_k']})",
        "effective_positions": "effective positions, exp(entropy) per row",
    }
    table = aligned(["figure", "value"], [[label, doc[k]] for k, label in labels.items()])
    return f"{table}\n\nnote: {doc['note']}" if doc.get("note") else table


def _record(doc: dict) -> str:
    return "\n".join([*(f"wrote {f['path']} (layer {f['layer']}, KV head {f['head']}, {f['bytes']} bytes)" for f in doc["files"]),
                      f"bundle {doc['bundle']}: {len(doc['files'])} traces, {doc['steps']} steps"])


def _export(doc: dict) -> str:
    return f"wrote {doc['out']}: trace {doc['trace']}, {doc['steps']} steps, {doc['dtype']}, {doc['bytes']} bytes"


def _claims(doc: list[dict]) -> str:
    from ..analysis.claims import render_ledger

    return render_ledger(doc)


def _bench(doc: dict) -> str:
    from .bench_command import render_bench

    return render_bench(doc)


def _cache(doc: dict) -> str:
    """``kvsim cache list``: the directory and a row per kind; ``clear``: what went."""
    from ..data.caches import human

    if doc["action"] == "list":
        rows = [[r["kind"], r["entries"], human(r["bytes"])] for r in doc["kinds"]]
        total = ["total", sum(r["entries"] for r in doc["kinds"]), human(doc["bytes"])]
        return "\n".join([f"cache directory: {doc['cache_dir']}", "", aligned(["kind", "files", "size"], [*rows, total]),
                          "", "kvsim cache clear [--kind KIND] deletes them; other is never deleted (docs/caches.md)"])
    done = [f"  {r['kind']}: {r['entries']} files, {human(r['bytes'])}" for r in doc["cleared"]]
    return "\n".join([f"cleared {doc['kind']} from {doc['cache_dir']}:", *done])


def _prefill_table(doc: dict, width: int | None = None) -> str:
    k = doc["top_k"]
    rows = [[r["policy"], params_label(r["params"]), r["retained_mass"], r["top_k_recall"]]
            for r in doc["rows"] if "refused" not in r]
    return "\n".join([prose(f"Each policy as the one-time scorer on {doc['trace']}: {doc['prefill_budget']} of the prompt's "
                            f"{doc['prompt_length']} positions kept per head, then the cache grows; measured over the "
                            f"{doc['decode_steps']} decode steps:", width), "",
                      aligned(["prefill_policy", "params", "retained_mass", f"top_{k}_recall"], rows, width=width),
                      *(prose(f"{r['policy']}: refused ({r['refused']})", width) for r in doc["rows"] if "refused" in r)])


def _table(doc: dict, width: int | None = None) -> str:
    """``kvsim table``'s document; ``width`` (the terminal's, unless ``--wide``): its sentences and tables
    wrapped to fit (``aligned``, ``prose``), the calibration targets one below the other; None: every
    table's columns side by side, one line per row."""
    if "allocate" in doc:
        return _allocated_table(doc, width)
    if "prefill_budget" in doc:
        return _prefill_table(doc, width)
    k = doc["top_k"]
    lay = doc.get("layout")
    layout_col = ["layout"] if lay else []
    under = f", under the serving layout {lay['label']} (memory {lay['memory']} positions)" if lay else ""
    parts = [
        prose(f"Measured at budget {doc['budget']} on the {doc['trace']} trace ({doc['steps']} steps){under}:", width),
        "",
        aligned(
            ["policy", "params", *layout_col, "retained_mass", f"top_{k}_recall", "gap_share", *_proxy_cols(doc["rows"])],
            [[r["policy"], params_label(r["params"]), *([r["layout"]] if lay else []), r["retained_mass"],
              r["top_k_recall"], r.get("gap_share"),
              *(r.get(c) for c in _proxy_cols(doc["rows"]))] for r in doc["rows"] if "absent" not in r],
            width=width,
        ),
        "",
        *(prose(line, width) for line in [
            "gap_share: the share of the way from sliding_window's retained mass to the exact optimum's (0: no better "
            "than the latest positions, 1: the optimum)."
            + (" Under a layout both ends are under it: the optimum is the optimum under blocks." if lay else ""),
            *([lay["note"]] if lay and lay.get("note") else []),
            *_proxy_note(doc["rows"]),
            *(f"{r['policy']} {params_label(r['params'])}: refused {'under this layout' if lay else 'at this budget'} "
              f"({r['refused']})"
              for r in doc["rows"] if "refused" in r),
            *(f"{r['policy']}: not measured on this trace ({r['absent']})" for r in doc["rows"] if "absent" in r),
        ]),
    ]
    turned = [r for r in doc["rows"] if r.get("turns")]
    if turned:  # a conversation's trace: each row's retained mass over each turn's queries
        parts += ["", prose("Retained mass per turn (over each turn's queries: its question and its answer):", width), "",
                  aligned(["policy", "params", *(f"turn {t['turn']}" for t in turned[0]["turns"])],
                          [[r["policy"], params_label(r["params"]), *(t["retained_mass"] for t in r["turns"])]
                           for r in turned], width=width)]
    s = doc["sweep"]
    if s["rows"]:
        parts += [
            "",
            prose(f"{s['policy']} over {s['param']} (budget {doc['budget']}), sampled at {len(s['rows'])} windows; * marks "
                  "the largest retained mass of these (the calibration target's):", width),
            "",
            aligned(
                [s["param"], "retained_mass", f"top_{k}_recall", "largest sampled"],
                [[r[s["param"]], r["retained_mass"], r["top_k_recall"], "*" if r[s["param"]] == s["argmax"] else ""]
                 for r in s["rows"]],
                width=width,
            ),
        ]
    w = doc.get("window")
    if w is not None:
        parts += ["", prose(f"{w['policy']} over every {w['param']} {w['windows'][0]}..{w['windows'][1]}: best {w['best']} "
                            f"(retained mass {w['best_mass']:.4f}); recommended {w['recommended']} "
                            f"({w['recommended_mass']:.4f}): the smallest within {w['tolerance']:g} of the best", width)]
    if doc["targets"] is not None:
        parts += ["", "Calibration targets (docs/domain.md, the canonical trace):", "", _targets(doc["targets"], width)]
    else:
        parts += ["", prose("Calibration targets: not checked (they are for the canonical trace at budget 256).", width)]
    return "\n".join(parts)


def _quality(doc) -> str:
    if (doc.get("turns") if isinstance(doc, dict) else doc and isinstance(doc[0], dict) and doc[0].get("turns")):
        return _own("conversation_command", "render_quality", doc)  # quality --conversation: a row per turn
    if isinstance(doc, dict) and "allocate" in doc:  # quality --allocate: the split beside uniform's, the same memory
        u = doc["uniform"]
        loop = "closed loop" if doc.get("mode") == "closed" else "open loop"
        return (f"{doc['policy']} {params_label(doc['params'])} at budget {doc['budget']} per head on average, {loop}, "
                f"{doc['model']} on {doc['text']} ({doc['steps']} steps)\n\n" + aligned(
                    ["split", "nll", "delta_nll", "kl", "retained_mass"],
                    [[doc["allocate"], doc["nll"], doc["delta_nll"], doc["kl"], doc["retained_mass"]],
                     ["uniform", u["nll"], u["delta_nll"], u["kl"], u["retained_mass"]]])) + _searched(doc)
    if isinstance(doc, list) and doc and "allocate" in doc[0]:  # quality --allocate's grid: a row per cell
        return f"open loop, {doc[0]['model']} on {doc[0]['text']} ({doc[0]['steps']} steps)\n\n" + aligned(
            ["policy", "params", "budget", "allocate", "positions", "nll", "delta_nll", "kl", "retained_mass", "cached"],
            [[r["policy"], params_label(r["params"]), r["budget"], r["allocate"], r["positions"], r["nll"], r["delta_nll"],
              r["kl"], r["retained_mass"], "yes" if r["cached"] else "no"] for r in doc])
    rows = [doc] if isinstance(doc, dict) else doc
    table = aligned(
        ["policy", "params", "budget", "mode", "steps", "nll_full", "nll", "delta_nll", "delta_nll_key", "ppl", "kl",
         "retained_mass", "seconds"],
        [[r["policy"], params_label(r["params"]), r["budget"], r["mode"], r["steps"], r["nll_full"], r["nll"],
          r["delta_nll"], r.get("delta_nll_key"), r["ppl"], r["kl"], r["retained_mass"], round(r["seconds"], 1)]
         for r in rows],
    )
    return "\n".join([table, *sorted({_key_tokens_line(r) for r in rows if "key_rule" in r})])


def _searched(doc: dict) -> str:
    """``quality --allocate optimal --by kl``: the static splits measured, the moves kept, why it stopped."""
    if "candidates" not in doc:
        return ""
    s, by = doc["search"], doc["by"]
    moves = [[i + 1, ",".join(map(str, m["layers"])), m["direction"], m["step"], m[by]] for i, m in enumerate(doc["moves"])]
    return "\n".join([
        "", "", f"the static splits by the truth (the search starts from the lowest {by}: {doc['start']}):", "",
        aligned(["split", "kl", "delta_nll", "retained_mass"],
                [[c["allocator"], c["kl"], c["delta_nll"], c["retained_mass"]] for c in doc["candidates"]]), "",
        f"moves kept ({len(moves)}; each: every head of a group of layers given or relieved of step positions, "
        "the others making up the difference evenly):", "",
        aligned(["move", "layers", "direction", "step", by], moves) if moves else "(none: the start is kept)", "",
        f"{s['tried']} splits tried ({s['measured']} measured, the rest cached) in {s['seconds']:.1f} s; "
        f"stopped: {s['stopped']}"])


def _key_tokens_line(r: dict) -> str:
    """What ``delta_nll_key`` averages over, stated (one line per distinct rule and text)."""
    rule = r["key_rule"]
    return (f"\ndelta_nll_key: delta NLL over the {r['key_tokens']} of {r['steps'] - 1} positions that are key tokens "
            f"(LongPPL's rule: the next token's NLL with only <bos> and the last {rule['short_window']} positions "
            f"visible exceeds the full cache's by more than {rule['alpha']:g} nats, and its full-cache log-probability "
            f"is above {rule['beta']:g}; docs/domain.md, \"The truth\")")


#: the columns ``tune``'s text fits, on a terminal or in a file (issue 56: a terminal of 100 columns)
TUNE_WIDTH = 100


def _tune_per_layer(doc: dict, k: int, width: int) -> tuple[list[str], list[list]]:
    """The one-window-per-layer table and its model-wide row, shown only where KV heads share a layer."""
    if not any(r["kv_heads"] > 1 for r in doc["per_layer"]):
        return [], []
    head = doc["model"]["per_head_windows"]
    table = [
        "",
        "One window per layer, shared by its KV heads (on the mean of their curves), by retained mass:",
        "",
        aligned(["layer", "kv_heads", "window", "mass", "recall", "best", "best_mass"],
                [[r["layer"], r["kv_heads"], r["recommended_window"], r["recommended_mass"], r["recommended_recall"],
                  r["best_window"], r["best_mass"]] for r in doc["per_layer"]], width=width),
    ]
    return table, [["per-KV-head windows by retained mass", "per head", head["recommended_mass"],
                    head["recommended_recall"]]]


def _at_defaults(name: str) -> str:
    """A baseline's name with its parameters at their defaults (``streaming_llm sinks=4``)."""
    from ..policies import POLICIES

    cls = POLICIES.get(name)
    params = " ".join(f"{p.name}={p.default}" for p in cls.tunables) if cls is not None else ""
    return f"{name} {params}".strip()


def _tune(doc: dict, width: int = TUNE_WIDTH) -> str:
    """``kvsim tune``'s document in ``width`` columns: each trace's figures by retained mass (the window rule of
    ``kvsim.analysis.windows``), the model-wide figures, then the run's one recommendation, said once with the
    rule that chose it (``--by``), and what the tune file deploys."""
    k, tol = doc["top_k"], doc["tolerance"]
    m = doc["model"]
    one, per, base = m["one_window"], m["per_layer_windows"], m["baselines"]
    rows = [[r["layer"], r["head"], r["attention"], r["recommended_window"], r["recommended_mass"], r["recommended_recall"],
             r["best_window"], r["best_mass"], *(r[p]["retained_mass"] for p in base)] for r in doc["layers"]]
    per_layer, by_head = _tune_per_layer(doc, k, width)
    run = doc["run"]
    how = "serially" if run["executor"] == "serial" else f"on Dask ({run['workers']} workers, {run['scheduler']})"
    swept = (f"under {doc['layout']} ({doc['memory']} positions), recent_window at "
             f"{', '.join(map(str, doc['swept_windows']))} (the candidates the layout leaves room for, each a reference "
             "replay)" if "layout" in doc else f"recent_window {doc['windows'][0]}..{doc['windows'][1]} swept")
    baselines = f"; {', '.join(base)}: each baseline's retained mass" if base else ""
    return "\n".join([
        prose(f"{doc['policy']} on {doc['trace']} at budget {doc['budget']}: {swept}.", width),
        "",
        prose(f"Each trace by retained mass: window, the smallest within {tol} of the trace's best retained mass, "
              f"its mass and recall (top-{k}); best, that best, and best_mass{baselines}.", width),
        "",
        aligned(["layer", "kv_head", "attention", "window", "mass", "recall", "best", "best_mass", *base], rows,
                width=width),
        *per_layer,
        "",
        "Model-wide (mean over every layer and KV head):",
        "",
        aligned(["setting", WINDOW, "retained_mass", f"top_{k}_recall"], [
            ["per-layer windows by retained mass", "per layer", per["recommended_mass"], per["recommended_recall"]],
            *by_head,
            [f"one window, within {tol} of the best mass", one["recommended_window"], one["recommended_mass"],
             one["recommended_recall"]],
            ["one window, the best mass", one["best_window"], one["best_mass"], one["best_recall"]],
            *([_at_defaults(p), "n/a", b["retained_mass"], b["top_k_recall"]] for p, b in base.items()),
        ], text=False, width=width),
        "",
        prose(_recommendation(doc), width),
        *([prose(f"(by default: {doc['by_detail']['auto']})", width)] if (doc.get("by_detail") or {}).get("auto") else []),
        *([prose(f"({doc['by_caveat']})", width)] if doc.get("by_caveat") else []),
        *_allocate_lines(doc, width),
        *_layout_search_lines(doc, width),
        "",
        prose(_tune_time_line(doc, how), width),
    ])


def _layout_search_lines(doc: dict, width: int) -> list[str]:
    """``tune --search-layout``: each candidate layout's model_window and its figure, and the one chosen."""
    if not (t := doc.get("layout_search")):
        return []
    rows = [[c["layout"], c["memory"], c["model_window"], c["figure"], c["seconds"]] for c in t["candidates"]]
    left = "; ".join(f"{k}: {v}" for k, v in t["left_out"].items())
    return ["", prose(f"serving layouts searched ({t['rule']}):", width), "",
            aligned(["layout", "memory", "model_window", t["by"], "seconds"], rows, width=width), "",
            prose(f"chosen: {t['chosen']} (the document above is its tune; --save-plan writes it)"
                  + (f"; left out: {left}" if left else ""), width)]


def _allocate_lines(doc: dict, width: int) -> list[str]:
    """``tune --allocate auto``: each candidate allocator's figure and the one chosen (``generate --allocate``)."""
    a = doc.get("allocate")
    if not a:
        return []
    cols = ["allocator", a["by"]] + (["retained_mass"] if a["by"] != "retained_mass" else [])
    rows = [[c["allocator"], c["figure"]] + ([c["retained_mass"]] if a["by"] != "retained_mass" else [])
            for c in a["candidates"]]
    return ["", prose(f"allocator at recent_window {a['recent_window']} in every layer, by {a['by']}"
                      + (f" ({a['note']})" if a.get("note") else "") + ":", width), "", aligned(cols, rows, width=width),
            "", prose(f"chosen: {a['chosen']} (deploys with generate --allocate on this file); left out: "
                      + "; ".join(f"{k}: {v}" for k, v in a["left_out"].items()), width)]


def _recommendation(doc: dict) -> str:
    """The run's one recommendation, said once with the rule that chose it: what the tune file deploys
    (``generate --windows``, ``kvsim.hf.cache(windows=...)``), by ``--by``, and its KL where the truth measured it.
    Every other window the text shows is a figure by retained mass, labelled so."""
    d = doc.get("deploy") or {}
    window, by = doc["model_window"], doc["by"]
    windows = [r[WINDOW] for r in d.get("per_layer", [])] or [window]
    if len(set(windows)) == 1:
        what = f"recent_window {windows[0]} in every layer" + (" (model_window)" if windows[0] == window else "")
    else:
        what = f"recent_window per layer {', '.join(map(str, windows))}"
    rule = d.get("rule", "")
    if rule.startswith("per layer"):  # --per-layer: the deploy rows' own rule
        how = f"by {d.get('by', by)}: " + rule.replace("each layer's recommended window by retained mass",
                                                       "each layer's window by retained mass")
    else:
        bd = doc.get("by_detail") or {}
        if bd.get("note"):
            how = (f"by retained mass, the smallest window within {doc['tolerance']} of the best model-wide mass "
                   f"({by} fell back: {bd['note']})")
        elif bd.get("windows"):
            lowest = by in ("kl", "delta_nll")
            value = "" if by == "kl" and d.get("kl") is not None else f" ({by} {bd['value']:.4g})"  # said once
            how = (f"by {by}{' (the truth)' if lowest else ''}: the {'lowest' if lowest else 'best'} of "
                   f"{len(bd['windows'])} candidate windows{value}")
        else:
            how = f"by {by}: the smallest window within {doc['tolerance']} of the best model-wide retained mass"
        if "layout" in doc:
            how += f", under {doc['layout']}"
    kl = (f"KL {d['kl']:.4f} (open loop)" if d.get("kl") is not None
          else f"KL {d['kl_note']}" if d.get("kl_note") else "")
    return (f"recommended: {what}, {how}" + (f"; {kl}" if kl else "")
            + ". The tune file (--json) deploys it: generate --windows FILE.")


def _tune_time_line(doc: dict, how: str) -> str:
    """Where the run's time went: the sweeps, the truth (read or measured), the per-layer search."""
    run = doc["run"]
    parts = [f"{len(doc['layers'])} traces swept {how} in {run.get('sweep_seconds', run['seconds']):.1f} s"]
    truth = run.get("truth")
    if truth is not None:
        parts.append(f"the truth: {truth['read']} configurations read (shipped or cached), {truth['measured']} measured, "
                     f"{run.get('by_seconds', 0.0) + run.get('deploy_seconds', 0.0):.1f} s")
    search = (doc.get("deploy") or {}).get("search")
    if search:
        parts.append(f"the per-layer search {search['measurements']} configurations in {search['seconds']:.1f} s")
    if "allocate_seconds" in run:
        parts.append(f"the allocators {run['allocate_seconds']:.1f} s")
    if t := doc.get("layout_search"):  # the search's tunes, the chosen one's among them, are the run
        parts.append(f"the layout search {len(t['candidates'])} tunes in {t['seconds']:.1f} s" + (
            f" (the truth: {t['truth']['read']} read, {t['truth']['measured']} measured)" if t.get("truth") else ""))
    total = t["seconds"] if t else run["seconds"]
    return "; ".join(parts) + f"; {total:.1f} s in all"


def _targets(targets: list[dict], width: int | None) -> str:
    """The calibration targets: a table of figure, target, measured and result (``width`` None, or wide enough
    for it); else each target as its result and figure, then its target and what was measured, indented."""
    rows = [[t["figure"], t["target"], t["measured"], "PASS" if t["pass"] else "FAIL"] for t in targets]
    table = aligned(["figure", "target", "measured", "result"], rows, text=True)
    if width is None or max(len(line) for line in table.splitlines()) <= width:
        return table
    import textwrap

    blocks = []
    for figure, target, measured, result in rows:
        head = textwrap.wrap(figure, max(width - 6, 20), break_long_words=False)
        blocks += [f"{result}  {head[0]}", *(f"      {x}" for x in head[1:]),
                   *textwrap.wrap(f"target {target}; measured {measured}", max(width, 26), initial_indent="      ",
                                  subsequent_indent="      ", break_long_words=False)]
    return "\n".join(blocks)


RENDERERS = {"replay": _replay, "sweep": _sweep, "describe": _describe, "record": _record, "export": _export,
             "table": _table, "bench": _bench, "claims": _claims, "quality": _quality, "tune": _tune, "cache": _cache,
             "generate": lambda doc: _own("generate_command", "render_generate", doc),
             "proxies": lambda doc: _own("proxies_command", "render_proxies", doc),
             "needle": lambda doc: _own("needle_command", "render_needle", doc),
             "policies": lambda doc: _own("policies_command", "render_policies", doc),
             "learn": lambda doc: _own("learn_command", "render_learn", doc),
             "serve": lambda doc: _own("serve_command", "render_serve", doc)}


def _own(module: str, name: str, doc) -> str:
    """``doc`` rendered by the function ``name`` of the command's own module, imported now."""
    return getattr(importlib.import_module(f".{module}", __package__), name)(doc)


#: the commands whose text fits a width (``render``'s ``width``; ``--wide`` turns it off)
FITTED = {"table": _table}


def render(command: str, doc, width: int | None = None) -> str:
    """``doc`` (what ``command`` returned) as the text the command prints without ``--json``; ``width``: the
    columns a ``FITTED`` command's text wraps to (None: its tables' rows one line each, however wide)."""
    if width is not None and command in FITTED:
        return FITTED[command](doc, width)
    return RENDERERS[command](doc)


def terminal_width() -> int | None:
    """The columns of the terminal stdout is (``COLUMNS`` first, as ``shutil`` reads it); None when stdout is a
    file or a pipe, which get every column: nothing wraps there, and a script reads the same text on any terminal."""
    import shutil
    import sys

    try:
        if not sys.stdout.isatty():
            return None
    except (AttributeError, ValueError):  # replaced by something that is no file, or closed
        return None
    return max(shutil.get_terminal_size().columns, 40)

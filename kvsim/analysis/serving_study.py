"""docs/serving.md's study tables from the study's JSON (``kvsim/bench/scripts/serving_study.py measure`` writes it,
``kvsim/bench/scripts/serving_study.py tables`` prints these): what each serving layout costs each policy, against the
same policy free of it, by the open-loop truth (KL, delta NLL, retained mass, each the mean over the
study's texts), the closed loop on a subset, and the pass key.

A row is one measurement: ``model``, ``text``, ``budget``, ``policy``, ``layout`` (the study's name for it)
and its fields, ``mode`` (open, closed, passkey), and either the figures or ``why`` it was not measured
(the layout's refusal in one line, or shared selection on one KV head: a no-op)."""

from __future__ import annotations

from collections import defaultdict
from statistics import mean

SHORT = {"gemma3-270m": "Gemma-3-270M", "smollm2-135m": "SmolLM2-135M"}


def _order(rows: list[dict], key: str) -> list:
    seen: dict = {}
    for r in rows:
        seen.setdefault(r[key], None)
    return list(seen)


def _means(rows: list[dict], metric: str) -> dict:
    """(model, budget, policy, layout) -> (mean of ``metric`` over texts, texts measured) or the reason."""
    cells: dict = defaultdict(list)
    why: dict = {}
    for r in rows:
        k = (r["model"], r["budget"], r["policy"], r["layout"])
        if r.get("why"):
            why[k] = r["why"]
        else:
            cells[k].append(r[metric])
    out = {k: mean(v) for k, v in cells.items()}
    out.update({k: w for k, w in why.items() if k not in out})
    return out


def _word(why: str) -> str:
    return "no-op" if why.startswith("no-op") else "refused"


def _cost_table(rows, model, budget, metric, digits, layouts, policies) -> list[str]:
    m = _means(rows, metric)
    lines = ["| policy | " + " | ".join(layouts) + " |", "| --- |" + " ---: |" * len(layouts)]
    for p in policies:
        free = m.get((model, budget, p, layouts[0]))
        cells = []
        for name in layouts:
            v = m.get((model, budget, p, name))
            if v is None:
                cells.append("")
            elif isinstance(v, str):
                cells.append(_word(v))
            elif name == layouts[0] or not isinstance(free, float):
                cells.append(f"{v:.{digits}f}")
            else:
                cells.append(f"{v:.{digits}f} ({v - free:+.{digits}f})")
        if any(cells):
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return lines


def _pair_table(rows, model, budgets, metric, digits, layouts, policies) -> list[str]:
    m = _means(rows, metric)
    lines = ["| policy | " + " | ".join(layouts) + " |", "| --- |" + " ---: |" * len(layouts)]
    for p in policies:
        cells = []
        for name in layouts:
            vs = [m.get((model, b, p, name)) for b in budgets]
            if all(v is None for v in vs):
                cells.append("")
            else:
                cells.append(" / ".join("" if v is None else _word(v) if isinstance(v, str) else f"{v:.{digits}f}"
                                        for v in vs))
        if any(cells):
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return lines


def _passkey_table(rows, model, layouts, policies) -> list[str]:
    by = {(r["policy"], r["layout"]): r for r in rows if r["model"] == model}
    lines = ["| policy | " + " | ".join(layouts) + " |", "| --- |" + " --- |" * len(layouts)]
    for p in policies:
        cells = []
        for name in layouts:
            r = by.get((p, name))
            if r is None:
                cells.append("")
            elif r["why"]:
                cells.append(_word(r["why"]))
            else:
                cells.append(" / ".join("found" if a == 1.0 else "-" if a == 0.0 else f"{a:.0%}" for a in r["found"]))
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return lines


def markdown(doc: dict) -> str:
    """The study's tables, as docs/serving.md prints them."""
    rows, plan = doc["rows"], doc["plan"]
    out: list[str] = []
    open_rows = [r for r in rows if r["mode"] == "open"]
    texts = len(plan["texts"])
    for model in _order(open_rows, "model"):
        mine = [r for r in open_rows if r["model"] == model]
        layouts, policies = _order(mine, "layout"), _order(mine, "policy")
        for budget in plan["budgets"]:
            out += [f"KL, open loop, {SHORT.get(model, model)}, budget {budget} (mean over {texts} texts; in brackets "
                    "the change from the same policy free of any layout):", ""]
            out += _cost_table(mine, model, budget, "kl", 3, layouts, policies) + [""]
        pair = " / ".join(str(b) for b in plan["budgets"])
        out += [f"Delta NLL, open loop, {SHORT.get(model, model)}, budgets {pair} (mean over {texts} texts):", ""]
        out += _pair_table(mine, model, plan["budgets"], "delta_nll", 3, layouts, policies) + [""]
        out += [f"Retained mass, open loop, {SHORT.get(model, model)}, budgets {pair} (mean over {texts} texts):", ""]
        out += _pair_table(mine, model, plan["budgets"], "retained_mass", 3, layouts, policies) + [""]
    closed = [r for r in rows if r["mode"] == "closed"]
    for model, text, budget in dict.fromkeys((r["model"], r["text"], r["budget"]) for r in closed):
        mine = [r for r in closed if (r["model"], r["text"], r["budget"]) == (model, text, budget)]
        out += [f"KL, closed loop, {SHORT.get(model, model)}, {text}, budget {budget} (in brackets the change from the "
                "policy free of any layout):", ""]
        out += _cost_table(mine, model, budget, "kl", 3, _order(mine, "layout"), _order(mine, "policy")) + [""]
    keys = [r for r in rows if r["mode"] == "passkey"]
    for model in _order(keys, "model"):
        mine = [r for r in keys if r["model"] == model]
        r0 = mine[0]
        control = next((r["control"] for r in mine if r["control"]), None)
        depths = " / ".join(str(d) for d in plan["passkey"]["depths"][model])
        said = "" if control is None else " (the full cache: " + " / ".join(
            "found" if a == 1.0 else "-" for a in control) + ")"
        out += [f"Pass key, {SHORT.get(model, model)}, {r0['length']} tokens, budget {r0['budget']}, found at depth "
                f"{depths}{said}:", ""]
        out += _passkey_table(mine, model, _order(mine, "layout"), _order(mine, "policy")) + [""]
    return "\n".join(out).rstrip() + "\n"

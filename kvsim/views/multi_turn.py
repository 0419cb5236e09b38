"""docs/multi-turn.md, reprinted from the study's JSON (``kvsim/bench/scripts/multi_turn_study.py``; issue 57, item 5)::

    python -m kvsim.views.multi_turn [docs/multi-turn-study.json] [docs/multi-turn.md]

One table per (model, keys, length): a row per configuration, a column per budget, each cell turn 1's key found
and the later turns' keys found, over the trials whose full cache found that turn's key; the retained attention
mass of the run beside the exact optimum's over the whole conversation; per exact-prompt configuration the delta
NLL per turn of the reference answers teacher-forced, open loop (the study's ``delta_nll``); and per configuration
the closed loop's delta NLL at turn 1 and over the later turns, where measured (the compressed prompts have only
that loop). The page says which cells were measured and which of the study's grid were not. Text only; no torch.
tests/test_multi_turn_study.py checks the shipped page equals this reprint of the shipped JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JSON = ROOT / "docs" / "multi-turn-study.json"
PAGE = ROOT / "docs" / "multi-turn.md"

HEAD = """# A conversation on one compressed cache: turn 1 against later turns

A pass key per turn (docs/needle.md, "A conversation: a pass key per turn"): K five-digit keys hidden in one
filler context, turn i asking for key i on the same cache, each question fed after what the cache wrote, each
answer decoded greedily through the evicting cache (8 tokens a turn). *snapkv aware* compresses the prompt to
the budget with the first question in snapkv's observation window, *snapkv agnostic* without it (the context
alone, the question fed after); both then decode with snapkv at the budget. *reconstruction* compresses the
prompt with KVzip's query-agnostic scorer (the attention each position draws while the model is teacher-forced to
repeat the context; docs/scorers.md), then decodes with snapkv. The other policies step the whole prompt at the
budget. The study records found per turn, each key's fate and the retained attention mass; and the delta NLL per
turn of the reference answer (" {key}." after each question of the same context) teacher-forced: the measure of
`python -m kvsim quality --conversation` (docs/cli.md "Conversations"). The configurations that step the whole
prompt are measured in its open loop (the policy's schedule, replayed on the full cache's attention, masks one
teacher-forced pass); their closed loop (about a minute a cell at 1,024 tokens on Gemma-3-270M here, every token
fed one at a time) is not measured. The compressed prompts have no open loop: they are measured in the closed loop
(`quality --conversation --prefill-budget B --prefill-policy SCORER --query aware|agnostic`: the context
compressed once to the budget as the run compressed it, then every question and answer token teacher-forced
through that cache, which keeps evicting), in a table of their own per group, "not measured" where the study does
not hold it.

This page is reprinted from docs/multi-turn-study.json by `python -m kvsim.views.multi_turn`; the study is
`python kvsim/bench/scripts/multi_turn_study.py measure` (its flags choose a subset; it resumes from the JSON).
"""


def _cells(doc: dict) -> list[tuple[tuple, dict]]:
    out = []
    for key, cell in doc["cells"].items():
        model, keys, length, budget, config, trial = (x.strip() for x in key.split("|"))
        out.append(((model, int(keys.split()[0]), int(length), int(budget), config, int(trial.split()[1])), cell))
    return out


def _configs(plan: dict) -> list[str]:
    """The study's configurations in its order (``[name, policy, scorer, query]`` rows)."""
    configs = plan["configs"]
    return list(configs) if isinstance(configs, dict) else [c[0] for c in configs]


def _exact(plan: dict, config: str) -> bool:
    """Whether ``config`` steps the whole prompt (no compression)."""
    configs = plan["configs"]
    row = configs[config] if isinstance(configs, dict) else next(c[1:] for c in configs if c[0] == config)
    return row[1] is None


def _found(cells: list[dict]) -> str:
    """``t1 a/b, later c/d``: found over the trials (turns) the control found."""
    measured = [c for c in cells if "why" not in c]
    if not measured:
        why = sorted({c["why"] for c in cells})
        return "not measured: " + "; ".join(why)
    first = [c["found"][0] for c in measured if c["control_found"][0]]
    later = [f for c in measured for f, ok in zip(c["found"][1:], c["control_found"][1:], strict=True) if ok]
    text = f"turn 1 {sum(first)}/{len(first)}, later {sum(later)}/{len(later)}"
    every = [c["found"] for c in measured]
    text += f" (every trial: {sum(f[0] for f in every)}/{len(every)}, {sum(sum(f[1:]) for f in every)}/" \
            f"{sum(len(f) - 1 for f in every)})"
    held = [sum(c["held_to_end"][i] for c in measured) for i in range(len(measured[0]["held_to_end"]))]
    heads = sum(c["heads"] for c in measured)
    text += f"; key held to the end in {', '.join(map(str, held))} of {heads} heads"
    if all("retained" in c for c in measured):
        best_held = [sum(c["optimal_held_to_end"][i] for c in measured) for i in range(len(held))]
        mine = sum(c["retained_after_prompt"] for c in measured) / len(measured)
        best = sum(c["optimal_retained_after_prompt"] for c in measured) / len(measured)
        text += f" (optimum {', '.join(map(str, best_held))}); mass {mine:.3f} (optimum {best:.3f})"
    return text


def _rate(hits: list[bool]) -> str:
    return f"{sum(hits)} of {len(hits)}" + (f" ({100 * sum(hits) / len(hits):.0f}%)" if hits else "")


def _later(cell: dict) -> tuple[list[bool], list[bool]]:
    """Turn 1's found and the later turns' found, over the turns the full cache found."""
    first = [cell["found"][0]] if cell["control_found"][0] else []
    return first, [f for f, ok in zip(cell["found"][1:], cell["control_found"][1:], strict=True) if ok]


def _scbench(cells: list) -> str:
    """SCBench's finding read as later turns failing more than turn 1, by found."""
    first = [f for _, c in cells for f in _later(c)[0]]
    later = [f for _, c in cells for f in _later(c)[1]]
    by_budget = []
    for b in sorted({key[3] for key, _ in cells}):
        f1 = [f for key, c in cells if key[3] == b for f in _later(c)[0]]
        fl = [f for key, c in cells if key[3] == b for f in _later(c)[1]]
        by_budget.append(f"budget {b}: turn 1 {_rate(f1)}, later {_rate(fl)}")
    by_group = []
    for g in sorted({key[:3] for key, _ in cells}):
        f1 = [f for key, c in cells if key[:3] == g for f in _later(c)[0]]
        fl = [f for key, c in cells if key[:3] == g for f in _later(c)[1]]
        by_group.append(f"{g[0]}, {g[1]} keys, {g[2]:,} tokens: turn 1 {_rate(f1)}, later {_rate(fl)}")
    if not first or not later:
        verdict = "cannot be told here: the full cache found too few keys for turn 1 and later turns to compare"
    elif sum(later) / len(later) < sum(first) / len(first) - 0.1:
        verdict = "reproduces here: the budgeted caches find later turns' keys less often than turn 1's"
    elif sum(later) / len(later) > sum(first) / len(first) + 0.1:
        verdict = "does not reproduce here: the budgeted caches find later turns' keys more often than turn 1's"
    else:
        verdict = "does not reproduce here: later turns fare about as turn 1 (within 10 points)"
    lost = len(first) + len(later) - sum(first) - sum(later)
    return (f"**SCBench** (methods holding less than O(n) memory fail in multi-turn use): every configuration at a "
            f"budget, turn 1's key found in {_rate(first)} of the turns the full cache found, later turns' in "
            f"{_rate(later)} ({'; '.join(by_budget)}; {'; '.join(by_group)}). So the finding, read as later turns failing more than the "
            f"first, {verdict}. The budgeted caches missed {lost} of the {len(first) + len(later)} turns the full "
            "cache answered, turn 1 included; this study has no one-question run beside them, so it does not say "
            "how much of that is owed to the conversation. Turn i asks for key i, "
            "which sits at the i-th depth, so turn order and depth go together here: a later turn's key is also "
            "nearer the question, which these models favour (docs/needle.md, \"A conversation: a pass key per turn\").\n")


def _losses(doc: dict, mode: str = "open") -> list[tuple[tuple, dict]]:
    """The measured delta NLLs of one loop, keyed as the cells are (model, keys, length, budget, configuration, trial),
    and mode."""
    out = []
    for key, row in doc.get("delta_nll", {}).items():
        *cell, loop = (x.strip() for x in key.split("|"))
        if loop != mode:
            continue
        (parsed, _), = _cells({"cells": {" | ".join(cell): row}})
        out.append(((*parsed, loop), row))
    return out


def _turn_means(rows: list[dict]) -> tuple[float, float, int]:
    """Mean delta NLL at turn 1 and over the later turns (each row's later turns averaged first), and how many rows
    have the later turns above turn 1."""
    first = [r["turns"][0]["delta_nll"] for r in rows]
    later = [sum(t["delta_nll"] for t in r["turns"][1:]) / (len(r["turns"]) - 1) for r in rows]
    return sum(first) / len(first), sum(later) / len(later), sum(b > a for a, b in zip(first, later, strict=True))


def _scbench_nll(doc: dict) -> str | None:
    """SCBench's finding by the delta NLL of the reference answers teacher-forced (every turn, found or not)."""
    rows = _losses(doc)
    if not rows:
        return None
    parts = []
    for name, pick in [*((f"budget {b}", lambda key, b=b: key[3] == b) for b in sorted({key[3] for key, _ in rows})),
                       *((f"{g[0]}, {g[1]} keys, {g[2]:,} tokens", lambda key, g=g: key[:3] == g)
                         for g in sorted({key[:3] for key, _ in rows}))]:
        mine = [r for key, r in rows if pick(key)]
        a, later, above = _turn_means(mine)
        parts.append(f"{name}: turn 1 {a:+.3f}, later {later:+.3f}, later above in {above} of {len(mine)}")
    a, later, above = _turn_means([r for _, r in rows])
    if later > a and above > len(rows) / 2:
        verdict = "reproduces: the later turns' answers lose more than turn 1's"
    elif later < a and above < len(rows) / 2:
        verdict = "does not reproduce: the later turns' answers lose less than turn 1's"
    else:
        verdict = "is mixed: the mean and the count of cells disagree"
    return (f"By the delta NLL of each turn's reference answer teacher-forced ({len(rows)} exact-prompt cells, the "
            f"open loop; every turn counts, found or not), turn 1 {a:+.3f} nats against the full cache, the later "
            f"turns {later:+.3f}, the later turns above turn 1 in {above} of {len(rows)} cells ({'; '.join(parts)}). "
            f"By this measure SCBench's finding {verdict}. Order and depth go together here as above, and each later "
            "turn is teacher-forced after the earlier turns' reference answers, not the run's own. The compressed prompts "
            "have no open loop; KVzip's finding by their closed loop follows.\n")


def findings(doc: dict) -> list[str]:
    """What the measured cells say of SCBench's and KVzip's findings, computed from them (either way)."""
    cells = [(k, c) for k, c in _cells(doc) if "why" not in c]
    if not cells:
        return ["No cell is measured yet, so neither finding is tested here.\n"]
    out = ["## The two findings, as measured here\n",
           "Counted over the measured cells only, and only on the turns whose full cache found that turn's key (a "
           "turn the full cache missed says nothing of what compression lost).\n"]
    control = {}
    for (m, k, n, _b, _c, t), c in cells:
        control[(m, k, n, t)] = c["control_found"]
    c_first = [v[0] for v in control.values()]
    c_later = [f for v in control.values() for f in v[1:]]
    out.append(f"The full cache itself found turn 1's key in {_rate(c_first)} conversations and a later turn's in "
               f"{_rate(c_later)} turns.\n")
    out.append(_scbench(cells))
    if (nll := _scbench_nll(doc)) is not None:
        out.append(nll)
    out.append(_kvzip(cells))
    out.append(_kvzip_nll(doc))
    return out


def _paired(rows: list) -> tuple[dict, dict]:
    """snapkv aware's rows (cells or delta NLL rows, ``(key, row)``) by their cell and trial, and each query-agnostic
    compression's rows paired with aware's of the same cell and trial: ``(aware, {other: [(aware's, other's), ...]})``."""
    aware = {(key[:4], key[5]): r for key, r in rows if key[4] == "snapkv aware"}
    return aware, {other: [(aware[(key[:4], key[5])], r) for key, r in rows if key[4] == other and (key[:4], key[5]) in aware]
                   for other in ("snapkv agnostic", "reconstruction")}


def _kvzip(cells: list) -> str:
    """KVzip's finding: snapkv aware against each query-agnostic compression, paired trial by trial."""
    aware, paired = _paired(cells)
    rows, loose = [], []
    for other, pairs in paired.items():
        if not pairs:
            rows.append(f"{other}: no trial measured beside snapkv aware")
            continue
        lost = sum(a["found"][0] and any(not fa and fo and ok for fa, fo, ok in zip(a["found"][1:], o["found"][1:],
                                                                                     a["control_found"][1:], strict=True))
                   for a, o in pairs)
        a1, al = [f for a, _ in pairs for f in _later(a)[0]], [f for a, _ in pairs for f in _later(a)[1]]
        o1, ol = [f for _, o in pairs for f in _later(o)[0]], [f for _, o in pairs for f in _later(o)[1]]
        keeps = ("keeps more" if sum(ol) > sum(al) else "keeps less" if sum(ol) < sum(al) else "keeps as much") + \
            " of what a later question needs"
        loose.append(f"{'reproduces' if sum(ol) > sum(al) else 'does not reproduce'} against {other} (later "
                     f"{sum(ol)} of {len(ol)} against aware's {sum(al)} of {len(al)})")
        rows.append(f"against {other} over {len(pairs)} paired trials: aware turn 1 {_rate(a1)}, later {_rate(al)}; "
                    f"{other} turn 1 {_rate(o1)}, later {_rate(ol)} (it {keeps}); aware found turn 1's key and lost a "
                    f"later key that {other} found in {lost}")
    said = [r for r in rows if "paired" in r]
    testable = [c for key, c in aware.items() if c["control_found"][0] and any(c["control_found"][1:])]
    aware_first = sum(c["found"][0] for c in aware.values() if c["control_found"][0])
    if said and testable and not aware_first:
        kv = ("cannot show in its strict form here (a query-aware compression finds turn 1's key and loses a later key "
              "that the query-agnostic one keeps): snapkv aware found turn 1's key in none of the trials, so only the "
              "looser reading below can be told")
    elif said and not testable:
        kv = ("cannot be told here: in no paired trial did the full cache find both turn 1's key and a later one")
    elif not said:
        kv = "cannot be told here: no query-agnostic configuration was measured beside snapkv aware"
    else:
        pairs_lost = sum(int(r.rsplit(" in ", 1)[1]) for r in said)
        kv = (f"shows in {pairs_lost} paired trial(s)" if pairs_lost else
              "does not show in any paired trial") + " in its strict form (a query-aware compression finds turn 1's key " \
            "and loses a later key that the query-agnostic one keeps); each half, per configuration, is in the figures " \
            "above"
    return (f"**KVzip** (query-aware compression loses what a later question needs; query-agnostic reconstruction "
            f"keeps it): snapkv aware {'; '.join(rows)}. So the finding {kv}."
            + (f" Read loosely (a query-agnostic compression finds later turns' keys more often than snapkv aware, over "
               f"the turns the full cache found), it {' and '.join(loose)}." if loose else "") + "\n")


def _split(row: dict) -> tuple[float, float]:
    """A delta NLL row's turn 1 and the mean of its later turns."""
    turns = [t["delta_nll"] for t in row["turns"]]
    return turns[0], sum(turns[1:]) / (len(turns) - 1)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _kvzip_nll(doc: dict) -> str:
    """KVzip's finding by the closed loop's delta NLL: snapkv aware against each query-agnostic compression, paired
    trial by trial, turn 1 and the later turns."""
    rows = _losses(doc, "closed")
    parts, verdicts = [], []
    for other, pairs in _paired(rows)[1].items():
        if not pairs:
            parts.append(f"{other}: no trial measured beside snapkv aware")
            continue
        a1, al = (_mean([_split(a)[i] for a, _ in pairs]) for i in (0, 1))
        o1, ol = (_mean([_split(o)[i] for _, o in pairs]) for i in (0, 1))
        worse = sum(_split(a)[1] > _split(o)[1] for a, o in pairs)
        parts.append(f"against {other} over {len(pairs)} paired trial{'s' * (len(pairs) != 1)}: aware turn 1 {a1:+.3f}, "
                     f"later {al:+.3f}; {other} turn 1 {o1:+.3f}, later {ol:+.3f}; aware's later turns lose more than "
                     f"{other}'s in {worse} of {len(pairs)}")
        said = ("reproduces" if al > ol and worse > len(pairs) / 2 else "does not reproduce"
                if al < ol and worse < len(pairs) / 2 else "is mixed (the mean and the count of trials disagree)")
        verdicts.append(f"{said} against {other}")
    head = ("**KVzip by the delta NLL** (each turn's reference answer teacher-forced through the compressed cache, "
            "quality's closed loop; every turn counts, found or not): ")
    if not verdicts:
        return head + "cannot be told here: no query-agnostic compression's closed-loop delta NLL is measured beside " \
            "snapkv aware's.\n"
    return (head + f"snapkv aware {'; '.join(parts)}. Read as a query-aware compression's later turns losing more than a "
            f"query-agnostic one's, the finding {' and '.join(verdicts)}. Turn order and depth go together here, as "
            "above.\n")


def _closed_table(doc: dict, plan: dict, group: tuple, budgets: list[int]) -> list[str]:
    """One group's closed-loop delta NLL: a row per configuration, a column per budget, each cell the mean over the
    measured trials of turn 1's delta NLL and of the later turns', "not measured" where the study lacks it."""
    rows = [(key, r) for key, r in _losses(doc, "closed") if key[:3] == group]
    if not rows:
        return ["\nClosed-loop delta NLL (quality --conversation's closed loop, the compressed prompts' only one): not "
                "measured for this group.\n"]
    lines = ["\nClosed-loop delta NLL of the reference answers teacher-forced (nats against the full cache; a compressed "
             "prompt compressed once as its run was, then every question and answer token stepped through the cache; "
             "the mean over the measured trials of turn 1's and of the later turns'):\n",
             "| configuration | " + " | ".join(f"budget {b}" for b in budgets) + " |", "| --- |" + " --- |" * len(budgets)]
    for config in _configs(plan):
        cells = []
        for b in budgets:
            mine = [r for key, r in rows if key[3] == b and key[4] == config]
            cells.append(f"turn 1 {_mean([_split(r)[0] for r in mine]):+.3f}, later {_mean([_split(r)[1] for r in mine]):+.3f}"
                         f" ({len(mine)} trial{'s' * (len(mine) != 1)})" if mine else "not measured")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return lines


def _nll_table(doc: dict, plan: dict, group: tuple) -> list[str]:
    """One group's delta NLL per turn (open loop): a row per exact-prompt configuration, a column per budget, each
    cell the mean over the measured trials of every turn's delta NLL, turn 1 first; the full cache's NLL below."""
    rows = [(key, r) for key, r in _losses(doc) if key[:3] == group]
    if not rows:
        return [f"\nNo delta NLL is measured for this group yet (`--nll`, {plan.get('answer', ' {key}.')!r} "
                "teacher-forced)."]
    budgets = sorted({key[3] for key, _ in rows})
    lines = ["\nDelta NLL per turn of the reference answer teacher-forced (nats against the full cache, quality "
             "--conversation's open loop; the mean over the measured trials, turn 1 first; the compressed prompts have "
             "no open loop, their closed loop is below):\n", "| configuration | " + " | ".join(f"budget {b}" for b in budgets) + " |",
             "| --- |" + " --- |" * len(budgets)]
    for config in _configs(plan):
        cells = []
        for b in budgets:
            mine = [r for key, r in rows if key[3] == b and key[4] == config]
            turns = [sum(r["turns"][i]["delta_nll"] for r in mine) / len(mine) for i in range(len(mine[0]["turns"]))] \
                if mine else []
            cells.append(" / ".join(f"{x:+.3f}" for x in turns) + f" ({len(mine)} trial{'s' * (len(mine) != 1)})" if mine else "-")
        if any(c != "-" for c in cells):
            lines.append(f"| {config} | " + " | ".join(cells) + " |")
    full = {key[5]: [t["nll_full"] for t in r["turns"]] for key, r in rows}
    said = "; ".join(f"trial {t}: " + ", ".join(f"{x:.3f}" for x in v) for t, v in sorted(full.items()))
    lines.append(f"\nThe full cache's NLL on each turn's answer, turn 1 first: {said}.")
    return lines


def _absent(plan: dict, mine: list) -> str:
    """The group's cells of the study's grid that are not measured, by configuration."""
    have = {(key[3], key[4], key[5]) for key, c in mine if "why" not in c}
    every = [(b, t) for b in plan["budgets"] for t in range(1, plan["trials"] + 1)]
    out = []
    for config in _configs(plan):
        lack = [(b, t) for b, t in every if (b, config, t) not in have]
        if len(lack) == len(every):
            out.append(f"{config} (none of its {len(every)})")
        elif lack:
            out.append(f"{config} ({', '.join(f'budget {b} trial {t}' for b, t in lack)})")
    return ("Not measured in this group: " + "; ".join(out) + ".") if out else "Every cell of this group is measured."


def _compressed_against_optimum(cells: list) -> list[str]:
    """What the compressed prompts' mass after the first question says against the optimum's over the same steps."""
    if not cells:
        return []
    above = sum(c["optimal_retained_after_prompt"] >= c["retained_after_prompt"] - 1e-9 for c in cells)
    text = (f"After the first question, the optimum's mass is at or above the compressed prompt's in {above} of the "
            f"{len(cells)} compressed-prompt cells")
    if above == len(cells):
        return [text + "."]
    worst = max(c["retained_after_prompt"] - c["optimal_retained_after_prompt"] for c in cells)
    return [text + f"; in the others the compressed prompt holds more, by up to {worst:.3f}. The optimum holds the budget "
            "at every step of the conversation, the context included, and is the best over all of them; a compressed "
            "prompt chose what to keep after reading the whole context, which nothing held to the budget at every step "
            "can do, so over the later steps alone it can come out above."]


def _share(some: int, every: int) -> str:
    """"all 336" where every one does, "321 of the 336" (the others do not) where not."""
    return f"all {every}" if some == every else f"{some} of the {every} (the others do not)"


def markdown(doc: dict) -> str:
    cells = _cells(doc)
    plan = doc["plan"]
    lines = [HEAD]
    if "needle" in plan:
        names = ", ".join(plan["names"][: max(plan["keys"])])
        lines.append(f"The needle \"{plan['needle']}\" and the question \"{plan['question']}\", key i named by the i-th "
                     f"of {names} (why this wording: docs/needle.md, \"A conversation: a pass key per turn\").\n")
    grid = [(m, k, n, b, c, t) for m in plan["models"] for k in plan["keys"] for n in plan["lengths"]
            for b in plan["budgets"] for c in _configs(plan) for t in range(1, plan["trials"] + 1)]
    have = {key for key, cell in cells if "why" not in cell}
    lines.append("## What was measured\n")
    cells_of = "cells (model x keys x length x budget x configuration x trial)"
    lines.append(f"All {len(grid)} of the study's {cells_of} are measured here.\n" if len(have) == len(grid) else
                 f"{len(have)} of the study's {len(grid)} {cells_of} are measured here; the rest are not yet run and "
                 "are not shown.\n")
    exact = [key for key in have if _exact(plan, key[4])]
    losses = {key[:6] for key, _ in _losses(doc)}
    compressed = [key for key in have if not _exact(plan, key[4])]
    closed = {key[:6] for key, _ in _losses(doc, "closed")}
    share = _share(len(losses & set(exact)), len(exact))
    lines.append(f"{share[0].upper()}{share[1:]} measured exact-prompt cells carry the delta NLL per "
                 f"turn (open loop); {_share(len(closed & set(compressed)), len(compressed))} measured compressed-prompt "
                 "cells carry it in the closed loop (their only one).\n")
    lines += findings(doc)
    groups = sorted({(m, k, n) for (m, k, n, *_), _ in cells})
    absent = [f"{m}, {k} keys, {n:,} tokens" for m in plan["models"] for k in plan["keys"] for n in plan["lengths"]
              if (m, k, n) not in groups]
    if absent:
        lines.append("Not measured at all yet: " + "; ".join(absent) + ". Below, a configuration or budget a table "
                     "does not show (or shows as -) was not measured either.\n")
    for m, k, n in groups:
        mine = [(key, c) for key, c in cells if key[:3] == (m, k, n)]
        budgets = sorted({key[3] for key, _ in mine})
        trials = sorted({key[5] for key, c in mine if "why" not in c})
        depths = ", ".join(f"{d:g}" for d in plan["depths"][str(k)])
        lines.append(f"## {m}, {k} keys (depths {depths}), {n:,} tokens\n")
        lines.append(f"Trials measured: {', '.join(map(str, trials)) or 'none'}. Each cell: the key found at turn 1 and "
                     "at the later turns, over the trials whose full cache found it; in how many (layer, KV head)s a token "
                     "of key 1, key 2, ... stayed to the end; then the retained attention mass after the first question "
                     "(the control's attention on what the run held), with the exact optimum's over the whole "
                     "conversation at the same budget in brackets.\n")
        lines.append(_absent(plan, mine) + "\n")
        lines.append("| configuration | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        lines.append("| --- |" + " --- |" * len(budgets))
        for config in _configs(plan):
            row = [_found([c for key, c in mine if key[3] == b and key[4] == config]) if any(
                key[3] == b and key[4] == config for key, _ in mine) else "-" for b in budgets]
            if all(x == "-" for x in row):
                continue
            lines.append(f"| {config} | " + " | ".join(row) + " |")
        exact = [c for key, c in mine if "why" not in c and "retained" in c and _exact(plan, key[4])]
        if exact:
            above = sum(c["optimal_retained"] >= c["retained"] - 1e-9 for c in exact)
            margin = min(c["optimal_retained"] - c["retained"] for c in exact)
            lines.append(f"\nOver every step of the conversation, the optimum's retained mass is at or above the run's in "
                         f"{above} of the {len(exact)} exact-prompt cells (the smallest margin {margin:.3f}); a compressed "
                         "prompt attends in full during its one call, so only its mass after the first question compares.")
        lines += _compressed_against_optimum([c for key, c in mine if "why" not in c and "retained" in c
                                              and not _exact(plan, key[4])])
        lines += _nll_table(doc, plan, (m, k, n))
        lines += _closed_table(doc, plan, (m, k, n), budgets)
        control = [c for key, c in mine if "why" not in c]
        if control:
            by_trial = {key[5]: c["control_found"] for key, c in mine if "why" not in c}
            said = "; ".join(f"trial {t}: " + ", ".join(f"turn {i + 1} {'found' if f else 'missed'}" for i, f in
                                                          enumerate(v)) for t, v in sorted(by_trial.items()))
            lines.append(f"\nThe full cache (control): {said}.\n")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    source = Path(argv[0]) if argv else JSON
    target = Path(argv[1]) if len(argv) > 1 else PAGE
    try:
        doc = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        print(f"multi_turn: {source}: cannot read the study ({' '.join(str(e).split())})", file=sys.stderr)
        return 1
    target.write_text(markdown(doc), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

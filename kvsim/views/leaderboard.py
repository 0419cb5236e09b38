"""The pass-key leaderboard the app draws on a fresh install: the tables docs/needle.md measured, shipped as
``traces/needle-leaderboard.json`` (transcribed from the page; tests/test_needle_leaderboard.py holds the
two equal), joined by every grid ``kvsim needle`` saved here.

A table is columns of (prompt length, budget) and, per policy and column, the share of the counted trials
in which it found the key at each depth (1 found, 0 missed; None where the control found none: not
counted), or None for a column the policy was not run in; the control's row the same.
"""

from __future__ import annotations

import json

from ..data import catalog

LEADERBOARD_NAME = "needle-leaderboard.json"


class LeaderboardError(ValueError):
    """The shipped leaderboard cannot be read; the message is one line."""


def shipped_tables() -> list[dict]:
    """The measured tables of ``traces/needle-leaderboard.json``, each labelled ``shipped``; [] where the
    checkout has no such file (a plain install)."""
    path = catalog.TRACES_DIR / LEADERBOARD_NAME
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise LeaderboardError(f"{path.name}: not a leaderboard ({' '.join(str(e).split())})") from None
    tables = doc.get("tables") if isinstance(doc, dict) else None
    if not isinstance(tables, list) or not all(isinstance(t, dict) and {"columns", "rows", "control", "depths"} <= set(t)
                                               for t in tables):
        raise LeaderboardError(f"{path.name}: not a leaderboard (no tables of columns, rows, control and depths)")
    return [dict(t, origin=f"measured for docs/needle.md, shipped in traces/{LEADERBOARD_NAME}", shipped=True)
            for t in tables]


def from_grid(doc: dict, source: str, date: str = "") -> dict:
    """A grid ``kvsim needle`` saved (``read_grid``) as a leaderboard table: a column per (length, budget)."""
    columns = sorted({(n, g["budget"]) for g in doc["grids"] for n in doc["lengths"]}, key=lambda c: (c[1], c[0]))
    rows: dict[str, list] = {}
    control = []
    for length, _ in columns:
        li = doc["lengths"].index(length)
        control.append([row[li] for row in doc["control"]["accuracy"]])
    for g in doc["grids"]:
        name = g["label"].replace(f" @ {g['budget']}", "", 1)
        line = rows.setdefault(name, [None] * len(columns))
        for li, length in enumerate(doc["lengths"]):
            line[columns.index((length, g["budget"]))] = [
                acc[li] if counted[li] else None for acc, counted in zip(g["accuracy"], g["counted"], strict=True)]
    budgets = sorted({b for _, b in columns})
    lengths = sorted({n for n, _ in columns})
    return {"title": f"{doc['model']}: {', '.join(map(str, lengths))} tokens, budget {', '.join(map(str, budgets))}",
            "model": doc["model"], "date": date, "trials": doc["trials"], "depths": doc["depths"],
            "columns": [{"length": n, "budget": b} for n, b in columns], "control": control, "rows": rows,
            "origin": f"measured here ({source})", "shipped": False}


def word(share: float | None) -> str:
    """A cell's reading at one depth, as docs/needle.md writes it: found, -, a share, or n/a (not counted)."""
    if share is None:
        return "n/a"
    return "found" if share == 1.0 else "-" if share == 0.0 else f"{share:.0%}"


def cell_text(shares: list | None) -> str:
    return "not run" if shares is None else " / ".join(word(s) for s in shares)


def markdown_rows(table: dict) -> list[str]:
    """The table's rows as docs/needle.md prints them: ``| h2o | - / - / - | found / found / - |``."""
    out = ["| full cache (control) | " + " | ".join(cell_text(c) for c in table["control"]) + " |"]
    out += [f"| {name} | " + " | ".join(cell_text(c) for c in cells) + " |" for name, cells in table["rows"].items()]
    return out


def column_label(column: dict, table: dict) -> str:
    """``512 tokens, budget 64``; only what differs between the table's columns where the rest is shared."""
    lengths = {c["length"] for c in table["columns"]}
    budgets = {c["budget"] for c in table["columns"]}
    parts = [f"{column['length']} tokens" if len(lengths) > 1 or len(budgets) == 1 else "",
             f"budget {column['budget']}" if len(budgets) > 1 or len(lengths) == 1 else ""]
    return ", ".join(p for p in parts if p)


def label(table: dict) -> str:
    """What a table is, in one line: its model, lengths, budgets, depths, trials and date."""
    lengths = sorted({c["length"] for c in table["columns"]})
    budgets = sorted({c["budget"] for c in table["columns"]})
    depths = " / ".join(f"{d:g}" for d in table["depths"])
    trials = f"{table['trials']} trial{'s' if table['trials'] != 1 else ''} a cell"
    return (f"{table['model']}; {', '.join(f'{n:,}' for n in lengths)} tokens; budget {', '.join(map(str, budgets))}; "
            f"depths {depths}; {trials}" + (f"; {table['date']}" if table.get("date") else ""))


__all__ = ["LEADERBOARD_NAME", "LeaderboardError", "cell_text", "column_label", "from_grid", "label", "markdown_rows",
           "shipped_tables", "word"]

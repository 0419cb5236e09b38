"""``kvsim tune --search-layout``: which serving layout costs the tuned policy least, by tune's own figure.

A search is small and stated: one field of the layout (``block_size`` or ``evict_every``) over its candidate
values (``SEARCH``, or the values given), the layout's other fields held as given. Every candidate is a whole
``tune`` under that layout (``kvsim.analysis.tune``: the windows swept under it, ``model_window`` chosen by the
same ``--by``, the truth measured under it), so each is measured by the truth where tune measures by the truth;
a candidate the policy cannot run at the budget is left out with the layout's reason. The best candidate is the
one whose ``model_window`` has the best figure (lowest KL or delta NLL, highest retained mass or recall, a
proxy by its own sign); the table keeps every candidate's. The budget is the memory in every candidate, so
they are compared at equal memory (docs/serving.md).
"""

from __future__ import annotations

from collections.abc import Callable

from ..policykit.layouts import Layout
from . import proxies as px
from .tune_sweep import TuneError, check_layout

#: the candidate values of each field a search may move: the block sizes the app offers (vLLM's 16 among them;
#: 1 is no blocks) and intervals doubling from 1 (no intervals) to 16
SEARCH = {"block_size": (1, 8, 16, 32), "evict_every": (1, 2, 4, 8, 16)}


def parse(text: str) -> tuple[str, tuple[int, ...]]:
    """``block_size``, ``evict_every`` (their ``SEARCH`` values) or ``FIELD=V1,V2,...``; TuneError, one line."""
    field, _, values = text.strip().partition("=")
    field = field.strip()
    if field not in SEARCH:
        raise TuneError(f"--search-layout: {text!r}: the field searched is one of {', '.join(SEARCH)} "
                        f"(optionally =V1,V2,...: its candidate values)")
    if not values:
        return field, SEARCH[field]
    try:
        got = tuple(int(v) for v in values.split(","))
    except ValueError:
        raise TuneError(f"--search-layout: {text!r}: the values are whole numbers, comma-separated") from None
    if any(v < 1 for v in got):
        raise TuneError(f"--search-layout: {text!r}: every {field} is 1 or more")
    if len(set(got)) < 2:
        raise TuneError(f"--search-layout: {text!r}: a search needs two candidate values or more")
    return field, tuple(sorted(set(got)))


def candidates(base: Layout | None, field: str, values: tuple[int, ...]) -> list[Layout]:
    """The layouts a search measures: ``base`` (None: no layout) with ``field`` set to each of ``values``."""
    held = (base or Layout()).to_dict()
    return [Layout(**{**held, field: int(v)}) for v in values]


def figure(doc: dict) -> tuple[str, float, int]:
    """``(name, value, sign)`` of a tune document's ``model_window`` by its ``by``: the truth's or a proxy's
    value at it where tune measured candidate windows, else its model-wide retained mass; ``sign`` +1 where
    higher is better."""
    d = doc.get("by_detail") or {}
    by = d.get("fell_back_to") or d.get("by") or doc["by"]
    if d.get("windows") and "value" in d:
        base = by[: -len("_late")] if by.endswith("_late") else by
        sign = -1 if by in ("kl", "delta_nll") else (+1 if base in ("retained_mass", "top_k_recall")
                                                      else px.PROXIES[base].sign)
        return by, float(d["value"]), sign
    return "retained_mass", float(doc["model"]["one_window"]["recommended_mass"]), +1


def search(run: Callable[[Layout], dict], layouts: list[Layout], field: str, policy: str, budget: int,
           params: dict, say=None) -> tuple[dict, dict]:
    """Tune under each of ``layouts`` (``run(layout)``: the tune document under it), the best by ``figure``.
    Returns ``(the chosen candidate's document, the search's table)``; TuneError when the policy can run under
    none of them."""
    rows, left_out, docs = [], {}, []
    runnable = []
    for lay in layouts:
        try:
            check_layout(policy, budget, lay, params)
        except TuneError as e:
            left_out[_label(lay)] = str(e).split(": ", 1)[-1]
            continue
        runnable.append(lay)
    if not runnable:
        raise TuneError(f"--search-layout {field}: {policy} at budget {budget} runs under none of the candidates ("
                        + "; ".join(f"{k}: {v}" for k, v in left_out.items()) + ")")
    for n, lay in enumerate(runnable, start=1):
        if say is not None:
            say(None, f"layout {n}/{len(runnable)}: {_label(lay)}")
        doc = run(lay)
        name, value, sign = figure(doc)
        memory, _ = lay.memory(budget)
        rows.append({"layout": _label(lay), **lay.to_dict(), "memory": memory, "model_window": doc["model_window"],
                     "by": name, "figure": value, "seconds": doc["run"]["seconds"], "truth": doc["run"].get("truth")})
        docs.append((sign * value, doc))
    best = max(range(len(docs)), key=lambda i: (docs[i][0], -i))  # ties: the earlier candidate (the smaller value)
    chosen = rows[best]["layout"]
    table = {"field": field, "values": [getattr(lay, field) for lay in layouts], "by": rows[best]["by"],
             "candidates": rows, "left_out": left_out, "chosen": chosen,
             "seconds": round(sum(r["seconds"] for r in rows), 2),
             # the configurations the truth read and measured over every candidate (each tune counts its own)
             "truth": {k: sum(r["truth"][k] for r in rows) for k in ("read", "measured")} if all(
                 r["truth"] for r in rows) else None,
             "rule": f"{field} over {', '.join(str(getattr(lay, field)) for lay in layouts)}, the other fields held; "
                     f"each candidate a whole tune under it (model_window by {rows[best]['by']}); the best "
                     f"model_window's figure chosen, at equal memory (the budget)"}
    return docs[best][1], table


def _label(layout: Layout) -> str:
    return "no layout" if layout.plain else layout.label


__all__ = ["SEARCH", "candidates", "figure", "parse", "search"]

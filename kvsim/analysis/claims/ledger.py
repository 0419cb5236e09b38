"""The ledger: every claim measured on one trace, as JSON-ready records, a DataFrame for the app, or text."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...data.trace import Trace
from .cards import CLAIMS
from .measure import BUDGET, VERDICTS, Measurer

if TYPE_CHECKING:  # pandas is imported where a table is built: the app's default page needs none
    import pandas as pd


def ledger(trace: Trace, budget: int = BUDGET) -> list[dict]:
    """Every claim measured on ``trace``: one JSON-ready record per claim, in ``CLAIMS`` order."""
    m = Measurer(trace, budget)
    out = []
    for claim in CLAIMS:
        if claim.scope == "trace" and trace.steps <= budget and claim.id != "sw-quarter-looks-alike":
            verdict, figures, note = "not applicable", {}, f"the trace has {trace.steps} steps: at budget {budget} nothing is evicted"
        else:
            verdict, figures, note = claim.check(m)
        if verdict in ("holds", "fails") and pins_canonical(claim) and not m.is_canonical:
            verdict, note = "not applicable", (f"the card's words are about the canonical trace; on {trace.name} the "
                                               "figures are for reference only" + (f" ({note})" if note else ""))
        assert verdict in VERDICTS, (claim.id, verdict)
        view = {k: str(v).format(trace=trace.name, quarter=max(1, trace.steps // 4)) for k, v in claim.view.items()}
        out.append({"id": claim.id, "card": claim.card, "words": claim.words, "scope": claim.scope,
                    "measurement": claim.measurement, "trace": trace.name, "verdict": verdict,
                    "figures": figures, "note": note, "view": view})
    return out


def pins_canonical(claim) -> bool:
    """Whether the card's words pin the claim on the canonical trace ("On the canonical trace ...",
    "The canonical trace puts ..."): such a claim is decided there and not applicable anywhere else."""
    return " ".join(claim.words.split()).lower().startswith(("on the canonical trace", "the canonical trace"))


def kept_ledger(trace: Trace, budget: int = BUDGET) -> list[dict]:
    """``ledger``, kept beside the trace's cache entry (``kvsim.data.store.derived``) and read back by a later
    process: the app measured all 31 claims again after every server start (2-3 s of the Claims view's first
    visit). Its version is a digest of kvsim's engine, policies, data and analysis code, so an edit of any
    of them measures it afresh; a trace without a cache entry (an upload) is measured every time."""
    import hashlib
    from pathlib import Path

    from ...data import store
    from ...sim.summaries import _package_digest

    analysis = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(_package_digest().encode())
    for f in sorted(analysis.rglob("*.py")):
        digest.update(str(f.relative_to(analysis)).encode() + b"\0" + f.read_bytes())

    def decode(record: dict) -> list[dict]:
        records = record["records"]
        if not isinstance(records, list) or len(records) != len(CLAIMS) or \
                [r["id"] for r in records] != [c.id for c in CLAIMS]:
            raise ValueError("not this ledger")
        return records

    return store.derived(trace, "claims", {"budget": budget}, digest.hexdigest()[:16], lambda: ledger(trace, budget),
                         encode=lambda records: {"records": records}, decode=decode)


def ledger_frame(records: list[dict]) -> pd.DataFrame:
    """The ledger as a table for the app: one row per (claim, trace), the figures as ``k=v`` text."""
    import pandas as pd

    rows = [{"id": r["id"], "card": r["card"], "trace": r["trace"], "verdict": r["verdict"], "scope": r["scope"],
             "words": r["words"], "measured": _figures_text(r["figures"]), "note": r["note"],
             "measurement": r["measurement"], "view": r["view"]} for r in records]
    return pd.DataFrame(rows, columns=["id", "card", "trace", "verdict", "scope", "words", "measured", "note",
                                       "measurement", "view"])


def _figures_text(figures: dict) -> str:
    return "; ".join(f"{k}={v}" for k, v in figures.items())


def render_ledger(records: list[dict]) -> str:
    """The ledger as text: per trace, one line per claim (verdict and figures), then the cards' words
    and the notes, so the table stays readable and nothing is cut."""
    parts = []
    for trace in dict.fromkeys(r["trace"] for r in records):
        rows = [r for r in records if r["trace"] == trace]
        counts = ", ".join(f"{sum(r['verdict'] == v for r in rows)} {v}" for v in VERDICTS)
        parts.append(f"Claims of the two cards on the {trace} trace ({counts}):\n")
        width = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in ("id", "card", "scope", "verdict")}
        head = "  ".join(k.ljust(width[k]) for k in width) + "  measured"
        parts.append(head)
        parts.append("  ".join("-" * width[k] for k in width) + "  " + "-" * 8)
        for r in rows:
            parts.append(("  ".join(str(r[k]).ljust(width[k]) for k in width) + "  " + _figures_text(r["figures"])).rstrip())
        parts.append("")
        for r in rows:
            parts.append(f"{r['id']} ({r['card']} card): \"{r['words']}\"")
            parts.append(f"    measured: {r['measurement']}")
            if r["note"]:
                parts.append(f"    note: {r['note']}")
        parts.append("")
    return "\n".join(parts).rstrip()

"""The tables for export: what the figures draw, as pandas frames (pandas is imported here only when
a table is built: the kept view, the first page, never needs it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...policykit.base import WINDOW
from ...sim.harness import ReplayResult
from .common import policy_label

if TYPE_CHECKING:
    import pandas as pd


def per_step_table(results: Sequence[ReplayResult]) -> pd.DataFrame:
    """One row per decode step; a retained-mass and a top-k-recall column per replay."""
    if not results:
        raise ValueError("per_step_table needs at least one replay")
    T = results[0].steps
    table = {"step": np.arange(1, T + 1)}
    for r in results:
        if r.steps != T:
            raise ValueError(f"{r.policy}: {r.steps} steps, expected {T}")
        label = policy_label(r)
        table[f"{label} retained_mass"] = r.retained_mass_series
        table[f"{label} top_{r.top_k}_recall"] = r.top_k_recall_series
    import pandas as pd

    return pd.DataFrame(table)


def sweep_table(curves: Mapping[str, Sequence[Mapping]], *, top_k: int = 32) -> pd.DataFrame:
    """The swept curves side by side, one row per recent_window: for each policy its retained mass,
    its top-k recall and any parameter it was swept with held fixed (``scissorhands history_window``).
    ``budget``, ``top_k`` and ``steps`` come once, from the first curve."""
    if not curves or not any(curves.values()):
        raise ValueError("sweep_table needs at least one swept curve")
    table = None
    for name, rows in curves.items():
        if not rows:
            continue
        df = _sweep_frame(rows)
        shared = [c for c in ("budget", "top_k", "steps") if c in df]
        fixed = [c for c in df.columns if c not in ("policy", WINDOW, "retained_mass", "top_k_recall", *shared)]
        part = df[[WINDOW, "retained_mass", "top_k_recall", *fixed]].rename(
            columns={"retained_mass": f"{name} retained_mass", "top_k_recall": f"{name} top_{top_k}_recall",
                     **{c: f"{name} {c}" for c in fixed}}
        )
        if table is None:
            table = df[[WINDOW, *shared]].merge(part, on=WINDOW)
        else:
            table = table.merge(part, on=WINDOW, how="outer")
    return table.sort_values(WINDOW).reset_index(drop=True)


def _sweep_frame(rows: Sequence[Mapping]) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame(list(rows)).sort_values(WINDOW).reset_index(drop=True)


"""What the figures share: the colours of the kinds of position, and a replay's label."""

from __future__ import annotations

from ...sim.harness import ReplayResult

#: the kinds of position, one colour each wherever they are drawn
SINK_COLOUR = "rgba(31, 119, 180, 0.9)"
BAND_COLOUR = "rgba(255, 127, 14, 0.9)"
HEAVY_COLOUR = "rgba(214, 39, 40, 0.85)"
STALE_COLOUR = "rgba(148, 103, 189, 0.9)"
RECENT_COLOUR = "rgba(44, 160, 44, 0.9)"
OTHER_COLOUR = "rgba(127, 127, 127, 0.75)"
CURRENT_COLOUR = "#d62728"


def policy_label(result: ReplayResult) -> str:
    """``h2o (recent_window=32)``: the name plus the parameters that made this run."""
    params = {k: v for k, v in result.params.items() if isinstance(v, (int, float, str))}
    inner = ", ".join(f"{k}={v}" for k, v in params.items())
    return f"{result.policy} ({inner})" if inner else result.policy


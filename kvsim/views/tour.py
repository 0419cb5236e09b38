"""A guided tour for teaching: a few steps, each a link (``?tour=<key>``) that sets the app's controls,
opens the view that makes one point, and says in two or three sentences what to look at.

Pure data: the app applies a step's ``settings`` to its controls and opens its ``view``. The steps run
on the canonical trace, whose features are known; the views beside them quote that trace's figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..policykit.base import WINDOW


@dataclass(frozen=True)
class TourStep:
    key: str  # the value of ``tour=`` in the link
    title: str
    view: str  # the tab it opens
    look: str  # what to look at, in two or three sentences
    settings: dict = field(default_factory=dict)  # control -> value; the rest keep their defaults


TOUR = (
    TourStep(
        "sinks", "Attention sinks", "Kept positions",
        "sliding_window and streaming_llm differ by four pinned positions, and this view shows only that difference. "
        "The blue strip at the left is the sink columns, widened: streaming_llm keeps them for the whole run, "
        "sliding_window drops them as soon as its cache fills. Compare the two masses in the title: the sinks alone "
        "are the gap.",
        {"trace": "canonical", "policies": ["streaming_llm", "sliding_window"], "budget": 256, "sinks": 4,
         "kept_mode": "difference", "step": 2048},
    ),
    TourStep(
        "heavy-hitters", "Heavy hitters", "Kept positions",
        "Red triangles mark the heavy hitters: older positions that draw a large share for a stretch. Beside each "
        "column a red line runs while the policy holds it; an × marks where it is evicted while still wanted. "
        "streaming_llm loses every one as it slides past; h2o's cumulative scores keep all but two.",
        {"trace": "canonical", "policies": ["streaming_llm", "h2o"], "budget": 256, WINDOW: 32,
         "kept_mode": "each", "step": 2048},
    ),
    TourStep(
        "window", "The recent window", "Choosing recent_window",
        "Each point is a replay of h2o at one recent_window. At the default, 32 (orange ring round the red star), "
        "it keeps less than streaming_llm (green dashes); the gain stops at the band (the square). Click a point "
        "to set recent_window everywhere.",
        {"trace": "canonical", "policies": ["streaming_llm", "h2o"], "budget": 256, WINDOW: 32,
         "curve_policy": "h2o", "step": 2048},
    ),
)

BY_KEY = {s.key: s for s in TOUR}


def neighbours(key: str) -> tuple[TourStep | None, TourStep | None]:
    """The steps before and after ``key`` (None at either end)."""
    i = [s.key for s in TOUR].index(key)
    return (TOUR[i - 1] if i > 0 else None, TOUR[i + 1] if i + 1 < len(TOUR) else None)

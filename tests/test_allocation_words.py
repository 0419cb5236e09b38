"""Issue 44, item 3, the allocation view: each allocator's mass said against uniform's in words ("worse than
uniform by 0.0213", not "-478% of the gap"), bars of the difference from uniform on a zero-based axis, panel
titles as large as the axes' labels, and a progress bar whose text says what its share counts."""

from __future__ import annotations

import numpy as np
from random_traces import random_trace

from kvsim.allocation import allocators as al
from kvsim.policies import PolicySpec
from kvsim.views.figures.allocators import against_uniform, mass_bars

ROWS = [{"allocator": "uniform", "retained_mass": 0.8600, "gap_closed": 0.0},
        {"allocator": "pyramidkv", "retained_mass": 0.8387, "gap_closed": -4.78},
        {"allocator": "cake", "retained_mass": 0.8620, "gap_closed": 0.45},
        {"allocator": "optimal", "retained_mass": 0.86440, "gap_closed": 1.0}]


def test_each_allocator_is_said_against_uniform_in_words():
    uniform = 0.86
    assert [against_uniform(r, uniform) for r in ROWS] == [
        "the baseline", "worse than uniform by 0.0213", "better than uniform by 0.0020, 45% of the way to the optimum",
        "the optimum: better than uniform by 0.0044"]
    assert against_uniform({"allocator": "cake", "retained_mass": 0.86002, "gap_closed": 0.01}, uniform) == "level with uniform"


def test_the_bars_are_the_difference_from_uniform_from_zero():
    fig = mass_bars(ROWS)
    (bar,) = fig.data
    assert np.allclose(bar.y, [0.0, -0.0213, 0.0020, 0.0044])
    low, high = fig.layout.yaxis.range
    assert low < -0.0213 and high > 0.0044 and low < 0 < high  # zero (uniform) on the axis: a bar's length is its gap
    assert list(bar.text) == ["0.8600", "0.8387", "0.8620", "0.8644"]  # the mass on the bar, its reading under it
    ticks = list(fig.layout.xaxis.ticktext)
    assert ticks[1] == "<b>pyramidkv</b><br>worse than uniform by 0.0213"
    assert ticks[2] == "<b>cake</b><br>better than uniform by 0.0020,<br>45% of the way to the optimum"
    assert not any("% of the gap" in t for t in ticks)
    assert list(bar.marker.color) == ["#4c78a8", "#e45756", "#4c78a8", "#4c78a8"]  # the worse one stands out


def test_the_comparisons_progress_says_what_its_share_counts():
    rng = np.random.default_rng(0)
    heads = [al.Head(x, 0, random_trace(40, rng, name=f"L{x}")) for x in range(3)]
    said = []
    al.compare(heads, PolicySpec.of("h2o", 12, recent_window=4), ["uniform", "optimal"], progress=lambda f, note="": said.append((f, note)))
    fractions = [f for f, _ in said if f is not None]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    # the second half of the bar is the optimum's: its notes say so, and which head of how many
    curve = [(f, n) for f, n in said if "budget curve" in n]
    assert curve and all(n.startswith("allocator 2 of 2, optimal: budget curve of layer") for _, n in curve)
    assert [n.split("(head ")[1].split(",")[0] for _, n in curve] == ["1 of 3", "2 of 3", "3 of 3"]
    assert all(0.5 <= f <= 1.0 for f, _ in curve)
    assert ("allocator 2 of 2, optimal: done" in [n for _, n in said]) and not any("optimal: optimal" in n for _, n in said)

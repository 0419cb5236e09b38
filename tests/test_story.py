"""The app's sentences, as pure functions: each must say what the figures it is given say."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvsim
from kvsim import figures, story


def rows(policy, values):
    return [{"policy": policy, "budget": 10, "recent_window": w, "retained_mass": m, "top_k_recall": m} for w, m in values]


def test_gap_says_within_below_or_above():
    assert story.gap(0.955, 0.961, "h2o's") == "within 0.01 of h2o's 0.961"
    assert story.gap(0.878, 0.961, "h2o's") == "0.083 below h2o's 0.961"
    assert story.gap(0.97, 0.90, "the bound") == "0.070 above the bound 0.900"


def test_possessive():
    assert story.possessive("h2o") == "h2o's" and story.possessive("scissorhands") == "scissorhands'"


def test_window_text_quotes_the_trace_figures():
    text = story.window_text("h2o", 64, 0.5489)
    assert "newest 64 positions take 0.55 of every row" in text and "h2o must" in text
    assert "take n/a of" in story.window_text("h2o", 64, None)


@pytest.mark.parametrize(("band", "says"), [(3, "the gain stops at 3, the band's width"),
                                           (2, "peaks at recent_window 3 (0.900), not at the band's 2")])
def test_curve_verdict_follows_the_peak(band, says):
    assert says in story.curve_verdict(rows("h2o", [(1, 0.5), (2, 0.6), (3, 0.9), (4, 0.8)]), band)


def test_lines_story_is_computed_from_the_lines():
    curves = {"h2o": rows("h2o", [(1, 0.5), (2, 0.6), (3, 0.9), (4, 0.8)]),
              "scissorhands": rows("scissorhands", [(1, 0.4), (2, 0.5), (3, 0.8), (4, 0.7)])}
    lines = [figures.Line("streaming_llm (sinks=4)", 0.7, 0.7, policy="streaming_llm"),
             figures.Line("tova", 0.95, 1.0, policy="tova"),
             figures.Line("greedy_future (offline reference)", 0.75, 0.7, "offline", "greedy_future"),
             figures.Line("upper bound (offline reference)", 0.97, 1.0, "bound")]
    text = story.lines_story("h2o", curves, lines, 10)
    assert "**scissorhands** also peaks at 3, at 0.800: 0.100 below h2o's peak 0.900." in text
    assert "**tova** has no recent_window, so it is one line: 0.950, 0.020 below the upper bound 0.970." in text
    assert "**upper bound** (0.970)" in text and "each row's 10 largest weights" in text
    assert "**greedy_future** (0.750): it evicts the position with the least attention still to come" in text
    assert "0.150 below h2o's peak 0.900" in text
    assert "streaming_llm" not in text  # the cards' baselines are described elsewhere


def test_lines_story_on_the_canonical_trace_quotes_its_sweeps(canonical):
    curves = {n: kvsim.sweep(canonical, n, 256, "recent_window", range(1, 256)) for n in ("h2o", "scissorhands")}
    tova = kvsim.replay(canonical, "tova", budget=256).summary()
    lines = [figures.Line.of(tova, "tova", policy="tova")]
    text = story.lines_story("h2o", curves, lines, 256)
    peak, top = figures.curve_peak(curves["h2o"])
    speak, stop = figures.curve_peak(curves["scissorhands"])
    assert peak == 64
    assert f"**scissorhands** {'also ' if speak == peak else ''}peaks at {speak}, at {stop:.3f}" in text
    assert f"one line: {tova['retained_mass']:.3f}" in text
    assert story.curve_verdict(curves["h2o"], 64).startswith("On this trace the gain stops at 64")


def test_lines_story_figures_are_the_lines_on_a_random_trace():
    rng = np.random.default_rng(5)
    a = np.tril(rng.random((201, 201)), -1)
    trace = kvsim.from_array(a, name="random")
    curves = {"h2o": kvsim.sweep(trace, "h2o", 40, "recent_window", range(1, 40))}
    tova = kvsim.replay(trace, "tova", budget=40).summary()
    text = story.lines_story("h2o", curves, [figures.Line.of(tova, "tova", policy="tova")], 40)
    assert re.search(rf"one line: {tova['retained_mass']:.3f}", text)

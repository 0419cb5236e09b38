"""The app's sentences, as pure functions: each must say what the figures it is given say."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvsim
from kvsim.analysis import features
from kvsim.views import figures, story


def rows(policy, values):
    return [{"policy": policy, "budget": 10, "recent_window": w, "retained_mass": m, "top_k_recall": m} for w, m in values]


def test_gap_says_within_below_or_above():
    assert story.gap(0.955, 0.961, "h2o's") == "0.006 below h2o's 0.961, within 0.01"
    assert story.gap(0.965, 0.961, "h2o's peak") == "0.004 above h2o's peak 0.961, within 0.01"  # issue 44: the sign said
    assert story.gap(0.9612, 0.961, "h2o's") == "level with h2o's 0.961"
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
             figures.Line("greedy_future (offline reference)", 0.75, 0.7, "offline", "greedy_future",
                          "evicts the position with the least attention still to come"),
             figures.Line("upper bound (offline reference)", 0.97, 1.0, "bound")]
    text = story.lines_story("h2o", curves, lines, 10)
    # windows 1..4 of 1..9: a sample, so its peak is said to be of the windows sampled
    assert "**scissorhands** also peaks at 3 of the windows sampled, at 0.800: 0.100 below h2o's peak 0.900." in text
    assert "**tova** has no recent_window, so it is one line: 0.950, 0.020 below the upper bound 0.970." in text
    assert "**upper bound** (0.970)" in text and "each row's 10 largest weights" in text
    assert "**greedy_future** (0.750): evicts the position with the least attention still to come" in text
    assert "0.150 below h2o's peak 0.900" in text
    assert "streaming_llm" not in text  # the cards' baselines are described elsewhere


def test_lines_story_on_the_canonical_trace_quotes_its_sweeps(canonical):
    curves = {n: kvsim.sweep(canonical, n, 256, "recent_window", range(1, 256)) for n in ("h2o", "scissorhands")}
    tova = kvsim.replay(canonical, "tova", budget=256).summary()
    lines = [figures.Line.of(tova, "tova", policy="tova")]
    text = story.lines_story("h2o", curves, lines, 256)
    peak, top = features.curve_peak(curves["h2o"])
    speak, stop = features.curve_peak(curves["scissorhands"])
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


# --------------------------------------------------------------------------------------------
# what the trace has: the sentences quote its figures or say the feature is absent


@pytest.fixture(scope="module")
def real():
    return kvsim.resolve_trace("gemma3-270m-L11")


def facts(trace):
    f = features.trace_features(trace)
    return f, kvsim.describe(trace, band=f.band, sinks=max(1, f.sinks))


def test_sink_band_and_trace_text_on_the_canonical_trace(canonical):
    f, info = facts(canonical)
    assert "(positions 0-3, widened" in story.sink_text(f, info)
    assert f"here they take {info['sink_share']:.2f} of each row" in story.sink_text(f, info)
    band = story.band_text(f, info, 128)
    assert f"the newest 64 positions take {info['recent_share']:.2f} of each row here" in band
    assert "newest 128 positions of every step" in band
    text = story.trace_text(f, info)
    assert "The bright diagonal is the recency band: the newest 64 positions" in text
    assert f"then {len(f.stale)} of them fade into the background" in text


def test_a_real_trace_is_described_as_it_is(real):
    f, info = facts(real)
    assert "(position 0, widened" in story.sink_text(f, info)
    band = story.band_text(f, info, 64)
    assert band.startswith("**No sharp recency band** on this trace") and f"take {info['recent_share']:.2f}" in band
    text = story.trace_text(f, info)
    assert "There is no sharp band along the diagonal" in text and "recency band" not in text
    assert "fade into the background" not in text and "keep drawing attention to the end" in text
    assert "stale" not in story.score_text(f, "h2o").split("the sum never forgets")[0].replace("none is stale", "")
    assert "no sharp recency band" in story.window_text("h2o", f.band, info["recent_share"], f.band_known)


def test_a_trace_without_features_says_so(make_trace):
    trace = make_trace(300, seed=1)
    f, info = facts(trace)
    assert story.sink_text(f, info).startswith("**Sinks**: this trace has none")
    assert story.heavy_text(f, {}).startswith("**Heavy hitters**: none on this trace")
    text = story.trace_text(f, info)
    assert "There is no sink column" in text and "No heavy hitters" in text


def test_heavy_text_counts_each_policys_losses(canonical):
    f = features.trace_features(canonical)
    results = {n: kvsim.replay(canonical, n, budget=256, record_kept=True) for n in ("sliding_window", "h2o")}
    fates = {n: features.heavy_fates(r.kept_history, f) for n, r in results.items()}
    text = story.heavy_text(f, fates)
    n = len(f.heavy)
    lost = [x for x in fates["sliding_window"] if x.lost_while_live]
    first = min(lost, key=lambda x: x.evicted_at)
    assert f"sliding_window loses {len(lost)} of {n} while live (the first, position {first.position}, at step {first.evicted_at})" in text
    h2o_lost = sum(x.lost_while_live for x in fates["h2o"])
    assert (f"h2o keeps all {n}" in text) if h2o_lost == 0 else (f"h2o loses {h2o_lost} of {n}" in text)
    assert f"{len(f.stale)} of them go stale" in text


def test_budget_note_only_when_nothing_is_ever_evicted():
    assert story.budget_note(100, 101).startswith("This trace has 100 steps, so at most 101 positions")
    assert story.budget_note(100, 100) is None  # step 100 holds 101 positions: one is evicted


def test_difference_text_quotes_the_counts():
    text = story.difference_text("streaming_llm", "sliding_window", 0.737, 0.597, (3.7, 3.7))
    assert "streaming_llm holds 3.7 positions that sliding_window does not" in text
    assert "0.140 above sliding_window's 0.597" in text


def test_curve_verdict_without_a_band_or_flat_past_it():
    rs = rows("h2o", [(1, 0.5), (2, 0.6), (3, 0.9), (4, 0.9012)])
    assert story.curve_verdict(rs, 3, band_known=False).startswith("This trace has no sharp recency band")
    flat = story.curve_verdict(rs, 3)
    assert "all but stops at the band's width, 3 (0.900)" in flat and "highest point at 4 (0.901), 0.0012 more" in flat
    assert "not one clean band" not in story.curve_verdict(rows("h2o", [(1, 0.5), (2, 0.9), (3, 0.6)]), 3)


def test_curve_verdict_at_a_large_budget_on_the_canonical_trace(canonical):
    windows = [*range(16, 1024, 48), 64]
    rs = kvsim.sweep(canonical, "h2o", 1024, "recent_window", windows)
    peak, top = features.curve_peak(rs)
    text = story.curve_verdict(rs, 64)
    at64 = next(r["retained_mass"] for r in rs if r["recent_window"] == 64)
    assert "not one clean band" not in text
    if peak == 64:
        assert text.startswith("On this trace the gain stops at 64, the band's width")
    else:
        assert f"{peak} ({top:.3f})" in text and f"({at64:.3f})" in text


def test_offline_references_are_described_from_their_class():
    from kvsim.policies import describe_policy

    note = describe_policy(kvsim.POLICIES["greedy_future"])
    lines = [figures.Line("greedy_future (offline reference)", 0.79, 0.79, "offline", "greedy_future", note),
             figures.Line("tova", 0.9684, 1.0, policy="tova"),
             figures.Line("upper bound (offline reference)", 0.9686, 1.0, "bound")]
    text = story.lines_story("h2o", {"h2o": rows("h2o", [(1, 0.5), (2, 0.96)])}, lines, 10)
    assert f"**greedy_future** (0.790): {note}" in text
    assert "**tova** and the upper bound differ by 0.0002: on the chart they are one line" in text


def test_every_policy_says_what_it_does():
    from kvsim.policies import Policy, describe_policy

    for name, cls in kvsim.POLICIES.items():
        assert describe_policy(cls) and "\n" not in describe_policy(cls), name

    class Bare(Policy):
        """Keeps nothing in particular. More words."""

    assert describe_policy(Bare) == "Keeps nothing in particular"

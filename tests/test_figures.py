"""The app's figure builders, tested as pure functions: no Streamlit, no browser."""

from __future__ import annotations

import base64
import io
import json
import re

import numpy as np
import plotly.graph_objects as go
import pytest
from PIL import Image
from plotly.colors import sequential
from tolerance import rounding, rounding64

import kvsim
from kvsim import replay, sweep
from kvsim.analysis import features
from kvsim.sim.harness import kept_mask_of
from kvsim.views import figures
from kvsim.views.figures import kept as kept_figures
from kvsim.views.figures import pooling


@pytest.fixture(scope="module")
def canonical():
    return kvsim.generate_canonical()


@pytest.fixture(scope="module")
def story(canonical):
    """The cards' three policies at budget 256, everything recorded."""
    return [
        replay(canonical, name, budget=256, record_kept=True, record_scores=True)
        for name in ("sliding_window", "streaming_llm", "h2o")
    ]


@pytest.fixture(scope="module")
def small():
    """A 40-step trace with no metadata: the fallbacks' case."""
    rng = np.random.default_rng(7)
    a = np.tril(rng.random((41, 41)), k=-1).astype(np.float32)
    a[:, 9] *= 40  # one position that draws far more than the rest
    return kvsim.from_array(a, name="small")


def png_of(source: str) -> Image.Image:
    head, data = source.split(",", 1)
    assert head == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data)))


# --------------------------------------------------------------------------------------------
# what a trace is made of


def test_features_of_the_canonical_trace_come_from_its_metadata(canonical):
    f = features.trace_features(canonical)
    assert (f.sinks, f.band, f.steps) == (4, 64, 4096)
    assert [p for p, _, _ in f.heavy] == sorted(canonical.meta["heavy_hitters"])
    p, first, last = f.heavy[0]
    assert (first, last) == (p + 1, p + 512)  # live for one epoch after birth
    assert "metadata" in f.heavy_source and f.live_known and f.band_known and "metadata" in f.band_source
    assert f.stale and all(last < 4096 for _, _, last in f.stale)


def test_the_band_and_heavy_hitters_are_measured_when_the_metadata_is_silent(canonical):
    bare = kvsim.Trace(canonical.attention, name="bare", meta={})
    f = features.trace_features(bare)
    assert f.band_known and f.band == 64 and f.band_source.startswith("measured")  # the generator's width
    assert features.detect_band(canonical.attention)[1] > 20  # a cliff, not a slope
    assert f.heavy and f.live_known


def test_a_real_trace_has_one_sink_no_band_and_persistent_heavy_hitters():
    real = kvsim.resolve_trace("gemma3-270m-L11")
    f = features.trace_features(real)
    assert f.sinks == 1 and not f.band_known and f.band_source.startswith("no sharp recency band")
    assert len(f.heavy) == 8 and f.stale == () and all(p > 0 for p, _, _ in f.heavy)
    col = real.attention[1:, :].astype(np.float64).mean(axis=0)
    assert col[0] > 0.3 and col[1] < 0.01  # position 0 is the one sink


def test_features_are_measured_and_found_absent_on_a_random_trace(small, make_trace):
    f = features.trace_features(small, n_heavy=3)
    assert [p for p, _, _ in f.heavy] == [9]  # the one position drawing far more than the rest
    assert f.sinks == 0 and not f.band_known
    noise = features.trace_features(make_trace(300, seed=1))
    assert (noise.sinks, noise.heavy, noise.band_known) == (0, (), False)
    given = features.trace_features(small, sinks=2, band=8)
    assert (given.sinks, given.band, given.band_known) == (2, 8, True)


def test_malformed_heavy_hitter_metadata_is_ignored(small):
    odd = kvsim.Trace(small.attention, name="odd", meta={"heavy_hitters": ["x", 10**9]})
    assert features.trace_features(odd).heavy_source.startswith("measured")


# --------------------------------------------------------------------------------------------
# kept positions


def test_kept_image_is_uint8_with_three_levels(story):
    result = story[2]
    img = figures.kept_image(result)
    T = result.steps
    assert img.dtype == np.uint8 and img.shape == (T, T + 1)
    assert set(np.unique(img)) == {pooling.KEPT, pooling.EVICTED, pooling.FUTURE}
    kept_per_row = (img == pooling.KEPT).sum(axis=1)
    assert np.array_equal(kept_per_row, np.minimum(np.arange(1, T + 1) + 1, result.budget))
    future = np.arange(T + 1)[None, :] > np.arange(1, T + 1)[:, None]
    assert np.all((img == pooling.FUTURE) == future)


def images(fig, name=None):
    return [t for t in fig.data if isinstance(t, go.Image) and (name is None or t.name == name)]


def test_kept_heatmap_pools_to_the_pixels_shown_and_keeps_thin_columns(canonical, story):
    f = features.trace_features(canonical)
    fig = figures.kept_heatmap(story, f, step=1000, size=341)
    mains = [png_of(t.source) for t in fig.data if isinstance(t, go.Image) and t.name in ("sliding_window", "streaming_llm", "h2o")]
    assert len(mains) == 3
    for png in mains:
        assert png.mode == "L" and png.size[0] <= 341 and png.size[1] <= 341  # never 4097 x 4096
    sliding, streaming, _ = (np.asarray(png) for png in mains)
    # the four sink columns share one block with other positions: held by streaming_llm, the block
    # is still not white at the last step; sliding_window's is
    assert streaming[-1, 0] != pooling.EVICTED and sliding[-1, 0] == pooling.EVICTED
    # the widened sink strip: one column per sink, held to the end by streaming_llm only
    strips = [np.asarray(png_of(t.source)) for t in images(fig, "sinks")]
    assert [s.shape[1] for s in strips] == [4, 4, 4]
    assert (strips[1][-1] == pooling.KEPT).all() and (strips[0][-1] == pooling.EVICTED).all()
    # the age strip: the newest positions of every step; sliding_window holds all of them
    ages = [np.asarray(png_of(t.source)) for t in images(fig, "newest positions")]
    assert (ages[0][-1] == pooling.KEPT).all()
    # the axes span the data, plus the header and the strips, and no more
    assert tuple(fig.layout.yaxis.range)[0] == 4096.5 and -400 < fig.layout.yaxis.range[1] < 0.5
    lo, hi = fig.layout.xaxis.range
    assert -0.15 * 4096 < lo < 0 and 4096 < hi < 1.45 * 4096  # the strips, widened to read (issue 44), and no more
    assert all(0 <= v <= 4096 for v in fig.layout.xaxis.tickvals)
    # the markers are traces, the lines shapes; each legend entry is shown once, on its first use
    # (the window edge first appears in the third panel: sliding_window and streaming_llm have none)
    shown = [x.name for x in [*fig.data, *fig.layout.shapes] if getattr(x, "showlegend", None) and x.name]
    assert len(shown) == len(set(shown))
    assert {"heavy hitter (×n: n side by side)", "step 1000", "band edge (age 64)", "protected window (age 32)",
            "held while live", "evicted, still live", "evicted here"} <= set(shown)
    # the key above the panels (read first, and on the first screen), not under the axis
    assert fig.layout.legend.yanchor == "bottom" and fig.layout.legend.y > 1
    # one ▼ per group of neighbours, ×n over a shared one: the marks drawn are the marks counted
    heads = [t for t in fig.data if t.name == "heavy hitter (×n: n side by side)"]
    groups = kept_figures.heavy_marks([p for p, _, _ in f.heavy], 4097, 3)
    for t in heads:
        assert len(t.x) == len(groups) == 8 and [int(x[1:]) if x else 1 for x in t.text] == [len(g) for g in groups]
    # the age strip's edges run from the image's top down, clear of the strips' names under the axis
    edges = [s for s in fig.layout.shapes if s.name in ("band edge (age 64)", "protected window (age 32)")]
    assert edges and all(min(s.y0, s.y1) == 0.5 for s in edges)
    names = [a for a in fig.layout.annotations if a.text in ("sinks", "newest 128 →")]
    assert len(names) == 6 and all(a.yref.endswith(" domain") and a.y == 0 and a.yshift < 0 for a in names)
    windows = [s for s in fig.layout.shapes if s.name == "protected window (age 32)"]
    assert [(s.xref, s.yref) for s in windows] == [("x3", "y3")]
    titles = " ".join(a.text for a in fig.layout.annotations)
    assert "streaming_llm (sinks=4)" in titles and f"{story[1].retained_mass:.3f}" in titles


def test_the_age_strip_is_shaded_by_the_share_held(canonical, story):
    """Issue 44: with "mid-grey when any is held", h2o's few survivors past its window drew the age
    strip as a dense hatch; shaded by the share held, its window is dark and what lies past it pale."""
    f = features.trace_features(canonical)
    fig = figures.kept_heatmap(story, f, step=1000, size=341)
    h2o = np.asarray(png_of(images(fig, "newest positions")[2].source))
    assert h2o.shape[1] == 64  # 128 ages, two to a column
    assert (h2o[-1, :15] == pooling.KEPT).all() and (h2o[-1, 16:] == pooling.EVICTED).all()
    assert h2o[100:, 16:].mean() > 245 and len(np.unique(h2o)) > 3  # pale past the window, in shades, not 3 levels
    lay = figures.panel_layers([story[2].kept_history], figures.Region.whole(4096), 4, 128, 341)
    assert lay["age"][0] == images(fig, "newest positions")[2].source  # the app's cached layers draw the same


def test_the_kept_figure_is_valid_plotly(canonical, story):
    """The figure is put together from plain dicts and not validated as it is built: Plotly's own
    validation of the result must change nothing (a misspelt property would raise here)."""
    f = features.trace_features(canonical)
    for fig in (figures.kept_heatmap(story, f, step=1000), figures.kept_heatmap(story[:2], f, compare=True),
                figures.kept_heatmap(story[2:], f, region=figures.Region(1000, 1199, 1100, 1299), size=1024)):
        spec = fig.to_dict()
        assert go.Figure(spec).to_dict() == spec


def test_a_zoomed_region_is_drawn_at_full_resolution(canonical, story):
    f = features.trace_features(canonical)
    region = figures.Region(1000, 1199, 1100, 1299)
    fig = figures.kept_heatmap(story[2:], f, region=region, size=1024)
    (main,) = images(fig, "h2o")
    full = figures.kept_image(story[2])[1099:1299, 1000:1200]
    assert np.array_equal(np.asarray(png_of(main.source)), full)
    assert (main.x0, main.dx, main.y0, main.dy) == (1000, 1, 1100, 1)


def test_heavy_fates_say_when_each_was_evicted(canonical, story):
    f = features.trace_features(canonical)
    for result in story:
        mask = result.kept_mask()
        for fate in features.heavy_fates(result.kept_history, f):
            p, ev = fate.position, fate.evicted_at
            if ev is None:
                assert mask[-1, p] == 1
            else:
                assert mask[ev - 2, p] == 1 and mask[ev - 1:, p].sum() == 0
    sliding = features.heavy_fates(story[0].kept_history, f)
    assert all(x.lost_while_live and x.evicted_at == x.position + 256 for x in sliding)  # out of the window
    fig = figures.kept_heatmap(story[:1], f)
    (marks,) = [t for t in fig.data if t.name == "evicted here"]
    assert len(marks.x) == len(f.heavy) and list(marks.y) == [x.evicted_at for x in sliding]
    assert all(x > p for x, (p, _, _) in zip(marks.x, f.heavy, strict=True))  # beside the column, not on it


def test_the_difference_shows_what_one_keeps_and_the_other_does_not(canonical, story):
    f = features.trace_features(canonical)
    fig = figures.kept_heatmap([story[1], story[0]], f, compare=True)
    (strip,) = [np.asarray(png_of(t.source)) for t in images(fig, "sinks")]
    assert tuple(strip[-1, 0]) == pooling.ONLY_A  # the sinks: streaming_llm's, not sliding_window's
    assert tuple(strip[0, 0]) == pooling.BOTH  # before the cache fills, both hold them
    assert "kept by streaming_llm only" in {t.name for t in fig.data}
    a, b = figures.difference_counts(story[1].kept_history, story[0].kept_history)
    # four sinks for the four newest, once full; each a float64 mean of 4096 counts of at most 4
    assert 3 < a < 4 and a == pytest.approx(b, abs=2 * rounding64(4096, 4.0))
    # what the masks say, step by step
    ma, mb = story[1].kept_mask().astype(bool), story[0].kept_mask().astype(bool)
    assert (a, b) == (float((ma & ~mb).sum(axis=1).mean()), float((mb & ~ma).sum(axis=1).mean()))
    with pytest.raises(ValueError, match="two replays"):
        figures.kept_heatmap(story[:1], f, compare=True)


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        ({"selection": {"box": [{"x": [1199.4, 1000.2], "y": [1100.1, 1299.6]}]}}, (1000, 1199, 1100, 1300)),
        ({"selection": {"box": [{"x": [-300.0, 50.0], "y": [-40.0, 30.0]}]}}, (0, 50, 1, 30)),  # strips, header
        ({"selection": {"box": [{"x": [10.0, 10.2], "y": [1.0, 9.0]}]}}, None),  # one position is not a region
        ({"selection": {"box": []}}, None),
        ({"selection": {"points": []}}, None),
        (None, None),
    ],
)
def test_selected_region_clips_the_box_to_the_run(event, expected):
    region = figures.selected_region(event, 4096)
    assert (None if region is None else (region.p0, region.p1, region.t0, region.t1)) == expected


def test_kept_heatmap_reuses_given_layers(canonical, story):
    f = features.trace_features(canonical)
    lay = figures.panel_layers([story[0].kept_history], figures.Region.whole(4096), 4, 128, 300)
    fig = figures.kept_heatmap(story[:1], f, layers=[lay])
    assert images(fig, "sliding_window")[0].source == lay["main"]


def _pooled_equal(x, y):
    if x is None or y is None:
        return x is None and y is None
    (cx, ex), (cy, ey) = x, y
    return len(cx) == len(cy) and all(map(np.array_equal, cx, cy)) and np.array_equal(ex, ey)


def _random_history(rng, T: int, budget: int) -> np.ndarray:
    """A kept history as a replay records one: row t - 1 holds distinct positions 0 .. t (at most
    ``budget``), in no particular order, -1 padded."""
    out = np.full((T, budget), -1, dtype=np.int32)
    for t in range(1, T + 1):
        held = rng.permutation(t + 1)[: int(rng.integers(0, min(budget, t + 1) + 1))]
        out[t - 1, : held.size] = held
    return out


@pytest.mark.skipif(not kvsim.sim.engine.AVAILABLE, reason="the pooling kernels need numba")
def test_pooling_kernels_give_the_reference_sums():
    """The kernels, reading kept histories, and the NumPy reference, reading the masks built from
    them, pool the same blocks to the same counts: one history and two, regions with ragged edge
    blocks, sinks past the region, no strips, budgets from 1 to past the trace."""
    rng = np.random.default_rng(11)
    T = 57
    for trial in range(60):
        budget = int(rng.integers(1, T + 3))
        histories = [_random_history(rng, T, budget) for _ in range(2)]
        p0, t0 = int(rng.integers(0, T)), int(rng.integers(1, T))
        region = figures.Region(p0, int(rng.integers(p0, T + 1)), t0, int(rng.integers(t0, T + 1)))
        sinks, ages = int(rng.integers(0, 8)), int(rng.integers(0, 70))
        br, bc, ba = (int(v) for v in rng.integers(1, 9, size=3))
        for chosen in (histories[:1], histories):
            want = pooling._pool_panel([kept_mask_of(h) for h in chosen], region, sinks, ages, br, bc, ba)
            got = pooling._pool_panel_fast(chosen, region, sinks, ages, br, bc, ba)
            assert all(_pooled_equal(w, g) for w, g in zip(want, got, strict=True)), (trial, region, len(chosen))
        a, b = histories
        ma, mb = kept_mask_of(a).astype(bool), kept_mask_of(b).astype(bool)
        assert figures.difference_counts(a, b) == (float((ma & ~mb).sum(axis=1).mean()), float((mb & ~ma).sum(axis=1).mean()))
        f = features.TraceFeatures(steps=T, sinks=0, band=4, heavy=tuple((p, p + 1, T) for p in range(0, T + 1, 5)),
                                  heavy_source="", live_known=True, band_known=True, band_source="", sink_source="")
        for fate in features.heavy_fates(a, f):  # held from birth for as many steps as the mask says
            held = int(ma[max(fate.position, 1) - 1 :, fate.position].sum())
            until = max(fate.position, 1) + held - 1
            assert fate.evicted_at == (None if until >= T else until + 1)


@pytest.mark.skipif(not kvsim.sim.engine.AVAILABLE, reason="the pooling kernels need numba")
def test_panel_layers_draws_the_same_images_with_and_without_the_kernels(story, monkeypatch):
    kept = [r.kept_history for r in story]
    cases = [([kept[0]], figures.Region.whole(4096), 4, 128, 341), (kept[1:], figures.Region.whole(4096), 4, 512, 1024),
             ([kept[2]], figures.Region(1000, 1300, 2000, 2400), 4, 64, 341), (kept[:2], figures.Region(3, 900, 5, 4000), 1, 0, 77)]
    fast = [figures.panel_layers(*case) for case in cases]
    fast_counts = figures.difference_counts(kept[0], kept[1])
    monkeypatch.setattr(pooling, "AVAILABLE", False)
    assert [figures.panel_layers(*case) for case in cases] == fast
    assert figures.difference_counts(kept[0], kept[1]) == fast_counts


def test_kept_heatmap_refuses_a_replay_of_another_trace(canonical, small):
    other = kvsim.replay(small, "sliding_window", budget=8, record_kept=True)
    with pytest.raises(ValueError, match="steps"):
        figures.kept_heatmap([other], features.trace_features(canonical))


def test_more_than_three_panels_leave_room_for_the_second_row_titles(canonical, story):
    f = features.trace_features(canonical)
    fig = figures.kept_heatmap(story + story[:1], f)
    top_row_bottom = fig.layout.yaxis.domain[0]
    second_row_top = fig.layout.yaxis4.domain[1]
    assert (top_row_bottom - second_row_top) * fig.layout.height > 100  # pixels for the axis and the titles


def test_the_key_sits_above_the_tallest_title_under_a_serving_layout(canonical, story):
    """Issue 56: under a serving layout the panels' titles take a third line (the layout's constraints) and
    the key's second row sat on them. The key's bottom is placed above the tallest title and the top margin
    holds its rows, the panels' height unchanged; without a layout the figure is 507 px high (on the first
    screen at 1280 x 800, with the first lines of its notes)."""
    from kvsim.policykit.layouts import Layout

    f = features.trace_features(canonical)
    plain = figures.kept_heatmap(story, f, step=1000)
    assert (plain.layout.height, plain.layout.margin.t) == (507, 142)
    laid = [replay(canonical, r.policy, budget=256, record_kept=True, layout=Layout(16), **r.params) for r in story]
    fig = figures.kept_heatmap(laid, f, step=1000)
    titles = [a.text for a in fig.layout.annotations if a.yref == "paper"]
    assert kept_figures.title_lines(titles) == 3 and kept_figures.title_lines([a.text for a in plain.layout.annotations
                                                                              if a.yref == "paper"]) == 2
    for figure, lines in ((plain, 2), (fig, 3)):
        lay = figure.layout
        plot = lay.height - lay.margin.t - lay.margin.b
        assert plot == kept_figures.ROW_HEIGHT  # the panels keep their height
        above = (lay.legend.y - 1) * plot  # the key's bottom, in pixels above the panels
        assert lay.legend.yanchor == "bottom" and above >= kept_figures.KEY_GAP + kept_figures.TITLE_LINE * lines - 1e-9
        assert lay.margin.t - above >= 2 * kept_figures.KEY_ROW + kept_figures.MODEBAR - 1e-9  # two rows of the key, within the figure
    # a key of more entries than two rows hold gets the room for them; a figure drawn on is placed again
    names = [f"protected window (age {w})" for w in range(10, 100, 10)]
    assert kept_figures.key_rows(names[:3]) == 1 and kept_figures.key_rows(names) == 3
    more = go.Figure(fig)
    for name in names:
        more.add_trace(go.Scatter(x=[None], y=[None], name=name, mode="lines"))
    figures.fit_key(more)
    assert more.layout.margin.t > fig.layout.margin.t
    assert more.layout.height - more.layout.margin.t == fig.layout.height - fig.layout.margin.t
    assert (more.layout.legend.y - 1) * kept_figures.ROW_HEIGHT == pytest.approx((fig.layout.legend.y - 1) * kept_figures.ROW_HEIGHT)


# --------------------------------------------------------------------------------------------
# cumulative scores


def test_score_snapshot_tells_positions_apart(canonical, story):
    h2o = story[2]
    f = features.trace_features(canonical)
    snap = figures.score_snapshot(h2o, 4096, f)
    assert len(snap) == 257  # budget + 1 before eviction
    assert snap["evicted"].sum() == 1
    recent = snap[snap["category"] == "recent window"]
    assert sorted(recent["position"]) == list(range(4096 - 31, 4097))  # the newest 32, the new one included
    assert set(snap.loc[snap["position"] < 4, "category"]) == {"sink"}
    assert "heavy hitter (live)" in set(snap["category"]) and "heavy hitter (stale)" in set(snap["category"])
    threshold = figures.eviction_threshold(snap)
    evictable_kept = snap[~snap["evicted"] & (snap["category"] != "recent window")]
    assert (evictable_kept["score"] >= threshold).all()


def test_score_snapshot_before_the_cache_fills_has_no_threshold(canonical, story):
    snap = figures.score_snapshot(story[2], 100, features.trace_features(canonical))
    assert not snap["evicted"].any() and figures.eviction_threshold(snap) is None


def test_score_distribution_marks_threshold_and_categories(canonical, story):
    fig = figures.score_distribution(story[2], 3000, features.trace_features(canonical))
    names = {t.name for t in fig.data}
    assert {"sink", "recent window", "other", "evicted at this step (ringed ×)"} <= names
    assert any(n.startswith("eviction threshold") for n in names)
    assert any(isinstance(t, go.Histogram) for t in fig.data)
    assert any("eviction threshold" in (a.text or "") for a in fig.layout.annotations)
    assert fig.layout.yaxis.type == "log"
    # the key above the panels' titles, under the figure's title (issue 56: under the axis it was below the
    # fold at 1280 x 800); the panels keep their 340 px
    lay = fig.layout
    assert lay.legend.yanchor == "bottom" and (lay.legend.y - 1) * 340 >= 30
    assert lay.height - lay.margin.t - lay.margin.b == 340 and lay.margin.t >= 36 + 2 * 26


def test_score_axis_spans_the_scores_for_votes_too(canonical):
    """scissorhands counts votes (0 .. thousands): the axis, in log10 units, spans exactly those,
    and the threshold's label sits at the threshold (plotly reads log-axis annotations in log10)."""
    result = replay(canonical, "scissorhands", budget=256, record_kept=True, record_scores=True)
    fig = figures.score_distribution(result, 4000, features.trace_features(canonical))
    snap = figures.score_snapshot(result, 4000, features.trace_features(canonical))
    lo, hi = fig.layout.yaxis.range
    positive = snap["score"][snap["score"] > 0]
    assert lo <= np.log10(positive.min() / 10) and hi >= np.log10(snap["score"].max()) and hi < 4.5
    (label,) = [a for a in fig.layout.annotations if (a.text or "").startswith("eviction threshold")]
    where = np.log10(max(figures.eviction_threshold(snap), positive.min() / 10))
    assert lo <= label.y <= hi and label.y == pytest.approx(where, abs=rounding64(2, abs(where)))  # the same log10, drawn
    assert not fig.layout.shapes or all(s.xref != "x" for s in fig.layout.shapes)


LOG_LABEL = re.compile(r"^[125]e-?\d+$")


def _log_scales(fig: go.Figure) -> list[tuple[list[float], list[str]]]:
    """Every log scale of a figure as (tick places in log10 units, labels): a log axis, an axis of
    log10 values (its title says "(log)") and a colour bar of log10 values. Unlabelled ones too (no
    ticktext: left to Plotly, which labels them by its own rule)."""
    found = []
    for name in [k for k in fig.layout.to_plotly_json() if k.startswith(("xaxis", "yaxis"))]:
        axis = fig.layout[name]
        if axis.type == "log":
            found.append(([float(np.log10(v)) for v in axis.tickvals or ()], list(axis.ticktext or ())))
        elif "(log)" in str(axis.title.text or ""):
            found.append((list(axis.tickvals or ()), list(axis.ticktext or ())))
    for t in fig.data:
        bar = getattr(getattr(t, "marker", None), "colorbar", None)
        if bar is not None and "(log)" in str(bar.title.text or ""):
            found.append((list(bar.tickvals or ()), list(bar.ticktext or ())))
    return found


def test_every_log_scale_is_labelled_in_one_format(canonical, story):
    """Issue 31, item 5: the score view's log axis read "100µ" and its histogram "1e-4" for the same scale.
    Every log scale of every view (the scores' two panels, votes too, and the trace's colour bar) is
    labelled by one rule, and the same place gets the same label everywhere."""
    scissorhands = replay(canonical, "scissorhands", budget=256, record_kept=True, record_scores=True)
    feats = features.trace_features(canonical)
    figs = [figures.score_distribution(story[2], 3000, feats), figures.score_distribution(scissorhands, 4000, feats),
            figures.trace_matrix(canonical, feats)]
    label_at: dict[float, str] = {}
    scales = [scale for fig in figs for scale in _log_scales(fig)]
    assert len(scales) == 5
    for places, labels in scales:
        assert len(labels) >= 2 and len(labels) == len(places), labels
        assert all(LOG_LABEL.match(text) for text in labels), labels
        for at, text in zip(places, labels, strict=True):
            assert label_at.setdefault(round(at, 6), text) == text
            assert float(text) == pytest.approx(10 ** at)


def test_score_view_refuses_what_it_cannot_show(canonical, story):
    f = features.trace_features(canonical)
    with pytest.raises(ValueError, match="no scores"):
        figures.score_snapshot(story[0], 100, f)
    with pytest.raises(ValueError, match="step"):
        figures.score_snapshot(story[2], 5000, f)


# --------------------------------------------------------------------------------------------
# retained mass against recent_window


def fake_rows(values):
    return [{"policy": "h2o", "budget": 10, "recent_window": w, "retained_mass": m, "top_k_recall": m}
            for w, m in values]


def test_curve_has_references_markers_and_current():
    rows = fake_rows([(1, 0.5), (2, 0.6), (3, 0.9), (4, 0.8)])
    refs = [figures.Line("streaming_llm (sinks=4)", 0.7, 0.7, policy="streaming_llm"),
            figures.Line("sliding_window", 0.4, 0.4, policy="sliding_window")]
    fig = figures.recent_window_curve(rows, refs, current=4, default=2, band=3, top_k=32)
    by_name = {}
    for t in fig.data:
        by_name.setdefault(t.name, []).append(t)
    assert len(by_name["h2o"]) == 2  # retained mass and recall
    assert list(by_name["h2o"][0].customdata) == [1, 2, 3, 4]
    assert list(by_name["streaming_llm (sinks=4)"][0].y) == [0.7, 0.7]
    assert list(by_name["shipped default (2)"][0].x) == [2]
    assert list(by_name["trace band (3)"][0].x) == [3]
    assert list(by_name["current recent_window (4)"][0].x) == [4]
    text = " ".join(a.text for a in fig.layout.annotations)
    assert "peak at 3" in text and "gain saturates" in text
    assert "keeps less than streaming_llm (0.600 vs 0.700)" in text


def test_curve_says_so_when_the_default_is_not_worse():
    rows = fake_rows([(1, 0.8), (2, 0.9)])
    refs = [figures.Line("streaming_llm (sinks=4)", 0.7, 0.7, policy="streaming_llm")]
    fig = figures.recent_window_curve(rows, refs, current=None, default=2, band=64)
    text = " ".join(a.text for a in fig.layout.annotations)
    assert "at least as much as" in text and "saturates" not in text
    assert not any((t.name or "").startswith("current") for t in fig.data)
    unknown = figures.recent_window_curve(rows, refs, current=None, default=2, band=1, band_known=False)
    assert not any("band" in (t.name or "") for t in unknown.data)  # no band, no mark pointing at one
    assert not any("band" in (a.text or "") for a in unknown.layout.annotations)


def fake_family():
    """h2o and scissorhands over recent_window 1..4, one deployable line and two offline ones."""
    rows = fake_rows([(1, 0.5), (2, 0.6), (3, 0.9), (4, 0.8)])
    scissors = [dict(r, policy="scissorhands", history_window=0, retained_mass=r["retained_mass"] - 0.1,
                     top_k_recall=r["top_k_recall"] - 0.05) for r in rows]
    lines = [figures.Line("streaming_llm (sinks=4)", 0.7, 0.7, policy="streaming_llm"),
             figures.Line("tova", 0.95, 1.0, policy="tova"),
             figures.Line("greedy_future (offline reference)", 0.75, 0.7, "offline", "greedy_future"),
             figures.Line("upper bound (offline reference)", 0.97, 1.0, "bound")]
    return rows, scissors, lines


def test_curve_draws_companions_and_offline_references_apart():
    rows, scissors, lines = fake_family()
    fig = figures.recent_window_curve(rows, lines, current=4, default=2, band=3, companions={"scissorhands": scissors})
    by_name = {}
    for t in fig.data:
        by_name.setdefault(t.name, []).append(t)
    # scissorhands: a curve on both panels, clickable like h2o's, with a marker of its own (a
    # companion told apart by its colour alone was lost where colours repeated), never the marks'
    sc = by_name["scissorhands"]
    assert len(sc) == 2 and all(t.mode.startswith("lines") for t in sc)
    assert {t.marker.symbol for t in sc} == {"diamond"} and by_name["h2o"][0].marker.symbol == "circle"
    assert list(sc[0].customdata) == [1, 2, 3, 4]
    assert list(sc[0].y) == pytest.approx([0.4, 0.5, 0.8, 0.7], rel=rounding(1))  # the rows' figures, a float32 store at most
    assert [t.yaxis for t in sc] == ["y", "y2"]
    # the markers and the current point stay on h2o's values, never scissorhands'
    assert list(by_name["shipped default (2)"][0].y) == [0.6]
    assert list(by_name["trace band (3)"][0].y) == [0.9]
    assert list(by_name["current recent_window (4)"][0].y) == [0.8]
    assert all(t.legend == "legend3" for n in ("shipped default (2)", "current recent_window (4)") for t in by_name[n])
    # deployable lines in the policies legend; offline references dotted, grey and black, in their own
    assert list(by_name["tova"][0].y) == [0.95, 0.95] and by_name["tova"][0].legend in (None, "legend")
    greedy, bound = by_name["greedy_future (offline reference)"], by_name["upper bound (offline reference)"]
    assert list(bound[1].y) == [1.0, 1.0] and list(greedy[0].y) == [0.75, 0.75]
    assert {t.legend for t in greedy + bound} == {"legend2"}
    # dotted: every dash a dot (at most 3 px), each in a pattern of its own (issue 31, item 5)
    for t in greedy + bound:
        assert max(float(v.removesuffix("px")) for v in t.line.dash.split(",")[::2]) <= 3, t.line.dash
    assert greedy[0].line.dash != bound[0].line.dash
    assert bound[0].line.color == "black" and greedy[0].line.color == "#b0b0b0"  # light grey beside the black
    assert "offline references" in fig.layout.legend2.title.text and "h2o" in fig.layout.legend3.title.text
    # the legend lists h2o first, then scissorhands, then the lines
    ranks = {t.name: t.legendrank for t in fig.data if t.showlegend is not False and t.legend in (None, "legend")}
    assert sorted(ranks, key=ranks.get)[:2] == ["h2o", "scissorhands"]
    # the notes are about h2o
    text = " ".join(a.text for a in fig.layout.annotations)
    assert "peak at 3: 0.900" in text and "at 2, h2o keeps less than streaming_llm (0.600 vs 0.700)" in text


def test_the_curve_figure_is_valid_plotly():
    """The curve is put together from plain dicts and not validated as it is built: Plotly's own
    validation of the result must change nothing (a misspelt property would raise here), with every
    kind of series, mark and note drawn (companions, lines that coincide, the exact best and the
    recommended window apart, a tour step's height)."""
    import plotly.io as pio

    rows, scissors, lines = fake_family()
    every = fake_rows([(1, 0.5), (2, 0.9), (3, 0.905), (4, 0.91)])
    coincide = [*lines, figures.Line("tova", 0.97, 1.0, policy="tova")]
    for fig in (figures.recent_window_curve(rows, coincide, current=4, default=2, band=3, companions={"scissorhands": scissors}),
                figures.recent_window_curve(every, lines, current=1, default=2, band=3, budget=5, plot_height=470),
                figures.recent_window_curve(rows, (), current=None, default=2, band=3, band_known=False)):
        assert json.loads(pio.to_json(go.Figure(fig.to_dict()), validate=True)) == json.loads(pio.to_json(fig, validate=False))


@pytest.mark.parametrize("plot_height", [None, 470])
def test_the_curves_legends_lie_between_its_panels(plot_height):
    """Issue 56: under the lower panel the legends were below the fold at 1280 x 800; between the panels they
    follow the retained mass. Each panel keeps its height; the gap holds the taller column of legends."""
    from kvsim.views.figures import curve as curves

    rows, scissors, lines = fake_family()
    fig = figures.recent_window_curve(rows, lines, current=4, default=2, band=3, companions={"scissorhands": scissors},
                                      plot_height=plot_height)
    lay = fig.layout
    plot = lay.height - lay.margin.t - lay.margin.b
    panel = (plot_height or curves.PLOT_HEIGHT) * (1 - 0.08) / 2
    (u0, u1), (l0, l1) = lay.yaxis.domain, lay.yaxis2.domain
    assert u1 == 1 and l0 == 0
    assert (u1 - u0) * plot == pytest.approx(panel, abs=1) and (l1 - l0) * plot == pytest.approx(panel, abs=1)
    lower_top = lay.margin.b + l1 * plot  # in pixels from the figure's foot, as the legends' container y
    upper_bottom = lay.margin.b + u0 * plot
    for legend in (lay.legend, lay.legend2, lay.legend3):
        assert legend.yref == "container" and legend.yanchor == "top"
        assert lower_top + curves.KEY_BELOW <= legend.y * lay.height <= upper_bottom - curves.KEY_ABOVE + 1e-6
    titles = [a for a in lay.annotations if a.text in ("retained mass", "top-5 recall", "top-32 recall")]
    assert sorted(a.y for a in titles) == pytest.approx([l1, 1.0])


def test_the_recommended_note_reads_away_from_the_nearer_edge():
    """Plotly widens an axis to fit a note: the recommended window's, near the left edge and reading
    leftwards, stretched the curve at budget 1024 to recent_window -600."""
    def note(masses):
        rows = fake_rows(list(zip(range(1, 10), masses, strict=True)))
        fig = figures.recent_window_curve(rows, current=1, default=2, band=5, budget=10)
        (a,) = [a for a in fig.layout.annotations if a.text.startswith("recommended")]
        return a.x, a.xanchor, a.ax

    assert note([0.5, 0.7, 0.949, 0.9, 0.9, 0.9, 0.9, 0.95, 0.9]) == (3, "left", 30)  # near the left edge: rightwards
    assert note([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.949, 0.9, 0.95]) == (7, "right", -30)


def test_sweep_table_puts_the_curves_side_by_side():
    rows, scissors, _ = fake_family()
    table = figures.sweep_table({"h2o": rows, "scissorhands": scissors[:3]}, top_k=32)
    assert list(table.columns) == [
        "recent_window", "budget", "h2o retained_mass", "h2o top_32_recall",
        "scissorhands retained_mass", "scissorhands top_32_recall", "scissorhands history_window",
    ]
    assert list(table["recent_window"]) == [1, 2, 3, 4]
    assert list(table["scissorhands retained_mass"][:3]) == pytest.approx([0.4, 0.5, 0.8], rel=rounding(1))  # as above
    assert np.isnan(table["scissorhands retained_mass"].iloc[3])  # a value one sweep lacks stays empty
    with pytest.raises(ValueError, match="at least one"):
        figures.sweep_table({})


def test_canonical_curve_tells_the_cards_story(canonical, story):
    from kvsim.policykit.upper_bound import upper_bound_summary

    rows = sweep(canonical, "h2o", 256, "recent_window", range(1, 256))
    scissors = sweep(canonical, "scissorhands", 256, "recent_window", range(1, 256))
    lines = [figures.Line.of(r.summary(), figures.policy_label(r), policy=r.policy) for r in story[:2]]
    lines.append(figures.Line.of(replay(canonical, "tova", budget=256).summary(), "tova", policy="tova"))
    lines.append(figures.Line.of(replay(canonical, "greedy_future", budget=256).summary(), "greedy_future (offline reference)", "offline"))
    lines.append(figures.Line.of(upper_bound_summary(canonical, 256, 32), "upper bound (offline reference)", "bound"))
    fig = figures.recent_window_curve(rows, lines, current=32, companions={"scissorhands": scissors})
    text = " ".join(a.text for a in fig.layout.annotations)
    assert "peak at 64" in text and "gain saturates here" in text
    assert "at 32, h2o keeps less than streaming_llm" in text
    # both curves peak at the band; no deployable policy passes the bound
    assert features.curve_peak(scissors)[0] == 64
    bound = lines[-1].retained_mass
    lines = [t for t in fig.data if t.yaxis == "y" and t.name in ("h2o", "scissorhands", "tova", "streaming_llm (sinks=4)")]
    assert len(lines) == 4 and all(max(t.y) <= bound + 2 * rounding64(4096 + 257) for t in lines)  # two float64 means


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        ({"selection": {"points": [{"x": 40, "customdata": 40, "curve_number": 0}]}}, 40),
        ({"selection": {"points": [{"x": 12.0}]}}, 12),
        ({"selection": {"points": [{"x": 0.5}]}}, None),
        ({"selection": {"points": []}}, None),
        (None, None),
        ({"selection": {}}, None),
    ],
)
def test_selected_recent_window(event, expected):
    assert figures.selected_recent_window(event) == expected


# --------------------------------------------------------------------------------------------
# the trace


def test_attention_image_is_log_scaled_and_block_averaged():
    a = np.zeros((9, 9), dtype=np.float32)
    a[1:, 0] = 1e-4
    a[8, 7] = 1.0
    rgb, block, (lo, hi) = figures.attention_image(a, size=4)
    assert rgb.dtype == np.uint8 and rgb.shape == (4, 4, 3) and block == 2
    assert np.all(rgb[0, 3] == 255)  # the future: nothing there, white
    lut = figures.trace._lut(sequential.Viridis)
    assert np.array_equal(rgb[3, 3], lut[255])  # the brightest block at the top of the scale
    # block mean of one 1.0 among four cells: a float32 mean of 4 terms, then its log10
    assert hi == pytest.approx(np.log10(0.25), abs=rounding(4) / np.log(10))


def test_trace_matrix_is_an_image_with_features_named(canonical):
    f = features.trace_features(canonical)
    fig = figures.trace_matrix(canonical, f)
    img = fig.data[0]
    assert isinstance(img, go.Image)
    png = png_of(img.source)
    assert png.size == (1024, 1024)
    assert img.dx == 4 and img.dy == 4
    text = " ".join(a.text for a in fig.layout.annotations)
    assert "sinks (positions 0-3)" in text and "recency band (64)" in text
    # one triangle per group of neighbours, each saying how many it stands for (issue 31, item 5)
    (heavy,) = [t for t in fig.data if (t.name or "").startswith("heavy hitter (born here")]
    groups = figures.trace.heavy_marks_drawn(f)
    assert len(heavy.x) == len(groups) < len(f.heavy)
    assert sorted(p for g in groups for p in g) == sorted(p for p, _, _ in f.heavy)


def test_per_step_table(story):
    table = figures.per_step_table(story)
    assert len(table) == 4096 and table["step"].iloc[-1] == 4096
    assert table["h2o (recent_window=32) retained_mass"].mean() == pytest.approx(story[2].retained_mass, abs=2 * rounding64(4096))
    assert "streaming_llm (sinks=4) top_32_recall" in table


def test_kept_mask_marks_exactly_the_recorded_kept_positions(story):
    for result in story:
        mask = result.kept_mask()
        assert mask.shape == (result.steps, result.steps + 1) and mask.dtype == np.uint8
        for t in (0, 1, 255, 256, 1000, result.steps - 1):
            held = result.kept_history[t][result.kept_history[t] >= 0]
            assert np.flatnonzero(mask[t]).tolist() == sorted(held.tolist())


def test_under_blocks_a_cell_is_whole_blocks_of_the_cache(small, monkeypatch):
    """Issue 45: a replay in blocks of 4 drawn from position 5 (inside block 1, positions 4..7): its cells start
    on a block and are whole blocks, all held or all gone, with and without the kernels; the figure pools
    that way by itself from the replay's layout, and refuses replays of two block sizes in one figure."""
    from kvsim.policykit.layouts import Layout

    paged = replay(small, "h2o", budget=16, recent_window=4, record_kept=True, layout=Layout(4))
    region = figures.Region(5, 40, 1, 40)
    lay = figures.panel_layers([paged.kept_history], region, 0, 8, 64, block_size=4)
    assert lay["block"][:2] == (1, 4) and lay["origin"] == 4 and lay["block_size"] == 4
    grey = np.asarray(png_of(lay["main"]))
    assert grey.shape == (40, 10) and pooling.PARTIAL not in grey  # positions 4..40; blocks leave whole
    assert (grey == pooling.KEPT).any() and (grey == pooling.EVICTED).any()
    assert figures.panel_layers([paged.kept_history], region, 0, 8, 64)["block"][:2] == (1, 1)  # no blocks: positions
    if kvsim.sim.engine.AVAILABLE:
        monkeypatch.setattr(pooling, "AVAILABLE", False)
        assert figures.panel_layers([paged.kept_history], region, 0, 8, 64, block_size=4) == lay
    fig = figures.kept_heatmap([paged], features.trace_features(small), region=region, size=64)
    (main,) = [t for t in fig.data if t.type == "image" and t.name == "h2o"]
    assert (main.dx, main.x0) == (4, 4 + 1.5) and "one cache block of 4 positions" in main.hovertemplate
    assert "block_size=4" in fig.layout.annotations[0].text
    plain = replay(small, "h2o", budget=16, recent_window=4, record_kept=True)
    with pytest.raises(ValueError, match="one block size"):
        figures.kept_heatmap([paged, plain], features.trace_features(small))

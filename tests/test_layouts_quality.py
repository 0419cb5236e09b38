"""``kvsim quality --mode open`` under a serving layout (``kvsim.models.quality_layout``): the open loop's
masks are the layout's kept sets (a layer's KV heads the same under shared selection), the measurement is the
open loop's document with the layout's columns, cached apart from the bare one; the closed loop decodes through
the deployed cache under the layout; both loops at once and grids are refused in one line before a model loads.
Tiny random models (tests/test_quality.py), nothing downloaded."""

from __future__ import annotations

import numpy as np
import pytest
from test_quality import HAS_TORCH, STEPS, ByteTokenizer, _tiny

from kvsim import cli
from kvsim.policykit.layouts import Layout

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from kvsim.models.quality import Session

    path = tmp_path_factory.mktemp("layouts-quality") / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 2)
    return Session(_tiny("gemma3"), ByteTokenizer(), path, STEPS, model_id="tiny-gemma3", progress=None)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))


def test_the_open_loops_masks_are_the_layouts_kept_sets(session):
    from kvsim.models.decode import replay_masks

    shared, _ = replay_masks(session.traces, "tova", 8, {}, session.n, layout=Layout(1, True, 1))
    assert session.kv_heads == 2
    for masks in shared.values():  # one selection per layer: both KV heads see the same positions
        assert np.array_equal(masks[0].numpy(), masks[1].numpy())
    blocks, mass = replay_masks(session.traces, "tova", 8, {}, session.n, layout=Layout(4))
    assert mass.shape == (len(blocks), 2) and np.all((0 < mass) & (mass <= 1))
    for masks in blocks.values():
        assert masks.numpy().sum(axis=2).max() <= 8 + 1  # at most the budget held, plus the query's own key


def test_measure_open_under_a_layout_is_the_open_loops_document_with_its_columns(session):
    from kvsim.models.quality_layout import measure_open

    doc = measure_open(session, "h2o", 16, {"recent_window": 2}, Layout(4, True, 2))
    assert doc["mode"] == "open" and doc["layout"] == "block_size=4 shared_selection evict_every=2"
    assert doc["memory"] == 16 and doc["cached"] is False and doc["kl"] >= 0
    again = measure_open(session, "h2o", 16, {"recent_window": 2}, Layout(4, True, 2))
    assert again["cached"] is True and again["kl"] == doc["kl"]
    bare = session.measure("h2o", 16, "open", recent_window=2)
    assert bare["cached"] is False and "layout" not in bare  # the bare result keeps its own key


def test_the_cli_refuses_a_layout_in_both_loops_at_once_before_a_model_loads(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text")
    code = cli.main(["quality", str(text), "--model", str(tmp_path / "no-model"), "--policy", "h2o", "--budget", "64",
                     "--block-size", "16", "--mode", "both"])
    err = capsys.readouterr().err
    assert code == 2 and "in the open loop or the closed loop (--mode open or closed)" in err and err.count("\n") == 1
    code = cli.main(["quality", str(text), "--model", str(tmp_path / "no-model"), "--policy", "h2o", "--budget", "64",
                     "--block-size", "128", "--mode", "open"])
    err = capsys.readouterr().err
    assert code == 2 and "larger than the budget" in err and err.count("\n") == 1


def test_measure_closed_under_a_layout_decodes_through_the_deployed_cache_in_whole_blocks(session, monkeypatch):
    from kvsim.hf.layout import memory
    from kvsim.models import quality_layout

    seen = []
    own = quality_layout._LayoutDecoder._cache
    monkeypatch.setattr(quality_layout._LayoutDecoder, "_cache", lambda self: seen.append(own(self)) or seen[-1])
    doc = quality_layout.measure_closed(session, "h2o", 16, {"recent_window": 2}, Layout(4, True, 1))
    assert doc["mode"] == "closed" and doc["layout"] == "block_size=4 shared_selection" and doc["memory"] == 16
    assert doc["cached"] is False and doc["kl"] >= 0 and 0 < doc["retained_mass"] <= 1
    (cache,) = seen
    assert memory(cache)["block_tables"] == 1 and memory(cache)["block_peak"] == 4
    for layer in cache.layers:
        held = [layer.held(0, h) for h in range(2)]
        assert np.array_equal(held[0], held[1]) and held[0].size <= 16
    again = quality_layout.measure_closed(session, "h2o", 16, {"recent_window": 2}, Layout(4, True, 1))
    assert again["cached"] is True and again["kl"] == doc["kl"]
    bare = session.measure("h2o", 16, "closed", recent_window=2)
    assert "layout" not in bare and bare["cached"] is False

"""Issue 45, item 2 (the app): the serving layout as a sidebar control, through AppTest. Set (from the control or
a link), the kept view replays under it and draws a cache block as one cell, the memory panel gives its whole
blocks beside the unconstrained cache, the plan download carries it; a combination the simulator refuses is
one line per policy; unset, the page is today's (no link key, nothing drawn, nothing computed)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
from PIL import Image
from test_app import charts, problems, run, widget
from test_qk_app import shipped_qk  # noqa: F401

from kvsim.analysis import memory
from kvsim.app.layout_control import LABEL, LAYOUT_OPEN
from kvsim.app.memory_panel import MEMORY_OPEN, layout_text
from kvsim.app.plan_download import PLAN_OPEN
from kvsim.data import qk
from kvsim.policykit.layouts import Layout
from kvsim.views.figures.pooling import EVICTED, FUTURE, KEPT, PARTIAL


def mains(spec: dict) -> list[dict]:
    """The kept figure's main images, one per panel (the policies' own names)."""
    return [t for t in spec["data"] if t["type"] == "image" and t["name"] not in ("sinks", "newest positions")]


def pixels(image: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(image["source"].split(",", 1)[1]))))


def test_no_layout_is_todays_page():
    at = run()
    assert problems(at) == [] and [e.value for e in at.error] == []
    assert LABEL in {e.label for e in at.expander}
    assert not {"block size", "decide every K steps"} & {w.label for kind in (at.sidebar.selectbox, at.sidebar.number_input) for w in kind}
    assert not {"block_size", "shared_selection", "evict_every"} & set(at.query_params)  # a link as before
    assert not any("layout" in c.value for c in at.sidebar.caption)
    (kept,) = charts(at)
    assert all("block_size" not in a.get("text", "") for a in kept["layout"]["annotations"])


def test_blocks_are_cells_of_the_kept_view_at_its_zoom():
    # positions from 2005 (inside block 125, which starts at 2000) and 101 steps: a step per row, a block per cell
    at = run({"block_size": "16", "policies": "h2o,tova"})
    at.session_state["zoom_positions"], at.session_state["zoom_steps"] = (2005, 3000), (3000, 3100)
    at.run()
    assert problems(at) == [] and [e.value for e in at.error] == []
    (kept,) = charts(at)
    titles = [a["text"] for a in kept["layout"]["annotations"]]
    assert any("recent_window=32, block_size=16" in t for t in titles) and any("tova (block_size=16)" in t for t in titles)
    for image in mains(kept):
        assert image["dx"] == 16 and image["dy"] == 1 and image["x0"] - 7.5 == 2000  # cells start on a block
        assert "one cache block of 16 positions x 1 step" in image["hovertemplate"]
        grey = pixels(image)
        # blocks leave whole: no cell is partly kept, every cell is one block, all held or all gone
        assert set(np.unique(grey)) <= {KEPT, EVICTED, FUTURE} and PARTIAL not in grey
        assert (grey == KEPT).any() and (grey == EVICTED).any()
        assert grey.shape == (101, -(-(3001 - 2000) // 16))
    words = " ".join(m.value for m in at.markdown)
    assert "Every panel runs under the serving layout **block_size=16**" in words and "one block of the cache" in words
    assert "| h2o (recent_window=32, block_size=16) |" in words
    # the whole run: the pixels ask for fewer columns, so a cell is whole blocks still
    at.session_state["zoom_positions"], at.session_state["zoom_steps"] = (0, 4096), (1, 4096)
    at.run()
    for image in mains(charts(at)[0]):
        assert image["dx"] % 16 == 0 and image["x0"] == (image["dx"] - 1) / 2


def test_the_control_sets_the_layout_into_the_link_and_its_notes():
    at = run({"policies": "h2o", "budget": "250"})
    at.session_state[LAYOUT_OPEN] = True
    at.run()
    widget(at, "selectbox", "block size").set_value(8).run()
    widget(at, "checkbox", "shared selection across a layer's KV heads").check().run()
    widget(at, "number_input", "decide every K steps").set_value(4).run()
    at.session_state[LAYOUT_OPEN] = False
    at.run()
    at.run()  # folded twice over: the values live in the session, not in the hidden inputs
    assert problems(at) == [] and [e.value for e in at.error] == []
    assert (at.query_params["block_size"], at.query_params["shared_selection"], at.query_params["evict_every"]) == ("8", "1", "4")
    (caption,) = [c.value for c in at.sidebar.caption if c.value.startswith("**layout:")]
    assert "**layout: block_size=8 shared_selection evict_every=4**" in caption
    assert "Budget 250 is no multiple of block_size 8: rounded down to 31 whole blocks (248 positions)" in caption
    assert "Shared selection on a trace with one KV head: a no-op" in caption
    (kept,) = charts(at)
    assert any("recent_window=32, block_size=8,<br>shared_selection, evict_every=4" in a["text"]
               for a in kept["layout"]["annotations"])  # the panel's title, broken between parameters


def test_a_refused_combination_is_one_line_per_policy():
    at = run({"block_size": "32", "budget": "16", "policies": "sliding_window,streaming_llm"})
    assert problems(at) == []
    assert [e.value for e in at.error] == [
        f"{name} under the layout block_size=32: block_size 32 is larger than the budget (16): the cache would hold no "
        "whole block. Change the layout or the setting in the sidebar; the kept view and the plan leave this policy out "
        "until then." for name in ("sliding_window", "streaming_llm")]
    at = run({"evict_every": "230", "policies": "h2o,tova"})  # 256 - 230 + 1 = 27 positions: below h2o's window
    assert problems(at) == []
    assert [e.value for e in at.error] == [
        "h2o: evict_every=230 leaves budget - k + 1 = 27: h2o's recent_window 32 must be below it. Change the layout or "
        "the setting in the sidebar; the kept view and the plan leave this policy out until then."]
    assert [t["name"] for t in mains(charts(at)[0])] == ["tova"]  # the other policy is drawn under the layout
    at = run({"block_size": "4", "evict_every": "0"})
    assert problems(at) == [] and not {"block_size", "evict_every"} & set(at.query_params)
    assert [w.value for w in at.warning] == ["block_size 4 from the link is not one of 1, 8, 16, 32; showing 1.",
                                             "evict_every=0 in the link is outside 1..16384; using 1."]


def test_the_optimum_under_blocks_and_the_offline_references():
    at = run({"block_size": "16", "policies": "optimal,greedy_future"})
    assert problems(at) == []
    assert [e.value for e in at.error] == [
        "greedy_future under the layout block_size=16: greedy_future is an offline reference: a layout wraps an online "
        "policy, or optimal (--block-size: the optimum under blocks). Change the layout or the setting in the sidebar; "
        "the kept view and the plan leave this policy out until then."]
    (kept,) = charts(at)
    assert [t["name"] for t in mains(kept)] == ["optimal"]
    assert any("optimal (block_size=16)" in a["text"] for a in kept["layout"]["annotations"])


def test_the_memory_panel_gives_whole_blocks_beside_the_unconstrained_cache():
    at = run({"trace": "gemma3-270m-heapq:L05", "policies": "h2o", "budget": "250", "block_size": "16"})
    at.session_state[MEMORY_OPEN] = True
    at.run()
    assert problems(at) == []
    text = " ".join(m.value for m in at.sidebar.markdown)
    # 18 layers x 18,432 bytes a position: 240 positions are 4,423,680 bytes, 250 are 4,608,000
    assert ("**Under the layout block_size=16**: the engine allocates 15 whole blocks of 16 positions in every layer and "
            "KV head, 240 positions (the budget 250 rounded down to whole blocks): **4.22 MiB**, beside **4.39 MiB** for "
            "budget 250 with no layout.") in text
    assert "Its block table of 15 entries (4-byte entries) is one per layer and KV head: 18 tables, 1.05 KiB." in text
    assert text.index("Under the layout") < text.index("**Larger models**")


def test_shared_selection_is_one_table_per_layer_on_a_model_of_several_kv_heads():
    smol = memory.SMOLLM2_135M  # 30 layers, 3 KV heads
    alone = layout_text(smol, 1025, 256, Layout(16))
    shared = layout_text(smol, 1025, 256, Layout(16, True))
    assert "one per layer and KV head: 90 tables, 5.62 KiB" in alone
    assert "one per layer, shared by its KV heads (shared selection): 30 tables, 1.88 KiB" in shared
    # 30 x 3 x 64 x 2 x 2 = 23,040 bytes a position; 256 = 16 whole blocks: the same memory as without
    assert "16 whole blocks of 16 positions in every layer and KV head, 256 positions: **5.62 MiB**, the same as **5.62 MiB**" in shared
    one = layout_text(memory.ONE_HEAD, 4097, 256, Layout(1, False, 8))
    assert "slot map of 256 entries" in one and "Once full it holds 249 to 256 positions" in one
    assert "block_size 64 is larger than the budget (32)" in layout_text(smol, 1025, 32, Layout(64))


def test_the_plan_download_carries_the_layout(deferred_downloads):
    deferred = deferred_downloads
    at = run({"policies": "h2o,optimal", "block_size": "16", "evict_every": "8"})
    assert problems(at) == [] and "plan: h2o" not in {b.label for b in at.get("download_button")}  # folded: not built
    at.session_state[PLAN_OPEN] = True
    at.run()
    assert problems(at) == [] and {b.label for b in at.get("download_button")} >= {"plan: h2o"}
    doc = json.loads(deferred["plan-h2o.json"]())
    assert doc["layout"] == {"block_size": 16, "shared_selection": False, "evict_every": 8}
    assert (doc["policy"], doc["budget"], doc["params"]) == ("h2o", 256, {"recent_window": 32})
    assert "plan-optimal.json" not in deferred  # an offline reference: no plan
    from kvsim.policykit.plan import Plan

    assert Plan.from_dict(doc).layout == Layout(16, False, 8)  # what --plan reads back


def test_the_difference_under_blocks_and_the_tour_leaves_the_layout():
    at = run({"block_size": "16", "kept_mode": "difference", "policies": "h2o,tova"})
    assert problems(at) == [] and [e.value for e in at.error] == []
    (kept,) = charts(at)
    (image,) = mains(kept)
    assert image["dx"] % 16 == 0 and image["x0"] == (image["dx"] - 1) / 2
    assert "blue: kept by h2o (recent_window=32, block_size=16)" in kept["layout"]["annotations"][0]["text"]
    assert any("keeps" in m.value and "h2o" in m.value for m in at.markdown)  # the difference's counts, said
    [b for b in at.sidebar.button if b.label == "start the guided tour"][0].click().run()
    assert problems(at) == [] and "block_size" not in at.query_params  # the tour tells of policies in no layout
    assert not any(c.value.startswith("**layout:") for c in at.sidebar.caption)


def test_a_query_key_trace_longer_than_its_matrix_replays_under_the_layout(shipped_qk, monkeypatch):  # noqa: F811
    monkeypatch.setattr(qk, "DENSE_LIMIT", 150)
    at = run({"trace": "toyqk:L01", "budget": "64", "block_size": "8", "policies": "h2o,tova"})
    assert problems(at) == [] and [e.value for e in at.error] == []
    (kept,) = charts(at)
    assert [t["name"] for t in mains(kept)] == ["h2o", "tova"] and all(t["dx"] % 8 == 0 for t in mains(kept))
    assert "| tova (block_size=8) |" in " ".join(m.value for m in at.markdown)

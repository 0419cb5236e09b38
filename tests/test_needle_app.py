"""The app's pass-key view through AppTest: a saved grid drawn beside its control, a cell where the
control failed labelled and not counted, and a trial's cache drawn with the key's columns and the step
each key token left. The grid and the trial's departures are written the way ``kvsim needle`` writes
them (``save_grid``, ``write_trial``); their figures are made up, the view's reading of them is not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def _run(label, key_positions, correct, left=None):
    from kvsim.models import needle

    return {"policy": label.split(" ")[0], "budget": 16, "params": {}, "label": label,
            "text": " 12345." if correct else " 12 and",
            "answer": "12345" if correct else None, "correct": correct, "cached": False, "prefill_seconds": 1.0,
            "decode_seconds": 0.1, "positions": 47,
            "key_left": None if left is None else needle.fate(left, key_positions),
            "key_first_left": None if left is None else needle.first_loss(left, key_positions),
            "cache_key": {"test": label, "at": key_positions[0]}}


@pytest.fixture
def saved(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    return saved_grid()


def saved_grid() -> dict:
    """A grid of one policy over two depths, written into ``KVSIM_CACHE_DIR`` as ``kvsim needle`` writes one."""
    from kvsim.models import needle, needle_prompt

    # a sliding window of 16 over 47 positions: position p leaves at step p + 16
    left = np.where(np.arange(48) + 16 < 47, np.arange(48) + 16, -1).astype(np.int32)[None, None, :]
    cells = []
    for depth in (0.0, 1.0):
        keys = [10, 11] if depth == 0.0 else [36, 37]
        run = _run("sliding_window @ 16", keys, correct=depth == 1.0, left=left)
        needle.write_trial(run["cache_key"], {"tokens": [1], "text": run["text"], "prefill_seconds": 1.0,
                                              "decode_seconds": 0.1, "positions": 47, "left": left})
        cells.append({"length": 40, "depth": depth, "trial": 0, "key": "12345", "key_positions": keys,
                      "needle_start": keys[0] - 1, "prompt_tokens": 40,
                      "control": _run("full", keys, correct=True), "runs": [run]})
    cells[1]["control"] = _run("full", keys, correct=False)  # the control misses at depth 1: that cell is not counted
    jobs = [needle.Job("sliding_window", 16)]
    doc = {"model": "tiny", "model_id": "tiny", "context": 512, "lengths": [40], "depths": [0.0, 1.0], "trials": 1,
           "seed": 0, "new_tokens": 8, "template": needle_prompt.Template().to_dict(), "run": {"executor": "serial", "seconds": 3},
           **needle.accuracy(cells, jobs, [40], [0.0, 1.0]), "cells": cells}
    assert needle.save_grid(doc) is not None
    return doc


def test_the_needle_view_draws_each_grid_beside_the_control_and_opens_a_trial(saved):
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["view"] = "Pass key"
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    grid = json.loads(at.get("plotly_chart")[0].proto.spec)
    heat = [t for t in grid["data"] if t["type"] == "heatmap" and t.get("name")]
    assert [t["name"] for t in heat] == ["full cache (control)", "sliding_window @ 16"]
    assert heat[0]["text"] == [["100%"], ["0%"]] and heat[1]["text"] == [["0%"], ["control fails"]]
    titles = [a["text"] for a in grid["layout"]["annotations"]]
    assert titles[:2] == ["full cache (control)", "sliding_window @ 16"]
    at.selectbox(key="needle_depth").set_value(0.0).run()
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    (trial,) = [s for s in specs if any(t.get("name") == "key token left" for t in s["data"])]
    (gone,) = [t for t in trial["data"] if t.get("name") == "key token left"]
    assert list(gone["x"]) == [10, 11] and list(gone["y"]) == [26, 27]  # each key token left 16 steps after it came
    assert trial["layout"]["title"]["text"] == "sliding_window @ 16, layer 0"
    shapes = [s for s in trial["layout"]["shapes"] if s["type"] == "rect"]
    assert [s["x0"] for s in shapes] == [9.5, 10.5]  # the key's columns marked
    (table,) = [d.value for d in at.dataframe if "key lost at step" in d.value.columns]  # not the conversation's
    assert table["key lost at step"].tolist() == ["27"]


def test_without_a_grid_the_view_says_which_command_makes_one(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["view"] = "Pass key"
    at.run()
    assert [e.value for e in at.exception] == []
    assert any("python -m kvsim needle" in i.value for i in at.info)

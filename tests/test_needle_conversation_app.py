"""Issue 57, item 4: the Pass key view draws a conversation turn by turn on a fresh install, from the shipped
measurement (traces/needle-conversation.json, measured on Gemma-3-270M by the commands inside it): per turn the
key it asked for and whether the full cache and the policy found it, per key the step it left each layer's cache
beside the optimum's; a conversation grid of one's own joins it; a file the view cannot draw is one warning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from kvsim.models import conversation_grid as grid

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def _open(tmp_path, monkeypatch) -> AppTest:
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))  # a fresh install: no grid of one's own
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params["view"] = "Pass key"
    at.run()
    assert [e.value for e in at.exception] == []
    return at


def _fates(at: AppTest) -> dict:
    """The figure of every key's fate (its titles say which turn asked for each key)."""
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    (spec,) = [s for s in specs if any("asked at turn" in a.get("text", "") for a in s["layout"].get("annotations", []))]
    return spec


def test_the_shipped_file_is_small_and_says_its_commands():
    path = grid.SHIPPED
    assert path.stat().st_size < 1_000_000
    measured = grid.shipped()
    assert [m["command"] for m in measured] == list(grid.COMMANDS)
    for m in measured:
        for cell in m["cells"]:
            for run in cell["runs"]:  # every key's fate per layer, the policy's and the optimum's
                assert len(run["key_left"]) == m["keys"] == len(run["optimal_key_left"])
                assert len(run["key_left"][0]) == 18  # Gemma-3-270M's layers


def test_a_fresh_install_draws_the_shipped_conversation_turn_by_turn(tmp_path, monkeypatch):
    at = _open(tmp_path, monkeypatch)
    doc = grid.shipped()[0]
    cell_i = at.selectbox(key="needle_conv_trial").value
    cell = doc["cells"][cell_i]
    run = cell["runs"][0]
    assert at.selectbox(key="needle_conv_policy").value == run["label"]
    assert at.selectbox(key="needle_conv_policy").options == [r["label"] for r in cell["runs"]]
    turns = next(d.value for d in at.dataframe if "asks for" in d.value.columns)
    assert turns["asks for"].tolist() == [f"key {i + 1} ({k})" for i, k in enumerate(cell["keys"])]
    assert turns["full cache found it"].tolist() == cell["control"]["found"]
    assert turns[f"{run['label']} found it"].tolist() == run["found"]  # h2o @ 256: no comma to shorten at
    assert turns[f"{run['label']} wrote"].tolist() == [t.strip() for t in run["texts"]]
    fig = _fates(at)
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert titles == [f"key {i + 1} ({k}), asked at turn {i + 1}" for i, k in enumerate(cell["keys"])]
    heat = [t for t in fig["data"] if t["type"] == "heatmap"]
    assert len(heat) == doc["keys"]
    for i, t in enumerate(heat):  # per layer: the policy's step (or held), then the optimum's
        assert list(t["x"]) == [run["label"], "optimum"]
        want = [["held" if s is None else str(s) for s in mine + best]
                for mine, best in zip(run["key_left"][i], run["optimal_key_left"][i], strict=True)]
        assert t["text"] == want
    assert any("optimum at the same budgets" in m.value for m in at.markdown)
    assert any(doc["command"] in c.value for c in at.caption)
    # another policy of the selector: its own turns and fates
    other = cell["runs"][-1]
    at.selectbox(key="needle_conv_policy").set_value(other["label"]).run()
    turns = next(d.value for d in at.dataframe if "asks for" in d.value.columns)
    assert turns[f"{other['label'].split(',')[0]} found it"].tolist() == other["found"]
    heat = [t for t in _fates(at)["data"] if t["type"] == "heatmap"]
    assert heat[1]["text"][0][0] == ("held" if other["key_left"][1][0][0] is None else str(other["key_left"][1][0][0]))


def test_a_conversation_grid_of_ones_own_joins_and_a_bad_one_is_one_warning(tmp_path, monkeypatch):
    folder = tmp_path / "needle"
    folder.mkdir()
    mine = dict(grid.shipped()[0], command=None, measured=None, model="tiny")
    (folder / "conversation-0001.json").write_text(json.dumps(mine))
    (folder / "conversation-0002.json").write_text("{not json")
    at = _open(tmp_path, monkeypatch)
    assert [w.value for w in at.warning] == [
        "conversation-0002.json: not a pass-key conversation (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))"]
    names = at.selectbox(key="needle_conv_doc").options
    assert any("(shipped)" in n for n in names) and any(n.startswith("tiny") and "yours" in n for n in names)


@pytest.mark.parametrize("text, why", [
    ("{not json", "Expecting property name"),
    ('{"measurements": []}', "no measurements"),
    ('{"measurements": [{"model": "x", "keys": 2, "cells": [{"runs": [], "control": {}}]}]}',
     "measurement 1: not a pass-key conversation (cell 1: not 2 keys with their positions)"),
])
def test_a_malformed_shipped_file_is_one_warning_line(tmp_path, monkeypatch, text, why):
    bad = tmp_path / grid.SHIPPED_NAME
    bad.write_text(text)
    monkeypatch.setattr(grid, "SHIPPED", bad)
    at = _open(tmp_path, monkeypatch)
    (warning,) = [w.value for w in at.warning]
    assert warning.startswith(grid.SHIPPED_NAME) and why in warning and "\n" not in warning
    assert any("No conversation here" in i.value for i in at.info)


def test_what_docs_needle_says_of_the_shipped_trial_1_is_in_the_file():
    """docs/needle.md, "A conversation in the app": h2o in trial 1 (the full cache found both keys, as in every
    trial), and what snapkv's compressed prompts wrote."""
    aware, agnostic = (doc["cells"] for doc in grid.shipped()[1:])
    cell = grid.shipped()[0]["cells"][0]
    h2o = cell["runs"][0]
    assert cell["keys"] == ["31037", "61814"] and h2o["label"] == "h2o @ 256"
    assert all(c["control"]["found"] == [True, True] for c in grid.shipped()[0]["cells"])
    assert h2o["texts"] == [" a key that can be used to unlock"] * 2 and h2o["found"] == [False, False]
    gone = [heads[0] for heads in h2o["key_left"][1]]
    assert sum(s == 744 for s in gone) == 12 and 744 < h2o["turn_starts"][0]
    assert sum(h[0] is None for h in h2o["optimal_key_left"][1]) == 17
    assert sum(h[0] is None for h in h2o["key_left"][0]) == 9
    assert sum(h[0] is None for h in h2o["optimal_key_left"][0]) == 3
    assert aware[0]["runs"][0]["answers"] == ["3103", "6103"] and aware[2]["runs"][0]["answers"] == ["37340", "21089"]
    assert aware[2]["runs"][0]["found"] == [False, True]
    assert all(c["runs"][0]["texts"] == [" a key that is used to unlock the"] * 2 for c in agnostic)
    text = (Path(__file__).resolve().parent.parent / "docs" / "needle.md").read_text(encoding="utf-8")
    assert "in 12 of 18 layers" in " ".join(text.split()) and "screenshot-conversation.png" in text


def test_the_compressed_prompts_are_drawn_and_their_mass_said_with_its_caveat(tmp_path, monkeypatch):
    at = _open(tmp_path, monkeypatch)
    for i, mode in ((1, "query-aware"), (2, "query-agnostic")):
        at.selectbox(key="needle_conv_doc").set_value(i).run()
        assert [e.value for e in at.exception] == [] and [w.value for w in at.warning] == []
        assert at.selectbox(key="needle_conv_policy").value.endswith(mode)
        assert any("only the second pair compares" in m.value for m in at.markdown)
        assert any("This prompt was compressed in one call" in c.value for c in at.caption)
        assert len([t for t in _fates(at)["data"] if t["type"] == "heatmap"]) == 2

"""Issue 44, item 2: the pass-key leaderboard docs/needle.md measured, shipped as traces/needle-leaderboard.json
and drawn in the Pass key tab on a fresh install; a user's own grids join it. The file is a transcription:
every row it holds is printed, as the page prints it, in the page's section it names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_needle_app import saved, saved_grid  # noqa: F401 (a fixture)

from kvsim.views import leaderboard as lb

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
DOC = (ROOT / "docs" / "needle.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = DOC.index(f"### {title}\n")
    end = min([i for i in (DOC.find("\n### ", start + 4), DOC.find("\n## ", start + 4)) if i > 0] or [len(DOC)])
    return DOC[start:end]


def flat(text: str) -> str:
    return " ".join(text.replace("`", " ").split())


@pytest.mark.parametrize("table", lb.shipped_tables(), ids=lambda t: t["title"])
def test_every_shipped_row_is_the_pages(table):
    text = section(table["section"])
    rows = lb.markdown_rows(table)
    for line in rows[1:]:
        assert line in text, line
    if "| full cache (control) |" in text:
        assert rows[0] in text
    else:  # the page says it in words
        assert table["control_said"] in text and set(rows[0].split(" | ")[1:]) <= {"found / found / found", "found / found / found |"}
    header = "| policy | " + " | ".join(
        f"{c['length']} tokens" if len({x["length"] for x in table["columns"]}) > 1 else f"budget {c['budget']}"
        for c in table["columns"]) + " |"
    assert header in text
    for part in table["command"].split("; then "):
        assert flat(part) in flat(text), part
    assert table["date"] in text or table.get("date_note")
    assert f"--trials {table['trials']}" in flat(text) and table["depths"] == [0.1, 0.5, 0.9]
    assert len(rows) - 1 == len([x for x in text.splitlines() if x.startswith("| ") and " / " in x
                                  and not x.startswith("| full cache")])  # no row of the page left out


def test_the_shipped_file_is_one_line_of_error_when_damaged(tmp_path, monkeypatch):
    from kvsim.data import catalog

    monkeypatch.setattr(catalog, "TRACES_DIR", tmp_path)
    assert lb.shipped_tables() == []  # a plain install: no file, no table
    (tmp_path / lb.LEADERBOARD_NAME).write_text("{not json")
    with pytest.raises(lb.LeaderboardError, match=r"^needle-leaderboard.json: not a leaderboard \("):
        lb.shipped_tables()


def test_a_saved_grid_joins_as_a_table():
    doc = {"model": "tiny", "lengths": [40], "depths": [0.0, 1.0], "trials": 1,
           "control": {"accuracy": [[1.0], [0.0]]},
           "grids": [{"label": "sliding_window @ 16", "budget": 16, "accuracy": [[0.0], [0.0]], "counted": [[True], [False]]},
                     {"label": "h2o @ 16, split pyramidkv", "budget": 16, "accuracy": [[1.0], [0.0]],
                      "counted": [[True], [False]]}]}
    table = lb.from_grid(doc, "grid-x.json", "3 Dec 2026 10:00 UTC")
    assert lb.markdown_rows(table) == ["| full cache (control) | found / - |", "| sliding_window | - / n/a |",
                                       "| h2o, split pyramidkv | found / n/a |"]
    assert lb.label(table) == "tiny; 40 tokens; budget 16; depths 0 / 1; 1 trial a cell; 3 Dec 2026 10:00 UTC"


def board(at) -> dict:
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    (spec,) = [s for s in specs if any(t.get("name", "").startswith(("budget", "1024 tokens", "40 tokens"))
                                       for t in s["data"])]
    return spec


def test_a_fresh_install_draws_the_measured_leaderboard(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))  # no grid of the user's
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["view"] = "Pass key"
    at.run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    said = " ".join(m.value for m in at.markdown)
    assert ("**Gemma-3-270M (google/gemma-3-270m, 4-bit GGUF Q4_K_M); 512 tokens; budget 64, 256; depths 0.1 / 0.5 / 0.9; "
            "1 trial a cell; 2 Dec 2026**") in said
    spec = board(at)
    heat = [t for t in spec["data"] if t["type"] == "heatmap" and t.get("name")]
    assert [t["name"] for t in heat] == ["budget 64", "budget 256"]
    names = list(heat[1]["y"])
    assert names == ["full cache (control)", *lb.shipped_tables()[0]["rows"]]  # the page's order, not sorted
    assert names[1:4] == ["sliding_window", "streaming_llm", "h2o"]
    assert heat[1]["text"][names.index("vatp")] == ["found", "found", "found"]
    assert heat[1]["text"][names.index("h2o")] == ["found", "found", "-"]
    assert heat[0]["text"][names.index("h2o")] == ["-", "-", "-"]
    assert any("python -m kvsim needle" in i.value and "joins the leaderboard" in i.value and "pip install -e '.[record]'" in i.value
               for i in at.info)
    titles = [t["title"] for t in lb.shipped_tables()]
    at.selectbox(key="needle_board").set_value(titles.index("Gemma-3-270M at 1,024 to 4,096 tokens, budget 256")).run()
    heat = [t for t in board(at)["data"] if t["type"] == "heatmap" and t.get("name")]
    assert [t["name"] for t in heat] == ["1024 tokens", "2048 tokens", "4096 tokens"]
    names = list(heat[2]["y"])
    assert heat[2]["text"][names.index("critical")] == ["found", "-", "-"]
    assert heat[2]["text"][names.index("snapkv")] == ["not run"] * 3


def test_a_users_grid_joins_the_leaderboard(saved):  # noqa: F811
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["view"] = "Pass key"
    at.run()
    assert [e.value for e in at.exception] == []
    options = at.selectbox(key="needle_board").options
    assert len(options) == len(lb.shipped_tables()) + 1
    assert re.fullmatch(r"tiny: 40 tokens, budget 16 \(yours\)", options[-1])
    at.selectbox(key="needle_board").set_value(len(options) - 1).run()
    heat = [t for t in board(at)["data"] if t["type"] == "heatmap" and t.get("name")]
    assert heat[0]["text"] == [["found", "-"], ["-", "n/a"]]  # the control, then the policy: not counted where the control missed

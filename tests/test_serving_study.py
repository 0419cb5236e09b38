"""docs/serving.md's study: its tables are reprinted from the shipped JSON (docs/serving-study.json) by
``kvsim.analysis.serving_study.markdown`` (``python kvsim/bench/scripts/serving_study.py tables``), and the rule the page
draws from its "all three" column holds in the simulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvsim
from kvsim.analysis.serving_study import markdown
from kvsim.policykit.layouts import Layout

ROOT = Path(__file__).resolve().parents[1]


def _row(policy, layout, kl, *, budget=64, text="a", why=None, mode="open"):
    r = {"model": "gemma3-270m", "text": text, "budget": budget, "policy": policy, "layout": layout, "mode": mode,
         "why": why}
    if why is None:
        r.update({"kl": kl, "delta_nll": kl / 2, "retained_mass": 1 - kl})
    return r


def test_the_tables_give_each_layout_its_cost_against_the_free_policy():
    rows = [_row("h2o", "none", 0.25, text="a"), _row("h2o", "none", 0.75, text="b"),
            _row("h2o", "blocks of 16", 0.5, text="a"), _row("h2o", "blocks of 16", 1.0, text="b"),
            _row("h2o", "shared", None, why="no-op: one KV head"),
            _row("h2o", "every 32", None, why="refused: every 32 leaves too few")]
    plan = {"texts": ["a", "b"], "budgets": [64], "passkey": {"depths": {}}}
    text = markdown({"plan": plan, "rows": rows})
    # the mean over the texts (0.5 and 0.75), the change in brackets, the reasons in one word
    assert "| h2o | 0.500 | 0.750 (+0.250) | no-op | refused |" in text
    assert "| h2o | 0.250 | 0.375 | no-op | refused |" in text  # delta NLL, one budget
    assert "mean over 2 texts" in text


def test_the_pass_key_table_says_found_per_depth():
    rows = [{"model": "smollm2-135m", "budget": 256, "length": 1024, "policy": p, "layout": "none", "mode": "passkey",
             "why": None, "found": found, "control": [1.0, 1.0]} for p, found in (("h2o", [1.0, 0.0]),
                                                                                  ("tova", [0.0, 0.0]))]
    plan = {"texts": [], "budgets": [256], "passkey": {"depths": {"smollm2-135m": [0.25, 0.75]}}}
    text = markdown({"plan": plan, "rows": rows})
    assert "found at depth 0.25 / 0.75 (the full cache: found / found)" in text
    assert "| h2o | found / - |" in text and "| tova | - / - |" in text


def test_docs_serving_prints_the_shipped_study():
    """The page's tables are what ``python kvsim/bench/scripts/serving_study.py tables docs/serving-study.json`` prints, run as
    the page prints it, from the checkout."""
    doc = json.loads((ROOT / "docs" / "serving-study.json").read_text())
    page = (ROOT / "docs" / "serving.md").read_text()
    assert "python kvsim/bench/scripts/serving_study.py tables docs/serving-study.json" in page
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "kvsim/bench/scripts/serving_study.py", "tables", "docs/serving-study.json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tables = markdown(doc)
    assert done.stdout.rstrip("\n") + "\n" == tables and tables in page
    # the grid the page says it measured: every policy under every layout, and the optimum free and in pages
    plan = doc["plan"]
    assert plan["models"] == ["gemma3-270m", "smollm2-135m"] and plan["budgets"] == [64, 256]
    assert len(plan["texts"]) == 3 and plan["steps"] == 512
    opened = [r for r in doc["rows"] if r["mode"] == "open"]
    cells = {(r["model"], r["text"], r["budget"], r["policy"], r["layout"]) for r in opened}
    assert len(cells) == len(opened) == 2 * 3 * 2 * (len(plan["policies"]) * len(plan["layouts"]) + 2)
    # measured, except shared selection on Gemma's one KV head, said as a no-op
    assert {r["why"] for r in opened} == {None, "no-op: one KV head"}
    assert all((r["why"] is None) == ("kl" in r) for r in opened)
    assert {r["model"] for r in opened if r["why"]} == {"gemma3-270m"}


@pytest.mark.parametrize("policy", ["h2o", "tova", "streaming_llm"])
def test_an_interval_that_divides_the_block_decides_nothing_blocks_do_not(policy):
    """Why docs/serving.md's "all three" (pages of 16, decided every 8 steps) equals pages alone: a block
    opens every 16 steps, at a multiple of 8, so every eviction the pages need falls on a decision; an
    interval of 32 is another schedule."""
    full = kvsim.resolve_trace("gemma3-270m-L05")
    trace = kvsim.from_array(np.ascontiguousarray(full.attention[:513, :513]))

    def kept(layout):
        return kvsim.replay(trace, policy, budget=128, layout=layout, record_kept=True).kept_mask()

    pages = kept(Layout(16))
    for k in (2, 8, 16):
        assert np.array_equal(kept(Layout(16, False, k)), pages), k
    assert not np.array_equal(kept(Layout(16, False, 32)), pages)

"""docs/needle.md's command runs as printed (tests/doc_chains.py) and prints the grids the page quotes:
the control's, then one per policy. It decodes Gemma-3-270M (6 runs at two depths, two thirds of the 9-run
grid that took 76 s on a quiet machine; every trial is cached, so a second run reads them back), hence the
record mark."""

from __future__ import annotations

import importlib.util

import pytest
from doc_chains import ROOT, chains, run

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


def test_the_page_prints_one_needle_chain():
    (chain,) = chains("docs/needle.md")
    assert len(chain) == 1 and chain[0].startswith("python -m kvsim needle ")


@pytest.mark.record
@pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")
def test_the_pages_grid_command_runs_as_printed(tmp_path):
    (chain,) = chains("docs/needle.md")
    done = run(chain, tmp_path, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.index("full cache (control):") < out.index("streaming_llm @ 64") < out.index("h2o @ 64")
    assert "  depth     512\n" in out
    page = (ROOT / "docs" / "needle.md").read_text(encoding="utf-8")
    quoted = page[page.index("```text\n", page.index(chain[0])) + 8:]
    assert quoted[: quoted.index("```")] in out  # the grids the page quotes are the ones it prints

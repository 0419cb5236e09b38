"""docs/allocation.md's command chains run as printed (tests/doc_chains.py): the optimum's split saved as
JSON and replayed from the file gives the same mass, above uniform's at the same memory; the split searched
by the truth (``quality --allocate optimal --by kl``, tiny steps) is no worse by KL than the best static
split, replays and deploys from its file; ``tune --allocate auto``'s file deploys its window and its split."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
from doc_chains import chains, run

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")


def _chain(marker: str) -> list[str]:
    (found,) = [c for c in chains("docs/allocation.md") if any(marker in line for line in c)]
    return found


def test_the_docs_print_the_three_allocation_chains():
    assert len([c for c in chains("docs/allocation.md") if any("--allocate" in line for line in c)]) == 3
    searched, auto = _chain("--by kl"), _chain("--allocate auto")
    assert "> searched.json" in searched[0] and "--allocate searched.json" in searched[1]
    assert "--allocate searched.json" in searched[2] and " generate " in searched[2]
    assert "> tune.json" in auto[0] and "--windows tune.json --allocate tune.json" in auto[1]


def test_the_allocation_chain_runs_as_printed(tmp_path):
    done = run(_chain("> optimal.json"), tmp_path)
    assert done.returncode == 0, done.stderr
    saved = json.loads((tmp_path / "optimal.json").read_text())
    assert saved["allocate"] == "optimal" and saved["positions"] == 64 * 18
    means = [float(m) for m in re.findall(r"bundle mean retained mass (\d\.\d+)", done.stdout)]
    uniform, again = means
    assert again == round(saved["retained_mass"], 4) and again > uniform


@needs_torch
@pytest.mark.record
def test_the_split_searched_by_the_truth_runs_as_printed_replays_and_deploys(tmp_path):
    done = run(_chain("--by kl"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "searched.json").read_text())
    assert got["by"] == "kl" and got["kl"] <= min(c["kl"] for c in got["candidates"])
    assert got["search"]["tried"] <= 2 and sum(r["budget"] for r in got["allocation"]) == 40 * 18
    replayed = re.search(r"bundle mean retained mass (\d\.\d+)", done.stdout)
    assert replayed is not None and "budget 40 x 18 heads" in done.stdout
    out = json.loads((tmp_path / "out.json").read_text())
    assert [r["budget"] for r in out["allocation"]] == [r["budget"] for r in got["allocation"]]


@needs_torch
@pytest.mark.record
def test_tune_allocate_auto_runs_as_printed_and_deploys_its_window_and_split(tmp_path):
    done = run(_chain("--allocate auto"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    tuned = json.loads((tmp_path / "tune.json").read_text())
    a = tuned["allocate"]
    assert a["chosen"] == max(a["candidates"], key=lambda c: c["figure"])["allocator"]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["recent_window_per_layer"] == [tuned["model_window"]] * 18
    assert [r["budget"] for r in out["allocation"]] == [r["budget"] for r in tuned["allocation"]]
    assert all(r["peak_positions"] <= r["budget"] for r in out["allocation"])

"""docs/allocation.md's command chain runs as printed (tests/doc_chains.py): the optimum's split saved as
JSON and replayed from the file gives the same mass, above uniform's at the same memory."""

from __future__ import annotations

import json
import re

from doc_chains import chains, run


def test_the_allocation_chain_runs_as_printed(tmp_path):
    found = [c for c in chains("docs/allocation.md") if any("--allocate" in line for line in c)]
    assert len(found) == 1
    done = run(found[0], tmp_path)
    assert done.returncode == 0, done.stderr
    saved = json.loads((tmp_path / "optimal.json").read_text())
    assert saved["allocate"] == "optimal" and saved["positions"] == 64 * 18
    means = [float(m) for m in re.findall(r"bundle mean retained mass (\d\.\d+)", done.stdout)]
    uniform, again = means
    assert again == round(saved["retained_mass"], 4) and again > uniform

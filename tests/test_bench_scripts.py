"""Every script in kvsim/bench/scripts/ answers ``--help`` with its usage and exit status 0, without running its work:
a reader finds out what a script measures, and what it needs, before it loads a model or a browser
(one of them once wrote its figures into a file named ``--help``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "kvsim" / "bench" / "scripts").glob("*.py") if p.name != "__init__.py")


def test_every_bench_script_answers_help_and_writes_nothing(tmp_path):
    assert len(SCRIPTS) >= 10
    # all at once: each is an interpreter start and a few imports, so the machine's cores share them
    runs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=tmp_path, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True) for p in SCRIPTS}
    failed = []
    for name, run in runs.items():
        out, err = run.communicate(timeout=300)
        if run.returncode != 0 or "usage" not in out.lower():
            failed.append(f"{name}: exit {run.returncode}: {(err or out)[-300:]}")
    assert not failed, "\n".join(failed)
    assert list(tmp_path.iterdir()) == []  # --help wrote nothing where it ran

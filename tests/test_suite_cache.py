"""The suite keeps its own cache directory (conftest.py's ``SUITE_CACHE``): a run of it, and every process
its tests start, writes nothing into the user's ($KVSIM_CACHE_DIR, else $XDG_CACHE_HOME/kvsim, else
~/.cache/kvsim)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import SUITE_CACHE

ROOT = Path(__file__).resolve().parent.parent
#: tests that write cache entries: one in this process (a trace file named alpha, decoded once), one in a
#: CLI process it starts (the file trace it replays)
WRITERS = ["tests/test_analysis_metrics.py::test_resolve_shipped_stems_and_paths", "tests/test_cli_documents.py::test_replay_json"]


def test_a_suite_run_leaves_the_users_cache_directory_untouched(tmp_path):
    user_cache, home, xdg = tmp_path / "user-cache", tmp_path / "home", tmp_path / "xdg"
    home.mkdir()
    before = {p.name for p in SUITE_CACHE.glob("file-alpha-*")} if SUITE_CACHE.is_dir() else set()
    env = {**os.environ, "KVSIM_CACHE_DIR": str(user_cache), "HOME": str(home), "XDG_CACHE_HOME": str(xdg)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *WRITERS], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
    for where in (user_cache, home / ".cache", xdg):
        assert not where.exists(), sorted(str(p) for p in where.rglob("*"))
    # the entries went to the suite's own directory instead (a fresh key per run: the file's mtime is in it)
    assert {p.name for p in SUITE_CACHE.glob("file-alpha-*")} - before

"""The order pytest-xdist's workers hand the test groups out in (conftest.py's ``_slowest_groups_first``):
the slowest files first, then the rest as xdist orders them itself (most tests first), each group whole."""

from __future__ import annotations

from pathlib import Path

from conftest import SLOWEST_FILES, _slowest_groups_first


class Item:  # a collected test as the ordering sees it: hashed by identity, as pytest's items are
    def __init__(self, name: str):
        self.name = name


def test_every_slowest_file_is_a_test_file_here():
    here = Path(__file__).resolve().parent
    assert len(set(SLOWEST_FILES)) == len(SLOWEST_FILES)
    assert [name for name in SLOWEST_FILES if not (here / name).is_file()] == []


def test_the_slowest_files_go_first_then_the_most_tests_each_group_keeping_its_order():
    slow, slower = SLOWEST_FILES[1], SLOWEST_FILES[0]
    names = [("test_a.py", 1), (slow, 1), ("browser", 1), ("test_b.py", 1), ("test_a.py", 2), ("browser", 2),
             (slower, 1), ("test_b.py", 2), ("test_c.py", 1), ("test_b.py", 3)]
    items = [Item(f"{g}::{i}") for g, i in names]
    ordered = _slowest_groups_first(items, {item: g for item, (g, _) in zip(items, names, strict=True)})
    assert [item.name for item in ordered] == [
        f"{slower}::1", f"{slow}::1",  # the listed files, slowest first
        "test_b.py::1", "test_b.py::2", "test_b.py::3",  # then by number of tests
        "test_a.py::1", "test_a.py::2", "browser::1", "browser::2",  # a tie: the first collected first
        "test_c.py::1"]


def test_each_file_runs_whole_in_one_worker_under_the_readmes_options():
    """Two files on two workers (``-n 2 --dist loadgroup``, as ``-n auto`` on this machine): each file's tests
    carry its group in their ids and run in one worker."""
    import re
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    quick = ["tests/test_tolerance.py", "tests/test_needle_docs.py::test_the_page_prints_one_needle_chain"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                           "-v", *quick], cwd=here.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    ran = re.findall(r"^\[(gw\d)\] \[\s*\d+%\] PASSED (tests/(test_\w+\.py)::\S+@(\S+))", done.stdout, re.M)
    assert len(ran) == 3 and all(file == group for _, _, file, group in ran), done.stdout
    workers = {}
    for worker, _, file, _ in ran:
        workers.setdefault(file, set()).add(worker)
    assert all(len(w) == 1 for w in workers.values()) and len(workers) == 2, workers

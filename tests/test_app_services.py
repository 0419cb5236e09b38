"""kvsim.app.services: the work the app's sessions share, tested with threads and no Streamlit."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvsim.app.services import Background, BoundedStore, Shared, Status, SweepStore, starting_after


def test_the_app_package_and_its_services_import_without_streamlit():
    code = ("import sys; sys.modules['streamlit'] = None; import kvsim.app, kvsim.app.services; "
            "assert 'streamlit' not in [m for m in sys.modules if sys.modules[m] is not None]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_the_bounded_store_drops_the_oldest_first_and_keeps_its_bound():
    store = BoundedStore(3)
    for k in "abcd":
        store.put(k, k.upper())
    assert store.keys() == ["b", "c", "d"] and len(store) == 3 and "a" not in store
    store.put("b", "B2")  # put again: now the newest
    store.put("e", "E")
    assert store.keys() == ["d", "b", "e"] and store.get("b") == "B2"
    assert store.setdefault("d", lambda: "never") == "D"
    assert store.setdefault("f", lambda: "F") == "F" and store.keys() == ["b", "e", "f"]
    assert store.pop("e") == "E" and store.pop("e", "gone") == "gone"
    with pytest.raises(ValueError, match="at least one entry"):
        BoundedStore(0)


def test_shared_work_is_done_once_when_two_threads_ask_at_once():
    shared = Shared(bound=4)
    calls, waited = [], []
    started = threading.Event()

    def compute():
        calls.append(threading.current_thread().name)
        started.set()
        time.sleep(0.2)
        return "rows"

    @contextmanager
    def waiting():
        waited.append(threading.current_thread().name)
        yield

    out = {}
    first = threading.Thread(target=lambda: out.setdefault("first", shared.get("k", compute, waiting)), name="first")
    first.start()
    started.wait(5)
    second = threading.Thread(target=lambda: out.setdefault("second", shared.get("k", compute, waiting)), name="second")
    second.start()
    first.join(5)
    second.join(5)
    assert out == {"first": "rows", "second": "rows"}
    assert calls == ["first"] and waited == ["second"]  # the second waited for the first's result


def test_shared_releases_its_lock_when_the_work_fails():
    shared = Shared(bound=2)

    def fail():
        raise RuntimeError("a rerun ended the run")

    with pytest.raises(RuntimeError):
        shared.get("k", fail)
    assert shared.get("k", lambda: 7) == 7  # not left locked, nothing stored by the failure


def rows(*windows: int) -> list[dict]:
    return [{"recent_window": w, "retained_mass": w / 100} for w in windows]


def test_the_sweep_store_sweeps_once_and_adds_only_the_missing_marks():
    store = SweepStore(bound=4)
    full_calls, added = [], []

    def full():
        full_calls.append(1)
        time.sleep(0.1)
        return rows(1, 9, 17)

    def add(missing):
        added.append(missing)
        return rows(*missing)

    results = []
    threads = [threading.Thread(target=lambda: results.append(store.curve("k", full, marks=[9], add=add)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len(full_calls) == 1 and added == []
    assert all(c.exact and [r["recent_window"] for r in c.rows] == [1, 9, 17] for c in results)
    curve = store.curve("k", full, marks=[5, 9], add=add)
    assert added == [[5]] and [r["recent_window"] for r in curve.rows] == [1, 5, 9, 17] and len(full_calls) == 1


def test_a_coarse_curve_is_drawn_first_and_refined_in_the_background():
    store = SweepStore(bound=4)
    release = threading.Event()

    def full():
        release.wait(5)
        return rows(1, 8, 9, 10, 17)

    first = store.curve("k", full, coarse=lambda: rows(1, 17))
    assert not first.exact and [r["recent_window"] for r in first.rows] == [1, 17]
    assert not store.exact("k")
    release.set()
    deadline = time.monotonic() + 5
    while not store.exact("k") and time.monotonic() < deadline:
        time.sleep(0.01)
    later = store.curve("k", full, coarse=lambda: pytest.fail("the coarse grid is not swept again"))
    assert later.exact and [r["recent_window"] for r in later.rows] == [1, 8, 9, 10, 17]


def test_once_refined_the_next_ask_fills_in_every_value_behind_the_jobs_asked_for_meanwhile():
    pool = Background(workers=1)
    store = SweepStore(bound=4, background=pool)
    order: list[str] = []

    def add(values):
        order.append(f"add {len(values)}")
        return rows(*values)

    def wait_idle():
        deadline = time.monotonic() + 5
        while store.busy("k") and time.monotonic() < deadline:
            time.sleep(0.01)

    release = threading.Event()

    def full():
        release.wait(5)
        return rows(1, 8, 9, 10, 17)

    ask = dict(full=full, coarse=lambda: rows(1, 17), add=add, every=range(1, 18))
    first = store.curve("k", **ask)
    assert not first.exact and not first.complete
    pool.submit(lambda: order.append("another job"))  # asked for while the refinement runs
    release.set()
    wait_idle()
    refined = store.curve("k", **ask)  # refined: this ask starts the fill, behind that job
    assert refined.exact and not refined.complete and [r["recent_window"] for r in refined.rows] == [1, 8, 9, 10, 17]
    pool.submit(lambda: None).result(5)
    wait_idle()
    done = store.curve("k", **ask)
    assert done.complete and [r["recent_window"] for r in done.rows] == list(range(1, 18))
    assert order == ["another job", "add 12"]  # the 12 windows missing, once, after the job asked for first
    assert store.curve("k", full=ask["full"], coarse=ask["coarse"], add=add).complete  # nothing more asked: complete


def test_what_an_earlier_server_kept_is_read_in_the_run_not_refined_in_the_background():
    """A fresh server drew a kept curve coarse, then ran the page again as each refinement, read from the
    disk in a moment, ended: what ``kept`` finds is the curve at once, exact and complete, nothing in the
    background; what it lacks is refined there as before."""
    store = SweepStore(bound=4)
    asked = []

    def kept(values):
        asked.append(values)
        return rows(1, 8, 9, 10, 17) if values is None else rows(*values)

    curve = store.curve("k", lambda: pytest.fail("not swept: kept"), coarse=lambda: pytest.fail("no coarse grid"),
                        add=lambda values: pytest.fail("not added: kept"), every=range(1, 18), kept=kept)
    assert curve.exact and curve.complete and [r["recent_window"] for r in curve.rows] == list(range(1, 18))
    assert not store.busy("k") and asked == [None, [v for v in range(1, 18) if v not in (1, 8, 9, 10, 17)]]

    lacking = store.curve("j", lambda: rows(1, 8, 9, 17), coarse=lambda: rows(1, 17), kept=lambda values: None)
    assert not lacking.exact and [r["recent_window"] for r in lacking.rows] == [1, 17]
    deadline = time.monotonic() + 5
    while not store.exact("j") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.exact("j")


def test_a_failed_refinement_is_tried_again_on_the_next_ask():
    store = SweepStore(bound=2)
    attempts = []

    def full():
        attempts.append(1)
        if len(attempts) == 1:
            raise MemoryError("no room")
        return rows(1, 2, 3)

    first = store.curve("k", full, coarse=lambda: rows(1, 3))
    assert not first.exact
    deadline = time.monotonic() + 5
    while not store.exact("k") and time.monotonic() < deadline:  # each ask after the failure starts it again
        store.curve("k", full, coarse=lambda: rows(1, 3))
        time.sleep(0.01)
    assert store.exact("k") and len(attempts) == 2


def test_background_work_asked_for_in_a_run_starts_once_the_run_ends():
    """A page's run draws what it has before its background work takes the cores: a job asked for
    inside ``starting_after()`` waits for the block's end, one asked for outside it does not (a held
    job keeps its worker meanwhile: three here, so the third job has one)."""
    pool = Background(workers=3)
    started: list[str] = []
    with starting_after():
        held = pool.submit(lambda: started.append("held"))
        polled = pool.poll("k", lambda progress: started.append("polled"))
        free = threading.Thread(target=lambda: pool.submit(lambda: started.append("free")).result(5))
        free.start()  # another thread (another session's run, not in this block): not held
        free.join(5)
        time.sleep(0.2)
        assert started == ["free"] and not held.done() and not polled.done
    held.result(5)
    deadline = time.monotonic() + 5
    while not pool.poll("k", lambda progress: None).done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(started) == ["free", "held", "polled"]


def test_a_runs_background_work_waits_a_moment_after_the_run_once_for_all_its_jobs(monkeypatch):
    """After the block, its jobs wait ``SETTLE_S`` more (the page is sent and drawn meanwhile), measured
    from the block's end: the second job in the queue does not wait it again."""
    from kvsim.app import services

    monkeypatch.setattr(services, "SETTLE_S", 0.3)
    pool = Background(workers=1)
    with starting_after():
        jobs = [pool.submit(time.monotonic) for _ in range(2)]
    ended = time.monotonic()
    first, second = (j.result(5) for j in jobs)
    assert first - ended >= 0.29 and second - first < 0.25


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_background_threads_and_the_threads_they_start_run_below_the_pages():
    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = nice()

    def job() -> tuple[int, int]:
        inner = []
        t = threading.Thread(target=lambda: inner.append(nice()))  # as the engine's sweep threads are started
        t.start()
        t.join()
        return nice(), inner[0]

    assert Background(nice=5).submit(job).result(5) == (min(19, mine + 5),) * 2
    assert Background().submit(job).result(5) == (mine, mine)
    assert nice() == mine  # the caller's own priority is untouched


def test_the_solver_pool_solves_once_reports_progress_and_says_a_failure_once():
    pool = Background(workers=1, bound=4)
    go = threading.Event()
    solved = []

    def solve(progress):
        progress(0.5)
        go.wait(5)
        solved.append(1)
        return "schedule"

    deadline = time.monotonic() + 5
    assert pool.poll("a", solve).done is False
    while pool.poll("a", solve).fraction != 0.5 and time.monotonic() < deadline:
        time.sleep(0.01)
    running = pool.poll("a", solve)  # asked again while running: the same job, not a second
    assert (running.done, running.fraction) == (False, 0.5) and 0 <= running.elapsed_s < 5
    go.set()
    while not pool.poll("a", solve).done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.poll("a", solve) == Status(True, 1.0, "schedule") and solved == [1]
    assert pool.poll("b", lambda p: pytest.fail("not needed"), needed=lambda: False) == Status(True, 1.0)

    def fail(progress):
        raise MemoryError("no room for the forfeit costs")

    pool.poll("c", fail)
    while time.monotonic() < deadline:
        try:
            pool.poll("c", fail)
        except MemoryError as e:
            assert "forfeit" in str(e)
            break
        time.sleep(0.01)
    else:
        pytest.fail("the failure was never reported")
    while not (status := pool.poll("c", lambda p: "ok")).done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert status.value == "ok"  # started again, not the old failure


def test_the_curve_reads_kept_sweeps_by_the_key_summaries_keeps_them_under(tmp_path, monkeypatch):
    """``memo.kept_sweep`` and ``memo.kept_refined`` look a sweep up by the key ``summaries.sweep`` writes it
    under (a copy of that key): what a sweep kept is found, rows equal, and nothing else is, nothing replayed."""
    import kvsim
    from kvsim.analysis.windows import sweep_coarse_to_fine
    from kvsim.app import memo
    from kvsim.policies import PolicySpec
    from kvsim.policykit.base import WINDOW
    from kvsim.sim import summaries

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    trace = kvsim.resolve_trace("canonical")
    spec = PolicySpec.of("h2o", 48, recent_window=1)
    assert memo.kept_sweep(trace, spec, [1, 5, 9]) is None and memo.kept_refined(trace, spec, (32,), 8) is None
    swept = summaries.sweep(trace, spec, None, WINDOW, [1, 5, 9], top_k=memo.TOP_K)
    assert memo.kept_sweep(trace, spec, [1, 5, 9]) == swept
    assert memo.kept_sweep(trace, spec, [1, 5]) is None  # another sweep's values: not this file
    refined = sweep_coarse_to_fine(trace, spec, None, WINDOW, 1, 47, marks=(32,), points=8, top_k=memo.TOP_K,
                                   run=summaries.sweep)
    assert memo.kept_refined(trace, spec, (32,), 8) == refined

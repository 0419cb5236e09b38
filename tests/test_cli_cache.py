"""Issue 21, items 9 and 10: the app watches only its own sources (``.streamlit/config.toml``), every cache
can be listed and cleared (``kvsim cache``), and ``kvsim bench --check`` exits 1 on a missed target."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

from kvsim import cli
from kvsim.bench import speed

ROOT = Path(__file__).resolve().parent.parent


def _caches():
    from kvsim.data import caches  # imported per test, so each test fails on its own where the module is missing

    return caches


# --- 9a: what the app's server watches ----------------------------------------------------------

def _server_config() -> dict:
    return tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())["server"]


def test_the_app_never_puts_a_recursive_watch_on_its_folder():
    """watchdog (Streamlit's default) watches the folder of app.py recursively, .venv/ included; polling
    watches only the imported source files, so a pip install into .venv/ cannot flood it."""
    assert _server_config()["fileWatcherType"] in ("poll", "none")


def test_environments_and_traces_are_never_watched():
    from streamlit.watcher.folder_black_list import FolderBlackList

    blacklist = FolderBlackList(_server_config()["folderWatchBlacklist"])
    for path in (".venv/lib/python3.11/site-packages/torch/__init__.py", "venv/lib/x.py", ".venv/bin/activate_this.py",
                 "traces/real_traces.py"):
        assert blacklist.is_blacklisted(str(ROOT / path)), path
    for path in ("app.py", "kvsim/app/main.py", "kvsim/views/story.py"):  # the app's own sources: still reloaded on edit
        assert not blacklist.is_blacklisted(str(ROOT / path)), path


def test_the_config_is_read_wherever_kvsim_app_is_started():
    """``kvsim app`` runs ``streamlit run <checkout>/app.py`` from the caller's folder: Streamlit 1.67 reads the
    ``.streamlit/config.toml`` beside the main script as well as the working directory's."""
    from streamlit import config

    from kvsim.cli.commands import APP_SCRIPT

    old = config._main_script_path
    try:
        config._main_script_path = str(APP_SCRIPT)
        assert str(ROOT / ".streamlit" / "config.toml") in config.get_config_files("config.toml")
    finally:
        config._main_script_path = old


# --- 9b: kvsim cache ------------------------------------------------------------------------------

def _fill(root: Path) -> dict[str, int]:
    """One entry of each kind as their writers name them, and a stranger; bytes per kind."""
    files = {
        "canonical-v2-0123456789abcdef.npy": ("traces", 4000), "canonical-v2-0123456789abcdef.json": ("traces", 100),
        "canonical-v2-0123456789abcdef-topk32.npy": ("traces", 300), "file-gemma3-270m-L11-aaaa.npy": ("traces", 2000),
        "file-gemma3-270m-L11-aaaa-describe-bbbb.json": ("traces", 50), "optimal-v3-cafe-b256.npz": ("optimal", 700),
        "qk-gemma3-270m-long-L05-cccc-rows-k32.npz": ("traces", 30), "qk-gemma3-270m-long-L05-cccc-rowstats-dddd.npz": ("traces", 20),
        "quality/abc.json": ("quality", 60), "quality/def.json": ("quality", 40),
        "models/gemma3-270m-0011-transformers-4.57/model.safetensors": ("models", 9000),
        "models/gemma3-270m-0011-transformers-4.57/complete": ("models", 3),
        "gemma3-270m-0011-transformers-4.50/model.safetensors": ("models", 8000),  # where older versions put it
        "recordings/gemma3-270m-long-32767-qk-0123/manifest.json": ("recordings", 500),
        "needle/trial-0123.json": ("needle", 80), "needle/trial-0123.npz": ("needle", 120),
        "allocation/compare-v1-0123.json": ("allocation", 90),
        "tuning/unit-0123.json": ("tuning", 70),
        "notes.txt": ("other", 11),
    }
    sizes: dict[str, int] = {}
    for name, (kind, size) in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x" * size)
        sizes[kind] = sizes.get(kind, 0) + size
    return sizes


def _list(capsys) -> dict:
    assert cli.main(["cache", "list", "--json"]) == 0
    return {r["kind"]: r for r in json.loads(capsys.readouterr().out)["kinds"]}


def test_cache_list_counts_each_kind(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    sizes = _fill(tmp_path)
    kinds = _list(capsys)
    assert {k: r["bytes"] for k, r in kinds.items()} == sizes
    assert {k: r["entries"] for k, r in kinds.items()} == {"traces": 7, "optimal": 1, "quality": 2, "models": 3, "recordings": 1,
                                                             "needle": 2, "allocation": 1, "tuning": 1,
                                                             "other": 1}
    assert cli.main(["cache", "list"]) == 0
    text = capsys.readouterr().out
    assert f"cache directory: {tmp_path}" in text and "models" in text and "16.6 KB" in text


@pytest.mark.parametrize("kind", ["traces", "models", "quality", "optimal", "recordings", "needle", "allocation", "tuning"])
def test_cache_clear_one_kind_leaves_the_others(tmp_path, monkeypatch, capsys, kind):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    sizes = _fill(tmp_path)
    assert cli.main(["cache", "clear", "--kind", kind, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bytes"] == sizes[kind] and [r["kind"] for r in doc["cleared"]] == [kind]
    after = _list(capsys)
    assert after[kind]["bytes"] == 0
    assert all(after[k]["bytes"] == sizes[k] for k in sizes if k != kind)


def test_cache_clear_all_keeps_what_the_cache_did_not_write(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    _fill(tmp_path)
    assert cli.main(["cache", "clear"]) == 0
    assert "cleared all from" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_cache_clear_never_follows_a_link_out_of_the_cache(tmp_path, monkeypatch, capsys):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.npy").write_bytes(b"data")
    cache = tmp_path / "cache"
    (cache / "quality").mkdir(parents=True)
    (cache / "models").symlink_to(outside, target_is_directory=True)  # a link named like an entry
    (cache / "quality" / "elsewhere").symlink_to(outside, target_is_directory=True)  # a link inside an entry
    (cache / "file-x-1234.npy").symlink_to(outside / "keep.npy")
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(cache))
    assert cli.main(["cache", "clear", "--json"]) == 0
    capsys.readouterr()
    assert (outside / "keep.npy").read_bytes() == b"data"
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("where", ["/", "~", "~/"])
def test_cache_refuses_the_root_or_home_as_its_directory(where, monkeypatch, capsys):
    monkeypatch.setenv("KVSIM_CACHE_DIR", os.path.expanduser(where))
    for argv in (["cache", "clear"], ["cache", "clear", "--kind", "models"], ["cache", "list"]):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("kvsim: error: the cache directory") and err.count("\n") == 1
    with pytest.raises(_caches().CacheError):
        _caches().clear("all", Path(os.path.expanduser(where)))


def test_cache_of_an_empty_or_missing_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "not-yet"))
    assert all(r["bytes"] == 0 for r in _list(capsys).values())
    assert cli.main(["cache", "clear"]) == 0
    assert not (tmp_path / "not-yet").exists()
    assert cli.main(["cache"]) == 2 and "required" in capsys.readouterr().err


def test_the_dequantised_model_goes_to_models(tmp_path, monkeypatch):
    from kvsim.models.loading import model_cache

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    assert model_cache("ab" * 32, "4.57.0") == tmp_path / "models" / "gemma3-270m-abababababababab-transformers-4.57.0"
    assert _caches().kind_of("models") == "models"
    legacy = tmp_path / "gemma3-270m-abababababababab-transformers-4.57.0"
    (legacy / "complete").parent.mkdir()
    (legacy / "complete").write_text("ok\n")
    assert model_cache("ab" * 32, "4.57.0") == legacy  # an existing copy is read, not made again


def test_docs_describe_every_cache_kind():
    text = (ROOT / "docs" / "caches.md").read_text()
    for word in (*_caches().KINDS, "kvsim cache list", "kvsim cache clear", "KVSIM_CACHE_DIR", "1.1 GB", "NUMBA_CACHE_DIR"):
        assert word in text, word


# --- 10: kvsim bench --check -------------------------------------------------------------------------

def _speed_doc(missed: bool) -> dict:
    doc = {"targets": {"cli_sweep_within_1_s": not missed, "results_identical": True}}
    return speed.verdict(doc)


@pytest.fixture
def fake_speed(monkeypatch):
    """``speed.run`` replaced by a document with the given verdicts; the figures' table by one line."""
    def install(missed: bool):
        monkeypatch.setattr(speed, "run", lambda full_reference=False, progress=None: _speed_doc(missed))
        monkeypatch.setattr(speed, "_figures_text", lambda doc: "(figures)")
    return install


@pytest.mark.parametrize("argv_tail", [[], ["--json"]])
def test_bench_check_exits_1_on_a_missed_target(fake_speed, capsys, argv_tail):
    fake_speed(missed=True)
    assert cli.main(["bench", "--check", *argv_tail]) == 1
    out = capsys.readouterr().out
    if argv_tail:
        assert json.loads(out)["result"] == "FAIL"
    else:
        assert "cli_sweep_within_1_s  FAIL" in out and out.rstrip().endswith("overall: FAIL (1 of 2 targets missed)")
    assert cli.main(["bench", *argv_tail]) == 0  # without --check: a report, status 0
    capsys.readouterr()


def test_bench_check_exits_0_when_every_target_passes(fake_speed, capsys):
    fake_speed(missed=False)
    assert cli.main(["bench", "--check"]) == 0
    out = capsys.readouterr().out
    assert "results_identical     PASS" in out and out.rstrip().endswith("overall: PASS (0 of 2 targets missed)")


def _browser_doc(result: str) -> dict:
    from kvsim.bench import browser

    runs = [browser.Timing(0.5, None, 0.1, 1.0), browser.Timing(2.5 if result == "FAIL" else 0.6, None, 0.1, 1.0)]
    step = browser.StepReport("a new session, default view", 1.0, runs)
    doc = {"kind": "browser", "cold_cache": False, "rounds": 2, "server_start_s": [1.0, 1.0],
           "machine": {"cpus": 2, "python": "3.11", "streamlit": "1.x", "load_average_at_start": [1.0, 1.0, 1.0],
                       "load_average_at_end": [1.0, 1.0, 1.0]}, "steps": [step.to_dict()], "load": None}
    return browser.overall(doc)


@pytest.mark.parametrize("result, check, status", [("FAIL", True, 1), ("PASS", True, 0), ("FAIL", False, 0)])
def test_bench_browser_check(monkeypatch, capsys, result, check, status):
    from kvsim.bench import browser

    monkeypatch.setattr(browser, "run", lambda **kw: _browser_doc(result))
    assert cli.main(["bench", "--browser", *(["--check"] if check else [])]) == status
    assert f"overall: {result}" in capsys.readouterr().out


def test_bench_help_documents_check(capsys):
    assert cli.main(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--check" in text and "1 with --check: at least one target was missed" in text


# --- 9a, for real: a server started by `kvsim app` puts no inotify watch on the checkout ---------------

def _inotify_inodes(pid: int) -> set[int]:
    """The inodes every inotify watch of process ``pid`` and its descendants is on (``/proc/PID/fdinfo``)."""
    import re

    inodes: set[int] = set()
    pending = [pid]
    while pending:
        p = pending.pop()
        for fd in Path(f"/proc/{p}/fd").iterdir() if Path(f"/proc/{p}/fd").is_dir() else ():
            try:
                if os.readlink(fd) != "anon_inode:inotify":
                    continue
                info = Path(f"/proc/{p}/fdinfo/{fd.name}").read_text()
            except OSError:
                continue
            inodes |= {int(m, 16) for m in re.findall(r"^inotify wd:\S+ ino:([0-9a-f]+)", info, re.MULTILINE)}
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                pending += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return inodes


def _checkout_dirs() -> dict[int, str]:
    """Inode -> path of every folder of the checkout (a .venv inside it too), links not followed."""
    found = {}
    for root, dirs, _files in os.walk(ROOT):
        found[os.lstat(root).st_ino] = root
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
    return found


@pytest.mark.browser
def test_a_server_started_by_kvsim_app_watches_no_folder_of_the_checkout(tmp_path, request):
    import sys
    import time

    from browser_support import CHROMIUM, free_port, opened, serving

    if not os.path.exists(CHROMIUM) or not Path("/proc/self/fdinfo").is_dir():
        pytest.skip(f"needs Debian's chromium at {CHROMIUM} and /proc")
    chromium = request.getfixturevalue("chromium")  # the session's (tests/conftest.py)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVSIM_CACHE_DIR": os.environ.get("KVSIM_CACHE_DIR", "")}
    env = {k: v for k, v in env.items() if v}
    cmd = [sys.executable, "-m", "kvsim", "app", "--server.headless", "true", "--server.port", str(port),
           "--server.address", "127.0.0.1"]
    # started from elsewhere, as a user would: the config beside app.py must apply
    with serving(cmd, port, tmp_path / "server.log", cwd=tmp_path, env=env) as (url, proc):
        with opened(chromium) as browser:
            page = browser.new_page()
            page.goto(url)
            page.wait_for_selector("[data-testid='stApp']", timeout=60_000)
            time.sleep(4)  # the session's source watcher is set up when it connects
            watched = _inotify_inodes(proc.pid)
        dirs = _checkout_dirs()
        on_checkout = sorted(dirs[i] for i in watched & set(dirs))
        assert on_checkout == [], f"{len(on_checkout)} folders of the checkout watched, e.g. {on_checkout[:5]}"

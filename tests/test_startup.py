"""A command line that answers at once (issue 36): ``import kvsim`` and the commands that run no kernel
load none of numba, scipy, pandas or torch; a replay loads only the kernels it runs, from numba's disk
cache without numba's typing, and a query/key trace replays with the dense trace's compiled code.

Each check runs a fresh interpreter, since what a process imports is the point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from random_traces import random_trace

from kvsim.data.trace import save_npz
from kvsim.jit import AVAILABLE

ROOT = Path(__file__).resolve().parent.parent
#: what a command that runs no kernel must not import: the kernels' compiler, and the heavy optional libraries
HEAVY = ("numba", "llvmlite", "scipy", "pandas", "torch")

needs_numba = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed: there are no kernels to load")

#: runs ``kvsim ARGS`` and prints, at exit, the heavy modules the process imported and every kvsim kernel
#: that has compiled code in it (loaded from disk or compiled), as JSON on stderr's last line
_CHILD = """import atexit, json, runpy, sys
HEAVY = ('numba', 'llvmlite', 'scipy', 'pandas', 'torch')  # the test module's HEAVY
def kernels():
    found = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("kvsim") and module is not None:
            for value in list(vars(module).values()):
                fn = getattr(value, "py_func", None)
                if fn is not None and fn.__module__.startswith("kvsim") and getattr(value, "overloads", None):
                    found.add(fn.__module__ + "." + fn.__qualname__)
    return sorted(found)
def report():
    heavy = sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in HEAVY})
    sys.stderr.write("\\n" + json.dumps({"heavy": heavy, "kernels": kernels()}) + "\\n")
atexit.register(report)
sys.argv = ["kvsim", *sys.argv[1:]]
runpy.run_module("kvsim", run_name="__main__")
"""


def kvsim_process(*args: str, env: dict | None = None) -> tuple[int, str, dict]:
    """(exit status, stdout, what the process loaded) of ``python -m kvsim ARGS`` in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=600)
    return done.returncode, done.stdout, json.loads(done.stderr.strip().splitlines()[-1])


def test_import_kvsim_loads_no_kernel_compiler_and_no_heavy_library():
    code = f"import sys, kvsim; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_the_public_api_still_reads_every_name(tmp_path):
    """``kvsim``'s names load on first use: each is the object its home module defines."""
    import importlib

    import kvsim

    for name in kvsim.__all__:
        module, attr = kvsim._HOMES[name]
        assert getattr(kvsim, name) is getattr(importlib.import_module(f"kvsim.{module}"), attr), name
    assert set(kvsim._HOMES) == set(kvsim.__all__) and set(kvsim.__all__) <= set(dir(kvsim))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = kvsim.nope


@pytest.mark.parametrize("args,status", [
    (["--help"], 0),
    (["replay", "--budget", "zero"], 2),  # a usage error
    (["replay", "--policy", "h2o", "--recent-window", "32", "--budget", "16"], 2),  # refused before any trace
    (["cache", "list"], 0),
    (["describe", "--trace", "{small}", "--json"], 0),  # a dense trace: statistics in NumPy
    (["export", "--trace", "{small}", "--out", "{out}", "--json"], 0),
])
def test_a_command_that_runs_no_kernel_loads_none_of_them(args, status, tmp_path):
    small = tmp_path / "small.npz"
    save_npz(random_trace(60, seed=3), small)
    args = [a.format(small=small, out=tmp_path / "out.npz") for a in args]
    code, _, loaded = kvsim_process(*args, env={"KVSIM_CACHE_DIR": str(tmp_path / "cache")})
    assert code == status
    assert loaded == {"heavy": [], "kernels": []}


@needs_numba
def test_a_second_replay_loads_only_the_kernel_it_runs():
    """The canonical trace's top-k positions are on disk beside it, so a second replay runs (and loads)
    the h2o step kernel alone: nothing is replayed ahead of it, nothing else is read from numba's cache."""
    args = ["replay", "--policy", "h2o", "--budget", "256", "--json"]
    first = kvsim_process(*args)  # fills the caches this machine may not have yet
    code, out, loaded = kvsim_process(*args)
    assert code == 0 and json.loads(out) == json.loads(first[1])
    [only] = loaded["kernels"]  # named after its policy and a digest of its sources (test_kernel_cache_names)
    assert only.startswith("kvsim.sim.kernels.h2o_steps_")


@needs_numba
def test_a_kernel_on_disk_loads_without_numbas_typing_and_a_compile_after_it_still_works(tmp_path):
    """numba refreshes its typing registries (a thousand templates, about as long as its import) before
    it reads a cached kernel; kvsim reads the compiled code alone, and a compile that follows in the
    same process still types and runs (numba's compiler refreshes them itself)."""
    code = """import contextlib, io, sys
from numba.core import base
calls = []
refresh = base.BaseContext.refresh
base.BaseContext.refresh = lambda self: calls.append(1) or refresh(self)
from kvsim.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(sys.argv[1:]) == 0
loaded = len(calls)
import numba, numpy as np
@numba.njit
def total(a):
    return a.sum() * 2.0
print(loaded, total(np.arange(4.0)))
"""
    args = [str(tmp_path / "small.npz"), "--policy", "tova", "--budget", "12", "--json"]
    save_npz(random_trace(40, seed=2), tmp_path / "small.npz")

    def run():
        done = subprocess.run([sys.executable, "-c", code, "replay", "--trace", *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()

    run()  # compiles, where this machine has not yet
    assert run() == ["0", "12.0"]


@needs_numba
def test_a_query_key_replay_after_a_dense_one_compiles_no_step_kernel(tmp_path):
    """The engine hands a query/key trace's rows to the step kernels read-only, as the dense matrix is:
    one compiled signature, so a machine's first query/key replay compiles only the row kernels."""
    code = """import json
import numpy as np
from numba.core import event
from kvsim.data import qk
from kvsim.data.trace import from_array
from kvsim.sim.simulate import replay
rng = np.random.default_rng(0)
q, k, v = (rng.normal(size=s).astype(np.float16) for s in ((2, 80, 8), (80, 8), (80, 8)))
replay(from_array(np.tril(rng.random((80, 80)), -1)), "h2o", budget=48)
with event.install_recorder("numba:compile") as seen:
    replay(qk.from_qk(q, k, v, scale=0.3), "h2o", budget=48)
names = {ev.data["dispatcher"].py_func.__module__ for _, ev in seen.buffer}
print(json.dumps(sorted(names)))
"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "KVSIM_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])  # the modules of the kernels compiled
    assert compiled and "kvsim.sim.kernels" not in compiled and "kvsim.policies.h2o" not in compiled, compiled


def test_a_command_line_process_ends_once_its_output_is_out():
    """After the command, the atexit handlers run and the process leaves without the interpreter's
    teardown (with numba loaded, LLVM's clean-up on the way out took 0.2-1 s): an object that only the
    teardown frees is never freed, and the exit status and the output are the command's."""
    code = """import atexit, runpy, sys
class Freed:
    def __del__(self):
        sys.stdout.write("torn down\\n")
kept_until_teardown = Freed()
atexit.register(lambda: sys.stdout.write("atexit ran\\n"))
sys.argv = ["kvsim", *sys.argv[1:]]
runpy.run_module("kvsim", run_name="__main__")
"""
    for args, status in ((["replay", "--budget", "zero"], 2), (["cache", "list", "--json"], 0)):
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert done.returncode == status, done.stderr
        assert done.stdout.endswith("atexit ran\n") and "torn down" not in done.stdout
        if status == 0:
            assert json.loads(done.stdout.removesuffix("atexit ran\n"))["action"] == "list"
        else:
            assert done.stderr.count("\n") == 1 and "--budget" in done.stderr


#: modules a second replay process has no use for: numba's array and string helpers (their compiled
#: code is in the kernel read from disk; importing them cost 0.05-0.1 s), numpy's masked arrays (which
#: numba's typing and ``np.unique`` asked about), the heavy libraries no replay runs, and what only the
#: other commands run (their modules, the analyses their flags and documents name, the query/key reader
#: and the thread pool of a sweep's batches): every kvsim module a process imports is compiled from
#: source where no bytecode is kept, as on the project's machines
OTHER_COMMANDS = ("kvsim.cli.commands", "kvsim.cli.tune_command", "kvsim.cli.needle_command", "kvsim.cli.proxies_command",
                  "kvsim.cli.generate_command", "kvsim.cli.cache_command", "kvsim.analysis.metrics", "kvsim.analysis.table",
                  "kvsim.analysis.tune", "kvsim.analysis.proxies", "kvsim.analysis.windows", "kvsim.data.qk",
                  "kvsim.data.qk_files", "subprocess", "statistics", "concurrent.futures")
NOT_FOR_A_REPLAY = ("numba.np.arrayobj", "numba.cpython.unicode", "numba.cpython.charseq", "numpy.ma", "scipy",
                    "pandas", "torch", "plotly", "streamlit", *OTHER_COMMANDS)


@needs_numba
def test_a_second_replay_imports_none_of_what_it_does_not_run():
    code = f"""import contextlib, io, json, sys
from kvsim.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert main(sys.argv[1:]) == 0
print(json.dumps([json.loads(out.getvalue()), [m for m in {NOT_FOR_A_REPLAY!r} if m in sys.modules]]))
"""
    args = ["replay", "--policy", "h2o", "--budget", "256", "--json"]

    def run():
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run()  # compiles where this machine has not yet (a compile imports all of numba)
    second = run()
    assert second == [first[0], []]


@needs_numba
def test_a_second_replay_compiles_none_of_numbas_runtime_and_makes_only_the_dispatchers_its_kernel_calls(tmp_path):
    """numba's runtime compiles its own LLVM functions when it starts; a kernel read from disk carries its
    copy of them, so a second replay registers the runtime's C functions only. Of the engine's kernels, a
    replay makes the dispatchers of those its step kernel's code names (and theirs), not every one in the
    module. A compile after it in the same process starts the runtime and links it (an array allocated)."""
    code = """import contextlib, io, json, sys
import numba, numpy as np
from numba.core.runtime import nrtdynmod
compiled = []
compile_nrt = nrtdynmod.compile_nrt_functions
nrtdynmod.compile_nrt_functions = lambda ctx: compiled.append(1) or compile_nrt(ctx)
from kvsim.cli import main
import re
from kvsim import jit
from kvsim.policies import h2o, snapkv, tova
from kvsim.policykit import slot_hooks
from kvsim.sim import kernels
def named(module):  # a specialisation by its policy's name, without the digest of its sources
    return {re.sub(r"_steps_[0-9a-f]{10}$", "_steps", n): v for n, v in vars(module).items() if isinstance(v, jit.Kernel)}
kernel = {n: v for m in (kernels, slot_hooks, tova, snapkv, h2o) for n, v in named(m).items()}  # before any is swapped
with contextlib.redirect_stdout(io.StringIO()):
    assert main(sys.argv[1:]) == 0
kernel.update(named(kernels))  # the step loops the replay specialised with the hooks beside their policies: h2o's alone
loaded = len(compiled)
made = sorted(n for n, v in kernel.items() if v._dispatcher is not None)
stand_ins = sorted(n for n, v in kernel.items() if v._dispatcher is None)
@numba.njit
def doubled(a):
    return (a * 2.0).sum()
print(json.dumps([loaded, made, stand_ins, doubled(np.arange(4.0)), len(compiled)]))
"""
    save_npz(random_trace(40, seed=4), tmp_path / "small.npz")
    args = ["replay", "--trace", str(tmp_path / "small.npz"), "--policy", "h2o", "--budget", "12", "--recent-window", "4", "--json"]

    def run():
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    run()  # compiles, where this machine has not yet
    loaded, made, stand_ins, doubled, after = run()
    assert loaded == 0 and doubled == 12.0 and after == 1
    assert "h2o_steps" in made and "_h2o_observe" in made and "_first_min" in made
    assert "_tova_observe" in stand_ins and "_tova_pick" in stand_ins and "_snapkv_observe" in stand_ins
    assert not {"tova_steps", "snapkv_steps"} & {*made, *stand_ins}  # the loops of policies not replayed: never made


def test_a_commands_own_parser_reads_its_line_as_the_whole_grammar_does():
    """A command's process builds its own sub-parser alone (``build_parser(command)``): the same flags, the
    same help and the same namespace as the whole grammar's, and the whole grammar for anything else."""
    from kvsim.cli import parser

    whole = parser.build_parser()
    subs = whole._subparsers._group_actions[0].choices
    assert tuple(subs) == parser.COMMANDS
    for name in parser.COMMANDS:
        own = parser.build_parser(name)
        (only,) = own._subparsers._group_actions[0].choices.items()
        assert only[0] == name and only[1].format_help() == subs[name].format_help(), name
    line = ["replay", "--policy", "h2o", "--budget", "64", "--recent-window", "8", "--json"]
    assert vars(parser.build_parser("replay").parse_args(line)) == vars(whole.parse_args(line))
    line = ["sweep", "--policy", "tova", "--budget", "32:64:8"]
    assert vars(parser.build_parser("sweep").parse_args(line)) == vars(whole.parse_args(line))


def test_a_replay_imports_none_of_the_other_commands_analyses_and_prints_the_same_document(tmp_path, capsys):
    """What the replay's process imports of kvsim and the standard library beyond its own: nothing the
    other commands run (where numba is not installed the replay runs the kernels' Python)."""
    code = f"""import contextlib, io, json, sys
from kvsim.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert main(sys.argv[1:]) == 0
print(json.dumps([json.loads(out.getvalue()), [m for m in {OTHER_COMMANDS!r} if m in sys.modules]]))
"""
    save_npz(random_trace(50, seed=6), tmp_path / "small.npz")
    args = ["replay", "--trace", str(tmp_path / "small.npz"), "--policy", "tova", "--budget", "16", "--json"]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env={**os.environ, "KVSIM_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    doc, imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == []
    from kvsim.cli import main

    capsys.readouterr()
    assert main(args) == 0  # in this process, where the other commands' modules are imported: the same document
    assert json.loads(capsys.readouterr().out) == doc and doc["policy"] == "tova" and doc["steps"] == 50


def _crc_calls(monkeypatch) -> list:
    import zlib

    from kvsim.data import store

    calls, crc32 = [], zlib.crc32
    monkeypatch.setattr(store.zlib, "crc32", lambda data, *a: calls.append(1) or crc32(data, *a))
    return calls


def test_a_cache_entry_checked_once_is_read_by_its_stamp_and_still_refused_when_damaged(tmp_path, monkeypatch):
    """The canonical entry's CRC is computed on a read until the file has settled; then its stamp
    joins the record and the next reads skip the CRC. A write to the file afterwards changes the stamp,
    so the damage is found by the CRC again and the entry made anew."""
    import time

    from kvsim.data import canonical, files, store

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(files, "SETTLED_NS", 50_000_000, raising=False)  # 50 ms, ten ticks of a coarse file-system clock
    config = canonical.CanonicalConfig(steps=64)
    fresh = store.canonical_trace(config)
    path = store.cache_path(config)
    calls = _crc_calls(monkeypatch)
    time.sleep(0.1)
    assert np.array_equal(store.canonical_trace(config).attention, fresh.attention) and len(calls) == 1  # checked, stamped
    assert np.array_equal(store.canonical_trace(config).attention, fresh.attention) and len(calls) == 1  # by its stamp
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store._read(path, config) is None and len(calls) == 2
    assert np.array_equal(store.canonical_trace(config).attention, fresh.attention)


def test_an_entry_just_written_is_not_trusted_by_its_stamp(tmp_path, monkeypatch):
    """A file written within the file system's timestamp tick could be rewritten with the same size and
    times: until it is older than ``SETTLED_NS`` every read checks its CRC."""
    from kvsim.data import canonical, store

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    config = canonical.CanonicalConfig(steps=64)
    store.canonical_trace(config)
    calls = _crc_calls(monkeypatch)
    for _ in range(2):
        store.canonical_trace(config)
    assert len(calls) == 2 and "stamp" not in json.loads(store.cache_path(config).with_suffix(".json").read_text())


def test_a_query_key_files_digest_is_read_back_by_its_stamp_and_a_changed_file_hashed_again(tmp_path, monkeypatch):
    import builtins
    import time

    from kvsim.data import files, qk_files

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(files, "SETTLED_NS", 50_000_000, raising=False)
    meta = {"layer": 1, "head": 0, "query_heads": [0, 1], "scale": 0.25, "softcap": None, "sliding_window": None,
            "gqa": "mean", "model": "random", "text": {"source": "none"}}

    def write(seed):
        rng = np.random.default_rng(seed)
        qk_files.save_qk(path, *(rng.normal(size=s).astype(np.float16) for s in ((2, 60, 8), (60, 8), (60, 8))), meta)

    path = tmp_path / "toy-L01.qk.npz"
    write(0)
    time.sleep(0.1)
    opened = []
    real_open = builtins.open
    monkeypatch.setattr(qk_files, "open", lambda p, *a, **k: opened.append(Path(p)) or real_open(p, *a, **k), raising=False)
    stems = [qk_files.load_qk(path).derived.disk_stem for _ in range(3)]
    assert len(set(stems)) == 1 and opened == [path.resolve()]  # hashed once, then read back by its stamp
    write(1)  # same size, new bytes
    changed = qk_files.load_qk(path).derived.disk_stem
    assert changed != stems[0] and opened == [path.resolve()] * 2
    with real_open(path, "rb") as f:  # as bytes (a Dask worker's): hashed, the same digest
        assert qk_files.load_qk(f, source=str(path)).derived.disk_stem == changed


@needs_numba
def test_numbas_extensions_are_loaded_before_a_kernel_compiles_and_not_for_one_read_from_disk(tmp_path):
    """Reading every installed distribution's entry points for numba's extensions is left out where a
    kernel's code is on disk; where it is compiled the extensions are loaded first, as numba does."""
    code = """import contextlib, io, json, sys
from numba.core import entrypoints, event
order = []
init_all = entrypoints.init_all
entrypoints.init_all = lambda: order.append("extensions") or init_all()
class Listener(event.Listener):
    def on_start(self, ev):
        order.append("compile")
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
from kvsim.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(sys.argv[1:]) == 0
compiled = "compile" in order
print(json.dumps([compiled, compiled and order.index("extensions") < order.index("compile"), "extensions" in order,
                  entrypoints._already_initialized]))
"""
    save_npz(random_trace(40, seed=5), tmp_path / "small.npz")
    args = ["replay", "--trace", str(tmp_path / "small.npz"), "--policy", "tova", "--budget", "12", "--json"]
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "KVSIM_CACHE_DIR": str(tmp_path / "cache")}

    def run():
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                              timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert run() == [True, True, True, True]  # an empty numba cache: compiled, the extensions loaded first
    assert run() == [False, False, False, False]  # read from disk: no extensions asked for

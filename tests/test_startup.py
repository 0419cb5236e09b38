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
    assert loaded["kernels"] == ["kvsim.sim.kernels.h2o_steps"]


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
    assert compiled and "kvsim.sim.kernels" not in compiled, compiled


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

"""numba keys a cached kernel by its own file's time stamp, and every policy's step loop is made in
kvsim/sim/kernels.py from hooks that live elsewhere (beside the policy, the helpers hooks share in
kvsim/policykit/slot_hooks.py, the GQA rule's jitted helpers). A specialisation's name carries a digest of
every source file its hooks reach, and every kernel's cache key the digest of every file its code reaches, so
editing a hook or a helper it calls compiles its callers afresh instead of running the old cached code, and
nothing else."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvsim.jit import AVAILABLE
from kvsim.sim import engine, kernels

ROOT = Path(__file__).resolve().parent.parent


def _module(tmp_path, name: str, source: str):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_the_digest_follows_a_hook_and_the_helpers_it_calls_in_other_files(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _module(tmp_path, "kc_helper", "def helper(x):\n    return x + 1\n")
    hooks = _module(tmp_path, "kc_hooks", "from kc_helper import helper\n\ndef pick(x):\n    return helper(x)\n")
    first = kernels._sources_digest([hooks.pick])
    assert kernels._sources_digest([hooks.pick]) == first  # the same files: the same name, the cache reused

    _module(tmp_path, "kc_helper", "def helper(x):\n    return x + 2\n")  # the helper, two files away, edited
    hooks = _module(tmp_path, "kc_hooks", "from kc_helper import helper\n\ndef pick(x):\n    return helper(x)\n")
    second = kernels._sources_digest([hooks.pick])
    assert second != first

    _module(tmp_path, "kc_hooks", "from kc_helper import helper\n\ndef pick(x):\n    return helper(x) * 1\n")
    assert kernels._sources_digest([sys.modules["kc_hooks"].pick]) not in (first, second)


def test_the_digest_follows_a_constant_imported_from_another_module(tmp_path, monkeypatch):
    """numba freezes a global constant into the code: one read from another module (``from .greedy_future import
    BLOCK`` in a hook's file) changes the digest when its value does."""
    monkeypatch.syspath_prepend(str(tmp_path))
    hooks = "from kc_const import BLOCK\n\ndef pick(x):\n    return x + BLOCK\n"
    _module(tmp_path, "kc_const", "BLOCK = 64\n")
    first = kernels._sources_digest([_module(tmp_path, "kc_const_hooks", hooks).pick])
    _module(tmp_path, "kc_const", "BLOCK = 32\n")  # the hook's own file unchanged
    assert kernels._sources_digest([_module(tmp_path, "kc_const_hooks", hooks).pick]) != first


def test_every_specialisation_is_named_after_its_policy_and_its_sources():
    for policy in ("h2o", "tova", "snapkv"):
        steps = engine.FAST[policy].steps
        name = steps.py_func.__name__
        base, _, digest = name.rpartition("_")
        assert base == f"{policy}_steps" and len(digest) == 10
        assert getattr(kernels, name) is steps  # where its __module__ and __qualname__ say it is


#: three files: a helper, a kernel that calls it, and a kernel that does not
_HELPER = "from kvsim.jit import kernel\n\n@kernel\ndef helper(x):\n    return x + {step}\n"
_CALLER = "from kvsim.jit import kernel\nfrom kc_jit_helper import helper\n\n@kernel\ndef caller(x):\n    return helper(x) * 10\n"
_OTHER = "from kvsim.jit import kernel\n\n@kernel\ndef other(x):\n    return x - 1\n"
_RUN = """import json, sys
from numba.core import event
sys.path.insert(0, sys.argv[1])
from kc_jit_caller import caller
from kc_jit_other import other
with event.install_recorder("numba:compile") as seen:
    values = [caller(1), other(1)]
print(json.dumps([values, sorted({ev.data["dispatcher"].py_func.__name__ for _, ev in seen.buffer})]))
"""


@pytest.mark.skipif(not AVAILABLE, reason="numba is not installed: nothing is cached")
def test_editing_a_helper_module_recompiles_its_callers_and_nothing_else(tmp_path):
    """numba alone loads ``caller``'s cached code after ``helper``'s file is edited (its own file and
    bytecode are unchanged), the old helper inlined; kvsim's key holds the digest of both files."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "kc_jit_caller.py").write_text(_CALLER)
    (code / "kc_jit_other.py").write_text(_OTHER)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(ROOT)}

    def run(step):
        (code / "kc_jit_helper.py").write_text(_HELPER.format(step=step))
        done = subprocess.run([sys.executable, "-c", _RUN, str(code)], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    assert run(1) == '[[20, 0], ["caller", "helper", "other"]]'  # an empty cache: all compiled
    assert run(1) == '[[20, 0], []]'  # all read from disk
    assert run(2) == '[[30, 0], ["caller", "helper"]]'  # the helper edited: it and its caller, not the other
    assert run(2) == '[[30, 0], []]'

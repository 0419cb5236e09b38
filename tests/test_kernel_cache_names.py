"""numba keys a cached kernel by its own file's time stamp, and every policy's step loop is made in
kvsim/sim/kernels.py from hooks that may live elsewhere (a policy's own kernel module, the GQA rule's
jitted helpers). A specialisation's name carries a digest of every source file its hooks reach, so
editing a hook or a helper it calls compiles afresh instead of running the old cached code."""

from __future__ import annotations

import importlib
import sys
import textwrap

from kvsim.sim import kernels


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


def test_every_specialisation_is_named_after_its_policy_and_its_sources():
    for kernel in (kernels.H2O, kernels.TOVA, kernels.SNAPKV):
        name = kernel.steps.py_func.__name__
        base, _, digest = name.rpartition("_")
        assert base.endswith("_steps") and len(digest) == 10

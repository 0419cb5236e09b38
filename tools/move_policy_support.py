"""Move the policies' support out of kvsim/policies/ into kvsim/policykit/ (issue 55, "rooms that say what they
hold"), so that kvsim/policies/ holds policies only and the registry finds them as every module there.

Why ``policykit``: what moves is what a policy is built with and run by, not a policy: the interface (``base``),
the registry and a choice of parameters (``registry``, ``spec``), a run's configuration (``plan``), the
declarations of a fast path and a tensor step (``slot_hooks``, ``tensor_hooks``), the serving layouts
(``layouts/``), RoPE's arithmetic (``rope``) and the bounds a policy is measured against (``upper_bound``,
``optimal_blocks``). The name sorts beside ``policies/`` and says it serves them; both stand on one floor of
docs/architecture.md's layers. ``kvsim.policies`` keeps re-exporting the plugin API (``from kvsim.policies
import Policy, register``: docs/architecture.md's "Adding a policy", what plugins outside the checkout import);
no module path is left behind as a shim.

Run from the root of a clean checkout (``python tools/move_policy_support.py``): it ``git mv``s the modules,
rewrites every import and path of them in kvsim/, tests/, docs/, README.md and tools/ (``--dry-run`` says what it
would change and touches nothing), says what it moved and rewrote, and refuses to run twice (kvsim/policykit/
present, or the modules gone) or on a dirty tree. Commit its result as one commit.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD, NEW = "policies", "policykit"
#: what moves: every module of kvsim/policies/ that holds no policy (registry.py's _SUPPORT, slot_hooks and
#: tensor_hooks, which it missed); learned_weights.json stays beside learned.py
SUPPORT = ("base", "registry", "spec", "rope", "upper_bound", "optimal_blocks", "plan", "layouts", "slot_hooks",
           "tensor_hooks")
#: where imports and paths are rewritten: the package, its tests, its documents and the tools
SCOPE = ("kvsim", "tests", "docs", "README.md", "tools", "app.py", "pyproject.toml")
SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".json", ".yml", ".yaml"}
_SUP = "|".join(SUPPORT)

KIT_INIT = '''"""What kvsim's policies are built with and run by (issue 55: kvsim/policies/ holds the policies alone): the
interface (``base``: Policy, Param, Capabilities), the registry (``registry``) and a checked choice of parameters
(``spec``), a run's configuration (``plan``), the declarations of a fast path and a tensor step (``slot_hooks``,
``tensor_hooks``), the serving layouts (``layouts``), RoPE's arithmetic (``rope``) and the bounds a policy is
measured against (``upper_bound``, ``optimal_blocks``). It stands on the policies' floor (docs/architecture.md).

A plugin imports ``kvsim.policies`` (``from kvsim.policies import Policy, register``), which re-exports the API.
Whichever module of this package is imported first, the policies are loaded with it: the one import below runs
``kvsim.policies`` (by name, as the registry imports each policy module), whose last line loads them once its
re-exports are bound; when ``kvsim.policies`` is the one being imported, it is already under way and this does
nothing.
"""

import importlib

importlib.import_module("kvsim.policies")
'''

POLICIES_DOC = '''"""The eviction policies, one module each and nothing else: the registry (``kvsim.policykit.registry``)
imports every module here and each registers its class. This package re-exports the API a plugin is written
against (docs/architecture.md, "Adding a policy": ``from kvsim.policies import Policy, register``), from
``kvsim.policykit``, where the interface, the registry and the policies' other support live; importing it loads
every policy, the entry points and ``KVSIM_PLUGINS``."""

'''


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def refuse(why: str) -> None:
    print(f"move_policy_support: {why}; nothing changed", file=sys.stderr)
    raise SystemExit(2)


def check() -> None:
    old, new = ROOT / "kvsim" / OLD, ROOT / "kvsim" / NEW
    if any(new.rglob("*.py")):
        refuse(f"{new.relative_to(ROOT)} holds modules: the move is applied already")
    missing = [m for m in SUPPORT if not (old / f"{m}.py").is_file() and not (old / m / "__init__.py").is_file()]
    if missing:
        refuse(f"kvsim/{OLD}/ has no {', '.join(missing)}: not the tree this script was written for")
    if "_SUPPORT" not in (old / "registry.py").read_text(encoding="utf-8"):
        refuse(f"kvsim/{OLD}/registry.py has no _SUPPORT list: not the tree this script was written for")
    if git("status", "--porcelain", "--untracked-files=no").strip():
        refuse("the working tree has uncommitted changes: commit or stash them first")
    # every hand edit below finds its text once, before anything moves (the tree changed since: edit the script)
    for rel, edits in ((f"kvsim/{OLD}/registry.py", REGISTRY_EDITS), ("tests/test_layers.py", LAYER_EDITS),
                       ("kvsim/sim/summaries.py", DIGEST_EDITS), ("tests/test_summaries.py", DIGEST_TEST_EDITS),
                       ("docs/architecture.md", DOC_EDITS)):
        text = (ROOT / rel).read_text(encoding="utf-8")
        for old_text, _ in edits:
            if text.count(old_text) != 1:
                refuse(f"{rel}: this text, which the script replaces, is not there once:\n{old_text}")


def policy_modules() -> list[str]:
    """The modules of kvsim/policies/ that stay: the policies."""
    folder = ROOT / "kvsim" / OLD
    return sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__" and p.stem not in SUPPORT)


# --- the rewrites, each an exact regex ------------------------------------------------------------------

def split_package_import(text: str) -> str:
    """``from kvsim.policies import A, registry, B`` (or ``from ..policies import (...)``): the support modules
    named move to a ``from kvsim.policykit import ...`` line of their own, the re-exported API stays."""
    pattern = re.compile(r"^(?P<indent>[ \t]*)from (?P<base>kvsim\.|\.+)policies import "
                         r"(?P<names>\([^)]*\)|[^\n#]*?)(?P<comment>[ \t]*#[^\n]*)?$", re.M)

    def one(m: re.Match) -> str:
        raw = m["names"].strip()
        inner = raw[1:-1] if raw.startswith("(") else raw
        names = [n.strip() for n in inner.replace("\n", " ").split(",") if n.strip()]
        moved = [n for n in names if n.split(" as ")[0].strip() in SUPPORT]
        if not moved:
            return m[0]
        kept = [n for n in names if n not in moved]
        indent, base = m["indent"], m["base"]
        lines = []
        if kept:
            lines.append(f"{indent}from {base}{OLD} import {', '.join(kept)}{m['comment'] or ''}")
        lines.append(f"{indent}from {base}{NEW} import {', '.join(moved)}")
        return "\n".join(lines)

    return pattern.sub(one, text)


def rewrite_everywhere(text: str) -> str:
    # a dotted module path: kvsim.policies.registry, ..policies.layouts.held, "kvsim.policies.plan.Plan"
    text = re.sub(rf"(?<![\w])(kvsim\.|\.+){OLD}\.({_SUP})\b", rf"\1{NEW}.\2", text)
    # a file path: kvsim/policies/base.py, policies/layouts/, `policies/plan.py`
    text = re.sub(rf"(?<![\w.]){OLD}/({_SUP})(?=\.py\b|/)", rf"{NEW}/\1", text)
    return split_package_import(text)


def rewrite_policy_module(text: str, depth: int) -> str:
    """A module left in kvsim/policies/ (``depth`` 1) importing the support relatively: ``from .slot_hooks``
    becomes ``from ..policykit.slot_hooks``; ``from . import registry`` a ``from ..policykit import`` line."""
    dots = "." * depth
    text = re.sub(rf"(^|\n)([ \t]*)from \.({_SUP})\b", rf"\1\2from {dots}.{NEW}.\3", text)
    return re.sub(rf"(^|\n)([ \t]*)from \. import ((?:{_SUP})(?:, *(?:{_SUP}))*)[ \t]*(?=\n)",
                  rf"\1\2from {dots}.{NEW} import \3", text)


def rewrite_kit_module(text: str, depth: int, policies: list[str]) -> str:
    """A moved module importing a policy relatively (``from .optimal`` in optimal_blocks, ``from ..optimal`` in
    layouts/): the policy is now in the sibling package."""
    names = "|".join(policies)
    up = "." * depth
    return re.sub(rf"(^|\n)([ \t]*)from {re.escape(up)}({names})\b", rf"\1\2from {up}.{OLD}.\3", text)


# --- the registry: every module of kvsim/policies/ is a policy --------------------------------------------

REGISTRY_EDITS = (
    ('#: the modules of this package that hold no policy: the interface, the registry and their helpers\n'
     '_SUPPORT = frozenset({"base", "registry", "spec", "rope", "upper_bound", "optimal_blocks", "plan", "layouts"})\n',
     '#: the package whose every module is a policy (its support is this package, kvsim.policykit)\n'
     'POLICY_PACKAGE = "kvsim.policies"\n'),
    ('    """Register every policy, once per process: each module of this package (none is listed anywhere: a\n'
     '    module saved here is found),',
     '    """Register every policy, once per process: each module of ``kvsim.policies`` (none is listed anywhere: a\n'
     '    module saved there is found),'),
    ('    package = Path(__file__).parent\n'
     '    for info in sorted(pkgutil.iter_modules([str(package)]), key=lambda m: m.name):\n'
     '        if info.name.startswith("_") or info.name in _SUPPORT:\n'
     '            continue\n'
     '        _load(f"kvsim/policies/{info.name}.py", lambda n=info.name: importlib.import_module(f"{__package__}.{n}"))\n',
     '    package = Path(__file__).parent.parent / POLICY_PACKAGE.rpartition(".")[2]\n'
     '    for info in sorted(pkgutil.iter_modules([str(package)]), key=lambda m: m.name):\n'
     '        if info.name.startswith("_"):\n'
     '            continue\n'
     '        _load(f"kvsim/policies/{info.name}.py", lambda n=info.name: importlib.import_module(f"{POLICY_PACKAGE}.{n}"))\n'),
)


def edit(path: Path, edits) -> None:
    text = path.read_text(encoding="utf-8")
    for old, new in edits:
        if text.count(old) != 1:
            refuse(f"{path.relative_to(ROOT)}: the text to replace is not there once:\n{old}")
        text = text.replace(old, new)
    path.write_text(text, encoding="utf-8")


# --- the layers: the kit stands on the policies' floor ----------------------------------------------------

LAYER_EDITS = (
    ('``kvsim.allocation`` is one room over four floors: each of its modules counts as the layer it stands on.\n',
     '``kvsim.allocation`` is one room over four floors: each of its modules counts as the layer it stands on.\n'
     '``kvsim.policykit`` (the policies\' interface, registry, plan, hooks and layouts) shares the policies\' floor:\n'
     'the two import each other as one layer.\n'),
    ('    if module.startswith("kvsim.allocation"):\n',
     '    if module.startswith(KIT):\n'
     '        return "policies"  # the policies\' support, on their floor\n'
     '    if module.startswith("kvsim.allocation"):\n'),
    ('#: kvsim/allocation/ holds allocation whole',
     '#: kvsim/policykit/ holds what the policies are built with and run by (issue 55), on their floor\n'
     'KIT = "kvsim.policykit"\n'
     '#: kvsim/allocation/ holds allocation whole'),
)

#: the code a replay's cached summary is keyed by: the policies' support is code a replay runs too
DIGEST_EDITS = (
    ('_CODE = ("sim", "policies", "data")\n', '_CODE = ("sim", "policies", "policykit", "data")\n'),
)

DIGEST_TEST_EDITS = (
    ('    assert files == {"sim", "policies", "data"}\n', '    assert files == {"sim", "policies", "policykit", "data"}\n'),
)

DOC_EDITS = (
    ('   policies      |  kvsim/policies/  base (Policy, Param, ParamError,    |\n'
     '                 |  Display, EngineBinding), spec (PolicySpec), registry |\n'
     '                 |  (register), one file per policy: its reference code, |\n'
     '                 |  parameters, display, engine binding and inputs;      |\n'
     '                 |  slot_hooks (SlotHooks: what a fast path declares     |\n'
     '                 |  beside its policy, as every built-in\'s hooks are)    |\n',
     '   policies      |  kvsim/policies/  one file per policy, nothing else:  |\n'
     '                 |  its reference code, parameters, display, engine      |\n'
     '                 |  binding, capabilities and inputs (the registry finds |\n'
     '                 |  every module there; learned_weights.json beside      |\n'
     '                 |  learned.py); its support beside it, kvsim/policykit/:|\n'
     '                 |  base (Policy, Param, ParamError, Display,            |\n'
     '                 |  EngineBinding, Capabilities), registry (register),   |\n'
     '                 |  spec (PolicySpec), plan (Plan), slot_hooks and       |\n'
     '                 |  tensor_hooks (what a fast path and a tensor step     |\n'
     '                 |  declare), layouts (the serving layouts), rope,       |\n'
     '                 |  upper_bound and optimal_blocks (the bounds)          |\n'),
    ('| policies | `kvsim/policies/` | data (the registry hands offline references their trace) |\n',
     '| policies | `kvsim/policies/` (the policies), `kvsim/policykit/` (their interface, registry, plan, hooks and '
     'layouts) | data (the registry hands offline references their trace); the two are one layer |\n'),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="say what would move and change, touch nothing")
    args = parser.parse_args(argv)
    check()
    policies = policy_modules()
    kvsim = ROOT / "kvsim"
    moves = [(kvsim / OLD / (m if (kvsim / OLD / m).is_dir() else f"{m}.py"),
              kvsim / NEW / (m if (kvsim / OLD / m).is_dir() else f"{m}.py")) for m in SUPPORT]
    for src, dst in moves:
        print(f"move {src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}")
    if args.dry_run:
        return 0
    (kvsim / NEW).mkdir(exist_ok=True)  # a checkout that was reset may keep its __pycache__ here
    for src, dst in moves:
        git("mv", str(src.relative_to(ROOT)), str(dst.relative_to(ROOT)))
    (kvsim / NEW / "__init__.py").write_text(KIT_INIT, encoding="utf-8")
    git("add", f"kvsim/{NEW}/__init__.py")

    tracked = [ROOT / p for p in git("ls-files", "--", *SCOPE).splitlines()]
    changed = []
    for path in tracked:
        if path.suffix not in SUFFIXES or not path.is_file() or path.resolve() == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8")
        new = text
        rel = path.relative_to(ROOT)
        if path.suffix == ".py" and rel.parts[:2] == ("kvsim", OLD):
            new = rewrite_policy_module(new, len(rel.parts) - 2)
        if path.suffix == ".py" and rel.parts[:2] == ("kvsim", NEW):
            new = rewrite_kit_module(new, len(rel.parts) - 2, policies)
        new = rewrite_everywhere(new)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(str(rel))
    edit(kvsim / NEW / "registry.py", REGISTRY_EDITS)
    init = kvsim / OLD / "__init__.py"
    if not init.read_text(encoding="utf-8").startswith('"""'):
        init.write_text(POLICIES_DOC + init.read_text(encoding="utf-8"), encoding="utf-8")
    # the rewritten imports sorted as the house's ruff (isort rules) wants them
    py = sorted({c for c in changed if c.endswith(".py")} | {f"kvsim/{OLD}/__init__.py"})
    fixed = subprocess.run([sys.executable, "-m", "ruff", "check", "--fix", "--select", "I", "--quiet", *py], cwd=ROOT,
                           capture_output=True, text=True)
    if fixed.returncode != 0:
        print(f"ruff could not sort every rewritten import (run ruff check):\n{fixed.stdout}{fixed.stderr}", file=sys.stderr)
    edit(ROOT / "tests" / "test_layers.py", LAYER_EDITS)
    edit(kvsim / "sim" / "summaries.py", DIGEST_EDITS)
    edit(ROOT / "tests" / "test_summaries.py", DIGEST_TEST_EDITS)
    edit(ROOT / "docs" / "architecture.md", DOC_EDITS)
    for rel in sorted(set(changed) | {f"kvsim/{NEW}/registry.py", "tests/test_layers.py",
                                           "kvsim/sim/summaries.py", "tests/test_summaries.py", "docs/architecture.md"}):
        print(f"rewrote {rel}")
    left = subprocess.run(["git", "grep", "-n", "-E", rf"(kvsim\.|\.\.?){OLD}\.({_SUP})\b|{OLD}/({_SUP})(\.py|/)",
                           "--", *SCOPE, ":!tools/move_policy_support.py"], cwd=ROOT, capture_output=True, text=True).stdout
    if left:
        print(f"still naming the old paths (check by hand):\n{left}", file=sys.stderr)
        return 1
    print(f"moved {len(moves)} modules to kvsim/{NEW}/; kvsim/{OLD}/ holds {len(policies)} policies: "
          f"{', '.join(policies)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

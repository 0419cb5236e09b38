"""The layers of docs/architecture.md, held: no module of kvsim imports a layer above its own, and
``kvsim.bench`` is imported by the CLI's bench command alone.

The order is data < policies < sim < hf < analysis = models < views < app = cli (kvsim.hf, the evicting
transformers cache, sits under models, whose closed loop decodes through it). Modules of one layer import
each other freely; two packages on one level (analysis and models, app and cli) import neither.
``kvsim.progress``, ``kvsim.jit`` and ``kvsim.cluster`` are the foundations every layer may use; ``kvsim`` itself (the
public API of ``kvsim/__init__.py``) re-exports up to analysis, so only views and above import it.
``kvsim.bench`` stands beside: it measures everything below the entry points, and nothing but
``kvsim.cli.bench_command`` loads it; its ``scripts/``, run by hand, may time any layer and nothing
imports them. The thin ``app.py`` at the root is the app's layer too.
``kvsim.allocation`` is one room over four floors: each of its modules counts as the layer it stands on.
``kvsim.policykit`` (the policies' interface, registry, plan, hooks and layouts) shares the policies' floor:
the two import each other as one layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_package import PACKAGE, ROOT, import_statements, module_name

RANK = {"data": 1, "policies": 2, "sim": 3, "hf": 3.5, "analysis": 4, "models": 4, "views": 5, "app": 6, "cli": 6}
FOUNDATIONS = {"kvsim.progress", "kvsim.jit", "kvsim.cluster", "kvsim.serve"}
FACADE = "kvsim"
FACADE_RANK = RANK["analysis"]
BENCH_RANK = RANK["views"]  # what kvsim.bench may import: everything below the entry points
BENCH_IMPORTER = "kvsim.cli.bench_command"
#: the scripts run by hand from a checkout (kvsim/bench/scripts/): they may time anything, nothing imports them
SCRIPTS = "kvsim.bench.scripts"
#: kvsim/policykit/ holds what the policies are built with and run by (issue 55), on their floor
KIT = "kvsim.policykit"
#: kvsim/allocation/ holds allocation whole (issue 55), and each of its modules stands on the floor of what it
#: imports: the split's arithmetic under the deployed cache and a plan file, the truth beside the models
ROOMS = {"kvsim.allocation.split": "policies", "kvsim.allocation.deployed": "hf", "kvsim.allocation.truth": "models",
         "kvsim.allocation": "analysis", "kvsim.allocation.allocators": "analysis", "kvsim.allocation.search": "analysis",
         "kvsim.allocation.tune": "analysis"}


def part(module: str) -> str:
    """The layer a module belongs to: its folder under kvsim/, or foundation, facade, bench."""
    if module in FOUNDATIONS:
        return "foundation"
    if module == FACADE:
        return "facade"
    if module in ("kvsim.__main__", "app"):
        return "cli" if module == "kvsim.__main__" else "app"
    if module.startswith(KIT):
        return "policies"  # the policies' support, on their floor
    if module.startswith("kvsim.allocation"):
        return ROOMS.get(module, "allocation")  # a new module of the room named here first
    return module.split(".")[1]


def rank(module: str) -> int:
    return {"foundation": 0, "facade": FACADE_RANK, "bench": BENCH_RANK, **RANK}[part(module)]


def violation(importer: str, target: str) -> str | None:
    """Why ``importer`` may not import ``target``, or None when it may."""
    mine, theirs = part(importer), part(target)
    if target.startswith(SCRIPTS):
        return None if importer.startswith(SCRIPTS) else "nothing in the package imports a bench script"
    if importer.startswith(SCRIPTS):
        return None  # a study run by hand times any layer, the app's included
    if theirs == "foundation" or mine == theirs:
        return None
    if theirs == "bench":
        return None if importer == BENCH_IMPORTER else f"only {BENCH_IMPORTER} imports kvsim.bench"
    if mine == "foundation":
        return "a foundation imports nothing of kvsim"
    if theirs == "facade":
        return None if rank(importer) > FACADE_RANK else "the public API (import kvsim) is for views and above"
    if rank(target) > rank(importer):
        return f"{theirs} is above {mine}"
    if rank(target) == rank(importer) and "facade" != mine != "bench":
        return f"{theirs} and {mine} are on one level"
    return None


def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    if (ROOT / "app.py").is_file():
        found["app"] = ROOT / "app.py"
    return found


def targets(path: Path, known: set[str]):
    """``(line, module)`` for every kvsim module ``path`` loads: ``from ..sim import engine`` loads
    kvsim.sim.engine, ``from ..policies import ParamError`` loads kvsim.policies."""
    for line, target, names in import_statements(path):
        subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
        if len(subs) < len(names) or not names:
            yield line, target
        for sub in subs:
            yield line, sub


def test_no_module_imports_a_higher_layer_and_only_the_bench_command_imports_bench():
    found = modules()
    known = set(found)
    bad = [f"{path.relative_to(ROOT)}:{line} imports {target}: {why}"
           for importer, path in sorted(found.items())
           for line, target in targets(path, known)
           if target in known and (why := violation(importer, target))]
    assert bad == [], "\n".join(bad)


def test_every_folder_of_kvsim_has_its_place_in_the_order():
    folders = {part(m) for m in modules()} - {"foundation", "facade", "bench"}
    assert folders <= set(RANK), folders - set(RANK)


@pytest.mark.parametrize(
    ("importer", "target", "allowed"),
    [
        ("kvsim.policykit.registry", "kvsim.data.trace", True),
        ("kvsim.sim.engine", "kvsim.jit", True),
        ("kvsim.views.figures", "kvsim.analysis.tune", True),
        ("kvsim.cli.commands", "kvsim.views.figures", True),
        ("app", "kvsim", True),
        ("kvsim.bench.speed", "kvsim.sim.engine", True),
        ("kvsim.bench.browser", "kvsim.views.figures", True),
        ("kvsim.cli.bench_command", "kvsim.bench.speed", True),
        ("kvsim", "kvsim.analysis.metrics", True),
        ("kvsim.data.catalog", "kvsim.policykit.registry", False),
        ("kvsim.sim.engine", "kvsim.analysis.table", False),
        ("kvsim.analysis.claims", "kvsim.models.quality", False),
        ("kvsim.views.figures", "kvsim.app", False),
        ("kvsim.app.main", "kvsim.cli.commands", False),
        ("kvsim.cli.commands", "kvsim.bench.speed", False),
        ("app", "kvsim.bench.browser", False),
        ("kvsim.policies.h2o", "kvsim", False),
        ("kvsim.policykit.plan", "kvsim.allocation.split", True),
        ("kvsim.bench.scripts.app_tabs", "kvsim.app.main", True),
        ("kvsim.bench.speed", "kvsim.bench.scripts.checkout", False),
        ("kvsim.hf", "kvsim.allocation.deployed", True),
        ("kvsim.allocation.search", "kvsim.analysis.layer_search", True),
        ("kvsim.allocation.truth", "kvsim.models.decode", True),
        ("kvsim.allocation.allocators", "kvsim.allocation.truth", False),
        ("kvsim.allocation.split", "kvsim.sim.simulate", False),
        ("kvsim.hf", "kvsim.allocation.allocators", False),
        ("kvsim.progress", "kvsim.data.trace", False),
        ("kvsim.bench.speed", "kvsim.cli.commands", False),
        ("kvsim", "kvsim.views.figures", False),
    ],
)
def test_the_rule(importer, target, allowed):
    assert (violation(importer, target) is None) == allowed, violation(importer, target)

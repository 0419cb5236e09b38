"""The package's own shape: no import cycles, and nothing heavy or optional imported by the core."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvsim"
#: the benchmarks and studies run by hand from a checkout
SCRIPTS = PACKAGE / "bench" / "scripts"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_statements(path: Path):
    """``(line, module, names)`` for every import of a kvsim module in ``path``, at the top or inside a
    function, relative imports resolved: ``from ..sim import engine`` is ``("kvsim.sim", ["engine"])``."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("kvsim"):
                yield node.lineno, target, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kvsim"):
                    yield node.lineno, a.name, []


def imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, at the top or inside a function: a lazy import that
    closes a cycle still ties the modules into one knot."""
    out = set()
    for _, target, names in import_statements(path):
        out.add(target)
        out.update(f"{target}.{name}" for name in names)
    return out


def test_no_import_cycles():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: {t for t in imports(p) if t in modules and t != m} for m, p in modules.items()}
    # a submodule import starts at its package's __init__; that edge is not a cycle by itself
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(t):], t]))
            if t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_core_imports_without_optional_extras():
    """``import kvsim`` and the CLI module never pull in torch, transformers, dask or streamlit."""
    code = ("import sys, kvsim, kvsim.cli; "
            "heavy = [m for m in ('torch', 'transformers', 'dask', 'distributed', 'streamlit') if m in sys.modules]; "
            "print(','.join(heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_figures_imports_pandas_and_plotly_express_only_when_a_table_or_the_trace_matrix_is_built():
    """The kept view (the first page) draws with graph_objects alone; pandas and plotly.express
    (~0.3-0.4 s of imports) load inside the few builders that use them."""
    code = ("import sys, kvsim.views.figures; "
            "print(','.join(m for m in ('pandas', 'plotly.express') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def pins(requirements: Path) -> list[str]:
    """A requirements file's ``name==version`` lines, comments and ``-r`` includes left out."""
    lines = (re.sub(r"#.*", "", line).strip() for line in requirements.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-r")]


def test_pyproject_declares_the_requirements_files_pins():
    """``pip install .[record,dev]`` and the requirements files install the same versions."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == pins(ROOT / "requirements.txt")
    assert project["optional-dependencies"]["record"] == pins(ROOT / "requirements-record.txt")
    assert project["optional-dependencies"]["dev"] == pins(ROOT / "requirements-dev.txt")
    assert all("==" in pin for group in (project["dependencies"], *project["optional-dependencies"].values()) for pin in group)


def test_the_console_script_is_the_cli_and_every_folder_is_a_package():
    """setuptools' discovery (``kvsim*``) finds only folders with an ``__init__.py``: one without it would
    be left out of a built wheel while every test here still passed."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"] == {"kvsim": "kvsim.cli:main"}
    assert meta["build-system"]["build-backend"] == "setuptools.build_meta"
    assert meta["tool"]["setuptools"]["packages"]["find"]["include"] == ["kvsim*"]
    folders = {p.parent for p in PACKAGE.rglob("*.py")}
    assert [f for f in folders if not (f / "__init__.py").is_file()] == []


def readme_command(section: str) -> str:
    """The one command in the README's code block under ``## section``."""
    text = (ROOT / "README.md").read_text()
    block = text.split(f"## {section}\n", 1)[1].split("```", 2)[1]
    (command,) = [line for line in block.splitlines() if line.strip()]
    return command


def test_ci_runs_exactly_the_readmes_test_command_and_the_setup_installs_the_package():
    assert readme_command("Run all the tests") in (ROOT / ".ci" / "run").read_text().splitlines()
    assert "pip install -e ." in readme_command("Start the app (fresh machine, Python 3.11)")


def test_the_bench_scripts_take_kvsim_as_installed_and_refuse_another_checkouts():
    """``kvsim/bench/scripts/`` scripts import kvsim as installed (or as PYTHONPATH names it), never by putting the
    checkout on ``sys.path`` themselves (issue 32); a script run against another copy of kvsim says so
    in one line instead of measuring that copy's code."""
    for script in sorted(SCRIPTS.glob("*.py")):
        text = script.read_text(encoding="utf-8")
        for line in text.splitlines():
            if "sys.path" in line:  # only the suite's helpers, which are modules of tests/, may be put there
                assert '"tests"' in line and "this_checkout(__file__)" in line, f"{script.name}: {line.strip()}"
        imported = {alias.name for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom) and node.module}
        if any(name.split(".")[0] == "kvsim" for name in imported):  # itself, not in a child process's code
            assert "this_checkout(__file__)" in text, script.name
    other = ROOT.parent / "another-checkout" / "kvsim" / "bench" / "scripts" / "tool.py"
    code = f"from checkout import this_checkout; this_checkout({str(other)!r})"  # as a script in kvsim/bench/scripts/ imports it
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=SCRIPTS, timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("tool.py: error: kvsim is imported from ") and f"PYTHONPATH={other.parents[3]}" in done.stderr


def test_every_module_says_what_it_holds_in_at_most_600_lines_and_no_file_name_three_times():
    """A room one can read whole (docs/architecture.md): a module past 600 lines holds two things; a file
    name used three times in the package says nothing of what each holds (``__init__.py`` aside)."""
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert long == {}
    names: dict[str, int] = {}
    for p in PACKAGE.rglob("*.py"):
        names[p.name] = names.get(p.name, 0) + 1
    assert {n: c for n, c in names.items() if c >= 3 and n != "__init__.py"} == {}


#: functions still past LONGEST lines, each in a module other work was changing when the rule came in
#: (issue 55): named here so that clearing one is a deletion from this list, and a new one fails
LONG_FUNCTIONS: set[str] = set()
LONGEST = 80


def long_functions() -> dict[str, int]:
    """``path:name`` of every function or method of kvsim past ``LONGEST`` lines (its def to its last line,
    docstring included, decorators not), with its length."""
    out = {}
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := node.end_lineno - node.lineno + 1) > LONGEST:
                    out[f"{p.relative_to(ROOT)}:{node.name}"] = n
    return out


def test_no_function_is_over_80_lines_but_the_named_exceptions():
    """A function one can read whole: past 80 lines it does two things. The exceptions are named, and one
    that is split leaves the list (the list never outlives its reason)."""
    long = long_functions()
    assert set(long) - LONG_FUNCTIONS == set(), {k: v for k, v in long.items() if k not in LONG_FUNCTIONS}
    assert LONG_FUNCTIONS - set(long) == set(), "split already: take these off LONG_FUNCTIONS"


def test_the_function_length_check_counts_a_long_function(tmp_path, monkeypatch):
    """The check itself sees a function of 81 lines and passes one of 80."""
    package = tmp_path / "kvsim"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST - 2))
    (package / "m.py").write_text(f"def short():\n{body}\n    return 0\n\n\ndef long():\n{body}\n    y = 1\n    return y\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert long_functions() == {"kvsim/m.py:long": LONGEST + 1}

"""Bring your own policy (issue 42): a policy the team never saw, written in one file, is everywhere a
policy runs with nothing edited, whether it is loaded from outside the checkout by ``KVSIM_PLUGINS`` or
saved in ``kvsim/policies/``. The file here is a sliding window under another name (``newest``), so every
figure it gives is checked against sliding_window's; a broken plugin is one line and the rest still works."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvsim.policies
from kvsim.policies import POLICIES
from kvsim.policykit import registry

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (the record extra)")
ROOT = Path(__file__).resolve().parent.parent

#: docs/architecture.md's "Adding a policy": the whole policy as a researcher writes it (reference steps and
#: display, nothing else), and the commands the page prints; the tests run exactly what the page shows
SECTION = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("## Adding a policy\n")[1].split("\n## ")[0]
NEWEST = re.search(r"^```python\n(.*?)^```", SECTION, re.S | re.M).group(1)
COMMANDS = re.search(r"^```bash\n(.*?)^```", SECTION, re.S | re.M).group(1)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    """The policy in a file outside the checkout."""
    path = tmp_path_factory.mktemp("plugins") / "newest.py"
    path.write_text(textwrap.dedent(NEWEST))
    return path


def kvsim_cli(*args: str, plugins: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m kvsim ARGS`` in a fresh process (the registry loads once per process), ``KVSIM_PLUGINS``
    set to ``plugins`` (unset when None)."""
    env = {k: v for k, v in os.environ.items() if k != registry.PLUGIN_ENV}
    if plugins is not None:
        env[registry.PLUGIN_ENV] = plugins
    done = subprocess.run([sys.executable, "-m", "kvsim", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    from random_traces import random_trace

    from kvsim.data.trace import save_npz

    path = tmp_path_factory.mktemp("trace") / "small.npz"
    save_npz(random_trace(80, seed=3), path)
    return path


def _replayed_everywhere(small: Path, plugins: str | None) -> None:
    """replay, table and tune (its baselines) know ``newest`` and give sliding_window's figures."""
    replay = {p: json.loads(kvsim_cli("replay", "--trace", str(small), "--policy", p, "--budget", "12", "--json",
                                      plugins=plugins).stdout) for p in ("newest", "sliding_window")}
    assert replay["newest"]["retained_mass"] == replay["sliding_window"]["retained_mass"]
    assert replay["newest"]["top_k_recall"] == replay["sliding_window"]["top_k_recall"]
    table = json.loads(kvsim_cli("table", "--trace", str(small), "--budget", "12", "--json", plugins=plugins).stdout)
    rows = {r["policy"]: r for r in table["rows"]}
    assert rows["newest"]["retained_mass"] == rows["sliding_window"]["retained_mass"]
    tune = json.loads(kvsim_cli("tune", "--trace", str(small), "--budget", "12", "--serial", "--by", "retained_mass",
                                "--quiet", "--json", plugins=plugins).stdout)
    base = tune["model"]["baselines"]
    assert base["newest"] == base["sliding_window"]
    assert "newest" in _listed(plugins)  # `kvsim policies` lists what --policy takes (--help names it, NAME)


def _listed(plugins: str | None) -> list[str]:
    return [p["name"] for p in json.loads(kvsim_cli("policies", "--json", plugins=plugins).stdout)["policies"]]


def test_a_plugin_outside_the_checkout_is_in_replay_table_and_tune(plugin, small):
    _replayed_everywhere(small, str(plugin))
    if importlib.util.find_spec("distributed") is not None:  # Dask workers read KVSIM_PLUGINS where they start too
        tune = json.loads(kvsim_cli("tune", "--trace", str(small), "--budget", "12", "--workers", "2", "--by",
                                    "retained_mass", "--quiet", "--json", plugins=str(plugin)).stdout)
        assert tune["run"]["executor"] == "dask" and tune["model"]["baselines"]["newest"] == tune["model"]["baselines"]["sliding_window"]


def test_the_same_file_saved_in_kvsim_policies_is_found_with_nothing_edited(plugin, small):
    target = Path(kvsim.policies.__file__).parent / "newest.py"
    assert not target.exists()
    target.write_text(plugin.read_text())
    try:
        _replayed_everywhere(small, None)
    finally:
        target.unlink()
    assert "newest" not in _listed(None)  # gone with its file


def test_a_broken_plugin_is_one_line_and_the_rest_still_works(tmp_path, small):
    broken = tmp_path / "broken.py"
    broken.write_text("import numpy as np\nraise RuntimeError('half-written')\n")
    taken = tmp_path / "taken.py"
    taken.write_text(textwrap.dedent(NEWEST).replace('name = "newest"', 'name = "h2o"'))
    plugins = ",".join([str(broken), str(taken), str(tmp_path / "missing.py"), "no_such_module_kvsim"])
    done = kvsim_cli("replay", "--trace", str(small), "--policy", "h2o", "--budget", "12", "--recent-window", "4", "--json",
                     plugins=plugins)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 4, done.stderr
    assert f"KVSIM_PLUGINS {broken}: RuntimeError: half-written; skipped" in lines[0]
    assert f"KVSIM_PLUGINS {taken}: register: the name 'h2o' is taken by kvsim.policies.h2o.H2O" in lines[1]
    assert str(tmp_path / "missing.py") in lines[2] and "no such file" in lines[2]
    assert "no_such_module_kvsim" in lines[3] and "ModuleNotFoundError" in lines[3]
    assert json.loads(done.stdout)["policy"] == "h2o"  # the shipped h2o, not the impostor


def test_an_entry_point_is_loaded(tmp_path, plugin, small):
    """An installed distribution that declares ``[kvsim.policies]`` in its entry points: a dist-info on the path."""
    site = tmp_path / "site"
    (site / "newest_pkg").mkdir(parents=True)
    (site / "newest_pkg" / "__init__.py").write_text(plugin.read_text())
    info = site / "newest_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: newest-pkg\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvsim.policies]\nnewest = newest_pkg\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env.pop(registry.PLUGIN_ENV, None)
    done = subprocess.run([sys.executable, "-m", "kvsim", "replay", "--trace", str(small), "--policy", "newest",
                           "--budget", "12", "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads(done.stdout)["policy"] == "newest"


def test_the_pages_commands_run_as_printed(plugin, tmp_path):
    """The page's chain in a folder holding its ``newest.py``: the policy listed, replayed, in the table."""
    (tmp_path / "newest.py").write_text(plugin.read_text())
    env = {k: v for k, v in os.environ.items() if k != registry.PLUGIN_ENV}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(["bash", "-c", "set -e\n" + COMMANDS], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    listed, table = [w for w in lines if w[:1] == ["newest"]], {w[0]: w[1:] for w in lines if w}
    assert listed[0][:5] == ["newest", "online", "nothing", "-", "reference"]  # kvsim policies
    assert any(w[:2] == ["canonical", "newest"] for w in lines)  # the replay
    assert listed[1][1:] == table["sliding_window"]  # the table's row: sliding_window's figures


@pytest.fixture
def loaded(plugin):
    """The plugin loaded into this process, as ``KVSIM_PLUGINS`` would at start; taken out afterwards."""
    registry.load_plugin(str(plugin))
    yield POLICIES["newest"]
    POLICIES.pop("newest", None)
    sys.modules.pop("kvsim_plugin_newest", None)


def test_the_apps_lists_offer_it_and_it_says_a_plugin_that_failed(loaded, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from kvsim.app.allocation_tab import allocation_policies, frontier_policies

    assert "newest" in allocation_policies()
    assert "newest" in frontier_policies([{"policy": "newest"}]) and "newest" not in frontier_policies([])
    line = "kvsim: KVSIM_PLUGINS /x/broken.py: RuntimeError: half-written; skipped"
    monkeypatch.setattr(registry, "PROBLEMS", [line])
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180)
    at.run()
    assert [e.value for e in at.exception] == []
    box = next(w for w in at.sidebar.multiselect if w.label == "policies")
    assert "newest" in box.options
    assert [w.value for w in at.sidebar.warning] == [line.removeprefix("kvsim: ")]


@needs_torch
def test_the_deployed_cache_runs_it_as_it_runs_sliding_window(loaded):
    """``kvsim.hf.cache``: the same tokens and the same positions held as sliding_window's, never more than the budget."""
    from test_hf import _prompt, _tiny

    import kvsim.hf as hf

    model, ids = _tiny("llama"), _prompt()
    out = {}
    for name in ("newest", "sliding_window"):
        cache = hf.cache(model, name, 12)
        out[name] = (model.generate(ids, cache=cache, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0].tolist(),
                     [layer.held(0, 0).tolist() for layer in cache.layers], cache.peak_positions)
    assert out["newest"] == out["sliding_window"]
    assert out["newest"][2] == [12] * len(out["newest"][1])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    if not HAS_TORCH:
        pytest.skip("torch/transformers not installed (the record extra)")
    from tiny_models import char_gemma3

    return char_gemma3(tmp_path_factory.mktemp("model") / "tiny-gemma3")


@needs_torch
def test_needle_and_quality_run_it_from_the_plugin(plugin, folder, tmp_path):
    """The pass key and the truth on a tiny model: the plugin's figures are sliding_window's."""
    env = str(plugin)
    needle = json.loads(kvsim_cli("needle", "--model", str(folder), "--policies", "newest,sliding_window", "--budget", "24",
                                  "--lengths", "100", "--depths", "0.5", "--trials", "1", "--no-cache", "--quiet", "--json",
                                  plugins=env).stdout)
    same = ("text", "answer", "correct", "positions", "budgets", "key_left", "key_first_left")
    for cell in needle["cells"]:
        by = {r["policy"]: {k: r[k] for k in same} for r in cell["runs"]}
        assert by["newest"] == by["sliding_window"]  # the same tokens, the key's positions leaving at the same steps
    text = tmp_path / "text.txt"
    text.write_text("the cache keeps the newest tokens. " * 8)
    quality = json.loads(kvsim_cli("quality", str(text), "--model", str(folder), "--policies", "newest,sliding_window",
                                   "--budget", "24", "--steps", "60", "--mode", "open", "--no-cache", "--json",
                                   plugins=env).stdout)
    by = {r["policy"]: r for r in quality}
    assert by["newest"]["kl"] == by["sliding_window"]["kl"] > 0
    assert by["newest"]["retained_mass"] == by["sliding_window"]["retained_mass"]


def test_a_policy_without_a_kernel_is_said_to_replay_on_the_reference_path(loaded):
    """Where the speed matters, the step's note (shown on a terminal once a step passes two seconds)."""
    from kvsim.cli import report

    said = []
    report.prepare(["newest", "h2o"], lambda fraction, note="": said.append(note))
    assert said[0] == "newest has no kernel: the reference harness replays it (slower; the same figures)"

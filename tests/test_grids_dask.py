"""``kvsim quality --scheduler`` and ``kvsim proxies --scheduler`` (issue 54, item 4): the grids' cells on Dask
through the same keyed caches as a run here, on a tiny config-built Gemma 3 saved as a folder (random weights, a
character tokenizer, nothing downloaded). A Dask run gives the local run's document, its timings aside; a run
after an interruption computes only the cells the cache lacks; an unreachable scheduler is one line naming the
flag, before any model loads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvsim import cli

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = [pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)"),
              pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                                 reason="Dask is an optional extra (requirements-record.txt)")]

TEXT = "the grass is green. the sky is blue. the sun is yellow. here we go. there and back again. " * 3
#: what differs between two runs of the same grid, here or on Dask: the time each took and whether it was read
TIMINGS = ("seconds", "cached", "seconds_open", "seconds_closed", "cached_open", "cached_closed")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tiny_models import char_gemma3

    return char_gemma3(tmp_path_factory.mktemp("grids") / "tiny-gemma3")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("grids-text") / "sky.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two local worker processes, their own cache directory (what they keep: the full-cache passes they open)."""
    import distributed

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSIM_CACHE_DIR", str(tmp_path_factory.mktemp("workers-cache")))
        c = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
    with c:
        yield c


@pytest.fixture
def counted(monkeypatch):
    """How many cells each Dask grid sent (``Fanout.compute``'s calls), in order."""
    from kvsim.models.fanout import Fanout

    sent: list[int] = []
    compute = Fanout.compute

    def spy(self, session, calls):
        if calls:
            sent.append(len(calls))
        yield from compute(self, session, calls)

    monkeypatch.setattr(Fanout, "compute", spy)
    return sent


def _run(capsys, *argv) -> object:
    code = cli.main([*argv, "--quiet", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _strip(doc):
    """The document without what differs between runs of the same cells (``TIMINGS``), as canonical JSON."""
    def bare(x):
        if isinstance(x, dict):
            return {k: bare(v) for k, v in x.items() if k not in TIMINGS}
        if isinstance(x, list):
            return [bare(v) for v in x]
        return x
    return json.dumps(bare(doc), sort_keys=True)


def _quality(folder, text, *flags):
    return ["quality", str(text), "--model", str(folder), "--policies", "h2o,streaming_llm,sliding_window",
            "--budget", "12,20", "--steps", "64", "--recent-window", "4", "--sinks", "2", *flags]


def test_quality_on_dask_gives_the_local_grid(folder, text, cluster, tmp_path, monkeypatch, capsys, counted):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "here"))
    here = _run(capsys, *_quality(folder, text, "--mode", "both", "--batch", "2"))
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "dask"))
    spread = _run(capsys, *_quality(folder, text, "--mode", "both", "--batch", "2", "--scheduler", cluster.scheduler_address))
    assert len(here) == len(spread) == 12 and not any(r["cached"] for r in here + spread)
    # closed loops two a cell (3 cells), open loops one (6 cells): the same chunks as here
    assert counted == [3, 6]
    assert _strip(spread) == _strip(here)  # the same figures, bit for bit, in the same order
    # what Dask measured is in this process's cache: a second run reads every cell and sends none
    again = _run(capsys, *_quality(folder, text, "--mode", "both", "--batch", "2", "--scheduler", cluster.scheduler_address))
    assert all(r["cached"] for r in again) and counted == [3, 6] and _strip(again) == _strip(here)


def test_a_local_cluster_leaves_this_processs_thread_variables_alone(monkeypatch):
    """Dask's nanny sets OMP_NUM_THREADS=1 (and MKL's, OpenBLAS's) in the starting process to spawn its workers; left
    there, torch imported afterwards (quality opening its session after the cluster starts) ran one thread here."""
    import os

    from kvsim.cluster import dask_client

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    with dask_client("local", 1) as (client, _):
        assert "OMP_NUM_THREADS" not in os.environ and os.environ["MKL_NUM_THREADS"] == "2"
        assert client.run(lambda: __import__("os").environ.get("OMP_NUM_THREADS")) == {w: "1" for w in
                                                                                         client.scheduler_info()["workers"]}
    assert "OMP_NUM_THREADS" not in os.environ


def test_a_cell_computes_with_this_processs_torch_threads(folder, text, cluster, tmp_path, monkeypatch):
    """A Dask worker runs one torch thread of its own; a float32 product summed by two threads may round otherwise
    (Gemma-3-270M's KL did, in the fourth significant digit), so a cell runs with as many threads as the process
    that sent it."""
    import torch

    from kvsim.cluster import dask_client
    from kvsim.models import quality
    from kvsim.models.fanout import Fanout

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    session = quality.open_session(text, 32, str(folder), progress=None)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with dask_client(cluster.scheduler_address) as (client, address):
            cell = lambda session: __import__("torch").get_num_threads()  # noqa: E731 (sent by value)
            got = dict(Fanout(client, address).compute(session, [(cell, ()), (cell, ())]))
    finally:
        torch.set_num_threads(before)
    assert got == {0: 3, 1: 3}


def test_a_resumed_quality_grid_computes_only_the_missing_cells(folder, text, cluster, tmp_path, monkeypatch, capsys,
                                                               counted):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    here = _run(capsys, *_quality(folder, text, "--mode", "open", "--no-cache"))
    # an interrupted study: only h2o's cells were measured (here) before it stopped
    first = _run(capsys, "quality", str(text), "--model", str(folder), "--policies", "h2o", "--budget", "12,20",
                 "--steps", "64", "--recent-window", "4", "--mode", "open")
    assert len(first) == 2 and counted == []
    resumed = _run(capsys, *_quality(folder, text, "--mode", "open", "--scheduler", cluster.scheduler_address))
    assert counted == [4] and [r["cached"] for r in resumed] == [True, True, False, False, False, False]
    assert _strip(resumed) == _strip(here)
    # and the other way: what Dask measured, a run here reads, measuring nothing
    assert all(r["cached"] for r in _run(capsys, *_quality(folder, text, "--mode", "open")))


def test_an_unreachable_scheduler_is_one_line_before_any_model_loads(folder, text, capsys, monkeypatch):
    from kvsim.models import quality

    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(quality, "load", refuse)
    for argv in (_quality(folder, text, "--scheduler", "tcp://127.0.0.1:9"),
                 ["proxies", "--models", str(folder), "--texts", str(text), "--scheduler", "tcp://127.0.0.1:9"]):
        assert cli.main([*argv, "--quiet"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("kvsim: error: --scheduler: cannot reach the Dask scheduler at tcp://127.0.0.1:9")
        assert err.count("\n") == 1
    # what spreads is the grid: one --allocate split or one serving layout's measurement is refused, in one line
    for extra in (["--allocate", "uniform"], ["--block-size", "8"]):
        assert cli.main(["quality", str(text), "--model", str(folder), "--policy", "h2o", "--budget", "12", "--workers", "2",
                         *extra, "--quiet"]) == 2
        assert capsys.readouterr().err == ("kvsim: error: --workers spreads quality's grid of policies, budgets and modes; "
                                           "not --allocate nor a serving layout\n")


def _proxies(folder, text, *flags):
    return ["proxies", "--models", str(folder), "--texts", str(text), "--budgets", "12", "--steps", "48",
            "--windows", "3", "--sweeps", "h2o", "--fixed", "streaming_llm,sliding_window", "--closed",
            f"{text.name}:12", *flags]


def test_proxies_on_dask_gives_the_local_study_and_resumes(folder, text, cluster, tmp_path, monkeypatch, capsys, counted):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "here"))
    here = _run(capsys, *_proxies(folder, text, "--out", str(tmp_path / "here.json")))
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "dask"))
    spread = _run(capsys, *_proxies(folder, text, "--scheduler", cluster.scheduler_address, "--out",
                                    str(tmp_path / "dask.json")))
    assert len(here["rows"]) == len(spread["rows"]) == 5
    # the 5 configurations' proxies, their 5 open loops, the h2o sweep's 3 closed loops as one batch (proxies cached)
    assert counted == [5, 5, 1]
    assert _strip(spread) == _strip(here)
    assert _strip(json.loads((tmp_path / "dask.json").read_text())) == _strip(json.loads((tmp_path / "here.json").read_text()))
    # an interrupted study: the h2o sweep's open-loop results never reached the cache; the resumed run measures only those
    files = [f for f in (tmp_path / "dask" / "quality").glob("*.json") if not f.name.startswith(("proxies-", "short-"))]
    opened = [f for f in files if json.loads(f.read_text())["key"]["mode"] == "open"
              and "recent_window" in json.loads(f.read_text())["key"]["params"]]
    assert len(opened) == 3
    for f in opened:
        f.unlink()
    del counted[:]
    resumed = _run(capsys, *_proxies(folder, text, "--scheduler", cluster.scheduler_address))
    assert counted == [3]  # the proxies and closed loops all cached; the three open loops sent again
    assert _strip(resumed) == _strip(here)


@pytest.fixture
def serving_study(folder, text, monkeypatch):
    """kvsim/bench/scripts/serving_study.py with its grid made small: the tiny model, one text, one budget, two policies under three
    layouts open (the optimum left out: its solve alone took 17 s here), h2o closed under two."""
    import importlib

    from kvsim.policykit.layouts import Layout

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "kvsim" / "bench" / "scripts"))
    study = importlib.import_module("serving_study")
    for name, value in {"MODELS": (str(folder),), "TEXTS": (str(text),), "BUDGETS": (40,), "STEPS": 64,
                        "POLICIES": ("h2o", "streaming_llm"),
                        "LAYOUTS": (("none", Layout()), ("blocks of 8", Layout(8)), ("shared", Layout(1, True))),
                        "OPTIMUM": (), "PASSKEY_DEPTHS": {str(folder): (0.5,)}, "PASSKEY_LAYOUTS": {str(folder): ("none",)},
                        "CLOSED": ((str(folder), str(text), 40, ("h2o",), ("none", "blocks of 8")),)}.items():
        monkeypatch.setattr(study, name, value)
    return study


def test_the_serving_study_on_dask_gives_the_local_rows_and_resumes(serving_study, folder, cluster, tmp_path, monkeypatch,
                                                                    counted):
    def measure(out, *flags):
        assert serving_study.main(["measure", "--out", str(tmp_path / out), "--models", str(folder), *flags]) == 0
        return json.loads((tmp_path / out).read_text())

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "here"))
    here = measure("here.json", "--parts", "open,closed")
    assert len(here["rows"]) == 8 and all(r["why"] is None for r in here["rows"])
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "dask"))
    # an interrupted study: its open part measured, here; the run on Dask measures only the two closed cells
    measure("open.json", "--parts", "open")
    assert counted == []
    spread = measure("dask.json", "--parts", "open,closed", "--scheduler", cluster.scheduler_address)
    assert counted == [2] and _strip(spread) == _strip(here)
    # on Dask from nothing: every cell sent, the same rows
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "dask-only"))
    assert _strip(measure("dask-only.json", "--parts", "open,closed", "--scheduler", cluster.scheduler_address)) == \
        _strip(here) and counted == [2, 8]


def test_the_serving_study_refuses_an_unreachable_scheduler_in_one_line(serving_study, folder, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        serving_study.main(["measure", "--out", str(tmp_path / "x.json"), "--models", str(folder), "--parts", "open",
                            "--scheduler", "tcp://127.0.0.1:9"])
    assert str(e.value).startswith("serving_study.py: --scheduler: cannot reach the Dask scheduler at tcp://127.0.0.1:9")
    assert "\n" not in str(e.value)

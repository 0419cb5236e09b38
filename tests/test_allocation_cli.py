"""``replay``, ``sweep`` and ``table`` with ``--allocate``: the JSON's allocation rows and masses, and every
refusal one line (``--allocate: BUNDLE_OR_FILE: problem``, exit 1) before a trace is read."""

from __future__ import annotations

import json

import numpy as np
import pytest
from random_traces import random_trace

from kvsim import cli
from kvsim.allocation import allocators as al
from kvsim.data.bundle import write_manifest
from kvsim.data.trace import save_npz
from kvsim.policies import POLICIES

STEPS = 120


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A recording's shape: 3 layers x 3 KV heads of random traces, written as a bundle."""
    folder = tmp_path_factory.mktemp("alloc") / "rand3x3"
    folder.mkdir()
    rng = np.random.default_rng(11)
    entries = []
    for layer in range(3):
        for head in range(3):
            name = f"rand-L{layer:02d}H{head}.npz"
            save_npz(random_trace(STEPS, rng, name=name), folder / name)
            entries.append({"file": name, "layer": layer, "head": head, "query_heads": [3 * head, 3 * head + 1]})
    write_manifest(folder, {"name": "rand3x3", "model": "random", "text": {"source": "random", "licence": "none"},
                            "steps": STEPS, "traces": entries})
    return folder


def kvsim_json(capsys, *argv):
    code = cli.main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_replay_allocate_gives_the_split_and_the_masses(bundle, capsys):
    docs = {name: kvsim_json(capsys, "replay", "--trace", str(bundle), "--policy", "h2o", "--budget", "24",
                             "--recent-window", "4", "--allocate", name) for name in al.ALLOCATORS}
    for name, doc in docs.items():
        assert doc["allocate"] == name and doc["positions"] == 24 * 9
        assert sum(r["budget"] for r in doc["allocation"]) == 24 * 9
        assert {(r["layer"], r["kv_head"]) for r in doc["allocation"]} == {(x, h) for x in range(3) for h in range(3)}
        layers = [x["retained_mass"] for x in doc["layers"]]
        assert doc["retained_mass"] == pytest.approx(np.mean(layers), abs=9 * np.finfo(float).eps)
    assert docs["adakv"]["pooled"] is True
    assert sum(r["streaming"] for r in docs["duo"]["allocation"]) == 4
    for name in al.STATIC:
        assert docs["optimal"]["retained_mass"] >= docs[name]["retained_mass"] - 18 * np.finfo(float).eps


def test_an_allocation_file_replays_the_same_split(bundle, capsys, tmp_path):
    first = kvsim_json(capsys, "replay", "--trace", str(bundle), "--policy", "h2o", "--budget", "24", "--allocate",
                       "pyramidkv", "--recent-window", "4")
    path = tmp_path / "split.json"
    path.write_text(json.dumps(first))
    again = kvsim_json(capsys, "replay", "--trace", str(bundle), "--policy", "h2o", "--recent-window", "4",
                       "--allocate", str(path))
    assert again["allocation"] == first["allocation"] and again["retained_mass"] == first["retained_mass"]


def test_replay_runs_a_split_from_its_plan_as_from_its_flags(bundle, capsys, tmp_path):
    """The plan replay --allocate saves replays the same split; a plan holding the rows is named by its file, as
    --allocate FILE is."""
    saved = tmp_path / "by-name.json"
    flags = ["--policy", "h2o", "--budget", "24", "--recent-window", "4", "--allocate", "pyramidkv"]
    first = kvsim_json(capsys, "replay", "--trace", str(bundle), *flags, "--save-plan", str(saved))
    assert kvsim_json(capsys, "replay", "--trace", str(bundle), "--plan", str(saved)) == first
    rows = tmp_path / "rows.json"
    doc = json.loads(saved.read_text())
    rows.write_text(json.dumps({**doc, "allocate": None, "allocation": first["allocation"]}))
    by_rows = kvsim_json(capsys, "replay", "--trace", str(bundle), "--plan", str(rows))
    by_file = kvsim_json(capsys, "replay", "--trace", str(bundle), "--policy", "h2o", "--recent-window", "4",
                         "--allocate", str(rows))
    assert by_rows == by_file and by_rows["allocate"] == "rows.json"
    assert by_rows["retained_mass"] == first["retained_mass"]


def test_sweep_allocate_over_the_budget(bundle, capsys):
    rows = kvsim_json(capsys, "sweep", "--trace", str(bundle), "--policy", "tova", "--budget", "8:40:16",
                      "--allocate", "optimal")
    assert [r["budget"] for r in rows] == [8, 24, 40]
    assert [r["positions"] for r in rows] == [72, 216, 360]
    assert sum(r["best"] for r in rows) == 1


def test_table_allocate_says_which_policies_it_cannot_allocate(bundle, capsys):
    doc = kvsim_json(capsys, "table", "--trace", str(bundle), "--budget", "40", "--allocate", "adakv")
    by = {r["policy"]: r for r in doc["rows"]}
    assert by["h2o"]["retained_mass"] is not None
    assert "tova declares no score to pool a layer's heads by (pools_heads)" in by["tova"]["refused"]


REFUSED = [
    (["--trace", "gemma3-270m-heapq", "--allocate", "adakv", "--budget", "64"],
     "--allocate: gemma3-270m-heapq: adakv pools a layer's KV heads, and with one KV head per layer the pool is that "
     "head: adakv is uniform within a layer on this model; use uniform, pyramidkv, cake or optimal"),
    (["--trace", "gemma3-270m-heapq", "--allocate", "duo", "--budget", "64"],
     "--allocate: gemma3-270m-heapq: duo splits a layer's KV heads into retrieval and streaming heads, and each layer "
     "has one KV head on this model; use uniform, pyramidkv, cake or optimal"),
    (["--trace", "{b}", "--allocate", "optimal", "--budget", "16"],
     "--allocate: rand3x3: budget 16 per head is below h2o's minimum of 33 positions per head (recent_window 32 + 1)"),
    (["--trace", "{b}", "--allocate", "uniform", "--budget", "121"],
     "--allocate: rand3x3: budget 121 per head is above the trace's length (120 steps)"),
    (["--trace", "canonical", "--allocate", "uniform"],
     "--trace: canonical: --allocate splits a bundle's memory over its layers and KV heads; give a bundle (a "
     "recording of a whole model: gemma3-270m-heapq), not one trace"),
    (["--trace", "{b}", "--allocate", "{d}/nope.json"],
     "--allocate: {d}/nope.json: no such file (and not an allocator: uniform, pyramidkv, cake, adakv, duo, optimal)"),
    (["--trace", "{b}", "--allocate", "{d}/gemma.json"],
     "--allocate: {d}/gemma.json: an allocation for another model's shape (18 rows; the bundle has 3 layers x 3 KV "
     "heads): it has layer 3 KV head 0, layer 4 KV head 0, layer 5 KV head 0 ..., which the bundle lacks"),
    (["--trace", "{b}", "--allocate", "{d}/long.json"],
     "--allocate: {d}/long.json: layer 2 KV head 2: budget 500 is above the trace's length (120 steps)"),
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[m.split(": ")[-1][:40] for _, m in REFUSED])
def test_each_refusal_is_one_line_before_any_trace_is_read(argv, message, bundle, tmp_path, capsys, monkeypatch):
    (tmp_path / "gemma.json").write_text(json.dumps({"allocation": [
        {"layer": x, "kv_head": 0, "budget": 64} for x in range(18)]}))
    (tmp_path / "long.json").write_text(json.dumps([
        {"layer": x, "kv_head": h, "budget": 500 if (x, h) == (2, 2) else 40} for x in range(3) for h in range(3)]))

    def no_reading(*a, **k):
        raise AssertionError("a trace was read before the refusal")

    monkeypatch.setattr(al, "load_heads", no_reading)
    code = cli.main(["replay", "--policy", "h2o", *(a.format(b=bundle, d=tmp_path) for a in argv)])
    out, err = capsys.readouterr()
    assert (code, out, err) == (1, "", f"kvsim: error: {message.format(d=tmp_path)}\n")


QUALITY_REFUSED = [
    (["--policy", "h2o", "--allocate", "optimal", "--mode", "both"],
     "--allocate measures one loop: give --mode closed (the deployed cache holding each head's budget) or --mode "
     "open (each head's schedule masks one teacher-forced pass)"),
    (["--policy", "h2o", "--allocate", "nope", "--mode", "open"],
     "--allocate: quality measures a split (uniform, pyramidkv, cake, optimal, duo) or adakv's pool; 'nope' is not one"),
    (["--policy", "h2o", "--allocate", "adakv", "--mode", "open"],
     "--allocate adakv: a pool, not a split, has no open-loop schedule here; give --mode closed (the deployed pool "
     "decodes the text)"),
    (["--policies", "h2o,nope", "--allocate", "optimal", "--mode", "open"],
     "--policy: unknown policy 'nope'; known: " + ", ".join(POLICIES)),
    (["--policy", "h2o", "--allocate", "uniform,duo", "--mode", "open", "--budget", "64,128"],
     "--allocate: quality measures a static split (uniform, pyramidkv, cake, optimal); 'duo' is not one (adakv's "
     "pool and duo's streaming heads are measured one split at a time: --policy h2o --budget B --allocate adakv|duo)"),
    (["--policy", "h2o", "--allocate", "uniform", "--mode", "open", "--budget", "64,x"],
     "--budget: expected a positive integer, got 'x'"),
]


QUALITY_INPUT_REFUSED = [
    (["--policy", "tova", "--allocate", "adakv", "--budget", "64", "--model", "smollm2-135m"],
     "--allocate: tova declares no score to pool a layer's heads by (pools_heads): adakv cannot run it (use --policy h2o)"),
    (["--policy", "h2o", "--allocate", "adakv", "--budget", "64"],
     "--allocate: adakv pools a layer's KV heads, and with one KV head per layer the pool is that head: adakv is "
     "uniform within a layer on this model; use uniform, pyramidkv, cake or optimal (Gemma-3-270M: 18 layers x 1 KV head)"),
    (["--policy", "h2o", "--allocate", "duo", "--budget", "64", "--mode", "open"],
     "--allocate: duo splits a layer's KV heads into retrieval and streaming heads, and each layer has one KV head on "
     "this model; use uniform, pyramidkv, cake or optimal (Gemma-3-270M: 18 layers x 1 KV head)"),
]


def _refused_before_a_model_loads(argv, message, status, capsys, monkeypatch) -> None:
    from kvsim.models import quality

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(quality, "open_session", no_model)
    code = cli.main(["quality", "heapq", *argv])
    out, err = capsys.readouterr()
    assert (code, out, err) == (status, "", f"kvsim: error: {message}\n")


@pytest.mark.parametrize("argv, message", QUALITY_INPUT_REFUSED, ids=[m[:40] for _, m in QUALITY_INPUT_REFUSED])
def test_quality_allocate_adakv_and_duo_are_refused_before_a_model_loads(argv, message, capsys, monkeypatch):
    _refused_before_a_model_loads(argv, message, 1, capsys, monkeypatch)


@pytest.mark.parametrize("argv, message", QUALITY_REFUSED, ids=[m[:40] for _, m in QUALITY_REFUSED])
def test_quality_allocate_refusals_come_before_a_model_loads(argv, message, capsys, monkeypatch):
    _refused_before_a_model_loads(argv, message, 2, capsys, monkeypatch)


def test_a_comparison_is_kept_on_disk_and_read_back_to_the_bit_without_loading_the_traces(bundle, tmp_path, monkeypatch):
    """The app's Allocation view measures a comparison once per install (``compare_bundle``), not once per
    server start: the second call reads the same rows, every float equal, and loads no trace."""
    from kvsim.allocation import allocators as al
    from kvsim.data.bundle import load_bundle
    from kvsim.policies import PolicySpec

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    b, spec = load_bundle(bundle), PolicySpec.of("h2o", 24, recent_window=4)
    first = al.compare_bundle(b, spec)
    assert al.compare_path(b, spec).is_file()
    monkeypatch.setattr(al, "load_heads", lambda bundle: pytest.fail("a cached comparison loaded the traces"))
    again = al.compare_bundle(b, spec)

    def figures(rows):
        return [(r["allocator"], r["retained_mass"], r["gap_closed"], r["measured"].allocation.rows(),
                 r["measured"].head_mass, r["measured"].allocation.detail) for r in rows]

    assert figures(again) == figures(first) and {r["allocator"] for r in first} >= {"uniform", "optimal"}
    assert al.compare_path(b, PolicySpec.of("h2o", 25, recent_window=4)) != al.compare_path(b, spec)  # keyed by the spec
    al.compare_path(b, spec).write_text("{not json")  # a damaged entry is measured again, not trusted
    monkeypatch.undo()
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path))
    assert figures(al.compare_bundle(b, spec)) == figures(first)

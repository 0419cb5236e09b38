"""The recorder: its row arithmetic (always), that the core never imports torch (always), and a real
run of Gemma-3-270M through ``python -m kvsim record`` on a few dozen tokens (needs the optional
extra, ``pip install -r requirements-record.txt``; skipped, with that reason, only when torch is not
importable)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tolerance import rounding

import kvsim.models.loading as loading
from kvsim import cli
from kvsim.data.trace import load_npz, unpack_lower
from kvsim.models.errors import RecordError
from kvsim.models.record import RecordConfig
from kvsim.models.recorder import kv_head_rows

# written for this test (no licence question): about 60 tokens of prose
TEXT = (
    "A cache that holds every token grows without bound, so a serving stack keeps only some of them. "
    "Which ones? The first few tokens soak up attention that has nowhere better to go, the last few carry "
    "the local context, and a handful in between matter again and again."
)
STEPS = 40  # the text has more tokens than this, so the recorder's truncation is exercised too


def _softmax_like(heads: int, n: int, seed: int = 0) -> np.ndarray:
    """Causal rows over 0 .. t (the diagonal included), each summing to 1, as a model returns them."""
    rng = np.random.default_rng(seed)
    a = np.tril(rng.random((heads, n, n)) + 1e-3)
    return a / a.sum(axis=2, keepdims=True)


# --- the row arithmetic, docs/domain.md "Traces" --------------------------------------------------


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_kv_head_rows_mean_of_the_group_then_renormalised_without_the_diagonal(kv_heads):
    softmax = _softmax_like(4, 12)
    out = kv_head_rows(softmax, kv_heads)
    assert len(out) == kv_heads
    group = 4 // kv_heads
    for h, rows in enumerate(out):
        mean = softmax[h * group : (h + 1) * group].mean(axis=0)
        assert np.all(rows[0] == 0)
        for t in range(1, 12):
            # float64 on both sides: a mean of at most 4 heads, a sum of at most 11 weights, a division
            np.testing.assert_allclose(rows[t, :t], mean[t, :t] / mean[t, :t].sum(), rtol=2 * rounding(4 + 11 + 2, 1.0, np.float64))
            assert np.all(rows[t, t:] == 0)  # the query's own weight and the future are gone


def test_kv_head_rows_refuses_an_uneven_grouping():
    with pytest.raises(RecordError, match="4 query heads cannot be shared evenly by 3 KV heads"):
        kv_head_rows(_softmax_like(4, 5), 3)


def test_kv_head_rows_refuses_a_row_with_nothing_before_the_diagonal():
    softmax = _softmax_like(2, 6)
    softmax[:, 3] = 0.0
    softmax[:, 3, 3] = 1.0  # all of step 3's attention on itself
    with pytest.raises(RecordError, match="step 3 puts all its attention on itself"):
        kv_head_rows(softmax, 1)


# --- what to record, checked once -------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"steps": 0}, "--steps must be an integer of at least 1, got 0"),
        ({"steps": 2.5}, "--steps must be an integer of at least 1, got 2.5"),
        ({"gqa": "sum"}, "--gqa must be one of mean, max, got 'sum'"),
        ({"layers": "x"}, "--layers must be all, global or comma-separated integers, got 'x'"),
        ({"layers": [0, "y"]}, "--layers must be all, global or comma-separated integers, got [0, 'y']"),
        ({"layers": ""}, "--layers: no layers given"),
        ({"layers": []}, "--layers: no layers given"),
        ({"dtype": "int8"}, "dtype must be a NumPy float type, got 'int8'"),
        ({"dtype": "nonsense"}, "dtype must be a NumPy float type, got 'nonsense'"),
        ({"chunk_elements": 0}, "chunk_elements must be an integer of at least 1, got 0"),
    ],
)
def test_record_config_refuses_a_bad_value_in_one_line_naming_the_flag(options, message):
    with pytest.raises(RecordError, match=re.escape(message) + "$"):
        RecordConfig("t.txt", "out", **options)


def test_record_config_is_normalised_once_frozen_and_hashable():
    config = RecordConfig("t.txt", "out", layers=" 3, 1,3 ", dtype=np.float32, steps=np.int64(8))
    assert (config.text, config.out, config.layers, config.dtype) == (Path("t.txt"), Path("out"), (1, 3), "float32")
    assert config.steps == 8 and type(config.steps) is int
    same = RecordConfig(Path("t.txt"), Path("out"), layers=[3, 1], dtype="float32", steps=8)
    assert config == same and hash(config) == hash(same)
    assert [RecordConfig("t", "o", layers=x).layers for x in (None, "global", " all")] == ["global", "global", "all"]
    assert RecordConfig("t", "o").dtype == "float16" and RecordConfig("t", "o").steps == 4096
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 9


# --- the extra stays optional -----------------------------------------------------------------


def test_core_cli_and_recorder_module_never_import_torch():
    code = (
        "import sys, kvsim, kvsim.cli, kvsim.data.catalog, kvsim.models.record, kvsim.models.loading, "
        "kvsim.models.recorder; kvsim.cli.build_parser(); "
        "bad = [m for m in ('torch', 'transformers', 'gguf') if m in sys.modules]; "
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"imported at start-up: {done.stdout.strip()} {done.stderr[-500:]}"


def test_cli_record_without_the_extra_says_so_in_one_line(monkeypatch, capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    # listed first, so it is the one reported whether or not the real extra is installed
    monkeypatch.setattr(loading, "_EXTRA", {"kvsim_test_absent_module": "kvsim-test-absent-package", **loading._EXTRA})
    assert cli.main(["record", str(text), "--out", str(tmp_path / "out")]) == 1  # the machine lacks it, not the command line
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert "kvsim-test-absent-package is not installed" in err and "pip install -e '.[record]'" in err
    assert not (tmp_path / "out").exists()


# --- the real model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not importable: the recorder's extra is not installed "
                    "(pip install -r requirements-record.txt)")
    work = tmp_path_factory.mktemp("record")
    text = work / "text.txt"
    text.write_text(TEXT)
    cmd = [sys.executable, "-m", "kvsim", "record", str(text), "--out", str(work / "out"), "--steps", str(STEPS),
           "--source", "kvsim's test suite", "--licence", "written for the test", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout), done.stderr, work / "out"


@pytest.mark.record
def test_record_writes_one_packed_float16_trace_per_global_layer(recorded):
    doc, stderr, out = recorded
    names = sorted(p.name for p in out.iterdir() if p.suffix == ".npz")
    assert names == ["gemma3-270m-L05.npz", "gemma3-270m-L11.npz", "gemma3-270m-L17.npz"]
    assert sorted(p.name for p in out.iterdir() if p.suffix != ".npz") == ["manifest.json"]  # a bundle
    assert sorted(f["path"].rsplit("/", 1)[-1] for f in doc["files"]) == names
    assert "forward pass" in stderr and "wrote" in stderr  # progress went to stderr, not stdout
    for name in names:
        with np.load(out / name, allow_pickle=False) as z:
            assert sorted(z.files) == ["attention_packed", "meta", "steps", "values"]
            assert int(z["steps"]) == STEPS
            packed = z["attention_packed"]
            # the KV head's values, one row per position, what the value-aware proxies read
            assert z["values"].dtype == np.float16 and z["values"].shape == (STEPS + 1, 256)
            assert np.isfinite(z["values"]).all() and np.abs(z["values"]).max() > 0
        assert packed.dtype == np.float16 and packed.shape == (STEPS * (STEPS + 1) // 2,)
        # the rows as written, before the loader renormalises: finite, non-negative, summing to 1
        # up to float16 rounding
        raw = unpack_lower(packed, STEPS).astype(np.float64)
        assert np.all(np.isfinite(raw)) and np.all(raw >= 0)
        # float32 rows that sum to 1 within their own rounding, each weight then stored as float16: half an ulp
        # of it, relatively, or half the smallest subnormal below float16's normal range
        f16 = np.finfo(np.float16)
        np.testing.assert_allclose(raw[1:].sum(axis=1), 1.0, rtol=0,
                                   atol=f16.eps / 2 + STEPS * float(f16.smallest_subnormal) / 2 + rounding(STEPS + 1))
        assert raw[1, 0] == 1.0  # step 1 has only position 0 to attend to


@pytest.mark.record
def test_record_meta_names_the_text_the_model_and_the_layer(recorded):
    _, _, out = recorded
    for layer in (5, 11, 17):
        trace = load_npz(out / f"gemma3-270m-L{layer:02d}.npz")
        m = trace.meta
        assert trace.name == f"gemma3-270m-L{layer:02d}" and trace.steps == STEPS
        assert m["layer"] == layer and m["head"] == 0 and m["query_heads"] == [0, 1, 2, 3]
        assert m["source"] == "kvsim's test suite" and m["licence"] == "written for the test"
        assert m["model"] == loading.MODEL and "Gemma Terms of Use" in m["model_licence"]
        assert m["attention"].startswith("global")
        # Gemma 3's global layers rotate with base 1,000,000 (its sliding ones with 10,000)
        assert (m["rope_theta"], m["rope_layout"], m["head_dim"], m["rope_dim"]) == (1e6, "rotate_half", 256, 256)
        assert len(m["tokens"]) == STEPS + 1 and m["tokens"][0] == "<bos>"
        assert TEXT.startswith("".join(m["tokens"][1:]))  # the positions are the text's own tokens


@pytest.mark.record
def test_record_global_layers_sink_on_position_0(recorded):
    _, _, out = recorded
    for layer in (5, 11, 17):
        a = load_npz(out / f"gemma3-270m-L{layer:02d}.npz").attention.astype(np.float64)
        rows = a[8:]  # steps with a few earlier positions to choose from
        share = rows[:, 0].mean()
        assert share > 0.3, f"layer {layer}: position 0 holds {share:.3f} of each row"
        top = np.mean(rows.argmax(axis=1) == 0)
        assert top > 0.5, f"layer {layer}: position 0 is the heaviest position in only {top:.0%} of the rows"

"""A recording stored as queries and keys is the dense recording: tiny Gemma-3- and Llama-style models built
here from configs (grouped-query attention, sliding-window layers; nothing downloaded), their own queries
and keys as ``kvsim record --store qk`` writes them and as ``kvsim/bench/scripts/qk_standin.py`` catches them, against the dense
recorder (``kvsim record``) on the same tokens: every row within float32 rounding (tests/tolerance.py), every
registered policy's retained mass within that of its kept rows. Needs the recorder's extra; skipped with that
reason without it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the recorder's extra is not installed (pip install -r requirements-record.txt)")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import tiny_models  # noqa: E402  (tests/, beside this file)
from tolerance import qk_file_rows, rounding  # noqa: E402

from kvsim.data import vectors  # noqa: E402
from kvsim.data.bundle import load_bundle  # noqa: E402
from kvsim.models.record import RecordConfig, record  # noqa: E402
from kvsim.policykit.registry import POLICIES  # noqa: E402
from kvsim.sim.simulate import replay  # noqa: E402

TEXT = " ".join(("the cache holds every token and grows so a serving stack keeps only some of them which ones "
                 "first few tokens soak up attention").split()[(i * 5) % 19] for i in range(200))
STEPS, WINDOW, BUDGET = 64, 6, 16
ROOT = Path(__file__).resolve().parents[1]


def _standin():
    """kvsim/bench/scripts/qk_standin.py as a module, its folder first on ``sys.path`` as when it runs as a script (it
    imports its neighbour ``kvsim/bench/scripts/checkout``)."""
    spec = importlib.util.spec_from_file_location("qk_standin", ROOT / "kvsim" / "bench" / "scripts" / "qk_standin.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "kvsim" / "bench" / "scripts"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "kvsim" / "bench" / "scripts"))
    return module


@pytest.mark.parametrize("writer", ["record --store qk", "capture"])
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_queries_and_keys_give_the_dense_recording_and_its_replays(tmp_path, family, writer, fit_args, monkeypatch):
    from transformers import AutoModelForCausalLM

    from kvsim.models.loading import token_ids

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer, vocab = tiny_models.tokenizer(TEXT, 300)
    torch.manual_seed(3)
    cfg = tiny_models.config(family, vocab, hidden=32, intermediate=64, max_positions=256, head_dim=8, window=WINDOW)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (tmp_path / "text.txt").write_text(TEXT)
    record(RecordConfig(tmp_path / "text.txt", tmp_path / "dense", model=folder, steps=STEPS, layers="all",
                        dtype=np.float32), progress=None)
    if writer == "capture":
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
        ids = token_ids(tokenizer, TEXT)[:, : STEPS + 1]
        standin = _standin()
        standin.write_bundle(tmp_path / "qk", "tinyqk", standin.capture(model, ids), STEPS, {"source": "test"}, np.float32)
    else:
        record(RecordConfig(tmp_path / "text.txt", tmp_path / "qk", model=folder, steps=STEPS, layers="all", store="qk",
                            dtype=np.float32), progress=None)
    dense, qkb = load_bundle(tmp_path / "dense"), load_bundle(tmp_path / "qk")
    assert qkb.manifest["store"] == "qk" and len(qkb.traces) == len(dense.traces)
    windows = set()
    for a, b in zip(dense.traces, qkb.traces, strict=True):
        assert (a.layer, a.head, a.sliding_window) == (b.layer, b.head, b.sliding_window)
        windows.add(b.sliding_window)
        d, q = a.load(), b.load()
        # two float32 computations of the rows of these queries and keys, each renormalised again by its loader
        row_bound = 2 * qk_file_rows(b.path) + 2 * rounding(STEPS + 2)
        np.testing.assert_allclose(q.attention, d.attention, rtol=0, atol=row_bound, err_msg=b.name)
        for name in POLICIES:
            if vectors.missing(d, POLICIES[name].reads) or vectors.missing(q, POLICIES[name].reads):
                continue  # what a recording does not hold yet (critical's output norms): refused, nothing to compare
            kw = fit_args(name, BUDGET, d)
            # the same decisions on rows within that bound: each step's kept sum of BUDGET weights within BUDGET of it
            assert abs(replay(q, name, budget=BUDGET, **kw).retained_mass
                       - replay(d, name, budget=BUDGET, **kw).retained_mass) <= BUDGET * row_bound, (b.name, name)
    assert windows == ({None, WINDOW} if family == "gemma3" else {None})


def test_the_open_loop_schedule_is_the_same_from_queries_and_keys(fit_args):
    from kvsim.data import qk
    from kvsim.data.trace import Trace
    from kvsim.models.decode import replay_masks

    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 80, 8)).astype(np.float16), rng.normal(size=(80, 8)).astype(np.float16)
    trace = qk.from_qk(q, k, k, scale=0.5)
    dense = Trace(np.array(trace.attention))
    for name in ("h2o", "tova", "sliding_window"):
        a, mass_a = replay_masks([[trace]], name, 16, fit_args(name, 16), 80)
        b, mass_b = replay_masks([[dense]], name, 16, fit_args(name, 16), 80)
        assert torch.equal(a[0], b[0]) and np.array_equal(mass_a, mass_b)

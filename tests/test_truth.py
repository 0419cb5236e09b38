"""The truth, cheaply and where tuning happens: the full-cache pass kept on disk (bit-identical
measurements, no tokenizer needed), the proxies of a configuration beside its truth, the truth
documents the views read, finding a recording's model and text, and the one-line refusals (a text or
model not at hand, a model that does not fit). Tiny random models built from configs, nothing
downloaded."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from test_quality import HAS_TORCH, STEPS, ByteTokenizer, _tiny

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

TEXT = "Heaps are arrays for which a[k] <= a[2*k+1] and a[k] <= a[2*k+2] for all k. " * 2


@pytest.fixture
def text_path(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return p


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_cached_full_pass_gives_the_same_numbers_without_a_tokenizer(text_path, cache):
    from kvsim.models.quality import QualityError, Session

    model = _tiny("gemma3")
    first = Session(model, ByteTokenizer(), text_path, STEPS, model_id="tiny-g3", progress=None)
    assert list(cache.glob("quality/fullpass-*.npz"))
    again = Session(model, None, text_path, STEPS, model_id="tiny-g3", progress=None)
    assert np.array_equal(first.ids.numpy(), again.ids.numpy())
    for a, b in zip(first.traces, again.traces, strict=True):
        assert all(np.array_equal(x.attention, y.attention) and np.array_equal(x.values, y.values) for x, y in zip(a, b, strict=True))
    assert first.traces[0][0].values.shape[0] == first.n  # one value row per position
    for mode in ("open", "closed"):
        assert first.evaluate("h2o", 8, mode, recent_window=3) | {"seconds": 0} == \
            again.evaluate("h2o", 8, mode, recent_window=3) | {"seconds": 0}
    with pytest.raises(QualityError, match="not cached, and no tokenizer"):
        Session(model, None, text_path, STEPS + 1, model_id="tiny-g3", progress=None)


def test_window_truth_keeps_proxies_beside_the_truth_and_the_views_find_it(text_path, cache):
    from kvsim.analysis.proxies import configuration
    from kvsim.models import truth
    from kvsim.models.quality import Session
    from kvsim.views import window_truth as vt

    session = Session(_tiny("llama"), ByteTokenizer(), text_path, STEPS, model_id="tiny-llama", progress=None)
    rows = truth.window_truth(session, "h2o", 8, [1, 3, 5], proxies=configuration,
                              recording="tiny llama (llama, LlamaForCausalLM)")
    assert [r["recent_window"] for r in rows] == [1, 3, 5]
    for r in rows:
        assert r["kl_open"] >= 0 and 0 < r["retained_mass"] <= 1 and r["output_error"] >= 0 and "value_mass_late" in r
    sha = hashlib.sha256(text_path.read_bytes()).hexdigest()
    meta = {"model": "tiny llama (llama, LlamaForCausalLM)", "source_sha256": sha, "steps": STEPS}
    found = vt.truth_for(meta, "h2o", 8)
    assert found is not None and found.windows == (1, 3, 5) and found.kl == tuple(r["kl_open"] for r in rows)
    assert vt.truth_for({**meta, "source_sha256": "0" * 64}, "h2o", 8) is None
    v = vt.verdict(found, 4)
    assert v["measured_window"] == 3 and v["kl_best"] == min(found.kl)
    text = vt.sentence(found, vt.layer_pick(4, "L00", STEPS, 0.005))
    assert f"least at {v['truth_window']} (KL {v['kl_best']:.4f})" in text and f"{100 * v['cost']:+.0f}% KL" in text
    # the same figures read again from the cache, not measured: the proxies too
    again = truth.window_truth(session, "h2o", 8, [1, 3, 5], proxies=configuration)
    assert [r["output_error"] for r in again] == [r["output_error"] for r in rows] and all(r["cached_open"] for r in again)


def test_a_recording_names_its_model_and_text_or_says_which_is_missing(tmp_path):
    from kvsim.models.loading import MODEL, SMOLLM2
    from kvsim.models.quality import QualityError
    from kvsim.models.texts import HEAPQ_SHA256
    from kvsim.models.truth import recording_source

    model, text, steps = recording_source({"model": MODEL, "text": {"sha256": HEAPQ_SHA256, "file": "heapq.py"},
                                           "steps": 1024})
    assert model == "gemma3-270m" and text.name.endswith("heapq.py") and steps == 1024
    assert recording_source({"model": SMOLLM2, "source_sha256": HEAPQ_SHA256, "steps": 64})[0] == "smollm2-135m"
    with pytest.raises(QualityError, match=r"the recording's text \(gone.txt, sha256 abcdef"):
        recording_source({"model": MODEL, "text": {"sha256": "abcdef" * 10, "file": "gone.txt"}, "steps": 8}, tmp_path)
    with pytest.raises(QualityError, match=r"model \(/nowhere \(llama, X\)\) is not at hand; pass --model"):
        recording_source({"model": "/nowhere (llama, X)", "source_sha256": HEAPQ_SHA256, "steps": 8})


def test_a_recordings_text_is_found_where_it_was_recorded_from_while_its_sha256_holds(tmp_path):
    """Before, the manifest kept only the text's name: a recording into the cache (its folder not beside
    the text) had 'its text not at hand' though the file was where it had been recorded from."""
    from kvsim.models.loading import MODEL, file_sha256
    from kvsim.models.quality import QualityError
    from kvsim.models.truth import recording_source

    text = tmp_path / "elsewhere" / "notes.txt"
    text.parent.mkdir()
    text.write_text(TEXT)
    (tmp_path / "bundle").mkdir()
    manifest = {"model": MODEL, "steps": 8, "text": {"sha256": file_sha256(text), "file": "notes.txt", "path": str(text)}}
    assert recording_source(manifest, tmp_path / "bundle")[1] == text
    text.write_text(TEXT + "changed")
    with pytest.raises(QualityError, match=r"notes.txt, sha256 .* is not at hand \(.*notes.txt has changed since: its "
                                           r"sha256 differs\); pass --text FILE"):
        recording_source(manifest, tmp_path / "bundle")
    text.unlink()
    with pytest.raises(QualityError, match=r"notes.txt is gone\); pass --text FILE"):
        recording_source(manifest, tmp_path / "bundle")


def test_a_model_that_does_not_fit_is_refused_before_loading(tmp_path):
    from kvsim.models.errors import RecordError
    from kvsim.models.loading import check_fits

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    check_fits(tmp_path, available=2001)
    with pytest.raises(RecordError, match=r"needs about 0.0 GB in float32, 0.0 GB are free: it does not fit"):
        check_fits(tmp_path, available=1999)


def test_tune_by_default_recommends_by_the_shipped_truth_without_running_the_model(cache, monkeypatch, capsys):
    """``kvsim tune`` on the shipped bundle, nothing cached: the truth (kl) is the default wherever the
    model is at hand, and every candidate window is read from the shipped truth document."""
    from kvsim import cli
    from kvsim.models import quality
    from kvsim.models.truth import documents

    def no_model(*a, **k):
        raise AssertionError("the model was opened although the shipped truth holds every window")

    monkeypatch.setattr(quality, "open_session", no_model)
    assert cli.main(["tune", "--trace", "gemma3-270m-heapq", "--policy", "h2o", "--budget", "256", "--serial",
                     "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["by"] == "kl" and doc["by_caveat"] is None and doc["by_detail"]["auto"].startswith("the truth: gemma3-270m")
    assert "recommending by the truth" in out.err and "--by output_error_late" in out.err
    shipped = next(d for p, d in documents() if p.name == "truth-gemma3-270m-heapq.json")
    kl = {r["params"]["recent_window"]: r["kl_open"] for r in shipped["results"] if r["budget"] == 256}
    assert doc["by_detail"]["windows"] == sorted(kl) and doc["model_window"] == min(kl, key=kl.get) == 104

"""The truth panel under the recent_window curve, on a recording that carries its values: the
value-aware proxy's pick is drawn and stated beside retained mass's, from the same truth."""

from __future__ import annotations

import json

from streamlit.testing.v1 import AppTest

SHA = "ab" * 32


def _panel(trace_path: str) -> None:
    from kvsim.app.truth_panel import truth_panel
    from kvsim.data.trace import load_npz
    from kvsim.sim.simulate import sweep

    trace = load_npz(trace_path)
    truth_panel(trace, "h2o", 16, sweep(trace, "h2o", 16, "recent_window", range(1, 16)), True)


def _recording(tmp_path, values: bool):
    import numpy as np

    from kvsim.data.trace import Trace, save_npz

    rng = np.random.default_rng(3)
    T = 120
    A = np.tril(rng.random((T + 1, T + 1)) ** 6, k=-1)
    A[1:] /= A[1:].sum(axis=1, keepdims=True)
    meta = {"model": "tiny (test)", "text": {"sha256": SHA, "file": "t.txt"}, "steps": T}
    trace = Trace(A.astype(np.float32), name="rec", meta=meta,
                  values=rng.standard_normal((T + 1, 4)).astype(np.float32) if values else None)
    save_npz(trace, tmp_path / "rec.npz", packed=True)
    windows = [2, 5, 8, 11, 14]
    doc = {"format": "kvsim-truth", "version": 1,
           "meta": {"model": "tiny (test)", "model_id": "tiny", "text": "t.txt", "text_sha256": SHA, "steps": T,
                    "mode": "open"},
           "results": [{"policy": "h2o", "budget": 16, "params": {"recent_window": w}, "recent_window": w,
                        "kl_open": 0.1 + 0.01 * abs(w - 8), "delta_nll_open": 0.1} for w in windows]}
    (tmp_path / "cache" / "truth").mkdir(parents=True)
    (tmp_path / "cache" / "truth" / "tiny.json").write_text(json.dumps(doc))
    return tmp_path / "rec.npz", windows


def test_a_recording_with_values_shows_the_output_errors_pick_beside_the_masss(tmp_path, monkeypatch):
    from kvsim.analysis import proxies as px
    from kvsim.data.trace import load_npz
    from kvsim.views import window_truth as vt

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    path, windows = _recording(tmp_path, values=True)
    at = AppTest.from_function(_panel, args=(str(path),), default_timeout=60).run()
    assert not at.exception
    assert not any("attention-output error recommends" in m.value for m in at.markdown)  # a replay per window: asked for
    at.button(key="output_error_button").click().run()
    assert not at.exception
    trace = load_npz(path)
    rows = px.sweep(trace, "h2o", 16, "recent_window", windows)
    pick = windows[min(range(len(rows)), key=lambda i: rows[i]["output_error"])]
    truth = vt.truth_for(trace.meta, "h2o", 16)
    text = " ".join(m.value for m in at.markdown)
    rule = "the least error at the truth's windows"
    assert vt.sentence(truth, vt.layer_pick(pick, "rec", trace.steps, 0.005, "attention-output error", rule)) in text
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    marker = [t for t in spec["data"] if str(t.get("name", "")).startswith("attention-output error recommends")]
    assert marker and marker[0]["name"] == f"attention-output error recommends {pick}"


def test_a_recording_without_values_says_the_value_proxies_fall_back(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = _recording(tmp_path, values=False)
    at = AppTest.from_function(_panel, args=(str(path),), default_timeout=60).run()
    assert not at.exception
    assert any("carries no values" in c.value for c in at.caption)
    assert not any("attention-output error recommends" in m.value for m in at.markdown)

"""The value-aware proxies (kvsim.analysis.proxies): computed from a replay's kept sets, so the engine and the
reference agree on them exactly; their arithmetic against a hand-written statement of it; a trace
without values falling back to mass, said in one line; values through a trace file; and the study's
rank correlation and regret (kvsim.analysis.windows, kvsim.analysis.study)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_traces import random_trace
from tolerance import rounding64

import kvsim
from kvsim.analysis import proxies as px
from kvsim.analysis import study
from kvsim.analysis.tune import TuneError, tune
from kvsim.analysis.windows import ranks, regret, spearman
from kvsim.data.trace import TraceError, load_npz, save_npz
from kvsim.sim import engine

ONLINE = ("sliding_window", "streaming_llm", "h2o", "scissorhands", "tova", "h2o_normalized", "snapkv")


def with_values(trace: kvsim.Trace, seed: int, d: int = 4) -> kvsim.Trace:
    rng = np.random.default_rng(seed)
    trace.values = rng.normal(size=(trace.steps + 1, d)).astype(np.float32) * rng.uniform(0.1, 3, size=(trace.steps + 1, 1))
    return trace


@pytest.mark.skipif(not engine.AVAILABLE, reason="numba is not installed: no engine to compare with the reference")
@pytest.mark.parametrize("name", ONLINE)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), steps=st.integers(1, 60), data=st.data())
def test_engine_and_reference_give_the_same_proxies(name, seed, steps, data):
    trace = with_values(random_trace(steps, seed, shape=data.draw(st.sampled_from(["gamma", "heavy"]))), seed)
    budget = data.draw(st.integers(1, steps + 2), label="budget")
    params = {p.name: data.draw(st.integers(0, p.upper(budget)) if p.below_budget else st.sampled_from([0, 3]))
              for p in kvsim.tunables(name)}
    fast = kvsim.replay(trace, name, budget=budget, record_kept=True, **params)
    ref = kvsim.replay(trace, name, budget=budget, record_kept=True, reference=True, **params)
    assert px.summary(trace, fast) == px.summary(trace, ref)


def test_output_error_is_the_renormalised_kept_output_against_the_full_one():
    trace = with_values(random_trace(30, 3), 3)
    res = kvsim.replay(trace, "h2o", budget=6, record_kept=True, recent_window=2)
    series = px.step_proxies(trace.attention, trace.values, res.kept_history)
    A, V = trace.attention.astype(np.float64), trace.values.astype(np.float64)
    for t in (1, 2, 7, 30):  # what query t saw: [0] at step 1, else what was kept after step t - 1
        kept = [0] if t == 1 else [int(p) for p in res.kept_history[t - 2] if p >= 0]
        full = (A[t, :t] @ V[:t]) / A[t, :t].sum()
        w = A[t, kept]
        mine = (w / w.sum()) @ V[kept]
        # each output a float64 weighted sum of at most t value rows (weights summing to 1) and a division, on
        # both sides: its components within that of the largest |value|; the norm over d of the difference adds d
        d, shift = V.shape[1], np.linalg.norm(mine - full)
        shift_bound = rounding64(2 * (t + 2 + d), np.abs(V).max() * np.sqrt(d))
        assert series["output_shift"][t - 1] == pytest.approx(shift, abs=shift_bound)
        error = shift / np.linalg.norm(full)
        assert series["output_error"][t - 1] == pytest.approx(error, abs=shift_bound / np.linalg.norm(full) + rounding64(d + 2, error))
        norms = np.linalg.norm(V, axis=1)
        # a ratio of two positive float64 sums of at most t products (each norm over d terms), on both sides
        assert series["value_mass"][t - 1] == pytest.approx((w * norms[kept]).sum() / (A[t, :t] * norms[:t]).sum(),
                                                            rel=2 * rounding64(2 * (t + d + 1) + 1))


def test_a_cache_that_holds_everything_loses_nothing():
    trace = with_values(random_trace(40, 5), 5)
    row = px.summary(trace, kvsim.replay(trace, "h2o", budget=41, record_kept=True, recent_window=4))
    # everything kept: the same sums as the full output, up to their order (as above, at t <= 40, d = 4), each
    # step's under its own output's norm; their mean is at most the largest
    A, V = trace.attention.astype(np.float64), trace.values.astype(np.float64)
    smallest = np.linalg.norm((A @ V)[1:] / A[1:].sum(axis=1, keepdims=True), axis=1).min()
    assert row["output_error"] == pytest.approx(0.0, abs=rounding64(2 * (40 + 2 + 4), np.abs(V).max() * 2) / smallest)
    assert row["value_mass"] == pytest.approx(1.0, rel=2 * rounding64(2 * (40 + 4 + 1) + 1))


def test_a_trace_without_values_falls_back_to_mass_and_says_so():
    trace = random_trace(20, 1, name="novalues")
    row = px.summary(trace, kvsim.replay(trace, "tova", budget=5, record_kept=True))
    assert row["output_error"] is None
    assert row["proxy_fallback"].startswith("novalues: the trace carries no values") and "\n" not in row["proxy_fallback"]
    assert px.score(row, "output_error") == row["retained_mass"]
    result = tune(trace, "h2o", 8, by="output_error")
    assert result.by["note"].startswith("novalues:") and result.by["fell_back_to"] == "retained_mass"
    assert result.to_dict()["model_window"] == result.model_wide()["one_window"]["recommended_window"]


def test_tune_by_a_value_proxy_and_by_the_truth_name_their_window():
    trace = with_values(random_trace(60, 9), 9)
    doc = tune(trace, "h2o", 16, by="output_error").to_dict()
    assert doc["by"] == "output_error" and doc["model_window"] in doc["by_detail"]["windows"]
    curve = doc["by_detail"]["curve"]
    assert doc["model_window"] == doc["by_detail"]["windows"][int(np.argmin(curve))]
    losses = {}
    picked = tune(trace, "h2o", 16, by="kl", truth=lambda ws: [losses.setdefault(w, abs(w - 5) + 0.1) for w in ws])
    assert picked.model_window == min(losses, key=losses.get) and picked.to_dict()["by"] == "kl"
    with pytest.raises(TuneError, match="--by kl needs the model and the text"):
        tune(trace, "h2o", 16, by="kl")
    with pytest.raises(TuneError, match="--by must be one of"):
        tune(trace, "h2o", 16, by="mass")


def test_values_go_through_a_trace_file_and_bad_ones_are_refused(tmp_path):
    trace = with_values(random_trace(12, 2), 2)
    save_npz(trace, tmp_path / "t.npz", packed=True)
    back = load_npz(tmp_path / "t.npz")
    assert np.array_equal(back.values, trace.values)
    np.savez(tmp_path / "bad.npz", attention=trace.attention, values=np.zeros((5, 4), dtype=np.float32))
    with pytest.raises(TraceError, match=r"bad.npz: values must be \(13, d\)"):
        load_npz(tmp_path / "bad.npz")


def test_spearman_and_regret():
    # a correlation of 4 ranks: three float64 sums of 4 products, a square root and a division
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0, abs=rounding64(3 * (4 + 2)))
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0, abs=rounding64(3 * (4 + 2)))
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert list(ranks([3, 1, 3])) == [2.5, 1.0, 2.5]
    # the proxy's best (largest score) is the second window, where the loss is 0.15 against a best of 0.1
    assert regret([0.1, 0.9, 0.5], [0.3, 0.15, 0.1]) == pytest.approx(0.5, abs=rounding64(2, 1.5))  # 0.15 / 0.1 - 1
    assert regret([0.1, 0.2, 0.9], [0.3, 0.15, 0.1]) == 0.0


def test_the_study_names_the_proxy_with_the_least_worst_regret():
    rows = []
    for w, kl in zip([4, 12, 20, 28], [0.4, 0.2, 0.25, 0.3], strict=True):
        rows.append({"model": "m", "text": "t", "budget": 32, "sweep": "h2o", "policy": "h2o",
                     "params": {"recent_window": w}, "kl_open": kl,
                     "retained_mass": 0.5 + w / 100,  # peaks at 28: regret 0.3 / 0.2 - 1 = 50%
                     "output_error": abs(w - 12) / 10})  # least at 12, the truth's best: no regret
    v = study.verdict(rows)
    assert v["best"] == "output_error"
    assert v["proxies"]["retained_mass"]["kl_open"]["regret"]["worst"] == pytest.approx(0.5, abs=rounding64(2, 1.5))  # 0.3/0.2 - 1
    assert v["proxies"]["output_error"]["kl_open"]["regret"]["worst"] == 0.0
    # scores -0.8, 0, -0.8, -1.6 against -KL -0.4, -0.2, -0.25, -0.3: ranks 2.5 4 2.5 1 and 1 4 3 2
    assert v["proxies"]["output_error"]["kl_open"]["spearman_within"]["mean"] == pytest.approx(0.4 ** 0.5, abs=rounding64(3 * (4 + 2)))


def test_even_windows():
    assert px.even_windows(64, 8) == [4, 12, 20, 28, 36, 44, 52, 60]
    assert px.even_windows(256, 16)[:3] == [8, 24, 40] and px.even_windows(3, 8) == [1, 2]




def test_replay_sweep_and_table_report_the_proxies_when_asked(tmp_path, capsys):
    """``--proxies``: the value-aware proxies beside retained mass in replay, sweep and table (JSON and
    text), the same figures as ``kvsim.analysis.proxies``; a trace without values says so in one line."""
    import json

    from kvsim import cli

    trace = with_values(random_trace(48, 7), 7)
    path = tmp_path / "v.npz"
    save_npz(trace, path, packed=True)
    trace = load_npz(path)  # what the commands read (float16 rows)
    assert cli.main(["replay", "--trace", str(path), "--policy", "h2o", "--budget", "8", "--recent-window", "3",
                     "--proxies", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    want = px.summary(trace, kvsim.replay(trace, "h2o", budget=8, recent_window=3, record_kept=True))
    assert {k: doc[k] for k in px.VALUE_PROXIES} == {k: want[k] for k in px.VALUE_PROXIES} and doc["output_error"] > 0
    assert cli.main(["sweep", "--trace", str(path), "--policy", "h2o", "--budget", "8", "--recent-window", "1:7:3",
                     "--proxies", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    swept = px.sweep(trace, "h2o", 8, "recent_window", [1, 4, 7])
    assert [r["output_error"] for r in rows] == [r["output_error"] for r in swept]
    assert cli.main(["table", "--trace", str(path), "--budget", "16", "--proxies"]) == 0
    text = capsys.readouterr().out
    assert "output_error" in text.splitlines()[2] and "the trace carries no values" not in text
    bare = tmp_path / "bare.npz"
    save_npz(random_trace(48, 7), bare, packed=True)
    assert cli.main(["replay", "--trace", str(bare), "--policy", "tova", "--budget", "8", "--proxies"]) == 0
    out = capsys.readouterr()
    # what is measured and what is not applicable, said plainly: no column of n/a, no fallback named
    assert out.out.splitlines()[0].split()[-2:] == ["retained_mass", "top_32_recall"] and "n/a" not in out.out
    assert out.out.splitlines()[-1] == ("measured: retained_mass, top_32_recall; not applicable: value_mass, output_error, "
                                        "output_shift (random carries attention only, no values: the value-aware proxies "
                                        "weigh what is kept by the values; a recording by kvsim record stores them)")
    assert "falls back" not in out.out + out.err
    assert cli.main(["replay", "--policy", "h2o", "--budget", "256", "--proxies", "--json"]) == 0  # canonical
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert None not in doc.values() and not set(px.VALUE_PROXIES) & set(doc) and "falls back" not in out.err
    assert doc["not_applicable"]["figures"] == list(px.VALUE_PROXIES) and doc["retained_mass"] == pytest.approx(0.7112, abs=1e-4)

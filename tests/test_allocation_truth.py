"""The open-loop truth of an allocation (kvsim.allocation.truth): equal budgets are exactly the
session's own open-loop measurement, and an uneven split of the same memory is measured, not assumed."""

from __future__ import annotations

import pytest
from test_quality import HAS_TORCH, _private_cache, session, text_path  # noqa: F401  (the tiny model's session)

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")


def test_equal_budgets_are_the_sessions_open_loop(session):  # noqa: F811
    from kvsim.allocation.truth import open_truth

    even = [[12] * session.kv_heads for _ in range(session.layers)]
    got = open_truth(session, "h2o", even, {"recent_window": 4})
    want = session.evaluate("h2o", 12, "open", recent_window=4)
    for key in ("nll", "kl", "delta_nll", "retained_mass", "retained_mass_by_layer"):
        assert got[key] == want[key], key


def test_an_uneven_split_of_the_same_memory_is_measured(session):  # noqa: F811
    from kvsim.allocation.truth import open_truth
    from kvsim.models.errors import QualityError

    n = session.layers * session.kv_heads
    flat = [6 if i % 2 else 18 for i in range(n)]
    flat[-1] += 12 * n - sum(flat)
    uneven = [flat[x * session.kv_heads:(x + 1) * session.kv_heads] for x in range(session.layers)]
    got = open_truth(session, "h2o", uneven, {"recent_window": 4})
    even = open_truth(session, "h2o", [[12] * session.kv_heads for _ in range(session.layers)], {"recent_window": 4})
    assert got["kl"] != even["kl"] and got["kl"] > 0
    with pytest.raises(QualityError, match="an allocation for 1 layers"):
        open_truth(session, "h2o", [[12] * session.kv_heads], {"recent_window": 4})


def test_equal_budgets_closed_loop_are_the_sessions_closed_loop(session):  # noqa: F811
    """The closed-loop truth of a split decodes through the deployed cache with each head at its own budget: with
    every budget equal it is ``quality --mode closed``'s measurement, bit for bit (the same cache, the same steps)."""
    from kvsim.allocation.truth import closed_truth

    even = [[12] * session.kv_heads for _ in range(session.layers)]
    got = closed_truth(session, "h2o", even, {"recent_window": 4})
    want = session.evaluate("h2o", 12, "closed", recent_window=4)
    for key in ("nll", "kl", "delta_nll", "retained_mass", "retained_mass_by_layer"):
        assert got[key] == want[key], key
    assert got["mode"] == "closed"


def test_an_uneven_split_and_adakvs_pool_closed_loop_are_measured_and_cached(session):  # noqa: F811
    from kvsim.allocation import truth as truth

    n = session.layers * session.kv_heads
    flat = [6 if i % 2 else 18 for i in range(n)]
    uneven = [flat[x * session.kv_heads:(x + 1) * session.kv_heads] for x in range(session.layers)]
    even = [[12] * session.kv_heads for _ in range(session.layers)]
    p = {"recent_window": 4}
    split = truth.measure(session, "h2o", uneven, p, "closed", use_cache=True)
    uniform = truth.measure(session, "h2o", even, p, "closed")
    pooled = truth.measure(session, "h2o", even, p, "closed", pooled=5)  # adakv: floor max(5, ceil(0.2 x 12)) = 5
    assert not split["cached"] and not pooled["cached"]
    assert split["kl"] != uniform["kl"] and pooled["kl"] != uniform["kl"] and pooled["kl"] > 0
    # the open loop of the same split is another measurement (its schedule masks one teacher-forced pass)
    assert truth.measure(session, "h2o", uneven, p, "open")["kl"] != split["kl"]
    again = truth.measure(session, "h2o", uneven, p, "closed")
    assert again["cached"] and {**again, "cached": False} == split
    assert truth.measure(session, "h2o", even, p, "closed", pooled=5)["cached"]
    assert not truth.measure(session, "h2o", even, p, "closed", pooled=5, use_cache=False)["cached"]


def test_a_pool_with_its_floor_at_the_share_is_uniform_closed_loop(session):  # noqa: F811
    """adakv with the floor at the share holds every head at its share: each step evicts each head's own h2o
    minimum, so the pooled closed loop keeps what the uniform one keeps (kvsim.sim.joint's identity, through the
    deployed pool): the same retained mass on the full trace, bit for bit. The loss differs only by the order of
    the attention's sums (one store of pool + heads slots, masked per head, against a block per head)."""
    from test_quality import _nll_bound

    from kvsim.allocation.truth import closed_truth

    even = [[12] * session.kv_heads for _ in range(session.layers)]
    pooled = closed_truth(session, "h2o", even, {"recent_window": 4}, pooled=12)
    uniform = closed_truth(session, "h2o", even, {"recent_window": 4})
    assert pooled["retained_mass_by_layer"] == uniform["retained_mass_by_layer"]
    # a token's NLL within _nll_bound of two float32 passes (the KL within twice it), as a batch's rows are
    nll = _nll_bound(session.model, session.ids)
    assert pooled["nll"] == pytest.approx(uniform["nll"], abs=nll)
    assert pooled["kl"] == pytest.approx(uniform["kl"], abs=2 * nll)


def test_cli_quality_allocate_closed_loop_for_a_split_and_adakv_beside_uniform_cached(tmp_path, capsys, monkeypatch):
    """``quality --allocate NAME --mode closed`` on a local model folder (the tiny Gemma 3, 4 layers x 2 KV heads):
    the split's closed-loop truth beside uniform's, adakv's pool too; the second run reads both from the cache."""
    import json

    from test_hf import _model_folder

    from kvsim import cli

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    folder = _model_folder(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog and on and on over the dog " * 2)
    base = ["quality", str(text), "--model", str(folder), "--steps", "48", "--policy", "h2o", "--recent-window", "3",
            "--budget", "16", "--mode", "closed", "--json", "--quiet"]
    docs = {}
    for name in ("pyramidkv", "adakv"):
        assert cli.main([*base, "--allocate", name]) == 0
        docs[name] = json.loads(capsys.readouterr().out)
    p, a = docs["pyramidkv"], docs["adakv"]
    assert p["mode"] == a["mode"] == "closed" and p["steps"] == 48 and not p["cached"] and not a["cached"]
    assert sum(r["budget"] for r in p["allocation"]) == 16 * 8  # uniform's memory, split unevenly
    assert len({r["budget"] for r in p["allocation"]}) > 1
    assert a["pooled"] is True and a["floor"] == 4 and {r["budget"] for r in a["allocation"]} == {16}
    assert p["uniform"]["kl"] == a["uniform"]["kl"]  # the same uniform closed loop, measured once, read once
    assert a["uniform"]["cached"] and not p["uniform"]["cached"]
    assert p["kl"] != p["uniform"]["kl"] and a["kl"] != a["uniform"]["kl"]
    assert cli.main([*base, "--allocate", "adakv"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["cached"] and again["kl"] == a["kl"]
    assert cli.main([*base[:-2], "--allocate", "adakv"]) == 0  # the table, its loop named
    assert "at budget 16 per head on average, closed loop" in capsys.readouterr().out


def test_duos_streaming_heads_run_streaming_llm_in_both_loops(session):  # noqa: F811
    """duo's truth: a head marked streaming replays (open loop) or is deployed (closed loop) as streaming_llm
    with its sinks, every other head as the policy. No head streaming is the static split bit for bit; every
    head streaming is streaming_llm's own measurement bit for bit; a mix is a third measurement, cached apart."""
    from kvsim.allocation import truth as truth

    layers, heads = session.layers, session.kv_heads
    even = [[12] * heads for _ in range(layers)]
    p = {"recent_window": 4}
    none = [[None] * heads for _ in range(layers)]
    every = [[{"sinks": 2}] * heads for _ in range(layers)]
    keys = ("nll", "kl", "delta_nll", "retained_mass", "retained_mass_by_layer")
    kls = {}
    for mode, run in (("open", truth.open_truth), ("closed", truth.closed_truth)):
        plain = run(session, "h2o", even, p)
        assert {k: run(session, "h2o", even, p, streaming=none)[k] for k in keys} == {k: plain[k] for k in keys}
        streamed = run(session, "h2o", even, p, streaming=every)
        want = session.evaluate("streaming_llm", 12, mode, sinks=2)
        assert {k: streamed[k] for k in keys} == {k: want[k] for k in keys}, mode
        kls[mode] = (plain["kl"], streamed["kl"])
    mixed = [[{"sinks": 2} if (x + h) % 2 else None for h in range(heads)] for x in range(layers)]
    got = truth.measure(session, "h2o", even, p, "open", streaming=mixed)
    assert not got["cached"] and got["kl"] not in kls["open"]
    assert truth.measure(session, "h2o", even, p, "open", streaming=mixed)["cached"]

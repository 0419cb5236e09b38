"""The pass key under a serving layout (needle --block-size/--shared-selection/--evict-every): the deployed
cache's departures are the simulator's layout replay on the attention it showed, and the layout is part of a
trial's key and its grid's label."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_needle import HAS_TORCH, folder  # noqa: F401  (the tiny model, a module fixture)

from kvsim import cli

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")


def _trace(rows: dict, seen: int):
    """A trace whose row t is what the cache showed at step t, at the positions it held then."""
    from kvsim.data.trace import from_array

    a = np.zeros((seen, seen), dtype=np.float64)
    for t, (kept, attn) in rows.items():
        a[t, kept] = attn
    a[0, 0] = 1.0
    return from_array(a)


def _departures(kept_history: np.ndarray, seen: int) -> np.ndarray:
    left = np.full(seen + 1, -1, dtype=np.int32)
    held = {0}
    for t in range(1, seen):
        now = set(kept_history[t - 1][kept_history[t - 1] >= 0].tolist())
        for p in (held | {t}) - now:
            left[p] = t
        held = now
    return left


@pytest.mark.parametrize("flags", [["--block-size", "8", "--shared-selection"], ["--block-size", "8", "--evict-every", "4"]])
def test_a_layouts_key_fates_are_the_simulators_layout_replay_on_the_attention_shown(folder, capsys, flags):  # noqa: F811
    from kvsim.models import needle, needle_prompt
    from kvsim.models.quality import load
    from kvsim.policies import PolicySpec
    from kvsim.policykit.layouts import Layout
    from kvsim.sim.layered import replay_layer, replay_layout

    code = cli.main(["needle", "--model", str(folder), "--policies", "h2o", "--budget", "24", "--recent-window", "4",
                     "--lengths", "100", "--depths", "0.5", "--trials", "1", "--quiet", "--json", *flags])
    out = capsys.readouterr()
    assert code == 0, out.err
    doc = json.loads(out.out)
    shared = "--shared-selection" in flags
    layout = Layout(8, shared, 1 if shared else 4)
    assert doc["grids"][0]["layout"] == layout.to_dict()
    assert doc["grids"][0]["label"] == f"h2o @ 24, recent_window 4, {layout.label}"
    cell = doc["cells"][0]
    run = cell["runs"][0]
    assert run["cache_key"]["layout"] == layout.to_dict()
    model, tokenizer, _ = load(str(folder), None)
    prompt = needle_prompt.Builder(tokenizer, needle_prompt.Template()).prompt(cell["length"], cell["depth"], cell["key"],
                                                                             cell["trial"])
    shown = {}

    def listen(layer, head, t, kept, attn):
        shown.setdefault((layer, head), {})[t] = (kept, attn)

    fresh = needle.run_trial(model, prompt, "h2o", 24, {"recent_window": 4}, listen=listen, layout=layout)
    assert np.array_equal(fresh["left"], needle.departures(run))
    seen = fresh["positions"]
    spec = PolicySpec.of("h2o", 24, recent_window=4)
    layers = sorted({x for x, _ in shown})
    for x in layers:
        heads = sorted(h for y, h in shown if y == x)
        traces = [_trace(shown[(x, h)], seen) for h in heads]
        if shared:
            kept = [r.kept_history for r in replay_layer(traces, spec, layout, record_kept=True)["heads"]]
        else:
            kept = [replay_layout(t, spec, layout, top_k=4, record_kept=True).kept_history for t in traces]
        for h, history in zip(heads, kept, strict=True):
            assert np.array_equal(fresh["left"][x, h, :seen], _departures(history, seen)[:seen]), (x, h)
            if shared:
                assert np.array_equal(fresh["left"][x, h], fresh["left"][x, 0])


def test_needle_refuses_a_bad_layout_in_one_line_before_the_model_loads(folder, capsys):  # noqa: F811
    base = ["needle", "--model", str(folder), "--policies", "h2o,tova", "--budget", "24", "--recent-window", "4",
            "--lengths", "100", "--depths", "0.5", "--quiet"]
    cases = [
        (["--block-size", "32"], "--block-size 32: block_size 32 is larger than the budget (24)"),
        (["--evict-every", "0"], "--evict-every 0 must be at least 1"),
        (["--block-size", "8", "--allocate", "uniform"], "--block-size 8 does not go with --allocate yet"),
        (["--evict-every", "22"], "--evict-every 22: evict_every=22 leaves budget - k + 1 = 3: h2o's recent_window 4 must be "
                                  "below it"),
    ]
    for extra, message in cases:
        code = cli.main([*base, *extra])
        out = capsys.readouterr()
        assert code != 0 and out.out == "" and len(out.err.splitlines()) == 1 and message in out.err, (extra, out.err)

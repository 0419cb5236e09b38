"""A needle cell in one pass (issue 43 item 4): every policy of a cell decoded as a row of one batched pass
over the prompt (``needle.run_batch``) gives what each gives alone (``needle.run_trial``): the same tokens, the
same departure step of every position in every (layer, KV head), the same budgets; for policies that read
attention, keys and values (keydiff), output norms (critical, vatp), their trace's meta (expected_attention),
a random generator (random), for a split (pyramidkv: each head its own budget) and a compressed prompt, and
for a row that ends at the end-of-sequence token while the others decode on. On the tiny Gemma 3 of
tests/test_needle.py (random weights, a character tokenizer)."""

from __future__ import annotations

import numpy as np
import pytest
from test_needle import HAS_TORCH, folder  # noqa: F401  (the tiny model, a module fixture)

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")

SNAP = {"budget": 40, "policy": "snapkv", "params": {}}
#: (policy, budget, params, allocate, prefill): three batches (budget 24 exact, the split, the compressed prompt)
#: and a fourth of one (budget 16)
JOBS = [("h2o", 24, {"recent_window": 4}), ("keydiff", 24, {}), ("random", 24, {}),
        ("expected_attention", 24, {"refresh": 8}), ("critical", 24, {"recent_window": 4}),
        ("streaming_llm", 24, {"sinks": 2}), ("tova", 16, {}),
        ("h2o", 24, {"recent_window": 4}, "pyramidkv"), ("tova", 24, {}, "pyramidkv"),
        ("h2o", 24, {"recent_window": 4}, None, SNAP), ("vatp", 24, {"recent_window": 4}, None, SNAP)]


@pytest.fixture(scope="module")
def tiny(folder):  # noqa: F811
    from kvsim.models import needle_prompt
    from kvsim.models.quality import load

    model, tokenizer, _ = load(str(folder), None)
    prompt = needle_prompt.Builder(tokenizer, needle_prompt.Template()).prompt(
        100, 0.5, needle_prompt.pass_key(0, 100, 0.5, 0), 0)
    return model, prompt


def _alone(model, prompt, job, eos=None, rows=False):
    from kvsim.models import needle

    policy, budget, params, *how = job
    return needle.run_trial(model, prompt, policy, budget, params, seed=0, eos=eos, rows=rows,
                            allocate=how[0] if how else None, prefill=how[1] if len(how) > 1 else None)


def _same(batched: dict, alone: dict, what) -> None:
    assert batched["tokens"] == alone["tokens"], what
    assert batched["positions"] == alone["positions"], what
    assert batched["budgets"] == alone["budgets"], what
    assert batched["left"].dtype == alone["left"].dtype and np.array_equal(batched["left"], alone["left"]), what


def test_every_row_of_a_batched_cell_is_its_policy_run_alone(tiny):
    from kvsim.models import needle

    model, prompt = tiny
    together = needle.run_batch(model, prompt, JOBS, seed=0, rows=[True] + [False] * (len(JOBS) - 1))
    assert [r["batch"] for r in together] == [6, 6, 6, 6, 6, 6, 1, 2, 2, 2, 2]
    alone = [_alone(model, prompt, job, rows=job is JOBS[0]) for job in JOBS]
    for job, batched, one in zip(JOBS, together, alone, strict=True):
        _same(batched, one, job)
    # the attention each step showed the first row's policies: the run alone's, (layer, KV head) by (layer, KV head)
    assert together[0]["rows"].keys() == alone[0]["rows"].keys()
    for k, v in alone[0]["rows"].items():
        assert np.array_equal(together[0]["rows"][k], v), k
    # the split's heads differ: the batch kept them apart from the uniform rows
    assert len({b for layer in together[7]["budgets"] for b in layer}) > 1


def test_a_row_that_ends_early_is_cut_where_its_run_alone_stops(tiny):
    """The end-of-sequence token ends one row; the batch decodes on for the others, and that row's tokens,
    departures and what it held are those of its run alone, which stopped there."""
    from kvsim.models import needle

    model, prompt = tiny
    jobs = [JOBS[0], JOBS[5], JOBS[1]]
    free = [_alone(model, prompt, job)["tokens"] for job in jobs]
    # a token the first run writes before its last and another run never writes: it ends one row only
    eos = next((t for t in free[0][1:-1] if t not in free[1]), None)
    assert eos is not None, free
    together = needle.run_batch(model, prompt, jobs, seed=0, eos=eos)
    assert len(together[0]["tokens"]) < needle.NEW_TOKENS and len(together[1]["tokens"]) == needle.NEW_TOKENS
    for job, batched in zip(jobs, together, strict=True):
        _same(batched, _alone(model, prompt, job, eos=eos), job)


def test_a_grid_decodes_each_cell_as_one_batch_and_caches_each_run(folder, capsys):  # noqa: F811
    """The command's cells: the control alone, the policies in one batch (said as it starts), each run then
    read back from the cache as its own trial."""
    import json

    from kvsim import cli

    argv = ["needle", "--model", str(folder), "--policies", "h2o,streaming_llm,keydiff", "--budget", "24",
            "--recent-window", "4", "--sinks", "2", "--lengths", "100", "--depths", "0.5", "--trials", "1", "--json"]
    assert cli.main([*argv, "--no-cache"]) == 0
    out = capsys.readouterr()
    first = json.loads(out.out)
    assert "decoding 3 run(s) as one batch over the prompt" in out.err
    assert [r["batch"] for r in first["cells"][0]["runs"]] == [3, 3, 3] and first["cells"][0]["control"]["batch"] == 1
    assert cli.main([*argv, "--quiet"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert all(r["cached"] for r in again["cells"][0]["runs"])
    strip = lambda d: [(r["text"], r["key_left"], r["key_first_left"]) for r in d["cells"][0]["runs"]]  # noqa: E731
    assert strip(again) == strip(first)

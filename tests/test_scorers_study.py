"""The proxy study's scorers table (docs/proxies.md): every policy at its defaults ranked by the truth in
each model x text x budget, and ``--fixed`` checked before any model loads."""

from __future__ import annotations

import pytest

from kvsim import cli
from kvsim.cli import proxies_command as pc
from kvsim.policykit.registry import study_fixed, study_sweeps


def test_the_parsers_names_are_the_studys():
    truth = pytest.importorskip("kvsim.models.truth")
    jobs = truth.study_jobs(64, [8, 16])
    assert [j[0] for j in jobs if j[3] is None] == study_fixed() == ["sliding_window", "streaming_llm", "tova"]
    assert sorted({j[3] for j in jobs if j[3]}) == sorted(study_sweeps()) == ["h2o", "h2o_normalized", "scissorhands", "snapkv"]
    args = cli.build_parser().parse_args(["proxies"])
    assert args.sweeps.split(",") == study_sweeps() and args.fixed.split(",") == study_fixed()


def _row(policy, kl, mass, sweep=None, budget=64, text="code.py"):
    return {"model": "gemma3-270m-q4km-x", "text": text, "budget": budget, "policy": policy, "kl_open": kl,
            "retained_mass": mass, "sweep": sweep}


def test_the_scorers_table_ranks_each_cells_fixed_policies_by_kl():
    rows = [_row("tova", 0.20, 0.90), _row("knorm", 0.50, 0.70), _row("vatp", 0.10, 0.85),
            _row("h2o", 0.01, 0.99, sweep="h2o"),  # a sweep's row is no scorer at its defaults
            _row("tova", 0.30, 0.80, budget=256)]
    lines = pc.scorers_table(rows)
    body = [line for line in lines if line.startswith("| gemma3 |")]
    assert body[0] == "| gemma3 | code.py | 64 | vatp 0.1000 (0.850) | tova 0.2000 (0.900) | knorm 0.5000 (0.700) |"
    assert body[1] == "| gemma3 | code.py | 256 | tova 0.3000 (0.800) | - | - |"


def test_fixed_names_only_online_policies_before_any_model_loads(capsys):
    assert cli.main(["proxies", "--fixed", "tova,optimal", "--quiet"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--fixed: optimal is not an online policy" in err

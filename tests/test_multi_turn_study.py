"""docs/multi-turn.md is the reprint of the shipped study (docs/multi-turn-study.json) by ``python -m
kvsim.views.multi_turn``, and kvsim/bench/scripts/multi_turn_study.py measures a subset on a tiny model, writes each cell keyed,
says a configuration it cannot run (a scorer this checkout lacks) and resumes without measuring again."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest

from kvsim.views.multi_turn import JSON, PAGE, main, markdown

ROOT = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


def test_the_page_is_the_reprint_of_the_shipped_study(tmp_path):
    doc = json.loads(JSON.read_text(encoding="utf-8"))
    assert PAGE.read_text(encoding="utf-8") == markdown(doc)
    out = tmp_path / "page.md"
    assert main([str(JSON), str(out)]) == 0 and out.read_text(encoding="utf-8") == markdown(doc)
    # the page says how many of the study's cells it measured, and each one it shows is in the JSON
    measured = sum("why" not in c for c in doc["cells"].values())
    assert f"{measured} of the study's" in markdown(doc)


def test_an_unreadable_study_is_one_line(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{", encoding="utf-8")
    assert main([str(bad), str(tmp_path / "y.md")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"multi_turn: {bad}: cannot read the study") and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")
def test_the_study_measures_a_subset_keyed_and_resumes(tmp_path, monkeypatch, capsys):
    from tiny_models import char_gemma3

    folder = char_gemma3(tmp_path / "tiny")
    monkeypatch.syspath_prepend(str(ROOT / "kvsim" / "bench" / "scripts"))
    study = importlib.import_module("multi_turn_study")
    out = tmp_path / "study.json"
    # a configuration whose scorer this checkout lacks is written as not measured, with the reason
    monkeypatch.setitem(study.CONFIGS, "nonesuch", ("snapkv", "nonesuch", "agnostic"))
    flags = ["measure", "--out", str(out), "--models", str(folder), "--keys", "2", "--lengths", "330", "--budgets", "40",
             "--policies", "h2o,streaming_llm,reconstruction,nonesuch", "--trials", "1", "--no-optimum"]
    assert study.main(flags) == 0
    cells = json.loads(out.read_text(encoding="utf-8"))["cells"]
    key = study.cell_key(str(folder), 2, 330, 40, "h2o", 0)
    assert key in cells and len(cells[key]["found"]) == 2 and cells[key]["heads"] == 6
    recon = cells[study.cell_key(str(folder), 2, 330, 40, "reconstruction", 0)]
    assert len(recon["found"]) == 2 and "why" not in recon  # KVzip's scorer (kvsim.policykit.registry.SCORERS)
    assert cells[study.cell_key(str(folder), 2, 330, 40, "nonesuch", 0)] == {
        "why": "the scorer 'nonesuch' is not in this checkout"}
    assert "query-aware" in capsys.readouterr().err
    # the delta NLL per turn, kept apart from the cells under the cell's key and the mode: the exact-prompt
    # configurations' in quality --conversation's open loop, a compressed prompt's in its closed loop (it has no open
    # one), compressed as its run was; the scorer this checkout lacks gets none
    nll = json.loads(out.read_text(encoding="utf-8"))["delta_nll"]
    recon_key = study.nll_key(study.cell_key(str(folder), 2, 330, 40, "reconstruction", 0), "closed")
    assert sorted(nll) == sorted([recon_key, *(study.nll_key(study.cell_key(str(folder), 2, 330, 40, c, 0), "open")
                                               for c in ("h2o", "streaming_llm"))])
    assert nll[recon_key]["prefill"] == {"budget": 40, "policy": "reconstruction", "params": {}, "query": "agnostic"}
    assert [t["turn"] for t in nll[recon_key]["turns"]] == [1, 2] and nll[recon_key]["retained_mass_after_prompt"] < 1
    turns = nll[study.nll_key(key, "open")]["turns"]
    assert [t["turn"] for t in turns] == [1, 2] and all(t["answer_tokens"] > 0 for t in turns)
    assert all(abs(t["delta_nll"] - (t["nll"] - t["nll_full"])) < 1e-9 for t in turns)
    before = out.read_text(encoding="utf-8")
    assert study.main(flags) == 0  # resumed: every cell is there (the missing scorer's said again, not run)
    assert "run(s)" not in capsys.readouterr().err
    assert json.loads(out.read_text(encoding="utf-8")) == json.loads(before)
    # the page reprints what was measured, and says the rest of the grid was not
    text = markdown(json.loads(before))
    assert "| h2o | turn 1 " in text and "| streaming_llm | turn 1 " in text
    assert "3 of the study's" in text and "## The two findings, as measured here" in text
    # with each exact-prompt cell's delta NLL per turn, turn 1 first, and what it says of SCBench's finding
    assert "All 2 measured exact-prompt cells carry the delta NLL" in text
    h2o = nll[study.nll_key(key, "open")]["turns"]
    assert f"| h2o | {h2o[0]['delta_nll']:+.3f} / {h2o[1]['delta_nll']:+.3f} (1 trial) |" in text
    assert "By the delta NLL of each turn's reference answer teacher-forced (2 exact-prompt cells" in text
    # and the compressed prompt's closed loop, turn 1 against the later turns, "not measured" where the study lacks it
    assert "all 1 measured compressed-prompt cells carry it in the closed loop" in text
    r1, rl = (t["delta_nll"] for t in nll[recon_key]["turns"])
    assert f"| reconstruction | turn 1 {r1:+.3f}, later {rl:+.3f} (1 trial) |" in text
    assert "| h2o | not measured |" in text
    assert "**KVzip by the delta NLL**" in text and "cannot be told here" in text  # no snapkv aware beside it


def test_the_page_reads_kvzips_finding_off_the_compressed_prompts_closed_loop():
    """Closed-loop rows for snapkv aware and agnostic on one trial (figures made up here, the page's arithmetic under
    test): the table shows turn 1 and the later turns' mean, and the verdict follows the figures, either way."""
    doc = json.loads(JSON.read_text(encoding="utf-8"))
    doc["delta_nll"] = {k: v for k, v in doc.get("delta_nll", {}).items() if not k.endswith("| closed")}
    cell = "gemma3-270m | 2 keys | 1024 | 256 | {} | trial 1 | closed"

    def row(first: float, later: float) -> dict:
        return {"mode": "closed", "turns": [{"turn": 1, "delta_nll": first}, {"turn": 2, "delta_nll": later}]}

    doc["delta_nll"][cell.format("snapkv aware")] = row(0.25, 1.5)
    doc["delta_nll"][cell.format("snapkv agnostic")] = row(2.0, 1.0)
    text = markdown(doc)
    assert "| snapkv aware | not measured | turn 1 +0.250, later +1.500 (1 trial) |" in text
    assert ("aware turn 1 +0.250, later +1.500; snapkv agnostic turn 1 +2.000, later +1.000; aware's later turns lose "
            "more than snapkv agnostic's in 1 of 1") in text
    assert "the finding reproduces against snapkv agnostic" in text
    doc["delta_nll"][cell.format("snapkv agnostic")] = row(2.0, 1.75)
    assert "the finding does not reproduce against snapkv agnostic" in markdown(doc)


def test_a_compressed_prompt_above_the_optimum_after_the_first_question_is_said_and_why():
    from kvsim.views.multi_turn import _compressed_against_optimum

    below = {"retained_after_prompt": 0.80, "optimal_retained_after_prompt": 0.85}
    above = {"retained_after_prompt": 0.846, "optimal_retained_after_prompt": 0.8447}
    assert _compressed_against_optimum([]) == []
    assert _compressed_against_optimum([below]) == [
        "After the first question, the optimum's mass is at or above the compressed prompt's in 1 of the 1 "
        "compressed-prompt cells."]
    (said,) = _compressed_against_optimum([below, above])
    assert "in 1 of the 2 compressed-prompt cells; in the others the compressed prompt holds more, by up to 0.001" in said
    assert "after reading the whole context" in said

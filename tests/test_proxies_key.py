"""Which proxy predicts the key-token loss (docs/proxies.md): the study's ranking of each proxy against a
truth per model x text x budget (``kvsim.analysis.study.ranking``), and ``kvsim proxies --truth`` end to
end on a tiny model with the page's own command."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from test_quality import HAS_TORCH, ByteTokenizer, _tiny
from tolerance import rounding64

from kvsim import cli
from kvsim.analysis import study
from kvsim.analysis.windows import spearman

DOCS = Path(__file__).resolve().parents[1] / "docs" / "proxies.md"
#: a Spearman of n ranks: three float64 sums of n products, a square root and a division (test_proxies.py)
RHO4 = rounding64(3 * (4 + 2))
#: the tiny case: the fixed policies with a recent_window default it to 32, so the budgets are above that, and the
#: steps above the budget (something is evicted); the text has 138 tokens, one cell keeps the suite quick
STEPS, BUDGETS = 64, "40"


def _row(budget, mass, error, key, kl, key_tokens=5):
    return {"model": "m", "text": "t", "budget": budget, "sweep": None, "policy": "p", "params": {},
            "retained_mass": mass, "output_error": error, "delta_nll_key_open": key, "kl_open": kl,
            "key_tokens": key_tokens}


def test_the_ranking_is_each_proxys_spearman_with_the_truth_per_cell():
    rows = [
        # budget 64: mass falls as the key-token loss rises (rho 1); the error's scores -0.1 -0.3 -0.2 -0.4
        # rank 4 2 3 1 against -loss's 4 3 2 1: 1 - 6 * 2 / (4 * 15) = 0.8; KL runs the other way
        *[_row(64, m, e, k, kl) for m, e, k, kl in zip([0.9, 0.8, 0.7, 0.6], [0.1, 0.3, 0.2, 0.4], [0.1, 0.2, 0.3, 0.4],
                                                       [0.4, 0.3, 0.2, 0.1], strict=True)],
        # budget 128: mass again 1; the error ranks 1 3 2 against 1 2 3: 1 - 6 * 2 / (3 * 8) = 0.5; KL as the loss
        *[_row(128, m, e, k, k) for m, e, k in zip([0.5, 0.6, 0.7], [0.3, 0.1, 0.2], [0.3, 0.2, 0.1], strict=True)],
        # budget 256: the rule selected no token, so there is no key-token loss to rank by
        *[_row(256, m, 0.1, None, 0.1, key_tokens=0) for m in (0.5, 0.6, 0.7)],
    ]
    r = study.ranking(rows, "delta_nll_key_open")
    assert [e["proxy"] for e in r["proxies"]] == ["retained_mass", "output_error"] and r["best"] == "retained_mass"
    mass, error = r["proxies"]
    assert mass["n"] == error["n"] == 2
    assert mass["mean"] == pytest.approx(1.0, abs=RHO4) and mass["worst"] == pytest.approx(1.0, abs=RHO4)
    assert error["mean"] == pytest.approx(0.65, abs=RHO4) and error["worst"] == pytest.approx(0.5, abs=RHO4)
    # beside, over the same two cells: mass -1 and 1 with KL, the error -0.8 and 0.5; no delta NLL measured
    assert mass["beside_mean"]["kl_open"] == pytest.approx(0.0, abs=2 * RHO4)
    assert error["beside_mean"]["kl_open"] == pytest.approx(-0.15, abs=2 * RHO4)
    assert mass["beside_mean"]["delta_nll_open"] is None
    cells = {c["budget"]: c for c in r["cells"]}
    assert cells[256]["why_none"] == "the key-token rule selects no position of this text"
    assert cells[256]["key_tokens"] == 0 and cells[256]["with_truth"] == 0 and cells[64]["key_tokens"] == 5
    assert "why_none" not in cells[64] and cells[64]["truths_agree"]["kl_open"] == pytest.approx(-1.0, abs=RHO4)
    assert r["truths_agree"]["kl_open"]["mean"] == pytest.approx(0.0, abs=2 * RHO4)
    assert r["truths_agree"]["kl_open"]["worst"] == pytest.approx(-1.0, abs=RHO4)
    # the verdict carries the key-token truth beside the others, and no regret for it (it may be negative)
    v = study.verdict(rows)
    assert v["proxies"]["retained_mass"]["delta_nll_key_open"]["spearman_overall"]["n"] == 2
    assert "regret" not in v["proxies"]["retained_mass"]["delta_nll_key_open"]
    assert mass["within_sweeps"]["n"] == 0  # no window sweep among these rows
    # the budget-64 rows as one window sweep: ranked within it too, as the verdict's spearman_within
    for w, row in zip([4, 8, 12, 16], rows[:4], strict=True):
        row.update(sweep="h2o", params={"recent_window": w})
    r = study.ranking(rows, "delta_nll_key_open")
    within = {e["proxy"]: e["within_sweeps"] for e in r["proxies"]}
    assert within["retained_mass"]["n"] == within["output_error"]["n"] == 1
    assert within["output_error"]["mean"] == pytest.approx(0.8, abs=RHO4)
    assert within["output_error"]["mean"] == study.verdict(rows)["proxies"]["output_error"]["delta_nll_key_open"][
        "spearman_within"]["mean"]
    # in that sweep the key-token loss is least at window 4, KL at 16; mass (0.9) and the error (-0.1) pick 4
    (sw,) = r["sweeps"]
    assert (sw["windows"], sw["truth_window"], sw["best_truth"]) == ([4, 8, 12, 16], 4, 0.1)
    assert sw["beside_windows"] == {"kl_open": 16}  # no delta NLL in these rows
    assert sw["picks"] == {"retained_mass": {"window": 4, "truth": 0.1}, "output_error": {"window": 4, "truth": 0.1}}
    with pytest.raises(ValueError, match="unknown truth 'nll'"):
        study.ranking(rows, "nll")


def test_a_constant_truth_ranks_nothing_and_says_so():
    rows = [_row(64, m, 0.1, 0.2, 0.3) for m in (0.5, 0.6, 0.7)]
    r = study.ranking(rows, "delta_nll_key_open")
    assert r["best"] is None and r["cells"][0]["why_none"] == "delta_nll_key_open is the same in every configuration"


def _page_command() -> list[str]:
    """The command docs/proxies.md's key-token section prints, as arguments after ``python -m kvsim``."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("## Which proxy predicts the key-token loss", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S)[1]
    argv = shlex.split(block.replace("\\\n", " "))
    return argv[argv.index("kvsim") + 1:]


def _with(argv: list[str], **flags) -> list[str]:
    """``argv`` with each ``--flag``'s value replaced, or the flag added where the page leaves it at its
    default (the page's flags, a tiny case's values)."""
    out = list(argv)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


@pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")
def test_the_pages_command_ranks_the_proxies_by_the_key_token_loss_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    """The page's command, its models, texts, steps, budgets and output swapped for a tiny Gemma3 on a short
    text with a key-token rule the tiny model's losses cross: every row carries the key-token loss of the
    session's own key tokens, the ranking is the Spearman of the rows written, and the table is printed."""
    from kvsim.models import quality

    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny("gemma3")
    monkeypatch.setattr(quality, "load", lambda m, progress, tokenizer=True: (model, ByteTokenizer(), "tiny"))
    monkeypatch.setattr(quality, "model_id_of", lambda m: "tiny")
    monkeypatch.setattr(quality, "SHORT_WINDOW", 4)  # the session reads these when it is made (test_quality.py)
    monkeypatch.setattr(quality, "KEY_ALPHA", 0.05)
    monkeypatch.setattr(quality, "KEY_BETA", -6.0)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 2)
    argv = _page_command()
    assert argv[0] == "proxies" and argv[argv.index("--truth") + 1] == "delta_nll_key" and "--markdown" in argv
    out_json = tmp_path / "study.json"
    argv = _with(argv, models="tiny", texts=str(text), steps=str(STEPS), budgets=BUDGETS, out=str(out_json))
    assert cli.main([*argv, "--quiet"]) == 0
    markdown = capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    rows, r = doc["rows"], doc["ranking"]
    assert doc["plan"]["truth"] == "delta_nll_key" and r["truth"] == "delta_nll_key_open"
    session = quality.Session(model, ByteTokenizer(), text, STEPS, model_id="tiny", progress=None)
    selected = int(session.key_tokens().sum())
    assert 0 < selected < STEPS - 1  # the rule selects some positions, not all
    assert {row["key_tokens"] for row in rows} == {selected}
    assert all(isinstance(row["delta_nll_key_open"], float) for row in rows)
    one = rows[-1]  # the row's figure is the session's own, measured again here (not read from the cache)
    again = session.measure(one["policy"], one["budget"], "open", use_cache=False, **one["params"])
    assert again["cached"] is False and one["delta_nll_key_open"] == again["delta_nll_key"]
    for cell in r["cells"]:
        members = [row for row in rows if row["budget"] == cell["budget"]]
        assert cell["configurations"] == len(members) and cell["key_tokens"] == selected
        for proxy, rho in cell["spearman"].items():
            sign = study.sign(proxy)
            # the same function of the same floats (JSON gives Python's floats back exactly): equal, bit for bit
            want = spearman([sign * row[proxy] for row in members], [-row["delta_nll_key_open"] for row in members])
            assert (rho is None and want != want) or rho == want, proxy
    assert "Which proxy predicts the key-token delta NLL" in markdown
    table = markdown.split("Which proxy predicts the key-token delta NLL", 1)[1]
    listed = [m[1] for line in table.splitlines() if (m := re.match(r"\| (\w+) \| (-?\d\.\d{3}|-) / ", line))]
    assert listed == [e["proxy"] for e in r["proxies"]]
    assert np.all(np.diff([e["mean"] for e in r["proxies"] if e["mean"] is not None]) <= 0)  # best mean first
    # the text output ranks by the same truth; --truth kl (the default) prints the study's tables without it
    plain = [a for a in argv if a != "--markdown"]
    assert cli.main([*_with(plain, out=str(tmp_path / "again.json")), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "which proxy predicts key-token delta NLL" in text and f"best by mean: {r['best']}" in text
    assert cli.main([*_with(argv, truth="kl", out=str(tmp_path / "kl.json")), "--quiet"]) == 0
    assert "Which proxy predicts" not in capsys.readouterr().out
    assert json.loads((tmp_path / "kl.json").read_text())["ranking"]["truth"] == "kl_open"


def test_truth_is_one_of_the_known_choices(capsys):
    assert cli.main(["proxies", "--truth", "ppl", "--quiet"]) != 0
    assert "--truth: invalid choice: 'ppl'" in capsys.readouterr().err

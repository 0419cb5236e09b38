"""docs/serving.md's command chain runs as printed (tests/doc_chains.py): tova in pages of 16 on the shipped
gemma3-270m layer-5 trace, at or below the optimum under the same blocks; h2o in pages deciding every 8 steps,
saved as a plan and replayed from it to the same row."""

from __future__ import annotations

import json

from doc_chains import chains, run


def _documents(text: str) -> list[dict]:
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(text, i)
        out.append(doc)
    return out


def test_the_serving_chain_runs_as_printed(tmp_path):
    (chain,) = [c for c in chains("docs/serving.md") if any("--block-size" in line for line in c)
                and not any(" tune " in line for line in c)]
    done = run(chain, tmp_path)
    assert done.returncode == 0, done.stderr
    tova, optimum, saved, again = _documents(done.stdout)
    assert tova["layout"] == optimum["layout"] == "block_size=16"
    assert tova["retained_mass"] <= optimum["retained_mass"]
    assert saved == again and saved["layout"] == "block_size=16 evict_every=8"
    assert json.loads((tmp_path / "paged.json").read_text())["layout"]["evict_every"] == 8


def test_the_tune_under_a_layout_chain_runs_as_printed(tmp_path):
    """tune within blocks of 16 deciding every 8 steps saves the layout with the window, and the plan replays to
    the tuned row; the search tunes under no blocks and blocks of 16 and keeps the better."""
    (chain,) = [c for c in chains("docs/serving.md") if any(" tune " in line for line in c)]
    done = run(chain, tmp_path)
    assert done.returncode == 0, done.stderr
    replayed, searched = _documents(done.stdout)
    tuned = json.loads((tmp_path / "tuned.json").read_text())
    assert tuned["layout"] == replayed["layout"] == "block_size=16 evict_every=8"
    assert replayed["recent_window"] == tuned["model_window"]
    assert replayed["retained_mass"] == tuned["model"]["one_window"]["recommended_mass"]
    assert json.loads((tmp_path / "paged-tuned.json").read_text())["layout"] == {
        "block_size": 16, "shared_selection": False, "evict_every": 8}
    table = searched["layout_search"]
    assert [c["layout"] for c in table["candidates"]] == ["evict_every=8", "block_size=16 evict_every=8"]
    assert table["candidates"][1]["model_window"] == tuned["model_window"]
    assert table["chosen"] == max(table["candidates"], key=lambda c: c["figure"])["layout"]

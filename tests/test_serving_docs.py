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
    (chain,) = [c for c in chains("docs/serving.md") if any("--block-size" in line for line in c)]
    done = run(chain, tmp_path)
    assert done.returncode == 0, done.stderr
    tova, optimum, saved, again = _documents(done.stdout)
    assert tova["layout"] == optimum["layout"] == "block_size=16"
    assert tova["retained_mass"] <= optimum["retained_mass"]
    assert saved == again and saved["layout"] == "block_size=16 evict_every=8"
    assert json.loads((tmp_path / "paged.json").read_text())["layout"]["evict_every"] == 8

"""docs/cli.md's conversation chains run as printed (tests/doc_chains.py), from a checkout's root as the page says:
the shipped example conversation, on the shipped Gemma-3-270M (a 236-token conversation; its closed loop, full
pass and recording are cached, so a second run reads them back), hence the record mark."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from doc_chains import ROOT, chains, run

from kvsim.models.conversation import load_conversation

HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


def _chain() -> list[str]:
    (chain,) = [c for c in chains("docs/cli.md") if any("generate --conversation" in line for line in c)]
    return chain


def _compressed() -> list[str]:
    (chain,) = [c for c in chains("docs/cli.md") if any("--prefill-budget" in line for line in c)]
    return chain


def test_the_page_prints_the_three_conversation_commands_on_the_shipped_example():
    chain = _chain()
    assert [line.split()[3] for line in chain] == ["quality", "generate", "record", "replay", "table"]
    conv = load_conversation(ROOT / "examples" / "conversation.json", needs_answers=True)
    assert len(conv.turns) == 3 and conv.context.startswith("Water on Earth")


def _with_example(folder):
    """``folder`` holding examples/conversation.json, where the printed commands read it: the folder they run in."""
    (folder / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "conversation.json", folder / "examples")
    return folder


@pytest.mark.record
@pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")
def test_the_conversation_chain_runs_as_printed(tmp_path):
    done = run(_chain(), _with_example(tmp_path), timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "answers teacher-forced" in out and "Q3: How much of the Earth's water is salt water?" in out
    assert "(reference, not fed: Groundwater.)" in out
    assert "Per turn (positions" in out and "Retained mass per turn" in out
    manifest = json.loads((tmp_path / "conversation-trace" / "manifest.json").read_text())
    assert len(manifest["turns"]) == 3 and manifest["context_end"] == manifest["turns"][0]["question_start"]


def test_the_page_prints_the_compressed_prompt_both_ways():
    chain = _compressed()
    assert [line.split()[3] for line in chain] == ["quality", "quality"] and "--query agnostic" in chain[1]
    assert all("--conversation examples/conversation.json" in line for line in chain)


@pytest.mark.record
@pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")
def test_the_compressed_prompt_chain_runs_as_printed(tmp_path):
    done = run(_compressed(), _with_example(tmp_path), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "the prompt compressed once to 64 by snapkv, query-aware" in out
    assert "the prompt compressed once to 64 by snapkv, query-agnostic" in out and "mass_after_prompt" in out

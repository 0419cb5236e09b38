"""What a user sees for three kinds of bad input (issue 44, item 6): a misspelt policy gets the nearest
registry name wherever a policy is named; the shipped model has one spelling everywhere (``gemma3-270m``;
``generate``'s old ``gemma`` still taken); and a JSON file nested 100,000 deep is refused in one line
naming it, never a RecursionError."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import kvsim
from kvsim import cli
from kvsim.data import jsontext
from kvsim.policykit import registry

ROOT = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
DEEP = 100_000  # the depth the issue tried


def one_line(capsys, code: int, expected: int, *fragments: str) -> str:
    out, err = capsys.readouterr()
    assert code == expected and out == "", (code, err)
    assert len(err.splitlines()) == 1 and err.startswith("kvsim: error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


# --- a misspelt policy: "did you mean 'h2o'?" ----------------------------------------------------------

@pytest.mark.parametrize(
    ("args", "code", "fragments"),
    [
        (["replay", "--policy", "h20"], 2, ["--policy", "'h20'", "(did you mean 'h2o'?)"]),
        (["sweep", "--policy", "tovva", "--recent-window", "1:2"], 2, ["--policy", "'tovva'", "(did you mean 'tova'?)"]),
        (["replay", "--policy", "h2o", "--prefill-budget", "0.5", "--prompt-length", "512", "--prefill-policy", "snapvk"], 2,
         ["--prefill-policy", "'snapvk'", "(did you mean 'snapkv'?)"]),
        (["tune", "--trace", "gemma3-270m-heapq", "--policy", "h20"], 2, ["--policy", "'h20'", "(did you mean 'h2o'?)"]),
        (["quality", "heapq", "--policy", "h20"], 2, ["--policy", "'h20'", "(did you mean 'h2o'?)"]),
        (["quality", "heapq", "--policy", "h2o,tovva"], 2, ["--policy", "'tovva'", "(did you mean 'tova'?)"]),
        (["quality", "heapq", "--policies", "h2o,tovva"], 2, ["--policy", "'tovva'", "(did you mean 'tova'?)"]),  # the old spelling
        (["generate", "--policy", "snapvk", "--max-new-tokens", "1", "hi"], 2,
         ["--policy", "'snapvk'", "(did you mean 'snapkv'?)"]),
        (["needle", "--policy", "h2o,strming_llm"], 1, ["--policy", "strming_llm", "(did you mean 'streaming_llm'?)"]),
        (["needle", "--policies", "h2o,strming_llm"], 1, ["--policy", "strming_llm", "(did you mean 'streaming_llm'?)"]),
        (["replya", "--policy", "h2o"], 2, ["COMMAND", "'replya'", "(did you mean 'replay'?)"]),
    ],
)
def test_a_misspelt_policy_is_one_line_with_the_nearest_name(args, code, fragments, capsys):
    one_line(capsys, cli.main(args), code, *fragments)


def test_a_name_near_nothing_gets_no_guess(capsys):
    err = one_line(capsys, cli.main(["replay", "--policy", "zzzz"]), 2, "--policy", "'zzzz'", "choose from 'sliding_window'")
    assert "did you mean" not in err


def test_the_python_entry_points_suggest_too():
    with pytest.raises(ValueError, match=r"unknown policy 'h20' \(did you mean 'h2o'\?\); known: "):
        registry.policy_class("h20")
    with pytest.raises(ValueError, match=r"did you mean 'h2o'"):
        kvsim.make_policy("h20", 256)


@pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed (requirements-record.txt)")
def test_the_deployed_cache_suggests():
    import kvsim.hf as hf

    with pytest.raises(hf.HFError, match=r"unknown policy 'h20' \(did you mean 'h2o'\?\)"):
        hf.cache(None, "h20", 256)


# --- one spelling of the shipped model ----------------------------------------------------------------

def test_every_command_that_takes_the_shipped_model_spells_it_gemma3_270m():
    choices = cli.build_parser()._subparsers._group_actions[0].choices
    for command in ("generate", "needle", "tune"):
        text = " ".join(choices[command].format_help().split())
        assert "gemma3-270m" in text, command
        assert "DIR|gemma " not in text and "or gemma for" not in text, command


@pytest.mark.parametrize("spelling", ["gemma3-270m", "gemma"])
def test_generate_loads_the_shipped_model_by_either_spelling(spelling, monkeypatch, capsys):
    from kvsim.cli.errors import InputError
    from kvsim.models import loading

    asked = []

    def shipped(*a, **k):
        asked.append("shipped")
        raise InputError("stopped before the weights")

    monkeypatch.setattr(loading, "load_model", shipped)
    monkeypatch.setattr(loading, "load_hf_model", lambda *a, **k: asked.append("folder"))
    code = cli.main(["generate", "--model", spelling, "--policy", "h2o", "--max-new-tokens", "1", "hi"])
    one_line(capsys, code, 1, "stopped before the weights")
    assert asked == ["shipped"]


def test_a_model_that_is_neither_says_the_one_spelling(tmp_path, capsys):
    code = cli.main(["generate", "--model", str(tmp_path / "nope"), "--policy", "h2o", "--max-new-tokens", "1", "hi"])
    err = one_line(capsys, code, 1, "--model", "nor gemma3-270m")
    assert "nor gemma\n" not in err


# --- JSON nested 100,000 deep --------------------------------------------------------------------------

def _deep(tmp_path, name="deep.json", depth=DEEP):
    path = tmp_path / name
    path.write_text("[" * depth + "]" * depth)
    return path


def test_an_allocation_file_nested_100000_deep_is_one_line(tmp_path, capsys):
    path = _deep(tmp_path)
    code = cli.main(["replay", "--trace", "gemma3-270m-heapq", "--policy", "h2o", "--allocate", str(path), "--json"])
    one_line(capsys, code, 1, "--allocate", str(path), "nested deeper than 100 levels")


def test_generate_refuses_deep_allocation_and_tune_files_before_the_model(tmp_path, capsys):
    path = _deep(tmp_path)
    for flag in ("--allocate", "--windows"):
        code = cli.main(["generate", "--policy", "h2o", flag, str(path), "--max-new-tokens", "1", "hi"])
        one_line(capsys, code, 1, flag, str(path), "nested deeper than 100 levels")


def test_a_trace_whose_meta_is_nested_deep_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep-meta.npz"
    np.savez(path, attention=np.tril(np.ones((5, 5), dtype=np.float32), k=-1), meta=np.array("[" * 5000 + "]" * 5000))
    code = cli.main(["describe", "--trace", str(path), "--json"])
    one_line(capsys, code, 1, str(path), "nested deeper than 100 levels")


def test_a_bundle_manifest_nested_deep_is_one_line(tmp_path, capsys):
    folder = tmp_path / "bundle"
    folder.mkdir()
    _deep(folder, "manifest.json")
    code = cli.main(["describe", "--trace", f"{folder}:L00", "--json"])
    one_line(capsys, code, 1, "manifest.json", "nested deeper than 100 levels")


def test_the_depth_check_counts_brackets_outside_strings_only():
    assert jsontext.loads("[" * 100 + "]" * 100) == json.loads("[" * 100 + "]" * 100)
    with pytest.raises(jsontext.NestingError, match="nested deeper than 100 levels") as e:
        jsontext.loads('{"a":\n' + "[" * 101 + "]" * 101 + "}")
    assert isinstance(e.value, json.JSONDecodeError) and e.value.lineno == 2 and e.value.pos == 105  # the 100th [ opens level 101
    tricky = ['"[[[[{{{{"'] * 60 + ['"\\\\"', '"\\"]]]]]"', '"a\\\\\\"]]]"']  # brackets, escaped backslashes and quotes
    doc = "[" + ",".join([*tricky, "[" * 98 + "]" * 98]) + "]"
    assert jsontext.loads(doc) == json.loads(doc)  # 99 levels deep, whatever the strings hold
    with pytest.raises(jsontext.NestingError):
        jsontext.loads("[" + ",".join([*tricky, "[" * 100 + "]" * 100]) + "]")
    for name in ("truth-gemma3-270m-heapq.json", "quality-heapq.json"):
        text = (ROOT / "traces" / name).read_text(encoding="utf-8")
        assert jsontext.loads(text) == json.loads(text)  # kvsim's own documents read as before

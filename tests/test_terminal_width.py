"""A terminal of 100 columns (issue 56): every ``--help`` fits it, long choice lists stand under one metavar
(``--policy NAME``, ``--by FIGURE``) and are still checked in one line naming the flag, and one idea has
one spelling in every command, the old spelling still taken but not shown."""

from __future__ import annotations

import re

import pytest

from kvsim import cli
from kvsim.cli.parser import COMMANDS, build_parser

WIDTH = 100
#: every help there is: the whole grammar's, each command's, and ``cache``'s actions'
HELPS = [[], *([c] for c in COMMANDS), ["cache", "list"], ["cache", "clear"]]


@pytest.mark.parametrize("argv", HELPS, ids=lambda a: " ".join(a) or "kvsim")
def test_every_help_fits_100_columns(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    assert cli.main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    widest = max(out.splitlines(), key=len)
    assert len(widest) <= WIDTH, f"{len(widest)} columns: {widest}"
    long = [c for c in re.findall(r"\{[^}]*\}", out) if len(c) > 40]
    assert not long, f"a long choice list, not under one metavar: {long[0]}"


@pytest.mark.parametrize(("argv", "flag"), [
    (["replay", "--policy", "h20"], "--policy"),
    (["tune", "--trace", "canonical", "--by", "klx"], "--by"),
    (["tune", "--trace", "canonical", "--policy", "tovva"], "--policy"),
    (["quality", "heapq", "--policy", "h20"], "--policy"),
])
def test_a_choice_under_a_metavar_is_still_checked_in_one_line(argv, flag, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvsim: error: argument {flag}: invalid choice") and err.count("\n") == 1


@pytest.mark.parametrize(("argv", "dest", "value"), [
    (["needle", "--policy", "h2o,tova"], "policies", "h2o,tova"),
    (["needle", "--policies", "h2o,tova"], "policies", "h2o,tova"),
    (["quality", "heapq", "--policy", "h2o,tova"], "policies", "h2o,tova"),
    (["quality", "heapq", "--policy", "all"], "policies", "all"),
    (["quality", "heapq", "--policies", "h2o"], "policies", "h2o"),  # the old spelling: a grid of one, as before
    (["quality", "heapq", "--policy", "h2o"], "policy", "h2o"),
    (["proxies", "--budget", "64"], "budgets", "64"),
    (["proxies", "--budgets", "64"], "budgets", "64"),
    (["proxies", "--model", "smollm2-135m"], "models", "smollm2-135m"),
    (["proxies", "--models", "smollm2-135m"], "models", "smollm2-135m"),
    (["proxies", "--text", "a.txt"], "texts", "a.txt"),
    (["proxies", "--texts", "a.txt"], "texts", "a.txt"),
])
def test_one_spelling_per_flag_and_the_old_one_still_taken(argv, dest, value):
    args = build_parser(argv[0]).parse_args(argv)
    assert getattr(args, dest) == value


def test_the_old_spellings_are_not_shown():
    for command, old in (("needle", "--policies"), ("quality", "--policies"), ("proxies", "--budgets"),
                         ("proxies", "--models"), ("proxies", "--texts")):
        assert old not in build_parser(command)._subparsers._group_actions[0].choices[command].format_help(), old
    for command in ("replay", "sweep", "table", "tune", "generate"):
        text = build_parser(command)._subparsers._group_actions[0].choices[command].format_help()
        assert "--budget B " in text and "BUDGET" not in text, command


def test_the_policies_given_twice_is_one_line(capsys):
    assert cli.main(["quality", "heapq", "--policy", "h2o", "--policies", "tova"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give the policies once" in err


@pytest.mark.parametrize("by", ["retained_mass", "top_k_recall"])
def test_tune_fits_100_columns_and_recommends_once_with_its_rule(by, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    assert cli.main(["tune", "--trace", "gemma3-270m-L05", "--budget", "64", "--by", by, "--serial", "--quiet"]) == 0
    out = capsys.readouterr().out
    widest = max(out.splitlines(), key=len)
    assert len(widest) <= WIDTH, f"{len(widest)} columns: {widest}"
    said = " ".join(out.split())
    assert said.count("recommended") == 1 and "recommended: recent_window" in said and f"by {by}" in said

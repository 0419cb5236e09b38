"""``kvsim table`` on a terminal fits its width (issue 44): the tables' cells and the sentences wrap, the
calibration targets stand one below the other; ``--wide``, a file or a pipe print every column side by side,
one line per row, as before; ``--json`` is the same bytes whatever the terminal."""

from __future__ import annotations

import sys

import pytest

import kvsim
from kvsim import cli


@pytest.fixture
def terminal(monkeypatch):
    """stdout a terminal ``columns`` wide (``COLUMNS``, as shutil reads it first)."""

    def at(columns: int) -> None:
        monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
        monkeypatch.setenv("COLUMNS", str(columns))

    return at


def table(capsys, *args: str) -> str:
    assert cli.main(["table", *args]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory, make_trace):
    path = tmp_path_factory.mktemp("table") / "small.npz"
    kvsim.save_npz(make_trace(80, seed=21, name="small"), path)
    return str(path)


def test_a_pipe_gets_the_wide_table_and_a_terminal_one_that_fits(capsys, terminal, small):
    wide = table(capsys, "--trace", small, "--budget", "16", "--proxies")
    assert max(map(len, wide.splitlines())) > 100  # the table (policy and params side by side) and its notes
    terminal(80)
    fitted = table(capsys, "--trace", small, "--budget", "16", "--proxies")
    assert max(map(len, fitted.splitlines())) <= 80
    for word in ("sliding_window", "observation_window=32", "retained_", "gap_share: the share", "not applicable:"):
        assert word in fitted
    assert [line.split()[0] for line in fitted.splitlines()[2:4]] == ["policy", "mass"]  # its header on two lines
    assert table(capsys, "--trace", small, "--budget", "16", "--proxies", "--wide") == wide
    terminal(max(map(len, wide.splitlines())))
    assert table(capsys, "--trace", small, "--budget", "16", "--proxies") == wide  # it fits: nothing wraps


def test_json_is_the_same_bytes_on_any_terminal(capsys, terminal, small):
    piped = table(capsys, "--trace", small, "--budget", "16", "--json")
    terminal(60)
    assert table(capsys, "--trace", small, "--budget", "16", "--json") == piped
    assert table(capsys, "--trace", small, "--budget", "16", "--json", "--wide") == piped


def test_the_calibration_targets_one_below_the_other_on_an_80_column_terminal(capsys, terminal):
    wide = table(capsys)
    targets = wide.split("Calibration targets")[1]
    assert max(map(len, targets.splitlines())) > 150  # figure, target, measured, result side by side
    terminal(80)
    fitted = table(capsys)
    assert max(map(len, fitted.splitlines())) <= 80
    assert fitted.count("PASS") == wide.count("PASS") == 8 and "FAIL" not in fitted
    block = fitted.split("Calibration targets (docs/domain.md, the canonical trace):\n\n")[1].splitlines()
    assert block[:2] == ["PASS  mean share of attention on the most recent 64 positions (steps t > 64)",
                         "      target 0.55 ± 0.01; measured 0.5477"]
    # every figure the wide table prints is in the fitted one
    numbers = {w.strip(",;()") for w in wide.split() if any(c.isdigit() for c in w)}
    assert numbers <= {w.strip(",;()") for w in fitted.split() if any(c.isdigit() for c in w)}
    assert table(capsys, "--wide") == wide


def test_wide_is_in_the_help(capsys):
    assert cli.main(["table", "--help"]) == 0
    assert "--wide" in capsys.readouterr().out

"""``python -m kvsim`` as outside checks run it: each subcommand's ``--json`` document, the readable
tables, and one-line errors that never show a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tolerance import rounding

import kvsim
from kvsim import cli
from kvsim.analysis.claims.measure import FIGURE_TOLERANCE
from kvsim.analysis.metrics import describe
from kvsim.cli import commands, errors, report

REPO = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = {"trace", "policy", "budget", "retained_mass", "top_k_recall", "top_k", "steps"}


def kvsim_cmd(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "kvsim", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def json_of(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return json.loads(proc.stdout)  # the whole of stdout is one JSON document


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvsim: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture(scope="module")
def small(tmp_path_factory, make_trace):
    """A 80-step random trace exported to the interchange format, and the trace as loaded back."""
    path = tmp_path_factory.mktemp("cli") / "small.npz"
    kvsim.save_npz(make_trace(80, seed=21, name="small"), path)
    return path, kvsim.load_trace(path)


def test_replay_json(small):
    path, trace = small
    doc = json_of(kvsim_cmd("replay", "--trace", str(path), "--policy", "h2o", "--budget", "16", "--recent-window", "4", "--json"))
    assert SUMMARY_KEYS | {"recent_window"} <= set(doc)
    expected = kvsim.replay(trace, "h2o", budget=16, recent_window=4)
    assert doc["policy"] == "h2o" and doc["budget"] == 16 and doc["recent_window"] == 4 and doc["steps"] == 80
    assert doc["trace"] == "small"
    assert doc["retained_mass"] == expected.retained_mass
    assert doc["top_k_recall"] == expected.top_k_recall


def test_replay_defaults_and_readable_table(small):
    path, trace = small
    proc = kvsim_cmd("replay", "--trace", str(path), "--policy", "streaming_llm", "--top-k", "8")
    assert proc.returncode == 0 and proc.stderr == ""
    header, rule, row = proc.stdout.splitlines()
    assert header.split() == ["trace", "policy", "params", "budget", "steps", "retained_mass", "top_8_recall"]
    assert set(rule.replace(" ", "")) == {"-"}
    expected = kvsim.replay(trace, "streaming_llm", budget=256, top_k=8)  # the default budget is 256
    assert row.split() == ["small", "streaming_llm", "sinks=4", "256", "80", f"{expected.retained_mass:.4f}",
                           f"{expected.top_k_recall:.4f}"]


def test_sweep_json(small):
    path, trace = small
    doc = json_of(kvsim_cmd("sweep", "--trace", str(path), "--policy", "h2o", "--budget", "16", "--recent-window", "2:8:2", "--json"))
    assert isinstance(doc, list)
    assert [r["recent_window"] for r in doc] == [2, 4, 6, 8]
    for r in doc:
        assert SUMMARY_KEYS <= set(r) and r["budget"] == 16 and r["policy"] == "h2o"
    assert doc[1]["retained_mass"] == kvsim.replay(trace, "h2o", budget=16, recent_window=4).retained_mass


def test_sweep_over_budget_with_a_fixed_parameter(small):
    path, _ = small
    doc = json_of(kvsim_cmd("sweep", "--trace", str(path), "--policy", "streaming_llm", "--sinks", "2", "--budget", "4:6", "--json"))
    assert [(r["budget"], r["sinks"]) for r in doc] == [(4, 2), (5, 2), (6, 2)]


def test_describe_json(small):
    path, trace = small
    doc = json_of(kvsim_cmd("describe", "--trace", str(path), "--band", "8", "--json"))
    assert doc == {"trace": "small", **describe(trace, band=8)}
    assert {"steps", "sink_share", "recent_share", "top_k_share", "effective_positions"} <= set(doc)


def test_export_canonical_round_trips(tmp_path, canonical):
    out = tmp_path / "canonical.npz"
    doc = json_of(kvsim_cmd("export", "--trace", "canonical", "--out", str(out), "--json"))
    assert doc["out"] == str(out) and doc["steps"] == 4096 and doc["dtype"] == "float32"
    assert doc["bytes"] == out.stat().st_size
    with np.load(out, allow_pickle=False) as z:
        assert z["attention"].dtype == np.float32
        assert json.loads(str(z["meta"][()]))["name"] == "canonical"
    loaded = kvsim.load_trace(out).attention
    # the loader renormalises every row in float64; a row whose float32 weights do not sum to
    # exactly 1 (half an ulp each, relatively) can move by that and the store's rounding, nothing more
    assert np.allclose(loaded, canonical.attention, rtol=rounding(2), atol=0)
    assert np.count_nonzero(loaded != canonical.attention) < 100


def test_table_on_the_canonical_trace_meets_every_target():
    doc = json_of(kvsim_cmd("table", "--json"))
    assert doc["budget"] == 256 and doc["trace"] == "canonical" and doc["top_k"] == 32
    rows = {(r["policy"], tuple(r["params"].items())): r for r in doc["rows"]}
    assert rows[("sliding_window", ())]["retained_mass"] == pytest.approx(0.5966, abs=FIGURE_TOLERANCE)  # docs/domain.md
    assert rows[("streaming_llm", (("sinks", 4),))]["retained_mass"] == pytest.approx(0.7367, abs=FIGURE_TOLERANCE)
    # pinned to 6 decimals, and a weight another machine rounds the other way moves it by an ulp of 1
    assert rows[("h2o", (("recent_window", 32),))]["retained_mass"] == pytest.approx(0.711233, abs=0.5e-6 + rounding(1))
    assert rows[("h2o", (("recent_window", 64),))]["top_k_recall"] == 1.0
    # the exact optimum: no row of the table passes it, and it does not pass the per-step bound
    best = rows[("optimal (offline reference)", ())]["retained_mass"]
    bound = rows[("upper bound (offline reference)", ())]["retained_mass"]
    slack = 2 * rounding(4096 + 257, 1.0, np.float64)  # two float64 means over 4096 steps of sums of at most 257 weights
    assert best <= bound + slack
    assert all(r["retained_mass"] <= best + slack for r in doc["rows"]
               if r["policy"] != "upper bound (offline reference)" and "absent" not in r)  # absent: scorers without keys
    assert [r["recent_window"] for r in doc["sweep"]["rows"]] == list(range(8, 193, 8))
    assert doc["sweep"]["argmax"] == 64
    assert len(doc["targets"]) == 8
    assert all(t["pass"] for t in doc["targets"]), [t for t in doc["targets"] if not t["pass"]]
    text = cli.render("table", doc)
    assert text.count("PASS") == 8 and "FAIL" not in text
    assert "Measured at budget 256" in text


def test_table_on_a_small_trace_says_which_rows_the_budget_refuses(small, capsys):
    path, small_trace = small
    assert cli.main(["table", "--trace", str(path), "--budget", "16", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert err == ""
    refused = [r for r in doc["rows"] if r["retained_mass"] is None and "absent" not in r]  # absent: no keys here
    assert {"policy": "h2o", "params": {"recent_window": 32}} in [{k: r[k] for k in ("policy", "params")} for r in refused]
    for r in refused:  # recent_window 32 and 64 do not fit a budget of 16; everything else runs
        assert r["params"].get("recent_window", 0) >= 16 and "recent_window" in r["refused"]
    for r in doc["rows"]:
        if r not in refused and "absent" not in r:
            # at most a whole row: float32 weights summing to 1 within one rounding each
            assert 0 <= r["retained_mass"] <= 1 + rounding(small_trace.steps + 1) and 0 <= r["top_k_recall"] <= 1
    assert [r["recent_window"] for r in doc["sweep"]["rows"]] == [8]
    assert doc["targets"] is None
    assert cli.main(["table", "--trace", str(path), "--budget", "16"]) == 0
    text = capsys.readouterr().out
    assert "refused at this budget" in text and "not checked" in text


def test_policy_flags_come_from_the_registry():
    replay = cli.build_parser()._subparsers._group_actions[0].choices["replay"]
    helptext = replay.format_help()
    choices = next(a.choices for a in replay._actions if a.dest == "policy")
    assert "--policy NAME" in helptext and "`kvsim policies` lists them" in " ".join(helptext.split())
    for name in kvsim.POLICIES:
        assert name in choices  # checked by the parser, listed once by `kvsim policies` (issue 56)
        for param in kvsim.policy_params(name):
            if param != "trace":
                assert "--" + param.replace("_", "-") in helptext


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["replay", "--policy", "h2o", "--trace", "/no/such/trace.npz"], ["/no/such/trace.npz", "no such file"]),
        (["replay", "--policy", "h2o", "--budget", "64", "--recent-window", "64"], ["--recent-window 64 must be below --budget 64"]),
        (["replay", "--policy", "h2o", "--sinks", "4"], ["--sinks", "h2o"]),
        (["replay", "--policy", "sliding_window", "--recent-window", "4"], ["--recent-window", "sliding_window"]),
        (["replay", "--policy", "h2o", "--budget", "0"], ["--budget 0 must be at least 1"]),
        (["replay", "--policy", "no_such_policy"], ["--policy", "no_such_policy"]),
        (["replay", "--trace", "no_such_trace", "--policy", "h2o"], ["no_such_trace", "canonical"]),
        (["sweep", "--policy", "h2o", "--recent-window", "8:x"], ["--recent-window", "8:x"]),
        (["sweep", "--policy", "h2o", "--recent-window", "64:8"], ["--recent-window", "empty"]),
        (["sweep", "--policy", "h2o", "--recent-window", "8:64:0"], ["STEP"]),
        (["sweep", "--policy", "h2o", "--recent-window", "8"], ["exactly one range"]),
        (["describe", "--band", "0"], ["--band"]),
        (["table", "--no-such-flag"], ["--no-such-flag"]),
    ],
)
def test_usage_errors_are_one_line(args, fragments, capsys):
    code = cli.main(args)
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("kvsim: error: ")
    for fragment in fragments:
        assert fragment in err


def test_errors_from_a_real_process_are_one_line(small, tmp_path):
    path, _ = small
    assert_one_line_error(kvsim_cmd("replay", "--policy", "h2o", "--trace", str(tmp_path / "missing.npz")), "no such file")
    assert_one_line_error(
        kvsim_cmd("replay", "--trace", str(path), "--policy", "h2o", "--budget", "16", "--recent-window", "16", "--json"),
        "--recent-window 16 must be below --budget 16",
    )
    assert_one_line_error(
        kvsim_cmd("sweep", "--trace", str(path), "--policy", "h2o", "--budget", "16", "--recent-window", "8:24:8"),
        "--recent-window 16 must be below --budget 16",
    )
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"PK\x03\x04 this is not really a zip archive")
    assert_one_line_error(kvsim_cmd("describe", "--trace", str(garbage), "--json"), str(garbage))
    wrong_key = tmp_path / "wrong_key.npz"
    np.savez(wrong_key, weights=np.eye(3, dtype=np.float32))
    assert_one_line_error(kvsim_cmd("replay", "--trace", str(wrong_key), "--policy", "h2o"), "attention")
    negative = tmp_path / "negative.npz"
    a = np.tril(np.ones((5, 5), dtype=np.float32), k=-1)
    a[3, 1] = -0.5
    np.savez(negative, attention=a)
    assert_one_line_error(kvsim_cmd("replay", "--trace", str(negative), "--policy", "h2o", "--budget", "2", "--recent-window", "1"),
                          "step 3", "negative")
    assert_one_line_error(kvsim_cmd("export", "--trace", str(path), "--out", str(tmp_path / "no" / "dir.npz")), "cannot write")


def test_help_is_not_an_error(capsys):
    assert cli.main(["--help"]) == 0
    assert "replay" in capsys.readouterr().out


def test_parse_range():
    assert cli.parse_range("--recent-window", "8:192:8") == list(range(8, 193, 8))
    assert cli.parse_range("--recent-window", "3:5") == [3, 4, 5]
    assert cli.parse_range("--recent-window", "7") == [7]
    assert cli.parse_range("--recent-window", "8:12:5") == [8]
    with pytest.raises(cli.CLIError, match="A:B"):
        cli.parse_range("--recent-window", "1:2:3:4")


def test_a_bound_is_said_in_the_flags_terms_and_exits_2():
    proc = kvsim_cmd("replay", "--trace", "canonical", "--policy", "h2o", "--budget", "16")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "kvsim: error: --recent-window 32 must be below --budget 16\n"


@pytest.mark.parametrize(
    ("problem", "limit", "limit_name", "said"),
    [
        ("not below", 16, "budget", "--recent-window 32 must be below --budget 16"),
        ("not below", 8, "observation_window", "--recent-window 32 must be below --observation-window 8"),
        ("below 1", 1, None, "--recent-window 32 must be at least 1"),
        ("negative", None, None, "--recent-window 32 must be 0 or more"),
    ],
)
def test_param_message_names_the_flags(problem, limit, limit_name, said):
    e = kvsim.policies.ParamError("the policy's own words", param="recent_window", value=32, problem=problem, limit=limit,
                                  limit_name=limit_name)
    assert errors.param_message(e) == said


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["replay", "--policy", "h2o", "--budget", "0"], 2),
        (["replay", "--policy", "h2o", "--budget", "8", "--recent-window", "8"], 2),
        (["replay", "--policy", "h2o", "--sinks", "4"], 2),
        (["sweep", "--policy", "h2o", "--recent-window", "8:x"], 2),
        (["table", "--no-such-flag"], 2),
        (["no-such-command"], 2),
        (["export", "--out", "canonical.txt"], 2),
        (["replay", "--policy", "h2o", "--trace", "/no/such/trace.npz"], 1),
        (["describe", "--trace", "no_such_trace"], 1),
    ],
)
def test_exit_2_for_the_command_line_1_for_the_data(args, code, capsys):
    assert cli.main(args) == code
    assert capsys.readouterr().err.startswith("kvsim: error: ")


def test_bad_files_exit_1(small, tmp_path):
    path, _ = small
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"PK\x03\x04 not a zip archive")
    assert kvsim_cmd("describe", "--trace", str(garbage)).returncode == 1
    assert kvsim_cmd("export", "--trace", str(path), "--out", str(tmp_path / "no" / "dir.npz")).returncode == 1


def test_bare_kvsim_prints_the_whole_usage_and_exits_2():
    proc = kvsim_cmd()
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("usage: kvsim")
    for command in ("replay", "sweep", "describe", "export", "table", "claims", "bench", "tune", "record", "quality", "app"):
        assert f"    {command} " in proc.stderr, command
    assert "exit status" in proc.stderr and "Traceback" not in proc.stderr


def test_help_documents_the_exit_codes_and_has_no_stale_references(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "exit status:" in text and "  2  the command line is wrong" in text and "  1  the command line is fine" in text
    parser = cli.build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        assert "issue" not in sub.format_help(), name


def test_one_default_budget_256_everywhere(small):
    assert kvsim.DEFAULT_BUDGET == 256
    path, trace = small
    doc = json_of(kvsim_cmd("replay", "--trace", str(path), "--policy", "h2o", "--json"))
    assert doc["budget"] == 256 and doc["retained_mass"] == kvsim.replay(trace, "h2o", budget=256).retained_mass
    rows = json_of(kvsim_cmd("sweep", "--trace", str(path), "--policy", "h2o", "--recent-window", "4:5", "--json"))
    assert [r["budget"] for r in rows] == [256, 256]
    choices = cli.build_parser()._subparsers._group_actions[0].choices
    for command in ("replay", "sweep", "table", "tune", "quality"):
        assert "(default: 256)" in " ".join(choices[command].format_help().split()), command


def test_a_long_step_reports_on_a_terminal_and_a_short_one_says_nothing(capsys):
    with report.step("replay", "replaying h2o", quiet=False, after=0.05) as progress:
        progress(0.5)
    assert capsys.readouterr().err == ""
    with report.step("replay", "replaying h2o", quiet=False, after=0.05) as progress:
        said, deadline = "", time.monotonic() + 30
        while not said and time.monotonic() < deadline:  # a step that blocks without reporting (a compile)
            time.sleep(0.05)                             # still shows its note
            said = capsys.readouterr().err
        progress(1.0)
    assert (said + capsys.readouterr().err).splitlines() == ["replay: replaying h2o", "replay: replaying h2o 100%"]
    with report.step("replay", "replaying h2o") as progress:  # stderr is not a terminal here: a script reads it
        assert progress is None


def test_replay_and_sweep_replay_nothing_ahead_and_announce_only_a_compile(small, monkeypatch, capsys):
    """A command loads only the kernels its replays run (issue 36): no tiny replay ahead of them
    (``engine.prepare``), only a listener that says so if a replay compiles, gone when the step ends."""
    path, _ = small
    calls, announced = [], []
    monkeypatch.setattr(report.engine, "prepare", lambda name, progress: calls.append((name, progress)))
    monkeypatch.setattr(report.engine, "announce_compile", lambda say: announced.append(say) or say)
    monkeypatch.setattr(report.engine, "stop_announcing", lambda say: announced.remove(say))
    assert cli.main(["replay", "--trace", str(path), "--policy", "tova", "--json"]) == 0
    assert cli.main(["sweep", "--trace", str(path), "--policy", "h2o", "--budget", "16", "--recent-window", "2:4", "--json"]) == 0
    assert calls == [] and announced == []  # no progress: stderr is not a terminal here, nothing to say
    assert capsys.readouterr().err == ""
    with report.step("replay", "replaying h2o", quiet=False, after=0.01) as progress:
        report.prepare(["h2o", "upper_bound"], progress)
        (say,) = announced
        say()  # a compile started: the step's note from now on
        said, deadline = "", time.monotonic() + 30
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
            said = capsys.readouterr().err
    assert announced == [] and calls == []
    assert said == "replay: compiling the h2o engine (once per install, ~15 s)\n"


def test_app_runs_streamlit_on_the_one_app_script(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(commands.subprocess, "run", lambda argv, check: ran.append(argv) or SimpleNamespace(returncode=3))
    assert commands.APP_SCRIPT.is_file()
    assert cli.main(["app", "--server.port", "8502"]) == 3
    assert ran == [[sys.executable, "-m", "kvsim.app.launch", "run", str(commands.APP_SCRIPT), "--server.port", "8502"]]
    monkeypatch.setattr(commands, "APP_SCRIPT", tmp_path / "app.py")
    assert cli.main(["app"]) == 1 and len(ran) == 1


# --- the README and docs/ (issue 44) ------------------------------------------------------------------

POLICY_TABLE = ("<!-- kvsim policies --markdown -->\n", "<!-- end of kvsim policies -->\n")


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_policy_table_of_the_docs_is_the_registrys_markdown(capsys):
    """The README's policy table (and any page's, between the same markers) is exactly what
    ``kvsim policies --markdown`` prints: derived from the registry, never kept by hand."""
    assert cli.main(["policies", "--markdown"]) == 0
    printed = capsys.readouterr().out
    found = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        for block in text.split(POLICY_TABLE[0])[1:]:
            assert POLICY_TABLE[1] in block, f"{page.name}: the policy table has no end marker"
            assert block.split(POLICY_TABLE[1])[0] == printed, f"{page.name}: run kvsim policies --markdown and paste it"
            found.append(page.name)
    assert "README.md" in found


def test_the_readme_fits_two_screens_and_names_every_subcommand():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    assert [name for name in commands if f"`{name}`" not in text] == []
    assert "`table --wide`" in text and "docs/screenshot.png" in text and "docs/README.md" in text


def test_docs_readme_indexes_every_page():
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    pages = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.name != "README.md"]
    assert [name for name in pages if f"]({name})" not in index] == []


def test_no_page_names_a_path_of_the_machine_it_was_written_on():
    machine = re.compile(r"(?<![\w.])/(?:work|root|tmp)/")
    found = [f"{p.name}:{i}" for p in _pages() for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if machine.search(line)]
    assert found == []

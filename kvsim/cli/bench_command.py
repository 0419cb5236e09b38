"""``kvsim bench``: the one place outside ``kvsim/bench/`` that imports it (tests/test_layers.py holds
that), so the measurement code never loads for any other command.

Without a section flag it runs the speed benchmark (``kvsim.bench.speed``); each section flag runs one
other benchmark instead, and the flags that only a section takes are refused beside any other."""

from __future__ import annotations

import argparse
import importlib

from .. import progress as protocol
from .errors import BAD_INPUT, CLIError

#: ``kvsim bench --check``: a target was missed
MISSED = BAD_INPUT

#: each benchmark a flag selects instead of the speed one, with the flags only it takes: (dest, flag, default)
SECTIONS = {
    "browser": (("rounds", "--rounds", 3), ("sessions", "--sessions", 8), ("no_load", "--no-load", False),
                ("only_load", "--only-load", False), ("cold_cache", "--cold-cache", False)),
    "load": (("profile", "--profile", None), ("serve", "--serve", None)),
    "long": (("trace", "--trace", None), ("no_tune", "--no-tune", False), ("study", "--study", False)),
    "generate": (("lengths", "--lengths", None), ("decode", "--decode", None), ("prefill", "--prefill", "exact")),
    "truth": (),
    "deploy": (("lengths", "--lengths", None), ("rounds", "--rounds", 3)),
}


def _flag(section: str) -> str:
    return f"--{section}"


def chosen_section(args: argparse.Namespace) -> str | None:
    """The one section the flags select (None: the speed benchmark), or CLIError naming the clash."""
    chosen = [s for s in SECTIONS if getattr(args, s) not in (None, False)]
    if len(chosen) > 1:
        raise CLIError(f"{' and '.join(map(_flag, chosen))} are separate benchmarks; run one at a time")
    section = chosen[0] if chosen else None
    mine = {dest for dest, _, _ in SECTIONS.get(section, ())}
    for other, flags in SECTIONS.items():
        if other != section:
            stray = [flag for dest, flag, default in flags if dest not in mine and getattr(args, dest) != default]
            if stray:
                raise CLIError(f"{', '.join(stray)} only {'applies' if len(stray) == 1 else 'apply'} with {_flag(other)}")
    if section and args.full_reference:
        raise CLIError(f"--full-reference applies to the speed benchmark, not to {_flag(section)}")
    return section


def cmd_bench(args: argparse.Namespace) -> object:
    section = chosen_section(args)
    say = None if args.json else protocol.stderr("bench")
    if section == "generate":
        return _generate(args, say)
    if section == "deploy":
        from ..bench import deploy

        return deploy.run(_lengths(args.lengths, deploy.LENGTHS), progress=say, rounds=args.rounds)
    if section == "load":
        from ..bench import load

        if args.serve and args.profile:
            raise CLIError("--profile samples one plain Streamlit process; it does not go with --serve")
        return load.run(sizes=args.load, progress=say, profile=args.profile, serve=args.serve)
    if section == "long":
        from ..bench import long

        if args.study:
            return long.study(args.trace, progress=say)
        return long.run(args.trace, with_tune=not args.no_tune, progress=say)
    if section == "truth":
        from ..bench import speed, truth_speed

        return speed.verdict(truth_speed.run(progress=say))
    if section == "browser":
        if args.no_load and args.only_load:
            raise CLIError("--no-load and --only-load exclude each other")
        from ..bench import browser

        return browser.run(rounds=args.rounds, sessions=args.sessions, cold_cache=args.cold_cache,
                           load=not args.no_load, single=not args.only_load, progress=say)
    from ..bench import speed

    return speed.run(full_reference=args.full_reference, progress=say)


def _generate(args: argparse.Namespace, say) -> dict:
    from ..bench import generate

    lengths = _lengths(args.lengths, generate.LENGTHS)
    decode = generate.DECODE if args.decode is None else args.decode
    if min(lengths) <= decode + 1:
        raise CLIError(f"--lengths: every length must exceed --decode + 1 ({decode + 1}), got {min(lengths)}")
    return generate.run(lengths, decode, prefill=args.prefill, progress=say)


def _lengths(text: str | None, default: tuple) -> tuple:
    if text is None:
        return default
    try:
        lengths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise CLIError(f"--lengths: expected comma-separated integers, got {text!r}") from None
    if min(lengths) < 2:
        raise CLIError(f"--lengths: every length must be at least 2, got {min(lengths)}")
    return lengths


def bench_status(args: argparse.Namespace, doc: dict) -> int:
    """The exit status of ``kvsim bench``: with ``--check``, 1 (``MISSED``) when any target was missed (the
    document's ``result`` is not PASS), else 0; without ``--check`` always 0, the figures being a report."""
    return MISSED if args.check and doc.get("result", "PASS") != "PASS" else 0


def render_bench(doc: dict) -> str:
    """The text of a benchmark's document: each section's module renders its own kind."""
    kind = doc.get("kind")
    if kind == "long-study":
        from ..bench import long

        return long.render_study(doc)
    module = importlib.import_module(f"..bench.{kind if kind in SECTIONS else 'speed'}", __package__)
    return module.render(doc)

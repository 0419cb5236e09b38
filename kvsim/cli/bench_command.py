"""``kvsim bench``: the one place outside ``kvsim/bench/`` that imports it (tests/test_layers.py holds
that), so the measurement code never loads for any other command."""

from __future__ import annotations

import argparse

from .. import progress as protocol
from .errors import BAD_INPUT, CLIError

#: ``kvsim bench --check``: a target was missed
MISSED = BAD_INPUT


def cmd_bench(args: argparse.Namespace) -> object:
    say = None if args.json else protocol.stderr("bench")
    browser_only = [f for f, on in (("--rounds", args.rounds != 3), ("--sessions", args.sessions != 8),
                                    ("--no-load", args.no_load), ("--only-load", args.only_load),
                                    ("--cold-cache", args.cold_cache)) if on]
    if args.browser:
        if args.truth:
            raise CLIError("--truth and --browser are separate benchmarks; run one at a time")
        if args.full_reference:
            raise CLIError("--full-reference does not apply to --browser")
        if args.no_load and args.only_load:
            raise CLIError("--no-load and --only-load exclude each other")
        from ..bench import browser

        return browser.run(rounds=args.rounds, sessions=args.sessions, cold_cache=args.cold_cache,
                           load=not args.no_load, single=not args.only_load, progress=say)
    if browser_only:
        raise CLIError(f"{', '.join(browser_only)} only apply with --browser")
    if args.truth:
        if args.full_reference:
            raise CLIError("--full-reference does not apply to --truth")
        from ..bench import speed, truth

        return speed.verdict(truth.run(progress=say))
    from ..bench import speed

    return speed.run(full_reference=args.full_reference, progress=say)


def bench_status(args: argparse.Namespace, doc: dict) -> int:
    """The exit status of ``kvsim bench``: with ``--check``, 1 (``MISSED``) when any target was missed (the
    document's ``result`` is not PASS), else 0; without ``--check`` always 0, the figures being a report."""
    return MISSED if args.check and doc.get("result") != "PASS" else 0


def render_bench(doc: dict) -> str:
    if doc.get("kind") == "browser":
        from ..bench import browser

        return browser.render(doc)
    if doc.get("kind") == "truth":
        from ..bench import truth

        return truth.render(doc)
    from ..bench import speed

    return speed.render(doc)

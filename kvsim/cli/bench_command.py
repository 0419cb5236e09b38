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
    generate_only = [f for f, on in (("--lengths", args.lengths is not None), ("--decode", args.decode is not None),
                                     ("--prefill", args.prefill != "exact")) if on]
    if args.generate:
        return _generate(args, say)
    if generate_only:
        raise CLIError(f"{', '.join(generate_only)} only apply with --generate")
    browser_only = [f for f, on in (("--rounds", args.rounds != 3), ("--sessions", args.sessions != 8),
                                    ("--no-load", args.no_load), ("--only-load", args.only_load),
                                    ("--cold-cache", args.cold_cache)) if on]
    if args.profile is not None and not args.load:
        raise CLIError("--profile only applies with --load")
    if args.load:
        if args.browser or args.full_reference or browser_only:
            raise CLIError("--load runs alone: without --browser, --full-reference or the browser's flags")
        from ..bench import load

        return load.run(sizes=args.load, progress=say, profile=args.profile)
    long_only = [f for f, on in (("--trace", args.trace is not None), ("--no-tune", args.no_tune), ("--study", args.study))
                 if on]
    if args.long:
        if args.browser or browser_only or args.full_reference:
            raise CLIError("--long takes only --trace, --no-tune, --study, --check and --json")
        from ..bench import long

        if args.study:
            return long.study(args.trace, progress=say)
        return long.run(args.trace, with_tune=not args.no_tune, progress=say)
    if long_only:
        raise CLIError(f"{', '.join(long_only)} only apply with --long")
    if args.browser:
        if args.full_reference:
            raise CLIError("--full-reference does not apply to --browser")
        if args.no_load and args.only_load:
            raise CLIError("--no-load and --only-load exclude each other")
        from ..bench import browser

        return browser.run(rounds=args.rounds, sessions=args.sessions, cold_cache=args.cold_cache,
                           load=not args.no_load, single=not args.only_load, progress=say)
    if browser_only:
        raise CLIError(f"{', '.join(browser_only)} only apply with --browser")
    from ..bench import speed

    return speed.run(full_reference=args.full_reference, progress=say)


def _generate(args: argparse.Namespace, say) -> dict:
    if args.browser or args.full_reference:
        raise CLIError("--generate excludes --browser and --full-reference")
    from ..bench import generate

    lengths = generate.LENGTHS
    if args.lengths is not None:
        try:
            lengths = tuple(int(x) for x in args.lengths.split(","))
        except ValueError:
            raise CLIError(f"--lengths: expected comma-separated integers, got {args.lengths!r}") from None
    decode = generate.DECODE if args.decode is None else args.decode
    if min(lengths) <= decode + 1:
        raise CLIError(f"--lengths: every length must exceed --decode + 1 ({decode + 1}), got {min(lengths)}")
    return generate.run(lengths, decode, prefill=args.prefill, progress=say)


def bench_status(args: argparse.Namespace, doc: dict) -> int:
    """The exit status of ``kvsim bench``: with ``--check``, 1 (``MISSED``) when any target was missed (the
    document's ``result`` is not PASS), else 0; without ``--check`` always 0, the figures being a report."""
    return MISSED if args.check and doc.get("result", "PASS") != "PASS" else 0


def render_bench(doc: dict) -> str:
    if doc.get("kind") == "load":
        from ..bench import load

        return load.render(doc)
    if doc.get("kind") == "generate":
        from ..bench import generate

        return generate.render(doc)
    if doc.get("kind") == "browser":
        from ..bench import browser

        return browser.render(doc)
    if doc.get("kind") in ("long", "long-study"):
        from ..bench import long

        return long.render(doc) if doc["kind"] == "long" else long.render_study(doc)
    from ..bench import speed

    return speed.render(doc)

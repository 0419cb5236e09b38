"""``kvsim`` (the console script) and ``python -m kvsim``: parse, run the command, print its document.

stdout carries the result alone, so ``--json`` output can be piped; errors and progress go to stderr.
"""

from __future__ import annotations

import os
import sys

from ..policies import ParamError
from .bench_command import bench_status, cmd_bench
from .cache_command import cmd_cache
from .commands import COMMANDS, cmd_app
from .errors import BAD_INPUT, USAGE, CLIError, model_error, param_message
from .generate_command import cmd_generate
from .parser import PROG, build_parser
from .proxies_command import cmd_proxies
from .render import as_json, render

RUNS = {**COMMANDS, "bench": cmd_bench, "cache": cmd_cache, "generate": cmd_generate, "proxies": cmd_proxies}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser()
        if not argv:  # bare `kvsim`: what it can do, and the status of a usage error
            parser.print_help(sys.stderr)
            return USAGE
        try:
            args, extra = parser.parse_known_args(argv)
        except SystemExit as e:  # --help and friends
            return int(e.code or 0)
        if args.command == "app":  # what follows is streamlit's
            return cmd_app(extra)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        doc = RUNS[args.command](args)
        sys.stdout.write((as_json(doc) if args.json else render(args.command, doc)) + "\n")
        sys.stdout.flush()
        return bench_status(args, doc) if args.command == "bench" else 0
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130
    except BrokenPipeError:
        # the reader went away (``| head``): point stdout at devnull so the exit flush stays quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BAD_INPUT
    except ParamError as e:  # a policy's bound, said in the flags' terms
        _fail(param_message(e))
        return USAGE
    except Exception as e:  # CLIError; TraceError, BundleError, OSError: the data; a ContractError
        if type(e).__module__ == "kvsim.models.errors":  # RecordError, QualityError (imported only when a model is)
            e = model_error(e)
        _fail(_one_line(e))
        return e.code if isinstance(e, CLIError) else BAD_INPUT


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if not isinstance(e, (CLIError, ValueError, OSError)):
        text = f"{type(e).__name__}: {text}"
    return text


def _fail(message: str) -> None:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.stderr.flush()

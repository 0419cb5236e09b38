"""``kvsim`` (the console script) and ``python -m kvsim``: parse, run the command, print its document.

stdout carries the result alone, so ``--json`` output can be piped; errors and progress go to stderr.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
from typing import NoReturn

from ..policies import ParamError
from .errors import BAD_INPUT, USAGE, CLIError, model_error, param_message
from .parser import COMMANDS, PROG, build_parser
from .plan_flags import TAKES_PLAN as PLAN_COMMANDS

#: the module of each command that has one of its own; ``commands`` holds the rest (``COMMANDS``). A
#: command's module is imported when it runs, so --help, a usage error and ``cache list`` load none of
#: the simulator, and a replay none of the other commands' analyses (issue 36: tests/test_startup.py)
OWN_MODULE = {"bench": "bench_command", "cache": "cache_command", "generate": "generate_command", "learn": "learn_command",
              "proxies": "proxies_command",
              "needle": "needle_command", "policies": "policies_command", "replay": "replay_command",
              "serve": "serve_command", "sweep": "replay_command"}


def command(name: str):
    """The function that runs command ``name``, its module imported now."""
    if name in OWN_MODULE:
        return getattr(importlib.import_module(f".{OWN_MODULE[name]}", __package__), f"cmd_{name}")
    return importlib.import_module(".commands", __package__).COMMANDS[name]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        # a command's own sub-parser when the line starts with one (it parses the line as the whole grammar
        # does); the whole grammar for --help, a bare ``kvsim`` and an unknown command, which list them all
        parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
        if not argv:  # bare `kvsim`: what it can do, and the status of a usage error
            parser.print_help(sys.stderr)
            return USAGE
        try:
            args, extra = parser.parse_known_args(argv)
        except SystemExit as e:  # --help and friends
            return int(e.code or 0)
        if args.command == "app":  # what follows is streamlit's
            from .commands import cmd_app

            return cmd_app(extra)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command in PLAN_COMMANDS:  # the run's one plan (--plan FILE, or the flags'), --save-plan written
            from . import run_plan

            run_plan.make(args, parser)
            run_plan.save(args)
        doc = command(args.command)(args)
        if args.json:
            from .jsondoc import as_json

            text = as_json(doc)
        else:
            from .render import render, terminal_width

            text = render(args.command, doc, width=None if getattr(args, "wide", True) else terminal_width())
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        if args.command == "bench":
            from .bench_command import bench_status

            return bench_status(args, doc)
        return 0
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


def exit_now(code: int) -> NoReturn:
    """End a command-line process as soon as its output is out: flush, run the atexit handlers, and
    leave without the interpreter's teardown, which once numba has loaded a kernel (LLVM's own clean-up
    on the way out) took 0.2-1 s of every such command here, for nothing a finished command still needs
    (issue 36). Only for a whole process (``python -m kvsim``, the ``kvsim`` script), never a caller's."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, a stream closed: nothing left to say anyway
            pass
    atexit._run_exitfuncs()
    os._exit(code)

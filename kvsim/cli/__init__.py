"""``kvsim`` on the command line: replay, sweep, describe, export, the cards' table and their claims,
bench, tune, record, quality, and ``app`` (the Streamlit app).

``--json`` on any subcommand prints exactly one JSON document on stdout and nothing else; without it
the same figures print as aligned tables. Every error is one line on stderr, ``kvsim: error: ...``,
never a traceback: exit 2 for a wrong command line, 1 for bad data (outside checks parse both);
``errors`` states the convention, a missing input's flag first included.

``parser`` holds the grammar, ``commands`` what each command does (``bench_command`` the one that
imports ``kvsim.bench``), ``render`` the readable tables, ``entry`` the ``main`` that ties them.
"""

from . import entry
from .errors import CLIError
from .parser import build_parser, parse_range
from .render import render


def main(argv: list[str] | None = None) -> int:
    """``kvsim`` with ``argv`` (default: this process's command line, and then the process ends here,
    ``entry.exit_now``, as soon as the command is done); the exit status."""
    code = entry.main(argv)
    if argv is None:
        entry.exit_now(code)
    return code

__all__ = ["CLIError", "build_parser", "main", "parse_range", "render"]

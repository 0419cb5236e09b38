"""The two errors of the real-model extra, each carrying a one-line message an entry point prints as it is."""

from __future__ import annotations


class RecordError(RuntimeError):
    """The recorder cannot run or its input is unusable; the message is one line.

    ``argument``: the command-line input at fault when it is one (``TEXT``, ``--model``, ``--out``), so
    that the CLI says it first (kvsim/cli/errors.py); ``usage``: a value the command line gave is out of
    this model's bounds (``--layers 99``, ``--steps`` past its context), a wrong command line rather than
    a bad input."""

    def __init__(self, message: str, *, argument: str | None = None, usage: bool = False):
        super().__init__(message)
        self.argument, self.usage = argument, usage


class QualityError(RuntimeError):
    """The measurement cannot run or its input is unusable; the message is one line."""

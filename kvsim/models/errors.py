"""The two errors of the real-model extra, each carrying a one-line message an entry point prints as it is."""

from __future__ import annotations


class RecordError(RuntimeError):
    """The recorder cannot run or its input is unusable; the message is one line."""


class QualityError(RuntimeError):
    """The measurement cannot run or its input is unusable; the message is one line."""

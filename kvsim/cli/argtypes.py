"""The argument types the command modules share: a positive integer, a list of them (in a module of their own, so
that a command module that builds its own subparser, ``learn_command``, need not import the parser that imports it)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def size_list(text: str) -> list[int]:
    """``N[,N...]``: the class sizes of ``bench --load``, each a positive integer."""
    try:
        return [positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"expected N[,N...]: {e}") from None

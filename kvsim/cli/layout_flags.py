"""``--block-size S``, ``--shared-selection`` and ``--evict-every K`` (replay, sweep, table, tune): the serving layout
a run's policy is held to (``kvsim.policykit.layouts``; docs/serving.md), read into one ``Layout`` and checked
before any trace or model loads. A refusal is one line; what is only worth saying (a budget rounded down to
whole blocks, shared selection on one KV head) goes to stderr as a note and the run goes on."""

from __future__ import annotations

import argparse
import sys

from .errors import CLIError

#: the commands that take the flags
TAKES_LAYOUT = ("replay", "sweep", "table", "tune")


def add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=None, metavar="S", help="serving layout: the cache in blocks "
                   "of S positions (vLLM: 16); only whole, complete blocks leave, the lowest summed score first; a "
                   "budget that is no multiple of S is rounded down (docs/serving.md)")
    p.add_argument("--shared-selection", action="store_true", help="serving layout: a layer's KV heads hold the same "
                   "positions, scored by their sum over the heads (a no-op on a trace of one KV head, said)")
    p.add_argument("--evict-every", type=int, default=None, metavar="K", help="serving layout: decide only every K "
                   "steps, evicting down to budget - K + 1; the cache grows in between, never past the budget")


def of(args: argparse.Namespace):
    """The layout the flags state, or None for none (today's run, untouched). CLIError for a value below 1."""
    s, k, shared = getattr(args, "block_size", None), getattr(args, "evict_every", None), getattr(args, "shared_selection", False)
    for name, value in (("--block-size", s), ("--evict-every", k)):
        if value is not None and value < 1:
            raise CLIError(f"{name} {value} must be at least 1")
    from ..policykit.layouts import Layout

    layout = Layout(1 if s is None else s, bool(shared), 1 if k is None else k)
    return None if layout.plain else layout


def refuse_with(args: argparse.Namespace, layout, *, split: bool | None = None, compressed: bool | None = None) -> None:
    """The flags a layout does not go with yet, in one line (``split``, ``compressed``: a plan's, in place of the
    flags')."""
    if layout is None:
        return
    split = getattr(args, "allocate", None) is not None if split is None else split
    compressed = getattr(args, "prefill_budget", None) is not None if compressed is None else compressed
    others = [f for f, on in (("--allocate", split), ("--prefill-budget", compressed),
                              ("--proxies", args.command != "replay" and getattr(args, "proxies", False))) if on]
    if others:
        raise CLIError(f"{layout_flags_text(layout)} does not go with {others[0]} yet")


def layout_flags_text(layout) -> str:
    parts = [f"--block-size {layout.block_size}"] if layout.block_size > 1 else []
    parts += ["--shared-selection"] if layout.shared_selection else []
    parts += [f"--evict-every {layout.evict_every}"] if layout.evict_every > 1 else []
    return " ".join(parts)


def check(layout, name: str, configs, heads: int | None = 1) -> None:
    """Refuse what the layout cannot run for policy ``name`` at each of ``configs`` (``(budget, params)``
    pairs: one for a replay, one per row of a sweep), one line in the CLI's terms; say its notes on stderr, once
    each."""
    if layout is None:
        return
    notes: list[str] = []
    for budget, params in configs:
        try:
            found = layout.check(name, budget, params, heads=heads)
        except ValueError as e:  # ParamError and LayoutError are ValueErrors
            raise CLIError(f"{layout_flags_text(layout)}: {' '.join(str(e).split())}") from None
        notes += [n for n in found if n not in notes]
    say(notes)


def say(notes: list[str]) -> None:
    for note in notes:
        print(f"kvsim: note: {note}", file=sys.stderr)

"""The prompt-compression flags' refusals, in the flags' own terms: one reader for ``replay``/``sweep``/``table``
(kvsim.cli.prefill_command), ``needle`` and a plan built from flags (kvsim.cli.run_plan).

Kept apart from prefill_command because that module reads sweep ranges through kvsim.cli.parser, and the
parser imports the commands that use these.
"""

from __future__ import annotations

from ..sim.prefill import PrefillError, parse_keep, parse_scorer
from .errors import CLIError

#: a PrefillError's field, as the flag that sets it
FLAGS = {"prefill_budget": "--prefill-budget", "prompt_length": "--prompt-length", "prefill_policy": "--prefill-policy"}


def say(e: PrefillError) -> str:
    """``e`` with its field named as the flag that sets it."""
    text = str(e)
    return FLAGS[e.field] + text[len(e.field):] if text.startswith(e.field) else f"{FLAGS[e.field]}: {text}"


def scorer(text: str, error: type[CLIError] = CLIError) -> tuple[str, dict]:
    """``--prefill-policy NAME[:param=N,...]`` as (name, params), or one line naming the flag."""
    try:
        return parse_scorer(text)
    except PrefillError as e:
        raise error(f"--prefill-policy: {e}") from None


def keep(text: str):
    """``--prefill-budget`` (positions per head, or a share of the prompt in (0, 1)), or one line naming the flag."""
    try:
        return parse_keep(text)
    except PrefillError as e:
        raise CLIError(say(e)) from None

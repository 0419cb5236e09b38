"""The CLI's two kinds of failure and how a policy's bound is said in flag terms.

Exit 2: the command line itself is wrong (an unknown flag, a value out of its bounds, flags that do
not go together); exit 1: the command line is fine but what it names is not (a trace file that is
missing or malformed, an output that cannot be written). Either way one line on stderr.
"""

from __future__ import annotations

from ..policies import ParamError

USAGE = 2
BAD_INPUT = 1


class CLIError(Exception):
    """A usage problem (exit 2), reported as one line."""

    code = USAGE


class InputError(CLIError):
    """The command line is fine, the data or the file system is not (exit 1)."""

    code = BAD_INPUT


def flag(param: str) -> str:
    """A policy parameter's flag: ``recent_window`` -> ``--recent-window``."""
    return "--" + param.replace("_", "-")


def param_message(e: ParamError) -> str:
    """A policy's refusal in the terms of the flags that were typed: ``--recent-window 32 must be below
    --budget 16`` rather than the policy's own ``recent_window must be less than budget (16), got 32``."""
    given = f"{flag(e.param)} {e.value}"
    if e.problem == "not below":
        return f"{given} must be below {flag(e.limit_name or 'budget')} {e.limit}"
    if e.problem == "below 1":
        return f"{given} must be at least {e.limit}"
    if e.problem == "negative":
        return f"{given} must be 0 or more"
    if e.problem == "not an integer":
        return f"{flag(e.param)} {e.value!r} must be an integer"
    return str(e)

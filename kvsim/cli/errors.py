"""The CLI's two kinds of failure and how a policy's bound is said in flag terms: the one convention
every command follows.

Exit 2 (``CLIError``): the command line itself is wrong (an unknown flag, a value out of its bounds,
flags that do not go together, ``record --layers 99`` on a model of 18 layers). Exit 1 (``InputError``):
the command line is fine but what it names is not: a trace, text, model, prompt or tune file that is
missing, unreadable, malformed or too short, an output that cannot be written. Either way one line on
stderr, ``kvsim: error: ...``, never a traceback and never an exception's class name.

A named input that cannot be used is said as ``FLAG: PATH: problem``, the flag (or the positional's
name, ``TEXT``) first, as typed: ``kvsim: error: --prompt-file: /nope.txt: no such file``
(``input_error``). Every check that needs no model runs before a model loads: the flags, the files,
and for ``record`` the model's layers and the text's length, read from its config and tokenizer
before its weights.
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


def input_error(name: str, e: BaseException) -> InputError:
    """``e`` (whose one-line message names the path and the problem) as the input ``name`` refused:
    ``--trace: /nope.npz: no such file`` (exit 1)."""
    return InputError(f"{name}: {' '.join(str(e).split())}")


def read_input(name: str, path) -> str:
    """The text file an input names (``TEXT``, ``--prompt-file``), or InputError in the one shape:
    ``TEXT: /nope.txt: no such file``."""
    from ..models.errors import RecordError  # a light module; loading imports no torch until a model loads
    from ..models.loading import read_text

    try:
        return read_text(path)
    except RecordError as e:
        raise input_error(name, e) from None


def model_error(e: BaseException) -> CLIError:
    """A RecordError or QualityError (kvsim/models/errors.py) in this convention: a value the command line
    gave out of the model's bounds is a usage error (exit 2); one naming its input (``TEXT``, ``--model``,
    ``--out``) says it first; the rest are inputs that cannot be used (exit 1)."""
    if getattr(e, "usage", False):
        return CLIError(" ".join(str(e).split()))
    if getattr(e, "argument", None):
        return input_error(e.argument, e)
    return InputError(" ".join(str(e).split()))


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

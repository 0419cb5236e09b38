"""``--conversation FILE`` of ``quality``, ``generate`` and ``record``: a context, then turns (a question and its
answer) on one evicting cache (docs/domain.md, "A conversation"; the file: ``kvsim.models.conversation``).

The file is read and checked on its text alone before any model loads (an empty turn, a turn without the answer
a measurement teacher-forces, a file that is not UTF-8 or not JSON, a TEXT argument beside it); the turns' lengths
against the model's context are checked once the tokenizer has loaded, before any pass runs.
"""

from __future__ import annotations

import argparse

from .errors import CLIError, InputError

HELP = ("a conversation file (JSON, UTF-8: a context, then turns of a question and its answer) run on one evicting "
        "cache, turn by turn (docs/cli.md, \"Conversations\")")


def add_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--conversation", default=None, metavar="FILE", help=f"{HELP}; {what}")


def add_prefill_flags(p: argparse.ArgumentParser) -> None:
    """``quality --conversation``'s compressed prompt, named as ``needle`` names it."""
    p.add_argument("--prefill-budget", default=None, metavar="N|RATIO", help="with --conversation: compress the prompt "
                   "once at its end: each head keeps N of its positions, or a ratio in (0, 1) of them, chosen by "
                   "--prefill-policy's score (kvsim.hf prefill='compress'); then --policy at --budget from that kept set, "
                   "every later token teacher-forced through it (the closed loop only)")
    p.add_argument("--prefill-policy", default=None, metavar="NAME[:K=V,...]", help="with --prefill-budget: the policy "
                   "whose score chooses once (default: snapkv, at its defaults), e.g. snapkv:recent_window=8, or "
                   "reconstruction (KVzip: the attention the model's repeat of the context draws; docs/scorers.md)")
    p.add_argument("--query", choices=("aware", "agnostic"), default=None, help="with --prefill-budget: compress the "
                   "context with the first question in the scorer's window (aware, the default) or without it, the "
                   "question fed after the compression (agnostic)")


def compression(args: argparse.Namespace):
    """``--prefill-budget``, ``--prefill-policy`` and ``--query`` as a ``quality_turns.Compression`` (None without
    --prefill-budget), each checked on the flags alone, before any model loads: a budget below 1 position or a ratio
    outside (0, 1), an unknown scorer or parameter, --query or --prefill-policy without --prefill-budget, the open
    loop. The budget against the prompt's length is checked once the tokenizer has loaded, before any pass."""
    from ..sim.prefill import DEFAULT_SCORER, Prefill, PrefillError
    from . import prefill_flags

    if getattr(args, "prefill_budget", None) is None:
        for on, name in ((getattr(args, "prefill_policy", None), "--prefill-policy"), (getattr(args, "query", None), "--query")):
            if on is not None:
                raise CLIError(f"{name} goes with --prefill-budget: without it every position is stepped, with or "
                               "without the question")
        return None
    if args.conversation is None:
        raise CLIError("--prefill-budget goes with --conversation: quality compresses a conversation's prompt")
    from ..models.quality_turns import OPEN_REFUSED, Compression

    if args.mode != "closed":
        raise CLIError(OPEN_REFUSED if args.mode == "open" else OPEN_REFUSED.replace("--mode open", "--mode both"))
    keep = prefill_flags.keep(args.prefill_budget)
    if isinstance(keep, int) and keep < 1:
        raise CLIError(f"--prefill-budget: {keep}: at least 1 position per head (or a ratio in (0, 1) of the prompt)")
    name, params = prefill_flags.scorer(args.prefill_policy or DEFAULT_SCORER)
    try:  # every check that needs no prompt: a stand-in longer than any, the real one after tokenizing
        Prefill.of(2**31, keep, name, **params)
    except PrefillError as e:
        raise CLIError(prefill_flags.say(e)) from None
    return Compression(keep, name, tuple(sorted(params.items())), args.query or "aware")


def read(args: argparse.Namespace, positional: str | None, needs_answers: bool):
    """The conversation of ``--conversation`` (InputError, one line naming the file and the turn), refused beside
    the positional argument ``positional`` names (``args.<positional>``)."""
    from ..models.conversation import ConversationError, load_conversation

    given = getattr(args, positional, None) if positional else None
    if given is not None:
        raise CLIError(f"--conversation {args.conversation}: the file holds the context and the questions; "
                       f"leave out the {positional.upper()} argument ({given!r})")
    try:
        return load_conversation(args.conversation, needs_answers=needs_answers)
    except ConversationError as e:
        raise InputError(f"--conversation {e}") from None


def check_quality(args: argparse.Namespace) -> None:
    """What ``quality --conversation`` refuses before anything loads: flags it does not take, a TEXT beside it, a
    conversation file that cannot run (every turn needs its reference answer here)."""
    from . import cluster_flags, layout_flags

    layout = layout_flags.of(args)
    for on, name in ((args.allocate, "--allocate"), (args.sweep, "--sweep"), (getattr(args, "plan", None), "--plan"),
                     (layout, layout and layout_flags.layout_flags_text(layout)),
                     (cluster_flags.wanted(args), cluster_flags.wanted(args))):
        if on:
            raise CLIError(f"{name} and --conversation: a conversation is measured per --policy and --budget, without a "
                           "layout, split, sweep, plan or cluster")
    read(args, "text", needs_answers=True)
    args.compression = compression(args)


def cmd_quality(args: argparse.Namespace, names: list[str], budgets: list[int], params: dict) -> list[dict] | dict:
    """``quality --conversation FILE``: each turn's delta NLL and KL on its reference answer
    (``kvsim.models.quality_turns``), for every policy, budget and mode asked."""
    from ..models import quality
    from ..models.conversation import ConversationError
    from ..models.loading import require_extra
    from ..models.quality_turns import open_conversation

    if args.model is None:
        require_extra()
    say = None if args.quiet else quality.QUALITY_STDERR
    try:
        session = open_conversation(args.conversation, args.model, progress=say, use_cache=not args.no_cache,
                                    compression=getattr(args, "compression", None))
    except ConversationError as e:
        raise InputError(f"--conversation {e}") from None
    modes = ["closed", "open"] if args.mode == "both" else [args.mode]
    rows = quality.grid(session, names, budgets, modes, params, None, use_cache=not args.no_cache, batch=args.batch,
                        progress=say)
    if not rows:
        raise CLIError(f"{', '.join(names)} cannot run at budget {', '.join(map(str, budgets))} with these parameters")
    return rows[0] if len(rows) == 1 else rows


def render_quality(doc) -> str:
    """Per turn and result: the answer's tokens, the full cache's NLL, the evicted one's, delta NLL and KL."""
    from .tables import aligned

    rows = [doc] if isinstance(doc, dict) else doc
    head = (f"{rows[0]['model']} on {rows[0]['conversation']}: {rows[0]['tokens']} tokens ({rows[0]['context_tokens']} "
            f"of context, then {len(rows[0]['turns'])} turns, answers teacher-forced); each turn's figures on its answer")
    after = (p := rows[0].get("prefill")) is not None
    if after:  # quality_turns.Compression.to_json, as the result holds it
        extra = "".join(f" {k}={v}" for k, v in p["params"].items())
        head += (f"; the prompt compressed once to {p['budget']} by {p['policy']}{extra}, query-{p['query']}, then "
                 "each policy from that kept set (retained mass: over every step, the prompt's held in full included; "
                 "mass_after_prompt: after the first question)")
    cells = []
    for r in rows:
        label = [r["policy"], r["budget"], r["mode"]]
        for t in r["turns"]:
            cells.append([*label, t["turn"], t["answer_tokens"], t["nll_full"], t["nll"], t["delta_nll"], t["kl"], "",
                          *([""] if after else [])])
        cells.append([*label, "all", sum(t["answer_tokens"] for t in r["turns"]), r["nll_full"], r["nll"], r["delta_nll"],
                      r["kl"], r["retained_mass"], *([r["retained_mass_after_prompt"]] if after else [])])
    return head + "\n\n" + aligned(["policy", "budget", "mode", "turn", "answer_tokens", "nll_full", "nll", "delta_nll",
                                    "kl", "retained_mass", *(["mass_after_prompt"] if after else [])], cells)

__all__ = ["add_flag", "add_prefill_flags", "check_quality", "cmd_quality", "compression", "read", "render_quality"]

"""docs/multi-turn.md's study (issue 57, item 5): a pass key per turn on one cache, turn 1 against later turns.

    python kvsim/bench/scripts/multi_turn_study.py measure --out docs/multi-turn-study.json [--models M,...] [--keys K,...]
        [--lengths N,...] [--budgets B,...] [--policies NAME,...] [--trials T] [--no-optimum]
        [--nll open|closed|both|none]
    python -m kvsim.views.multi_turn docs/multi-turn-study.json docs/multi-turn.md

``measure`` runs the grid's conversations (``kvsim.models.needle_conversation``: K keys at ``DEPTHS[K]``, each
named by its owner (the default wording, ``needle_prompt.NEEDLE_NAMED`` and ``QUESTION_NAMED``), turn i asking
for key i, each question fed after what the cache wrote) and writes each cell to ``--out`` as it ends
(atomically), keyed by model, keys, length, budget, configuration and trial: a run that
stops, or a second run over a larger subset, measures only what the file lacks (every conversation also goes
through needle's disk cache). Progress on stderr. The configurations (``CONFIGS``):

- ``snapkv aware`` / ``snapkv agnostic``: the prompt compressed to the budget by snapkv with the first question
  in its observation window or without it, then snapkv decoding at the budget;
- ``reconstruction``: the prompt compressed by the scorer named ``reconstruction`` (KVzip's context
  reconstruction, its own branch), query-agnostic, then snapkv decoding; where this checkout has no such scorer
  the cell is written as not measured, with the reason, and measured by a later run that has it;
- h2o, tova, keydiff, knorm, critical, expected_attention, streaming_llm: the exact prompt, each policy at the
  budget throughout.

With the optimum (the default; ``--no-optimum`` leaves it out), each cell also holds the retained attention mass
of the run and of the exact optimum over the whole conversation at the same budgets (the control's attention).

With ``--nll`` (default ``open``), each cell also gets the delta NLL per turn of the reference answers
teacher-forced (``ANSWER``, after each question of the same context): ``kvsim quality --conversation``'s measure
(``kvsim.models.quality_turns``), run by ``teacher_forced`` and kept apart from the cells, under ``delta_nll`` keyed
by the cell's key and the mode (``nll_key``), so adding it measures nothing of the cells again. An exact-prompt
configuration is measured in the loop ``--nll`` names (open, closed or both). A compressed prompt (snapkv aware /
agnostic, reconstruction) is measured in the closed loop whatever ``--nll`` names but none (``quality --conversation
--prefill-budget B --prefill-policy SCORER --query aware|agnostic``: the context compressed once to the budget by the
configuration's scorer, with the first question in its window or without it, as the cell's run compressed it, then
every question and answer token teacher-forced through that cache; it has no open loop). quality caches each
result on disk under the conversation's tokens, the policy, its parameters, the budget, the mode and the
compression.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from checkout import this_checkout

ROOT = this_checkout(__file__)

from kvsim.data.files import atomic_write  # noqa: E402

MODELS = ("gemma3-270m", "smollm2-135m")
KEYS = (2, 4)
LENGTHS = (1024, 2048)
BUDGETS = (64, 256)
TRIALS = 3
#: each key count's depths, key i at the i-th
DEPTHS = {2: (0.3, 0.7), 4: (0.2, 0.4, 0.6, 0.8)}
#: each turn's reference answer, teacher-forced after its question for the delta NLL (the needle's own words end so)
ANSWER = " {key}."
#: name -> (decode policy, prompt scorer or None for the exact prompt, query mode)
CONFIGS = {
    "snapkv aware": ("snapkv", "snapkv", "aware"),
    "snapkv agnostic": ("snapkv", "snapkv", "agnostic"),
    "reconstruction": ("snapkv", "reconstruction", "agnostic"),
    **{p: (p, None, "aware") for p in ("h2o", "tova", "keydiff", "knorm", "critical", "expected_attention",
                                       "streaming_llm")},
}


def cell_key(model: str, keys: int, length: int, budget: int, config: str, trial: int) -> str:
    return f"{model} | {keys} keys | {length} | {budget} | {config} | trial {trial + 1}"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str, known) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in known]
    if bad:
        raise SystemExit(f"multi_turn_study.py: {bad[0]!r}: not one of {', '.join(known)}")
    return out


def _job(config: str, budget: int):
    from kvsim.models.needle_runs import Job

    policy, scorer, _ = CONFIGS[config]
    return Job(policy, budget, (), None, None if scorer is None else (budget, scorer, ()))


def _missing(config: str) -> str | None:
    """Why ``config`` cannot run in this checkout (its scorer is not registered), or None."""
    from kvsim.policykit.registry import POLICIES, SCORERS

    _, scorer, _ = CONFIGS[config]
    if scorer is not None and scorer not in POLICIES and scorer not in SCORERS:
        return f"the scorer {scorer!r} is not in this checkout"
    return None


def teacher_forced(model, tokenizer, model_id: str, keys: int, length: int, trial: int):
    """The cell's conversation (the needle's context and questions, as ``run_conversation_unit`` builds them) with each
    turn's reference answer (``ANSWER``) after its question, opened as ``quality --conversation`` opens a file: a
    ``ConversationSession`` whose full-cache pass and results are cached on disk under its tokens' digest."""
    from kvsim.models.conversation import Conversation, Turn
    from kvsim.models.conversation_tokens import ConversationTokens, TurnSpan
    from kvsim.models.needle_prompt import Builder, Template, conversation, pass_keys
    from kvsim.models.quality_turns import ConversationSession

    builder = Builder(tokenizer, Template())
    prompt = conversation(builder, length, list(DEPTHS[keys]), pass_keys(0, length, DEPTHS[keys], trial), trial)
    ids, turns, said = list(prompt.context), [], []
    for question, key in zip(prompt.questions, prompt.keys, strict=True):
        answer = builder.encode(ANSWER.format(key=key))[0]
        turns.append(TurnSpan(len(ids), len(ids) + len(question), len(ids) + len(question) + len(answer)))
        ids += list(question) + answer
        said.append(Turn(tokenizer.decode(list(question)), ANSWER.format(key=key)))
    tokens = ConversationTokens(tuple(int(x) for x in ids), len(prompt.context), tuple(turns))
    conv = Conversation(tokenizer.decode(list(prompt.context)), tuple(said), source="needle-conversation")
    return ConversationSession(model, tokens, conv, model_id=model_id, progress=None)


def _summary(cell: dict, run: dict, optimum: bool) -> dict:
    out = {"found": run["found"], "control_found": cell["control"]["found"], "answers": run["answers"],
           "control_answers": cell["control"]["answers"], "keys": cell["keys"],
           "held_to_end": [sum(v is None for row in k for v in row) for k in run["key_left"]],
           "heads": sum(len(row) for row in run["key_left"][0]), "label": run["label"],
           "seconds": run["prefill_seconds"] + run["decode_seconds"], "cached": run["cached"]}
    if optimum:
        out.update({k: run[k] for k in ("retained", "optimal_retained", "retained_after_prompt",
                                        "optimal_retained_after_prompt")})
        out["optimal_held_to_end"] = [sum(v is None for row in k for v in row) for k in run["optimal_key_left"]]
    return out


def nll_key(key: str, mode: str) -> str:
    """Where a cell's delta NLL lies in the study's ``delta_nll``: its cell's key and the mode."""
    return f"{key} | {mode}"


def _nll_summary(session, row: dict) -> dict:
    keep = ("turn", "answer_tokens", "nll_full", "nll", "delta_nll", "kl")
    out = {"model_id": row["model"], "tokens": session.tokens.digest, "answer": ANSWER, "mode": row["mode"],
           "delta_nll": row["delta_nll"], "kl": row["kl"], "retained_mass": row["retained_mass"],
           "turns": [{k: t[k] for k in keep} for t in row["turns"]], "seconds": row["seconds"], "cached": row["cached"]}
    if "prefill" in row:  # a compressed prompt: how, and the mass after the first question (its budget held)
        out.update(prefill=row["prefill"], retained_mass_after_prompt=row["retained_mass_after_prompt"])
    return out


def _modes(config: str, modes: list[str]) -> list[str]:
    """The loops ``config``'s delta NLL is measured in: ``--nll``'s for an exact prompt; the closed loop for a
    compressed one (it has no open loop), unless ``--nll none``."""
    return modes if CONFIGS[config][1] is None else ["closed"] if modes else []


def _measure_nll(doc: dict, loaded, m: str, k: int, n: int, t: int, wanted: list, say) -> None:
    """The delta NLL per turn of every wanted (budget, configuration, mode) of one conversation: ``quality
    --conversation``'s measure (``kvsim.models.quality``'s grid on ``teacher_forced``'s session; a compressed
    prompt's to the budget by the configuration's scorer and query mode, ``quality_turns.Compression``), each result
    also cached on disk by quality, written to the study's ``delta_nll`` as it ends."""
    from kvsim.models import quality
    from kvsim.models.quality_turns import Compression

    session = teacher_forced(*loaded, k, n, t)
    for b, c, mode in wanted:
        policy, scorer, query = CONFIGS[c]
        mine = session.compressed(None if scorer is None else Compression(b, scorer, (), query))
        row = quality.grid(mine, [policy], [b], [mode], progress=None)[0]
        doc["delta_nll"][nll_key(cell_key(m, k, n, b, c, t), mode)] = _nll_summary(session, row)
        _write(doc)
        say(f"delta NLL of {c} @ {b} ({mode} loop) {'read from the cache' if row['cached'] else 'measured'}")


def _measure_found(doc: dict, loaded, m: str, k: int, n: int, t: int, wanted: list, no_optimum: bool, say) -> None:
    """Found, fates and retained mass of every wanted (budget, configuration) of one conversation, each written as
    it ends; a configuration this checkout cannot run is written with the reason."""
    from kvsim.models.needle_conversation import run_conversation_unit
    from kvsim.models.needle_prompt import Template

    cells = doc["cells"]
    for query in ("aware", "agnostic"):
        mine = [(b, c) for b, c in wanted if CONFIGS[c][2] == query]
        for b, c in mine:
            if _missing(c) is not None:
                cells[cell_key(m, k, n, b, c, t)] = {"why": _missing(c)}
        for b, c in [(b, c) for b, c in mine if _missing(c) is None]:  # one at a time, each written as it ends
            cell = run_conversation_unit(*loaded, Template(), n, list(DEPTHS[k]), t, [_job(c, b)], query=query,
                                         optimum=not no_optimum)
            cells[cell_key(m, k, n, b, c, t)] = {"model_id": loaded[2], **_summary(cell, cell["runs"][0], not no_optimum)}
            _write(doc)
            say(f"{c} @ {b} (query-{query}) run(s) {'read from the cache' if cell['runs'][0]['cached'] else 'measured'}")


def measure(args) -> int:
    from kvsim.models.needle_prompt import KEY_NAMES, NEEDLE_NAMED, QUESTION_NAMED
    from kvsim.models.quality import load

    doc = json.loads(Path(args.out).read_text(encoding="utf-8")) if Path(args.out).exists() else {"cells": {}}
    doc["out"] = Path(args.out)
    doc["plan"] = {"models": MODELS, "keys": KEYS, "lengths": LENGTHS, "budgets": BUDGETS, "trials": TRIALS,
                   "depths": {str(k): v for k, v in DEPTHS.items()}, "configs": [[k, *v] for k, v in CONFIGS.items()],
                   "new_tokens": 8, "seed": 0, "needle": NEEDLE_NAMED, "question": QUESTION_NAMED,
                   "names": list(KEY_NAMES), "answer": ANSWER}
    cells, nll = doc["cells"], doc.setdefault("delta_nll", {})
    models, keys, lengths = args.models.split(","), _ints(args.keys), _ints(args.lengths)
    budgets, configs = _ints(args.budgets), _names(args.policies, CONFIGS)
    modes = [] if args.nll == "none" else ["closed", "open"] if args.nll == "both" else [args.nll]
    todo = [(m, k, n, t) for m in models for k in keys for n in lengths for t in range(args.trials)]
    t0 = time.perf_counter()
    for i, (m, k, n, t) in enumerate(todo):
        wanted = [(b, c) for b in budgets for c in configs
                  if cell_key(m, k, n, b, c, t) not in cells or "why" in cells[cell_key(m, k, n, b, c, t)]]
        losses = [(b, c, mode) for b in budgets for c in configs for mode in _modes(c, modes)
                  if nll_key(cell_key(m, k, n, b, c, t), mode) not in nll and _missing(c) is None]
        if not wanted and not losses:
            continue

        def say(what: str, i=i, m=m, k=k, n=n, t=t) -> None:
            print(f"[{i + 1}/{len(todo)}] {m} {k} keys {n} tokens trial {t + 1}: {what}, "
                  f"{time.perf_counter() - t0:.0f} s so far", file=sys.stderr, flush=True)

        loaded = load(m, None)
        _measure_found(doc, loaded, m, k, n, t, wanted, args.no_optimum, say)
        if losses:
            _measure_nll(doc, loaded, m, k, n, t, losses, say)
    _write(doc)
    return 0


def _write(doc: dict) -> None:
    """The study, atomically, to where ``measure`` read it (``doc["out"]``, not written into it)."""
    body = {k: v for k, v in doc.items() if k != "out"}
    atomic_write(doc["out"], lambda f: f.write((json.dumps(body, indent=1, sort_keys=True) + "\n").encode()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="multi_turn_study.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="run the grid (or a subset), resuming from --out")
    m.add_argument("--out", default=str(ROOT / "docs" / "multi-turn-study.json"))
    m.add_argument("--models", default=",".join(MODELS))
    m.add_argument("--keys", default=",".join(map(str, KEYS)))
    m.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    m.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    m.add_argument("--policies", default=",".join(CONFIGS), help="configurations: " + ", ".join(CONFIGS))
    m.add_argument("--trials", type=int, default=TRIALS)
    m.add_argument("--no-optimum", action="store_true")
    m.add_argument("--nll", choices=("open", "closed", "both", "none"), default="open",
                   help="the delta NLL per turn of the exact-prompt configurations, in quality --conversation's "
                        "open or closed loop (default: open); a compressed prompt's in the closed loop, unless none")
    args = p.parse_args(argv)
    bad = [k for k in _ints(args.keys) if k not in DEPTHS]
    if bad:
        raise SystemExit(f"multi_turn_study.py: --keys {bad[0]}: the study's depths are for {', '.join(map(str, DEPTHS))}")
    return measure(args)


if __name__ == "__main__":
    raise SystemExit(main())

"""Which needle and question wording lets the full cache answer a pass key per turn, on the control alone.

docs/needle.md, "A conversation: a pass key per turn": the control alone (transformers' full cache, no policy), 2 keys at depths
0.3 and 0.7 of ``--length`` tokens, turn i asking for key i, per wording and trial.

    python kvsim/bench/scripts/needle_wordings.py [--models M,...] [--wordings W,...] [--trials T] [--length N]

Prints one JSON line per (model, wording, trial): the keys, the answers, found per turn, then per (model,
wording) how many turns found their key. Each conversation goes through needle's disk cache. Wordings
(``WORDINGS``): ``numbered`` ("The pass key number 1 is ..."), ``colour`` and ``colour once`` (the key named
by a colour word, the needle repeated as the one-key needle's, or said once), ``owner`` and ``owner once``
(named by its owner, Anna, Boris, ...; ``owner once`` is the default, ``needle_prompt.NEEDLE_NAMED``).
"""

from __future__ import annotations

import argparse
import json

from checkout import this_checkout

ROOT = this_checkout(__file__)

COLOURS = ("red", "purple", "orange", "silver")
#: name -> (needle, question, the names {name} takes or None for the default ``KEY_NAMES``)
WORDINGS = {
    "numbered": ("The pass key number {n} is {key}. Remember it. {key} is the pass key number {n}.",
                 "What is the pass key number {n}? The pass key number {n} is", None),
    "colour": ("The {name} pass key is {key}. Remember it. {key} is the {name} pass key.",
               "What is the {name} pass key? The {name} pass key is", COLOURS),
    "colour once": ("The {name} pass key is {key}.", "What is the {name} pass key? The {name} pass key is", COLOURS),
    "owner": ("{name}'s pass key is {key}. Remember it. {key} is {name}'s pass key.",
              "What is {name}'s pass key? {name}'s pass key is", None),
    "owner once": ("{name}'s pass key is {key}.", "What is {name}'s pass key? {name}'s pass key is", None),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="needle_wordings.py", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gemma3-270m,smollm2-135m")
    p.add_argument("--wordings", default=",".join(WORDINGS), help="of: " + ", ".join(WORDINGS))
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--length", type=int, default=1024)
    args = p.parse_args(argv)
    wordings = [w.strip() for w in args.wordings.split(",") if w.strip()]
    bad = [w for w in wordings if w not in WORDINGS]
    if bad:
        raise SystemExit(f"needle_wordings.py: --wordings: {bad[0]!r}: not one of {', '.join(WORDINGS)}")

    import kvsim.models.needle_prompt as prompts
    from kvsim.models.needle_conversation import run_conversation_unit
    from kvsim.models.quality import load

    default_names = prompts.KEY_NAMES
    for m in args.models.split(","):
        model, tokenizer, model_id = load(m, None)
        for w in wordings:
            needle, question, names = WORDINGS[w]
            prompts.KEY_NAMES = names or default_names
            try:
                hits = []
                for t in range(args.trials):
                    cell = run_conversation_unit(model, tokenizer, model_id, prompts.Template(), args.length, [0.3, 0.7],
                                                 t, [], needle=needle, question=question)
                    c = cell["control"]
                    hits.append(c["found"])
                    print(json.dumps({"model": m, "wording": w, "trial": t + 1, "keys": cell["keys"],
                                      "answers": c["answers"], "found": c["found"]}), flush=True)
            finally:
                prompts.KEY_NAMES = default_names
            turns = [sum(f[i] for f in hits) for i in range(2)]
            print(f"{m}, {w}: key 1 found in {turns[0]} of {len(hits)}, key 2 in {turns[1]} of {len(hits)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

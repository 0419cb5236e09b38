"""Decode again the pass-key runs the needle cache holds and compare: does this checkout keep what the
code that filled the cache kept?

    python kvsim/bench/scripts/needle_recheck.py POLICY[,POLICY...] [--lengths 512] [--budgets 64,256] [--depths 0.1,0.5,0.9]

Gemma-3-270M as shipped, the built-in filler, seed 0, trial 1 (what ``kvsim needle`` runs at its
defaults). For each cached run of each policy at its default parameters: decoded afresh (the cache is
read, never written), then its tokens and every (layer, KV head)'s departure steps compared with the
cached run's. One line per run; a run the cache does not hold is said and skipped. Exit status 1 if
any run differs. A change to the deployed cache's arithmetic that must not move a decision (a product
batched, a sum moved into a kernel) is checked this way on the real model.
"""

from __future__ import annotations

import argparse
import sys

from checkout import this_checkout

ROOT = this_checkout(__file__)


def _numbers(text: str, kind):
    return [kind(x) for x in text.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policies", help="comma-separated policy names")
    ap.add_argument("--lengths", default="512")
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    args = ap.parse_args()
    try:
        lengths, budgets, depths = _numbers(args.lengths, int), _numbers(args.budgets, int), _numbers(args.depths, float)
    except ValueError as e:
        ap.error(f"--lengths, --budgets and --depths take comma-separated numbers: {e}")
    from kvsim.policies import PolicySpec

    for policy in args.policies.split(","):
        try:
            PolicySpec.of(policy)
        except ValueError as e:
            ap.error(f"policies: {e}")

    import numpy as np

    from kvsim.models import needle, needle_prompt
    from kvsim.models.quality import load

    model, tokenizer, model_id = load(None, None)
    builder = needle_prompt.Builder(tokenizer, needle_prompt.Template())
    eos = getattr(tokenizer, "eos_token_id", None)
    differ = 0
    for policy in args.policies.split(","):
        for length in lengths:
            for budget in budgets:
                for depth in depths:
                    prompt = builder.prompt(length, depth, needle_prompt.pass_key(0, length, depth, 0), 0)
                    key = needle.trial_key(model_id, prompt, policy, budget, {}, needle.NEW_TOKENS, 0)
                    cached = needle.read_trial(key)
                    where = f"{policy} @ {budget}, {length} tokens, depth {depth:g}"
                    if cached is None:
                        print(f"{where}: not in the cache, skipped")
                        continue
                    run = needle.run_trial(model, prompt, policy, budget, {}, seed=0, eos=eos)
                    same = cached["tokens"] == run["tokens"] and np.array_equal(cached["left"], run["left"])
                    differ += not same
                    print(f"{where}: {'the same tokens and departures' if same else 'DIFFERENT'} "
                          f"({run['prefill_seconds']:.1f} s prompt)", flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

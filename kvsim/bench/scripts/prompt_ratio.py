"""One deployed prompt against transformers' full cache, paired run by run (issue 54's fast-prefill figure, closer up
than ``kvsim bench --deploy``, which times every cache three times):

    python kvsim/bench/scripts/prompt_ratio.py [--model smollm2-135m] [--policy h2o] [--prefill fast] [--rounds 7]

One thread. Each round feeds the prompt (``--length`` tokens of the bench's text) to a ``DynamicCache`` under sdpa,
then to ``kvsim.hf.cache(model, POLICY, 256, prefill=PREFILL)`` (h2o at recent_window 32, as the bench deploys it),
and prints both times (wall and process CPU) and their ratio; the last line is the median ratio over the rounds. A
round's two prompts run back to back, so each ratio is taken under one load. To compare two trees on the same load,
copy it into the other checkout and run each copy from its own checkout (``PYTHONPATH=CHECKOUT``), one after the
other.
"""

from __future__ import annotations

import argparse
import statistics
import time

from checkout import this_checkout

ROOT = this_checkout(__file__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=("gemma3-270m", "smollm2-135m"))
    p.add_argument("--policy", default="h2o")
    p.add_argument("--prefill", default="fast", choices=("fast", "exact"))
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=7)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.rounds < 1 or args.length < 1:
        raise SystemExit("prompt_ratio: --rounds and --length must be at least 1")
    import torch

    from kvsim import hf
    from kvsim.bench.deploy import BUDGET, POLICIES, DynamicCacheOf, _feed, _load, use
    from kvsim.bench.generate import text_ids

    torch.set_num_threads(1)
    model, tokenizer = _load(args.model)
    ids, _ = text_ids(tokenizer, args.length)
    params = dict(POLICIES).get(args.policy, {})

    def feed(make, attention: str) -> tuple[float, float]:
        use(model, attention)
        cpu = time.process_time()
        wall = _feed(model, ids, make())[0]
        return wall, time.process_time() - cpu

    def full():
        return feed(lambda: DynamicCacheOf(model), "sdpa")

    def mine():
        return feed(lambda: hf.cache(model, args.policy, BUDGET, prefill=args.prefill, **params), "kvsim")

    full(), mine()  # warm: the first prompt of each compiles and allocates
    ratios = []
    for _ in range(args.rounds):
        (fw, fc), (mw, mc) = full(), mine()
        ratios.append(mw / fw)
        print(f"full {fw:.2f} s ({fc:.2f} s CPU)  {args.policy} {args.prefill} {mw:.2f} s ({mc:.2f} s CPU)  "
              f"ratio {mw / fw:.3f}", flush=True)
    print(f"{args.model} {args.length} tokens, {args.policy} {args.prefill} against the full cache: median ratio "
          f"{statistics.median(ratios):.3f} over {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How many key tokens LongPPL's rule selects (kvsim.models.quality, docs/proxies.md "Which proxy predicts the
key-token loss"), per model and text, at the study's steps, under the rule and two looser thresholds: what
the key-token loss of the study averages over.

    OMP_NUM_THREADS=1 PYTHONPATH=. python kvsim/bench/scripts/key_token_counts.py [--steps 512] [--models gemma3-270m,smollm2-135m]

The full-cache and short-window passes are read from the disk cache where the study left them (else
measured, and kept); progress on stderr, one Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import sys

from checkout import this_checkout

from kvsim.cli.proxies_command import DEFAULT_MODELS, DEFAULT_TEXTS
from kvsim.models import quality
from kvsim.models.truth import TEXTS_DIR
from kvsim.progress import stderr

this_checkout(__file__)

#: (alpha, beta) in nats: LongPPL's rule first, then a smaller gain, then a less confident full cache
RULES = ((quality.KEY_ALPHA, quality.KEY_BETA), (1.0, quality.KEY_BETA), (quality.KEY_ALPHA, -4.0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--texts", default=",".join(DEFAULT_TEXTS))
    args = p.parse_args(argv)
    say = stderr("key_token_counts")
    heads = [f"alpha {a:g}, beta {b:g}" for a, b in RULES]
    print(f"| model | text | positions | {' | '.join(heads)} |")
    print(f"| --- | --- | ---: | {' | '.join('---:' for _ in RULES)} |")
    for model in args.models.split(","):
        loaded = quality.load(model, say)
        for text in args.texts.split(","):
            s = quality.open_session(TEXTS_DIR / text, args.steps, model_and_tokenizer=loaded, progress=say)
            full, short = s.nll_full_series, s.nll_short_series()
            counts = [int(quality.key_token_mask(full, short, a, b).sum()) for a, b in RULES]
            # positions 1 .. N-1 carry a loss; those before the short window sees all they see cannot gain
            print(f"| {model} | {text} | {len(full)} (of which {max(0, len(full) - s.short_window)} past the "
                  f"{s.short_window}-position window) | {' | '.join(map(str, counts))} |")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

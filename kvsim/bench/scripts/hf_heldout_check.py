"""The issue's held-out check for kvsim.hf on the shipped Gemma-3-270M (tests/test_hf.py runs it on tiny
models): the first 16 tokens of heapq.py, streaming_llm with 4 sinks at budget 32, 96 greedy tokens
through ``model.generate(cache=kvsim.hf.cache(...))`` against a loop that recomputes the whole sequence
every step with the full cache masked to StreamingLLM's schedule. About 2 minutes on one core here.

    python kvsim/bench/scripts/hf_heldout_check.py
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    from checkout import this_checkout

    sys.path.insert(0, str(this_checkout(__file__) / "tests"))  # the suite's helpers: modules of tests/, not a package
    import test_hf
    import torch

    import kvsim.hf as hf
    from kvsim.models.loading import load_model
    from kvsim.models.texts import heapq_path, tokenize

    torch.set_num_threads(1)
    model, tokenizer = load_model(None)
    ids = tokenize(tokenizer, heapq_path(), test_hf.PROMPT - 1)  # <bos> and 15 tokens
    forward = model.forward
    model.forward = lambda *a, **k: forward(*a, **{**k, "logits_to_keep": 1})  # 262k words x 112 rows: keep one
    t0 = time.perf_counter()
    expected = test_hf._masked_reference(model, ids, test_hf.NEW)
    model.forward = forward
    t1 = time.perf_counter()
    cache = hf.cache(model, "streaming_llm", test_hf.BUDGET, sinks=test_hf.SINKS)
    new = {"cache": cache, "max_new_tokens": test_hf.NEW, "min_new_tokens": test_hf.NEW, "do_sample": False}
    out = model.generate(ids, **new)[0, test_hf.PROMPT:].tolist()
    t2 = time.perf_counter()
    model.set_attn_implementation("eager")
    del new["cache"]
    full = model.generate(ids, **new)[0, test_hf.PROMPT:].tolist()
    first = next((i for i, (a, b) in enumerate(zip(full, out, strict=True)) if a != b), None)
    print(f"same tokens as the masked full-cache loop: {out == expected}; peak positions per layer: {cache.peak_positions}")
    print(f"the unevicted cache's tokens differ from token {first} on; reference {t1 - t0:.0f} s, kvsim.hf {t2 - t1:.0f} s")
    print(repr(tokenizer.decode(out)))


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()

"""The reconstruction scorer's extra prefill cost, and whether it keeps a pass key that snapkv without the
question loses (issue 57, item 3; docs/scorers.md, "reconstruction"):

    OMP_NUM_THREADS=1 python kvsim/bench/scripts/reconstruction_cost.py [--lengths 1024,2048] [--repeat 3] [--keep 64]

Gemma-3-270M as shipped, in one sitting. **Cost**: per length, the compressed prefill of a pass-key prompt
(``kvsim.hf.decoding.prefill`` into ``kvsim.hf.cache(model, "none", prefill="compress", prefill_budget=KEEP,
prefill_policy=...)``), snapkv and reconstruction in turn, ``--repeat`` rounds after one short warm-up of each; the
reconstruction figure includes its scoring pass (the context, then the repeat prompt and the context again),
which is also timed alone. Medians. **Quality** (``--key-length``, default 1,024; depth 0.5; trial 0): the
prompt's context (everything before the question) compressed alone to KEEP positions per (layer, KV head), the
question fed as a second forward call, snapkv at ``--budget`` (64) decoding from the kept set, 8 tokens greedy;
the same with the whole prompt compressed at once (snapkv with the question in its observation window); and the
full cache. Per run: the key found or not, and the (layer, KV head)s that kept every position of the key's
digits right after compression. The load average is printed before and after: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from checkout import this_checkout

ROOT = this_checkout(__file__)
SCORERS = ("snapkv", "reconstruction")


def _compressed(model, policy, budget, keep, scorer):
    import kvsim.hf as hf

    return hf.cache(model, policy, budget, prefill="compress", prefill_budget=keep, prefill_policy=scorer)


def cost(model, tokenizer, lengths, keep, repeat) -> list[dict]:
    import torch

    from kvsim.hf import decoding, reconstruction
    from kvsim.models import needle_prompt

    builder = needle_prompt.Builder(tokenizer, needle_prompt.Template())
    warm = torch.tensor([builder.prompt(2 * keep, 0.5, "12345").ids])
    for scorer in SCORERS:  # one warm-up of each, on a short prompt (the repeat prompt's tokenizer read once)
        decoding.prefill(model, warm, _compressed(model, "none", None, keep, scorer))
    rows = []
    for n in lengths:
        ids = torch.tensor([builder.prompt(n, 0.5, needle_prompt.pass_key(0, n, 0.5, 0)).ids])
        times = {s: [] for s in (*SCORERS, "scoring pass")}
        for _ in range(repeat):
            for scorer in SCORERS:
                cache = _compressed(model, "none", None, keep, scorer)
                t = time.perf_counter()
                decoding.prefill(model, ids, cache)
                times[scorer].append(time.perf_counter() - t)
            t = time.perf_counter()
            reconstruction.reconstruction_scores(model, ids, reconstruction.model_repeat_ids(model))
            times["scoring pass"].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"tokens": n, **{f"{k}_s": round(v, 2) for k, v in med.items()},
                     "ratio": round(med["reconstruction"] / med["snapkv"], 2)})
        print(f"{n:>6} tokens  snapkv {med['snapkv']:6.2f} s  reconstruction {med['reconstruction']:6.2f} s "
              f"({rows[-1]['ratio']:.2f}x)  its scoring pass alone {med['scoring pass']:6.2f} s", flush=True)
    return rows


def _decode(model, cache, out, steps: int = 8) -> list[int]:
    import torch

    tokens = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(int(nxt[0, 0]))
            out = model(nxt, cache=cache, use_cache=True)
    return tokens


def quality(model, tokenizer, n, keep, budget) -> list[dict]:
    import torch
    from transformers import DynamicCache

    from kvsim.hf import decoding
    from kvsim.models import needle_prompt

    builder = needle_prompt.Builder(tokenizer, needle_prompt.Template())
    prompt = builder.prompt(n, 0.5, needle_prompt.pass_key(0, n, 0.5, 0))
    ids = torch.tensor([prompt.ids])
    q = len(builder.question)
    context, question = ids[:, :-q], ids[:, -q:]
    digits = list(prompt.key_positions)
    runs = [("full cache", None, None, False), *((f"{s}, question as a second call", s, budget, True) for s in SCORERS),
            ("snapkv, question in view (one call)", "snapkv", budget, False)]
    rows = []
    for label, scorer, b, split in runs:
        if scorer is None:
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                out = model(ids, cache=cache, use_cache=True)
            kept = None
        else:
            cache = _compressed(model, "snapkv", b, keep, scorer)
            out = decoding.prefill(model, context if split else ids, cache)
            heads = [(layer, h) for layer in cache.layers for h in range(layer.kv_heads)]
            kept = sum(all(p in set(layer.held(0, h).tolist()) for p in digits) for layer, h in heads)
            kept = f"{kept}/{len(heads)}"
            if split:
                with torch.no_grad():
                    out = model(question, cache=cache, use_cache=True)
        text = tokenizer.decode(_decode(model, cache, out))
        found = needle_prompt.answer(text) == prompt.key
        rows.append({"run": label, "found": found, "answer": text.strip(), "heads_keeping_the_key": kept})
        print(f"{label:>40}  {'found' if found else 'not found':>9}  key kept whole in {kept or '-':>6} (layer, KV "
              f"head)s  answer {text.strip()!r}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,2048", help="prompt lengths of the cost (default: 1024,2048)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds after the warm-up (default: 3)")
    ap.add_argument("--keep", type=int, default=64, help="prefill_budget: positions kept per head (default: 64)")
    ap.add_argument("--budget", type=int, default=64, help="snapkv's decode budget in the quality check (default: 64)")
    ap.add_argument("--key-length", type=int, default=1024, help="the quality check's prompt length (default: 1024)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]

    from kvsim.models.quality import load

    print(f"load average {os.getloadavg()[0]:.2f} at the start; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    model, tokenizer, _ = load(None, None)
    rows = cost(model, tokenizer, lengths, args.keep, args.repeat)
    checks = quality(model, tokenizer, args.key_length, args.keep, args.budget)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    print(json.dumps({"keep": args.keep, "budget": args.budget, "cost": rows, "quality": checks}))


if __name__ == "__main__":
    main()

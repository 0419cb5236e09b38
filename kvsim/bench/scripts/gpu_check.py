"""The deployed cache's tensor path on a GPU (issue 54, item 5), one prepared run for a lent machine:

1. equality: a tiny Llama, a tiny Gemma 3 (sliding layers) and the shipped Gemma-3-270M, each policy with a
   tensor step, a prompt over the budget then greedy tokens, on the device and on the CPU: the same tokens and
   the same held sets in every layer and KV head (the CPU's reference path is what tests/test_hf_tensor.py
   holds the tensor path to);
2. cost: the shipped model at 8k and 32k prompt tokens, transformers' full cache (sdpa) against h2o and
   streaming_llm at budget 256 on the tensor path: prefill seconds, decode milliseconds per token (median of
   16), peak device memory (``torch.cuda.max_memory_allocated`` of each run, from a reset).

    python kvsim/bench/scripts/gpu_check.py [--device cuda] [--lengths 8000,32000] [--skip-cost] [--json OUT]

Without a CUDA device it says so in one line and exits 2, before loading anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    from checkout import this_checkout

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="the device to check (default: cuda)")
    ap.add_argument("--lengths", default="8000,32000", help="prompt tokens of the cost part (default: 8000,32000)")
    ap.add_argument("--skip-cost", action="store_true", help="only the equality part")
    ap.add_argument("--json", default=None, metavar="OUT", help="also write the figures as JSON to OUT")
    args = ap.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing was checked",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(this_checkout(__file__) / "tests"))  # the suite's tiny models
    doc = {"device": args.device, "torch": torch.__version__, "equality": [], "cost": []}
    if args.device.startswith("cuda"):
        doc["gpu"] = torch.cuda.get_device_name(0)
    ok = equality(args.device, doc)
    if not args.skip_cost:
        cost(args.device, [int(x) for x in args.lengths.split(",")], doc)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    print("equality:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def _run(model, ids, policy, budget, params, device, tensor, new):
    import kvsim.hf as hf
    from kvsim.hf.decoding import greedy

    model.to(device)
    cache = hf.cache(model, policy, budget, tensor=tensor, **params)
    out = greedy(model, ids.to(device), cache, new)
    heads = cache.layers[0].kv_heads
    return out["tokens"], [[layer.held(0, h).tolist() for h in range(heads)] for layer in cache.layers]


def equality(device: str, doc: dict) -> bool:
    import torch
    from test_hf import _prompt, _tiny
    from test_hf_tensor import TENSOR_POLICIES

    from kvsim.models.loading import load_model

    ok = True
    shipped, tokenizer = load_model(None)
    text = "The heap queue algorithm keeps the smallest item at the root. " * 40
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False).input_ids[:299]]])
    cases = [("tiny llama", lambda: _tiny("llama"), _prompt(40), 16, 30),
             ("tiny gemma3", lambda: _tiny("gemma3"), _prompt(40), 16, 30),
             ("gemma-3-270m", lambda: shipped, ids, 64, 12)]
    for name, make, prompt, budget, new in cases:
        for policy, params in TENSOR_POLICIES:
            if name == "gemma-3-270m" and "recent_window" in params:
                params = {**params, "recent_window": 16}
            t0 = time.perf_counter()
            cpu = _run(make(), prompt, policy, budget, params, "cpu", False, new)
            there = _run(make(), prompt, policy, budget, params, device, True, new)
            same = cpu == there
            ok &= same
            doc["equality"].append({"model": name, "policy": policy, "same": same,
                                    "seconds": round(time.perf_counter() - t0, 1)})
            print(f"{name:14s} {policy:15s} {'same' if same else 'DIFFERENT'}", flush=True)
    shipped.to("cpu")
    return ok


def cost(device: str, lengths: list[int], doc: dict) -> None:
    import torch
    from transformers import DynamicCache

    import kvsim.hf as hf
    from kvsim.bench.generate import text_ids
    from kvsim.hf.decoding import prefill
    from kvsim.models.loading import load_model

    model, tokenizer = load_model(None)
    model.to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for length in lengths:
        ids, _ = text_ids(tokenizer, length + 16)
        ids = ids.to(device)
        for name, make in (("full", lambda: DynamicCache(config=model.config)),
                           ("h2o", lambda: hf.cache(model, "h2o", 256, recent_window=32)),
                           ("streaming_llm", lambda: hf.cache(model, "streaming_llm", 256))):
            if name == "full":
                model.set_attn_implementation("sdpa")
            cache = make()
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                prefill(model, ids[:, :length], cache)
            sync()
            pre = time.perf_counter() - t0
            steps = []
            with torch.no_grad():
                for t in range(length, length + 15):
                    t0 = time.perf_counter()
                    model(ids[:, t : t + 1], cache=cache, use_cache=True)
                    sync()
                    steps.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
            row = {"length": length, "cache": name, "prefill_seconds": round(pre, 2),
                   "decode_ms": round(1000 * statistics.median(steps), 2), "peak_bytes": peak}
            doc["cost"].append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m kvsim bench --generate``: decoding with kvsim.hf's evicting cache against transformers' own.

The shipped Gemma-3-270M (float32, eager attention) on one CPU thread, at each context length L: the
first ``L - G`` tokens of a text are the prompt, then the next ``G`` tokens are decoded one forward pass
each, teacher-forced on the text, so every cache is scored on the same continuation (the text's own:
its NLL is known). The caches decode in lockstep (``lockstep``): on a shared machine the ratios are
then measured under one load. For each cache it reports the prefill time, decoding tokens per second (one over the
median time of a decoding step's forward pass: the machine is shared), the bytes of
keys and values held at the end (the full cache's only grows, so that is its peak; kvsim's is
allocated once at the budget), the most positions any layer held, and the continuation's NLL against
the full cache's (delta NLL).

The full cache is ``transformers.DynamicCache(config=...)``: Gemma 3's sliding layers keep only their
512-position window there, the global ones everything. kvsim's prompt is fed ``exact`` (position by
position, as decoding would show it to the policy) unless ``prefill="fast"``.

The text: CPython's own ``Lib/heapq.py`` (the shipped traces' text) and then, for longer contexts, more
standard-library modules in the order of ``TEXT_FILES``, from the interpreter running this.

Target: at the shortest length, kvsim's decoding is within 25% of the full cache's tokens per second,
and at the longer lengths no slower than it; the figures are wall-clock on whatever machine runs this.
"""

from __future__ import annotations

import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from ..progress import Progress

LENGTHS = (2048, 4096, 8192)
DECODE = 256
BUDGETS = (256, 1024)
POLICIES = ("h2o", "streaming_llm")
TEXT_FILES = ("heapq.py", "textwrap.py", "statistics.py", "fractions.py", "difflib.py")
#: kvsim's decoding speed at the shortest length, at least this share of the full cache's
SHORT_SHARE = 0.75


def text_ids(tokenizer, tokens: int):
    """``(1, tokens)`` ids: ``<bos>`` then the standard-library modules of ``TEXT_FILES``, concatenated."""
    import torch

    lib = Path(sysconfig.get_paths()["stdlib"])
    text, used = "", []
    ids: list[int] = []
    for name in TEXT_FILES:
        text += (lib / name).read_text(encoding="utf-8")
        used.append(name)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) + 1 >= tokens:
            break
    if len(ids) + 1 < tokens:
        raise RuntimeError(f"the texts {', '.join(used)} give {len(ids) + 1} tokens, fewer than {tokens}")
    return torch.tensor([[tokenizer.bos_token_id, *ids[: tokens - 1]]]), used


def lockstep(model, ids, prompt: int, caches: dict) -> dict:
    """Prefill ``ids[:, :prompt]`` into every cache of ``caches`` (``{name: cache}``; ``"full"`` runs on
    transformers' eager attention, the rest on kvsim's), then decode the rest one token per forward
    pass, every cache taking its step before any takes the next (in an order that rotates), so a load
    that comes and goes on a shared machine falls on all of them alike. Per cache: the prompt's
    seconds, decoding tokens per second (one over the median step), the continuation's NLL and what the
    cache held."""
    import torch

    from ..hf.attention import attach
    from ..hf.decoding import prefill as feed_prompt

    def use(name: str) -> None:
        model.set_attn_implementation("eager") if name == "full" else attach(model)

    names, n = list(caches), ids.shape[1]
    out, prefill_s, steps, nll = {}, {}, {k: [] for k in names}, {k: [] for k in names}
    with torch.no_grad():
        for name in names:
            use(name)
            t0 = time.perf_counter()
            out[name] = feed_prompt(model, ids[:, :prompt], caches[name])
            prefill_s[name] = time.perf_counter() - t0
        for i, t in enumerate(range(prompt, n)):
            for name in names[i % len(names):] + names[: i % len(names)]:
                lp = torch.log_softmax(out[name].logits[0, -1].float(), dim=-1)
                nll[name].append(-float(lp[ids[0, t]]))
                if t + 1 < n:
                    use(name)
                    t0 = time.perf_counter()
                    out[name] = model(ids[:, t : t + 1], cache=caches[name], use_cache=True)
                    steps[name].append(time.perf_counter() - t0)
    return {k: {"prefill_seconds": prefill_s[k], "decode_seconds": sum(steps[k]),
                "tokens_per_second": 1 / statistics.median(steps[k]), "nll": sum(nll[k]) / len(nll[k]),
                "cache_bytes": cache_bytes(caches[k]), "peak_positions": max(held(caches[k]))} for k in names}


def cache_bytes(cache) -> int:
    """Bytes of the keys and values a cache holds (kvsim's: its storage, allocated at the budget)."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    return int(sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None))


def held(cache) -> list[int]:
    """Positions per layer: kvsim's peak, the full cache's (which only grows) at the end."""
    if hasattr(cache, "peak_positions"):
        return cache.peak_positions
    return [layer.keys.shape[-2] for layer in cache.layers if layer.keys is not None]


def run(lengths=LENGTHS, decode_tokens: int = DECODE, budgets=BUDGETS, policies=POLICIES, prefill: str = "exact",
        progress: Progress | None = None) -> dict:
    """Every (length, cache) above, in one document."""
    import torch
    from transformers import DynamicCache

    from .. import hf
    from ..models.loading import load_model

    def say(note: str) -> None:
        if progress is not None:
            progress(None, note)

    torch.set_num_threads(1)
    model, tokenizer = load_model(progress)
    ids_all, used = text_ids(tokenizer, max(lengths) + 1)
    doc = {"kind": "generate", "model": "gemma-3-270m (shipped, float32, eager)", "threads": 1, "prefill": prefill,
           "decode_tokens": decode_tokens, "text": used, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
           "torch": torch.__version__}, "rows": []}
    for length in lengths:
        ids, prompt = ids_all[:, : length + 1], length - decode_tokens
        configs = [(p, b) for b in budgets for p in policies]
        say(f"L={length}: the full cache and kvsim's {', '.join(f'{p}@{b}' for p, b in configs)}, in lockstep")
        caches = {"full": DynamicCache(config=model.config),
                  **{f"{p}@{b}": hf.cache(model, p, b, prefill=prefill) for p, b in configs}}
        measured = lockstep(model, ids, prompt, caches)
        full = measured["full"]
        doc["rows"].append({"length": length, "cache": "full", **full, "delta_nll": 0.0})
        say(_row(doc["rows"][-1]))
        for p, b in configs:
            r = measured[f"{p}@{b}"]
            doc["rows"].append({"length": length, "cache": f"{p}@{b}", "policy": p, "budget": b, **r,
                                "delta_nll": r["nll"] - full["nll"],
                                "speed_vs_full": r["tokens_per_second"] / full["tokens_per_second"]})
            say(_row(doc["rows"][-1]))
    doc["targets"] = targets(doc)
    doc["result"] = "PASS" if all(doc["targets"].values()) else "FAIL"
    return doc


def targets(doc: dict) -> dict:
    """At the shortest length every kvsim cache decodes at ``SHORT_SHARE`` of the full cache's speed or
    better; at every longer length at its speed or better."""
    rows = [r for r in doc["rows"] if r["cache"] != "full"]
    if not rows:
        return {}
    short = min(r["length"] for r in rows)
    out = {f"L={short}: kvsim within {1 - SHORT_SHARE:.0%} of full speed":
           all(r["speed_vs_full"] >= SHORT_SHARE for r in rows if r["length"] == short)}
    for length in sorted({r["length"] for r in rows} - {short}):
        out[f"L={length}: kvsim at least full speed"] = all(r["speed_vs_full"] >= 1.0 for r in rows if r["length"] == length)
    return out


def _row(r: dict) -> str:
    """One measured row, as the table prints it (and the progress note says it when it is measured, so a
    run stopped early still leaves its figures in the log)."""
    vs = f"{r['speed_vs_full']:.2f}x" if "speed_vs_full" in r else ""
    return (f"{r['length']:>6}  {r['cache']:<20}{r['prefill_seconds']:>10.1f}{r['tokens_per_second']:>8.2f}{vs:>9}"
            f"{r['cache_bytes'] / (1 << 20):>11.1f}{r['peak_positions']:>10}{r['nll']:>8.3f}{r['delta_nll']:>+9.3f}")


def render(doc: dict) -> str:
    lines = [f"kvsim bench --generate: {doc['model']}, {doc['threads']} thread ({doc['machine']['cpus']} CPUs, "
             f"torch {doc['machine']['torch']}); prompt L - {doc['decode_tokens']}, then {doc['decode_tokens']} tokens "
             f"decoded teacher-forced on the text ({' + '.join(doc['text'])}); kvsim prefill {doc['prefill']}",
             "",
             f"{'L':>6}  {'cache':<20}{'prefill s':>10}{'tok/s':>8}{'vs full':>9}{'cache MiB':>11}{'peak pos':>10}"
             f"{'NLL':>8}{'dNLL':>9}"]
    lines += [_row(r) for r in doc["rows"]]
    lines += ["", "targets:", *(f"  {k}  {'PASS' if ok else 'FAIL'}" for k, ok in doc["targets"].items()),
              f"overall: {doc['result']}"]
    return "\n".join(lines)

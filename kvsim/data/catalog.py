"""Where a trace comes from, by name: the one place the CLI and the app turn ``--trace`` into a Trace.

A spec is ``canonical`` (the calibrated synthetic trace), the stem of a file shipped in the repo's
``traces/`` folder (``traces/<stem>.npz``), a path to an interchange ``.npz`` or to a query/key trace
(``*.qk.npz``, ``kvsim.data.qk``). A bundle (a recorded
model: ``traces/<name>/manifest.json`` when shipped, or any folder with a manifest) is named by its
name or path; one of its traces by ``BUNDLE:L05`` (layer 5) or ``BUNDLE:L05H1`` (layer 5, KV head 1).
"""

from __future__ import annotations

from pathlib import Path

from .bundle import MANIFEST, Bundle, BundleError, is_bundle, load_bundle, parse_selector
from .store import cache_dir, canonical_trace, file_trace  # generated (or decoded) once, then read from the user cache directory
from .trace import Trace, TraceError, load_npz

CANONICAL = "canonical"
#: the recordings' folder inside the cache directory (docs/caches.md)
RECORDINGS_DIR = "recordings"
#: the shipped traces; read at call time so tests can point it elsewhere
TRACES_DIR = Path(__file__).resolve().parents[2] / "traces"


def shipped_traces() -> dict[str, Path]:
    """Stem -> path of every ``traces/*.npz``, sorted by stem."""
    if not TRACES_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(TRACES_DIR.glob("*.npz")) if p.is_file() and p.stem != CANONICAL}


def available_traces() -> list[str]:
    """Every name ``resolve_trace`` accepts without a path: canonical first, then the shipped stems."""
    return [CANONICAL, *shipped_traces()]


def shipped_bundles() -> dict[str, Path]:
    """Name -> folder of every shipped bundle, ``traces/<name>/manifest.json``, sorted by name."""
    if not TRACES_DIR.is_dir():
        return {}
    return {p.parent.name: p.parent for p in sorted(TRACES_DIR.glob(f"*/{MANIFEST}")) if p.is_file()}


def available_bundles() -> list[str]:
    """Every shipped bundle's name (``resolve_bundle`` also takes the recorded ones, ``recorded_bundles``)."""
    return list(shipped_bundles())


def recorded_bundles() -> dict[str, Path]:
    """Name -> folder of every finished recording kept in the cache directory
    (``<cache_dir>/recordings/<name>/manifest.json``: ``kvsim record --preset long`` and any ``kvsim
    record`` without ``--out``), sorted by name. What this machine has recorded, so never in a test's
    expectations unless the test points the cache directory elsewhere."""
    root = cache_dir() / RECORDINGS_DIR
    if not root.is_dir():
        return {}
    return {p.parent.name: p.parent for p in sorted(root.glob(f"*/{MANIFEST}")) if p.is_file()}


def resolve_bundle(spec: str) -> Bundle:
    """A shipped bundle's name, a recorded one's (``recorded_bundles``) or a bundle folder's path.
    Raises BundleError (one line)."""
    spec = str(spec).strip()
    shipped = shipped_bundles()
    if spec in shipped:
        return load_bundle(shipped[spec])
    path = Path(spec)
    if path.is_dir() or "/" in spec or "\\" in spec:
        return load_bundle(path)
    recorded = recorded_bundles()
    if spec in recorded:
        return load_bundle(recorded[spec])
    raise BundleError(f"unknown bundle {spec!r}: not a shipped bundle ({', '.join(shipped) or 'none shipped'}), "
                      "a recording in the cache directory or a folder holding a manifest.json")


def _bundle_spec(spec: str) -> bool:
    return spec in shipped_bundles() or is_bundle(spec) or spec in recorded_bundles()


def resolve_trace(spec: str) -> Trace:
    """``canonical``, a shipped trace's stem, a path to an ``.npz``, or one trace of a bundle
    (``BUNDLE:L05``, ``BUNDLE:L05H1``). Raises TraceError (one line)."""
    spec = str(spec).strip()
    if spec == CANONICAL:
        return canonical_trace()
    shipped = shipped_traces()
    if spec in shipped:  # decoded once into the cache directory, then read from there
        return file_trace(shipped[spec], load_npz)
    selector = parse_selector(spec)
    if selector is not None and _bundle_spec(selector[0]):
        base, layer, head = selector
        return resolve_bundle(base).load(layer, head)
    if _bundle_spec(spec):
        bundle = resolve_bundle(spec)
        first = bundle.traces[0]
        raise TraceError(f"{spec} is a bundle of {bundle.describe()}: name one trace, e.g. {spec}:L{first.layer:02d} "
                         f"or {spec}:{first.label} (layer, KV head), or use a command that takes a bundle (tune)")
    path = Path(spec)
    if spec.endswith(".qk.npz"):  # kvsim.data.qk_files.SUFFIX: its reader loads only for such a file
        from .qk_files import load_qk

        return load_qk(path)
    # anything that looks like a path goes to the loader, whose error names the file and the problem
    if path.exists() or path.suffix == ".npz" or "/" in spec or "\\" in spec:
        return load_npz(path)
    raise TraceError(
        f"unknown trace {spec!r}: not {CANONICAL!r}, a shipped trace ({', '.join(shipped) or 'none shipped'}), "
        "a bundle's trace (BUNDLE:L05) or a path to an .npz file"
    )

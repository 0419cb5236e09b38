"""Where a trace comes from, by name: the one place the CLI and the app turn ``--trace`` into a Trace.

A spec is ``canonical`` (the calibrated synthetic trace), the stem of a file shipped in the repo's
``traces/`` folder (``traces/<stem>.npz``), or a path to an interchange ``.npz``.
"""

from __future__ import annotations

from pathlib import Path

from .cache import canonical_trace  # generated once, then read from the user cache directory
from .trace import Trace, TraceError, load_npz

CANONICAL = "canonical"
#: the shipped traces; read at call time so tests can point it elsewhere
TRACES_DIR = Path(__file__).resolve().parent.parent / "traces"


def shipped_traces() -> dict[str, Path]:
    """Stem -> path of every ``traces/*.npz``, sorted by stem."""
    if not TRACES_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(TRACES_DIR.glob("*.npz")) if p.is_file() and p.stem != CANONICAL}


def available_traces() -> list[str]:
    """Every name ``resolve_trace`` accepts without a path: canonical first, then the shipped stems."""
    return [CANONICAL, *shipped_traces()]


def resolve_trace(spec: str) -> Trace:
    """``canonical``, a shipped trace's stem, or a path to an ``.npz``. Raises TraceError (one line)."""
    spec = str(spec).strip()
    if spec == CANONICAL:
        return canonical_trace()
    shipped = shipped_traces()
    if spec in shipped:
        return load_npz(shipped[spec])
    path = Path(spec)
    # anything that looks like a path goes to the loader, whose error names the file and the problem
    if path.exists() or path.suffix == ".npz" or "/" in spec or "\\" in spec:
        return load_npz(path)
    raise TraceError(
        f"unknown trace {spec!r}: not {CANONICAL!r}, a shipped trace ({', '.join(shipped) or 'none shipped'}) "
        "or a path to an .npz file"
    )

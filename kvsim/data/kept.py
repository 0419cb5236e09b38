"""What the cache would hold for the shipped traces, shipped with the repo (``traces/kept/*.json``), so that a
fresh install reads it instead of computing it (issue 56: the first visit of *Choosing recent_window* on a
shipped real trace replayed its curves, its reference lines and the exact optimum for 20-42 s).

Each file holds cache documents under the names the cache keys them by, with the trace's part of the name
replaced by the trace's ``content_key`` (its attention's fingerprint, its per-position members and its meta):

- ``<content key>/<name>-<digest>.json``: what ``kvsim.data.store.derived`` keeps beside a trace's entry
  (``<entry>-<name>-<digest>.json``: a summary, a recent_window sweep, the claims ledger, the features), the
  digest the same function of the analysis's arguments and of the version of the code that made it;
- ``tuning/unit-<digest>.json``: a bundle trace's tuning (``kvsim.analysis.tune_sweep.kept_unit``), keyed
  by the file's bytes and the code already.

So an edit of the engine, a policy or an analysis changes the digest as it changes the cache's, the shipped
document is no longer found, and the value is computed as before (and a test says the data needs writing
again: ``python -m kvsim.app.ship_kept``). An upload that is a copy of a shipped trace has the same content
key, so it reads them too. Nothing here is ever written by the app; a missing or damaged file is no file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import numpy as np

#: the folder of the shipped documents, read at call time (tests point it elsewhere)
KEPT_DIR = Path(__file__).resolve().parents[2] / "traces" / "kept"
#: set (to anything) to read nothing shipped: what the generator and a test of the computed values use
OFF_ENV = "KVSIM_NO_SHIPPED_CACHE"


def enabled() -> bool:
    return not os.environ.get(OFF_ENV)


@functools.cache
def _documents(folder: str) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for path in sorted(Path(folder).glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            entries = doc["entries"]
            if isinstance(entries, dict):
                found.update({str(k): v for k, v in entries.items() if isinstance(v, dict)})
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
            continue  # a damaged file ships nothing
    return found


def documents() -> dict[str, dict]:
    """Every shipped document by its name (empty when turned off or none ship)."""
    return _documents(str(KEPT_DIR)) if enabled() else {}


@functools.cache
def _keys(folder: str) -> frozenset[str]:
    return frozenset(name.split("/", 1)[0] for name in _documents(folder) if not name.startswith("tuning/"))


def content_key(trace) -> str | None:
    """What a trace's shipped documents are named by: a digest of its attention's fingerprint, its members
    (``VECTOR_KEYS``) and its meta, so a copy of a shipped file (an upload) has the same one wherever it
    was read from. None for a trace whose attention is not at hand whole (a long query/key trace)."""
    from .derived import TraceStore
    from .trace import VECTOR_KEYS

    store = trace.derived
    if type(store) is not TraceStore:
        return None
    known = getattr(store, "_content_key", None)
    if known is not None:
        return known
    digest = hashlib.blake2b(trace.fingerprint.encode(), digest_size=12)
    for name in sorted(VECTOR_KEYS):
        array = getattr(trace, name, None)
        if array is None:
            continue
        array = np.ascontiguousarray(array)
        digest.update(f"\0{name}|{array.shape}|{array.dtype.str}\0".encode())
        digest.update(array.data)
    try:
        meta = json.dumps(_round_trip(trace.meta), sort_keys=True)
    except (TypeError, ValueError):
        return None
    digest.update(b"\0meta\0" + meta.encode())
    store._content_key = digest.hexdigest()
    return store._content_key


def derived(trace, file_name: str) -> dict | None:
    """The shipped document of ``store.derived``'s file ``<entry>-<file_name>`` for this trace, or None.
    The trace is hashed only when some trace's documents ship (once per trace object)."""
    docs = documents()
    if not docs:
        return None
    key = content_key(trace)
    if key is None or key not in _keys(str(KEPT_DIR)):
        return None
    return docs.get(f"{key}/{file_name}")


def tuning(file_name: str) -> dict | None:
    """The shipped ``tuning/<file_name>`` document, or None."""
    return documents().get(f"tuning/{file_name}")


def _round_trip(value):
    """What ``value`` reads back as after a JSON round trip (tuples become lists): how the cache keys it."""
    return json.loads(json.dumps(value))

"""A replay's summary (``ReplayResult.summary()``: the policy's retained mass and top-k recall over the
trace) kept on disk beside the trace's cache entry (``kvsim.data.store.derived``), so that a fresh process
reads what an earlier one measured instead of replaying again. Most replays take milliseconds; a few
take most of a minute (expected_attention at its default refresh of 1 on a 4096-step shipped trace: its
scores are refreshed for every held position at every step), and the app drew such a line again after
every server start (issue 43).

A summary depends on the trace (its cache entry's name already holds the file's or the generator's
identity, and so the members a policy reads), the policy's name, budget and parameters, the top-k, and
the code that replays: ``code_version`` is a digest of every module of ``kvsim.sim``, ``kvsim.policies``
and ``kvsim.data``, of ``kvsim.jit``, and of the policy's own module (a plugin lives elsewhere), so an edit
of any of them makes every summary measured afresh. A trace without a cache entry (an upload, a generated
trace) is replayed every time, as before.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from pathlib import Path

from ..data import store
from ..policies.registry import policy_class
from ..policies.spec import PolicySpec

#: the packages whose code a replay runs
_PACKAGE = Path(__file__).resolve().parent.parent
_CODE = ("sim", "policies", "data")
#: the analysis's name in the file beside the trace (``<stem>-summary-<digest>.json``)
NAME = "summary"


@functools.cache
def _package_digest() -> str:
    files = [_PACKAGE / "jit.py", *sorted(p for d in _CODE for p in (_PACKAGE / d).rglob("*.py"))]
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(_PACKAGE)).encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def code_version(name: str) -> str:
    """The digest of the code that replays policy ``name``: kvsim's engine, policies and data modules and the
    policy's own module file."""
    own = Path(inspect.getfile(policy_class(name))).resolve()
    return _package_digest() + "-" + store.source_version(str(own))


def _params(spec: PolicySpec, top_k: int) -> dict:
    return {"policy": spec.name, "budget": spec.budget, "params": spec.kwargs, "top_k": top_k}


def summary(trace, spec: PolicySpec, top_k: int) -> dict:
    """``kvsim.replay(trace, spec, top_k=top_k).summary()``, read from beside the trace's cache entry when an
    earlier process measured it with the same code."""
    from . import simulate

    return store.derived(trace, NAME, _params(spec, top_k), code_version(spec.name),
                         lambda: simulate.replay(trace, spec, top_k=top_k).summary())


def stored(trace, spec: PolicySpec, top_k: int) -> dict | None:
    """The summary an earlier process kept, or None (nothing is replayed)."""
    return store.derived_stored(trace, NAME, _params(spec, top_k), code_version(spec.name))

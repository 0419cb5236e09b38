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
from ..policykit.registry import policy_class
from ..policykit.spec import PolicySpec

#: the packages whose code a replay runs
_PACKAGE = Path(__file__).resolve().parent.parent
_CODE = ("sim", "policies", "policykit", "data")
#: the analysis's name in the file beside the trace (``<stem>-summary-<digest>.json``)
NAME = "summary"
#: a sweep's rows beside the trace (``<stem>-sweep-<digest>.json``)
SWEEP = "sweep"


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


def sweep(trace, policy, budget: int | None = None, param: str | None = None, values=(), *, top_k: int,
          progress=None, **params) -> list[dict]:
    """``kvsim.sim.simulate.sweep`` of one policy spec over ``param``, its rows read from beside the trace's
    cache entry when an earlier process swept the same values with the same code (the app's recent_window
    curves, replayed afresh after every server start before: 3 s of a first visit to the curve view on the
    canonical trace). Any other call (a name with ``budget`` and ``params``, a list of specs) is swept as
    given, nothing kept; ``progress`` hears only a sweep that runs."""
    from . import simulate

    values = [int(v) for v in values]
    if not isinstance(policy, PolicySpec) or budget is not None or params or param is None:
        return simulate.sweep(trace, policy, budget, param, values, top_k=top_k, progress=progress, **params)
    fixed = {k: v for k, v in policy.kwargs.items() if k != param}
    key = {"policy": policy.name, "budget": None if param == "budget" else policy.budget, "params": fixed,
           "param": param, "values": values, "top_k": top_k}

    def decode(record: dict) -> list[dict]:
        rows = record["rows"]
        if not isinstance(rows, list) or len(rows) != len(values) or not all(isinstance(r, dict) for r in rows) or \
                [r.get(param) for r in rows] != values:
            raise ValueError("not this sweep's rows")
        return rows

    return store.derived(trace, SWEEP, key, code_version(policy.name),
                         lambda: simulate.sweep(trace, policy, None, param, values, top_k=top_k, progress=progress),
                         encode=lambda rows: {"rows": rows}, decode=decode)

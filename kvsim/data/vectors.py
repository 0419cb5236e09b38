"""What a trace holds besides attention: the per-position vectors the key-, value- and query-aware
policies read (docs/domain.md, "Scorers beyond attention").

Each member is position-major, row ``p`` for position ``p`` (0 .. T):

- ``keys`` ``(T + 1, d)``: the KV head's keys, post-RoPE, as the model stores them;
- ``values`` ``(T + 1, d_v)``: its values;
- ``queries`` ``(T + 1, G, d)``: the post-RoPE queries of its G query heads (position t's query is
  the one that attends at step t);
- ``out_norms`` ``(T + 1, G)``: for each query head h of the group, ``|W_O^h v_p|_2``, the norm of
  position p's value after the layer's output projection for that head (CriticalKV's weight).

A dense trace carries those it was saved with (``Trace.keys`` ...); a query/key trace carries keys,
values and queries by construction. ``require`` hands a policy the members it ``reads`` or refuses the
trace in one line naming the member that is missing and how to record it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from .trace import Trace, TraceError

#: the members, in the order the docs list them
MEMBERS = ("keys", "values", "queries", "out_norms")

#: how a trace gets each member: what the one-line refusal tells the user to run
HOW = {
    "keys": "record it with `kvsim record --vectors` (or --store qk, which always holds queries, keys and values)",
    "values": "record it with `kvsim record` (every recording stores values)",
    "queries": "record it with `kvsim record --vectors` (or --store qk, which always holds queries, keys and values)",
    "out_norms": "record it with `kvsim record --vectors` (or --store qk): it stores the output projection's "
                 "per-head norms",
}


def of(trace: Trace, name: str) -> np.ndarray | None:
    """Member ``name`` of ``trace``, position-major, or None when the trace has none."""
    if name not in MEMBERS:
        raise ValueError(f"unknown trace member {name!r}; known: {', '.join(MEMBERS)}")
    return getattr(trace, name, None)


def require(trace: Trace, names: Iterable[str], who: str) -> dict[str, np.ndarray]:
    """The members ``names`` of ``trace`` (``who``: the policy that reads them, for the message); a
    ``TraceError`` naming the trace, the first missing member and how to record it."""
    out = {}
    for name in names:
        array = of(trace, name)
        if array is None:
            raise TraceError(f"{trace.name}: policy {who} reads {name}, which this trace does not hold; {HOW[name]}")
        if array.shape[0] != trace.steps + 1:
            raise TraceError(f"{trace.name}: {name} has {array.shape[0]} positions, expected {trace.steps + 1}")
        out[name] = array
    return out


def at(members: Mapping[str, np.ndarray], pos: int) -> dict[str, np.ndarray]:
    """Position ``pos``'s row of each member: what ``Policy.see(pos, ...)`` is handed."""
    return {name: array[pos] for name, array in members.items()}


def missing(trace: Trace, names: Iterable[str], meta: bool = False) -> list[str]:
    """The members of ``names`` that ``trace`` does not hold (the app greys out what it cannot replay);
    with ``meta`` (a policy that ``reads_meta``: expected_attention), also the RoPE its meta must state."""
    out = [n for n in names if of(trace, n) is None]
    if meta and trace.meta.get("rope_inv_freq") is None:
        out.append("RoPE (meta rope_inv_freq)")
    return out

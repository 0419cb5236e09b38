"""A run's plan: what every command and the deployed cache need to know to run one configuration, as one
frozen, hashable value: the decode policy at its budget and parameters (a ``PolicySpec``), the split of the
memory over (layer, KV head) (an allocator's name, or the budgets themselves), and the prompt's compression
at its end (how many positions each head keeps, chosen by which policy's score). Made once from the flags
(``kvsim.cli.run_plan``), the app's controls (its "this run's plan" download) or a file; read by ``replay``,
``sweep``, ``table``, ``quality``, ``generate``, ``needle`` (``--plan FILE``) and ``kvsim.hf.cache(plan=...)``.

Its JSON (``Plan.to_dict``) is a superset of an allocation file: the ``allocation`` rows (``layer``,
``kv_head``, ``budget``) are what ``--allocate FILE`` reads, so a plan with a split is also a split file::

    {"kvsim_plan": 1, "policy": "h2o", "budget": 256, "params": {"recent_window": 32},
     "allocate": null, "allocation": null,
     "compression": {"keep": 0.5, "policy": "snapkv", "params": {}, "prompt_length": null}}

A conversation's plan (``kvsim needle --keys K``; docs/needle.md, "A conversation: a pass key per turn") also
says its turns and how the prompt's compression sees the first question, each written only when set, so a plan
without them reads and writes as before::

     "keys": 2, "compression": {..., "query": "agnostic"}

A plan may also name a serving layout (``kvsim.policykit.layouts``; docs/serving.md), written only when there is
one, so a plan without it reads and writes as before::

     "layout": {"block_size": 16, "shared_selection": false, "evict_every": 1}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..allocation.split import ALLOCATORS
from ..data import jsontext
from .base import ParamError
from .layouts import Layout, LayoutError
from .registry import POLICIES, SCORERS, suggest
from .spec import ParamValues, PolicySpec

FORMAT = 1
#: how a compressed prompt sees a conversation's first question (``kvsim.hf.conversation.QUERY``): the first, the default
QUERY = ("aware", "agnostic")
#: the policy name that lets the cache grow after a compressed prompt (``kvsim.sim.prefill.GROW``)
GROW = "none"
#: a plan is a small document; anything larger is refused before it is read
MAX_BYTES = 4 * 1024 * 1024


class PlanError(ValueError):
    """A plan that cannot be used: one line naming where it came from, the field and the problem."""


@dataclass(frozen=True)
class Compression:
    """The prompt compressed once at its end: each (layer, KV head) keeps ``keep`` of its positions (an
    integer, or a share in (0, 1) of the prompt), chosen by ``policy``'s score at ``params``."""

    keep: int | float
    policy: str = "snapkv"
    #: the scorer's parameters as given (``compression.params.recent_window``), in name order
    params: ParamValues = ParamValues()
    prompt_length: int | None = None
    #: aware: the first question in the compressed call (the scorer's window); agnostic: the context alone
    query: str = QUERY[0]

    def __post_init__(self) -> None:
        if type(self.params) is not ParamValues:
            object.__setattr__(self, "params", ParamValues(self.params))

    @property
    def scorer(self) -> str:
        """``NAME[:param=N,...]``, the form ``--prefill-policy`` takes."""
        return self.policy + (":" + ",".join(f"{k}={v}" for k, v in self.params) if self.params else "")

    def to_dict(self) -> dict:
        query = {} if self.query == QUERY[0] else {"query": self.query}
        return {"keep": self.keep, "policy": self.policy, "params": dict(self.params), "prompt_length": self.prompt_length,
                **query}


@dataclass(frozen=True)
class Plan:
    """One run: ``policy`` (None: the cache grows after the compressed prompt), ``allocate`` (an allocator's
    name) or ``allocation`` (``(layer, kv_head, budget)`` rows), and ``compression``."""

    policy: PolicySpec | None
    allocate: str | None = None
    allocation: tuple[tuple[int, int, int], ...] | None = None
    compression: Compression | None = None
    #: the serving layout (None: none; ``Layout()`` is read as None, so equal plans stay equal)
    layout: Layout | None = None
    #: a conversation's keys, one a turn (``needle --keys``; None: no conversation)
    keys: int | None = None

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout.plain:
            object.__setattr__(self, "layout", None)

    def to_dict(self) -> dict:
        p = self.policy
        layout = {} if self.layout is None else {"layout": self.layout.to_dict()}
        return {
            "kvsim_plan": FORMAT,
            "policy": GROW if p is None else p.name,
            "budget": None if p is None else p.budget,
            "params": {} if p is None else dict(p.params),
            "allocate": self.allocate,
            "allocation": None if self.allocation is None else
            [{"layer": x, "kv_head": h, "budget": b} for x, h, b in self.allocation],
            "compression": None if self.compression is None else self.compression.to_dict(),
            **layout,
            **({} if self.keys is None else {"keys": self.keys}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @property
    def budgets(self) -> dict[tuple[int, int], int] | None:
        """The split as ``{(layer, kv_head): budget}`` (what ``kvsim.hf.cache(allocate=...)`` takes), or None."""
        return None if self.allocation is None else {(x, h): b for x, h, b in self.allocation}

    @classmethod
    def from_dict(cls, doc, where: str = "plan") -> Plan:
        """The plan ``doc`` states, every field checked; PlanError (``where: field: problem``) otherwise."""
        if not isinstance(doc, dict) or doc.get("kvsim_plan") != FORMAT:
            raise PlanError(f"{where}: not a kvsim plan (an object with \"kvsim_plan\": {FORMAT})")
        unknown = sorted(set(doc) - {"kvsim_plan", "policy", "budget", "params", "allocate", "allocation", "compression",
                                   "layout", "keys"})
        if unknown:
            raise PlanError(f"{where}: unknown field {unknown[0]!r}")
        name = doc.get("policy")
        keys = doc.get("keys")
        if keys is not None and (type(keys) is not int or keys < 1):
            raise PlanError(f"{where}: keys: a conversation's number of keys (an integer from 1), got {keys!r}")
        compression = _compression(doc.get("compression"), where)
        layout = _layout(doc.get("layout"), where)
        if name == GROW and layout is not None:
            raise PlanError(f"{where}: layout: policy 'none' lets the cache grow: no layout")
        if name == GROW:
            if compression is None:
                raise PlanError(f"{where}: policy: 'none' (the cache growing) needs a compression")
            if doc.get("budget") is not None or doc.get("params") or doc.get("allocate") or doc.get("allocation"):
                raise PlanError(f"{where}: policy: 'none' lets the cache grow: no budget, params or split")
            return cls(None, compression=compression, keys=keys)
        spec = _spec(name, doc.get("budget"), doc.get("params", {}), where, "")
        allocate, rows = doc.get("allocate"), doc.get("allocation")
        if allocate is not None and rows is not None:
            raise PlanError(f"{where}: allocate and allocation: give one (a split by name, or its rows)")
        if allocate is not None and allocate not in ALLOCATORS:
            raise PlanError(f"{where}: allocate: {allocate!r} is not an allocator ({', '.join(ALLOCATORS)})")
        if layout is not None:
            try:
                layout.check(spec.name, spec.budget, spec.params)
            except (ParamError, ValueError) as e:
                raise PlanError(f"{where}: layout: {' '.join(str(e).split())}") from None
        return cls(spec, allocate, None if rows is None else _rows(rows, where), compression, layout, keys)

    @classmethod
    def read(cls, path) -> Plan:
        """The plan in the JSON file ``path``; PlanError naming the file for anything else."""
        if not Path(path).is_file():
            raise PlanError(f"{path}: no such file")
        return cls.from_dict(jsontext.read_file(path, MAX_BYTES, PlanError, "a plan's limit"), str(path))


def _spec(name, budget, params, where: str, field: str) -> PolicySpec:
    scorer = field == "compression." and isinstance(name, str) and name in SCORERS  # a scorer that needs the model
    if not isinstance(name, str) or (name not in POLICIES and not scorer):
        raise PlanError(f"{where}: {field}policy: {name!r} is not a registered policy{suggest(str(name))}")
    if not scorer and POLICIES[name].needs_trace:
        raise PlanError(f"{where}: {field}policy: {name} is an offline reference (it reads the future); a plan runs online")
    if not isinstance(params, dict) or not all(isinstance(k, str) and type(v) is int for k, v in params.items()):
        raise PlanError(f"{where}: {field}params: an object of integer parameters")
    if type(budget) is not int:
        raise PlanError(f"{where}: {field}budget: an integer is needed, got {budget!r}")
    try:
        return PolicySpec.of(name, budget, **params)
    except (ParamError, ValueError) as e:
        raise PlanError(f"{where}: {field}{' '.join(str(e).split())}") from None


def _layout(doc, where: str) -> Layout | None:
    if doc is None:
        return None
    try:
        layout = Layout.from_dict(doc, f"{where}: layout")
    except (LayoutError, ParamError) as e:
        raise PlanError(" ".join(str(e).split())) from None
    return None if layout.plain else layout


def _rows(rows, where: str) -> tuple[tuple[int, int, int], ...]:
    if not isinstance(rows, list) or not rows:
        raise PlanError(f"{where}: allocation: a non-empty list of rows (layer, kv_head, budget)")
    out, seen = [], set()
    for i, r in enumerate(rows):
        if not (isinstance(r, dict) and all(type(r.get(k)) is int for k in ("layer", "kv_head", "budget"))):
            raise PlanError(f"{where}: allocation[{i}]: integer 'layer', 'kv_head' and 'budget' are needed")
        key = (r["layer"], r["kv_head"])
        if key in seen:
            raise PlanError(f"{where}: allocation[{i}]: layer {key[0]} KV head {key[1]} is listed twice")
        if r["budget"] < 1:
            raise PlanError(f"{where}: allocation[{i}]: budget {r['budget']} is below 1")
        seen.add(key)
        out.append((r["layer"], r["kv_head"], r["budget"]))
    return tuple(sorted(out))


def _compression(doc, where: str) -> Compression | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise PlanError(f"{where}: compression: an object (keep, policy, params, prompt_length) or null")
    unknown = sorted(set(doc) - {"keep", "policy", "params", "prompt_length", "query"})
    if unknown:
        raise PlanError(f"{where}: compression: unknown field {unknown[0]!r}")
    keep = doc.get("keep")
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or keep <= 0 or (isinstance(keep, float) and keep >= 1):
        raise PlanError(f"{where}: compression.keep: a number of positions (1 or more) or a share in (0, 1), got {keep!r}")
    name = doc.get("policy", "snapkv")
    params = doc.get("params", {})
    # checked as the scorer would be at a budget it can always hold (its windows below it), online
    _spec(name, 10**9, params, where, "compression.")
    prompt = doc.get("prompt_length")
    if prompt is not None and (type(prompt) is not int or prompt < 2):
        raise PlanError(f"{where}: compression.prompt_length: an integer of 2 or more, got {prompt!r}")
    query = doc.get("query", QUERY[0])
    if query not in QUERY:
        raise PlanError(f"{where}: compression.query: {query!r}: one of {', '.join(QUERY)} (with the first question in "
                        "the compressed call or without it)")
    return Compression(keep, name, tuple(sorted(params.items())), prompt, query)


__all__ = ["FORMAT", "QUERY", "Compression", "Plan", "PlanError"]

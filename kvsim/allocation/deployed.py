"""A budget per (layer, KV head) for the deployed cache: an allocator's split computed from the model's
shape, or a split given as data (``{(layer, kv_head): budget}``, or the ``allocation`` rows of
``python -m kvsim replay --allocate NAME --json``), checked against the model before any token.

Static splits deploy, and those whose split needs nothing but the model's shape are computed here:
``uniform`` and ``pyramidkv`` (``kvsim.allocation.split``, the arithmetic ``kvsim.allocation.allocators``
builds on). ``cake``, ``duo`` and ``optimal`` read a recorded bundle's attention; their split comes from
a replay's ``--json``. ``adakv`` is no split but a pool per layer: ``kvsim.hf.cache(..., allocate="adakv")``
builds it (``kvsim.hf.pooled``); ``adakv_refusal`` says when it cannot.
"""

from __future__ import annotations

from pathlib import Path

from ..data import jsontext
from ..hf.cache import HFError
from ..policies import PolicySpec
from ..policykit import registry
from ..policykit.base import WINDOW
from . import split as al

#: allocators whose split this module computes from the model's shape alone
FROM_SHAPE = ("uniform", "pyramidkv")


#: allocators the deployed cache builds as a pool per layer rather than a split
POOLED = ("adakv",)


def refusal(name: str) -> str | None:
    """Why the deployed cache cannot take allocator ``name`` by name (one line), None when it can (adakv:
    ``adakv_refusal`` says more once the policy and the model are known)."""
    if name in FROM_SHAPE or name in POOLED:
        return None
    if name in al.ALLOCATORS:
        return (f"{name} computes its split from a recorded bundle's attention; run python -m kvsim replay --trace "
                f"BUNDLE --allocate {name} --budget B --json > split.json and deploy split.json")
    return f"{name!r} is neither an allocator ({', '.join(FROM_SHAPE)} deploy by name) nor an allocation file"


def adakv_refusal(policy: str, kv_heads: int | None = None, shape: str = "the model has 1 KV head per layer") -> str | None:
    """Why adakv cannot deploy ``policy`` on a model of ``kv_heads`` KV heads per layer (None: not known
    yet), one line; None when it can."""
    if not registry.can_pool(policy):
        return f"{registry.missing(policy, 'pools_heads', 'adakv')} (use {' or '.join(registry.poolers())})"
    if kv_heads == 1:
        return (f"adakv pools a layer's KV heads, and with one KV head per layer the pool is that head: adakv is "
                f"uniform within a layer on this model ({shape}); use uniform, pyramidkv or a split file")
    return None


def read_file(path) -> tuple[dict[tuple[int, int], int], str | None]:
    """An allocation file's budgets and the policy it was computed for (``split.read_allocation``);
    HFError, one line naming the file, for anything else."""
    try:
        return al.read_allocation(path)
    except al.AllocationError as e:
        raise HFError(str(e)) from None


def pooled_file(path) -> str | None:
    """Why an allocation file (already read by ``read_file``) cannot deploy as a split: adakv's rows are each
    head's share of a pool (``"pooled": true``, what ``replay --allocate adakv --json`` writes); None otherwise."""

    doc = jsontext.loads(Path(path).read_text(encoding="utf-8"))
    if isinstance(doc, dict) and doc.get("pooled") is True:
        return (f"{path}: adakv's pool (each row is a head's share, 'pooled': true), not a split of budgets; deploy "
                "the pool itself with --allocate adakv (allocate='adakv') at its budget")
    return None


def _minimum(policy: str, params: dict) -> tuple[int, PolicySpec]:
    loose = PolicySpec.of(policy, 10**9, **params)  # the parameters checked, whatever the budget
    return al.minimum_budget(loose), loose


def _head_params(params: dict, windows: dict | None, layer: int, head: int) -> dict:
    """``params`` with the recent_window ``windows`` sets for (layer, head) (``{layer: w}`` or ``{(layer, head): w}``)."""
    w = None if not windows else windows.get((layer, head), windows.get(layer))
    return params if w is None else {**params, WINDOW: w}


def check_minimum(budgets: dict[tuple[int, int], int], policy: str, params: dict, where: str,
                  windows: dict | None = None) -> None:
    """Every head's budget at least the policy's minimum with ``params`` (and that head's window from
    ``windows``): HFError naming the head and the minimum."""
    for (layer, head), b in sorted(budgets.items()):
        low, loose = _minimum(policy, _head_params(params, windows, layer, head))
        if b < low:
            raise HFError(f"{where}: layer {layer} KV head {head}: budget {b} is below "
                          f"{al.minimum_why(PolicySpec(policy, b, loose.params))}")


def split(allocate, policy: str, budget: int | None, layers: int, kv_heads: int, params: dict,
          model: str = "the model", windows: dict | None = None) -> dict[tuple[int, int], int]:
    """Each (layer, KV head)'s budget on a model of ``layers`` x ``kv_heads``: ``allocate`` is an
    allocator's name (at ``budget`` per head on average, uniform's memory), a path to an allocation
    file, or a mapping ``{(layer, kv_head): budget}``; ``windows``: each layer's or head's recent_window,
    which sets its minimum. HFError, one line, for a split that cannot
    deploy: an allocator that needs a bundle, another model's shape, a head below the policy's minimum."""
    where = "allocate"
    if isinstance(allocate, (str, Path)) and str(allocate) in al.ALLOCATORS:
        name = str(allocate)
        if name in POOLED:
            raise HFError(f"allocate={name}: a pool per layer, not a split of budgets; kvsim.hf.cache(model, policy, "
                          f"budget, allocate={name!r}) builds it")
        why = refusal(name)
        if why is not None:
            raise HFError(f"allocate={name}: {why}")
        if budget is None:
            raise HFError(f"allocate={name} splits budget x {layers * kv_heads} heads; give the budget")
        shape = [(x, h) for x in range(layers) for h in range(kv_heads)]
        check_minimum(dict.fromkeys(shape, budget), policy, params, f"allocate={name}", windows)
        n, total = len(shape), budget * len(shape)
        if name == "uniform":
            return dict.fromkeys(shape, budget)
        schedule = al.pyramid_schedule(budget, layers)
        weights = [schedule[x] for x, _ in shape]
        # one floor for every head, the highest of their minimums: integer_split takes one
        low = max(_minimum(policy, _head_params(params, windows, x, h))[0] for x, h in shape)
        got = al.integer_split(weights, total, low, total - low * (n - 1))
        return {(x, h): int(got[x * kv_heads + h]) for x in range(layers) for h in range(kv_heads)}
    if isinstance(allocate, (str, Path)):
        where = str(allocate)
        budgets, made_for = read_file(allocate)
        if (why := pooled_file(allocate)) is not None:
            raise HFError(why)
        if made_for is not None and made_for != policy:
            raise HFError(f"{where}: a split made for {made_for}, the policy is {policy}")
    elif isinstance(allocate, dict):
        budgets = {}
        for k, b in allocate.items():
            ok = (isinstance(k, tuple) and len(k) == 2 and all(type(v) is int for v in k) and type(b) is int)
            if not ok:
                raise HFError(f"allocate: {k!r}: {b!r}: keys must be (layer, kv_head) integers, budgets integers")
            budgets[k] = b
    else:
        raise HFError(f"allocate must be an allocator's name, an allocation file or {{(layer, kv_head): budget}}, "
                      f"got {type(allocate).__name__}")
    shape = {(x, h) for x in range(layers) for h in range(kv_heads)}
    missing, extra = sorted(shape - set(budgets)), sorted(set(budgets) - shape)
    if missing or extra:
        def shown(hs):
            return ", ".join(f"layer {x} KV head {h}" for x, h in hs[:3]) + (" ..." if len(hs) > 3 else "")
        what = f"has {shown(extra)}, which it lacks" if extra else f"lacks {shown(missing)}"
        raise HFError(f"{where}: an allocation for another model's shape ({len(budgets)} rows; {model} has {layers} "
                      f"layers x {kv_heads} KV head{'s' if kv_heads != 1 else ''}): it {what}")
    check_minimum(budgets, policy, params, where, windows)
    total = sum(budgets.values())
    if budget is not None and total != budget * len(shape):
        raise HFError(f"{where}: the split holds {total} positions, not budget {budget} x {len(shape)} heads = "
                      f"{budget * len(shape)}; give no budget to deploy the split as it is")
    return budgets


__all__ = ["FROM_SHAPE", "POOLED", "adakv_refusal", "pooled_file", "read_file", "refusal", "split"]

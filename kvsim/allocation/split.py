"""The arithmetic of a budget split across (layer, KV head), which needs nothing but numbers and the
registry: the allocators' names, the least budget a policy's parameters allow per head, PyramidKV's
schedule and the integer split in proportion to weights. ``kvsim.allocation.allocators`` builds the
allocators on it (those that read a bundle's attention among them); the deployed cache
(``kvsim.allocation.deployed``), below analysis, computes its shape-only splits with it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..data import jsontext
from ..policykit.registry import POLICIES
from ..policykit.spec import PolicySpec

ALLOCATORS = ("uniform", "pyramidkv", "cake", "adakv", "duo", "optimal")
PYRAMID_BETA = 20
PYRAMID_WINDOW = 8
#: adakv's floor per head, a share of the budget (Ada-KV's alpha); never below the policy's minimum
ADAKV_ALPHA = 0.2
#: an allocation file is a small table; refuse anything larger before reading it
MAX_FILE_BYTES = 4 * 1024 * 1024


class AllocationError(ValueError):
    """A request that cannot be allocated; one line naming what and why (before any replay)."""


def minimum_budget(spec: PolicySpec) -> int:
    """The smallest budget ``spec``'s parameters allow (a window must be below the budget)."""
    cls = POLICIES[spec.name]
    below = [spec[p.name] for p in cls.tunables if p.below_budget]
    return max([1, *(v + 1 for v in below)])


def adakv_floor(spec: PolicySpec, low: int | None = None) -> int:
    """The fewest positions a head of an adakv pool keeps: ``max(policy minimum, ceil(ADAKV_ALPHA x budget))``
    (``low``: the policy's minimum when the caller has it already)."""
    return max(minimum_budget(spec) if low is None else low, math.ceil(ADAKV_ALPHA * spec.budget))


def minimum_why(spec: PolicySpec) -> str:
    cls = POLICIES[spec.name]
    below = [(p.name, spec[p.name]) for p in cls.tunables if p.below_budget]
    if not below:
        return f"{spec.name}'s minimum of 1 position"
    name, value = max(below, key=lambda x: x[1])
    return f"{spec.name}'s minimum of {value + 1} positions per head ({name} {value} + 1)"


def integer_split(weights: np.ndarray, total: int, low: int, high: int) -> np.ndarray:
    """Integers between ``low`` and ``high`` summing to ``total``, in proportion to ``weights`` where the
    bounds allow (``clip(lam x weights)``, ``lam`` found by bisection); the fractions go, largest first
    (the lower index on ties), to the heads below ``high``. Weights equal to the ideal budgets come
    back unchanged wherever they are integers within the bounds."""
    w = np.asarray(weights, dtype=np.float64)
    n = w.size
    if not low * n <= total <= high * n:
        raise AllocationError(f"{total} positions cannot be split over {n} heads between {low} and {high}")
    w = np.maximum(w, 0.0)
    if w.sum() == 0:
        w = np.ones(n)
    lo, hi = 0.0, 1.0
    while np.clip(hi * w, low, high).sum() < total:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if np.clip(mid * w, low, high).sum() < total:
            lo = mid
        else:
            hi = mid
    x = np.clip(hi * w, low, high)
    out = np.floor(x + 1e-9).astype(np.int64)
    out = np.clip(out, low, high)
    short = total - int(out.sum())
    order = np.argsort(-(x - out), kind="stable")
    i = 0
    while short > 0:
        j = order[i % n]
        if out[j] < high:
            out[j] += 1
            short -= 1
        i += 1
    i = 0
    order = np.argsort(x - out, kind="stable")
    while short < 0:
        j = order[i % n]
        if out[j] > low:
            out[j] -= 1
            short += 1
        i += 1
    return out


def pyramid_schedule(B: int, n_layers: int) -> np.ndarray:
    """PyramidKV's budget of each of ``n_layers`` layers at average ``B`` (float: the window plus the
    reference code's integer schedule beyond it, first layer the most)."""
    if n_layers == 1:
        return np.array([float(B)])
    room = max(B - PYRAMID_WINDOW, 0)
    low = room // PYRAMID_BETA
    high = room * 2 - low
    step = (high - low) // (n_layers - 1)
    return np.array([PYRAMID_WINDOW + high - i * step for i in range(n_layers)], dtype=np.float64)


def read_allocation(path) -> tuple[dict[tuple[int, int], int], str | None]:
    """An allocation file's budgets and the policy it was computed for (None if it does not say): a
    JSON list of rows ``{layer, kv_head, budget}`` or a document with them as ``allocation`` (what
    ``kvsim replay --allocate NAME --json`` writes). AllocationError, one line starting with the
    path, for anything else; the CLI and the deployed cache say it in their own terms."""
    p = Path(path)
    if not p.is_file():
        raise AllocationError(f"{path}: no such file (and not an allocator: {', '.join(ALLOCATORS)})")
    doc = jsontext.read_file(p, MAX_FILE_BYTES, AllocationError)
    rows = doc.get("allocation") if isinstance(doc, dict) else doc
    if not isinstance(rows, list) or not rows:
        raise AllocationError(f"{path}: 'allocation' must be a non-empty list of rows (layer, kv_head, budget)")
    budgets: dict[tuple[int, int], int] = {}
    for i, r in enumerate(rows):
        if not (isinstance(r, dict) and all(type(r.get(k)) is int for k in ("layer", "kv_head", "budget"))):
            raise AllocationError(f"{path}: allocation[{i}] must have integer 'layer', 'kv_head' and 'budget'")
        key = (r["layer"], r["kv_head"])
        if key in budgets:
            raise AllocationError(f"{path}: allocation[{i}]: layer {key[0]} KV head {key[1]} is listed twice")
        budgets[key] = r["budget"]
    policy = doc.get("policy") if isinstance(doc, dict) else None
    return budgets, policy if isinstance(policy, str) else None

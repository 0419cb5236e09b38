"""The serving layouts (docs/serving.md; docs/domain.md, "What a serving engine allows"): the constraints a
serving engine puts on any online policy, applied the same way to all of them.

- **blocks** (``block_size`` s, ``paged``): the cache is ``budget // s`` blocks of s positions; only whole,
  complete blocks leave, the lowest block score first (the sum of its positions' scores under the policy's
  own rule), the older block on ties;
- **shared selection** (``shared_selection``, ``shared``): a layer's KV heads hold the same positions, a
  position's score the sum of its scores over the heads;
- **decisions at intervals** (``evict_every`` k, ``intervals``): the policy decides at steps that are
  multiples of k, down to ``budget - k + 1``, and the cache grows in between, never past the budget.

``Layout`` is the choice, one frozen, hashable value (a plan's ``layout`` field, part of a replay's row and
label); ``Layout()`` is none of them, which every path treats as today's (no wrapper at all). The wrapper
itself is ``held.LayoutCache`` (any number of heads) and ``held.LayoutPolicy`` (one head, stepped by the
harness like any policy). Layouts run on the reference (Python) path: the fast engine replays bare
policies only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import registry
from ..base import ParamError, check_budget, check_param
from ..registry import policy_class
from .priorities import LayoutError

#: vLLM's page size, the block size the docs and the study quote
VLLM_BLOCK = 16


@dataclass(frozen=True)
class Layout:
    block_size: int = 1
    shared_selection: bool = False
    evict_every: int = 1

    def __post_init__(self) -> None:
        check_param("block_size", self.block_size, minimum=1)
        check_param("evict_every", self.evict_every, minimum=1)
        if not isinstance(self.shared_selection, bool):
            raise LayoutError(f"shared_selection must be true or false, got {self.shared_selection!r}")

    @property
    def plain(self) -> bool:
        """No constraint at all: today's replay, bit for bit (no wrapper is built)."""
        return self.block_size == 1 and not self.shared_selection and self.evict_every == 1

    @property
    def label(self) -> str:
        """``block_size=16 shared_selection evict_every=8`` (the constraints set), ``-`` for none."""
        parts = [f"block_size={self.block_size}"] if self.block_size > 1 else []
        parts += ["shared_selection"] if self.shared_selection else []
        parts += [f"evict_every={self.evict_every}"] if self.evict_every > 1 else []
        return " ".join(parts) or "-"

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "shared_selection": self.shared_selection, "evict_every": self.evict_every}

    @classmethod
    def from_dict(cls, doc, where: str = "layout") -> Layout:
        """The layout ``doc`` states (a plan's ``layout`` object); LayoutError naming the field otherwise."""
        if not isinstance(doc, dict):
            raise LayoutError(f"{where}: an object (block_size, shared_selection, evict_every) or null")
        unknown = sorted(set(doc) - {"block_size", "shared_selection", "evict_every"})
        if unknown:
            raise LayoutError(f"{where}: unknown field {unknown[0]!r}")
        s, shared, k = doc.get("block_size", 1), doc.get("shared_selection", False), doc.get("evict_every", 1)
        for name, value in (("block_size", s), ("evict_every", k)):
            if type(value) is not int or value < 1:
                raise LayoutError(f"{where}.{name}: an integer of 1 or more, got {value!r}")
        if type(shared) is not bool:
            raise LayoutError(f"{where}.shared_selection: true or false, got {shared!r}")
        return cls(s, shared, k)

    def memory(self, budget: int) -> tuple[int, str | None]:
        """``(positions, note)``: the memory the layout allocates at ``budget`` (whole blocks), and a note
        when the budget is no multiple of the block size (rounded down). ParamError for a block larger than
        the budget."""
        budget = check_budget(budget)
        s = self.block_size
        if s > budget:
            raise ParamError(f"block_size {s} is larger than the budget ({budget}): the cache would hold no whole "
                             "block", param="block_size", value=s, problem="above budget", limit=budget)
        blocks = budget // s
        if budget % s:
            return blocks * s, (f"budget {budget} is no multiple of block_size {s}: rounded down to {blocks} whole "
                                f"blocks ({blocks * s} positions)")
        return budget, None

    def floor(self, budget: int) -> int:
        """The fewest positions held right after a decision, once the cache is full: ``memory - s + 1`` with
        blocks, ``budget - k + 1`` with intervals, ``(blocks - ceil((k - 1) / s) - 1) s + 1`` with both
        (below 1: the interval does not fit the budget)."""
        memory, _ = self.memory(budget)
        s, k = self.block_size, self.evict_every
        return (memory // s - (-(-(k - 1) // s)) - 1) * s + 1

    def check(self, name: str, budget: int, params: dict | tuple = (), heads: int | None = None) -> list[str]:
        """Refuse, in one line each, what cannot run (ParamError/LayoutError, ValueErrors): a block larger
        than the budget, an interval leaving fewer positions than the policy's windows need, a policy that
        declares no layout score, an offline policy other than the optimum (and the optimum with anything but
        blocks): before any trace or model loads. The notes to say (on
        stderr): the budget rounded down to whole blocks; shared selection on one KV head, a no-op."""
        if self.plain:
            return []
        cls = policy_class(name)
        if registry.is_offline(name):
            if not registry.is_optimum(name):
                raise LayoutError(f"{name} is an offline reference: a layout wraps an online policy, or "
                                  f"{registry.optimum() or 'the optimum'} (--block-size: the optimum under blocks)")
            if self.shared_selection or self.evict_every > 1:
                raise LayoutError(f"{name} under a layout is the optimum under blocks: --block-size only (no "
                                  "--shared-selection, no --evict-every)")
        elif not registry.layout_ready(name):
            raise LayoutError(registry.missing(name, "layout_score", f"a serving layout ({self.label})"))
        memory, note = self.memory(budget)
        notes = [note] if note else []
        floor = self.floor(budget)
        k = self.evict_every
        if floor < 1:
            raise ParamError(f"evict_every {k} does not fit budget {budget}"
                             + (f" in blocks of {self.block_size}" if self.block_size > 1 else "")
                             + ": the cache would fill before the next decision", param="evict_every", value=k,
                             problem="too long")
        values = dict(params)
        for p in cls.tunables:
            if p.below_budget and values.get(p.name, p.default) >= floor:
                what = (f"budget - k + 1 = {floor}" if self.block_size == 1 else f"{floor} positions right after a "
                        "decision")
                raise ParamError(f"{self.label} leaves {what}: {name}'s {p.name} {values.get(p.name, p.default)} "
                                 f"must be below it", param="evict_every" if k > 1 else "block_size",
                                 value=k if k > 1 else self.block_size, problem="too long")
        if self.shared_selection and heads == 1:
            notes.append("shared selection on a trace with one KV head: a no-op")
        return notes


NONE = Layout()

__all__ = ["NONE", "VLLM_BLOCK", "Layout", "LayoutError"]

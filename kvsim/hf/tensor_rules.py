"""What the tensor path (``kvsim.hf.tensor``) can run: a class's tensor step, the runs of rows a layer's groups
step, and why a cache of given specs cannot run there (``refusal``), said before any token."""

from __future__ import annotations

from ..policykit.tensor_hooks import TensorHooks
from .refusal import HFError

#: the vectors the tensor path hands a policy (``TensorState.now``)
HANDED = frozenset({"keys", "values", "queries", "out_norms"})


def hooks_of(cls) -> TensorHooks | None:
    """The class's tensor step, or None when it declares none."""
    from ..policykit import registry

    step = registry.tensor_step(cls.name)
    return step if isinstance(step, TensorHooks) else None


def _runs(name: str, policies) -> list[tuple[int, int, type]]:
    """``(first row, row after the last, class)`` of each run of rows of one policy class; an HFError where a row
    mixes classes or a class declares no tensor step."""
    runs: list[list] = []
    for b, row in enumerate(policies):
        classes = {type(p) for p in row}
        if len(classes) != 1 or hooks_of(next(iter(classes))) is None:
            raise HFError(f"{name}: the tensor path steps one policy class with a tensor step in every head of a row; "
                          f"row {b} has {', '.join(sorted(c.name for c in classes))}")
        cls = classes.pop()
        if runs and runs[-1][2] is cls:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1, cls])
    return [tuple(run) for run in runs]


def refusal(layers, seed: int | None = None, prefill: str = "exact") -> str | None:
    """Why layers of these specs (``PolicySpec``, ``[layer][KV head]``) cannot run on the tensor path, in a
    phrase; None when they can: one policy, with a tensor step that takes each configuration, reading no
    vectors but those ``HANDED`` (keys, values, output norms) and no trace meta, and one budget in each layer (a layer's
    heads are one tensor of slots; an allocation that splits a layer's heads keeps each head's bytes on the
    reference path). A policy that draws (not ``deterministic``) with a ``seed`` draws every head of a layer from one
    generator, in the reference path's order, which fast prefill takes head by head: it runs there with more
    than one KV head."""
    from ..policies import policy_class

    layers = [list(row) for row in layers]
    specs = [s for row in layers for s in row]
    names = sorted({s.name for s in specs if s is not None})
    if None in specs or len(names) != 1:
        return "the tensor path runs one policy in every head"
    cls = policy_class(names[0])
    hooks = hooks_of(cls)
    if hooks is None:
        return f"{cls.name} declares no tensor step"
    if set(cls.reads) - HANDED:
        return f"{cls.name} reads {', '.join(cls.reads)}, which the tensor path does not hand over"
    if hooks.takes is not None:
        odd = next((s for s in specs if not hooks.takes(s)), None)
        if odd is not None:
            return f"{cls.name}'s tensor step does not cover {odd.label}"
    if not cls.deterministic and seed is not None and prefill == "fast" and any(len(row) > 1 for row in layers):
        return f"a seeded {cls.name} draws a layer's KV heads from one generator, which fast prefill draws head by head"
    split = next((x for x, row in enumerate(layers) if len({s.budget for s in row}) > 1), None)
    if split is not None:
        return f"layer {split}'s KV heads hold different budgets"
    return None


__all__ = ["HANDED", "hooks_of", "refusal"]

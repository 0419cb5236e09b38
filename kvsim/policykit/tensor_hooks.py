"""What a policy's tensor step is made of, declared beside the policy as its numba hooks are
(``kvsim.policykit.slot_hooks``): the deployed cache (``kvsim.hf.tensor``) steps every row and KV head of a
decoder layer at once with it, as a handful of tensor operations on the model's device, nothing read back
to the host.

The layer keeps, per (row, KV head), a run of columns (the cache's slots, and during a prompt chunk the
chunk's positions after them) and a map of what each holds (``Columns.pos``, -1 for none). A policy
keeps its state in tensors the same shape (``TensorState.slots``, one value per column, moved with the
column when the layer compacts a chunk into its slots) and its parameters per (row, KV head)
(``TensorState.params``). One step t of every (row, KV head), in the harness's order:

1. ``observe(state, shown, before)``: ``shown`` ``(batch, heads, width)`` float32 is what the reference
   path shows the policy (the combining rule's row renormalised over the held columns, float32), zero off
   them; only called for a policy that ``reads_attention``. A row with no column held before t (a padded
   position of a left-padded batch, which the layer steps as if it never came) must come out unchanged;
2. ``admit(state, new, before)``: ``new`` ``(batch, heads, width)`` bool marks position t's column
   (``before``: the columns held before it), t's vectors in ``state.now``;
   position 0, held from the start, is admitted the same way (its state is the policy's starting one);
3. ``rank(state, cols)`` -> ``(values, candidates)``: where the cache is over its budget, the layer evicts
   the candidate with the smallest value, and among equal values the lower position (the cards' tie
   rule); a policy that evicts the largest returns the values negated (exact in floating point).

``Columns`` gives what the rules are written in: positions, the held mask (after t is admitted), and
for each held column how many held positions are newer (``newer``: a recent window protects
``newer < recent_window``) and older (``older``: sinks are ``older < sinks``).

Declaring hooks imports nothing: the hook functions import torch when the layer first calls them, so
``kvsim.policies`` loads without the torch extra.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TensorState:
    """A policy's state on the device: ``params``, name -> ``(batch, heads, ...)`` tensor (a parameter or a
    counter per (row, KV head): each may differ, as a quality batch's rows do); ``slots``, name -> ``(batch,
    heads, width, ...)`` tensor, a value (or a vector) per column, which the layer widens for a chunk and
    compacts after. The layer sets ``t`` and ``now``, position t's rows of what the policy ``reads`` (``keys`` and
    ``values`` ``(batch, heads, d)`` as stored, ``queries`` ``(batch, heads, G, d)`` post-RoPE as the model attends
    with them, ``out_norms`` ``(batch, heads, G)`` float32), before each step,
    and ``host``: ``policies`` and ``budgets``, the layer's per-row lists (``[row][kv head]``)."""

    params: dict = field(default_factory=dict)
    slots: dict = field(default_factory=dict)
    now: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    #: the step being taken (the layer sets it before ``observe``): the position t, a host integer
    t: int = -1


@dataclass(frozen=True)
class Columns:
    """What the layer's columns hold at step ``t``: ``pos`` ``(batch, heads, width)`` int64 (-1: none),
    ``held`` bool (t admitted), ``newer`` and ``older`` int64, per held column the held positions newer
    and older than its own (undefined off ``held``); ``order``, the columns in position order, the held
    ones first (what a sum in kept order gathers by)."""

    t: int
    pos: object
    held: object
    newer: object
    older: object
    order: object = None


@dataclass(frozen=True)
class TensorHooks:
    """A policy's tensor step, given to its class as ``tensor_step``. ``state(policies, batch, heads, width,
    device)``: the ``TensorState`` for ``policies[row][kv head]`` (built policies of this class, at their
    parameters), its slot tensors ``(batch, heads, width)``; ``rank`` is the one every policy has; the
    others, left out, do nothing."""

    name: str
    state: Callable
    rank: Callable
    observe: Callable | None = None
    admit: Callable | None = None
    #: ``takes(spec)``: False for a configuration (a ``PolicySpec``) the step does not cover (None: every one does)
    takes: Callable | None = None
    #: a deployed prompt and its decode steps may be walked by the class's engine hooks (its ``engine_binding``'s
    #: ``SlotHooks``) in one compiled loop on a CPU (``kvsim.hf.walk``): ``(slot name, index of the engine state's
    #: array)`` for each of ``state``'s slots (``"position"`` after the pair where that array is indexed by position,
    #: not held order), read into the engine's state before the walk and out of it after, or a ``WalkMap`` where the
    #: engine keeps its state otherwise (snapkv's ring rows); None: it walks on these hooks. Declared only where the
    #: engine's hooks do what these do, step for step, position 0 admitted too
    walk: tuple | WalkMap | None = None
    #: for a class that reads vectors (``reads``: keys, values, output norms): ``walk_rows(policy, engine, t0, rows)``
    #: puts a call's rows (``rows``: member -> position-major NumPy array, positions ``t0 ..``) of one configuration
    #: into its engine state (``policy``: that configuration's built policy), which the walk then keeps one per (row,
    #: KV head), as the simulator keeps one per trace;
    #: it returns None, or the engine state anew where that keeps the call's rows alone (``per_call``)
    walk_rows: Callable | None = None
    #: the engine state keeps the rows the class reads for the call being walked alone, not one per position seen
    #: (``walk_rows`` returns it anew each call), so the walk builds it from one row and lets the rows go after the call
    per_call: bool = False


@dataclass(frozen=True)
class WalkMap:
    """A tensor step's ``walk`` where the engine's state is not one array per tensor slot in held order (a ring with a
    row map of its own, a counter the tensor step keeps as a parameter). ``read(engine, c, held, slots, params)``: set
    configuration c's engine state (the tuple its ``SlotHooks.state`` made) from the tensor state, ``held`` the
    columns it holds in position order (it returns None, or the engine state anew where it had to grow it);
    ``write(engine, p, col, length, slots, params)``: every configuration's held columns (``col[c, :length[c]]``, at
    positions ``p``) and parameters set back from the engine's, in place. ``slots`` and ``params``: the group's
    tensors as NumPy views, ``(configurations, ...)``.

    ``prepare(state, slots, shapes, size)``, called before each ``write``: what the tensor step makes at its first
    call (keydiff's unit keys, sized by the keys), made where it is not there yet, in ``slots`` (the dict written
    into) or the group's ``TensorState``; ``shapes``: what the class reads, member -> trailing shape; ``size``: the
    group's ``(rows, KV heads, slots)``. ``inputs(state, steps)``: the engine's inputs made from the group's ``TensorState`` for
    ``steps`` positions, in place of the class's ``engine_inputs`` (random's draws, which the walk reads from the
    tensor step's plan and never makes again)."""

    read: Callable
    write: Callable
    prepare: Callable | None = None
    inputs: Callable | None = None


def param(policies, name: str, device):
    """``(batch, heads)`` int64: each built policy's parameter ``name``."""
    import torch

    return torch.tensor([[int(getattr(p, name)) for p in row] for row in policies], dtype=torch.int64, device=device)


def slots(batch: int, heads: int, width: int, device, fill: float = 0.0):
    """``(batch, heads, width)`` float64, every column ``fill``: a per-column score."""
    import torch

    return torch.full((batch, heads, width), fill, dtype=torch.float64, device=device)


def in_order(x):
    """The float64 sum over the last axis added strictly in order, as ``kvsim.data.gqa.position_sum`` adds (a
    cumulative sum: sequential on the CPU, where the tests hold the tensor path to the reference)."""
    return x.double().cumsum(-1)[..., -1]


def key_norms(keys):
    """``kvsim.policies.knorm.key_norms`` in torch: each key widened to float64, its squares added in
    dimension order, ``sqrt``: the same bits."""
    k = keys.double()
    return in_order(k * k).sqrt()


def held_columns(state, cols: Columns):
    """``(batch, heads, n)``: each head's held columns in position order, then others, ``n`` the most a head of the
    layer can hold (its largest budget + 1): what a policy gathers to score the held alone, whatever the width."""
    import torch

    held = cols.held
    n = min(held.shape[-1], max(max(row) for row in state.host["budgets"]) + 1)
    return torch.where(held, cols.pos, torch.iinfo(torch.int64).max).argsort(-1)[..., :n]


def admitted(slot, new, value):
    """``slot`` ``(batch, heads, width, ...)`` with t's column (``new``) set to ``value`` ``(batch, heads, ...)``. A
    slot of vectors is written in place, t's column alone (a row with no new column writes its column 0 back as it
    was), rather than copied whole at every step."""
    import torch

    extra = slot.dim() - new.dim()
    value = value.unsqueeze(2).to(slot.dtype)
    if not extra:
        return torch.where(new, value, slot)
    at = new.to(torch.uint8).argmax(-1)  # (batch, heads): t's column, 0 where none
    index = at.reshape(*at.shape, 1, *[1] * extra).expand(*at.shape, 1, *slot.shape[3:])
    came = new.any(-1).reshape(*at.shape, 1, *[1] * extra)
    return slot.scatter_(2, index, torch.where(came, value, slot.gather(2, index)))


__all__ = ["Columns", "TensorHooks", "TensorState", "WalkMap", "admitted", "held_columns", "in_order", "key_norms", "param", "slots"]

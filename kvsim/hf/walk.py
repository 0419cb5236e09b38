"""A prompt walked in one compiled loop on a CPU: the tensor path's chunk step (``kvsim.hf.tensor``,
``TensorLayer._part``) with its per-position work fused into one numba call per block of positions and policy class;
a decode step is a block of one position (``decode``), its column the slot each head found free.

On one CPU thread the tensor path's walk through a prompt is dispatch-bound: each position of each layer is some
forty small tensor operations (the softmax over what the position still sees, what the policy is shown, its step,
the ranks and the victim), microseconds each, 18,000-90,000 times for a 1,024-token prompt on the shipped models.
Here the products stay torch's (the block's logits against the held keys and its own, one matmul per head; the
outputs from the same rows, one more), and what lies between them, per position and (row, KV head), is one loop:

- ``exact``: each query head's softmax over the columns the position still sees (the held ones, inside the model's
  sliding window if the layer has one, and its own), float32 weights from float32 exponentials over a float64 sum;
  ``fast``: the rows torch computed over what the call found and the call causally, as the tensor path computes them;
- what the policy is shown: the combining rule's row (the group's mean folded in head order in float64, over the
  columns held before the position), its sum in position order, the policy's own ``observe`` hook of the engine
  (``kvsim.sim.kernels``; it adds ``float64(float32(row / sum))``, the tensor path's shown row);
- the position admitted into its column by the policy's ``admit`` hook; where the head is over its budget, its
  ``pick`` hook's victim (the first minimum over its candidates in position order: the cards' tie rule) leaves,
  its departure noted where the layer ``watch``es.

The policy is the same code the simulator's engine replays (its ``SlotHooks``, declared beside it); what the
tensor step keeps per column is read into the engine's state before the walk (a later prompt: a conversation's next
question, a long prompt fed in several calls; ``_Walker.read``) and out of it after, at the places the tensor path's
compaction puts each position (the policy's ``TensorHooks.walk``: which state array each tensor slot is). A class
takes this route when its tensor step declares ``walk`` (``registry.walks_prompt``; a ``WalkMap`` where the engine
keeps its state otherwise; one engine state per (row, KV head) for a class that reads vectors): h2o, h2o_normalized,
tova, scissorhands, streaming_llm, sliding_window, snapkv, vatp, critical, knorm, keydiff and expected_attention
(their engines keep the held slots' keys, norms or unit keys and the call's rows, ``TensorHooks.per_call``) and random (its
draws read from the tensor step's plan, ``WalkMap.inputs``): every online class but learned;
only on a CPU, float32, unpadded, numba installed; anything else walks on the tensor path's operations. The
weights differ from the tensor path's softmax in their last float32 bits (a sum in another order: relatively within
``n x 2^-24`` of the exact one, either way, docs/domain.md's tolerance rule);
tests/test_hf_walk.py holds held sets, departures, scores and tokens to the tensor path's.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from ..jit import AVAILABLE, kernel, sources_digest
from ..policykit.slot_hooks import Shape, SlotHooks, _drop, _nothing_admitted, _nothing_dropped, _nothing_observed
from ..policykit.tensor_hooks import WalkMap
from .tensor_math import logits as _logits
from .tensor_math import outputs as _outputs
from .tensor_math import softmax as _softmax
from .tensor_math import vectors as _vectors
from .walk_masks import picked as _picked
from .walk_masks import places as _places
from .walk_masks import rows_of as _rows_of
from .walk_masks import sees as _sees


@kernel
def _first_seen(p_c, n, t, window):
    """The first of the ``n`` held (ascending positions ``p_c``) inside ``window`` (0: none): those after it are too."""
    lo = 0
    if window > 0:
        while lo < n and p_c[lo] <= t - window:
            lo += 1
    return lo


@kernel
def _softmax_row(lg, w, k_c, p_c, n, own, t, window, scratch):
    """Row t's weights ``w`` ``(G, columns)`` from its logits ``lg``: each query head's softmax over the ``n`` held
    columns ``k_c[:n]`` (positions ``p_c``) inside ``window`` (0: none) and its own column ``own``; ``scratch`` holds
    the exponentials, added in position order in float64."""
    lo = _first_seen(p_c, n, t, window)
    for g in range(lg.shape[0]):
        lg_g = lg[g]
        w_g = w[g]
        top = lg_g[own]
        for i in range(lo, n):
            v = lg_g[k_c[i]]
            if v > top:
                top = v
        total = 0.0
        for i in range(lo, n):
            e = np.exp(lg_g[k_c[i]] - top)
            scratch[i] = e
            total += np.float64(e)
        e = np.exp(lg_g[own] - top)
        total += np.float64(e)
        for i in range(lo, n):
            w_g[k_c[i]] = np.float32(scratch[i] / total)
        w_g[own] = np.float32(np.float64(e) / total)


@kernel
def _marks_row(w, k_c, p_c, n, own, t, window):
    """Row t's visible columns (held, inside ``window``, and its own) marked 1 in ``w`` ``(columns,)``."""
    for i in range(_first_seen(p_c, n, t, window), n):
        w[k_c[i]] = 1.0
    w[own] = 1.0


@kernel
def _combined(w, k_c, n, gather):
    """The combining rule's row over the ``n`` held columns ``k_c``: the group's mean in float64 folded in head order
    into ``gather``, and its sum in position order."""
    heads = w.shape[0]
    total = 0.0
    for i in range(n):
        k = k_c[i]
        acc = np.float64(w[0, k])
        for g in range(1, heads):
            acc += np.float64(w[g, k])
        acc = acc / heads
        gather[i] = acc
        total += acc
    return total


def _walk_steps(lg, ws, mode, m, t0, own0, window, budgets, pos, p, col, length, left, observes, gather, A, state):
    """Positions ``t0 .. t0 + m - 1`` of a block (row j in ``lg`` and ``ws`` ``(configurations, rows, G, columns)``,
    its column ``own0[c] + j``: a prompt's are the same in every configuration, a decode step's the slot each head
    found free) for every configuration c (a (row, KV head)): held positions ``p[c, :length[c]]`` in
    position order, in columns ``col[c]``; ``pos[c, column]`` the position a column holds (-1: none), changed in
    place; ``left[c, q]`` the step at which position q left (``left`` of width 0: none watched). ``mode``: 0, the
    rows are in ``ws`` already (``fast``); 1, each row's softmax into ``ws`` from ``lg`` (``exact``); 2, each row's
    visible columns marked 1 in ``ws[c, j, 0]``, for outputs a masked fused attention computes (a policy that reads
    no attention). Specialised with a policy's hooks as the globals ``observe``, ``admit``, ``pick`` and ``drop``
    (``walk_kernel``)."""
    watched = left.shape[1]
    for j in range(m):
        t = t0 + j
        for c in range(budgets.shape[0]):
            own = own0[c] + j
            n = length[c]
            p_c = p[c]
            k_c = col[c]
            if mode == 1:
                _softmax_row(lg[c, j], ws[c, j], k_c, p_c, n, own, t, window, gather)
            elif mode == 2:
                _marks_row(ws[c, j, 0], k_c, p_c, n, own, t, window)
            if observes and t > 0:
                total = _combined(ws[c, j], k_c, n, gather)
                observe(state, c, p_c, n, gather, total)  # noqa: F821 - a specialisation's global
            p_c[n] = t
            k_c[n] = own
            pos[c, own] = t
            admit(state, c, p_c, n)  # noqa: F821
            n += 1
            if n > budgets[c]:
                best = pick(state, c, t, p_c, n, A, 0, False)  # noqa: F821
                drop(state, c, best, n)  # noqa: F821
                gone = p_c[best]
                pos[c, k_c[best]] = -1
                if gone < watched:
                    left[c, gone] = t
                _drop(p_c, best, n)
                _drop(k_c, best, n)
                n -= 1
            length[c] = n


@kernel
def _relocate(pos, p, col, length):
    """After the layer's compaction: each held position's column, read off the new map ``pos`` ``(configurations,
    slots)``."""
    for c in range(pos.shape[0]):
        n = length[c]
        for s in range(pos.shape[1]):
            q = pos[c, s]
            if q >= 0:
                col[c, np.searchsorted(p[c, :n], q)] = s


_TEMPLATE = {name: _walk_steps.__globals__[name] for name in _walk_steps.__code__.co_names
             if name in _walk_steps.__globals__}
_MADE: dict = {}


def walk_kernel(hooks: SlotHooks):
    """The walk specialised with a policy's engine hooks (compiled on first use, cached on disk under the hooks' name
    and a digest of every file they reach, as ``kvsim.sim.kernels.slot_kernel`` names its loops)."""
    if hooks not in _MADE:
        named = {"observe": hooks.observe or _nothing_observed, "admit": hooks.admit or _nothing_admitted,
                 "pick": hooks.pick, "drop": hooks.drop or _nothing_dropped}
        name = f"walk_{hooks.name}_{sources_digest([*named.values(), *_TEMPLATE.values()])}"
        fn = types.FunctionType(_walk_steps.__code__, {**_TEMPLATE, **named}, name)
        fn.__qualname__, fn.__module__ = name, __name__
        fn.__doc__ = f"{name}: ``_walk_steps`` with {hooks.name}'s hooks."
        _MADE[hooks] = globals()[name] = kernel(fn)
    return _MADE[hooks]


def _binding(cls):
    """``(SlotHooks, walk)`` of a class whose tensor step declares ``walk``, else None."""
    from ..policykit import registry

    walk = registry.walks_prompt(cls.name)
    return None if walk is None else (cls.engine_binding.kernel, walk)


#: whether a call that fits walks here (``off()`` says no: the benchmark's before, the tests' other side)
_on = [True]


@contextmanager
def off() -> Iterator[None]:
    """Within this block every prompt walks on the tensor path's operations."""
    _on.append(False)
    try:
        yield
    finally:
        _on.pop()


def walks(policy: str, device) -> bool:
    """Whether a prompt of ``policy`` on ``device`` walks here (its class declares ``walk``; a CPU; numba)."""
    from ..policykit import registry

    return AVAILABLE and _on[-1] and torch.device(device).type == "cpu" and registry.walks_prompt(policy) is not None


def fits(layer, q, real) -> bool:
    """Whether ``layer``'s call of ``q`` walks here: unpadded (nor any call before it), float32 on a CPU, numba
    installed, every group's class declaring ``walk``, and not ``off()``."""
    return (real is None and not layer._padded and q.dtype == torch.float32
            and all(walks(group.state.host["policies"][0][0].name, q.device) for group in layer.groups))


class _Walker:
    """A group's walk, or one configuration's where its class reads vectors (``span``): its configurations (rows x KV
    heads) ``lo .. hi`` of the layer (``at`` of the group), the engine's state of its policy sized for ``steps``
    positions, and the held positions in position order with their columns. It lives on the layer between calls
    (``TensorLayer._walkers``) while nothing but the walk steps the layer. A class that reads vectors (keys, values,
    output norms) takes them per trace in the engine, one head's: its walk keeps one engine state per (row, KV head),
    each given its own rows of every call (``see``, the tensor step's ``walk_rows``)."""

    def __init__(self, group, heads: int, steps: int, span: tuple[int, int] | None = None, shapes: dict | None = None,
                 columns: int = 0):
        policies = [p for row in group.state.host["policies"] for p in row]
        self.configs = len(policies)  # the group's
        first, last = span if span is not None else (0, len(policies))
        policies = policies[first:last]
        self.cls = cls = type(policies[0])
        self.policy = policies[0]  # a walk of one configuration's (a class that reads vectors): its policy
        self.hooks, self.walk = _binding(cls)
        self.group = group
        self.steps = steps
        self.at = slice(first, last)
        self.lo, self.hi = group.rows.start * heads + first, group.rows.start * heads + last
        width = max(p.budget for p in policies) + 1
        configs = len(policies)
        self.shapes, self.columns = shapes, columns  # what the class reads, per row; the layer's slots
        if cls.reads:  # rows of zeros, the calls' own put in by ``see``
            ahead = 1 if cls.tensor_step.per_call else steps + 1
            blank = {m: np.zeros((ahead, *shapes[m]), dtype=np.float32) for m in cls.reads}
            inputs = cls.engine_inputs(policies, steps, blank)
        elif isinstance(self.walk, WalkMap) and self.walk.inputs is not None:
            inputs = self.walk.inputs(group.state, steps)
        else:
            inputs = cls.engine_inputs(policies, steps)
        self.state = self.hooks.state(Shape(configs, width, steps), **inputs)
        self.budgets = np.array([p.budget for p in policies], dtype=np.int64)
        self.p = np.zeros((configs, width), dtype=np.int64)
        self.col = np.zeros((configs, width), dtype=np.int64)
        self.length = np.zeros(configs, dtype=np.int64)
        self.gather = np.zeros(width, dtype=np.float64)
        self.observes = group.observes
        self.step = walk_kernel(self.hooks)

    def see(self, t0: int, rows: dict) -> None:
        """This configuration's rows of a call (member -> ``(positions, ...)`` NumPy, from position ``t0``) into its
        engine state."""
        state = self.cls.tensor_step.walk_rows(self.policy, self.state, t0, {m: rows[m][self.lo] for m in self.cls.reads})
        if state is not None:  # the engine keeps the call's rows alone (``TensorHooks.per_call``)
            self.state = state

    def forget(self, t: int, rows: dict) -> None:
        """The call's rows let go once it is walked, where the engine keeps the call's alone (``TensorHooks.per_call``)."""
        if self.cls.tensor_step.per_call:
            self.see(t, {m: x[:, :0] for m, x in rows.items()})

    def read(self, pos, slots, seen: int) -> None:
        """What the layer holds of the positions before ``seen`` (a later prompt: a conversation's next question, a
        prompt fed in several calls; a decode step after the tensor operations stepped the layer) into the walk's
        terms: each configuration's held positions in position order with their slots, and each declared tensor
        slot's values into the engine's state array (``walk``)."""
        flat = pos.numpy().reshape(-1, pos.shape[-1])[self.lo : self.hi]
        mapped = isinstance(self.walk, WalkMap)
        values = self._mine(slots)
        params = self._mine(self.group.state.params) if mapped else None
        for c in range(len(self.length)):
            held = np.nonzero((flat[c] >= 0) & (flat[c] < seen))[0]
            held = held[np.argsort(flat[c, held], kind="stable")]
            n = len(held)
            self.p[c, :n], self.col[c, :n], self.length[c] = flat[c, held], held, n
            if mapped:
                state = self.walk.read(self.state, c, held, values, params)
                if state is not None:
                    self.state = state
                continue
            for name, array, by_position in self._arrays():
                at = flat[c, held] if by_position else slice(0, n)
                array[c, at] = values[name][c, held]

    def _arrays(self):
        """``(slot name, engine state array, indexed by position)`` of each declared tensor slot (``walk``: an engine
        array in the held positions' order, or, marked ``"position"``, one indexed by position; one the engine shares
        between configurations, a walk of one configuration's, as a row)."""
        out = []
        for name, index, *rest in self.walk:
            array = self.state[index]
            out.append((name, array[None] if array.ndim == 1 else array, bool(rest) and rest[0] == "position"))
        return out

    def block(self, lg, ws, mode, m, t0, own0, window, pos, left, first: int | None = None):
        """A block of ``m`` positions from ``t0`` (``_walk_steps``); ``lg`` and ``ws`` hold this walk's configurations
        from ``first`` on (None: at their places in the layer, ``lo``), the other arrays the layer's."""
        c = slice(self.lo, self.hi)
        at = c if first is None or not len(lg) else slice(first, first + self.hi - self.lo)
        self.step(lg[at], ws[at], mode, m, t0, own0[c], window, self.budgets, pos[c], self.p, self.col, self.length,
                  left[c], self.observes, self.gather, _NO_ROWS, self.state)

    def write(self, slots: dict) -> None:
        """Each held position's engine values into its column of the group's tensor slots, in place (a free column
        keeps what it had: the tensor step's ``admit`` sets a column's values when it takes a position)."""
        if isinstance(self.walk, WalkMap) and self.walk.prepare is not None:
            rows = self.group.rows.stop - self.group.rows.start
            self.walk.prepare(self.group.state, slots, self.shapes, (rows, self.configs // rows, self.columns))
        views = self._mine(slots)
        if isinstance(self.walk, WalkMap):
            self.walk.write(self.state, self.p, self.col, self.length, views, self._mine(self.group.state.params))
            return
        held = np.arange(self.p.shape[1])[None, :] < self.length[:, None]
        configs = np.nonzero(held)[0]
        for name, array, by_position in self._arrays():
            views[name][configs, self.col[held]] = array[configs, self.p[held]] if by_position else array[held]

    def _mine(self, tensors: dict) -> dict:
        """The group's tensors (slots or parameters) as NumPy views of this walk's configurations (``_views``)."""
        return {k: v[self.at] for k, v in _views(tensors, self.configs).items()}


def _views(tensors: dict, configs: int) -> dict:
    """Each tensor ``(rows, heads, ...)`` of ``tensors`` as a NumPy view ``(configurations, ...)`` of its memory (a tensor
    that is not contiguous is replaced in ``tensors`` by a contiguous copy first, so that writes reach it)."""
    out = {}
    for name, x in tensors.items():
        if x.dim() < 2:  # not one per (row, KV head)
            continue
        if not x.is_contiguous():
            tensors[name] = x = x.contiguous()
        out[name] = x.view(configs, *x.shape[2:]).numpy()
    return out


#: the rows a pick may read (none of the walking policies reads them)
_NO_ROWS = np.zeros((0, 0), dtype=np.float32)
#: a block's logits or weights where the walk reads none (a fast prompt of policies that read no attention)
_NO_BLOCK = torch.zeros(0, 0, 0, 0, dtype=torch.float32)


def run(layer, q, key, value, call):
    """``layer``'s prompt ``q`` ``(batch, heads, G, n, d)`` walked here (``fits``): its outputs ``(batch,
    heads, G, n, d)``, the layer left as the tensor path's ``_chunk`` leaves it."""
    batch, heads, width = layer.pos.shape
    n, g = q.shape[3], q.shape[2]
    rows = _rows(layer, q, key, value, call)
    walkers = _walkers(layer, layer.seen + n, rows)
    for walker in walkers:
        if walker.cls.reads:
            walker.see(layer.seen, rows)
    configs = batch * heads
    left = _left(layer, configs)
    fast = layer.prefill == "fast"
    window = 0 if call.window is None else int(call.window)
    out = q.new_empty(batch, heads, g, n, value.shape[-1])
    part = n if fast else layer.chunk
    for a in range(0, n, part):
        b = min(a + part, n)
        _part(layer, walkers, q[:, :, :, a:b], key[:, :, a:b], value[:, :, a:b], call, out[:, :, :, a:b], fast,
              window, left)
    layer._count = torch.from_numpy(np.concatenate([w.length for w in walkers]).reshape(batch, heads).copy())
    for group in layer.groups:  # fresh slots, each held position's engine values at its compacted column
        fresh = group.hooks.state(group.state.host["policies"], group.rows.stop - group.rows.start, heads, width,
                                  layer.pos.device)
        for walker in walkers:
            if walker.group is group:
                walker.write(fresh.slots)
        group.state.slots = fresh.slots
    for walker in walkers:
        walker.forget(layer.seen, rows)
    layer._walkers = walkers  # the decode steps go on from here
    return out


#: positions a walker's engine state is sized for past those it is built to walk: the decode steps that follow a
#: prompt walk on in it (scissorhands' votes are kept per position) until they reach its end, where it is built again
HEADROOM = 1024


def _rows(layer, q, key, value, call) -> dict:
    """The call's rows of what the layer's policies read (``kvsim.hf.tensor_math.vectors``), each as a NumPy array
    ``(configurations, positions, ...)``, computed for the rows whose class reads it alone (critical's output norms, a
    float64 product per position, would otherwise be made for every row of a pass key's cell), zeros elsewhere; none
    read: empty."""
    out = {}
    batch = q.shape[0]
    for member in layer.reads:
        mine = torch.zeros(batch, dtype=torch.bool)
        for group in layer.groups:
            if member in type(group.state.host["policies"][0][0]).reads:
                mine[group.rows] = True
        at = _picked(mine, batch)
        x = _vectors(layer.name, (member,), key[at], value[at], call, q[at])[member]
        if not isinstance(at, slice):
            x = x.new_zeros(batch, *x.shape[1:]).index_put_((at,), x)
        out[member] = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).numpy()
    return out


def _walkers(layer, steps: int, rows: dict) -> list[_Walker]:
    """A walker per group (per configuration where its class reads vectors), in the layer's order of configurations,
    sized for ``steps`` positions and ``HEADROOM`` more, with what the layer holds of the positions it has seen read
    in. ``rows``: a call's (``_rows``), whose shapes size what a class reads."""
    heads = layer.pos.shape[1]
    shapes = {m: x.shape[2:] for m, x in rows.items()}
    walkers = []
    for group in layer.groups:
        cls = type(group.state.host["policies"][0][0])
        configs = (group.rows.stop - group.rows.start) * heads
        spans = [(c, c + 1) for c in range(configs)] if cls.reads else [None]
        walkers += [_Walker(group, heads, steps + HEADROOM, span, shapes, layer.pos.shape[-1]) for span in spans]
    if layer.seen:
        for walker in walkers:
            walker.read(layer.pos, walker.group.state.slots, layer.seen)
    return walkers


def _left(layer, configs: int):
    """The departures the layer keeps (``watch``), ``(configurations, positions)``, in place; none: width 0."""
    return layer.left.view(configs, -1).numpy() if layer.left is not None else np.zeros((configs, 0), dtype=np.int64)


def decode(layer, q, key, value, call):
    """``layer``'s decode step ``q`` ``(batch, heads, G, 1, d)`` walked here (``fits``), its key and value already in
    slot ``layer._col`` (``update``): ``(out (batch, 1, query heads, d), weights (batch, query heads, 1, slots))``, the
    layer left as the tensor path's ``_decode`` leaves it. Between a product for the logits and one for the outputs,
    one compiled call per walker: each query head's softmax over what the position sees, the policy's step, the victim
    (``_walk_steps``, a block of one position whose column is each head's own). The walkers live on the layer from
    step to step (and from the prompt's walk); the group's tensor slots are written in place after each step, so
    whatever reads them next (the tensor operations, a later prompt, a reorder) finds them current."""
    batch, heads, width = layer.pos.shape
    configs, t = batch * heads, layer.seen
    rows = _rows(layer, q, key, value, call)
    walkers = layer._walkers
    if walkers is None or any(walker.steps <= t for walker in walkers):
        walkers = _walkers(layer, t + 1, rows)
    q = q[:, :, :, 0]
    lg = _logits(q, layer._keys, call)  # (batch, heads, G, slots)
    ws = torch.zeros_like(lg)
    window = 0 if call.window is None else int(call.window)
    pos, left = layer.pos.view(configs, width).numpy(), _left(layer, configs)
    own = layer._col.reshape(configs).numpy()
    lg_np, ws_np = lg.view(configs, 1, *lg.shape[2:]).numpy(), ws.view(configs, 1, *ws.shape[2:]).numpy()
    count = layer._count.view(configs).numpy()
    for walker in walkers:
        if walker.cls.reads:
            walker.see(t, rows)
        walker.block(lg_np, ws_np, 1, 1, t, own, window, pos, left)
        count[walker.lo : walker.hi] = walker.length
        walker.write(walker.group.state.slots)
    layer._walkers = walkers
    layer.seen = t + 1
    out = _outputs(ws, layer._values)  # (batch, heads, G, d)
    g, d = out.shape[2], out.shape[3]
    return out.reshape(batch, 1, heads * g, d), ws.reshape(batch, heads * g, 1, width)


#: queries per block: each block's logits reach only the columns up to its last position (a causal prefix), so the
#: products and softmaxes are those of a causal pass, give or take a block's triangle
BLOCK = 128


def _part(layer, walkers, q, key, value, call, out, fast, window, left) -> None:
    """One part of the call (all of it ``fast``, a chunk ``exact``): its columns (the slots, then its positions), the
    walk over blocks of queries, the outputs into ``out``, and the layer's compaction. In a part that starts with
    nothing held (the first), no query reads a slot: its blocks' columns are its own positions alone. The rows whose
    class reads no attention (``_blind``) take their outputs from a fused attention masked by what each row sees, the
    others from the weights the walk computes, each kind computed over its own rows alone: a row's arithmetic is its
    own, whatever shares its batch."""
    t0, n = layer.seen, q.shape[3]
    batch, heads, width = layer.pos.shape
    configs, g, d = batch * heads, q.shape[2], out.shape[-1]
    keys = torch.cat([layer._keys, key], dim=2)
    values = torch.cat([layer._values, value], dim=2)
    pos = torch.cat([layer.pos, torch.full((batch, heads, n), -1, dtype=torch.int64)], dim=2)
    shift = width if t0 == 0 else 0  # the first column a query of this part may read
    flat = pos.numpy().reshape(configs, width + n)[:, shift:]
    block = min(BLOCK, layer.chunk)
    blind = _blind(layer, walkers, call)
    # each kind's rows (an index, a slice, None), and where each configuration of the kind sits among the kind's
    (see_at, see_first), (blind_at, blind_first) = [(_picked(rows, batch), _places(rows, heads)) for rows in (~blind, blind)]
    # where the part is the whole of a fast first prompt inside the model's window, what each row sees is the call up
    # to it: a blind row's outputs are the full cache's causal attention, one fused call for the part
    causal = blind_at is not None and fast and shift and (not window or window >= n)
    if causal:
        out[blind_at] = torch.nn.functional.scaled_dot_product_attention(
            q[blind_at].reshape(-1, heads * g, n, q.shape[-1]), key[blind_at], value[blind_at], is_causal=True,
            scale=call.scale, enable_gqa=True).reshape(-1, heads, g, n, d)
    qt = q[see_at].transpose(2, 3).contiguous() if see_at is not None else None  # (rows, heads, n, G, d): a block's
    for a in range(0, n, block):  # queries are then one run of rows per head, not a copy each
        m = min(a + block, n) - a
        hi = width + a + m  # the columns up to the block's last position
        k, v = keys[:, :, shift:hi], values[:, :, shift:hi]
        sees = _sees(layer, t0, a, m, shift, hi, window) if fast else None
        lg = ws = marks = _NO_BLOCK
        if see_at is not None:  # the seeing rows' logits and, fast, their rows: what the walk reads
            lg = _logits(qt[:, :, a : a + m], k[see_at], call)  # (rows, heads, m, G, cols)
            if fast:  # in a first part no query hides a column before the block's own unless the window does
                lo = a if shift and (not window or window >= n) else 0
                ws = _softmax(lg, _rows_of(sees, see_at), q.dtype, spend=True, lo=lo)
            else:
                ws = torch.zeros_like(lg)
        if blind_at is not None and not fast:  # the walk marks what each blind row sees
            marks = torch.zeros(int(blind.sum()), heads, m, 1, hi - shift, dtype=torch.float32)
        own = np.full(configs, width + a - shift, dtype=np.int64)
        seeing, blinded = (_flat(lg), _flat(ws), see_first), (_flat(marks), _flat(marks), blind_first)
        for walker in walkers:
            x, y, first = seeing if walker.observes else blinded
            walker.block(x, y, 0 if fast else 1 if walker.observes else 2, m, t0 + a, own, window, flat, left,
                         int(first[walker.lo]))
        if see_at is not None:
            rows = _outputs(ws.reshape(-1, heads, m * g, hi - shift), v[see_at]).reshape(-1, heads, m, g, d)
            out[see_at, :, :, a : a + m] = rows.transpose(2, 3)
        if blind_at is not None and not causal:
            seen = _rows_of(sees.expand(batch, heads, m, -1), blind_at) if fast else marks[:, :, :, 0] > 0
            rows = torch.nn.functional.scaled_dot_product_attention(
                q[blind_at, :, :, a : a + m].reshape(-1, heads, g * m, q.shape[-1]), k[blind_at], v[blind_at],
                attn_mask=seen.repeat(1, 1, g, 1), scale=call.scale)
            out[blind_at, :, :, a : a + m] = rows.reshape(-1, heads, g, m, d)
    layer._compact(width, keys, values, pos, [{} for _ in layer.groups])
    new = layer.pos.numpy().reshape(configs, width)
    for walker in walkers:
        _relocate(new[walker.lo : walker.hi], walker.p, walker.col, walker.length)
    layer.seen = t0 + n


def _blind(layer, walkers, call):
    """``(batch,)`` bool: the rows whose class reads no attention, whose outputs a masked fused attention gives (none
    where the model caps its logits, which that attention cannot)."""
    blind = torch.zeros(layer.pos.shape[0], dtype=torch.bool)
    if call.softcap is None:
        for walker in walkers:
            if not walker.observes:
                blind[walker.group.rows] = True
    return blind


def _flat(x):
    """A block's logits, weights or marks ``(rows, heads, m, G, columns)`` as NumPy ``(rows x heads, m, G, columns)``."""
    return x.numpy().reshape(-1, *x.shape[2:]) if x.dim() == 5 else _NO_BLOCK.numpy()


__all__ = ["decode", "fits", "off", "run", "walk_kernel", "walks"]

"""Random eviction: evict uniformly at random among every held position, the newcomer included.
Nothing is protected beyond what the cache rules force (the budget). The floor any scoring rule
has to clear: what choosing blindly keeps.

No ``recent_window``, on purpose: with one, this would be "a recency window plus noise", and the
plain draw is the cleaner floor; h2o's or snapkv's rows at the same budget say what their scores
and windows add to it. (It also keeps this policy a single line, not a curve, in the app.)

The first policy that draws from the ``rng`` the interface passes (``uses_rng = True``): the same
seed gives the same victims. ``rng=None`` means ``numpy.random.default_rng(DEFAULT_SEED)``, so a
replay by name is deterministic too. Each eviction draws its victims as one uniform sample
without replacement (``rng.choice``) from the held positions (one victim per step under the
harness); victims come back in ascending position order. Attention is never read.

Its fast path is declared here too (``STEPS``): the hook with which the engine's one step loop
(``kvsim.sim.kernels``) replays every configuration at once. The draws depend on the cache's length alone,
so ``engine_inputs`` makes them ahead, with the very calls ``evict`` makes, and the pick evicts the slot
drawn for the step (one victim a step from step ``budget`` on).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, Display, EngineBinding, SlotPolicy
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks
from ..policykit.tensor_hooks import TensorHooks, TensorState, WalkMap

#: the seed of the generator used when none is passed
DEFAULT_SEED = 0


@kernel
def _random_pick(state, c, t, p_c, n, A, a0, scored):
    """``plan[c, t - 1]``: the slot (kept order, after admitting t) drawn for step t (``engine_inputs``)."""
    return state[0][c, t - 1]


@kernel
def _random_admit(state, c, p_c, n):
    """The count of positions admitted (the newest's plus one): what the deployed cache's walk hands back."""
    state[1][c] = p_c[n] + 1


def _random_state(shape: Shape, plan):
    return plan, np.zeros(shape.configs, dtype=np.int64)


#: random's hooks of the engine's step loop, which its ``engine_binding`` names: nothing per slot but the
#: positions, one victim per step from step ``budget`` on
STEPS = SlotHooks("random_steps", _random_state, admit=_random_admit, pick=_random_pick)


# --------------------------------------------------------------------------------------------
# the tensor step (the deployed cache's, ``kvsim.hf.tensor``): the draws are made on the host, ahead of the steps
# (``AHEAD`` steps at a time), with the very calls ``evict`` makes, and handed to the device as a plan; a step reads
# its (row, KV head)'s draw from the plan at its own count of admitted positions, so nothing is read back. A step
# t >= budget evicts one of budget + 1 held, so each draw is ``_draw(budget + 1, 1)``, the slot in kept order, which
# is the column with that many held positions older. The draws are made step by step, then KV head by KV head,
# then row by row: the reference path's order (decode and an exact prompt), so a layer whose policies share one
# generator (a seeded cache, ``EvictingLayer``'s) draws what the reference draws. Fast prefill draws a chunk head
# by head (``kvsim.hf.tensor.refusal`` keeps a seeded cache of several KV heads there on the reference path), and
# a padded row evicts later than the others, which a shared generator would feel: refused in one line. The compiled
# walk on a CPU (``kvsim.hf.walk``) reads the same plan, drawn on first to the positions it is sized for, in the same
# order: the stream is one whichever path draws next.

#: steps whose draws are made at once
AHEAD = 256


def _random_tensor_state(policies, batch, heads, width, device):
    import torch

    return TensorState({"admitted": torch.zeros(batch, heads, dtype=torch.int64, device=device),
                        "plan": torch.zeros(batch, heads, 0, dtype=torch.int64, device=device)})


def _random_tensor_admit(state, new, before):
    state.params["admitted"] = state.params["admitted"] + new.any(-1)


def _random_draws(state, upto: int) -> None:
    """The plan drawn on to step ``upto`` (excluded) from the first step not yet drawn for, in the reference path's
    order (step by step, then KV head by KV head, then row by row), with the very calls ``evict`` makes."""
    import torch

    policies, budgets = state.host["policies"], state.host["budgets"]
    until = state.host.setdefault("until", min(min(row) for row in budgets))  # the first step not yet drawn for
    if upto <= until:
        return
    generators = [p.rng for row in policies for p in row]
    if state.host.get("padded") and len({id(g) for g in generators}) < len(generators):
        raise ValueError("a seeded random draws a layer's heads from one generator in the reference path's "
                         "order, which a padded row's later evictions change: build the cache with tensor=False")
    steps = range(until, upto)
    plan = np.zeros((len(policies), len(policies[0]), len(steps)), dtype=np.int64)
    for i, t in enumerate(steps):
        for h in range(plan.shape[1]):
            for b, (row, budget) in enumerate(zip(policies, budgets, strict=True)):
                if t >= budget[h]:
                    plan[b, h, i] = row[h]._draw(budget[h] + 1, 1)[0]
    drawn = state.params["plan"]
    state.params["plan"] = torch.cat([drawn, torch.as_tensor(plan, device=drawn.device)], -1)
    state.host["until"] = upto


def _random_tensor_rank(state, cols):
    least = min(min(row) for row in state.host["budgets"])
    until = state.host.setdefault("until", least)
    if until <= cols.t:
        _random_draws(state, max(cols.t + 1, until + AHEAD))
    at = (state.params["admitted"] - 1 - least).clamp(min=0)  # the step an unpadded row draws this eviction at
    drawn = state.params["plan"].gather(-1, at[..., None])
    return (cols.older != drawn).double(), cols.held


def _random_walk_inputs(state, steps: int) -> dict:
    """The engine's plan (``engine_inputs``' layout: ``plan[c, t - 1]`` the slot drawn for step t) for every
    configuration of the group, from the tensor state's draws, drawn on to cover ``steps`` first: the walk never
    draws again, so the generators' stream is the tensor path's."""
    _random_draws(state, steps)
    drawn = state.params["plan"].numpy()
    least = state.host["until"] - drawn.shape[-1]  # the step of the first draw
    plan = np.full((drawn.shape[0] * drawn.shape[1], steps), -1, dtype=np.int64)
    count = min(drawn.shape[-1], steps - least + 1)
    plan[:, least - 1 : least - 1 + count] = drawn.reshape(plan.shape[0], -1)[:, :count]
    return {"plan": plan}


def _random_walk_read(engine, c, held, slots, params):
    """Configuration c's count of admitted positions into the engine's (its draws are in the plan already)."""
    engine[1][c] = params["admitted"][c]


def _random_walk_write(engine, p, col, length, slots, params):
    """Every configuration's count of admitted positions from the engine's into the tensor state's."""
    params["admitted"][:] = engine[1]


#: random's tensor step, which its ``tensor_step`` names
TENSOR = TensorHooks("random", _random_tensor_state, _random_tensor_rank, admit=_random_tensor_admit,
                     walk=WalkMap(_random_walk_read, _random_walk_write, inputs=_random_walk_inputs))


@register
class RandomEviction(SlotPolicy):
    name = "random"
    order = 130
    deterministic = False
    summary = "evict uniformly at random, from the rng it is given: the floor any informed policy must clear"
    display = Display("#fb9a99", "12px,3px,3px,3px,3px,3px", 4)
    engine_binding = EngineBinding(STEPS)
    tensor_step = TENSOR
    uses_rng = True

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        super().__init__(budget, np.random.default_rng(DEFAULT_SEED) if rng is None else rng)

    @classmethod
    def engine_inputs(cls, policies, steps):
        """Each configuration's victims, drawn before the replay with the very calls ``evict`` makes,
        in the same order: the draws depend on the cache's length only, which is
        ``min(t, budget) + 1`` after admitting t, so step t >= budget draws one slot of
        ``budget + 1`` (kept order). ``plan[c, t - 1]`` is that slot (-1 where nothing is evicted);
        each generator is left where the reference leaves it."""
        plan = np.full((len(policies), steps), -1, dtype=np.int64)
        for c, p in enumerate(policies):
            for t in range(p.budget, steps + 1):
                plan[c, t - 1] = p._draw(p.budget + 1, 1)[0]
        return {"plan": plan}

    def _draw(self, held: int, n_evict: int) -> np.ndarray:
        """The slots (kept order) of ``n_evict`` victims among ``held``: one uniform sample without
        replacement from the policy's generator."""
        return self.rng.choice(held, size=n_evict, replace=False)

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        self._step_attention(None)  # the free-slot check only: attention is never read
        self._admit(pos)

    def layout_priorities(self) -> np.ndarray:
        """A serving layout's per-position score (kvsim.policykit.layouts): one uniform draw per held position
        from the policy's own generator, the lowest going first."""
        return self.rng.random(self.kept.size)

    def evict(self, budget: int) -> list[int]:
        n_evict = self._len - budget
        if n_evict <= 0:
            return []
        values = np.ones(self._len)
        values[self._draw(self._len, n_evict)] = 0.0  # the chosen go first
        return self._evict_lowest(budget, values)

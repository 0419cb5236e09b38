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
from .base import DEFAULT_BUDGET, Display, EngineBinding, SlotPolicy
from .registry import register
from .slot_hooks import Shape, SlotHooks

#: the seed of the generator used when none is passed
DEFAULT_SEED = 0


@kernel
def _random_pick(state, c, t, p_c, n, A, a0, scored):
    """``plan[c, t - 1]``: the slot (kept order, after admitting t) drawn for step t (``engine_inputs``)."""
    return state[0][c, t - 1]


def _random_state(shape: Shape, plan):
    return (plan,)


#: random's hooks of the engine's step loop, which its ``engine_binding`` names: nothing per slot but the
#: positions, one victim per step from step ``budget`` on
STEPS = SlotHooks("random_steps", _random_state, pick=_random_pick)


@register
class RandomEviction(SlotPolicy):
    name = "random"
    order = 130
    deterministic = False
    summary = "evict uniformly at random, from the rng it is given: the floor any informed policy must clear"
    display = Display("#fb9a99", "12px,3px,3px,3px,3px,3px", 4)
    engine_binding = EngineBinding(STEPS)
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
        """A serving layout's per-position score (kvsim.policies.layouts): one uniform draw per held position
        from the policy's own generator, the lowest going first."""
        return self.rng.random(self.kept.size)

    def evict(self, budget: int) -> list[int]:
        n_evict = self._len - budget
        if n_evict <= 0:
            return []
        values = np.ones(self._len)
        values[self._draw(self._len, n_evict)] = 0.0  # the chosen go first
        return self._evict_lowest(budget, values)

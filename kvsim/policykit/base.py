"""The policy interface every eviction policy implements (docs/domain.md, "The policy interface").

A policy holds a set of token positions, ``kept``, in ascending order: the order in which
attention arrives. The harness calls ``on_decode_step(pos, attn)`` once per decode step
(``attn`` is aligned with ``kept`` as it was *before* the call, or ``None`` for "no
information"), then ``evict(budget)``, which returns the victims in ascending position order.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

DEFAULT_BUDGET = 256


class ContractError(AssertionError):
    """A policy broke the victims contract (docs/domain.md, "The harness"), or holds a schedule
    that would (an offline reference's, from a damaged cache)."""


class LayoutError(ValueError):
    """A layout that cannot run as asked: one line naming the policy, the layout and the problem
    (``kvsim.policykit.layouts``)."""


class ParamError(ValueError):
    """A policy parameter (or the budget) out of its bounds. Its fields name what was wrong, so an
    entry point can say it in its own terms (the CLI: ``--recent-window 32 must be below --budget 16``)
    while the message stays readable on its own."""

    def __init__(self, message: str, *, param: str, value, problem: str, limit: int | None = None,
                 limit_name: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # "budget" or the parameter's name
        self.value = value
        self.problem = problem  # "not an integer", "negative", "below 1", "not below"
        self.limit = limit
        self.limit_name = limit_name


def check_budget(budget: int) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise ParamError(f"budget must be an integer, got {budget!r}", param="budget", value=budget,
                         problem="not an integer")
    if budget < 1:
        raise ParamError(f"budget must be at least 1, got {budget}", param="budget", value=budget, problem="below 1",
                         limit=1)
    return int(budget)


def check_param(name: str, value: int, *, below: int | None = None, below_name: str = "budget", minimum: int = 0) -> int:
    """Validate a non-negative integer parameter (at least ``minimum``), optionally strictly below ``below``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ParamError(f"{name} must be an integer, got {value!r}", param=name, value=value, problem="not an integer")
    if value < 0:
        raise ParamError(f"{name} must be non-negative, got {value}", param=name, value=value, problem="negative")
    if value < minimum:
        raise ParamError(f"{name} must be at least {minimum}, got {value}", param=name, value=value,
                         problem=f"below {minimum}", limit=minimum)
    if below is not None and value >= below:
        raise ParamError(f"{name} must be less than {below_name} ({below}), got {value}", param=name, value=value,
                         problem="not below", limit=below, limit_name=below_name)
    return int(value)


@dataclass(frozen=True)
class Param:
    """A tunable integer parameter of a policy: what the registry lists, the CLI turns into a flag
    and the app into a control. Its bounds are checked by ``check`` when the policy is built."""

    name: str
    default: int
    help: str
    #: True when the value must be strictly below the budget (a window the size of the cache would
    #: leave nothing to choose between)
    below_budget: bool = False
    #: the smallest value allowed (0 unless a count of 0 means nothing, as a window of no queries)
    minimum: int = 0

    def check(self, value: int, budget: int) -> int:
        return check_param(self.name, value, below=budget if self.below_budget else None, minimum=self.minimum)

    def upper(self, budget: int) -> int | None:
        """The largest value allowed at ``budget`` (None: no upper bound)."""
        return budget - 1 if self.below_budget else None


#: the window of every policy that protects its newest positions (h2o, scissorhands, snapkv, vatp, critical, ...),
#: declared once: a spec reads it as ``spec.params.recent_window``, everything else names it by ``WINDOW``
RECENT_WINDOW = Param("recent_window", 32, "the newest recent_window positions are never evicted", below_budget=True)
#: its name: the key of a window's value in a row, a plan or a policy's parameters, and the label of a window axis;
#: the one place kvsim spells it (JSON files and the ``--recent-window`` flag spell it at the edge)
WINDOW = RECENT_WINDOW.name


@dataclass(frozen=True)
class Display:
    """How the views draw a policy: its line on the charts (the recent_window curve, the model view)
    and what its score is called on the scores view. Every colour and every line differs in its
    proportions from every other policy's (tests/test_views_text.py holds it)."""

    colour: str
    #: Plotly's dash: lengths in px ("12px,4px"), or "solid"
    dash: str
    width: float
    #: the marker on a curve (the policies with a recent_window); None for a horizontal line
    symbol: str | None = None
    #: what the score counts, for the scores view's axes (the policies that keep scores)
    score_name: str = "cumulative score"


@dataclass(frozen=True)
class EngineBinding:
    """How the fast engine (``kvsim.sim.engine``) replays a policy, declared beside it: its hooks of the
    engine's step loop, or a path to them, so that this layer loads neither numba nor the engine; the
    engine specialises the loop on first use. What the kernel reads comes from the policy's ``engine_inputs``."""

    #: the policy's ``kvsim.policykit.slot_hooks.SlotHooks`` (every built-in's, beside it: ``EngineBinding(STEPS)``),
    #: or the ``"module:name"`` of its hooks or of a ``SlotKernel`` (the step loop specialised already, and the
    #: state it allocates), e.g. ``"kvsim.policies.h2o:STEPS"``
    kernel: object
    #: about how long its kernels take to compile from nothing on two cores (the app's warm-up estimate)
    compile_s: float = 2.0


@dataclass(frozen=True)
class Capabilities:
    """What a policy can do beyond the interface, as its class declares it (``registry.capabilities(name)``; one
    query each: ``registry.window_param``, ``layout_ready``, ``can_pool``, ``reads_meta``, ``is_offline``,
    ``is_optimum``, ``has_engine``, ``tensor_step``, ``needs_model``, ``walks_prompt``). ``MISSING`` names each in
    the words a refusal uses."""

    #: the parameter its recent_window curve sweeps, or None
    window: str | None
    #: a serving layout can sum its scores (``layout_priorities``, ``layout_drop``)
    layout_score: bool
    #: adakv can pool a layer's KV heads by its score
    pools_heads: bool
    #: it reads constants of its trace's meta (``check_meta``)
    reads_meta: bool
    #: an offline reference: it reads the whole trace, future rows included (``needs_trace``)
    offline: bool
    #: the exact optimum (offline), solved under blocks too
    optimum: bool
    #: the fast engine replays it (``engine_binding``)
    engine: bool
    #: the deployed cache steps it as tensor operations (``tensor_step``)
    tensor: bool
    #: a prompt scorer whose scores come from a pass of the model itself (``needs_model``): chosen only as the
    #: prefill_policy of a deployed cache, never replayed on a trace nor stepped while decoding
    needs_model: bool = False
    #: the deployed cache walks its prompt on a CPU in one compiled loop by its engine hooks (its tensor step's ``walk``)
    walks: bool = False

    #: each capability a run may need, as a refusal names it when it is missing
    MISSING: ClassVar[dict[str, str]] = {
        "window": "no window parameter (window)",
        "layout_score": "no layout score (layout_score: layout_priorities() and layout_drop())",
        "pools_heads": "no score to pool a layer's heads by (pools_heads)",
        "engine": "no fast path (engine_binding)",
        "tensor": "no tensor step (tensor_step)",
    }


class Policy:
    """Base class: the members of docs/domain.md ("The policy interface"), plus the cache's starting state ``[0]``."""

    name: ClassVar[str] = ""
    #: where the lists (the CLI's choices, the app's, the table's rows) place it: ascending, then load order
    order: ClassVar[float] = 1000.0
    #: True for policies whose eviction depends on the attention they are shown.
    reads_attention: ClassVar[bool] = False
    #: True for policies that keep a per-position score (the app's cumulative-score view).
    keeps_scores: ClassVar[bool] = False
    #: True for offline references that read the whole trace (future rows included); they take
    #: a ``trace=`` parameter, which the registry's ``make_policy`` passes when it is given one.
    needs_trace: ClassVar[bool] = False
    #: True for those that read the trace's dense matrix, which a query/key trace has only up to
    #: ``kvsim.data.qk.DENSE_LIMIT`` steps (the others read rows a block at a time)
    needs_matrix: ClassVar[bool] = False
    #: the trace members it reads besides attention (``kvsim.data.vectors.MEMBERS``: "keys", "values",
    #: "queries", "out_norms"); the harness hands each position's rows to ``see`` before admitting it, and
    #: refuses a trace without them in one line
    reads: ClassVar[tuple[str, ...]] = ()
    #: the policy's tunable parameters beyond budget, in the order the controls list them
    tunables: ClassVar[tuple[Param, ...]] = ()
    #: the configurations ``kvsim table`` measures it at (its parameters beyond budget; ``{}``: its defaults), in order
    table_rows: ClassVar[tuple[dict, ...]] = ({},)
    #: False for a policy whose choices are drawn at random: the studies that rank configurations leave it out
    deterministic: ClassVar[bool] = True
    #: what the policy does, in one line the app and the CLI can quote (``describe_policy`` falls
    #: back to the docstring's first sentence when a policy leaves it empty)
    summary: ClassVar[str] = ""
    #: how the views draw it (None: one of the curve's spare styles)
    display: ClassVar[Display | None] = None
    #: how the fast engine replays it (None: the reference harness replays it)
    engine_binding: ClassVar[EngineBinding | None] = None
    #: how the deployed cache steps it as tensor operations on the model's device, every row and KV head of a
    #: layer at once (``kvsim.policykit.tensor_hooks.TensorHooks``, declared beside the policy as its engine
    #: hooks are; None: the deployed cache steps it on the reference path, one (row, KV head) at a time)
    tensor_step: ClassVar[object | None] = None
    #: True for a policy whose scorer was fitted on kvsim's own shipped traces (learned): the proxy study, whose
    #: grid is the hand-written policies', leaves it out
    fitted: ClassVar[bool] = False
    # --- what it can do beyond the interface: read by the registry's queries (``registry.capabilities``), never
    # --- by ``getattr`` at the point of use; ``register`` holds each declaration to the code that backs it
    #: the parameter a recent_window curve sweeps (one of ``tunables``), or None: a horizontal line on the curve
    window: ClassVar[str | None] = None
    #: True when a serving layout (blocks, shared selection, intervals) can sum its scores: it backs
    #: ``layout_priorities()`` and ``layout_drop()`` (a ``SlotPolicy`` that ranks in one ``_evict_lowest`` call
    #: has both)
    layout_score: ClassVar[bool] = False
    #: True when adakv can pool a layer's KV heads under it: one score comparable across heads (h2o's)
    pools_heads: ClassVar[bool] = False
    #: True when it reads constants of its trace's meta (a RoPE); built with ``trace=``, and its ``check_meta``
    #: says in one line a meta it cannot follow
    reads_meta: ClassVar[bool] = False
    #: True for the exact optimum (offline): solved in one pass, under blocks too (``--block-size``)
    optimum: ClassVar[bool] = False
    #: True for a prompt scorer whose scores a pass of the model computes (``kvsim.hf.reconstruction``): registered
    #: with ``register_scorer`` (not in ``POLICIES``), chosen only as a deployed cache's ``prefill_policy``; a trace
    #: has no model to run it, and it scores no position decoded after the prompt
    needs_model: ClassVar[bool] = False

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        self.budget = check_budget(budget)
        self.rng = rng  # accepted by every policy; deterministic ones never touch it

    @property
    def params(self) -> dict[str, int]:
        """The policy's own parameters (beyond budget), as passed to ``make_policy``: each tunable's
        value, read from the attribute of the same name."""
        return {p.name: getattr(self, p.name) for p in self.tunables}

    @classmethod
    def engine_inputs(cls, policies: Sequence[Policy], steps: int, vectors: Mapping[str, np.ndarray] | None = None
                      ) -> dict[str, np.ndarray]:
        """What the fast engine (``kvsim.sim.engine``) reads from ``policies``, configurations of
        this class built on one trace of ``steps`` steps, to replay them all in one pass: arrays
        named after the keyword arguments of its ``engine_binding``'s state (h2o's ``windows``, one
        recent window per configuration). ``vectors``: the trace's members the class ``reads``, whole
        (position-major), given only to a class that reads some. A policy without engine inputs has none."""
        return {}

    def see(self, pos: int, vectors: Mapping[str, np.ndarray]) -> None:
        """Position ``pos``'s row of each member the policy ``reads`` (``vectors["keys"]`` its key, ...),
        handed over right before ``on_decode_step(pos, ...)`` admits it: by the harness from the trace,
        by the deployed cache from what the model computed. A policy that reads nothing ignores it."""

    @classmethod
    def check_meta(cls, meta: Mapping, source: str, head_dim: int) -> None:
        """Refuse (ValueError, one line) a trace's ``meta`` the policy cannot follow (``source`` names where it came
        from); only a policy that ``reads_meta`` is asked."""

    def layout_priorities(self) -> np.ndarray:
        """float64, aligned with ``kept``: each held position's score under the policy's own rule, the lowest going
        first, ``inf`` where the rule never evicts it. A policy that declares ``layout_score`` defines it."""
        raise NotImplementedError(f"{self.name} declares no layout score (layout_score)")

    def layout_drop(self, victims: np.ndarray) -> None:
        """Remove ``victims`` (held positions, ascending) and their per-position state: what a layout chose. A
        policy that declares ``layout_score`` defines it."""
        raise NotImplementedError(f"{self.name} declares no layout score (layout_score)")

    @property
    def kept(self) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:  # pragma: no cover
        raise NotImplementedError

    def evict(self, budget: int) -> list[int]:  # pragma: no cover
        raise NotImplementedError

    def held_bounds(self, t: int, budget: int) -> tuple[int, int]:
        """How many positions it may hold after evicting at step ``t`` (0-based), low and high: ``min(t + 1,
        budget)`` exactly, which the harness holds it to; a policy under a serving layout (``kvsim.policykit.layouts``)
        answers its layout's range instead."""
        return (min(t + 1, budget),) * 2

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in {"budget": self.budget, **self.params}.items())
        return f"{type(self).__name__}({args})"


def describe_policy(cls: type[Policy]) -> str:
    """The policy's one-line ``summary``, else the first sentence of its module's or class's docstring."""
    if cls.summary:
        return cls.summary
    doc = cls.__doc__ or getattr(sys.modules.get(cls.__module__), "__doc__", None) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".") if first else cls.name


def per_config(values) -> np.ndarray:
    """One int64 per configuration: the shape ``engine_inputs`` gives a parameter in."""
    return np.fromiter(values, dtype=np.int64)


class SlotPolicy(Policy):
    """Shared mechanics of the policies that keep per-position state in parallel arrays indexed by
    kept order (ascending position, the order attention arrives in): h2o, scissorhands, tova.

    ``budget + 1`` slots, the most the cache holds (right after admitting the new position).
    Subclasses name their per-slot arrays in ``_slot_arrays`` so eviction compacts them together.
    """

    #: a layout sums the scores its ``evict`` hands ``_evict_lowest`` (a subclass that ranks another way overrides
    #: ``layout_priorities``)
    layout_score: ClassVar[bool] = True

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None) -> None:
        super().__init__(budget, rng)
        self._pos = np.zeros(self.budget + 1, dtype=np.int64)
        self._len = 1  # position 0

    def layout_priorities(self) -> np.ndarray:
        """The values ``evict`` hands ``_evict_lowest`` (its scores of the evictable prefix, computed by its own
        code, nothing evicted), ``inf`` for the slots beyond the prefix."""
        seen: list[np.ndarray] = []

        def record(budget: int, values: np.ndarray) -> list[int]:
            seen.append(np.asarray(values, dtype=np.float64).copy())
            return []

        self._evict_lowest = record  # an instance attribute, shadowing the method for this one call
        try:
            self.evict(0)
        finally:
            del self._evict_lowest
        if len(seen) != 1:
            raise LayoutError(f"{self.name}: its evict did not rank its positions in one _evict_lowest call; "
                              "a layout needs layout_priorities() on it")
        out = np.full(self._len, np.inf)
        out[: seen[0].size] = seen[0]
        return out

    def layout_drop(self, victims: np.ndarray) -> None:
        """Compact the slot arrays as ``_evict_lowest`` does, ``victims`` out."""
        n = self._len
        keep = ~np.isin(self._pos[:n], victims)
        m = int(keep.sum())
        if n - m != victims.size:
            raise LayoutError(f"{self.name}: asked to drop {victims.tolist()}, not all held")
        for arr in (self._pos, *self._slot_arrays()):
            arr[:m] = arr[:n][keep]
        self._len = m

    def _slot_arrays(self) -> list[np.ndarray]:
        """Per-slot state besides the positions, compacted along with them on eviction."""
        return []

    @property
    def kept(self) -> np.ndarray:
        return self._pos[: self._len].copy()

    def _step_attention(self, attn: np.ndarray | None) -> np.ndarray | None:
        """Check there is a free slot and that ``attn`` is aligned with ``kept``; the array or None."""
        n = self._len
        if n == self._pos.size:
            raise RuntimeError(f"{self.name}: cache full ({n}); evict before the next step")
        if attn is None:
            return None
        attn = np.asarray(attn)
        if attn.shape != (n,):
            raise ValueError(f"{self.name}: attn has shape {attn.shape}, expected ({n},)")
        return attn

    def _admit(self, pos: int) -> int:
        """Append ``pos`` in the next slot; the slot index, for the subclass's own state."""
        i = self._len
        self._pos[i] = pos
        self._len = i + 1
        return i

    def _evict_lowest(self, budget: int, values: np.ndarray) -> list[int]:
        """Evict down to ``budget`` by repeated argmin over ``values``, which covers the first
        ``len(values)`` slots (the evictable prefix). The first minimum wins, so equal values evict
        the lower position; victims come back in ascending position order."""
        n_evict = self._len - budget
        if n_evict <= 0:
            return []
        candidates = values.size
        if candidates < n_evict:
            raise ValueError(f"{self.name}: cannot evict to budget {budget} from {candidates} evictable positions")
        if n_evict == 1:  # the usual step (one admitted, one out): no copy, the later slots shifted down one
            i = int(np.argmin(values))  # float32 or float64 alike: the same order, the same first minimum
            n = self._len
            victim = int(self._pos[i])
            for arr in (self._pos, *self._slot_arrays()):
                arr[i : n - 1] = arr[i + 1 : n]  # NumPy copies an overlapping slice as if through a buffer
            self._len = n - 1
            return [victim]
        values = values.astype(np.float64)  # a copy: chosen slots are set to +inf below
        chosen = np.zeros(self._len, dtype=bool)
        for _ in range(n_evict):
            i = int(np.argmin(values))
            chosen[i] = True
            values[i] = np.inf
        victims = self._pos[: self._len][chosen].tolist()
        keep = ~chosen
        m = self._len - n_evict
        for arr in (self._pos, *self._slot_arrays()):
            arr[:m] = arr[: self._len][keep]
        self._len = m
        return victims

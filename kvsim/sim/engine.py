"""The fast engine: replays many configurations of one trace at once, with exactly the results of
the reference policies (``kvsim.replay``), which stay the readable, authoritative implementation.
The step loop is in ``kvsim.sim.kernels`` (its exactness rules are stated there), specialised per
policy; this module allocates the arrays every policy's loop shares, runs it a chunk of steps at a
time (so that ``progress`` can be told between chunks) and spreads a sweep's batches over threads.

Which policies it replays is read off the registry: a policy whose class declares an
``engine_binding`` (``kvsim.policies.EngineBinding``: its ``SlotHooks``, declared beside it as every built-in's are,
or the path of its hooks or ``SlotKernel``, resolved here on first use, so the policies layer imports
neither numba nor this module) is replayed by that kernel, every other registered policy by the
reference harness. What the kernel reads comes through the
policy's own public hook, ``Policy.engine_inputs(policies, steps)``: a classmethod declared next to the
policy that turns its configurations (built on one trace) into arrays named after the keyword
arguments of its kernel's ``state``. h2o gives ``windows`` (one recent window per configuration),
scissorhands ``windows`` and ``histories``, snapkv ``windows`` and ``obs_windows``, streaming_llm and
sliding_window ``sinks``, random ``plan`` (the slots its generator draws, with the calls its ``evict``
makes), greedy_future ``suffix`` (its block suffix sums) and optimal ``plan`` (the positions its
schedule evicts, checked legal); tova gives nothing. A state whose signature and hook disagree fails
on its first call, by name, rather than reading a parameter that is not there.

``FAST`` is the registry's view of the policies the engine replays, each with its ``SlotKernel``;
``kvsim.replay`` and ``kvsim.sweep`` use it when ``covers`` says so and the reference harness otherwise.
``prepare`` compiles one policy's kernels ahead of its first replay; ``ready`` says whether they are
compiled in this process (a caller inside ``kvsim.jit.compiled_only()``, the app's page, replays on the
reference path until they are, rather than wait for numba).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from .. import jit
from ..data import vectors
from ..data.trace import Trace, from_array
from ..jit import AVAILABLE
from ..policies import POLICIES, Policy, PolicySpec, tunables
from ..policies.greedy_future import BLOCK as GREEDY_BLOCK
from ..policykit import registry
from ..progress import Progress
from . import kernels
from .harness import ReplayResult

#: threads a sweep runs its batches on: one per core
_WORKERS = os.cpu_count() or 1
#: steps per kernel call: the granularity of ``progress`` reports
_CHUNK = 256
#: steps per kernel call on a query/key trace: each call's rows are computed for it, at the positions
#: held when it starts plus those it admits, so a shorter chunk computes fewer weights that nobody reads.
#: A multiple of greedy_future's block: its kernel reads the rest of a block's rows from the chunk
_QK_CHUNK = 64
assert _QK_CHUNK % GREEDY_BLOCK == 0
#: configurations per pass of a sweep. The per-step series (16 bytes per configuration and step)
#: are kept only for one batch, so a sweep holds the trace, O(configurations x budget) of cache
#: state and O(_BATCH x steps) of series, whatever the number of values; a pass re-reads only the
#: kept entries of each row, so batching costs next to nothing.
_BATCH = 64


def _none(dtype, ndim: int) -> np.ndarray:
    """An empty record array: the kernels skip recording when given one."""
    return np.zeros((0,) * ndim, dtype=dtype)


@dataclass
class _Pass:
    """One pass over a trace for configurations of one policy: what every kernel reads (the
    attention as the kernels take it, the top-k positions, one budget per configuration), the
    per-step series of every configuration, the top-k stamp, the slot arrays (positions in kept
    order, how many are held, a gather scratch), and the records of configuration 0 (empty arrays
    when not recording)."""

    A: np.ndarray
    topk: np.ndarray
    budgets: np.ndarray
    progress: Progress | None
    mass: np.ndarray
    recall: np.ndarray
    stamp: np.ndarray  # stamp[p] == t: p is in row t's top k
    pos: np.ndarray
    length: np.ndarray  # every cache starts holding position 0
    gather: np.ndarray
    kept_hist: np.ndarray
    score_hist: np.ndarray
    score_pos: np.ndarray
    victims: np.ndarray
    #: the step ``A``'s first row stands for: 0 (the whole matrix) or the chunk's first step
    a0: int = 0
    #: the trace's rows as the kernels read them (``TraceStore.kernel_view``): the whole matrix, or a query/key
    #: trace's rows computed a call's steps at a time, read-only either way (one compiled signature for both)
    view: object = None

    @classmethod
    def of(cls, trace: Trace, budgets: np.ndarray, top_k: int, record: frozenset, progress,
           keeps_scores: bool) -> _Pass:
        T, n_cfg, width, b0 = trace.steps, budgets.size, int(budgets.max()) + 1, int(budgets[0])
        scores = "scores" in record and keeps_scores
        view = trace.derived.kernel_view(_QK_CHUNK)
        return cls(
            A=view.A,
            topk=trace.derived.topk(top_k),
            budgets=budgets,
            progress=progress,
            mass=np.empty((n_cfg, T), dtype=np.float64),
            recall=np.empty((n_cfg, T), dtype=np.float64),
            stamp=np.zeros(T + 1, dtype=np.int64),
            pos=np.zeros((n_cfg, width), dtype=np.int32),
            length=np.ones(n_cfg, dtype=np.int64),
            gather=np.empty(width, dtype=np.float64),
            kept_hist=np.full((T, b0), -1, dtype=np.int32) if "kept" in record else _none(np.int32, 2),
            score_hist=np.full((T, b0 + 1), np.nan) if scores else _none(np.float64, 2),
            score_pos=np.full((T, b0 + 1), -1, dtype=np.int32) if scores else _none(np.int32, 2),
            victims=np.full(T, -1, dtype=np.int64) if "victims" in record else _none(np.int64, 1),
            view=view,
        )

    @property
    def steps(self) -> int:
        return self.mass.shape[1]

    @property
    def shape(self) -> kernels.Shape:
        return kernels.Shape(*self.pos.shape, self.steps)

    def chunks(self):
        """``(t0, t1)`` per kernel call, telling ``progress`` the share done after each; for a
        query/key trace, ``A`` then holds rows ``t0 .. t1-1`` at every position a configuration may
        read in them (``_candidates``, through the store's ``kernel_view``)."""
        T = self.steps
        size = self.view.steps_per_call or _CHUNK
        for t0 in range(1, T + 1, size):
            t1 = min(t0 + size, T + 1)
            self.a0 = self.view.fill(t0, t1, lambda t0=t0, t1=t1: self._candidates(t0, t1))
            yield t0, t1
            if self.progress is not None:
                self.progress((t1 - 1) / T)

    def _candidates(self, t0: int, t1: int) -> np.ndarray:
        """The positions rows ``t0 .. t1-1`` may be read at: those held before step t0 by any configuration,
        and those admitted in the chunk (what a query/key trace computes: O(chunk x positions x heads x
        head dim)). Every kernel, the window policies' included, keeps its slots in ``pos``."""
        held = self.pos[np.arange(self.pos.shape[1])[None, :] < self.length[:, None]]
        return _union(held, np.arange(t0, t1 - 1))

    def records(self) -> dict:
        return {"victims": self.victims, "kept_history": self.kept_hist, "score_history": self.score_hist,
                "score_positions": self.score_pos}

    def run(self, kernel: kernels.SlotKernel, inputs: dict) -> dict:
        """Every chunk of steps through the policy's specialised step loop; the records of
        configuration 0."""
        state = kernel.state(self.shape, **inputs)
        for t0, t1 in self.chunks():
            kernel.steps(self.A, self.a0, self.topk, t0, t1, self.budgets, self.pos, self.length, self.mass,
                         self.recall, self.stamp, self.gather, self.kept_hist, self.score_hist, self.score_pos,
                         self.victims, state)
        return self.records()


class _Fast(Mapping):
    """The policies the engine replays, read off the registry each time (a policy registered later is
    in it): name -> its ``SlotKernel``, resolved from the class's ``engine_binding`` on first use."""

    def __getitem__(self, name: str) -> kernels.SlotKernel:
        if name not in self:
            raise KeyError(name)
        binding = POLICIES[name].engine_binding
        return _resolve(name, binding.kernel)

    def __contains__(self, name: object) -> bool:
        return name in POLICIES and registry.has_engine(name)  # type: ignore[operator]

    def __iter__(self) -> Iterator[str]:
        return iter([name for name in POLICIES if registry.has_engine(name)])

    def __len__(self) -> int:
        return sum(1 for _ in self)


FAST: Mapping[str, kernels.SlotKernel] = _Fast()

_resolved: dict[str, kernels.SlotKernel] = {}


def _resolve(name: str, bound) -> kernels.SlotKernel:
    """The ``SlotKernel`` a binding names: its ``SlotHooks`` specialised (once a process), or what is at the
    path ("module:name", imported once: a ``SlotKernel``, or hooks to specialise); a ``ValueError`` naming
    the policy and what is wrong with its binding."""
    if isinstance(bound, kernels.SlotHooks):
        return kernels.specialise(bound)
    if not isinstance(bound, str):
        raise ValueError(f"policy {name!r}: engine_binding {bound!r} is a {type(bound).__name__}, not SlotHooks or a path")
    if bound not in _resolved:
        module, _, attr = bound.partition(":")
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"policy {name!r}: engine_binding {bound!r} cannot be resolved ({e})") from None
        if isinstance(found, kernels.SlotHooks):
            found = kernels.specialise(found)
        if not isinstance(found, kernels.SlotKernel):
            raise ValueError(f"policy {name!r}: engine_binding {bound!r} is a {type(found).__name__}, not a SlotKernel")
        _resolved[bound] = found
    return _resolved[bound]


def covers(trace: Trace, name: str) -> bool:
    """Whether the engine replays policy ``name`` on ``trace`` (else the reference harness does)."""
    return AVAILABLE and name in FAST and trace.derived.dtype in (np.float32, np.float64) and trace.steps >= 1


def on_disk(name: str) -> bool:
    """Whether numba's disk cache holds policy ``name``'s kernels, fresh (``prepare`` would load them
    in a fraction of a second rather than compile them): a cheap check, a few small files read."""
    if not AVAILABLE or name not in FAST:
        return True
    from ..data.derived import _topk_positions

    return jit.on_disk(FAST[name].steps, _topk_positions)


def _group(name: str, dtype) -> str:
    """The name ``kvsim.jit`` knows policy ``name``'s kernels by, for attention of ``dtype``."""
    return f"engine.{name}.{np.dtype(dtype).name}"


def ready(trace: Trace, name: str) -> bool:
    """Whether replaying ``name`` on ``trace`` with the engine should be done now (``kvsim.jit.use``):
    its kernels are compiled in this process (by ``prepare`` or an earlier replay), or numba's disk
    cache holds them (loading takes a fraction of a second; only a compile is worth the reference
    path's detour), or the caller is not inside ``kvsim.jit.compiled_only()``. No compiling; at most
    a few small files read."""
    return jit.use(_group(name, trace.derived.dtype)) or on_disk(name)


def run(trace: Trace, policies: list[Policy], top_k: int, progress: Progress | None = None,
        record: frozenset = frozenset()) -> tuple[np.ndarray, np.ndarray, dict]:
    """Replay the configurations ``policies`` (freshly built, all of one name in ``FAST``) in one pass
    through the policy's kernel.

    Returns ``(mass, recall, records)``: float64 ``(configs, T)`` series and, with ``record`` (a set
    of "kept", "scores", "victims"), the kept/score/victim histories of configuration 0."""
    cls = type(policies[0])
    r = _Pass.of(trace, np.array([p.budget for p in policies], dtype=np.int64), top_k, record, progress,
                 cls.keeps_scores)
    inputs = (cls.engine_inputs(policies, trace.steps, vectors.require(trace, cls.reads, cls.name)) if cls.reads
              else cls.engine_inputs(policies, trace.steps))
    records = r.run(FAST[cls.name], inputs)
    jit.mark_compiled(_group(policies[0].name, r.A.dtype))
    return r.mass, r.recall, records


def replay(
    trace: Trace,
    policy: Policy,
    *,
    top_k: int,
    record_kept: bool = False,
    record_scores: bool = False,
    record_victims: bool = False,
    progress: Progress | None = None,
    spec: PolicySpec | None = None,
) -> ReplayResult:
    """The reference's ``ReplayResult`` for a freshly built ``policy`` whose name ``covers``
    (``spec``: what it was built from, carried by the result)."""
    record = frozenset(name for name, on in (("kept", record_kept), ("scores", record_scores), ("victims", record_victims))
                       if on)
    mass, recall, rec = run(trace, [policy], top_k, progress=progress, record=record)
    keeps_scores = record_scores and policy.keeps_scores
    victims = [[int(v)] if v >= 0 else [] for v in rec["victims"]] if record_victims else []
    return ReplayResult(
        policy=policy.name,
        budget=policy.budget,
        params=dict(policy.params),
        steps=trace.steps,
        top_k=top_k,
        retained_mass_series=mass[0],
        top_k_recall_series=recall[0],
        kept_history=rec["kept_history"] if record_kept else None,
        score_history=rec["score_history"] if keeps_scores else None,
        score_positions=rec["score_positions"] if keeps_scores else None,
        victims_history=victims,
        spec=spec,
    )


def sweep(
    trace: Trace, policies: list[Policy], *, top_k: int, progress: Progress | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (mass, recall) series of each freshly built configuration in ``policies`` (all of one
    name that ``covers``), in batches of at most ``_BATCH`` configurations per pass over the trace.

    The batches are independent, so they run on one thread per core (the kernels release the GIL):
    each configuration's arithmetic is the same sequence whichever thread runs it, so the results
    are the serial run's bit for bit. ``progress`` is called from the calling thread only (a
    Streamlit progress bar must be), after each chunk when one thread works and after each batch
    when several do. The trace's top-k positions are computed once, by whichever thread asks
    first (the trace's store holds the others until they are there)."""
    workers = max(1, min(_WORKERS, -(-len(policies) // 8)))  # a thread earns its start-up from ~8 configs
    size = min(_BATCH, -(-len(policies) // workers))
    batches = [policies[i : i + size] for i in range(0, len(policies), size)]
    if len(batches) == 1 or workers == 1:
        out = []
        for j, batch in enumerate(batches):
            report = None if progress is None else (lambda f, j=j: progress((j + f) / len(batches)))
            mass, recall, _ = run(trace, batch, top_k, report)
            out += list(zip(mass, recall, strict=True))
        return out
    from concurrent.futures import ThreadPoolExecutor, as_completed  # a sweep's batches only, not a replay's

    results: list = [None] * len(batches)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run, trace, batch, top_k): j for j, batch in enumerate(batches)}
        for done, future in enumerate(as_completed(futures), start=1):
            mass, recall, _ = future.result()
            results[futures[future]] = list(zip(mass, recall, strict=True))
            if progress is not None:
                progress(done / len(batches))
    return [pair for part in results for pair in part]


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.union1d(a, b)``, the sorted distinct values of both, as ``np.unique`` computes them (sort, keep
    each value that differs from the one before it) but without its question whether the array is a
    masked one, which imports ``numpy.ma`` (0.03-0.08 s of a query/key replay's process here, issue 36)."""
    out = np.concatenate((a, b), axis=None)
    out.sort()
    keep = np.empty(out.shape, dtype=bool)
    keep[:1] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out[keep]


#: roughly how long numba takes to compile one policy's kernels from nothing (two shared cores),
#: what ``prepare`` tells the user to expect
COMPILE_SECONDS = 15


def prepare(name: str, progress: Progress | None = None) -> None:
    """Compile the kernels policy ``name`` replays with (or load them from numba's disk cache), by
    replaying it once on a tiny trace, so that the first real replay starts at once and a first run
    after an install is never silent. ``progress(None, note)`` is called, once, only when numba
    actually compiles (a cache miss: numba's ``numba:compile`` event), not when the kernels load
    from disk. Empty record arrays have the types of full ones, so one recorded replay compiles
    what every later replay and sweep of the policy calls (every trace's attention is float32, as
    the loader makes it). A policy the engine does not replay, no numba, or kernels already
    compiled in this process: nothing to do."""
    if not AVAILABLE or name not in FAST or jit.compiled(_group(name, np.float32)):
        return
    from numba.core import event

    note = f"compiling the {name} engine (once per install, ~{COMPILE_SECONDS} s)"
    listener = _first_compile(None if progress is None else (lambda: progress(None, note)))
    trace = from_array(np.tril(np.ones((9, 9)), -1), name="prepare")
    if POLICIES[name].reads:  # small members of the types a recording has, and a RoPE for those that turn queries
        rng = np.random.default_rng(0)
        draw = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
        trace = dataclasses.replace(trace, keys=draw(9, 4), values=draw(9, 4), queries=draw(9, 2, 4),
                                    out_norms=np.abs(draw(9, 2)),
                                    meta={"rope_inv_freq": [1.0, 0.01], "rope_layout": "rotate_half", "rope_theta": 1e4})
    # every tunable at 1 (below the budget of 4): the kernels' windowed paths are taken too
    spec = PolicySpec.of(name, 4, **{p.name: 1 for p in tunables(name)})
    with event.install_listener("numba:compile", listener):  # process-wide: another thread's compile counts too
        replay(trace, spec.build(trace), top_k=2, record_kept=True, record_scores=True, record_victims=True)


def announce_compile(report: Callable[[], None]):
    """Call ``report`` once, at the start of the first compile numba does in this process from now on
    (any thread), until ``stop_announcing`` is given what this returns. A load from numba's disk cache is
    no compile and says nothing."""
    from numba.core import event

    listener = _first_compile(report)
    event.register("numba:compile", listener)
    return listener


def stop_announcing(listener) -> None:
    from numba.core import event

    event.unregister("numba:compile", listener)


def _first_compile(report: Callable[[], None] | None):
    """A numba event listener that calls ``report`` at the start of the first compilation it sees
    (the kernel a replay calls first; the ones it calls inside are compiled with it)."""
    from numba.core import event

    class FirstCompile(event.Listener):
        fired = False

        def on_start(self, ev) -> None:
            if not self.fired:
                self.fired = True
                if report is not None:
                    report()

        def on_end(self, ev) -> None:
            pass

    return FirstCompile()

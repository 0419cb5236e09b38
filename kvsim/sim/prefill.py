"""Compression at the prompt's end (docs/domain.md, "Scorers beyond attention"; docs/scorers.md "prefill compression"):
the trace's first ``prompt`` positions (0 .. P - 1) are the prompt; at its last position each head keeps
``keep`` of them, chosen once by a scorer policy's score, and decoding goes on from that kept set.

The one-time choice (``choose``): the scorer is built at budget P (so it evicts nothing while it reads
the prompt), stepped through the prompt's rows 1 .. P - 1 with nothing evicted (what a prefill over the
whole prompt computes), then asked once to ``evict(keep)``: its own rule, applied once. With ``snapkv``
(the default) that is SnapKV as published: the ``recent_window`` newest positions (the observation
window) are kept, and of the rest the ``keep - recent_window`` that drew the most attention from the
last ``observation_window`` queries (the paper's 1-D pooling left out, as in kvsim's snapkv). Any online
policy can rank the prompt this way (``RANKERS``): h2o keeps the most attended over the whole prompt,
tova those the last query attends to most, streaming_llm its sinks and the newest, and so on. The
offline references (they read the future) cannot.

Decoding (``Resumed``): with no decode-time policy the cache grows (query t >= P sees the kept set and
every position P .. t - 1); with one (at its own budget), the policy starts from the kept set: it is
built fresh and handed the kept prompt positions in order, as if they had been decoded one after the
other over what it holds (each shown its prompt query's attention over what the policy holds,
renormalised, and its vectors), so it evicts by its own rule where the kept set is above its budget.
The policy works on positions renumbered 0 .. (the kept set, then P, P + 1, ...), so its
contract (position 0 held from the start, ``min(t + 1, budget)`` held after step t) holds unchanged;
``Resumed`` maps them back. The deployed cache (``kvsim.hf``, ``prefill="compress"``) calls the same
``choose`` and ``Resumed`` on the attention the model computed, which is what makes its kept sets the
simulator's.

Figures (``replay_prefill``): retained mass and top-k recall over the decode steps t = P .. T only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ..data import vectors as vec
from ..data.trace import Trace
from ..policies import POLICIES, ParamError, Policy, PolicySpec
from ..policykit import registry
from ..policykit.registry import suggest
from .harness import DEFAULT_TOP_K, ReplayResult, Taken, kept_sum, step, top_k_hits

#: the default scorer of the one-time choice
DEFAULT_SCORER = "snapkv"
#: the decode-time "policy" that lets the cache grow after the prompt
GROW = "none"


class PrefillError(ValueError):
    """A prefill compression that cannot run as asked. ``field`` names what was wrong ("prefill_budget",
    "prompt_length", "prefill_policy"), so an entry point can say it as its own flag."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def parse_scorer(text: str) -> tuple[str, dict]:
    """``--prefill-policy NAME[:param=N,...]``: the scoring policy's name and its integer parameters;
    PrefillError (field "prefill_policy") for anything else, each entry point saying it as its own flag."""
    name, _, rest = text.strip().partition(":")
    params = {}
    for part in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = part.partition("=")
        try:
            params[key.strip()] = int(value)
        except ValueError:
            eq = ""
        if not eq:
            raise PrefillError(f"expected NAME[:param=N,...], got {text!r}", field="prefill_policy")
    return name, params


def refuse_model(name: str) -> None:
    """PrefillError (field "prefill_policy") for a scorer whose scores a pass of the model computes (``needs_model``):
    a trace's rows cannot stand in for them."""
    if registry.needs_model(name):
        raise PrefillError(f"prefill_policy: {name} scores the prompt by a pass of the model itself (needs_model), and "
                           "a trace holds no model: run it on a model (kvsim needle --prefill-policy "
                           f"{name}, kvsim.hf.cache(..., prefill_policy={name!r}))", field="prefill_policy")


def rankers() -> list[str]:
    """The registered policies that can rank a prompt: the online ones (an offline reference reads the
    future, which the prompt's end does not have)."""
    return registry.online()


def prompt_length(trace: Trace, given: int | None = None) -> int:
    """P, the prompt's positions: ``given``, else the trace's meta ``prompt_length``; at least 2 (a prompt
    of one position has nothing to choose) and below the trace's positions (decoding needs a step)."""
    where = "--prompt-length"
    if given is None:
        given = trace.meta.get("prompt_length") if isinstance(trace.meta, dict) else None
        where = f"{trace.name}'s meta prompt_length"
        if given is None:
            raise PrefillError(f"prompt_length: {trace.name} does not say where its prompt ends (no meta prompt_length); "
                               "give it", field="prompt_length")
    if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or not 2 <= given <= trace.steps:
        raise PrefillError(f"prompt_length: {where} {given!r} must be an integer from 2 to the trace's {trace.steps} "
                           "steps (positions 0 .. P - 1 are the prompt, decoding starts at step P)", field="prompt_length")
    return int(given)


def parse_keep(value):
    """``--prefill-budget``'s text as the number it names (an int, else a float); other values as they are.
    PrefillError (field "prefill_budget") for text that is neither."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise PrefillError(f"prefill_budget: expected an integer or a ratio in (0, 1), got {text!r}",
                               field="prefill_budget") from None


def keep_count(value, prompt: int) -> int:
    """N, the positions kept per head: an integer 1 .. ``prompt``, or a ratio in (0, 1), the share of the
    prompt kept: ``int(prompt x ratio)`` (kvpress keeps ``int(q_len x (1 - compression_ratio))``: its
    compression_ratio is the share evicted, so kvpress's 0.25 is kvsim's 0.75)."""
    value = parse_keep(value)
    if isinstance(value, bool):
        raise PrefillError(f"prefill_budget: expected an integer or a ratio, got {value!r}", field="prefill_budget")
    if isinstance(value, (int, np.integer)):
        if not 1 <= value <= prompt:
            raise PrefillError(f"prefill_budget: {value} positions must be from 1 to the prompt's {prompt}",
                               field="prefill_budget")
        return int(value)
    if isinstance(value, float):
        if not (0.0 < value < 1.0):
            raise PrefillError(f"prefill_budget: the ratio {value} must lie strictly between 0 and 1 (the share of the "
                               "prompt kept)", field="prefill_budget")
        n = int(prompt * value)
        if n < 1:
            raise PrefillError(f"prefill_budget: {value} of the prompt's {prompt} positions keeps none", field="prefill_budget")
        return n
    raise PrefillError(f"prefill_budget: expected an integer or a ratio, got {value!r}", field="prefill_budget")


@dataclass(frozen=True)
class Prefill:
    """What is compressed and how: the prompt's positions, how many each head keeps, and the scorer (its
    spec at budget ``keep``, checked there: a window it always keeps must be below ``keep``)."""

    prompt: int
    keep: int
    scorer: PolicySpec

    @classmethod
    def of(cls, trace_or_prompt, keep, scorer: str | PolicySpec = DEFAULT_SCORER, *, prompt: int | None = None,
           **params) -> Prefill:
        """From a trace (its ``prompt_length`` unless ``prompt`` is given) or a prompt length, a keep count
        (``keep_count``) and a scorer (a name with ``params``, or a spec, whose budget is replaced)."""
        P = trace_or_prompt if isinstance(trace_or_prompt, (int, np.integer)) else prompt_length(trace_or_prompt, prompt)
        if isinstance(trace_or_prompt, (int, np.integer)) and not 2 <= P:
            raise PrefillError(f"prompt_length: {P} must be at least 2", field="prompt_length")
        n = keep_count(keep, int(P))
        name = scorer.name if isinstance(scorer, PolicySpec) else scorer
        if name not in POLICIES and name not in registry.SCORERS:
            known = rankers() + registry.model_scorers()
            raise PrefillError(f"prefill_policy: unknown policy {name!r}{suggest(name, known)}; it takes one of {', '.join(known)}",
                               field="prefill_policy")
        if not isinstance(trace_or_prompt, (int, np.integer)):
            refuse_model(name)
        if registry.is_offline(name):
            raise PrefillError(f"prefill_policy: {name} cannot rank the prompt (an offline reference: it reads the "
                               f"future); it takes one of {', '.join(rankers())}", field="prefill_policy")
        kwargs = {**(scorer.kwargs if isinstance(scorer, PolicySpec) else {}), **params}
        try:
            spec = PolicySpec.of(name, n, **kwargs)
        except ParamError as e:
            if e.problem == "not below":
                raise PrefillError(f"prefill_budget: {n} positions must be above the scorer {name}'s {e.param} {e.value}, "
                                   f"which it always keeps (a larger budget, or {name}:{e.param}=N)",
                                   field="prefill_budget") from None
            raise PrefillError(f"prefill_policy: {name}: {e}", field="prefill_policy") from None
        except ValueError as e:
            raise PrefillError(f"prefill_policy: {e}", field="prefill_policy") from None
        return cls(int(P), n, spec)

    def summary(self) -> dict:
        """The prefill's figures as a row's columns: the scorer as its label (``snapkv recent_window=32 ..``)."""
        return {"prompt_length": self.prompt, "prefill_budget": self.keep, "prefill_policy": self.scorer.label}


#: one row of the prompt's attention: ``row(t, positions)`` is query t's weight on each of ``positions``
#: (not renormalised), aligned with them
Rows = Callable[[int, np.ndarray], np.ndarray]
#: position p's row of each member a policy reads (``kvsim.data.vectors.at``)
Vectors = Callable[[int], Mapping[str, np.ndarray]]


def choose(prefill: Prefill, rows: Rows, vectors: Vectors | None = None, trace: Trace | None = None) -> np.ndarray:
    """The positions (ascending) the scorer keeps at the prompt's end: stepped through the prompt's rows
    1 .. P - 1 at budget P (nothing evicted), then ``evict(keep)`` once. ``rows`` and ``vectors`` give what
    the trace (``choose_on``) or the model (``kvsim.hf``) computed."""
    P = prefill.prompt
    policy = prefill.scorer.replace(budget=P).build(trace)
    _see(policy, 0, vectors)
    for t in range(1, P):
        held = policy.kept
        row = np.asarray(rows(t, held), dtype=np.float64) if policy.reads_attention else None
        step(policy, t, row, P, _total(row), _vectors(policy, t, vectors))
    victims = policy.evict(prefill.keep)
    kept = policy.kept
    if kept.size != prefill.keep or len(victims) != P - prefill.keep:
        raise PrefillError(f"prefill_policy: {policy.name} kept {kept.size} of the prompt's {P} positions, not "
                           f"{prefill.keep}: it cannot rank the prompt", field="prefill_policy")
    return kept.astype(np.int64)


def trace_rows(trace: Trace) -> Rows:
    store, out = trace.derived, trace.derived.row_scratch()

    def rows(t: int, positions: np.ndarray) -> np.ndarray:
        return store.row(t, positions, out)[positions]

    return rows


def trace_vectors(trace: Trace, policies: list[Policy | PolicySpec | str]) -> Vectors | None:
    """Position p's rows of what any of ``policies`` reads, from ``trace`` (refused in one line, by
    ``kvsim.data.vectors.require``, when it does not hold them); None when none reads anything."""
    names = []
    for p in policies:
        cls = POLICIES[p] if isinstance(p, str) else POLICIES[p.name] if isinstance(p, PolicySpec) else type(p)
        names += [n for n in cls.reads if n not in names]
        who = cls.name
    if not names:
        return None
    members = vec.require(trace, names, who)
    return lambda p: vec.at(members, p)


def choose_on(trace: Trace, prefill: Prefill) -> np.ndarray:
    """``choose`` on a trace's rows and vectors (a scorer that needs the model refused: ``refuse_model``)."""
    refuse_model(prefill.scorer.name)
    return choose(prefill, trace_rows(trace), trace_vectors(trace, [prefill.scorer]), trace)


class Resumed:
    """A decode-time policy resumed from a kept set: positions renumbered (``kept`` then P, P + 1, ...) so
    the policy starts as it always does, then seeded with the kept positions (see the module's doc).
    ``step(t, ...)`` for t >= P is the harness's step in real positions. ``policy`` None: the cache grows."""

    def __init__(self, policy: Policy | None, kept: np.ndarray, prompt: int, rows: Rows,
                 vectors: Vectors | None = None) -> None:
        self.policy, self.prompt = policy, prompt
        self._kept = np.asarray(kept, dtype=np.int64)
        self.n = self._kept.size
        self._grown = 0  # with no policy: decode positions P .. P + grown - 1 held
        self._next = prompt  # the decode step expected next
        if policy is None:
            return
        budget = policy.budget
        _see(policy, 0, vectors, int(self._kept[0]))
        for c in range(1, self.n):
            real = self.real(policy.kept)
            t = int(self._kept[c])
            row = np.asarray(rows(t, real), dtype=np.float64) if policy.reads_attention else None
            step(policy, c, row, budget, _total(row), _vectors(policy, t, vectors))

    def real(self, compact: np.ndarray) -> np.ndarray:
        compact = np.asarray(compact, dtype=np.int64)
        return np.where(compact < self.n, self._kept[np.minimum(compact, self.n - 1)], compact - self.n + self.prompt)

    @property
    def kept(self) -> np.ndarray:
        """Held now, in real positions, ascending."""
        if self.policy is None:
            return np.concatenate([self._kept, np.arange(self.prompt, self.prompt + self._grown, dtype=np.int64)])
        return self.real(self.policy.kept)

    def step(self, t: int, attention: np.ndarray | None, total: float | None = None,
             vectors: Mapping[str, np.ndarray] | None = None) -> list[int]:
        """Decode step t (>= P, in order): the policy shown query t's ``attention`` over ``kept`` (aligned),
        t admitted, victims (real positions) evicted; with no policy t is simply held."""
        if t != self._next:
            raise ValueError(f"resumed cache: step {t} out of order (expected {self._next})")
        self._next += 1
        if self.policy is None:
            self._grown += 1
            return []
        taken: Taken = step(self.policy, self.n + t - self.prompt, attention, self.policy.budget, total, vectors)
        return self.real(np.asarray(taken.victims, dtype=np.int64)).tolist()


def _see(policy: Policy, compact: int, vectors: Vectors | None, real: int | None = None) -> None:
    if policy.reads:
        if vectors is None:
            raise ValueError(f"{policy.name} reads {', '.join(policy.reads)}; they were not handed over")
        policy.see(compact, vectors(compact if real is None else real))


def _vectors(policy: Policy, t: int, vectors: Vectors | None):
    return vectors(t) if policy.reads and vectors is not None else None


def _total(row: np.ndarray | None) -> float | None:
    """The row's sum added in position order (``kept_sum``'s order: sequential float64)."""
    return None if row is None else float(np.cumsum(row)[-1]) if row.size else 0.0


def replay_prefill(trace: Trace, prefill: Prefill, decode: PolicySpec | None = None, *, top_k: int = DEFAULT_TOP_K,
                   record_kept: bool = False) -> ReplayResult:
    """Compress at the prompt's end, then decode steps P .. T with ``decode`` (None: the cache grows):
    the figures over those steps alone; ``kept_history`` (``record_kept``) row i is what is held after
    step P + i (``-1`` padded). The result's ``params`` carry the prefill's (``Prefill.summary``)."""
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    P, T = prefill.prompt, trace.steps
    kept = choose_on(trace, prefill)
    rows = trace_rows(trace)
    policy = None if decode is None else decode.build(trace)
    vectors = trace_vectors(trace, [decode]) if decode is not None else None
    resumed = Resumed(policy, kept, P, rows, vectors)
    store, out = trace.derived, trace.derived.row_scratch()
    n = T - P + 1
    mass, recall = np.empty(n), np.empty(n)
    width = (prefill.keep + n) if decode is None else decode.budget
    history = np.full((n, width), -1, dtype=np.int32) if record_kept else None
    for i, t in enumerate(range(P, T + 1)):
        held = resumed.kept
        row = store.row(t, held, out)
        total = kept_sum(row, held)
        mass[i] = total
        recall[i] = top_k_hits(store, t, top_k, held) / min(top_k, t)
        reads = policy is not None and policy.reads_attention
        resumed.step(t, row[held] if reads else None, total, _vectors(policy, t, vectors) if policy is not None else None)
        if record_kept:
            after = resumed.kept
            history[i, : after.size] = after
    name = GROW if decode is None else decode.name
    budget = prefill.keep + n if decode is None else decode.budget
    params = {**({} if decode is None else decode.kwargs), **prefill.summary()}
    return ReplayResult(name, budget, params, n, top_k, mass, recall, kept_history=history, spec=decode)

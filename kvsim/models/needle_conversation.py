"""A conversation on one cache, a pass key per turn (issue 57, docs/needle.md "A conversation: a pass key per
turn"; docs/domain.md "A conversation").

A context holds K numbered needles (``needle_prompt.conversation``: key i at its own depth); turn i asks for
key i. Every turn runs on the same cache, which keeps evicting as it decodes: the question is fed as a
further forward call after what the cache has seen (the previous answer's last token first: greedy decoding
writes it without feeding it), then the answer is decoded greedily through the evicting cache. The prompt's
compression (``prefill``) is **query-aware** (``query="aware"``: the context and the first question in the
one compressed call, the question in the scorer's observation window) or **query-agnostic**
(``query="agnostic"``: the context alone compressed, the first question a call of its own after it); any
scorer of the shelf either way. With an exact prompt the two are the same run (every position is stepped
one by one either way), and the mode is not said.

Per run: the answer per turn, found per turn (its first run of digits is that turn's key), each key's fate
per (layer, KV head) (``key_left``: the step its last token left, None when one stayed; ``key_first_left``),
and the retained attention mass over the conversation (``retained``: on the control's attention, the
departures' held sets, ``retained_mass``). With ``optimum``: the exact optimum over the whole conversation
(``needle_traces.optimum`` on the control's attention over every step the full cache took: the context,
every question and every answer it wrote) at the run's budgets, its fate for every key and its retained
mass, the best schedule for all turns at once.

Each run is cached on disk (``<cache>/needle/``, ``needle.read_trial``) under a key made of everything it
depends on; the optimum under the control's tokens and the budgets.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from .needle import NEEDLE_DIR, VERSION, read_trial, write_trial
from .needle_prompt import (
    NEEDLE_NAMED,
    QUESTION_NAMED,
    Builder,
    ConversationPrompt,
    NeedleError,
    Template,
    answer,
    conversation,
    pass_keys,
)
from .needle_runs import CONTROL, NEW_TOKENS, Job, _cache_how, _Departures, _layout_how, fate, first_loss

#: how the prompt's compression sees the first question (``--query``; ``kvsim.hf.conversation.QUERY``)
QUERY = ("aware", "agnostic")
#: ``--query``'s default: the first question in the compressed prompt, as a one-key needle always ran
DEFAULT_QUERY = "aware"

__all__ = ["DEFAULT_QUERY", "NEEDLE_DIR", "QUERY", "ConversationPrompt", "conversation_trial", "label",
           "retained_mass", "run_conversation", "run_conversation_unit"]


def label(job: Job, query: str) -> str:
    """The job's label, the query mode said where it matters (a compressed prompt)."""
    return job.label + (f", query-{query}" if job.prefill is not None else "")


def _key(model_id: str, prompt: ConversationPrompt, job: Job, new_tokens: int, seed: int, query: str) -> dict:
    import transformers

    how = job.how
    key = {"version": VERSION, "kind": "conversation", "model": model_id, "prompt": prompt.digest,
           "key_positions": [list(k) for k in prompt.key_positions], "policy": job.policy, "budget": job.budget,
           "params": dict(sorted(job.params)), "prefill": "exact", "new_tokens": new_tokens,
           "seed": seed if job.policy == "random" else None, "transformers": transformers.__version__}
    if job.allocate is not None:
        key["allocate"] = job.allocate if isinstance(job.allocate, str) else [list(r) for r in job.allocate]
    if how["prefill"]:
        p = how["prefill"]
        key["prefill"] = {"budget": p["budget"], "policy": p["policy"], "params": dict(sorted(p["params"].items())),
                          "query": query}
    if job.layout is not None:
        key["layout"] = job.layout.to_dict()
    return key


def conversation_ids(prompt: ConversationPrompt, tokens: Sequence[Sequence[int]]) -> list[int]:
    """Every position a conversation fed, in order: the context, each question, each answer but the last token
    of the last (written, never fed)."""
    ids = list(prompt.context)
    for q, a in zip(prompt.questions, tokens, strict=True):
        ids += list(q) + list(a)
    return ids[:-1]


def run_conversation(model, prompt: ConversationPrompt, job: Job, *, new_tokens: int = NEW_TOKENS, seed: int | None = None,
                     eos=None, query: str = DEFAULT_QUERY, tensor: bool | None = None) -> dict:
    """One conversation through ``job`` (``CONTROL``: transformers' full cache): ``tokens`` per turn, the timings,
    ``positions``, ``turn_starts``; for a policy ``left`` (every position's departure step per (layer, KV head),
    -1 for held to the end) and ``budgets``. The cache is ``kvsim.hf.cache``'s: the tensor path where the job can
    take it (``tensor=False``: the reference path, which the tensor path's records equal,
    tests/test_needle_conversation.py)."""
    import kvsim.hf as hf
    from kvsim.hf.conversation import converse

    if query not in QUERY:
        raise NeedleError(f"--query: {query!r}: one of {', '.join(QUERY)}", "--query")
    total = len(prompt.context) + sum(len(q) + 1 for q in prompt.questions) + len(prompt.questions) * new_tokens
    if job.policy == CONTROL:
        from transformers import DynamicCache

        hf.attach(model)
        talk = converse(model, DynamicCache(config=model.config), prompt.context, prompt.questions, new_tokens, eos=eos,
                        query=query)
        return {**talk, "left": None, "budgets": None}
    how = job.how
    cache = hf.cache(model, job.policy, job.budget, seed=seed, allocate=how["allocate"], **_cache_how(how["prefill"]),
                     **_layout_how(job.layout), **({} if tensor is None else {"tensor": tensor}), **dict(job.params))
    watch = _Departures(cache, total)
    talk = converse(model, cache, prompt.context, prompt.questions, new_tokens, eos=eos, query=query)
    watch.collect()
    watch.check(talk["positions"])
    budgets = [[row[h] for h in range(watch.left.shape[2])] for row in (layer.budgets[0] for layer in cache.layers)]
    return {**talk, "left": watch.ended(0, talk["positions"]), "budgets": budgets}


def retained_mass(traces: dict, left: np.ndarray, start: int = 1) -> float:
    """The mean over (layer, KV head) and steps ``t >= start`` of the control's attention on what the cache held
    when query t came (position p held at step t: it had not left before t; ``left[x, h, p]`` -1 or at least t),
    the harness's retained mass (``ReplayResult.retained_mass``) read from departures."""
    total, count = 0.0, 0
    for (x, h), trace in traces.items():
        a = np.asarray(trace.attention, dtype=np.float64)
        steps = trace.steps
        dep = left[x, h, : steps + 1]
        t = np.arange(steps + 1)[:, None]
        held = (np.arange(steps + 1)[None, :] < t) & ((dep[None, :] < 0) | (dep[None, :] >= t))
        total += float((a * held)[max(start, 1) :].sum())
        count += steps + 1 - max(start, 1)
    return total / count if count else float("nan")


def _fates(left: np.ndarray, prompt: ConversationPrompt) -> dict:
    return {"key_left": [fate(left, k) for k in prompt.key_positions],
            "key_first_left": [first_loss(left, k) for k in prompt.key_positions]}


def run_conversation_unit(model, tokenizer, model_id: str, template: Template, length: int, depths: Sequence[float],
                          trial: int, jobs: Sequence[Job], *, seed: int = 0, new_tokens: int = NEW_TOKENS,
                          query: str = DEFAULT_QUERY, optimum: bool = False, use_cache: bool = True,
                          needle: str = NEEDLE_NAMED, question: str = QUESTION_NAMED, on_run=None) -> dict:
    """One (length, depths, trial) conversation through the control and each job, each read from the disk cache
    when there: per run the answers, found per turn, every key's fate per (layer, KV head), the retained mass
    (with ``optimum``: the optimum's over the whole conversation beside it)."""
    from . import needle_traces as nt

    builder = Builder(tokenizer, template)
    keys = pass_keys(seed, length, depths, trial)
    prompt = conversation(builder, length, depths, keys, trial, needle, question)
    eos = getattr(tokenizer, "eos_token_id", None)
    runs = []
    control_ids = None
    for i, job in enumerate([Job(CONTROL), *jobs]):
        ck = _key(model_id, prompt, job, new_tokens, seed, query)
        record = read_trial(ck) if use_cache else None
        cached = record is not None
        if record is None:
            record = run_conversation(model, prompt, job, new_tokens=new_tokens, seed=seed, eos=eos, query=query)
            record["texts"] = [tokenizer.decode(t, skip_special_tokens=True) for t in record["tokens"]]
            write_trial(ck, record)
        said = [answer(t) for t in record["texts"]]
        run = {"policy": job.policy, "budget": job.budget, "params": dict(job.params),
               "label": label(job, query) if job.policy != CONTROL else job.label, "prefill": job.how["prefill"],
               "query": query if job.prefill is not None else None, "texts": record["texts"], "answers": said,
               "found": [a == k for a, k in zip(said, prompt.keys, strict=True)], "cached": cached,
               "prefill_seconds": record["prefill_seconds"], "decode_seconds": record["decode_seconds"],
               "positions": record["positions"], "turn_starts": record["turn_starts"], "budgets": record["budgets"],
               "cache_key": ck, **({} if record["left"] is None else _fates(record["left"], prompt))}
        if job.policy == CONTROL:
            control_ids = conversation_ids(prompt, record["tokens"])
        else:
            run["_left"] = record["left"]
        runs.append(run)
        if on_run is not None:
            on_run(i, run)
    if optimum and jobs:
        _add_optimum(model, model_id, prompt, control_ids, runs[1:], use_cache, nt)
    for run in runs[1:]:
        run.pop("_left", None)
    return {"length": length, "depths": list(depths), "trial": trial, "keys": list(keys),
            "key_positions": [list(k) for k in prompt.key_positions], "needle_starts": list(prompt.needle_starts),
            "context_tokens": len(prompt.context), "question_tokens": [len(q) for q in prompt.questions],
            "control": runs[0], "runs": runs[1:]}


#: the control's attention of the last conversation an optimum was asked for, by (model, its ids' digest)
_LAST_TRACES: dict = {}


def _add_optimum(model, model_id: str, prompt: ConversationPrompt, ids: list[int], runs: list[dict], use_cache: bool,
                 nt) -> None:
    """Each run's ``optimal_key_left`` / ``optimal_key_first_left`` per key and ``optimal_retained`` beside its own
    ``retained``: on the control's attention over the whole conversation (every step it took), the exact optimum at
    the run's budgets. ``retained`` counts every step; ``retained_after_prompt`` the steps after the context and the
    first question (the steps at which a compressed prompt's run holds its budget too)."""
    digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:24]
    traces = _LAST_TRACES.get((model_id, digest))
    after = prompt.length  # the context and the first question: every compression has been made by then
    for run in runs:
        ck = {"version": VERSION, "kind": "optimum", "model": model_id, "ids": digest, "budgets": run["budgets"]}
        found = read_trial(ck) if use_cache else None
        if traces is None:
            traces = nt.control_traces(model, ids)
            _LAST_TRACES.clear()  # the last conversation's only: a study asks for one configuration at a time
            _LAST_TRACES[(model_id, digest)] = traces
        if found is None:
            found = {"positions": len(ids), "left": nt.optimum(traces, run["budgets"])}
            write_trial(ck, found)
        best = found["left"]
        mine = _on_control(run["_left"], len(ids))
        run["optimal_key_left"] = [fate(best, k) for k in prompt.key_positions]
        run["optimal_key_first_left"] = [first_loss(best, k) for k in prompt.key_positions]
        run["optimal_cache_key"] = ck
        run["retained"] = retained_mass(traces, mine)
        run["optimal_retained"] = retained_mass(traces, best)
        run["retained_after_prompt"] = retained_mass(traces, mine, after)
        run["optimal_retained_after_prompt"] = retained_mass(traces, best, after)


def _on_control(left: np.ndarray, positions: int) -> np.ndarray:
    """A run's departures over the control's positions: a run that wrote shorter answers (an end of text) saw
    fewer positions; those it never saw count as held (the optimum is compared on the control's steps)."""
    out = np.full(left.shape[:2] + (positions,), -1, dtype=np.int32)
    n = min(positions, left.shape[2])
    out[:, :, :n] = left[:, :, :n]
    return out


def conversation_trial(model: str, policy: str, budget: int, *, length: int = 1024, depths=(0.3, 0.7), trial: int = 0,
                       seed: int = 0, prefill_budget=None, prefill_policy: str = "snapkv", query: str = DEFAULT_QUERY,
                       optimum: bool = False, new_tokens: int = NEW_TOKENS, use_cache: bool = True, **params) -> dict:
    """A pass key per turn in Python: ``len(depths)`` keys in one context of ``length`` tokens (the context and the
    first question), turn i asking for key i, on one cache of ``policy`` at ``budget`` (``prefill_budget``: the
    prompt compressed by ``prefill_policy``, ``query``-aware or -agnostic). ``model``: gemma3-270m, smollm2-135m
    or a local folder (``kvsim.models.quality.load``). Returns ``run_conversation_unit``'s cell: ``keys``, and per
    run (``control``, ``runs[0]``) ``found`` per turn and ``key_left[key][layer][kv_head]``."""
    from .quality import load

    if query not in QUERY:
        raise NeedleError(f"query: {query!r}: one of {', '.join(QUERY)}", "--query")
    prefill = None if prefill_budget is None else (prefill_budget, prefill_policy, ())
    job = Job(policy, budget, tuple(sorted(params.items())), None, prefill)
    loaded, tokenizer, model_id = load(model, None)
    return run_conversation_unit(loaded, tokenizer, model_id, Template(), length, list(depths), trial, [job], seed=seed,
                                 new_tokens=new_tokens, query=query, optimum=optimum, use_cache=use_cache)

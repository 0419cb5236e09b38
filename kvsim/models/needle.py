"""The pass-key test (issue 35, docs/needle.md): does the model still find a key hidden in filler text
when every layer's cache is held to a budget, and at which step did each layer's cache lose the key?

A prompt (``kvsim.models.needle_prompt``) is ``[start] filler[:a] needle filler[a:] question``, exactly ``length`` tokens: the needle
(``NEEDLE``, its ``{key}`` a random five-digit number) goes in at the sentence boundary of the filler
nearest ``depth`` x the filler's length (0: before all of it, 1: after all of it). The model decodes
``NEW_TOKENS`` greedily (``kvsim.hf.decoding.greedy``) with ``kvsim.hf.cache`` in every layer, and
with transformers' full cache as the control; a trial is right when the first run of digits it writes
is the key.

The needle's fate: every position's departure step per (layer, KV head), -1 for one still held at the
end (docs/domain.md, "Positions, steps and the cache": step t admits position t, then evicts). An
exact prefill steps every prompt position inside one forward pass, so the steps are heard from the
policies the cache built (what each one evicts is what its layer drops); at the end the departures are
checked against what each layer still holds (``EvictingLayer.held``).

Each trial is cached on disk (``<cache_dir>/needle/``) under a key made of everything it depends on:
the model's identity, the prompt's token ids, the policy spec, the prefill and the tokens decoded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data import jsontext
from ..data.files import atomic_write
from ..data.store import cache_dir
from ..progress import Progress
from .needle_prompt import Builder, NeedleError, Prompt, Template, answer, pass_key

#: what a cached trial means; bump it when a trial's figures change meaning
VERSION = 1
#: the tokens decoded after the prompt
NEW_TOKENS = 8
#: the cache directory's folder of trials and grids (``kvsim cache list``: kind ``needle``)
NEEDLE_DIR = "needle"
#: the full cache's name in a grid's runs
CONTROL = "full"


# --- one trial ---------------------------------------------------------------------------------------


class _Departures:
    """Every position's departure step per (row, layer, KV head), heard from each layer's own cache: each
    step of a layer (``EvictingLayer._admit``: step t admits position t, then evicts) is wrapped, and
    what it held before, with t, less what it holds after, left at step t. A compressed prompt
    (``prefill="compress"``: every prompt position stored or dropped at once, ``EvictingLayer._store``)
    drops the positions it does not keep at the prompt's last step. Nothing here depends on how a
    policy numbers its positions (a policy resumed after compression numbers its own). A batch's rows
    (``run_batch``: one policy configuration each) are heard apart, each its own ``left[row]``.

    With ``rows`` (one flag per batch row, or one for all) it also keeps, per (layer, KV head), the attention
    each step showed the cache's policy (the combined row over the positions held then, ``kvsim.hf.cache``),
    as a trace's rows: row t over the positions held when query t came, zero elsewhere (what
    ``needle_traces.save_bundle`` writes for the kept-positions view), ``self.rows[row]``.
    ``listen(layer, kv_head, t, held, row)`` hears the same of batch row 0 at each step t >= 1."""

    def __init__(self, cache, positions: int, listen=None, rows=False, batch: int = 1) -> None:
        self.cache = cache
        self.listen = listen
        self.positions = positions
        self.batch = batch
        self.left = None  # (rows, layers, KV heads, positions) once the first token has told the heads
        wanted = [rows] * batch if isinstance(rows, bool) else list(rows)
        self.rows: list[dict[tuple[int, int], np.ndarray] | None] = [{} if w else None for w in wanted]
        for li, layer in enumerate(cache.layers):
            self._wrap(layer, li)

    def _heads(self, layer) -> int:
        if self.left is None:
            self.left = np.full((self.batch, len(self.cache.layers), layer.kv_heads, self.positions), -1,
                                dtype=np.int32)
        return self.left.shape[2]

    def _wrap(self, layer, li: int) -> None:
        admit, store = layer._admit, layer._store

        def admitting(b, h, t, shown, key, value, queries=None):
            self._heads(layer)
            before = layer.held(b, h)  # a new array (fancy indexing), the held positions ascending
            kept = self.rows[b]
            if t and shown is not None and (kept is not None or (self.listen is not None and b == 0)):
                row = np.asarray(shown, dtype=np.float32)  # the row over what (b, h) holds, ascending
                if kept is not None:
                    full = kept.setdefault((li, h), np.zeros((self.positions, self.positions), dtype=np.float32))
                    full[t, before] = row
                if self.listen is not None and b == 0:
                    self.listen(li, h, t, before, row)
            admit(b, h, t, shown, key, value, queries)
            after = layer.held(b, h)
            if after.size == before.size + 1:  # t admitted, nothing left
                return
            # both ascending, what it holds after among what it held with t: the rest left
            had = np.append(before, t)
            gone = np.ones(had.size, dtype=bool)
            gone[np.searchsorted(had, after)] = False
            self.left[b, li, h, had[gone]] = t

        def storing(b, h, held, keys, values):
            self._heads(layer)
            n = keys.shape[0]  # a compressed prompt is stored in one pass, from position 0
            store(b, h, held, keys, values)
            gone = np.setdiff1d(np.arange(n), held)
            self.left[b, li, h, gone] = n - 1

        layer._admit = admitting
        layer._store = storing

    def held(self, row: int = 0) -> list[list[np.ndarray]]:
        """What each (layer, KV head) of ``row`` holds now."""
        return [[layer.held(row, h) for h in range(self.left.shape[2])] for layer in self.cache.layers]

    def ended(self, row: int, seen: int) -> np.ndarray:
        """``row``'s departures as its own run ends after ``seen`` positions: what left at a later step (a
        batch decodes on until its last row ends) was still held at the row's end (-1)."""
        left = self.left[row].copy()
        left[left >= seen] = -1
        return left

    def check(self, seen: int, row: int = 0, held: list[list[np.ndarray]] | None = None) -> None:
        """What the departures say is held after ``row``'s last step must be what each layer holds (``held``:
        what it held then, when the batch went on after it)."""
        held = self.held(row) if held is None else held
        left = self.ended(row, seen)
        for li in range(left.shape[0]):
            for h in range(left.shape[1]):
                said = np.flatnonzero(left[li, h, :seen] < 0)
                if not np.array_equal(said, held[li][h]):
                    raise RuntimeError(f"layer {li} KV head {h}: the policy's victims leave {said.size} positions, "
                                       f"the cache holds {held[li][h].size}")


def fate(left: np.ndarray, key_positions: Sequence[int]) -> list[list[int | None]]:
    """Per (layer, KV head), the step at which the last of the key's tokens left the cache (None:
    some stayed to the end): after it the layer can no longer read the key at all."""
    at = left[:, :, list(key_positions)]
    return [[None if (row < 0).any() else int(row.max()) for row in layer] for layer in at]


def first_loss(left: np.ndarray, key_positions: Sequence[int]) -> list[list[int | None]]:
    """Per (layer, KV head), the step at which the first of the key's tokens left (None: none left)."""
    at = left[:, :, list(key_positions)]
    return [[None if (row < 0).all() else int(row[row >= 0].min()) for row in layer] for layer in at]


def run_trial(model, prompt: Prompt, policy: str, budget: int | None = None, params: dict | None = None, *,
              new_tokens: int = NEW_TOKENS, seed: int | None = None, eos=None, listen=None, allocate=None,
              prefill: dict | None = None, rows: bool = False) -> dict:
    """Decode ``prompt`` with ``policy`` at ``budget`` in every layer (``CONTROL``: the full cache).
    The record (``tokens``, the ``prefill_seconds`` / ``decode_seconds`` split) and, for a policy,
    ``left``: each position's departure step per (layer, KV head), -1 for held to the end, and
    ``budgets``: each (layer, KV head)'s budget. ``allocate``: a static split (``kvsim.hf.cache``'s:
    ``uniform``, ``pyramidkv`` or ``{(layer, kv_head): budget}``); ``prefill``: ``{"budget": N or a
    ratio, "policy": scorer, "params": {...}}`` compresses the prompt at its end (``prefill="compress"``)
    instead of stepping it position by position. ``rows``: also ``rows``, the attention each step showed
    each (layer, KV head)'s policy (``_Departures``; not with a compressed prompt, whose positions are
    never shown one by one). ``listen(layer, kv_head, t, held, row)`` hears that attention at each step."""
    import torch

    import kvsim.hf as hf
    from kvsim.hf.decoding import greedy

    ids = torch.tensor([prompt.ids], dtype=torch.long)
    if policy == CONTROL:
        from transformers import DynamicCache

        hf.attach(model)
        run = greedy(model, ids, DynamicCache(config=model.config), new_tokens, eos)
        return {**run, "positions": len(prompt.ids) + len(run["tokens"]) - 1, "left": None}
    if rows and prefill:
        raise NeedleError("a compressed prompt shows its policy no rows one by one; its attention is not kept",
                          "--prefill-budget")
    how = {"prefill": "exact"}
    if prefill:
        how = {"prefill": "compress", "prefill_budget": prefill["budget"], "prefill_policy": prefill["policy"],
               "prefill_params": dict(prefill.get("params") or {})}
    cache = hf.cache(model, policy, budget, seed=seed, allocate=allocate, **how, **(params or {}))
    watch = _Departures(cache, len(prompt.ids) + new_tokens, listen, rows)
    # one thread: an exact prefill steps each position through tiny matrix-vector products, which a
    # second thread only slows down on a busy machine (kvsim.models.decode measured the same)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = greedy(model, ids, cache, new_tokens, eos)
    finally:
        torch.set_num_threads(threads)
    seen = cache.layers[0].seen
    watch.check(seen)
    budgets = cache.budgets
    heads = watch.left.shape[2]
    out = {**run, "positions": seen, "left": watch.left[0],
           "budgets": [[budgets[(x, h)] for h in range(heads)] for x in range(len(cache.layers))]}
    if rows:
        out["rows"] = {k: v[:seen, :seen] for k, v in watch.rows[0].items()}
    return out


def _cache_how(prefill: dict | None) -> dict:
    """``kvsim.hf.cache``'s prompt arguments for a trial's ``prefill`` (None: the exact prefill)."""
    if not prefill:
        return {"prefill": "exact"}
    return {"prefill": "compress", "prefill_budget": prefill["budget"], "prefill_policy": prefill["policy"],
            "prefill_params": dict(prefill.get("params") or {})}


def run_batch(model, prompt: Prompt, jobs: Sequence, *, new_tokens: int = NEW_TOKENS, seed: int | None = None, eos=None,
              rows: bool | Sequence[bool] = False, progress: Progress | None = None) -> list[dict]:
    """``run_trial`` for several policy configurations over one prompt in one batched pass: each job
    (``(policy, budget, params, allocate, prefill)``, or a ``Job``) a row of one ``EvictingCache``, its
    own policy in every (layer, KV head) at its own budgets (``EvictingLayer(policies=...)``, as
    ``kvsim.models.quality`` batches configurations): the prompt's forward passes and each decoding
    step read the weights once for every row. One record per job, what ``run_trial`` gives for it alone:
    the same tokens and departures (tests/test_needle_batch.py), ``prefill_seconds`` and
    ``decode_seconds`` the batch's shared equally (``batch``: its rows). A row that ends at ``eos``
    before the others is decoded on (its tokens and departures cut where its own run stops, what it held
    then checked against its departures).

    The jobs share one batch when their prompt mode (``prefill``) and every (layer, KV head)'s budget
    agree (one layer takes one prompt mode; a head's storage is its largest row's budget, and a row at
    another budget would see its slots in another layout); the rest go in further batches, each
    decoded the same way. ``rows``: as ``run_trial``'s, per job or for all."""
    import kvsim.hf as hf
    from kvsim.hf import EvictingCache, EvictingLayer, LayerMeta

    jobs = [j if isinstance(j, Job) else Job(j[0], j[1], tuple(sorted((j[2] or {}).items())),
                                             *(_job_how(j[3] if len(j) > 3 else None, j[4] if len(j) > 4 else None)))
            for j in jobs]
    wanted = [rows] * len(jobs) if isinstance(rows, bool) else list(rows)
    if any(w and j.prefill is not None for w, j in zip(wanted, jobs, strict=True)):
        raise NeedleError("a compressed prompt shows its policy no rows one by one; its attention is not kept",
                          "--prefill-budget")
    # each job's own cache, as run_trial builds it (every check, its specs, seed, meta and scorer), then grouped
    built = []
    for job in jobs:
        how = job.how
        one = hf.cache(model, job.policy, job.budget, seed=seed, allocate=how["allocate"], **_cache_how(how["prefill"]),
                       **dict(job.params))
        budgets = tuple(tuple(spec.budget for spec in layer.specs) for layer in one.layers)
        built.append((one, (job.prefill, budgets)))
    groups: dict = {}
    for i, (_, key) in enumerate(built):
        groups.setdefault(key, []).append(i)
    positions = len(prompt.ids) + new_tokens
    out: list[dict | None] = [None] * len(jobs)
    for members in groups.values():
        # attention kept per row is positions^2 float32 per (layer, KV head): at most about 2 GB of it at once
        one = built[members[0]][0]
        per_row = positions * positions * 4 * sum(len(layer.specs) for layer in one.layers)
        size = max(1, int(2e9 // per_row)) if any(wanted[i] for i in members) else len(members)
        for a in range(0, len(members), size):
            part = members[a : a + size]
            layers = []
            for x in range(len(one.layers)):
                firsts = [built[i][0].layers[x] for i in part]
                policies = []
                for lay in firsts:
                    rng = None if lay.rng_seed is None else np.random.default_rng(lay.rng_seed)  # as the layer's own
                    trace = LayerMeta(f"layer {x}", dict(lay.meta))
                    policies.append([None if spec is None else spec.build(trace, rng=rng) for spec in lay.specs])
                meta = next((lay.meta for lay in firsts if lay.meta), {})
                head = firsts[0]
                layers.append(EvictingLayer(policies=policies, prefill=head.prefill, prefill_budget=head.prefill_budget,
                                            prefill_policy=head.prefill_policy, meta=meta))
            cache = EvictingCache(layers, progress=progress)
            for i, record in zip(part, _decode_batch(model, prompt, cache, new_tokens, eos, [wanted[i] for i in part]),
                                 strict=True):
                out[i] = record
    return out


def _job_how(allocate, prefill) -> tuple:
    """A ``Job``'s ``allocate`` and ``prefill`` from ``run_trial``'s arguments."""
    if allocate is not None and not isinstance(allocate, str):
        allocate = tuple(allocation_rows(allocate))
    if prefill:
        prefill = (prefill["budget"], prefill["policy"], tuple(sorted((prefill.get("params") or {}).items())))
    return allocate, prefill or None


@contextlib.contextmanager
def _one_row_at_a_time(model):
    """Every linear layer of ``model`` takes a batch of single positions (``(rows, 1, features)``: each decoding
    step, the prompt's last logits) one row at a time, as a batch of one does. A product of one row runs
    another kernel (a matrix-vector product) than a product of several, which rounds otherwise, and each row's
    figures must be its run alone's; a chunk of several positions (the prompt) is one product either way, the
    same kernel as alone, row by row the same bits (tests/test_needle_batch.py). The layers' own ``forward``
    is back afterwards."""
    import torch

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def rowwise(forward):
        def run(x):
            if x.dim() < 3 or x.shape[0] < 2 or x.shape[-2] != 1:
                return forward(x)
            return torch.cat([forward(x[b : b + 1].clone()) for b in range(x.shape[0])])

        return run

    for m in linears:
        m.forward = rowwise(m.forward)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


def _decode_batch(model, prompt: Prompt, cache, new_tokens: int, eos, wanted: list[bool]) -> list[dict]:
    """Greedy decoding of ``prompt`` in every row of ``cache`` at once (``kvsim.hf.decoding.greedy``'s, row by
    row: each row stops at its own ``eos`` or after ``new_tokens``); per row ``run_trial``'s record."""
    import torch

    from kvsim.hf.decoding import prefill as feed

    batch = len(wanted)
    ids = torch.tensor([prompt.ids], dtype=torch.long).expand(batch, -1)
    stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    watch = _Departures(cache, len(prompt.ids) + new_tokens, rows=wanted, batch=batch)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    ends: dict[int, tuple[int, list]] = {}  # row -> (positions seen, what it held) once its run has ended
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_trial: tiny products, which a second thread only slows on a busy machine
    try:
        with _one_row_at_a_time(model):
            t0 = time.perf_counter()
            out = feed(model, ids, cache)
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            with torch.no_grad():
                while True:
                    nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)
                    for b in range(batch):
                        if b in ends:
                            continue
                        tokens[b].append(int(nxt[b, 0]))
                        if len(tokens[b]) == new_tokens or tokens[b][-1] in stops:
                            ends[b] = (cache.layers[0].seen, watch.held(b))
                    if len(ends) == batch:
                        break
                    out = model(nxt, cache=cache, use_cache=True)
            decode_s = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    records = []
    for b in range(batch):
        seen, held = ends[b]
        watch.check(seen, b, held)
        budgets = [[row[h] for h in range(watch.left.shape[2])] for row in (layer.budgets[b] for layer in cache.layers)]
        record = {"tokens": tokens[b], "prefill_seconds": prefill_s / batch, "decode_seconds": decode_s / batch,
                  "batch": batch, "positions": seen, "left": watch.ended(b, seen), "budgets": budgets}
        if wanted[b]:
            record["rows"] = {k: v[:seen, :seen] for k, v in watch.rows[b].items()}
        records.append(record)
    return records


# --- the disk cache -------------------------------------------------------------------------------------


def trial_key(model_id: str, prompt: Prompt, policy: str, budget: int | None, params: dict, new_tokens: int,
              seed: int | None, allocate=None, prefill: dict | None = None) -> dict:
    """What a trial depends on. ``allocate``: a split's name or its ``[[layer, kv_head, budget], ...]``
    rows (a file's content, not its path); ``prefill``: the compression (budget, scorer, its parameters)."""
    import transformers

    key = {"version": VERSION, "model": model_id, "prompt": prompt.digest, "key_positions": list(prompt.key_positions),
           "policy": policy, "budget": budget, "params": dict(sorted(params.items())), "prefill": "exact",
           "new_tokens": new_tokens, "seed": seed if policy == "random" else None,
           "transformers": transformers.__version__}
    if allocate is not None:
        key["allocate"] = allocate if isinstance(allocate, str) else [list(r) for r in allocation_rows(allocate)]
    if prefill:
        key["prefill"] = {"budget": prefill["budget"], "policy": prefill["policy"],
                          "params": dict(sorted((prefill.get("params") or {}).items()))}
    return key


def allocation_rows(allocate) -> list[tuple[int, int, int]]:
    """A split given as ``{(layer, kv_head): budget}`` or its rows, as sorted ``(layer, kv_head, budget)`` rows."""
    items = allocate.items() if isinstance(allocate, dict) else (((x, h), b) for x, h, b in allocate)
    return sorted((int(x), int(h), int(b)) for (x, h), b in items)


def trial_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / NEEDLE_DIR / f"trial-{digest}"


def read_trial(key: dict) -> dict | None:
    """A cached trial (its record and departures), or None when missing, damaged or another key's."""
    base = trial_path(key)
    try:
        doc = json.loads(base.with_suffix(".json").read_text(encoding="utf-8"))
        if doc.get("key") != key:
            return None
        left = None
        if doc.get("has_left"):
            with np.load(base.with_suffix(".npz"), allow_pickle=False) as z:
                left = z["left"]
    except (OSError, ValueError, KeyError, UnicodeDecodeError):
        return None
    return {**doc["record"], "left": left}


def write_trial(key: dict, record: dict) -> None:
    """Departures first, then the record that names them: a reader never finds a record without them.
    A cache that cannot be written is skipped (the result is still returned)."""
    base = trial_path(key)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        left = record.get("left")
        if left is not None:
            buf = io.BytesIO()
            np.savez_compressed(buf, left=left)
            atomic_write(base.with_suffix(".npz"), lambda f: f.write(buf.getvalue()))
        doc = {"key": key, "has_left": left is not None, "record": {k: v for k, v in record.items() if k not in ("left", "rows")}}
        atomic_write(base.with_suffix(".json"), lambda f: f.write(json.dumps(doc).encode()))
    except OSError:
        pass


def departures(run: dict) -> np.ndarray | None:
    """The departures of one run of a grid's cell, read back from the disk cache (None: not there)."""
    found = read_trial(run["cache_key"])
    return None if found is None else found["left"]


# --- a grid ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One policy configuration of a grid (the control is ``Job(CONTROL)``)."""

    policy: str
    budget: int | None = None
    params: tuple = ()  # sorted (name, value) pairs
    #: a static split: an allocator's name (uniform, pyramidkv) or sorted (layer, kv_head, budget) rows
    allocate: str | tuple | None = None
    #: a compressed prompt: (positions kept or a ratio, the scorer's name, its sorted (name, value) pairs)
    prefill: tuple | None = None

    @property
    def label(self) -> str:
        if self.policy == CONTROL:
            return "full cache (control)"
        extra = "".join(f", {k} {v}" for k, v in self.params)
        if self.allocate is not None:
            extra += f", split {self.allocate}" if isinstance(self.allocate, str) else ", split from a file"
        if self.prefill is not None:
            keep, scorer, sp = self.prefill
            extra += f", prompt compressed to {keep} by {scorer}" + "".join(f" {k} {v}" for k, v in sp)
        return f"{self.policy} @ {self.budget if self.budget is not None else 'the split'}{extra}"

    @property
    def how(self) -> dict:
        """``run_trial``'s and ``trial_key``'s ``allocate`` and ``prefill``."""
        allocate = self.allocate if isinstance(self.allocate, str) or self.allocate is None else \
            {(x, h): b for x, h, b in self.allocate}
        prefill = None if self.prefill is None else {"budget": self.prefill[0], "policy": self.prefill[1],
                                                     "params": dict(self.prefill[2])}
        return {"allocate": allocate, "prefill": prefill}


@dataclass
class Unit:
    """One (length, depth, trial) cell's prompt, run through the control and every job."""

    length: int
    depth: float
    trial: int
    jobs: list[Job] = field(default_factory=list)
    #: also the exact optimum's departures at each job's budgets (``needle_traces.optimum``)
    optimum: bool = False
    #: also each job's attention as a bundle for the kept-positions view (``needle_traces.save_bundle``)
    attention: bool = False


def run_unit(model, tokenizer, model_id: str, template: Template, unit: Unit, seed: int, new_tokens: int,
             use_cache: bool = True, on_run=None, on_batch=None) -> dict:
    """One cell's trial: the prompt, then the control and each job, each read from the disk cache when
    there; the control decoded alone (transformers' full cache), every other job not cached decoded
    together in one batched pass over the prompt (``run_batch``: each job a row with its own policy),
    each then cached as its own trial. The trial's record, with each run's answer and the key's fate
    (and, as ``unit`` asks, the exact optimum's fate at the run's budgets, and the run's attention kept
    as a bundle the kept-positions view opens). ``on_run(i, run)`` hears of each run as it ends (the
    control is run 0; the batch's runs end together), ``on_batch(n)`` of a batch of ``n`` runs as it
    starts, so a long cell shows progress."""
    from . import needle_traces as nt

    builder = Builder(tokenizer, template)
    key = pass_key(seed, unit.length, unit.depth, unit.trial)
    prompt = builder.prompt(unit.length, unit.depth, key, unit.trial)
    eos = getattr(tokenizer, "eos_token_id", None)
    jobs = [Job(CONTROL), *unit.jobs]
    keys, records, wanted = [], [], []
    for job in jobs:
        ck = trial_key(model_id, prompt, job.policy, job.budget, dict(job.params), new_tokens, seed, **job.how)
        record = read_trial(ck) if use_cache else None
        want_rows = unit.attention and job.policy != CONTROL and job.prefill is None
        if record is not None and want_rows and not nt.has_bundle(ck):
            record = None  # decoded again to keep its attention
        keys.append(ck)
        records.append(record)
        wanted.append(want_rows)
    runs = []
    control_ids = None

    def fresh(i: int, record: dict) -> dict:
        record["text"] = tokenizer.decode(record["tokens"], skip_special_tokens=True)
        if wanted[i]:
            record["attention"] = _keep_attention(model, model_id, keys[i], record, prompt, jobs[i])
        write_trial(keys[i], record)
        return record

    def finish(i: int, record: dict, cached: bool) -> None:
        nonlocal control_ids
        job, params, how = jobs[i], dict(jobs[i].params), jobs[i].how
        if job.policy == CONTROL:
            control_ids = list(prompt.ids) + list(record["tokens"])[:-1]
        said = answer(record["text"])
        left = record["left"]
        budgets = record.get("budgets")
        if budgets is None and left is not None and job.allocate is None:  # a trial cached before budgets were kept
            budgets = [[job.budget] * left.shape[1] for _ in range(left.shape[0])]
        run = {"policy": job.policy, "budget": job.budget, "params": params, "label": job.label,
               "allocate": how["allocate"] if isinstance(how["allocate"], (str, type(None))) else
               [list(r) for r in job.allocate], "prefill": how["prefill"],
               "text": record["text"], "answer": said, "correct": said == key, "cached": cached,
               "prefill_seconds": record["prefill_seconds"], "decode_seconds": record["decode_seconds"],
               "batch": record.get("batch", 1), "positions": record["positions"], "budgets": budgets,
               "key_left": None if left is None else fate(left, prompt.key_positions),
               "key_first_left": None if left is None else first_loss(left, prompt.key_positions),
               "attention": record.get("attention"), "cache_key": keys[i]}
        runs.append(run)
        if on_run is not None:
            on_run(i, run)

    if records[0] is None:
        finish(0, fresh(0, run_trial(model, prompt, CONTROL, new_tokens=new_tokens, seed=seed, eos=eos)), False)
    else:
        finish(0, records[0], True)
    todo = [i for i in range(1, len(jobs)) if records[i] is None]
    if todo:
        if on_batch is not None:
            on_batch(len(todo))
        decoded = run_batch(model, prompt, [jobs[i] for i in todo], new_tokens=new_tokens, seed=seed, eos=eos,
                            rows=[wanted[i] for i in todo])
        for i, record in zip(todo, decoded, strict=True):
            records[i] = fresh(i, record)
    for i in range(1, len(jobs)):
        finish(i, records[i], i not in todo)
    if unit.optimum and unit.jobs:
        _add_optimum(model, model_id, prompt, control_ids, runs[1:], use_cache, unit.attention)
    return {"length": unit.length, "depth": unit.depth, "trial": unit.trial, "key": key,
            "key_positions": list(prompt.key_positions), "needle_start": prompt.needle_start,
            "prompt_tokens": len(prompt.ids), "control": runs[0], "runs": runs[1:]}


def _keep_attention(model, model_id: str, ck: dict, record: dict, prompt: Prompt, job: Job) -> dict:
    """Write a run's attention (``record["rows"]``, dropped from it) as a bundle the kept view opens."""
    from kvsim.hf import model_layout

    from . import needle_traces as nt

    kinds, _, window = model_layout(model)
    rows = record.pop("rows")
    meta = {"key_positions": list(prompt.key_positions), "prompt_length": len(prompt.ids), "policy": job.policy,
            "budget": job.budget, "params": dict(job.params), "label": job.label, "model_id": model_id,
            "budgets": record["budgets"]}
    return nt.save_bundle(ck, rows, meta, model_id, kinds, window)


def _add_optimum(model, model_id: str, prompt: Prompt, ids: list[int], runs: list[dict], use_cache: bool,
                 attention: bool = False) -> None:
    """Each run's ``optimal_key_left`` / ``optimal_key_first_left``: the key's fate in the exact optimum's
    cache at the run's budgets, on the control's attention (``needle_traces.optimum``); cached on disk
    under the control's tokens and the budgets. With ``attention``, the control's attention is kept as a
    bundle too (``optimal_attention``), which the kept view replays through ``optimal``."""
    from . import needle_traces as nt

    traces = None
    digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:24]
    for run in runs:
        if run["budgets"] is None or run["prefill"] is not None:  # a compressed prompt's budgets hold the prompt
            continue
        ck = {"version": VERSION, "kind": "optimum", "model": model_id, "ids": digest, "budgets": run["budgets"]}
        found = read_trial(ck) if use_cache else None
        if found is None:
            if traces is None:
                traces = nt.control_traces(model, ids)
            left = nt.optimum(traces, run["budgets"])
            found = {"positions": len(ids), "left": left}
            write_trial(ck, found)
        left = found["left"]
        run["optimal_key_left"] = fate(left, prompt.key_positions)
        run["optimal_key_first_left"] = first_loss(left, prompt.key_positions)
        run["optimal_cache_key"] = ck
        if attention:
            control = {"version": VERSION, "kind": "control attention", "model": model_id, "ids": digest}
            if not nt.has_bundle(control):
                from kvsim.hf import model_layout

                if traces is None:
                    traces = nt.control_traces(model, ids)
                kinds, _, window = model_layout(model)
                meta = {"key_positions": list(prompt.key_positions), "prompt_length": len(prompt.ids),
                        "policy": "optimal", "label": "the full cache's attention (the control's)", "model_id": model_id}
                nt.save_bundle(control, {k: t.attention for k, t in traces.items()}, meta, model_id, kinds, window)
            run["optimal_attention"] = {"bundle": nt.bundle_name(control), "skipped": []}


def accuracy(trials: Sequence[dict], jobs: Sequence[Job], lengths: Sequence[int], depths: Sequence[float]) -> dict:
    """Per job, the accuracy grid (depth x length) over the trials the control got right; a cell where
    the control got none right is None (labelled, not counted). The control's own grid beside."""
    def cell(rows, pick):
        return [[pick([r for r in rows if r["depth"] == d and r["length"] == n]) for n in lengths] for d in depths]

    def share(rows):
        return None if not rows else sum(r["control"]["correct"] for r in rows) / len(rows)

    control = cell(trials, share)
    grids = []
    for j, job in enumerate(jobs):
        def counted(rows, j=j):
            ok = [r for r in rows if r["control"]["correct"]]
            return None if not ok else sum(r["runs"][j]["correct"] for r in ok) / len(ok)

        grids.append({"policy": job.policy, "budget": job.budget, "params": dict(job.params), "label": job.label,
                      "allocate": job.allocate if not isinstance(job.allocate, tuple) else [list(r) for r in job.allocate],
                      "prefill": job.how["prefill"],
                      "accuracy": cell(trials, counted),
                      "counted": cell(trials, lambda rows: sum(r["control"]["correct"] for r in rows))})
    total = [r["control"]["correct"] for r in trials]
    return {"control": {"accuracy": control, "overall": sum(total) / len(total) if total else None,
                        "fails": not any(total)}, "grids": grids}


def open_model(name: str, progress: Progress | None = None):
    """``(config, tokenizer, weights, model_id)``: what the model is before its weights load
    (``weights()`` loads them), so the command refuses a length beyond its context first. ``name``:
    gemma3-270m, smollm2-135m or a local folder (``kvsim.models.quality.load``'s names)."""
    from .errors import QualityError, RecordError
    from .loading import load_smollm2, open_hf_model
    from .loading import open_model as open_shipped
    from .quality import model_id_of

    try:
        model_id = model_id_of(name)
        if name == "gemma3-270m":
            config, tokenizer, weights = open_shipped(None, progress=progress)
        elif name == "smollm2-135m":
            model, tokenizer = load_smollm2(progress)
            config, weights = model.config, lambda: model
        else:
            config, tokenizer, weights = open_hf_model(name, progress=progress)
    except (QualityError, RecordError) as e:
        said = " ".join(str(e).split())
        raise NeedleError(said if said.startswith("--model") else f"--model: {said}", "--model") from None
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config, tokenizer, weights, model_id


_WORKER: dict = {}


def _worker_model(model_name: str, progress: Progress | None):
    """The model, loaded once per process (a Dask worker runs many cells)."""
    if _WORKER.get("name") != model_name:
        from .quality import load

        model, tokenizer, model_id = load(None if model_name == "gemma3-270m" else model_name, progress)
        _WORKER.update(name=model_name, model=model, tokenizer=tokenizer, model_id=model_id)
    return _WORKER["model"], _WORKER["tokenizer"], _WORKER["model_id"]


def _remote_unit(model_name: str, template: Template, unit: Unit, seed: int, new_tokens: int, use_cache: bool) -> dict:
    model, tokenizer, model_id = _worker_model(model_name, None)
    return run_unit(model, tokenizer, model_id, template, unit, seed, new_tokens, use_cache)


def run_grid(model_name: str, template: Template, jobs: Sequence[Job], lengths: Sequence[int],
             depths: Sequence[float], trials: int, seed: int, *, new_tokens: int = NEW_TOKENS,
             use_cache: bool = True, scheduler: str | None = None, workers: int | None = None,
             progress: Progress | None = None, loaded=None, optimum: bool = False, attention: bool = False) -> dict:
    """Every (length, depth, trial) cell through the control and ``jobs``; here one after another, or
    on Dask (``scheduler``: ``"local"`` or an address, as ``kvsim tune``). ``loaded``: (model,
    tokenizer, model_id) already loaded here. ``optimum``, ``attention``: see ``Unit``."""
    say = progress or (lambda f, n="": None)
    units = [Unit(n, d, t, list(jobs), optimum, attention) for n in lengths for d in depths for t in range(trials)]
    t0 = time.perf_counter()
    results: list[dict | None] = [None] * len(units)

    def note(done: int, u: Unit, r: dict) -> None:
        fresh = sum(not x["cached"] for x in [r["control"], *r["runs"]])
        say(done / len(units), f"length {u.length} depth {u.depth:g} trial {u.trial + 1}: control "
            f"{'found' if r['control']['correct'] else 'missed'} the key; {fresh} run(s) decoded, "
            f"{len(jobs) + 1 - fresh} from the cache")

    if scheduler is None:
        model, tokenizer, model_id = loaded or _worker_model(model_name, progress)
        for i, u in enumerate(units):
            def each(j: int, r: dict, i: int = i, u: Unit = u) -> None:
                n = r.get("batch", 1)
                how = "from the cache" if r["cached"] else \
                    f"decoded, {r['prefill_seconds']:.1f} s prompt + {r['decode_seconds']:.1f} s decoding" if n == 1 else \
                    f"decoded in a batch of {n}, {r['prefill_seconds'] * n:.1f} s prompt + {r['decode_seconds'] * n:.1f} s " \
                    "decoding for the batch"
                say((i + (j + 1) / (len(jobs) + 2)) / len(units),
                    f"length {u.length} depth {u.depth:g} trial {u.trial + 1}: {r['label']} {how}")

            def batch(n: int, i: int = i, u: Unit = u) -> None:
                say((i + 1 / (len(jobs) + 2)) / len(units), f"length {u.length} depth {u.depth:g} trial {u.trial + 1}: "
                    f"decoding {n} run(s) as one batch over the prompt")

            results[i] = run_unit(model, tokenizer, model_id, template, u, seed, new_tokens, use_cache, on_run=each,
                                  on_batch=batch)
            note(i + 1, u, results[i])
        run = {"executor": "serial", "workers": 1}
    else:
        from ..cluster import dask_client

        with dask_client(scheduler, workers) as (client, address):
            futures = [client.submit(_remote_unit, model_name, template, u, seed, new_tokens, use_cache, pure=False)
                       for u in units]
            index = {f.key: i for i, f in enumerate(futures)}
            from distributed import as_completed

            for done, fut in enumerate(as_completed(futures), start=1):
                i = index[fut.key]
                results[i] = fut.result()
                note(done, units[i], results[i])
            run = {"executor": "dask", "workers": len(client.scheduler_info().get("workers", {})), "scheduler": address}
    run["seconds"] = time.perf_counter() - t0
    return {"lengths": list(lengths), "depths": list(depths), "trials": trials, "seed": seed,
            "new_tokens": new_tokens, "template": template.to_dict(), "run": run,
            **accuracy(results, jobs, lengths, depths), "cells": results}


def grid_path(doc: dict) -> Path:
    """Where a grid's document is kept for the app's needle view: keyed by what it measured."""
    what = {k: doc[k] for k in ("model_id", "lengths", "depths", "trials", "seed", "new_tokens", "template")}
    what["jobs"] = [(g["policy"], g["budget"], g["params"], *([g["allocate"], g["prefill"]] if g.get("allocate") or
                     g.get("prefill") else [])) for g in doc["grids"]]
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / NEEDLE_DIR / f"grid-{digest}.json"


def save_grid(doc: dict) -> Path | None:
    path = grid_path(doc)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(json.dumps(doc).encode()))
    except OSError:
        return None
    return path


def saved_grids(folder: Path | None = None) -> list[Path]:
    """The grid documents in the cache, newest first."""
    folder = cache_dir() / NEEDLE_DIR if folder is None else folder
    try:
        return sorted(folder.glob("grid-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []


def read_grid(path: Path) -> dict:
    """A grid document; NeedleError naming the file when it is not one."""
    try:
        doc = jsontext.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise NeedleError(f"{path}: not a needle grid ({' '.join(str(e).split())})") from None
    if not isinstance(doc, dict) or not {"grids", "cells", "lengths", "depths"} <= set(doc):
        raise NeedleError(f"{path}: not a needle grid (no grids, cells, lengths, depths)")
    return doc


__all__ = ["CONTROL", "NEW_TOKENS", "Job", "accuracy", "fate", "first_loss", "read_grid", "run_grid", "run_trial",
           "save_grid", "saved_grids"]

"""A pass-key trial's run (docs/needle.md): one policy configuration (``run_trial``) or a cell's configurations as
rows of one batched pass over the prompt (``run_batch``), and the step at which every position left each
layer's cache (``_Departures``, ``fate``, ``first_loss``). kvsim.models.needle keys, caches and grids them.

The needle's fate: every position's departure step per (layer, KV head), -1 for one still held at the
end (docs/domain.md, "Positions, steps and the cache": step t admits position t, then evicts). An
exact prefill steps every prompt position inside one forward pass, so the steps are heard from the
policies the cache built (what each one evicts is what its layer drops); at the end the departures are
checked against what each layer still holds (``EvictingLayer.held``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..progress import Progress
from .needle_prompt import NeedleError, Prompt

#: the tokens decoded after the prompt
NEW_TOKENS = 8
#: the full cache's name in a grid's runs
CONTROL = "full"


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
    #: a serving layout (``kvsim.policykit.layouts.Layout``; None: none), deployed by ``kvsim.hf.cache``
    layout: object = None

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
        if self.layout is not None:
            extra += f", {self.layout.label}"
        return f"{self.policy} @ {self.budget if self.budget is not None else 'the split'}{extra}"

    @property
    def how(self) -> dict:
        """``run_trial``'s and ``trial_key``'s ``allocate`` and ``prefill``."""
        allocate = self.allocate if isinstance(self.allocate, str) or self.allocate is None else \
            {(x, h): b for x, h, b in self.allocate}
        prefill = None if self.prefill is None else {"budget": self.prefill[0], "policy": self.prefill[1],
                                                     "params": dict(self.prefill[2])}
        return {"allocate": allocate, "prefill": prefill, "layout": self.layout}



def allocation_rows(allocate) -> list[tuple[int, int, int]]:
    """A split given as ``{(layer, kv_head): budget}`` or its rows, as sorted ``(layer, kv_head, budget)`` rows."""
    items = allocate.items() if isinstance(allocate, dict) else (((x, h), b) for x, h, b in allocate)
    return sorted((int(x), int(h), int(b)) for (x, h), b in items)


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

    def _shown(self, li: int, b: int, h: int, t: int, before: np.ndarray, shown) -> None:
        """(row b, layer li, KV head h) was shown ``shown`` over ``before`` at step t: kept, heard."""
        kept = self.rows[b]
        if t and shown is not None and (kept is not None or (self.listen is not None and b == 0)):
            row = np.asarray(shown, dtype=np.float32)  # the row over what (b, h) holds, ascending
            if kept is not None:
                full = kept.setdefault((li, h), np.zeros((self.positions, self.positions), dtype=np.float32))
                full[t, before] = row
            if self.listen is not None and b == 0:
                self.listen(li, h, t, before, row)

    def _left(self, li: int, b: int, h: int, t: int, before: np.ndarray, after: np.ndarray) -> None:
        """What (row b, layer li, KV head h) held before step t, with t, less what it holds after, left at t."""
        gone = before.size + 1 - after.size
        if gone == 0:  # t admitted, nothing left
            return
        if gone == 1:  # the usual step: t left, or t stayed and the one held position where the two part
            n = after.size - 1
            if n < 0 or after[-1] != t:
                self.left[b, li, h, t] = t
            else:
                differ = np.flatnonzero(before[:n] != after[:n])
                self.left[b, li, h, before[differ[0] if differ.size else n]] = t
            return
        # both ascending, what it holds after among what it held with t: the rest left
        had = np.append(before, t)
        gone = np.ones(had.size, dtype=bool)
        gone[np.searchsorted(had, after)] = False
        self.left[b, li, h, had[gone]] = t

    def _wrap(self, layer, li: int) -> None:
        if hasattr(layer, "watch"):  # the tensor path (kvsim.hf.tensor) keeps the departures on the device
            if self.listen is not None or any(r is not None for r in self.rows):
                raise NeedleError("the tensor path shows no rows one by one; build the cache with tensor=False")
            layer.watch(self.positions)
            return
        if hasattr(layer, "_decide"):  # a layout's layer decides for all a row's KV heads at once (kvsim.hf.layout)
            self._wrap_rows(layer, li)
            return
        admit, store = layer._admit, layer._store

        def admitting(b, h, t, shown, key, value, queries=None):
            self._heads(layer)
            before = layer.held(b, h)  # a new array (fancy indexing), the held positions ascending
            self._shown(li, b, h, t, before, shown)
            admit(b, h, t, shown, key, value, queries)
            self._left(li, b, h, t, before, layer.held(b, h))

        def storing(b, h, held, keys, values):
            self._heads(layer)
            n = keys.shape[0]  # a compressed prompt is stored in one pass, from position 0
            store(b, h, held, keys, values)
            gone = np.setdiff1d(np.arange(n), held)
            self.left[b, li, h, gone] = n - 1

        layer._admit = admitting
        layer._store = storing

    def _wrap_rows(self, layer, li: int) -> None:
        decide = layer._decide

        def deciding(b, t, shown, key, value, q):
            heads = self._heads(layer)
            before = [layer.held(b, h) for h in range(heads)]
            for h in range(heads):
                self._shown(li, b, h, t, before[h], shown[h])
            decide(b, t, shown, key, value, q)
            for h in range(heads):
                self._left(li, b, h, t, before[h], layer.held(b, h))

        layer._decide = deciding

    def held(self, row: int = 0) -> list[list[np.ndarray]]:
        """What each (layer, KV head) of ``row`` holds now."""
        return [[layer.held(row, h) for h in range(layer.kv_heads)] for layer in self.cache.layers]

    def collect(self) -> None:
        """The departures the tensor path's layers kept on the device, read back once the run has ended."""
        for li, layer in enumerate(self.cache.layers):
            if getattr(layer, "left", None) is not None:
                self._heads(layer)
                self.left[:, li] = layer.left.cpu().numpy()

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
              prefill: dict | None = None, rows: bool = False, layout=None) -> dict:
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

    if policy == CONTROL:
        ids = torch.tensor([prompt.ids], dtype=torch.long)
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
    # the tensor path keeps each key token's departure on the device; rows shown one by one need the reference
    cache = hf.cache(model, policy, budget, seed=seed, allocate=allocate, **how, **_layout_how(layout),
                     **({"tensor": False} if rows or listen is not None else {}), **(params or {}))
    # decoded as a batch of one row (run_batch's loop): the prompt fed in the same passes as a batch feeds it
    # (``_feed``), so a row of a batch is this run by construction
    out = _decode_batch(model, prompt, cache, new_tokens, eos, [rows], listen)[0]
    del out["batch"]
    return out


def _cache_how(prefill: dict | None) -> dict:
    """``kvsim.hf.cache``'s prompt arguments for a trial's ``prefill`` (None: the exact prefill)."""
    if not prefill:
        return {"prefill": "exact"}
    return {"prefill": "compress", "prefill_budget": prefill["budget"], "prefill_policy": prefill["policy"],
            "prefill_params": dict(prefill.get("params") or {})}


def _layout_how(layout) -> dict:
    """``kvsim.hf.cache``'s layout arguments for a trial's ``layout`` (None: none)."""
    return {} if layout is None else layout.to_dict()


def run_batch(model, prompt: Prompt, jobs: Sequence, *, new_tokens: int = NEW_TOKENS, seed: int | None = None, eos=None,
              rows: bool | Sequence[bool] = False, progress: Progress | None = None, note=None,
              tensor: bool | None = None) -> list[dict]:
    """``run_trial`` for several policy configurations over one prompt in one batched pass: each job
    (``(policy, budget, params, allocate, prefill)``, or a ``Job``) a row of one ``EvictingCache``, its
    own policy in every (layer, KV head) at its own budgets (``EvictingLayer(policies=...)``, as
    ``kvsim.models.quality`` batches configurations): the prompt's forward passes and each decoding
    step read the weights once for every row. One record per job, what ``run_trial`` gives for it alone:
    the same tokens and departures (tests/test_needle_batch.py), ``prefill_seconds`` and
    ``decode_seconds`` the batch's shared equally (``batch``: its rows). A row that ends at ``eos``
    before the others is decoded on (its tokens and departures cut where its own run stops, what it held
    then checked against its departures).

    The jobs share one batch when their prompt mode (``prefill``), every (layer, KV head)'s budget and their
    path agree (one layer takes one prompt mode; a head's storage is its largest row's budget, and a row at
    another budget would see its slots in another layout); the rest go in further batches, each
    decoded the same way. A job under a serving layout (``Job.layout``) decodes alone, in the cache
    ``kvsim.hf.cache`` built for it. ``rows``: as ``run_trial``'s, per job or for all.

    Rows run on the tensor path (``kvsim.hf.tensor``) wherever ``kvsim.hf.cache`` builds a job's cache there
    (its policy declares a tensor step that takes the job's options, ``kvsim.hf.tensor.refusal``): such a
    batch takes every policy class, a run of rows per class, each stepped by its class's hooks in the layer's one
    step (``TensorLayer.groups``);
    a row whose attention is kept (``rows``) and a job the tensor path refuses run on the reference path
    (``EvictingLayer(policies=...)``), and ``note`` hears once each reason a cache gave for that
    (``EvictingCache.notes``). ``tensor=False``: every row on the reference path, the authority the tensor path's
    rows are held to (tests/test_needle_batch.py)."""
    import kvsim.hf as hf
    from kvsim.hf import walk
    from kvsim.hf.tensor import TensorLayer

    jobs = [j if isinstance(j, Job) else Job(j[0], j[1], tuple(sorted((j[2] or {}).items())),
                                             *(_job_how(j[3] if len(j) > 3 else None, j[4] if len(j) > 4 else None)))
            for j in jobs]
    wanted = [rows] * len(jobs) if isinstance(rows, bool) else list(rows)
    if any(w and j.prefill is not None for w, j in zip(wanted, jobs, strict=True)):
        raise NeedleError("a compressed prompt shows its policy no rows one by one; its attention is not kept",
                          "--prefill-budget")
    # each job's own cache, as run_trial builds it (every check, its specs, seed, meta and scorer), then grouped
    built, notes = [], []
    for job, want in zip(jobs, wanted, strict=True):
        how = job.how
        # a kept row's attention is shown one step at a time: the reference path's (as run_trial builds it)
        one = hf.cache(model, job.policy, job.budget, seed=seed, allocate=how["allocate"], **_cache_how(how["prefill"]),
                       **_layout_how(job.layout), **({"tensor": False} if want or tensor is False else {}), **dict(job.params))
        notes += [n for n in getattr(one, "notes", []) if n not in notes]
        budgets = tuple(tuple(spec.budget for spec in layer.specs) for layer in one.layers)
        # the tensor path's rows share a batch whatever their class (a TensorLayer steps a run of rows per class), but
        # on a CPU the classes whose prompt the compiled walk takes (kvsim.hf.walk) batch apart from those it does not,
        # which would hold the whole layer to the tensor operations
        path = (None if not isinstance(one.layers[0], TensorLayer)
                else "walk" if walk.walks(job.policy, model.device) else "tensor")
        built.append((one, (job.prefill, budgets, path) if job.layout is None else ("layout", len(built))))
    for said in notes if note is not None else ():
        note(said)
    groups: dict = {}
    for i, (_, key) in enumerate(built):
        groups.setdefault(key, []).append(i)
    for members in groups.values():  # a class's rows side by side: one run of rows each (``TensorLayer.groups``)
        members.sort(key=lambda i: jobs[i].policy)
    positions = len(prompt.ids) + new_tokens
    out: list[dict | None] = [None] * len(jobs)
    for members in groups.values():
        one = built[members[0]][0]
        if jobs[members[0]].layout is not None:  # a layout's job decodes alone, in the cache it was built as
            out[members[0]] = _decode_batch(model, prompt, one, new_tokens, eos, [wanted[members[0]]])[0]
            continue
        # attention kept per row is positions^2 float32 per (layer, KV head): at most about 2 GB of it at once
        per_row = positions * positions * 4 * sum(len(layer.specs) for layer in one.layers)
        size = max(1, int(2e9 // per_row)) if any(wanted[i] for i in members) else len(members)
        for a in range(0, len(members), size):
            part = members[a : a + size]
            layers = [_batch_layer([built[i][0].layers[x] for i in part], x) for x in range(len(one.layers))]
            cache = hf.EvictingCache(layers, progress=progress)
            for i, record in zip(part, _decode_batch(model, prompt, cache, new_tokens, eos, [wanted[i] for i in part]),
                                 strict=True):
                out[i] = record
    return out


def _batch_layer(firsts: list, x: int):
    """Decoder layer ``x`` of a batch: row i the policies of ``firsts[i]`` (layer ``x`` of a job's own cache, as
    ``kvsim.hf.cache`` built it), built afresh as that layer builds them, on the path the group's layers are on
    (a ``TensorLayer`` steps each run of rows of one class by that class's hooks)."""
    from kvsim.hf import EvictingLayer, LayerMeta
    from kvsim.hf.tensor import TensorLayer

    policies = []
    for lay in firsts:
        rng = None if lay.rng_seed is None else np.random.default_rng(lay.rng_seed)  # as the layer's own
        trace = LayerMeta(f"layer {x}", dict(lay.meta))
        policies.append([None if spec is None else spec.build(trace, rng=rng) for spec in lay.specs])
    meta = next((lay.meta for lay in firsts if lay.meta), {})
    head = firsts[0]
    if isinstance(head, TensorLayer):
        return TensorLayer(policies=policies, prefill=head.prefill, meta=meta, chunk=head.chunk)
    return EvictingLayer(policies=policies, prefill=head.prefill, prefill_budget=head.prefill_budget,
                         prefill_policy=head.prefill_policy, meta=meta)


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


def _feed(model, ids, cache, batch: int):
    """The prompt ``ids`` ``(1, n)`` into the ``batch`` rows of ``cache``: first the positions every row attends over
    in full (``EvictingLayer.shared_start``: up to the smallest budget, nothing is evicted yet), as one row
    for all of them, then the rest, row by row as a batch; the last pass's output. A batch of one is fed
    in the same two passes, so each row's products are its run alone's: the prompt's start is one product
    either way, and the rest one product per chunk whatever the number of rows (``_one_row_at_a_time``).
    Feeding the start once cuts the model's arithmetic of a 13-row needle cell at 1,024 tokens and budget
    256 by a quarter (docs/needle.md)."""
    from kvsim.hf.decoding import prefill

    n = ids.shape[1]
    starts = [layer.shared_start() for layer in cache.layers]
    first = min(min(starts), n)
    if first < 2:  # nothing to share (a layout, a pool, a compressed prompt): the prompt as it comes
        first = 0
    out = prefill(model, ids[:, :first], cache) if first else None
    if first < n:
        out = prefill(model, ids[:, first:].expand(batch, -1), cache)
    return out


def _decode_batch(model, prompt: Prompt, cache, new_tokens: int, eos, wanted: list[bool], listen=None) -> list[dict]:
    """Greedy decoding of ``prompt`` in every row of ``cache`` at once (``kvsim.hf.decoding.greedy``'s, row by
    row: each row stops at its own ``eos`` or after ``new_tokens``); per row ``run_trial``'s record.
    ``listen``: as ``run_trial``'s, for row 0."""
    import torch

    batch = len(wanted)
    ids = torch.tensor([prompt.ids], dtype=torch.long)
    stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    watch = _Departures(cache, len(prompt.ids) + new_tokens, listen, rows=wanted, batch=batch)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    ends: dict[int, tuple[int, list]] = {}  # row -> (positions seen, what it held) once its run has ended
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_trial: tiny products, which a second thread only slows on a busy machine
    try:
        with _one_row_at_a_time(model):
            t0 = time.perf_counter()
            out = _feed(model, ids, cache, batch)
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            with torch.no_grad():
                while True:
                    nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True).expand(batch, -1)  # a shared prompt's: one row
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
    watch.collect()
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



"""The pass-key test (issue 35, docs/needle.md): does the model still find a key hidden in filler text
when every layer's cache is held to a budget, and at which step did each layer's cache lose the key?

A prompt (``kvsim.models.needle_prompt``) is ``[start] filler[:a] needle filler[a:] question``, exactly ``length`` tokens: the needle
(``NEEDLE``, its ``{key}`` a random five-digit number) goes in at the sentence boundary of the filler
nearest ``depth`` x the filler's length (0: before all of it, 1: after all of it). The model decodes
``NEW_TOKENS`` greedily (``kvsim.hf.decoding.greedy``) with ``kvsim.hf.cache`` in every layer, and
with transformers' full cache as the control; a trial is right when the first run of digits it writes
is the key.

The needle's fate (every position's departure step per layer and KV head) and a trial's run, alone or
as a row of a cell's one batched pass, are kvsim.models.needle_runs'.

Each trial is cached on disk (``<cache_dir>/needle/``) under a key made of everything it depends on:
the model's identity, the prompt's token ids, the policy spec, the prefill, the serving layout (when there
is one) and the tokens decoded.
"""

from __future__ import annotations

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
from ..policykit import registry
from ..progress import Progress
from .needle_prompt import Builder, NeedleError, Prompt, Template, answer, pass_key
from .needle_runs import CONTROL, NEW_TOKENS, Job, allocation_rows, fate, first_loss, run_batch, run_trial

#: what a cached trial means; bump it when a trial's figures change meaning
VERSION = 1
#: the cache directory's folder of trials and grids (``kvsim cache list``: kind ``needle``)
NEEDLE_DIR = "needle"


def trial_key(model_id: str, prompt: Prompt, policy: str, budget: int | None, params: dict, new_tokens: int,
              seed: int | None, allocate=None, prefill: dict | None = None, layout=None) -> dict:
    """What a trial depends on. ``allocate``: a split's name or its ``[[layer, kv_head, budget], ...]``
    rows (a file's content, not its path); ``prefill``: the compression (budget, scorer, its parameters);
    ``layout``: the serving layout (``Layout``; None, a trial without one, keeps the key it always had)."""
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
        if registry.needs_model(prefill["policy"]):  # its scores come from a pass of the model: that pass's recipe too
            from ..hf.reconstruction import RECIPE

            key["prefill"]["pass"] = RECIPE
    if layout is not None:
        key["layout"] = layout.to_dict()
    return key


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
             use_cache: bool = True, on_run=None, on_batch=None, on_note=None) -> dict:
    """One cell's trial: the prompt, then the control and each job, each read from the disk cache when
    there; the control decoded alone (transformers' full cache), every other job not cached decoded
    together in one batched pass over the prompt (``run_batch``: each job a row with its own policy),
    each then cached as its own trial. The trial's record, with each run's answer and the key's fate
    (and, as ``unit`` asks, the exact optimum's fate at the run's budgets, and the run's attention kept
    as a bundle the kept-positions view opens). ``on_run(i, run)`` hears of each run as it ends (the
    control is run 0; the batch's runs end together), ``on_batch(n)`` of a batch of ``n`` runs as it
    starts, so a long cell shows progress; ``on_note`` as ``run_batch``'s ``note``."""
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
               **({} if job.layout is None else {"layout": job.layout.to_dict()}),
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
                            rows=[wanted[i] for i in todo], note=on_note)
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
            "budgets": record["budgets"], **({} if job.layout is None else {"layout": job.layout.to_dict()})}
    return nt.save_bundle(ck, rows, meta, model_id, kinds, window)


def _add_optimum(model, model_id: str, prompt: Prompt, ids: list[int], runs: list[dict], use_cache: bool,
                 attention: bool = False) -> None:
    """Each run's ``optimal_key_left`` / ``optimal_key_first_left``: the key's fate in the exact optimum's
    cache at the run's budgets, on the control's attention (``needle_traces.optimum``); for a run in blocks of
    S (its layout's ``block_size``), the optimum under the same blocks. Cached on disk under the control's
    tokens, the budgets and the block size. With ``attention``, the control's attention is kept as a
    bundle too (``optimal_attention``), which the kept view replays through ``optimal``."""
    from . import needle_traces as nt

    traces = None
    digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:24]
    for run in runs:
        if run["budgets"] is None or run["prefill"] is not None:  # a compressed prompt's budgets hold the prompt
            continue
        # under pages, the optimum under the same blocks (whole-block evictions: kvsim.policykit.optimal_blocks);
        # shared selection and intervals are the online policy's constraints, which the block optimum has not
        block = (run.get("layout") or {}).get("block_size", 1)
        ck = {"version": VERSION, "kind": "optimum", "model": model_id, "ids": digest, "budgets": run["budgets"],
              **({"block_size": block} if block > 1 else {})}
        found = read_trial(ck) if use_cache else None
        if found is None:
            if traces is None:
                traces = nt.control_traces(model, ids)
            left = nt.optimum(traces, run["budgets"], block)
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
                      "prefill": job.how["prefill"], **({} if job.layout is None else {"layout": job.layout.to_dict()}),
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


def _worker_model(model_name: str, progress: Progress | None):
    """The model, loaded once per process (a Dask worker runs many cells): ``kvsim.models.fanout``'s, which
    ``quality`` and ``proxies`` cells share on the same worker."""
    from .fanout import worker_model

    return worker_model(None if model_name == "gemma3-270m" else model_name, progress)


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
        told: list[str] = []  # what the cells' caches said (a policy on the reference path), once for the grid

        def tell(text: str) -> None:
            if text not in told:
                told.append(text)
                say(sum(r is not None for r in results) / len(units), text)

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
                    f"decoding {n} run(s) in batched passes over the prompt")

            results[i] = run_unit(model, tokenizer, model_id, template, u, seed, new_tokens, use_cache, on_run=each,
                                  on_batch=batch, on_note=tell)
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

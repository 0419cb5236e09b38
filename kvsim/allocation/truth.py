"""The truth of an allocation: the model's loss and KL when each (layer, KV head) holds its own budget
(docs/allocation.md, "The truth of a split"), open loop or closed loop.

- open (``open_truth``): the policy replays each head's full-cache trace at that head's budget; the
  schedules mask one teacher-forced pass (docs/domain.md, "The truth"), as ``Session.run_open`` does with one
  budget for all, so a split of equal budgets is exactly ``Session.evaluate(policy, budget, "open")``.
- closed (``closed_truth``): the model decodes the text teacher-forced, token by token, through the deployed
  cache (``kvsim.hf``) holding each head's budget, as ``Session.run_closed`` does for one budget, so a split of
  equal budgets is exactly ``Session.evaluate(policy, budget, "closed")``; or, with ``pooled`` (adakv's floor),
  through layers whose KV heads share one pool (``kvsim.hf.pooled``), a pool of ``budget x KV heads``.

tests/test_allocation_truth.py holds both equalities. ``measure`` keeps each result in the quality cache
(``kvsim.models.quality.read_cached``), keyed by the split itself. The split is made above this layer
(``kvsim.allocation.allocators``, by the command line); this module reads it as ``budgets[layer][kv_head]``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.files import atomic_write
from ..data.store import cache_dir
from ..models.decode import ClosedLoopDecoder, MaskedPass, hidden_states, layer_params, replay_masks
from ..models.errors import QualityError
from ..models.loading import no_progress
from ..progress import Progress

MODES = ("open", "closed")


def _check_shape(session, budgets) -> None:
    shape = (session.layers, session.kv_heads)
    got = (len(budgets), len(budgets[0]) if len(budgets) else 0)
    if got != shape or any(len(row) != shape[1] for row in budgets):
        raise QualityError(f"an allocation for {got[0]} layers x {got[1]} KV heads; the model has "
                           f"{shape[0]} x {shape[1]}")


def _result(session, policy: str, params: dict, mode: str, hidden, mass: np.ndarray, seconds: float) -> dict:
    ((nll, kl),) = session._scorer.score([hidden])
    mean_nll = float(nll.mean())
    return {"policy": policy, "params": params, "mode": mode, "steps": session.steps, "nll_full": session.nll_full,
            "nll": mean_nll, "delta_nll": mean_nll - session.nll_full, "kl": float(kl.mean()),
            "retained_mass": float(mass.mean()), "retained_mass_by_layer": mass.mean(axis=1).tolist(),
            "seconds": seconds}


def open_truth(session, policy: str, budgets, params: dict | None = None, *, streaming=None) -> dict:
    """The open-loop truth of ``policy`` with ``budgets[layer][kv_head]`` on ``session`` (a
    ``kvsim.models.quality.Session``): NLL, delta NLL, KL against the full cache, retained mass."""
    params = dict(params or {})
    _check_shape(session, budgets)
    t0 = time.perf_counter()
    allowed, mass = replay_masks(session.traces, policy, budgets, params, session.n, streaming)
    hidden = hidden_states(session.model, session.ids, MaskedPass(allowed=allowed))
    return _result(session, policy, params, "open", hidden, mass, time.perf_counter() - t0)


class _PooledDecoder(ClosedLoopDecoder):
    """The closed loop through adakv's pooled layers (one configuration): the retained mass read from what each
    head of the store holds."""

    def __init__(self, model, specs, pool: int, floor: int, full_rows, n):
        super().__init__(model, [[[None] * len(row) for row in specs]], None, full_rows, n)
        self.specs, self.pool, self.floor = specs, pool, floor

    def _cache(self):
        from ..hf import EvictingCache
        from ..hf.pooled import PooledLayer

        return EvictingCache([PooledLayer(row, self.pool, self.floor) for row in self.specs])

    def _mass(self, t: int) -> None:
        for x, layer in enumerate(self.cache.layers):
            for h in range(len(self.specs[x])):
                self.mass[0, x, h, t] = self.full_rows[x][h][t, layer.held(0, h)].astype(np.float64).sum()


def closed_truth(session, policy: str, budgets, params: dict | None = None, *, pooled: int | None = None,
                 streaming=None, progress: Progress | None = None) -> dict:
    """The closed-loop truth of ``policy`` with ``budgets[layer][kv_head]``: the text decoded teacher-forced
    through the deployed cache, each head at its budget; ``pooled`` (adakv's floor per head): each layer's
    heads share one pool of their summed budgets instead (h2o, one recent_window per layer)."""
    from ..policies import PolicySpec

    params = dict(params or {})
    _check_shape(session, budgets)
    try:
        per_layer = layer_params(params, session.layers)
    except ValueError as e:
        raise QualityError(str(e)) from None
    specs = [[PolicySpec.of(policy, int(b), **per_layer[x]) if streaming is None or streaming[x][h] is None else
              PolicySpec.of("streaming_llm", int(b), **streaming[x][h]) for h, b in enumerate(row)]
             for x, row in enumerate(budgets)]
    rows = [[tr.attention for tr in layer] for layer in session.traces]
    t0 = time.perf_counter()
    if pooled is None:
        policies = [[spec.build(session.traces[x][h]) for h, spec in enumerate(row)] for x, row in enumerate(specs)]
        decoder = ClosedLoopDecoder(session.model, [policies], None, rows, session.n)
    else:
        pools = {sum(int(b) for b in row) for row in budgets}
        if len(pools) != 1:
            raise QualityError(f"a pooled allocation holds one pool per layer; these layers' budgets sum to {sorted(pools)}")
        decoder = _PooledDecoder(session.model, specs, pools.pop(), int(pooled), rows, session.n)
    ((hidden, mass),) = decoder.decode(session.ids, session.hidden_full.shape[1], progress)
    return _result(session, policy, params, "closed", hidden, mass, time.perf_counter() - t0)


def split_key(session, policy: str, budgets, params: dict, mode: str, pooled: int | None = None,
              streaming=None) -> dict:
    """What a split's truth depends on: the model, the tokens and steps, the policy and its parameters as asked,
    the loop, every head's budget (and a pool's floor), and the key-token rule the session scores by. One key
    for ``measure`` and the frontier's cells (``measure_cells``), so a cell measured either way is read by both."""
    from ..models.quality import VERSION

    return {"version": VERSION, "model": session.model_id, "tokens": session.tokens_id, "steps": session.steps,
            "policy": policy, "params": dict(sorted(dict(params).items())), "mode": mode,
            "budgets": [[int(b) for b in row] for row in budgets], "pooled": pooled, "key_rule": session.key_rule,
            **({} if streaming is None else {"streaming": streaming})}


def measure(session, policy: str, budgets, params: dict | None = None, mode: str = "closed", *,
            pooled: int | None = None, streaming=None, use_cache: bool = True,
            progress: Progress | None = None) -> dict:
    """``open_truth`` or ``closed_truth`` through the quality cache (``<cache>/quality/split-<key>.json``),
    keyed by the model, the tokens, the policy and its parameters, the mode and the split itself (each head's
    budget, the floor of a pool, duo's streaming heads: ``streaming[layer][kv_head]``, None or the
    streaming_llm parameters that head runs with); ``"cached": True`` on what was read."""
    from ..models.quality import read_cached, write_cached

    if mode not in MODES:
        raise QualityError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if pooled is not None and mode != "closed":
        raise QualityError("a pooled allocation (adakv) is measured closed loop, through the deployed pool")
    params = dict(params or {})
    budgets = [[int(b) for b in row] for row in budgets]
    if streaming is not None and pooled is not None:
        raise QualityError("a split has streaming heads (duo) or a pool per layer (adakv), not both")
    key = split_key(session, policy, budgets, params, mode, pooled, streaming)
    use_cache = use_cache and session.use_cache
    got = read_cached(key, "split") if use_cache else None
    if got is not None:
        return {**got, "cached": True}
    if mode == "open":
        got = open_truth(session, policy, budgets, params, streaming=streaming)
    else:
        got = closed_truth(session, policy, budgets, params, pooled=pooled, streaming=streaming, progress=progress)
    if session.use_cache:
        write_cached(key, got, "split")
    return {**got, "cached": False}


def cached_open_truth(session, policy: str, budgets, params: dict | None = None, *, use_cache: bool = True) -> dict:
    """``measure`` in open loop: what the split search and tune's allocator step read (the same cache)."""
    return measure(session, policy, budgets, params, "open", use_cache=use_cache)


def open_truths(session, policy: str, splits, params: dict | None = None) -> list[dict]:
    """``open_truth`` of each split of ``splits`` (each ``budgets[layer][kv_head]``), their schedules masking
    ONE teacher-forced pass as its batch dimension: the weights are read once for all of them, and each
    row of the batch sees only its own schedule. One split is ``open_truth`` itself. Memory: the masks are
    ``len(splits) x layers x KV heads x n x n`` booleans and one layer's attention ``len(splits) x query heads
    x n x n`` floats, so the caller sizes the batch (``measure_cells``'s ``batch``)."""
    import torch

    splits = list(splits)
    if len(splits) == 1:
        return [open_truth(session, policy, splits[0], params)]
    params = dict(params or {})
    masks = []
    for budgets in splits:
        _check_shape(session, budgets)
        masks.append(replay_masks(session.traces, policy, budgets, params, session.n))
    allowed = {layer: torch.stack([m[0][layer] for m in masks]) for layer in range(session.layers)}
    ids = session.ids.expand(len(splits), -1)
    hidden = hidden_states(session.model, ids, MaskedPass(allowed=allowed), batch=True)
    scores = session._scorer.score([hidden[i] for i in range(len(splits))])
    out = []
    for (_, mass), (nll, kl) in zip(masks, scores, strict=True):
        mean_nll = float(nll.mean())
        out.append({"policy": policy, "params": params, "mode": "open", "steps": session.steps,
                    "nll_full": session.nll_full, "nll": mean_nll, "delta_nll": mean_nll - session.nll_full,
                    "kl": float(kl.mean()), "retained_mass": float(mass.mean()),
                    "retained_mass_by_layer": mass.mean(axis=1).tolist()})
    return out


# --- the frontier's cells, kept on disk ---------------------------------------------------------------

#: the frontier document's version (its cells' figures are keyed in the quality cache by ``split_key``)
CELL_VERSION = 1
#: the format of the frontier document the app reads (``document_path``)
FORMAT = "kvsim-allocation-truth"


@dataclass(frozen=True)
class Cell:
    """One cell of the frontier: ``policy`` (with ``params``) split by ``allocate`` at uniform's memory for
    ``budget`` per head, its split ``budgets[layer][kv_head]`` (made above this layer, by
    ``kvsim.allocation.allocators``)."""

    policy: str
    allocate: str
    budget: int
    budgets: tuple
    params: tuple = ()

    @property
    def asked(self) -> dict:
        return dict(self.params)


def _cell_fields(session, cell: Cell) -> dict:
    """What a frontier row says beside the split's truth: its allocator, budget, model, text and memory."""
    return {"allocate": cell.allocate, "budget": cell.budget, "model": session.model_id, "text": session.text_path.name,
            "positions": int(sum(map(sum, cell.budgets))), "split": [list(map(int, row)) for row in cell.budgets]}


def document_path(model_id: str, text_sha256: str, steps: int) -> Path:
    """Where the frontier's cells of one model, text and steps are gathered for the app:
    ``<cache>/allocation/<model id>-<text sha256 prefix>-<steps>.json``."""
    return cache_dir() / "allocation" / f"{model_id}-{text_sha256[:16]}-{steps}.json"


def read_document(path: Path) -> list[dict]:
    """The cells of a frontier document, or none when it is missing or damaged (they are measured again)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return []
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("results"), list):
        return []
    return [r for r in doc["results"] if isinstance(r, dict)]


def _same_cell(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("policy", "params", "allocate", "budget"))


def save_cells(session, rows: list[dict]) -> Path:
    """Merge ``rows`` into the session's frontier document (atomically; a cell measured again replaces
    the old one). An unwritable cache costs the app its figures, nothing else."""
    from ..models.loading import file_sha256

    sha = file_sha256(session.text_path)
    path = document_path(session.model_id, sha, session.steps)
    old = [r for r in read_document(path) if not any(_same_cell(r, new) for new in rows)]
    doc = {"format": FORMAT, "version": CELL_VERSION,
           "meta": {"model_id": session.model_id, "text": session.text_path.name, "text_sha256": sha,
                    "steps": session.steps, "mode": "open"},
           "results": old + rows}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = json.dumps(doc, indent=1).encode("utf-8")
        atomic_write(path, lambda f: f.write(blob))
    except OSError:
        pass
    return path


def measure_cells(session, cells, *, batch: int = 4, use_cache: bool = True, progress=None) -> list[dict]:
    """Each cell's open-loop truth (KL, delta NLL) and retained mass, through the on-disk cache: a cell
    measured before (by this or an interrupted run) is read, the rest are measured ``batch`` splits of one
    policy at a time in one batched pass (``open_truths``), each kept as soon as its batch ends, so an
    interrupted grid resumes where it stopped. ``progress`` hears of every cell."""
    from ..models.quality import read_cached, write_cached

    say = progress or no_progress
    cells = list(cells)
    out: list[dict | None] = [None] * len(cells)
    todo = []
    for i, cell in enumerate(cells):
        record = read_cached(split_key(session, cell.policy, cell.budgets, cell.asked, "open"), "split") if use_cache else None
        if record is not None:
            out[i] = {**record, **_cell_fields(session, cell), "batch": record.get("batch", 1), "cached": True}
        else:
            todo.append(i)
    done = len(cells) - len(todo)
    if done:
        say(done / len(cells), f"{done} of {len(cells)} cells read from the cache")
    groups: dict[tuple, list[int]] = {}
    for i in todo:  # one batched pass serves splits of one policy with the same parameters
        groups.setdefault((cells[i].policy, cells[i].params), []).append(i)
    for (policy, params), members in groups.items():
        for a in range(0, len(members), max(1, batch)):
            chunk = members[a : a + max(1, batch)]
            t0 = time.perf_counter()
            got = open_truths(session, policy, [[list(r) for r in cells[i].budgets] for i in chunk], dict(params))
            seconds = (time.perf_counter() - t0) / len(chunk)
            rows = []
            for i, r in zip(chunk, got, strict=True):
                c = cells[i]
                if use_cache:
                    write_cached(split_key(session, policy, c.budgets, c.asked, "open"),
                                 {**r, "seconds": seconds, "batch": len(chunk)}, "split")
                row = {**r, **_cell_fields(session, c), "seconds": seconds, "batch": len(chunk)}
                out[i] = {**row, "cached": False}
                rows.append(row)
                done += 1
                say(done / len(cells), f"{policy} {c.allocate} at {c.budget}: KL {row['kl']:.4f}, delta NLL "
                                       f"{row['delta_nll']:.4f}, mass {row['retained_mass']:.4f} ({seconds:.1f} s each, "
                                       f"{len(chunk)} in one pass)")
            if use_cache:
                save_cells(session, rows)
    if use_cache:
        save_cells(session, [{k: v for k, v in r.items() if k != "cached"} for r in out if r is not None])
    return out


def documents_for(model_id: str, text_sha256: str) -> dict[int, list[dict]]:
    """The frontier cells measured for one model and text, by the steps they were measured at: the shipped
    documents (``traces/allocation-*.json``, a study's cells) and the disk cache's ``allocation/``, a cell
    measured here replacing a shipped one; damaged documents are skipped."""
    from ..data.catalog import TRACES_DIR

    out: dict[int, list[dict]] = {}
    for path in sorted(TRACES_DIR.glob("allocation-*.json")) + sorted((cache_dir() / "allocation").glob("*.json")):
        meta = read_meta(path)
        if meta.get("model_id") != model_id or meta.get("text_sha256") != text_sha256:
            continue
        steps = meta.get("steps")
        if not isinstance(steps, int):
            continue
        rows = read_document(path)
        kept = [r for r in out.get(steps, []) if not any(_same_cell(r, new) for new in rows)]
        out[steps] = kept + rows
    return {s: rows for s, rows in out.items() if rows}


def read_meta(path: Path) -> dict:
    """A frontier document's ``meta`` (model id, text sha256, steps), or {} when it is not one."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("meta"), dict):
        return {}
    return doc["meta"]

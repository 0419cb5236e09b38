"""The truth of an allocation, open loop: the model's loss and KL when each (layer, KV head) holds its own
budget (docs/allocation.md). The policy replays each head's full-cache trace at that head's budget; the
schedules mask one teacher-forced pass (docs/domain.md, "The truth"), as ``Session.run_open`` does with one
budget for all, so a split of equal budgets is exactly ``Session.evaluate(policy, budget, "open")``
(tests/test_allocation_truth.py). The split itself is made above this layer (``kvsim.analysis.allocation``,
by the command line); this module reads it as ``budgets[layer][kv_head]``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..data.files import atomic_write
from ..data.store import cache_dir
from .decode import MaskedPass, hidden_states, replay_masks
from .errors import QualityError
from .loading import no_progress


def open_truth(session, policy: str, budgets, params: dict | None = None) -> dict:
    """The open-loop truth of ``policy`` with ``budgets[layer][kv_head]`` on ``session`` (a
    ``kvsim.models.quality.Session``): NLL, delta NLL, KL against the full cache, retained mass."""
    params = dict(params or {})
    shape = (session.layers, session.kv_heads)
    got = (len(budgets), len(budgets[0]) if len(budgets) else 0)
    if got != shape:
        raise QualityError(f"an allocation for {got[0]} layers x {got[1]} KV heads; the model has "
                           f"{shape[0]} x {shape[1]}")
    allowed, mass = replay_masks(session.traces, policy, budgets, params, session.n)
    hidden = hidden_states(session.model, session.ids, MaskedPass(allowed=allowed))
    ((nll, kl),) = session._scorer.score([hidden])
    mean_nll = float(nll.mean())
    return {"policy": policy, "params": params, "mode": "open", "steps": session.steps, "nll_full": session.nll_full,
            "nll": mean_nll, "delta_nll": mean_nll - session.nll_full, "kl": float(kl.mean()),
            "retained_mass": float(mass.mean()), "retained_mass_by_layer": mass.mean(axis=1).tolist()}


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
    shape = (session.layers, session.kv_heads)
    masks = []
    for budgets in splits:
        got = (len(budgets), len(budgets[0]) if len(budgets) else 0)
        if got != shape:
            raise QualityError(f"an allocation for {got[0]} layers x {got[1]} KV heads; the model has "
                               f"{shape[0]} x {shape[1]}")
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

#: what a cached cell means; bump it when the figures change meaning
CELL_VERSION = 1
#: the format of the frontier document the app reads (``document_path``)
FORMAT = "kvsim-allocation-truth"


@dataclass(frozen=True)
class Cell:
    """One cell of the frontier: ``policy`` (with ``params``) split by ``allocate`` at uniform's memory for
    ``budget`` per head, its split ``budgets[layer][kv_head]`` (made above this layer, by
    ``kvsim.analysis.allocation``)."""

    policy: str
    allocate: str
    budget: int
    budgets: tuple
    params: tuple = ()

    @property
    def asked(self) -> dict:
        return dict(self.params)


def cell_key(session, cell: Cell) -> dict:
    """What keys a cell in the result cache: the model, its tokens and steps, the policy, the allocator
    and the split itself (an allocator's split can change with the traces; the figure follows the split)."""
    return {"version": CELL_VERSION, "model": session.model_id, "tokens": session.tokens_id, "steps": session.steps,
            "policy": cell.policy, "params": dict(sorted(cell.params)), "allocate": cell.allocate,
            "budget": cell.budget, "split": [list(map(int, row)) for row in cell.budgets]}


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
    from .loading import file_sha256

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
    import time

    from .quality import read_cached, write_cached

    say = progress or no_progress
    cells = list(cells)
    out: list[dict | None] = [None] * len(cells)
    todo = []
    for i, cell in enumerate(cells):
        record = read_cached(cell_key(session, cell), "allocation") if use_cache else None
        if record is not None:
            out[i] = {**record, "cached": True}
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
                row = {**r, "allocate": c.allocate, "budget": c.budget, "model": session.model_id,
                       "text": session.text_path.name, "positions": int(sum(map(sum, c.budgets))),
                       "split": [list(map(int, row)) for row in c.budgets], "seconds": seconds, "batch": len(chunk)}
                if use_cache:
                    write_cached(cell_key(session, c), row, "allocation")
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

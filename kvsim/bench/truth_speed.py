"""``kvsim bench --truth``: what the truth costs, Gemma-3-270M on the shipped traces'
text, open loop, measured in one process so the figures compare on a noisy machine.

- the model's load (the tokenizer skipped when the full-cache pass is cached: it holds the token ids);
- the session: the full-cache pass, read from the disk cache when there (say which);
- one configuration (h2o, budget 256, recent_window 88), the first of the session: its replays, its
  masked pass and the output layer on every row that differs, full-cache side included;
- a 16-window sweep (recent_window 8 .. 248 by 16) in the same session, nothing read from the
  result cache, the full-cache side of the output layer shared;
- that the sweep's window 88 gives the one configuration's numbers exactly.

What it measures is kept in the result cache and in the recording's truth document (the curve view
and ``tune --by kl`` read them; ``traces/truth-gemma3-270m-heapq.json`` ships a copy).
"""

from __future__ import annotations

import time

from ..policykit.base import WINDOW
from ..progress import Progress

STEPS = 1024
BUDGET = 256
ONE_WINDOW = 88
WINDOWS = tuple(range(8, 249, 16))
TARGETS = {"one_configuration_seconds": 10.0, "sweep_16_seconds": 180.0}


def run(progress: Progress | None = None, steps: int = STEPS) -> dict:
    import torch

    from ..models import quality, texts
    from ..models.scoring import full_pass_key, read_full_pass

    text = texts.resolve_text("heapq")
    model_id = quality.model_id_of(None)
    cached = read_full_pass(full_pass_key(model_id, text.read_bytes(), steps)) is not None
    t0 = time.perf_counter()
    loaded = quality.load(None, progress, tokenizer=not cached)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    session = quality.open_session(text, steps, model_and_tokenizer=loaded, progress=progress)
    session_s = time.perf_counter() - t0
    fresh = dict(use_cache=False, write_cache=True)  # measured afresh; kept for tune --by kl and the views
    t0 = time.perf_counter()
    one = session.measure_many([session.configuration("h2o", BUDGET, {WINDOW: ONE_WINDOW})], "open", **fresh)[0]
    one_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = session.measure_many([session.configuration("h2o", BUDGET, {WINDOW: w}) for w in WINDOWS], "open",
                                **fresh)
    sweep_s = time.perf_counter() - t0
    from ..analysis.proxies import configuration
    from ..models.loading import MODEL
    from ..models.truth import window_truth

    window_truth(session, "h2o", BUDGET, WINDOWS, proxies=configuration, recording=MODEL)  # the truth document, read from the cache
    same = next(r for r in rows if r["params"][WINDOW] == ONE_WINDOW)
    doc = {
        "kind": "truth",
        "threads": torch.get_num_threads(),
        "steps": session.steps,
        "full_pass_cached": cached,
        "load_seconds": load_s,
        "session_seconds": session_s,
        "one_configuration_seconds": one_s,
        "one_configuration_with_load_seconds": load_s + session_s + one_s,
        "sweep_16_seconds": sweep_s,
        "sweep_per_window_seconds": sweep_s / len(WINDOWS),
        "one": {k: one[k] for k in ("kl", "delta_nll", "retained_mass")},
        "sweep": [{WINDOW: r["params"][WINDOW], "kl": r["kl"], "delta_nll": r["delta_nll"],
                   "retained_mass": r["retained_mass"]} for r in rows],
        "identical": all(one[k] == same[k] for k in ("kl", "delta_nll", "nll", "retained_mass")),
    }
    doc["targets"] = {
        "one_configuration_within_10_s": doc["one_configuration_with_load_seconds"] <= TARGETS["one_configuration_seconds"],
        "sweep_16_within_3_min": sweep_s <= TARGETS["sweep_16_seconds"],
        "sweep_matches_one_configuration": doc["identical"],
    }
    return doc


def render(doc: dict) -> str:
    from .speed import verdict_lines

    lines = [
        f"truth, open loop: Gemma-3-270M on heapq.py, {doc['steps']} steps, budget {BUDGET}, {doc['threads']} threads",
        f"  model load            {doc['load_seconds']:6.1f} s" + ("  (tokenizer skipped)" if doc["full_pass_cached"] else ""),
        f"  full-cache pass       {doc['session_seconds']:6.1f} s  "
        f"({'read from the cache' if doc['full_pass_cached'] else 'computed, now cached'})",
        f"  one configuration     {doc['one_configuration_seconds']:6.1f} s  (h2o recent_window={ONE_WINDOW}: KL {doc['one']['kl']:.4f}); "
        f"with load and session {doc['one_configuration_with_load_seconds']:.1f} s",
        f"  16-window sweep       {doc['sweep_16_seconds']:6.1f} s  ({doc['sweep_per_window_seconds']:.1f} s a window)",
        "",
        *verdict_lines(doc),
    ]
    return "\n".join(lines)


__all__ = ["TARGETS", "render", "run"]

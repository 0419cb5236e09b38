"""A pass key per turn kept for the app (issue 57, item 4; docs/needle.md, "A conversation: a pass key per turn").

``kvsim needle --keys K`` measures a conversation grid (``needle_conversation.run_conversation_unit`` per length
and trial); this keeps what the Pass key view draws of it and nothing else: per cell the keys, their positions,
the turns' boundaries, and per run (the full cache, each policy) what each turn wrote, whether it found its key,
and each key's fate per (layer, KV head) (``key_left``: the step its last token left, None when one stayed;
``key_first_left``), with ``--optimum`` the optimum's over the whole conversation and both retained masses.

Two homes: ``traces/needle-conversation.json`` ships the measurements docs/needle.md made (``SHIPPED``, a list of
them, each with the command that made it), so a fresh install draws a conversation; ``kvsim needle --keys K``
saves each grid of one's own in the cache directory (``<cache>/needle/conversation-*.json``, ``saved``).
``python -m kvsim.models.conversation_grid [OUT]`` measures ``COMMANDS`` again (each run read from the disk
cache where it is there; the model and torch needed) and writes the shipped file.

Reading either checks the shape the view needs and raises ``ConversationGridError`` (one line naming the file)
for anything else; nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from ..data.catalog import TRACES_DIR
from ..data.files import atomic_write
from ..data.store import cache_dir

#: the shipped measurements (``traces/``)
SHIPPED_NAME = "needle-conversation.json"
SHIPPED = TRACES_DIR / SHIPPED_NAME
#: the cache directory's folder the grids go in (``kvsim cache list``: needle), and their names' start
FOLDER = "needle"
PREFIX = "conversation-"
#: what the shipped file holds, each measured on Gemma-3-270M in the default wording (each key's owner's name, as the
#: study in docs/multi-turn.md; every run cached on disk under its key)
COMMANDS = (
    "python -m kvsim needle --keys 2 --depths 0.3,0.7 --lengths 1024 --trials 3 --policy h2o,tova,snapkv --budget 256 "
    "--optimum",
    "python -m kvsim needle --keys 2 --depths 0.3,0.7 --lengths 1024 --trials 3 --policy snapkv --budget 256 "
    "--prefill-budget 256 --query aware --optimum",
    "python -m kvsim needle --keys 2 --depths 0.3,0.7 --lengths 1024 --trials 3 --policy snapkv --budget 256 "
    "--prefill-budget 256 --query agnostic --optimum",
)
#: a grid's own fields kept, a cell's, a run's
_GRID = ("model", "model_id", "keys", "query", "lengths", "depths", "trials", "seed", "new_tokens", "needle", "question")
_CELL = ("length", "depths", "trial", "keys", "key_positions", "needle_starts", "context_tokens", "question_tokens")
_RUN = ("policy", "budget", "params", "label", "prefill", "query", "texts", "answers", "found", "positions",
        "turn_starts", "key_left", "key_first_left", "optimal_key_left", "optimal_key_first_left", "retained",
        "optimal_retained", "retained_after_prompt", "optimal_retained_after_prompt")


class ConversationGridError(ValueError):
    """A conversation file the view cannot draw; the message is one line naming the file."""


def shrink(doc: dict, command: str | None = None, measured: str | None = None) -> dict:
    """What the view draws of ``kvsim needle --keys K --json``'s document (``doc``), with the command that made it."""
    cells = [{**{k: c[k] for k in _CELL}, "control": {k: c["control"].get(k) for k in _RUN},
              "runs": [{k: r.get(k) for k in _RUN} for r in c["runs"]]} for c in doc["cells"]]
    return {**{k: doc.get(k) for k in _GRID}, "command": command, "measured": measured,
            "control_found": doc["control"]["found"], "cells": cells}


def check(doc, name: str) -> dict:
    """``doc`` when it has everything the view reads; else ConversationGridError naming ``name``."""
    def bad(why: str):
        return ConversationGridError(f"{name}: not a pass-key conversation ({why})")

    if not isinstance(doc, dict):
        raise bad("not a JSON object")
    missing = [k for k in ("model", "keys", "cells") if k not in doc]
    if missing:
        raise bad(f"no {', '.join(missing)}")
    if not isinstance(doc["cells"], list) or not doc["cells"]:
        raise bad("cells: an empty or non-list value")
    k = doc["keys"]
    if not isinstance(k, int) or k < 1:
        raise bad(f"keys: {k!r}: not a count of keys")
    for i, cell in enumerate(doc["cells"]):
        if not isinstance(cell, dict) or not isinstance(cell.get("runs"), list) or not isinstance(cell.get("control"), dict):
            raise bad(f"cell {i + 1}: no control and runs")
        if len(cell.get("keys") or []) != k or len(cell.get("key_positions") or []) != k:
            raise bad(f"cell {i + 1}: not {k} keys with their positions")
        for run in [cell["control"], *cell["runs"]]:
            if not isinstance(run, dict) or len(run.get("found") or []) != k or len(run.get("turn_starts") or []) != k:
                raise bad(f"cell {i + 1}: a run without a found and a start per turn")
            for field in ("key_left", "optimal_key_left"):
                fates = run.get(field)
                if fates is not None and not (isinstance(fates, list) and len(fates) == k and all(
                        isinstance(layers, list) and layers and all(isinstance(h, list) for h in layers) for layers in fates)):
                    raise bad(f"cell {i + 1}, {run.get('label')}: {field}: not a step per key, layer and KV head")
        if not cell["runs"]:
            raise bad(f"cell {i + 1}: no policy's run")
    return doc


def _load(path: Path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConversationGridError(f"{Path(path).name}: not a pass-key conversation ({' '.join(str(e).split())})") \
            from None


def shipped(path: Path | None = None) -> list[dict]:
    """The shipped measurements, each checked; [] where the install has no such file."""
    path = SHIPPED if path is None else Path(path)
    try:
        doc = _load(path)
    except FileNotFoundError:
        return []
    measurements = doc.get("measurements") if isinstance(doc, dict) else None
    if not isinstance(measurements, list) or not measurements:
        raise ConversationGridError(f"{path.name}: not a pass-key conversation (no measurements)")
    return [check(m, f"{path.name}, measurement {i + 1}") for i, m in enumerate(measurements)]


def save(doc: dict) -> Path | None:
    """A grid of one's own (``kvsim needle --keys K``'s document) in the cache directory; None where it cannot be
    written (the result is still printed)."""
    small = shrink(doc)
    text = json.dumps(small)
    path = cache_dir() / FOLDER / f"{PREFIX}{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(text.encode()))
    except OSError:
        return None
    return path


def saved() -> list[Path]:
    """The conversation grids of one's own in the cache directory, newest first."""
    try:
        return sorted((cache_dir() / FOLDER).glob(f"{PREFIX}*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []


def read(path: Path) -> dict:
    """One saved grid, checked (ConversationGridError naming the file)."""
    try:
        doc = _load(path)
    except FileNotFoundError:
        raise ConversationGridError(f"{Path(path).name}: not a pass-key conversation (gone)") from None
    return check(doc, Path(path).name)


def refresh(out: Path = SHIPPED) -> dict:
    """Run ``COMMANDS`` (each with ``--json --quiet``; cached runs are read back) and write ``out``."""
    import shlex
    import subprocess
    from datetime import UTC, datetime

    measurements = []
    for command in COMMANDS:
        argv = shlex.split(command)[3:]  # after "python -m kvsim"
        done = subprocess.run([sys.executable, "-m", "kvsim", *argv, "--json", "--quiet"], check=True,
                              capture_output=True, text=True)
        when = datetime.now(tz=UTC).strftime("%d %b %Y")
        measurements.append(shrink(json.loads(done.stdout), command, when))
    doc = {"what": "a pass key per turn measured for docs/needle.md, drawn by the app's Pass key view on a fresh "
                   "install; written by python -m kvsim.models.conversation_grid", "measurements": measurements}
    out.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
    return doc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else SHIPPED
    doc = refresh(out)
    print(f"{out}: {len(doc['measurements'])} measurement(s), {out.stat().st_size:,} bytes")
    return 0


__all__ = ["COMMANDS", "SHIPPED", "SHIPPED_NAME", "ConversationGridError", "check", "read", "refresh", "save", "saved",
           "shipped", "shrink"]

if __name__ == "__main__":
    raise SystemExit(main())

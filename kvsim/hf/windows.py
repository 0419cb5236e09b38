"""Per-layer windows from ``python -m kvsim tune --json``, checked against the model they are deployed on.

The tune document's ``per_layer`` rows give one recommended ``recent_window`` per layer (shared by its
KV heads: what a serving stack sets per layer); its ``layers`` rows give one per (layer, KV head), each
row with the layer's ``attention`` (``global`` or ``sliding``). Both are read as ``tune`` writes them;
fields added later are read where they say what to deploy (``deploy``: the windows ``tune``
recommends by its ``by``) and checked where they say what the recording was (``recording``: its
model and sliding window). A file tuned on another model (other layer count, KV heads, layer kinds or
sliding window) is refused in one line before anything runs.

Nothing here uses torch, but importing it runs ``kvsim/hf/__init__.py``, which loads torch and
transformers: ``kvsim generate`` checks a tune file with them loaded, before the model is.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..data import jsontext
from ..policykit.base import WINDOW

BY = ("layer", "head")


class WindowsError(ValueError):
    """A tune file that cannot be deployed as asked; one line naming the file and the field."""


def read_tune(path: str | Path) -> dict:
    """The tune document at ``path``; WindowsError when it is missing, not JSON, or not a tune file."""
    p = Path(path)
    try:
        doc = jsontext.loads(p.read_text())
    except OSError as e:
        raise WindowsError(f"{p}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WindowsError(f"{p}: not a JSON file ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("layers"), list) or not doc["layers"]:
        raise WindowsError(f"{p}: not a tune file (python -m kvsim tune --json): no 'layers' rows")
    if doc.get("param", WINDOW) != WINDOW:
        raise WindowsError(f"{p}: tunes {doc.get('param')!r}, kvsim.hf deploys {WINDOW}")
    for i, row in enumerate(doc["layers"]):
        if not isinstance(row, dict) or not all(isinstance(row.get(k), int) for k in ("layer", "head", "recommended_window")):
            raise WindowsError(f"{p}: layers[{i}] lacks an integer layer, head or recommended_window")
    return doc


def tune_windows(doc: dict, by: str = "layer", *, source: str = "tune file") -> dict:
    """``{layer: window}`` (``by="layer"``: what the file deploys, its ``deploy`` rows, chosen by its
    ``by``; in a file written before them, the ``per_layer`` rows, or the ``layers`` rows where each
    layer's heads agree) or ``{(layer, head): window}`` (``by="head"``: each KV head's recommended
    window by retained mass, the ``layers`` rows)."""
    if by not in BY:
        raise WindowsError(f"{source}: windows by {by!r}; choose one of {', '.join(BY)}")
    if by == "head":
        return {(r["layer"], r["head"]): r["recommended_window"] for r in doc["layers"]}
    deploy = doc.get("deploy")
    if isinstance(deploy, dict) and deploy.get("per_layer") is not None:
        rows = deploy["per_layer"]
        if not isinstance(rows, list) or not rows or not all(
                isinstance(r, dict) and isinstance(r.get("layer"), int) and isinstance(r.get(WINDOW), int) for r in rows):
            raise WindowsError(f"{source}: deploy.per_layer must be rows of an integer layer and recent_window")
        return {r["layer"]: r[WINDOW] for r in rows}
    per_layer = doc.get("per_layer")
    if isinstance(per_layer, list) and per_layer:
        return {int(r["layer"]): int(r["recommended_window"]) for r in per_layer}
    out: dict[int, int] = {}
    for r in doc["layers"]:
        if out.setdefault(r["layer"], r["recommended_window"]) != r["recommended_window"]:
            raise WindowsError(f"{source}: layer {r['layer']}'s KV heads recommend different windows and the file "
                               "has no per_layer rows; deploy them by head")
    return out


def check_model(doc: dict, layer_kinds: list[str], kv_heads: int, model_window: int | None, *,
                source: str = "tune file", model: str = "the model") -> None:
    """Refuse a tune document recorded on another model: ``layer_kinds`` is the model's ``global`` /
    ``sliding`` per layer, ``kv_heads`` its KV heads, ``model_window`` its sliding window."""
    rows = doc["layers"]
    layers = sorted({r["layer"] for r in rows})
    name = doc.get("trace", "?")
    if layers != list(range(len(layer_kinds))):
        raise WindowsError(f"{source}: tuned on {len(layers)} layers ({name}), {model} has {len(layer_kinds)}; "
                           "it is for another model")
    heads = max(r["head"] for r in rows) + 1
    if heads != kv_heads:
        raise WindowsError(f"{source}: tuned on {heads} KV head(s) per layer ({name}), {model} has {kv_heads}; "
                           "it is for another model")
    for r in rows:
        kind = r.get("attention")
        if kind in ("global", "sliding") and kind != layer_kinds[r["layer"]]:
            raise WindowsError(f"{source}: layer {r['layer']} is {kind} attention there ({name}) and "
                               f"{layer_kinds[r['layer']]} in {model}; it is for another model")
    # the recording's own sliding window, never the tuned model_window: that one is a recent_window
    # chosen inside the budget, and comparing it with the model's window refused every file tune wrote
    recorded = (doc.get("recording") or {}).get("sliding_window") if isinstance(doc.get("recording"), dict) else None
    if isinstance(recorded, int) and model_window is not None and recorded != model_window:
        raise WindowsError(f"{source}: recorded on {doc['recording'].get('model') or name} with a sliding window of "
                           f"{recorded}, {model}'s is {model_window}; it is for another model")

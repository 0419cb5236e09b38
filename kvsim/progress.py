"""The one progress protocol every long step reports through: ``progress(fraction, note)``.

``fraction`` is the share done, 0..1, or ``None`` when a phase has no measurable extent (loading a
model, compiling the engine); ``note`` says what is happening, in a few words. The CLI prints it on
stderr (``stderr``), the app draws it as a bar, a caller that does not care passes nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol


class Progress(Protocol):
    def __call__(self, fraction: float | None, note: str = "") -> None: ...


def scaled(progress: Progress | None, start: float, end: float) -> Progress | None:
    """A sub-phase's progress mapped onto ``start .. end`` of the caller's (None stays None)."""
    if progress is None:
        return None

    def report(fraction: float | None, note: str = "") -> None:
        progress(None if fraction is None else start + (end - start) * fraction, note)

    return report


def stderr(prefix: str = "kvsim", every: float = 0.5, stream=None) -> Progress:
    """Lines on stderr (``prefix: note 42%``), at most one per ``every`` seconds unless the note
    changes or the phase is done, so a long step is never silent and a short one never noisy."""
    last = {"t": -1e9, "note": None}

    def report(fraction: float | None, note: str = "") -> None:
        now = time.monotonic()
        done = fraction is not None and fraction >= 1.0
        if note == last["note"] and not done and now - last["t"] < every:
            return
        last.update(t=now, note=note)
        pct = "" if fraction is None else f" {100 * min(max(fraction, 0.0), 1.0):.0f}%"
        print(f"{prefix}: {note}{pct}".rstrip(), file=stream or sys.stderr, flush=True)

    return report

"""The command chains the docs print, read from the docs themselves, so that a test runs what a reader
copies and the two cannot drift apart.

A chain is a fenced code block with no language (or ``bash``/``sh``) whose every line is a ``python``
command; ``run`` runs one in a folder of its own, as printed, one ``bash -e`` script, with ``python``
being this interpreter and ``kvsim`` imported from this checkout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([A-Za-z]*)\n(.*?)^```", re.S | re.M)


def chains(doc: str | Path) -> list[list[str]]:
    """The command chains of ``doc`` (a path relative to the checkout), in the order printed."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    out = []
    for lang, body in FENCE.findall(text):
        lines = [line for line in body.splitlines() if line.strip()]
        if lang in ("", "bash", "sh") and lines and all(line.startswith("python ") for line in lines):
            out.append(lines)
    return out


def run(chain: list[str], folder: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``chain`` in ``folder`` exactly as printed: ``python`` is this interpreter (its folder first
    on PATH), and this checkout is first on the import path, whichever copy of kvsim is installed. Its
    kvsim cache is the test's (``KVSIM_CACHE_DIR``, the suite's ``.test-cache`` unless the test set its
    own), never the reader's: so the chains share the dequantised model and whatever truth one of them
    measures with each other and the rest of the suite, rather than measuring it again per folder."""
    env = dict(os.environ)
    if not env.get("KVSIM_CACHE_DIR"):  # tests/conftest.py sets it before kvsim is imported
        raise RuntimeError("doc_chains.run: KVSIM_CACHE_DIR is not set; a chain would use the reader's cache")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    script = "set -e\n" + "\n".join(chain) + "\n"
    return subprocess.run(["bash", "-c", script], cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)

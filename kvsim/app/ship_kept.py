"""Write ``traces/kept/``: what the app's cache holds after the first visits of *Choosing recent_window* (at the
app's budget) and *Claims* on each shipped trace, so a fresh install reads it (``kvsim.data.kept``).

    python -m kvsim.app.ship_kept                 # every shipped trace (a few minutes on two cores)
    python -m kvsim.app.ship_kept --traces gemma3-270m-L05

The visits run the app itself (Streamlit's AppTest) in a child process with an empty cache directory of their
own and nothing shipped read (``KVSIM_NO_SHIPPED_CACHE``), so every document is what the code computes now, and
is named as the cache names it. Run it again after an edit of the engine, the policies, the data layer or the
analyses (``tests/test_kept.py`` fails until then); until it is run the app computes, as without the files.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: the visits, in the child: each view opened by its link on each trace, until nothing is left in the background
_CHILD = """
import sys, time
from streamlit.testing.v1 import AppTest
app, budget = sys.argv[1], sys.argv[2]
for trace in sys.argv[3:]:
    for view in ("Choosing recent_window", "Claims"):
        at = AppTest.from_file(app, default_timeout=1800)
        at.query_params.update({"view": view, "trace": trace, "budget": budget})
        at.run()
        started = time.monotonic()
        while time.monotonic() - started < 1800:
            words = " ".join([c.value for c in at.caption] + [i.value for i in at.info])
            if "Still replaying" not in words and "being solved" not in words:
                break
            time.sleep(0.5)
            at.run()
        if at.exception or at.error:
            sys.exit(f"{trace}, {view}: {[e.value for e in at.exception] + [e.value for e in at.error]}")
        print(trace, view, "done", flush=True)
"""


def collect(cache: Path, stems: list[str]) -> dict[str, dict]:
    """Per shipped trace, its documents in ``cache`` by their shipped names; and ``tuning`` the tunings."""
    from kvsim.data import kept, store
    from kvsim.data.catalog import resolve_trace

    out = {}
    for stem in stems:
        trace = resolve_trace(stem)  # the entry the visits wrote (the cache directory is the child's)
        entry, key = trace.derived.disk_stem, kept.content_key(trace)
        entries = {}
        for path in sorted(cache.glob(f"{entry.name}-*.json")):
            doc = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(doc, dict) or set(doc) != {"name", "params", "version", "record"}:
                continue
            head, name = store.derived_name(doc["name"], doc["params"], doc["version"])
            assert path.name == f"{entry.name}-{name}", path  # named by the cache's own key function
            entries[f"{key}/{name}"] = doc
        out[stem] = {"trace": stem, "content_key": key, "entries": entries}
    out["tuning"] = {"entries": {f"tuning/{p.name}": json.loads(p.read_text(encoding="utf-8"))
                                 for p in sorted((cache / "tuning").glob("unit-*.json"))}}
    return out


def write(folder: Path, files: dict[str, dict]) -> list[Path]:
    """One JSON file per trace (and the tunings), a document a line, so a change reads as a diff."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for label, doc in files.items():
        head = [f"{json.dumps(k)}: {json.dumps(v)}," for k, v in sorted(doc.items()) if k != "entries"]
        items = sorted(doc["entries"].items())
        body = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True, separators=(',', ':'))}" for k, v in items]
        path = folder / f"{label}.json"
        path.write_text("{" + "\n".join([*head, '"entries": {', ",\n".join(body), "}}"]) + "\n", encoding="utf-8")
        json.loads(path.read_text(encoding="utf-8"))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    from kvsim.app.state import APP_BUDGET
    from kvsim.data import kept
    from kvsim.data.catalog import shipped_traces

    parser = argparse.ArgumentParser(prog="python -m kvsim.app.ship_kept", description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=",".join(shipped_traces()), help="shipped traces, comma-separated")
    parser.add_argument("--out", default=str(kept.KEPT_DIR), help="the folder written (default: %(default)s)")
    args = parser.parse_args(argv)
    stems = [s for s in args.traces.split(",") if s]
    app = Path(__file__).resolve().parents[2] / "app.py"
    with tempfile.TemporaryDirectory(prefix="kvsim-ship-") as tmp:
        env = {**os.environ, "KVSIM_CACHE_DIR": tmp, kept.OFF_ENV: "1"}
        subprocess.run([sys.executable, "-c", _CHILD, str(app), str(APP_BUDGET), *stems], env=env, check=True)
        os.environ["KVSIM_CACHE_DIR"] = tmp
        files = collect(Path(tmp), stems)
    out = Path(args.out)
    for path in write(out, files):
        print(f"{path}: {sum(1 for _ in json.loads(path.read_text())['entries'])} documents, {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

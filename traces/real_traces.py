"""Measure the shipped real traces against the canonical one: the figures in REAL_TRACES.md and the
picture docs/real-traces.png; and give a shipped trace the members the key-, value-, query- and
output-aware policies read.

    python traces/real_traces.py                              # the figures, as JSON on stdout
    python traces/real_traces.py --png docs/real-traces.png   # and the picture (headless chromium)
    python traces/real_traces.py --add-vectors traces/gemma3-270m-L11.npz --text /usr/lib/python3.11/heapq.py

The figures need only the core (no torch): the traces are files, the replays run on the fast engine.

``--add-vectors`` (needs the record extra, pip install -e '.[record]') records the trace's layer again over
the same text (checked by the sha256 in its meta), with ``kvsim record --store dense --vectors``, and
writes the file back with its attention bytes as shipped and the recording's ``values``, ``keys``,
``queries`` and ``out_norms`` (float16) beside them, the meta gaining the layer's rotary constants
(``rope_theta``, ``rope_layout``, ``head_dim``, ...) and ``vectors``. The re-recorded attention must
match the shipped one within one float16 step per weight (today's blockwise recorder sums in another
order than the one that made the shipped files: on gemma3-270m-L11, 7,452 of 8,390,656 weights differ,
by one step each, at most 2.4e-4), else nothing is written. A second run replaces the members.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, nothing installed
from kvsim.analysis.metrics import describe
from kvsim.analysis.table import build_table
from kvsim.data.catalog import resolve_trace
from kvsim.sim.simulate import sweep

TRACES = ["canonical", "gemma3-270m-L05", "gemma3-270m-L11", "gemma3-270m-L17"]
BUDGETS = [128, 256, 512]
TOP_K = 32
#: a heavy hitter: a position past the sinks that is among a row's top 32 in at least this many rows
#: in which it is older than the recency band, i.e. attention keeps coming back to it
HEAVY_ROWS, BAND, SINKS = 256, 64, 4
#: where h2o's curve saturates: the smallest recent_window within this much of the curve's maximum
SATURATION = 0.005


def heavy_hitters(trace) -> dict:
    """Positions that stay in the rows' top 32 long after they leave the recency band."""
    mask = trace.topk_mask(TOP_K).astype(bool)
    n = mask.shape[0]
    age = np.arange(n)[:, None] - np.arange(n)[None, :]
    old = mask & (age > BAND)
    hits = old.sum(axis=0)
    heavy = np.flatnonzero(hits >= HEAVY_ROWS)
    heavy = heavy[heavy >= SINKS]
    a = trace.attention
    rows = np.arange(BAND + 1, n)
    # the share of each row that the heavy hitters hold while they are older than the band
    share = np.array([a[t, heavy[heavy < t - BAND]].sum() for t in rows]) if heavy.size else np.zeros(rows.size)
    return {"count": int(heavy.size), "first": heavy[:12].tolist(), "row_share": float(share.mean())}


def measure(name: str) -> dict:
    trace = resolve_trace(name)
    d = describe(trace, top_k=TOP_K)
    a = trace.attention
    out = {
        "trace": name,
        "steps": trace.steps,
        "position0_share": float(a[SINKS + 1 :, 0].mean()),
        **{k: d[k] for k in ("sink_share", "recent_share", "top_k_share", "effective_positions")},
        "heavy_hitters": heavy_hitters(trace),
        "budgets": {},
    }
    for budget in BUDGETS:
        table = build_table(trace, budget=budget, top_k=TOP_K, targets=False)
        rows = [
            {"policy": r["policy"], "params": r["params"], "retained_mass": r.get("retained_mass"),
             "top_k_recall": r.get("top_k_recall")}
            for r in table["rows"]
        ]
        windows = list(range(0, budget, 8))
        curve = sweep(trace, "h2o", budget, "recent_window", windows, top_k=TOP_K)
        mass = np.array([c["retained_mass"] for c in curve])
        best = int(np.argmax(mass))
        saturated = int(np.flatnonzero(mass >= mass[best] - SATURATION)[0])
        out["budgets"][budget] = {
            "rows": rows,
            "h2o_curve": {"recent_window": windows, "retained_mass": mass.tolist(),
                          "top_k_recall": [c["top_k_recall"] for c in curve]},
            "h2o_best": {"recent_window": windows[best], "retained_mass": float(mass[best])},
            "h2o_saturates_at": windows[saturated],
        }
    return out


def figure(results: list[dict]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    colors = {"canonical": "#7f7f7f", "gemma3-270m-L05": "#1f77b4", "gemma3-270m-L11": "#ff7f0e",
              "gemma3-270m-L17": "#2ca02c"}
    fig = make_subplots(
        rows=1, cols=4, column_widths=[0.31, 0.23, 0.23, 0.23], horizontal_spacing=0.06,
        subplot_titles=["gemma3-270m-L11: first 512 steps, log10 weight",
                        *(f"h2o retained mass vs recent_window, budget {b}" for b in BUDGETS)],
    )
    a = resolve_trace("gemma3-270m-L11").attention[:513, :513].astype(np.float64)
    z = np.where(np.tril(np.ones_like(a), k=-1) > 0, np.log10(np.maximum(a, 1e-6)), np.nan)
    fig.add_trace(go.Heatmap(z=z, zmin=-5, zmax=0, colorscale="Viridis", showscale=False), row=1, col=1)
    fig.update_yaxes(autorange="reversed", title_text="step t (query position)", row=1, col=1)
    fig.update_xaxes(title_text="position p", row=1, col=1)
    for col, budget in enumerate(BUDGETS, start=2):
        for r in results:
            b = r["budgets"][budget]
            fig.add_trace(go.Scatter(
                x=b["h2o_curve"]["recent_window"], y=b["h2o_curve"]["retained_mass"], mode="lines",
                name=r["trace"], legendgroup=r["trace"], showlegend=col == 2,
                line={"color": colors[r["trace"]], "width": 2.5 if r["trace"] != "canonical" else 2,
                      "dash": "dash" if r["trace"] == "canonical" else "solid"},
            ), row=1, col=col)
            tova = next(x for x in b["rows"] if x["policy"] == "tova")
            fig.add_trace(go.Scatter(
                x=[budget - 8], y=[tova["retained_mass"]], mode="markers", legendgroup=r["trace"],
                showlegend=False, marker={"symbol": "triangle-left", "size": 10, "color": colors[r["trace"]]},
                hovertext=f"tova {tova['retained_mass']:.3f}",
            ), row=1, col=col)
        fig.update_xaxes(title_text="recent_window", row=1, col=col)
        fig.update_yaxes(range=[0.35, 1.0], row=1, col=col)
    fig.update_layout(
        width=1900, height=560, template="plotly_white", margin={"l": 60, "r": 20, "t": 60, "b": 90},
        legend={"orientation": "h", "x": 0.36, "y": -0.2},
        annotations=[*fig.layout.annotations, {
            "text": "triangles: tova at the same budget", "xref": "paper", "yref": "paper", "x": 1.0,
            "y": -0.2, "showarrow": False, "font": {"size": 12}}],
    )
    return fig


def screenshot(fig, png: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "fig.html"
        fig.write_html(html, include_plotlyjs="inline", full_html=True, config={"staticPlot": True})
        subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--window-size={fig.layout.width},{fig.layout.height}", f"--screenshot={png.resolve()}",
             "--virtual-time-budget=5000", html.as_uri()],
            check=True, capture_output=True, timeout=120,
        )


#: the members ``--add-vectors`` adds (kvsim.data.vectors), and the meta fields it takes from the recording
VECTOR_MEMBERS = ("values", "keys", "queries", "out_norms")


def add_vectors(path: Path, text: Path) -> dict:
    """Give the shipped dense trace at ``path`` its layer's vectors from a re-recording (module docstring).
    Returns what was done: sizes before and after, how the re-recorded attention compares, seconds."""
    import time

    from kvsim.data.files import atomic_write
    from kvsim.models.loading import file_sha256
    from kvsim.models.record import RecordConfig, record

    with np.load(path, allow_pickle=False) as z:
        shipped = {k: z[k] for k in z.files}
    meta = json.loads(str(shipped["meta"][()]))
    steps, layer = int(shipped["steps"]), int(meta["layer"])
    if file_sha256(text) != meta["source_sha256"]:
        raise SystemExit(f"--text {text}: its sha256 is not the trace's source_sha256 {meta['source_sha256']}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "again"
        record(RecordConfig(text, out, steps=steps, layers=[layer], store="dense", vectors=True,
                            source=meta["source"], licence=meta["licence"]), progress=None)
        with np.load(out / path.name, allow_pickle=False) as z:
            again = {k: z[k] for k in z.files}
    seconds = time.perf_counter() - t0
    old, new = shipped["attention_packed"], again["attention_packed"]
    if old.dtype != np.float16 or new.shape != old.shape:
        raise SystemExit(f"{path}: the re-recording is not the same layout ({new.shape} {new.dtype} against "
                         f"{old.shape} {old.dtype})")
    gap = np.abs(old.astype(np.float64) - new.astype(np.float64))
    step = np.spacing(np.maximum(np.abs(old), np.abs(new))).astype(np.float64)  # one float16 step at each weight
    if not (gap <= step).all():
        worst = int(np.argmax(gap - step))
        raise SystemExit(f"{path}: the re-recorded attention differs by more than one float16 step (weight {worst}: "
                         f"{float(old[worst])} against {float(new[worst])}); nothing written")
    new_meta = json.loads(str(again["meta"][()]))
    meta = {k: v for k, v in meta.items() if not k.startswith("rope_")}
    meta.update({k: v for k, v in new_meta.items() if k.startswith("rope_") or k == "head_dim"})
    meta["vectors"] = sorted(VECTOR_MEMBERS)
    meta["vectors_recorder"] = {
        **new_meta["recorder"], "by": "traces/real_traces.py --add-vectors",
        "attention": f"kept as shipped; the re-recording's differs in {int((gap > 0).sum())} of {gap.size} weights, by at "
                     f"most one float16 step ({float(gap.max()):.2g})"}
    arrays = {"attention_packed": old, "steps": shipped["steps"], **{k: again[k] for k in VECTOR_MEMBERS},
              "meta": np.array(json.dumps(meta))}
    before = path.stat().st_size
    atomic_write(path, lambda f: np.savez_compressed(f, **arrays))
    return {"trace": str(path), "bytes_before": before, "bytes_after": path.stat().st_size,
            "members": {k: [list(again[k].shape), str(again[k].dtype)] for k in VECTOR_MEMBERS},
            "attention_weights_differing": int((gap > 0).sum()), "attention_max_difference": float(gap.max()),
            "record_seconds": round(seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", type=Path, help="also render the picture to this PNG (needs chromium)")
    parser.add_argument("--add-vectors", type=Path, metavar="TRACE", help="instead: give this shipped trace its keys, "
                        "queries, values and out_norms from a re-recording (needs the record extra and --text)")
    parser.add_argument("--text", type=Path, help="with --add-vectors: the trace's text (its sha256 is checked)")
    args = parser.parse_args()
    if args.add_vectors is not None:
        if args.text is None:
            parser.error("--add-vectors needs --text, the file the trace was recorded from")
        json.dump(add_vectors(args.add_vectors, args.text), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    results = [measure(name) for name in TRACES]
    if args.png:
        screenshot(figure(results), args.png)
    json.dump(results, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

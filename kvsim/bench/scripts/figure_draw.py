"""What the browser pays to draw each of the benchmark steps' figures, part by part (issue 56 item 3).

    python kvsim/bench/scripts/figure_draw.py [--reps 7] [--only NAME[,NAME...]] [--save DIR]

Each figure is taken as the page receives it: the app's own script run in AppTest (a child process
per step, as ``browser_floor.py``'s curve) on the default view, the six-policy link, the shipped real
trace and the curve at budgets 1024 (the first paint, its coarse grid) and 256 (every window). It
prints each figure's bytes of JSON, then times Plotly itself drawing it in headless Chromium
(``Plotly.newPlot`` on a div as wide as the app's chart, until two frames have painted), and the
same figure without one part at a time: its key, its notes (titles included), its shapes, its
images, its markers' text, its hover, the linked axes. The variants are drawn in turn, ``--reps``
times each, so the machine's load falls on all of them alike; the table gives each one's median and
what leaving the part out saves. Nothing of Streamlit is in these times: they are the figure alone.

Plotly is the one the ``plotly`` package ships (``plotly/package_data/plotly.min.js``), not
Streamlit's bundle: the proportions, not the milliseconds, are what carry over.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import plotly
from checkout import this_checkout

from kvsim.bench import browser as bb
from kvsim.bench import checkout_env

ROOT = this_checkout(__file__)
#: the steps' links (``kvsim bench --browser``'s), and the curve at the default budget
LINKS = {
    "default": {},
    "six": {"policies": ",".join(bb.SIX_POLICIES)},
    "real": {"trace": bb.REAL_TRACE},
    "curve1024": {"budget": "1024", "view": "Choosing recent_window"},
    "curve256": {"view": "Choosing recent_window"},
}
#: one run of the app's script at a link (AppTest), printing its charts' specs as the page receives them,
#: one a line; it leaves at once (``os._exit``), not waiting for what it started in the background
SPECS = """import json, os, sys
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=300)
at.query_params.update(json.loads(sys.argv[2]))
at.run()
for chart in at.get("plotly_chart"):
    sys.stdout.write(chart.proto.spec.replace("\\n", " ") + "\\n")
sys.stdout.flush()
os._exit(0)
"""
#: the chart's width in the app's page at 1500 px (the kept view: the main column; the curve: 3 of 4 columns)
WIDTH = {"curve1024": 820, "curve256": 820}
PAGE = """<!doctype html><html><head><meta charset="utf-8"><script>{plotly}</script></head>
<body style="margin:0"><div id="box"></div></body></html>"""
DRAW = """async ([fig, width]) => {
  const box = document.getElementById('box');
  const div = document.createElement('div');
  div.style.width = width + 'px';
  box.appendChild(div);
  const t0 = performance.now();
  await Plotly.newPlot(div, fig.data, fig.layout, {responsive: false});
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const t = performance.now() - t0;
  Plotly.purge(div);
  box.removeChild(div);
  return t;
}"""


def specs(name: str) -> list[str]:
    """The figures' JSON of the link ``name`` as the app sends them."""
    out = subprocess.run([sys.executable, "-c", SPECS, str(ROOT / "app.py"), json.dumps(LINKS[name])],
                         env=checkout_env(), cwd=ROOT, check=True, capture_output=True, text=True, timeout=600)
    return [line for line in out.stdout.splitlines() if line.startswith("{")]


def _drop(fig: dict, part: str) -> dict:
    """The figure without ``part``."""
    fig = copy.deepcopy(fig)
    lay, data = fig["layout"], fig["data"]
    if part == "key":
        lay["showlegend"] = False
    elif part == "notes":
        lay["annotations"] = []
    elif part == "shapes":
        lay["shapes"] = []
    elif part == "images":
        fig["data"] = [t for t in data if t.get("type") != "image"]
    elif part == "marker text":
        for t in data:
            if t.get("mode", "").endswith("+text"):
                t["mode"] = t["mode"].removesuffix("+text")
    elif part == "hover":
        lay["hovermode"] = False
        for t in data:
            t["hoverinfo"] = "skip"
            t.pop("hovertemplate", None)
    elif part == "linked axes":
        for k, axis in lay.items():
            if k.startswith(("xaxis", "yaxis")) and isinstance(axis, dict):
                axis.pop("matches", None)
    elif part == "markers":
        for t in data:
            if t.get("type") == "scatter" and t.get("mode") == "lines+markers":
                t["mode"] = "lines"
    elif part == "dashes":
        for t in data:
            if isinstance(t.get("line"), dict):
                t["line"].pop("dash", None)
    return fig


PARTS = ("key", "notes", "shapes", "images", "marker text", "hover", "linked axes", "markers", "dashes")


@contextlib.asynccontextmanager
async def plotly_page():
    """A page of headless Chromium (Debian's, as ``kvsim bench --browser`` runs it) with Plotly loaded from the
    installed package, 1500 x 1250: where the figures are drawn (this script's and chart_mount.py's)."""
    from playwright.async_api import async_playwright

    plotly_js = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        page_file = Path(tmp) / "page.html"
        page_file.write_text(PAGE.format(plotly=plotly_js))
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=bb.CHROMIUM, args=bb.CHROMIUM_ARGS)
            try:
                page = await browser.new_page(viewport={"width": 1500, "height": 1250})
                await page.goto(page_file.as_uri())
                yield page
            finally:
                await browser.close()


async def draw_all(figs: dict[str, dict], reps: int) -> dict[str, dict[str, list[float]]]:
    variants = {name: {"as sent": fig, **{f"no {p}": _drop(fig, p) for p in PARTS if _drop(fig, p) != fig}}
                for name, fig in figs.items()}
    times: dict[str, dict[str, list[float]]] = {n: {v: [] for v in vs} for n, vs in variants.items()}
    async with plotly_page() as page:
        for name, vs in variants.items():  # once each, not counted: Plotly's own first-use costs
            for fig in vs.values():
                await page.evaluate(DRAW, [fig, WIDTH.get(name.split("#")[0], 1100)])
        for _ in range(reps):
            for name, vs in variants.items():
                for v, fig in vs.items():
                    times[name][v].append(await page.evaluate(DRAW, [fig, WIDTH.get(name.split("#")[0], 1100)]))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="draws of each variant (default: 7)")
    ap.add_argument("--only", default=",".join(LINKS), help=f"the links, of {', '.join(LINKS)} (default: all)")
    ap.add_argument("--save", type=Path, help="also write each figure's JSON here")
    args = ap.parse_args()
    figs = {}
    for name in args.only.split(","):
        for i, spec in enumerate(specs(name)):
            key = name if i == 0 else f"{name}#{i + 1}"
            figs[key] = json.loads(spec)
            fig = figs[key]
            images = sum(1 for t in fig["data"] if t.get("type") == "image")
            image_bytes = sum(len(t.get("source", "")) for t in fig["data"] if t.get("type") == "image")
            print(f"{key:12s} {len(spec):7d} bytes of JSON ({image_bytes} of them {images} images), "
                  f"{len(fig['data'])} traces, {len(fig['layout'].get('shapes', []))} shapes, "
                  f"{len(fig['layout'].get('annotations', []))} notes", flush=True)
            if args.save:
                args.save.mkdir(parents=True, exist_ok=True)
                (args.save / f"{key.replace('#', '_')}.json").write_text(spec)
    times = asyncio.run(draw_all(figs, args.reps))
    print(f"\nPlotly.newPlot to the second frame, ms, median of {args.reps} (what leaving the part out saves)")
    for name, vs in times.items():
        base = statistics.median(vs["as sent"])
        print(f"{name:12s} as sent {base:6.0f}  " + "  ".join(
            f"{v} {base - statistics.median(ts):+.0f}" for v, ts in vs.items() if v != "as sent"))


if __name__ == "__main__":
    main()

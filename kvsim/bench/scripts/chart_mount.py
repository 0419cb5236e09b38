"""What Streamlit's chart element adds to Plotly's own draw of each benchmark step's figure (issue 56 item 3).

    python kvsim/bench/scripts/chart_mount.py [--reps 5] [--only NAME[,NAME...]]

Streamlit 1.67's ``PlotlyChart`` element (its ``PlotlyChart.*.js`` chunk) does not draw a figure once. It
mounts the figure with ``Plotly.newPlot``; then an effect applies the theme again to a JSON copy of the
figure and hands it to ``Plotly.react``; then, on a chart with selections (``on_select``), an effect sets
``layout.clickmode``, ``hovermode`` and ``dragmode`` to what the selection mode asks for, where the figure
left them unset, and ``Plotly.react`` again: ``clickmode`` is a ``editType: "plot"`` attribute, so a change
of it redraws the whole figure. Last, Plotly's ``onUpdate`` hands the drawn figure back to the state
(``Plotly.react`` with the same objects).

This script replays that sequence on each step's figure as the app sends it (``figure_draw.py``'s AppTest
run), in headless Chromium with the ``plotly`` package's Plotly, timing each stage to the second painted
frame: ``frames`` (two frames, nothing drawn: the wait every stage includes), ``newPlot``, ``theme``
(again), ``modes`` (the selection modes; ``-`` where the figure already has them), ``onUpdate``; the last
column sums the stages after ``newPlot``, each less the two frames' wait. The figures are mounted in turn,
``--reps`` times, and the medians printed. The proportions carry over to the page, not the milliseconds
(Streamlit's bundle, its React work and the page's layout are not here).

The app now sends a selectable chart with those modes set (``kvsim.app.charts.selectable``). Each such
figure is also mounted without its ``clickmode`` (``NAME, no clickmode``: the figure as the app sent it
before), in the same turns, so the redraw it spares is measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys

from checkout import this_checkout
from figure_draw import LINKS, WIDTH, plotly_page

from kvsim.bench import checkout_env

ROOT = this_checkout(__file__)
#: one run of the app's script at a link (AppTest), printing each chart's spec and selection modes, one a line
SPECS = """import json, os, sys
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=300)
at.query_params.update(json.loads(sys.argv[2]))
at.run()
for chart in at.get("plotly_chart"):
    modes = [int(m) for m in chart.proto.selection_mode]
    sys.stdout.write(json.dumps({"spec": chart.proto.spec, "modes": modes}) + "\\n")
sys.stdout.flush()
os._exit(0)
"""
#: Streamlit's mount, stage by stage (its ``PlotlyChart`` element's effects, in their order); each stage's ms
MOUNT = """async ([fig, width, modes]) => {
  const frames = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const box = document.getElementById('box');
  const div = document.createElement('div');
  div.style.width = width + 'px';
  box.appendChild(div);
  const out = {};
  let t0 = performance.now();
  await frames();
  out.frames = performance.now() - t0;
  t0 = performance.now();
  await Plotly.newPlot(div, fig.data, fig.layout, {responsive: false});
  await frames();
  out.newPlot = performance.now() - t0;
  const again = JSON.parse(JSON.stringify({data: div.data, layout: div.layout}));
  t0 = performance.now();
  await Plotly.react(div, again.data, again.layout);
  await frames();
  out.theme = performance.now() - t0;
  // the selection modes: Streamlit's BOX = 1, LASSO = 2, POINTS = 0
  const points = modes.includes(0), boxed = modes.includes(1), lasso = modes.includes(2);
  if (modes.length) {
    const lay = fig.layout;
    const click = lay.clickmode || (points ? 'event+select' : 'none');
    const hover = lay.hovermode || 'closest';
    const drag = lay.dragmode || (points ? 'pan' : boxed ? 'select' : lasso ? 'lasso' : 'pan');
    const now = div.layout;
    if (now.clickmode !== click || now.hovermode !== hover || now.dragmode !== drag) {
      t0 = performance.now();
      await Plotly.react(div, div.data, {...div.layout, clickmode: click, hovermode: hover, dragmode: drag});
      await frames();
      out.modes = performance.now() - t0;
    }
  }
  t0 = performance.now();
  await Plotly.react(div, div.data, div.layout);
  await frames();
  out.onUpdate = performance.now() - t0;
  Plotly.purge(div);
  box.removeChild(div);
  return out;
}"""
STAGES = ("frames", "newPlot", "theme", "modes", "onUpdate")


def charts(name: str) -> list[dict]:
    """The charts of the link ``name`` as the app sends them: ``{"spec": JSON, "modes": [...]}``."""
    out = subprocess.run([sys.executable, "-c", SPECS, str(ROOT / "app.py"), json.dumps(LINKS[name])],
                         env=checkout_env(), cwd=ROOT, check=True, capture_output=True, text=True, timeout=600)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


async def mount_all(figs: dict[str, dict], reps: int) -> dict[str, dict[str, list[float]]]:
    times: dict[str, dict[str, list[float]]] = {n: {s: [] for s in STAGES} for n in figs}
    async with plotly_page() as page:
        for rep in range(reps + 1):  # the first round not counted: Plotly's own first-use costs
            for name, chart in figs.items():
                width = WIDTH.get(name.split("#")[0], 1100)
                out = await page.evaluate(MOUNT, [json.loads(chart["spec"]), width, chart["modes"]])
                for stage, ms in out.items():
                    if rep:
                        times[name][stage].append(ms)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="mounts of each figure (default: 5)")
    ap.add_argument("--only", default="default,six,real,curve1024", help=f"the links, of {', '.join(LINKS)}")
    args = ap.parse_args()
    figs = {}
    for name in args.only.split(","):
        for i, chart in enumerate(charts(name)):
            key = name if i == 0 else f"{name}#{i + 1}"
            figs[key] = chart
            fig = json.loads(chart["spec"])
            if chart["modes"] and fig["layout"].pop("clickmode", None) is not None:
                figs[f"{key}, no clickmode"] = {"spec": json.dumps(fig, separators=(",", ":")), "modes": chart["modes"]}
    times = asyncio.run(mount_all(figs, args.reps))
    print(f"Streamlit's mount of each figure, stage by stage, ms to the second frame, median of {args.reps}")
    print(f"{'figure':24s} {'bytes':>7s} " + " ".join(f"{s:>9s}" for s in STAGES) + "   after newPlot")
    for name, stages in times.items():
        med = {s: statistics.median(ts) if ts else None for s, ts in stages.items()}
        extra = sum(v - med["frames"] for s, v in med.items() if v is not None and s not in ("frames", "newPlot"))
        print(f"{name:24s} {len(figs[name]['spec']):7d} " + " ".join(
            f"{'-' if v is None else f'{v:.0f}':>9s}" for v in med.values()) + f"   +{extra:.0f}")


if __name__ == "__main__":
    main()

"""The proxy study's figure for docs/proxies.md, from the JSON that ``kvsim proxies --out`` writes:
per window sweep, the truth (open-loop KL) against recent_window beside retained mass and the best
value-aware proxy, each curve scaled to its sweep's range so their optima can be compared; rendered
by plotly in headless Chromium to a PNG (no kaleido here).

    PYTHONPATH=. python kvsim/bench/scripts/proxies_figure.py STUDY.json docs/proxies.png
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from checkout import this_checkout
from plotly.subplots import make_subplots

from kvsim.bench.browser.driver import CHROMIUM, CHROMIUM_ARGS
from kvsim.policykit.base import WINDOW

this_checkout(__file__)

SHOWN = ("kl_open", "retained_mass", "output_error")
COLOURS = {"kl_open": "#d62728", "retained_mass": "#1f77b4", "output_error": "#2ca02c"}
LABELS = {"kl_open": "KL (truth, open loop)", "retained_mass": "retained mass (flipped)",
          "output_error": "attention-output error"}


def figure(doc: dict, sweep: str = "h2o") -> go.Figure:
    rows = [r for r in doc["rows"] if r.get("sweep") == sweep]
    cells = sorted({(r["model"], r["text"], r["budget"]) for r in rows})
    cols = 4
    fig = make_subplots(rows=-(-len(cells) // cols), cols=cols, subplot_titles=[
        f"{m.split('-')[0]} {t.split('-')[0]} B{b}" for m, t, b in cells], vertical_spacing=0.09)
    for i, cell in enumerate(cells):
        mine = sorted((r for r in rows if (r["model"], r["text"], r["budget"]) == cell),
                      key=lambda r: r["params"][WINDOW])
        x = [r["params"][WINDOW] for r in mine]
        for key in SHOWN:
            y = np.array([r[key] for r in mine], dtype=float)
            y = -y if key == "retained_mass" else y  # every curve a loss: lower is better
            y = (y - y.min()) / (np.ptp(y) or 1.0)
            best = int(np.argmin(y))
            fig.add_scatter(x=x, y=y, mode="lines+markers", line=dict(color=COLOURS[key]), name=LABELS[key],
                            legendgroup=key, showlegend=i == 0, row=i // cols + 1, col=i % cols + 1,
                            marker=dict(size=[14 if j == best else 5 for j in range(len(x))],
                                        symbol=["star" if j == best else "circle" for j in range(len(x))]))
    fig.update_layout(width=1400, height=300 * (-(-len(cells) // cols)) + 130, margin=dict(l=40, r=20, t=130, b=40),
                      title=f"{sweep}: the truth and two proxies over recent_window, each scaled to its sweep "
                            "(0 = its best, marked by a star)", legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0))
    return fig


def main(study: str, out: str) -> None:
    from playwright.sync_api import sync_playwright

    doc = json.loads(Path(study).read_text())
    fig = figure(doc)
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "fig.html"
        fig.write_html(html, include_plotlyjs=True, full_html=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": fig.layout.width, "height": fig.layout.height})
            page.goto(html.as_uri())
            page.wait_for_selector(".main-svg")
            page.screenshot(path=out, full_page=True)
            browser.close()
    print(out)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("study", help="the JSON that `kvsim proxies --out` wrote")
    ap.add_argument("out", help="the PNG to write")
    a = ap.parse_args()
    main(a.study, a.out)

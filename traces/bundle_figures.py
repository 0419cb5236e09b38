"""The shipped bundle tuned per layer: the figures in REAL_TRACES.md ("All 18 layers") and the picture
docs/model-tune.png.

    python traces/bundle_figures.py                            # the tuning, as JSON on stdout
    python traces/bundle_figures.py --png docs/model-tune.png  # and the heatmap (headless chromium)

Needs only the core (no torch, no Dask): the bundle is files, the sweeps run on the fast engine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, nothing installed
from kvsim.analysis.tune import tune
from kvsim.data.catalog import resolve_bundle
from kvsim.views.model_figures import tune_heatmap

BUNDLE, POLICY, BUDGET = "gemma3-270m-heapq", "h2o", 256


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", type=Path, help="also render the heatmap to this PNG (needs chromium)")
    args = parser.parse_args()
    result = tune(resolve_bundle(BUNDLE), POLICY, BUDGET)
    if args.png:
        fig = tune_heatmap(result)
        fig.update_layout(width=1100)
        with tempfile.TemporaryDirectory() as tmp:
            html = Path(tmp) / "fig.html"
            fig.write_html(html, include_plotlyjs="inline", full_html=True, config={"staticPlot": True})
            subprocess.run(
                ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--window-size={fig.layout.width},{fig.layout.height}", f"--screenshot={args.png.resolve()}",
                 "--virtual-time-budget=5000", html.as_uri()],
                check=True, capture_output=True, timeout=120,
            )
    doc = result.to_dict()
    doc.pop("run")  # timings vary from run to run; the figures do not
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

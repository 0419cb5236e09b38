"""Figure builders for the app: pure functions, replay results and traces in, Plotly figures out.

One module per view: ``kept`` (the kept positions, pooled by ``pooling``), ``scores`` (the cache's
scores at one step), ``curve`` (retained mass and recall against recent_window), ``trace`` (the
attention matrix), ``tables`` (the same as frames for export), ``common`` (their shared colours and a
replay's label). Nothing here imports Streamlit, so every figure is built and tested without a
browser; pandas and plotly.express load only inside the builders that use them. Images reach Plotly
as PNGs made from uint8 arrays, never as booleans or lists.

What a trace is made of (``TraceFeatures`` and the functions that measure it) lives in the analysis
layer, ``kvsim.analysis.features``, and what a reader chose on a figure in ``kvsim.views.selection``;
the names the app calls are re-exported here, so ``figures.<name>`` reaches every one of them.
"""

from ...analysis.features import HeavyFate, TraceFeatures, curve_peak, heavy_fates, trace_features, trace_features_cached
from ..selection import Region, selected_recent_window, selected_region
from .common import policy_label
from .curve import Line, coinciding, recent_window_curve
from .kept import age_span, fit_key, kept_heatmap
from .pooling import difference_counts, kept_image, panel_layers
from .scores import eviction_threshold, score_distribution, score_name, score_snapshot
from .tables import per_step_table, sweep_table
from .trace import attention_image, trace_matrix

__all__ = [
    "HeavyFate", "Line", "Region", "TraceFeatures", "age_span", "attention_image", "coinciding", "curve_peak",
    "difference_counts", "eviction_threshold", "fit_key", "heavy_fates", "kept_heatmap", "kept_image", "panel_layers",
    "per_step_table", "policy_label", "recent_window_curve", "score_distribution", "score_name", "score_snapshot",
    "selected_recent_window", "selected_region", "sweep_table", "trace_features", "trace_features_cached",
    "trace_matrix",
]

"""The truth beside the proxy in the recent_window views: what the model itself loses (its KL, every
layer's cache evicted by the policy) at the windows measured, the proxy's recommended window beside
the truth's best, and one sentence computed from the two.

Truth comes from truth documents (``kvsim.models.truth.save_truth``): shipped ones
(``traces/truth-*.json``, for the shipped bundle's recording) and those measured here (the disk
cache's ``truth/``). A document matches a trace when it names the same model and the same text (by
sha256), as the trace's meta or its bundle's manifest does. Plain JSON and plotly: the app shows
shipped truth without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from ..data import catalog

#: a proxy's recommendation "agrees" with the truth when it costs at most this much more KL
AGREE = 0.05
#: the figure the truth is read by
KEY = "kl_open"


@dataclass(frozen=True)
class Truth:
    """The truth of one recording for one policy and budget: ``windows`` with their ``kl`` (and
    ``delta_nll``), where it came from, and the document's meta (model, text, steps, mode)."""

    windows: tuple[int, ...]
    kl: tuple[float, ...]
    delta_nll: tuple[float, ...]
    source: str
    meta: dict

    @property
    def best(self) -> int:
        return self.windows[int(np.argmin(self.kl))]

    def at(self, window: int) -> tuple[int, float]:
        """The measured window nearest ``window`` (the smaller on a tie) and its KL."""
        i = int(np.argmin([abs(w - window) + (0.1 if w > window else 0) for w in self.windows]))
        return self.windows[i], self.kl[i]


def recording(meta: dict) -> tuple[str, str] | None:
    """(model, text sha256) a trace or manifest names, or None when it names neither."""
    text = meta.get("text") if isinstance(meta.get("text"), dict) else {}
    sha = text.get("sha256") or meta.get("source_sha256")
    model = meta.get("model")
    return (str(model), str(sha)) if model and sha else None


def truth_for(meta: dict, policy: str, budget: int) -> Truth | None:
    """The truth for the recording ``meta`` names, ``policy`` at ``budget`` over recent_window (the
    document with the most windows measured; at least 3), or None."""
    who = recording(meta)
    if who is None:
        return None
    found = []
    from ..models.truth import documents  # here, not at the top: the app's page does not load it until asked

    for path, doc in documents():
        m = doc.get("meta") or {}
        if (str(m.get("model")), str(m.get("text_sha256"))) != who:
            continue
        rows = sorted((r for r in doc["results"] if r.get("policy") == policy and r.get("budget") == budget
                       and KEY in r and "recent_window" in r), key=lambda r: r["recent_window"])
        if len(rows) >= 3:
            found.append(Truth(tuple(int(r["recent_window"]) for r in rows), tuple(float(r[KEY]) for r in rows),
                               tuple(float(r.get("delta_nll_open", np.nan)) for r in rows),
                               "shipped" if path.parent == catalog.TRACES_DIR else "measured here", m))
    return max(found, key=lambda t: len(t.windows)) if found else None


def verdict(truth: Truth, proxy_window: int) -> dict:
    """The figures the sentence states: the proxy's window, the measured window nearest it and the
    KL there, the truth's best window and KL, and what trusting the proxy costs (``cost``: KL there
    over the best, minus 1)."""
    near, kl_near = truth.at(proxy_window)
    best = truth.best
    kl_best = min(truth.kl)
    cost = kl_near / kl_best - 1 if kl_best > 0 else 0.0
    return {"proxy_window": int(proxy_window), "measured_window": int(near), "kl_at_proxy": float(kl_near),
            "truth_window": int(best), "kl_best": float(kl_best), "cost": float(cost), "agree": cost <= AGREE}


def sentence(truth: Truth, proxy_window: int, proxy: str = "retained mass") -> str:
    """Whether the proxy's recommended window and the truth's best agree, and what trusting the
    proxy costs, in one sentence made from ``verdict``'s figures."""
    v = verdict(truth, proxy_window)
    m = truth.meta
    what = (f"the model's KL ({m.get('steps')} steps of {m.get('text')}, every layer evicted, {m.get('mode', 'open')} "
            f"loop, {len(truth.windows)} windows measured)")
    at = (f"at {v['measured_window']}" if v["measured_window"] == v["proxy_window"]
          else f"at {v['measured_window']}, the measured window nearest it,")
    head = "agree" if v["agree"] else "disagree"
    return (f"**Proxy and truth {head}.** {proxy.capitalize()} recommends recent_window {v['proxy_window']}; {what} is "
            f"least at {v['truth_window']} (KL {v['kl_best']:.4f}). {at.capitalize()} KL is {v['kl_at_proxy']:.4f}: "
            f"trusting {proxy} costs {100 * v['cost']:+.0f}% KL.")


def truth_figure(truth: Truth, proxy_window: int, proxy: str = "retained mass", height: int = 300,
                 others: dict[str, int] | None = None) -> go.Figure:
    """KL against recent_window, the truth's best marked (a star) and the proxy's recommendation (a
    dashed line at its window, a ring on the measured window nearest it); ``others``: more proxies'
    picks (label -> window), each a diamond on the truth at that window."""
    v = verdict(truth, proxy_window)
    fig = go.Figure()
    fig.add_scatter(x=list(truth.windows), y=list(truth.kl), mode="lines+markers", name="KL (the truth)",
                    line=dict(color="#d62728", width=2), marker=dict(size=6))
    fig.add_scatter(x=[v["truth_window"]], y=[v["kl_best"]], mode="markers", name=f"truth's best: {v['truth_window']}",
                    marker=dict(symbol="star", size=16, color="#d62728", line=dict(color="black", width=1)))
    fig.add_scatter(x=[v["measured_window"]], y=[v["kl_at_proxy"]], mode="markers",
                    name=f"{proxy} recommends {v['proxy_window']}",
                    marker=dict(symbol="circle-open", size=16, color="#111111", line=dict(width=3)))
    fig.add_vline(x=v["proxy_window"], line=dict(color="#111111", dash="dash", width=1))
    for label, window in (others or {}).items():
        near, kl = truth.at(window)
        fig.add_scatter(x=[near], y=[kl], mode="markers", name=f"{label} recommends {window}",
                        marker=dict(symbol="diamond-open", size=14, color="#2ca02c", line=dict(width=3)))
    fig.update_layout(height=height, margin=dict(l=60, r=20, t=40, b=40), title=dict(
        text=f"What the model loses: KL against recent_window ({truth.source})", font=dict(size=14)),
        xaxis_title="recent_window", yaxis_title="KL (nats per token)", legend=dict(orientation="h", y=-0.25))
    return fig


__all__ = ["AGREE", "Truth", "recording", "sentence", "truth_figure", "truth_for", "verdict"]

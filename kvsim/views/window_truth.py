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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from ..analysis.windows import best_of
from ..data import catalog
from ..policykit.base import WINDOW

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
    policy: str = "h2o"
    budget: int | None = None

    @property
    def best(self) -> int:
        return self.windows[best_of(self.kl, -1)]  # a loss: the least KL, the smallest window of equal ones

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
                       and KEY in r and WINDOW in r), key=lambda r: r[WINDOW])
        if len(rows) >= 3:
            found.append(Truth(tuple(int(r[WINDOW]) for r in rows), tuple(float(r[KEY]) for r in rows),
                               tuple(float(r.get("delta_nll_open", np.nan)) for r in rows),
                               "shipped" if path.parent == catalog.TRACES_DIR else "measured here", m, policy, budget))
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


@dataclass(frozen=True)
class ProxyPick:
    """A proxy's recommended window and what it was read from, as every truth sentence names it: two
    windows from different layers, steps or rules are different answers, and say so (issue 31, item 4)."""

    window: int
    #: who picks, as the sentence's headline names it: "L11's own window", "One window for all layers"
    subject: str
    #: the measure, the layers and steps it was read over, and the rule: "retained mass of L11 alone over
    #: its 4096 steps (the smallest window within 0.005 of its best)"
    what: str
    #: the figure's label for its mark
    label: str = "retained mass"


def layer_pick(window: int, trace_label: str, steps: int, tolerance: float, proxy: str = "retained mass",
               rule: str | None = None) -> ProxyPick:
    """One trace's own pick (the curve view's): ``trace_label``'s ``proxy`` over its ``steps``."""
    rule = rule or f"the smallest window within {tolerance:g} of its best"
    return ProxyPick(window, f"{trace_label}'s own window" if proxy == "retained mass" else f"{proxy.capitalize()} on {trace_label}",
                     f"{proxy} of {trace_label} alone over its {steps} steps ({rule})",
                     proxy if proxy != "retained mass" else f"retained mass of {trace_label}")


def model_wide_pick(result, steps: int) -> ProxyPick:
    """The one window for all layers that retained mass picks from a bundle's tuning (``kvsim.analysis.tune``,
    over the bundle's ``steps``): the window of the mean curve over every traced layer and KV head, the
    window the model view draws as "one window for all layers"."""
    one = result.model_wide()["one_window"]
    layers = len({t.layer for t in result.traces})
    return ProxyPick(int(one["recommended_window"]), "One window for all layers",
                     f"retained mass averaged over the {layers} layers of {result.source} ({steps} steps; the smallest "
                     f"window within {result.tolerance:g} of the average's best)", "retained mass, one window for all layers")


def compared(truth: Truth) -> str:
    """What the truth measured, named as every sentence states it: layers, policy, budget, steps, rule."""
    m = truth.meta
    budget = f"budget {truth.budget}" if truth.budget is not None else "the budget"
    return (f"the model's KL with every layer's cache held to {budget} by {truth.policy} at one recent_window for all "
            f"layers ({m.get('steps')} steps of {m.get('text')}, {m.get('mode', 'open')} loop, "
            f"{len(truth.windows)} windows measured)")


def sentence(truth: Truth, pick: ProxyPick) -> str:
    """Whether the proxy's recommended window and the truth's best agree, and what trusting the
    proxy costs, in one sentence made from ``verdict``'s figures, naming what each side was measured
    over (``pick.what``, ``compared``)."""
    v = verdict(truth, pick.window)
    at = (f"at {v['measured_window']}" if v["measured_window"] == v["proxy_window"]
          else f"at {v['measured_window']}, the measured window nearest it,")
    head = "agree" if v["agree"] else "disagree"
    return (f"**{pick.subject}: proxy and truth {head}.** {pick.what[0].upper() + pick.what[1:]} recommends recent_window "
            f"{v['proxy_window']}; {compared(truth)} is least at {v['truth_window']} (KL {v['kl_best']:.4f}). "
            f"{at.capitalize()} KL is {v['kl_at_proxy']:.4f}: trusting this pick costs {100 * v['cost']:+.0f}% KL.")


def truth_figure(truth: Truth, pick: ProxyPick, height: int = 300, others: Sequence[ProxyPick] = ()) -> go.Figure:
    """KL against recent_window, the truth's best marked (a star) and the proxy's recommendation (a
    dashed line at its window, a ring on the measured window nearest it); ``others``: more proxies'
    picks, each a diamond on the truth at that window."""
    proxy_window, proxy = pick.window, pick.label
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
    for other, colour in zip(others, ("#2ca02c", "#9467bd", "#8c564b"), strict=False):
        near, kl = truth.at(other.window)
        fig.add_scatter(x=[near], y=[kl], mode="markers", name=f"{other.label} recommends {other.window}",
                        marker=dict(symbol="diamond-open", size=14, color=colour, line=dict(width=3)))
    fig.update_layout(height=height, margin=dict(l=60, r=20, t=40, b=40), title=dict(
        text=f"What the model loses: KL against recent_window ({truth.source})", font=dict(size=14)),
        xaxis_title=WINDOW, yaxis_title="KL (nats per token)", legend=dict(orientation="h", y=-0.25))
    return fig


__all__ = ["AGREE", "ProxyPick", "Truth", "compared", "layer_pick", "model_wide_pick", "recording", "sentence", "truth_figure",
           "truth_for", "verdict"]

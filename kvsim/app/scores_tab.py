"""The cumulative-score view: what each scoring policy (h2o, scissorhands, ...) holds at the sidebar's step, and
for ``learned`` the weights its score is made of."""

from __future__ import annotations

import streamlit as st

import kvsim
from kvsim.policykit import registry
from kvsim.views import figures, story

from .controls import Settings
from .downloads import html_button, stem
from .memo import cached_features, kept_history, replays


def score_view(trace: kvsim.Trace, settings: Settings) -> None:
    features = cached_features(trace)
    scoring = [spec for spec in settings.runs if registry.keeps_scores(spec.name)]
    st.markdown(story.score_text(features, scoring[0].name if scoring else "h2o"))
    if not scoring:
        names = ", ".join(registry.score_keepers())
        st.info(f"None of the chosen policies keeps a score. Add one of: {names}.")
        return
    step = settings.step
    for spec, result in zip(scoring, replays(trace, scoring, scores=True), strict=True):
        name = spec.name
        fig = figures.score_distribution(result, step, features)
        st.plotly_chart(fig, key=f"score_{name}")
        html_button(f"{name} scores at step {step} (HTML)", fig, f"{stem(trace)}-{name}-scores-{step}.html", f"html_score_{name}")
        if name == "learned":
            _learned_weights()
            _learned_beside(trace, settings)


def _learned_weights() -> None:
    """What the learned policy's score looks at: its weights, one bar per feature (docs/learned.md)."""
    from kvsim.policies.learned import WeightsError, default_weights
    from kvsim.views.learned import weights_figure

    try:
        weights = default_weights()
    except WeightsError as e:
        st.warning(str(e))
        return
    st.plotly_chart(weights_figure(weights), key="learned_weights")
    st.caption("The learned score is a weighted sum of these features, each standardised; the lowest score outside "
               "the recent window is evicted. Fitted by `kvsim learn` to the exact optimum (docs/learned.md).")


def _learned_beside(trace: kvsim.Trace, settings: Settings) -> None:
    """The learned policy's kept positions beside the optimum's and h2o's at the sidebar's budget and step: which
    positions each keeps that the other two do not, and how much of the optimum's cache each keeps over the run."""
    from kvsim.views.learned import BESIDE, beside_sentence, kept_beside, kept_beside_figure

    specs = {n: settings.specs.get(n) for n in BESIDE}
    if lacking := [f"{n}: {s}" for n, s in specs.items() if isinstance(s, str) or s is None]:
        st.info("The learned policy beside the optimum and h2o is not drawn here. " + " ".join(map(str, lacking)))
        return
    b = kept_beside({n: kept_history(trace, spec) for n, spec in specs.items()}, settings.step)
    st.plotly_chart(kept_beside_figure(b), key="learned_beside")
    st.caption(beside_sentence(b))

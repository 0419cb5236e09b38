"""The cumulative-score view: what each scoring policy (h2o, scissorhands, ...) holds at the sidebar's step, and
for ``learned`` the weights its score is made of."""

from __future__ import annotations

import streamlit as st

import kvsim
from kvsim.views import figures, story

from .controls import Settings
from .downloads import html_button, stem
from .memo import cached_features, replays


def score_view(trace: kvsim.Trace, settings: Settings) -> None:
    features = cached_features(trace)
    scoring = [spec for spec in settings.runs if getattr(kvsim.POLICIES[spec.name], "keeps_scores", False)]
    st.markdown(story.score_text(features, scoring[0].name if scoring else "h2o"))
    if not scoring:
        names = ", ".join(n for n, c in kvsim.POLICIES.items() if getattr(c, "keeps_scores", False))
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

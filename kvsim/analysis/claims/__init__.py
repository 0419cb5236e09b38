"""The claims ledger: every checkable claim of the two policy cards, measured on a trace.

Each ``Claim`` quotes the card's words, says how they are checked, and carries the app view (as URL
query parameters) that shows them. ``ledger(trace)`` measures every claim on one trace and returns
one record per claim with a verdict:

- ``holds`` / ``fails``: measured, and the figures say which;
- ``not applicable``: the claim is about something this trace is not (an exact figure of the
  canonical trace, measured on a real one) or about an implementation this project is not; the
  figures are still measured where they can be, and the note says why they do not decide it;
- ``not measured``: checking it needs something this project does not have yet; the note says what.

Scopes: ``canonical`` claims pin a figure of the canonical trace (``not applicable`` elsewhere);
``trace`` claims are structural (sinks matter, h2o against streaming_llm, where the gain saturates)
and are decided on every trace; ``policy`` claims are about a policy's mechanics and are decided on
the card's own small vector (the same on every trace); ``model`` claims need a language model's
output quality, which attention traces do not carry.

The package, in the order a claim is made and measured: ``measure`` (verdicts, tolerances,
``Claim``, ``Measurer`` and the helpers every check shares), ``h2o`` and ``sliding_window`` (each
card's checks), ``cards`` (the claims themselves, as data) and ``ledger`` (measuring them all on a
trace, and the ledger as a DataFrame or as text).

``python -m kvsim claims [--trace NAME] [--json]`` prints the ledger; ``ledger_frame`` gives it to
the app as a DataFrame.
"""

from .cards import CLAIMS
from .ledger import ledger, ledger_frame, render_ledger
from .measure import ALIKE, BUDGET, SCOPES, VERDICTS, Claim, Measurer
from .sliding_window import SHARP_PPL_RATIO

__all__ = ["ALIKE", "BUDGET", "CLAIMS", "SCOPES", "SHARP_PPL_RATIO", "VERDICTS", "Claim", "Measurer", "ledger", "ledger_frame",
           "render_ledger"]

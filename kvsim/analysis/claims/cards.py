"""The claims of the two policy cards, as data: each card's words quoted as written, its scope, what
is measured, the app view that shows it (URL query parameters) and the check that decides it."""

from __future__ import annotations

from ...policies import POLICIES
from ...policykit import registry
from ...policykit.base import WINDOW
from . import h2o as h
from . import sliding_window as sw
from .measure import BUDGET, Claim, check_cost_not_measured, check_deterministic


def _view(view: str, **params) -> dict:
    out = {"view": view, "trace": "{trace}", "budget": BUDGET}
    out.update({k: (",".join(v) if isinstance(v, (list, tuple)) else v) for k, v in params.items()})
    return out


KEPT, SCORES, CURVE, TRACE, LAB = "Kept positions", "Cumulative scores", "Choosing recent_window", "The trace", "Policy lab"
QUALITY = "Proxy against truth"

CLAIMS: list[Claim] = [
    Claim("h2o-recall-beats-attention-blind", "h2o",
          "On the canonical trace it recovers more of the top-32 attended positions than any policy here that does "
          "not read attention.", "canonical",
          "top-32 recall at budget 256: h2o (recent_window 32, the default) against every registry policy that "
          "neither reads attention nor reads the whole trace (sliding_window, streaming_llm)",
          _view(KEPT, policies=["sliding_window", "streaming_llm", "h2o"], recent_window=32), h.check_h2o_recall_vs_blind),
    Claim("h2o-32-less-mass-than-streaming", "h2o",
          "at the default of 32 on a trace whose recency band is 64 wide, this policy retains less attention mass "
          "than a much simpler one", "trace",
          "retained mass at budget 256: h2o at recent_window 32 against streaming_llm (4 sinks)",
          _view(CURVE, curve_policy="h2o", policies=["streaming_llm", "h2o"], recent_window=32), h.check_h2o_32_less_mass),
    Claim("h2o-33-to-64-lose", "h2o",
          "At recentWindow = 32, positions that are 33 to 64 steps old are unprotected and must compete on "
          "cumulative score: against attention sinks and against heavy hitters from earlier epochs that have been "
          "accumulating for thousands of steps. They lose.", "trace",
          "of the attention on positions 33..64 steps old (steps t > 64), the share h2o at 32 still holds",
          _view(KEPT, policies=["streaming_llm", "h2o"], recent_window=32), h.check_h2o_33_64_lose),
    Claim("h2o-64-beats-on-both", "h2o", "At 64 it beats it on both metrics at once.", "trace",
          "retained mass and top-32 recall at budget 256: h2o at recent_window 64 against streaming_llm",
          _view(CURVE, curve_policy="h2o", policies=["streaming_llm", "h2o"], recent_window=64), h.check_h2o_64_beats),
    Claim("h2o-saturates-at-64", "h2o",
          "The gain saturates at exactly 64, the trace’s span, which is what identifies the window width as the "
          "cause rather than something else.", "trace",
          "h2o's retained mass over recent_window 8..192 (step 8) at budget 256: the argmax, and whether any window "
          "beats 64 by more than 0.001",
          _view(CURVE, curve_policy="h2o", policies=["h2o"], recent_window=64), h.check_h2o_saturates),
    Claim("h2o-band-holds-0.55", "h2o",
          "The canonical trace puts 0.55 of its attention on the most recent 64 positions.", "canonical",
          "mean share of each row (t > 64) on the newest 64 positions", _view(TRACE), h.check_band_share),
    Claim("h2o-streaming-0.7367", "h2o", "At 32 this policy retains less mass than streaming-llm’s 0.7367.",
          "canonical", "streaming_llm's retained mass at budget 256 (the comparison itself is h2o-32-less-mass-than-streaming)",
          _view(KEPT, policies=["streaming_llm", "h2o"], recent_window=32), h.check_streaming_figure),
    Claim("h2o-scissorhands-within-a-hundredth", "h2o",
          "On the canonical trace the two land within a hundredth of each other, because that workload’s heavy "
          "hitters hold their weight for a whole 512-step epoch and so score well under either rule.", "canonical",
          "retained mass at budget 256 of h2o and scissorhands at recent_window 32 and at 64",
          _view(CURVE, curve_policy="scissorhands", policies=["h2o", "scissorhands"], recent_window=32),
          h.check_within_hundredth),
    Claim("h2o-heavy-hitters-hold-an-epoch", "h2o",
          "that workload’s heavy hitters hold their weight for a whole 512-step epoch", "canonical",
          "each generator-declared heavy hitter: the share of its 512 live steps on which it clears 1/256 of the "
          "row, and its mean weight live against the 512 steps after", _view(TRACE), h.check_heavy_hitters_epoch),
    Claim("h2o-defends-a-stale-spike", "h2o",
          "a position that takes almost the whole of the first two steps and nearly nothing after has the highest "
          "score of any position here and a single vote there, so this policy defends it and that one evicts it.",
          "policy", "the card's vector at budget 4, recent_window 2: h2o's scores, scissorhands' votes and victims "
          "at the first eviction", {"view": LAB, "lab_preset": "h2o vs scissorhands"}, h.check_h2o_vector),
    Claim("h2o-ties-lower-position", "h2o",
          "Tie-breaking. Equal scores evict the lower position. Victims are returned in ascending position order, "
          "not in the order they were chosen.", "policy",
          "two positions tied at exactly 0.25 (the lower goes); three victims chosen at once (ascending)",
          {"view": LAB, "lab_preset": "h2o vs scissorhands"}, h.check_h2o_ties),
    Claim("h2o-float64-scores", "h2o",
          "Scores accumulate in float64 while the weights arrive as float32. Four thousand float32 additions would "
          "lose low-order bits that the eviction comparison then depends on.", "policy",
          "4,000 float32 weights added to one position's score, against the float64 and the float32 sums",
          _view(SCORES, policies=["h2o"], recent_window=32), h.check_h2o_float64),
    Claim("h2o-refuses-window-at-budget", "h2o", "recentWindow >= budget is refused", "policy",
          "make_policy('h2o', budget=8, recent_window=8) raises ValueError naming recent_window",
          {"view": LAB}, h.check_h2o_refuses_window),
    Claim("h2o-recent-window-load-bearing", "h2o",
          "A token generated this step has accumulated nothing, so without protection it would be the first thing "
          "evicted every time and the cache would never advance.", "trace",
          "h2o at recent_window 0, budget 256: the share of eviction steps whose victim is the newest position",
          {"view": LAB, "lab_preset": "h2o recent_window 0 pitfall"}, h.check_h2o_window_load_bearing),
    Claim("h2o-one-victim-per-step", "h2o", "in steady state exactly one position goes per step", "trace",
          "victims per step of h2o (recent_window 32, budget 256) after the cache first fills",
          _view(KEPT, policies=["h2o"], recent_window=32), h.check_h2o_one_victim),
    Claim("h2o-deterministic", "h2o", "The Rng is accepted at construction and never used: this policy is entirely "
          "deterministic.", "policy", "the same steps under two different rngs give the same victims",
          {"view": LAB}, check_deterministic("h2o", {WINDOW: 2})),
    Claim("h2o-null-attention", "h2o",
          "A null attn is read as “no information this step” and leaves every score unchanged, rather than as a "
          "vector of zeroes.", "policy", "scores before and after a step with attn=None",
          {"view": LAB}, h.check_h2o_null_attn),
    Claim("h2o-space", "h2o", "O(budget) space: per slot, 4 bytes of position, 8 of score and 1 of eviction scratch, "
          "so about 6.7 KB at the default budget.", "policy",
          "the card's arithmetic, and the bytes kvsim's h2o actually allocates per slot", {"view": LAB}, h.check_h2o_space),
    Claim("h2o-cost-per-step", "h2o", "The per-step cost is O(kept), against O(1) for streaming-llm", "policy",
          "not timed (see the note)", {"view": LAB}, check_cost_not_measured),
    Claim("sw-retains-most-mass", "sliding_window",
          "So keeping only recent tokens still retains most of the attention mass.", "trace",
          "sliding_window's retained mass at budget 256; most = over half",
          _view(KEPT, policies=["sliding_window"]), sw.check_sw_most_mass),
    Claim("sw-quarter-looks-alike", "sliding_window",
          "At a budget of a quarter of the sequence, every policy in this domain looks alike.", "trace",
          "retained mass of every online registry policy that reads attention or nothing (defaults) at budget T/4; alike = all within 0.01",
          {"view": KEPT, "trace": "{trace}", "budget": "{quarter}",
           "policies": ",".join(n for n in registry.online() if not POLICIES[n].reads)}, sw.check_sw_quarter),
    Claim("sw-0.7367-against-0.5966", "sliding_window",
          "On the canonical trace at a budget of 256 it retains 0.7367 of the attention mass against this "
          "policy’s 0.5966", "canonical", "retained mass at budget 256 of streaming_llm and sliding_window",
          _view(KEPT, policies=["sliding_window", "streaming_llm"]), sw.check_sw_figures),
    Claim("sw-gap-is-the-sinks", "sliding_window",
          "the entire gap being the attention sinks this policy throws away first.", "trace",
          "streaming_llm minus sliding_window at budget 256, against the sinks' mass sliding_window loses and the "
          "mass of the 4 slots the sinks cost streaming_llm",
          _view(KEPT, policies=["sliding_window", "streaming_llm"]), sw.check_sw_gap_is_sinks),
    Claim("sw-evicts-sinks-first", "sliding_window",
          "This policy evicts them before anything else, purely because they are the oldest thing it holds", "trace",
          "the first four victims of sliding_window at budget 256", _view(KEPT, policies=["sliding_window"]),
          sw.check_sw_sinks_first),
    Claim("sw-streaming-strictly-better", "sliding_window",
          "streaming-llm is the same ring buffer plus four pinned positions and is strictly better.", "trace",
          "retained mass of both at budgets 8..2048 (powers of two below T); recall reported alongside",
          _view(CURVE, policies=["sliding_window", "streaming_llm"]), sw.check_sw_streaming_better),
    Claim("sw-deprived-degrades-sharply", "sliding_window",
          "a model deprived of them degrades sharply rather than gracefully.", "model",
          "Gemma-3-270M's perplexity on heapq.py, closed-loop decoding, every layer's cache held to the budget by "
          "sliding_window and by streaming_llm (shipped measurements, traces/quality-heapq.json)",
          _view(QUALITY, budget=64),
          sw.check_deprived),
    Claim("sw-distinguishing-vector", "sliding_window",
          "this one evicts positions 0, 1 and 2 in turn, and that one keeps them and evicts 4 instead.", "policy",
          "the card's vector: budget 5, steps 1..8, both policies", {"view": LAB,
                                                                      "lab_preset": "sliding_window vs streaming_llm"},
          sw.check_sw_vector),
    Claim("sw-budget-one", "sliding_window",
          "A budget of 1 is legitimate, keeping only the newest token, and a vector covers it. Zero is refused",
          "policy", "budget 1 over 11 steps; budget 0 raises ValueError naming budget", {"view": LAB},
          sw.check_sw_budget_one),
    Claim("sw-never-reads-attention", "sliding_window",
          "Some serving stacks do not expose them per step, and this policy needs nothing but the position.", "trace",
          "the first 600 steps of the trace at budget 64, with the trace's attention and with None: same victims",
          _view(KEPT, policies=["sliding_window"]), sw.check_sw_blind),
    Claim("sw-space", "sliding_window", "O(budget) space: budget + 1 positions of uint32_t in C, so 2,052 bytes at "
          "the default plus the struct.", "policy", "the card's arithmetic, and the bytes kvsim's ring allocates",
          {"view": LAB}, sw.check_sw_space),
    Claim("sw-cost-per-step", "sliding_window", "O(1) time per decode step and per eviction.", "policy",
          "not timed (see the note)", {"view": LAB}, check_cost_not_measured),
]

"""Expected attention: evict the held position that the next queries are expected to attend to least,
weighted by its value's norm.

Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution", 2025 (arXiv:2510.00636); NVIDIA kvpress's ``ExpectedAttentionPress``
(kvpress/presses/expected_attention_press.py), whose definition this follows:

1. the recent queries, taken before RoPE (``u_i``, position ``i``), are modelled as a Gaussian: mean
   ``mu`` and covariance ``Sigma = (1/N) sum_i (u_i - mu)(u_i - mu)^T`` (over N queries, not N - 1);
2. the next ``future_positions`` queries sit at positions ``t + 1 .. t + future_positions``; their
   rotation is replaced by its average ``Rbar = mean_j R_j`` (a scaled rotation per frequency pair), so
   the future query is ``N(Rbar mu, Rbar Sigma Rbar^T)``;
3. for a key ``k`` (post-RoPE, as the cache holds it) ``E[exp(q.k / sqrt(d))] = exp(k.mu'/sqrt(d) +
   k^T Sigma' k / (2 d))``: the logit is the exponent, softmaxed over the held keys, per query head;
4. the query heads sharing the KV head are averaged (the press's ``scores.mean`` over the group), and
   the result multiplied by ``|v|_2`` (``use_vnorm``; epsilon 0).

The press runs once, on the prompt; here it runs at every decode step (docs/domain.md, "The
harness"): after position t is admitted, the statistics come from the queries of the last
``query_window`` positions seen (t included), leaving out positions below ``sinks`` as the press
leaves out the first ``n_sink`` hidden states; the future positions are counted from t + 1 (the press's
``q_len``: the next position to come). The first ``sinks`` positions are never evicted (the press pads
them with the highest score); every other held position is scored, the newest included (its key is
known, so unlike TOVA's newcomer it has a score). The lowest score goes; equal scores evict the lower
position. ``d`` in the formula is the head dimension, as in the press, whatever scale the model uses.

The recorded queries are post-RoPE (``kvsim.data.vectors``): query i is turned back by ``R_{-i}`` with
the model's RoPE, which the trace's meta carries (``rope``: the inverse frequencies and the layout,
written by ``kvsim record --store qk``); a trace without it is refused in one line. A RoPE
``attention_scaling`` cancels: it scales ``mu`` by s and ``Sigma`` by s^2 either way.

``attn`` is never read. Deterministic: ``rng`` is never used. This policy has no engine kernel: the
reference replays it (its cost per step is O(budget x window x head dim x heads); docs/scorers.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..data.trace import TraceError
from .base import DEFAULT_BUDGET, Display, Param, ParamError, SlotPolicy
from .streaming_llm import SINKS

QUERY_WINDOW = Param("query_window", 256, "the statistics come from the queries of the newest query_window positions "
                     "(kvpress's DecodingPress buffer)")
FUTURE_POSITIONS = Param("future_positions", 512, "the future queries are averaged over this many positions to come "
                         "(the press's n_future_positions)")
#: the RoPE layouts this policy can turn back: transformers' ``rotate_half`` (pairs (i, i + r/2))
LAYOUTS = ("rotate_half",)


class RopeError(TraceError):
    """A trace whose meta does not say its model's RoPE well enough to turn its queries back."""


@dataclass(frozen=True)
class Rope:
    """A model's rotary embedding as the recorder writes it into a trace's meta (``rope``): the
    inverse frequencies ``inv_freq`` (r/2 of them: the first r dimensions rotate, in pairs
    ``(i, i + r/2)``, the ``rotate_half`` layout; the rest pass through) and ``theta`` (the base, for
    the reader; the frequencies are what is used, so scaled RoPEs are followed exactly)."""

    inv_freq: np.ndarray
    layout: str = "rotate_half"
    theta: float | None = None

    @classmethod
    def from_meta(cls, meta: Mapping, source: str, head_dim: int) -> Rope:
        """The RoPE in ``meta["rope"]``; a ``RopeError``, one line naming ``source`` and the field."""
        rope = meta.get("rope")
        if rope is None:
            raise RopeError(f"{source}: policy expected_attention needs the model's RoPE to advance the queries' positions, "
                            "and this trace's meta has no 'rope'; record it again with `kvsim record --store qk`")
        if not isinstance(rope, Mapping):
            raise RopeError(f"{source}: meta 'rope' must be an object, got {type(rope).__name__}")
        layout = rope.get("layout")
        if layout not in LAYOUTS:
            raise RopeError(f"{source}: meta 'rope' layout {layout!r} is not one this policy turns back ({', '.join(LAYOUTS)})")
        freq = rope.get("inv_freq")
        try:
            inv = np.asarray(freq, dtype=np.float64)
        except (TypeError, ValueError):
            inv = None
        if inv is None or inv.ndim != 1 or inv.size < 1 or not np.isfinite(inv).all() or (inv < 0).any():
            raise RopeError(f"{source}: meta 'rope' inv_freq must be a list of non-negative numbers")
        if 2 * inv.size > head_dim:
            raise RopeError(f"{source}: meta 'rope' has {inv.size} frequencies, more than head dim {head_dim} allows "
                            f"({head_dim // 2})")
        theta = rope.get("theta")
        return cls(inv, layout, None if theta is None else float(theta))

    @property
    def half(self) -> int:
        return self.inv_freq.size

    def rotate(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """``x`` (..., d) with pair f of its first 2h dims turned by (cos[f], sin[f]) (any scale): what
        transformers' ``x * cos + rotate_half(x) * sin`` does to the rotated part."""
        h = self.half
        out = np.array(x, dtype=np.float64)
        a, b = x[..., :h], x[..., h : 2 * h]
        out[..., :h] = a * cos - b * sin
        out[..., h : 2 * h] = b * cos + a * sin
        return out

    def unrotate(self, x: np.ndarray, pos: int) -> np.ndarray:
        """``R_{-pos} x``: a post-RoPE vector of position ``pos`` turned back to before RoPE."""
        angle = self.inv_freq * float(pos)
        return self.rotate(x, np.cos(angle), -np.sin(angle))

    def future_average(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(cbar, sbar)``: ``mean_{j=1..n} (cos, sin)(j theta_f)``, summed directly once (float64)."""
        j = np.arange(1, n + 1, dtype=np.float64)[:, None]
        angle = j * self.inv_freq[None, :]
        return np.cos(angle).mean(axis=0), np.sin(angle).mean(axis=0)


class ExpectedAttention(SlotPolicy):
    name = "expected_attention"
    summary = ("evict the lowest attention expected from the next queries (a Gaussian fitted to the recent queries, "
               "their RoPE advanced) times the value's norm; the first sinks positions are kept")
    display = Display("#6a3d9a", "9px,2px,2px,2px,2px,2px", 3, score_name="expected attention")
    keeps_scores = True
    reads = ("queries", "keys", "values")
    #: built with the trace (``PolicySpec.build`` hands it over): its meta says the model's RoPE
    reads_meta = True
    tunables = (SINKS, QUERY_WINDOW, FUTURE_POSITIONS)

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        rng: np.random.Generator | None = None,
        sinks: int = SINKS.default,
        query_window: int = QUERY_WINDOW.default,
        future_positions: int = FUTURE_POSITIONS.default,
        trace=None,
        rope: Rope | None = None,
    ) -> None:
        super().__init__(budget, rng)
        self.sinks = SINKS.check(sinks, self.budget)
        self.query_window = _at_least_one(QUERY_WINDOW, query_window, self.budget)
        self.future_positions = _at_least_one(FUTURE_POSITIONS, future_positions, self.budget)
        self._rope = rope
        self._rope_source = None if trace is None else trace
        self._future: tuple[np.ndarray, np.ndarray] | None = None
        self._keys: np.ndarray | None = None  # (budget + 1, d) float64, per slot
        self._vnorm = np.zeros(self.budget + 1, dtype=np.float64)
        self._window: np.ndarray | None = None  # (query_window, G, d): pre-RoPE queries, a ring by position
        self._seen = -1  # the newest position handed to ``see``
        self._count = 0  # queries in the window
        self._next = 0  # the ring's slot for the next query
        self._zero = False  # position 0's vectors handed over
        self._score = np.zeros(self.budget + 1, dtype=np.float64)

    # -- what the harness hands over -----------------------------------------------------------

    def rope(self, head_dim: int) -> Rope:
        if self._rope is None:
            trace = self._rope_source
            if trace is None:
                raise RopeError("policy expected_attention needs the model's RoPE: build it with trace= (a trace whose "
                                "meta has 'rope') or rope=")
            self._rope = Rope.from_meta(trace.meta, trace.name, head_dim)
        return self._rope

    def see(self, pos: int, vectors: Mapping[str, np.ndarray]) -> None:
        q = np.asarray(vectors["queries"], dtype=np.float64)
        k = np.asarray(vectors["keys"], dtype=np.float64)
        v = np.asarray(vectors["values"], dtype=np.float64)
        if q.ndim != 2 or k.ndim != 1 or q.shape[1] != k.shape[0]:
            raise ValueError(f"{self.name}: position {pos}'s queries {q.shape} and key {k.shape} do not match "
                             "((G, d) and (d,))")
        rope = self.rope(k.shape[0])
        if self._keys is None:
            self._keys = np.zeros((self.budget + 1, k.shape[0]), dtype=np.float64)
            self._window = np.zeros((self.query_window, *q.shape), dtype=np.float64)
            self._future = rope.future_average(self.future_positions)
        vnorm = float(np.sqrt(np.dot(v, v)))
        if pos == 0:  # held from the start: its slot is 0
            self._keys[0], self._vnorm[0], self._zero = k, vnorm, True
        self._seen, self._pending = pos, (k, vnorm)
        if pos >= self.sinks:  # the press leaves the first n_sink queries out of its statistics
            self._window[self._next] = rope.unrotate(q, pos)
            self._next = (self._next + 1) % self.query_window
            self._count = min(self._count + 1, self.query_window)

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._score, self._vnorm] + ([] if self._keys is None else [self._keys])

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        self._step_attention(None)  # a free slot; the attention is never read
        if not self._zero or self._seen != pos:
            raise ValueError(f"{self.name}: position {pos}'s queries, key and value were not handed over (see) before it "
                             "was admitted")
        i = self._admit(pos)
        self._keys[i], self._vnorm[i] = self._pending
        self._rescore(pos)

    def _rescore(self, t: int) -> None:
        n = self._len
        out = self._score[:n]
        s = min(self.sinks, n)
        if n > s:
            out[s:] = held_scores(expected_logits(self._keys[s:n], self._stats(t)), self._vnorm[s:n])
        out[:s] = (out[s:].max() + 1.0) if n > s else 1.0  # the press's padding: sinks above every score

    def _stats(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """``(mean, centred)``: the future query's mean ``(G, d)`` and the window's centred queries
        ``(N, G, d)``, both turned by ``Rbar_t`` (the average rotation over positions t+1 .. t+n)."""
        rope = self._rope
        u = self._window[: self._count]
        mu = u.mean(axis=0) if self._count else np.zeros(self._window.shape[1:])
        cbar, sbar = self._future
        angle = rope.inv_freq * float(t)
        c, s = np.cos(angle), np.sin(angle)
        cos, sin = c * cbar - s * sbar, s * cbar + c * sbar  # mean over j of (t + j) theta: R_t Rbar
        return rope.rotate(mu, cos, sin), rope.rotate(u - mu, cos, sin)

    @property
    def scores(self) -> np.ndarray:
        """Each held position's expected attention x value norm, aligned with ``kept``; the sinks carry
        the press's padding (the highest score + 1)."""
        return self._score[: self._len].copy()

    def evict(self, budget: int) -> list[int]:
        return self._evict_lowest(budget, self._score[: self._len])


def _at_least_one(param: Param, value: int, budget: int) -> int:
    value = param.check(value, budget)
    if value < 1:
        raise ParamError(f"{param.name} must be at least 1, got {value}", param=param.name, value=value, problem="below 1",
                         limit=1)
    return value


def expected_logits(keys: np.ndarray, stats: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """``(G, m)``: per query head g, ``k.mu_g / sqrt(d) + k^T Sigma_g k / (2 d)`` for each of the m keys,
    with ``Sigma_g = C_g^T C_g / N`` from the centred queries (N of them), computed as
    ``mean_i (k.c_i)^2`` (O(m N d) a head rather than forming the d x d matrix)."""
    mean, centred = stats
    d = keys.shape[1]
    out = np.einsum("md,gd->gm", keys, mean) / np.sqrt(d)
    if centred.shape[0]:
        for g in range(mean.shape[0]):
            z = keys @ centred[:, g, :].T  # (m, N)
            out[g] += np.einsum("mn,mn->m", z, z) / centred.shape[0] / (2 * d)
    return out


def held_scores(logits: np.ndarray, vnorm: np.ndarray) -> np.ndarray:
    """The press's score from the logits ``(G, m)``: softmax over the m held keys per head, the mean
    over the heads, times each value's norm."""
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return w.mean(axis=0) * vnorm

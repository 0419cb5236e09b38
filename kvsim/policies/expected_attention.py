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

``attn`` is never read. Deterministic: ``rng`` is never used.

``refresh`` (1 by default: every step, the definition above) takes the statistics afresh only every
refresh steps (steps 1, 1 + refresh, ...): each held key is scored by them once, a newcomer by the last ones
when it comes, and the softmax over the held keys is taken at every step. kvpress's ``DecodingPress`` works
this way with its ``compression_interval`` (512), compressing once per interval.

The arithmetic of a step is three kernels, ``window_stats`` (``kvsim.policykit.expected_math``, which the
deployed cache's walk shares), ``key_logits`` and ``combine`` (plain loops, every sum in a stated order), which
this reference and the engine's hooks (declared here, ``STEPS``, for the engine's one step loop in
``kvsim.sim.kernels``, and the deployed cache's compiled walk on a CPU) both call, so the two agree bit for bit
(tests/test_scorers_queries.py); the trigonometry (``turns``) and the queries turned back
(``pre_rope``) are NumPy, per position, in the same calls on both paths. Its cost per step is
O(held x window x head dim x heads) when the statistics are taken afresh (docs/scorers.md).

Its tensor step (the deployed cache's, ``kvsim.policykit.expected_tensor``) takes the rotations from NumPy as this
reference does, one ``turns`` call per position, and the products in float64 on the model's device; its sums add in
BLAS's order, not the order stated here, so a score may differ from this reference's in the last bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..data.trace import TraceError
from ..jit import kernel
from ..policykit.base import DEFAULT_BUDGET, Display, EngineBinding, Param, SlotPolicy, per_config
from ..policykit.expected_math import _norm, _window, per_position, period_of, window_stats
from ..policykit.expected_tensor import TENSOR
from ..policykit.registry import register
from ..policykit.slot_hooks import Shape, SlotHooks, _drop, _first_min, _slots
from .streaming_llm import SINKS

QUERY_WINDOW = Param("query_window", 256, "the statistics come from the queries of the newest query_window positions "
                     "(kvpress's DecodingPress buffer)", minimum=1)
FUTURE_POSITIONS = Param("future_positions", 512, "the future queries are averaged over this many positions to come "
                         "(the press's n_future_positions)", minimum=1)
REFRESH = Param("refresh", 1, "the statistics are taken afresh every refresh steps and every held key scored by them "
                "again; in between a newcomer is scored by the last ones (1: every step)", minimum=1)
#: the RoPE layouts this policy can turn back: transformers' ``rotate_half`` (pairs (i, i + r/2))
LAYOUTS = ("rotate_half",)
#: keys scored together by ``key_logits`` (each key's sums are the same whatever the block)
BLOCK = 8


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
        """The RoPE the recorder states in a trace's meta (``rope_inv_freq``, ``rope_layout``, ``rope_theta``,
        ``rope_attention_scaling``: ``kvsim.policykit.rope.rope_meta``); a ``RopeError``, one line
        naming ``source`` and the field."""
        if meta.get("rope_inv_freq") is None:
            raise RopeError(f"{source}: policy expected_attention needs the model's RoPE to advance the queries' positions, "
                            "and this trace's meta has no 'rope_inv_freq'; record it again with `kvsim record --store qk`")
        layout = meta.get("rope_layout")
        if layout not in LAYOUTS:
            raise RopeError(f"{source}: meta 'rope_layout' {layout!r} is not one this policy turns back ({', '.join(LAYOUTS)})")
        scaling = meta.get("rope_attention_scaling", 1.0)
        if scaling not in (None, 1, 1.0):
            raise RopeError(f"{source}: meta 'rope_attention_scaling' is {scaling!r}; this policy turns back only an "
                            "unscaled rotation (1)")
        try:
            inv = np.asarray(meta["rope_inv_freq"], dtype=np.float64)
        except (TypeError, ValueError):
            inv = None
        if inv is None or inv.ndim != 1 or inv.size < 1 or not np.isfinite(inv).all() or (inv < 0).any():
            raise RopeError(f"{source}: meta 'rope_inv_freq' must be a list of non-negative numbers")
        if 2 * inv.size > head_dim:
            raise RopeError(f"{source}: meta 'rope_inv_freq' has {inv.size} frequencies, more than head dim {head_dim} "
                            f"allows ({head_dim // 2})")
        theta = meta.get("rope_theta")
        return cls(inv, layout, None if theta is None else float(theta))

    @property
    def half(self) -> int:
        return self.inv_freq.size

    def turns(self, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """``(cos, sin)`` of ``pos x inv_freq``: RoPE's rotation of position ``pos``, one call per position
        on every path (NumPy's vectorised cosine may round a lane differently from a scalar one)."""
        angle = self.inv_freq * float(pos)
        return np.cos(angle), np.sin(angle)

    def pre_rope(self, x: np.ndarray, pos: int) -> np.ndarray:
        """``R_{-pos} x`` in float64: a post-RoPE vector (or rows of them) of position ``pos`` turned back."""
        c, s = self.turns(pos)
        h = self.half
        x = np.asarray(x, dtype=np.float64)
        out = x.copy()
        a, b = x[..., :h], x[..., h : 2 * h]
        out[..., :h] = a * c + b * s
        out[..., h : 2 * h] = b * c - a * s
        return out

    def future_average(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(cbar, sbar)``: ``mean_{j=1..n} (cos, sin)(j theta_f)``, summed directly once (float64)."""
        j = np.arange(1, n + 1, dtype=np.float64)[:, None]
        angle = j * self.inv_freq[None, :]
        return np.cos(angle).mean(axis=0), np.sin(angle).mean(axis=0)


# --------------------------------------------------------------------------------------------
# the fast path: the state holds what ``engine_inputs`` made a position at a time with the reference's own
# calls (keys in float64, value norms, the queries turned back before RoPE, each position's turn) and, per
# configuration, its sinks, query window, refresh and future average, with the statistics of its current
# period and each slot's logits against them (stamped with the period). A step's scores are computed when
# the loop first asks for them (the scores record, or the pick once the cache is over its budget): the
# statistics of the period's first step (``period_of``; its window the positions ``max(sinks, p - window + 1)
# .. p``, oldest first, as the reference's ring held them), the logits of the slots not stamped with it, the
# softmax over the held. Skipping a step changes nothing: what is computed depends on the step, not on when.


@kernel
def _fresh(state, c, p_c):
    """Configuration c's scores, computed once per step (``due[c]``: how many slots are held, newest last,
    while the step's scores are still to compute; 0 once they are)."""
    (keys, vnorm, pre, cos, sin, sinks, windows, refresh, cbar, sbar, scores, due, adv, cols, logits, stamp, period,
     counts, slot_keys, slot_vnorm, col_of, base) = state
    n = due[c]
    if n > 0:
        t = p_c[n - 1]
        s = sinks[c]
        per = 1 + (t - 1) // refresh[c] * refresh[c]  # ``period_of``
        if per != period[c]:
            _window(state, c, per)
        held_sinks = min(s, n)
        key_logits(slot_keys[c], col_of[c], n, held_sinks, adv[c], cols[c], counts[c], logits[c], stamp[c], per)
        combine(logits[c], col_of[c], slot_vnorm[c], n, held_sinks, scores[c])
        due[c] = 0
    return scores[c]


@kernel
def _expected_admit(state, c, p_c, n):
    """Slot n (the newcomer, in column ``col_of[c, n]``) takes its key and value norm; the n + 1 held are to be
    scored, its logits not taken yet."""
    state[11][c] = n + 1
    state[15][c, n] = -1
    j = state[20][c, n]
    at = p_c[n] - state[21][0]
    key = state[0][at]
    mine = state[18][c, j]
    for x in range(key.shape[0]):
        mine[x] = key[x]
    state[19][c, j] = state[1][at]


@kernel
def _expected_score(state, c, p_c, i):
    return _fresh(state, c, p_c)[i]


@kernel
def _expected_pick(state, c, t, p_c, n, A, a0, scored):
    return _first_min(_fresh(state, c, p_c), n)


@kernel
def _expected_drop(state, c, best, n):
    """Slot ``best`` leaves: the later slots' logits and stamps move up with their positions, its column goes to the
    next newcomer."""
    logits = state[14][c]
    stamp = state[15][c]
    for i in range(best, n - 1):
        stamp[i] = stamp[i + 1]
        for g in range(logits.shape[1]):
            logits[i, g] = logits[i + 1, g]
    o_c = state[20][c]
    freed = o_c[best]
    _drop(o_c, best, n)
    o_c[n - 1] = freed


def _expected_state(shape: Shape, keys, vnorm, pre, cos, sin, sinks, windows, refresh, cbar, sbar):
    G, d = pre.shape[1:]
    # each held slot's key and value norm in a column of its own (``col_of``: an eviction hands its column to the next
    # newcomer), taken from the per-position rows when it is admitted; position 0, held from the start, in column 0
    slot_keys = np.zeros((shape.configs, shape.width, keys.shape[1]))
    slot_keys[:, 0] = keys[0]
    slot_vnorm = np.zeros((shape.configs, shape.width))
    slot_vnorm[:, 0] = vnorm[0]
    col_of = np.tile(np.arange(shape.width, dtype=np.int64), (shape.configs, 1))
    return (keys, vnorm, pre, cos, sin, sinks, windows, refresh, cbar, sbar, _slots(shape, 0.0, np.float64),
            np.zeros(shape.configs, dtype=np.int64), np.zeros((shape.configs, G, d)),
            np.zeros((shape.configs, G, d, int(windows.max()))), np.zeros((shape.configs, shape.width, G)),
            _slots(shape, -1, np.int64), np.full(shape.configs, -1, dtype=np.int64), np.zeros(shape.configs, dtype=np.int64),
            slot_keys, slot_vnorm, col_of, np.zeros(2, dtype=np.int64))


#: expected_attention's hooks of the engine's step loop, which its ``engine_binding`` names
STEPS = SlotHooks("expected_attention_steps", _expected_state, admit=_expected_admit, score=_expected_score,
                  pick=_expected_pick, drop=_expected_drop)


@register
class ExpectedAttention(SlotPolicy):
    name = "expected_attention"
    order = 120
    #: statistics afresh every 64 steps (kvpress's decoding mode compresses at intervals; every step costs ~130x h2o's replay)
    table_rows = ({"refresh": 64},)
    summary = ("evict the lowest attention expected from the next queries (a Gaussian fitted to the recent queries, "
               "their RoPE advanced) times the value's norm; the first sinks positions are kept")
    display = Display("#b8860b", "18px,3px,2px,3px", 3, score_name="expected attention")
    engine_binding = EngineBinding(STEPS, compile_s=50)
    tensor_step = TENSOR
    keeps_scores = True
    reads = ("queries", "keys", "values")
    #: built with the trace (``PolicySpec.build`` hands it over): its meta says the model's RoPE
    reads_meta = True
    tunables = (SINKS, QUERY_WINDOW, FUTURE_POSITIONS, REFRESH)

    def __init__(
        self,
        budget: int = DEFAULT_BUDGET,
        rng: np.random.Generator | None = None,
        sinks: int = SINKS.default,
        query_window: int = QUERY_WINDOW.default,
        future_positions: int = FUTURE_POSITIONS.default,
        refresh: int = REFRESH.default,
        trace=None,
        rope: Rope | None = None,
    ) -> None:
        super().__init__(budget, rng)
        self.sinks = SINKS.check(sinks, self.budget)
        self.query_window = QUERY_WINDOW.check(query_window, self.budget)
        self.future_positions = FUTURE_POSITIONS.check(future_positions, self.budget)
        self.refresh = REFRESH.check(refresh, self.budget)
        self._rope = rope
        self._trace = trace
        self._future: tuple[np.ndarray, np.ndarray] | None = None
        self._keys: np.ndarray | None = None  # (budget + 1, d) float64, per slot
        self._vnorm = np.zeros(self.budget + 1, dtype=np.float64)
        self._window: np.ndarray | None = None  # (query_window, G, d): pre-RoPE queries, a ring, oldest at _next once full
        self._seen = -1  # the newest position handed to ``see``
        self._count = 0  # queries in the window
        self._next = 0  # the ring's slot for the next query
        self._zero = False  # position 0's vectors handed over
        self._score = np.zeros(self.budget + 1, dtype=np.float64)
        self._turn: tuple[np.ndarray, np.ndarray] | None = None  # the newest position's (cos, sin)
        self._logits: np.ndarray | None = None  # (budget + 1, G) per slot, against the statistics of _period
        self._stamp = np.full(self.budget + 1, -1, dtype=np.int64)  # the period a slot's logits were taken in
        self._period = -1  # the step of the statistics held: adv, cols, over _stats_count queries
        self._stats_count = 0

    @classmethod
    def engine_inputs(cls, policies, steps, vectors):
        """Per configuration its sinks, query window and future average ``(cbar, sbar)``; per position its
        key and value norm, its queries turned back (``pre_rope``) and its turn (``turns``), made by the
        very calls the reference makes, a position at a time."""
        p0 = policies[0]
        rows = per_position(p0, 0, vectors, steps + 1)
        future = [p0.rope(rows["keys"].shape[1]).future_average(p.future_positions) for p in policies]
        return {**rows,
                "sinks": per_config(p.sinks for p in policies), "windows": per_config(p.query_window for p in policies),
                "refresh": per_config(p.refresh for p in policies),
                "cbar": np.array([f[0] for f in future]), "sbar": np.array([f[1] for f in future])}

    @classmethod
    def check_meta(cls, meta: Mapping, source: str, head_dim: int) -> None:
        """Refuse (``RopeError``, one line naming ``source``) a meta whose RoPE this policy cannot turn back: what
        the deployed cache asks of each layer's ``rope_meta`` before any token."""
        Rope.from_meta(meta, source, head_dim)

    def rope(self, head_dim: int) -> Rope:
        """The model's RoPE: given, or read from the trace's meta (a ``RopeError`` when it has none)."""
        if self._rope is None:
            trace = self._trace
            if trace is None:
                raise RopeError("policy expected_attention needs the model's RoPE: build it with trace= (a trace whose "
                                "meta has 'rope_inv_freq') or rope=")
            self._rope = Rope.from_meta(trace.meta, trace.name, head_dim)
        return self._rope

    def see(self, pos: int, vectors: Mapping[str, np.ndarray]) -> None:
        q = np.asarray(vectors["queries"])
        k = np.asarray(vectors["keys"], dtype=np.float64)
        if q.ndim != 2 or k.ndim != 1 or q.shape[1] != k.shape[0]:
            raise ValueError(f"{self.name}: position {pos}'s queries {q.shape} and key {k.shape} do not match "
                             "((G, d) and (d,))")
        rope = self.rope(k.shape[0])
        if self._keys is None:
            self._keys = np.zeros((self.budget + 1, k.shape[0]), dtype=np.float64)
            self._window = np.zeros((self.query_window, *q.shape), dtype=np.float64)
            self._future = rope.future_average(self.future_positions)
            G, d = q.shape
            self._logits = np.zeros((self.budget + 1, G))
            self._adv, self._cols = np.zeros((G, d)), np.zeros((G, d, self.query_window))
        vnorm = _norm(vectors["values"])
        if pos == 0:  # held from the start: its slot is 0
            self._keys[0], self._vnorm[0], self._zero = k, vnorm, True
        self._seen, self._pending, self._turn = pos, (k, vnorm), rope.turns(pos)
        if pos >= self.sinks:  # the press leaves the first n_sink queries out of its statistics
            self._window[self._next] = rope.pre_rope(q, pos)
            self._next = (self._next + 1) % self.query_window
            self._count = min(self._count + 1, self.query_window)

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._vnorm, self._stamp] + ([] if self._keys is None else [self._keys, self._logits])

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        self._step_attention(None)  # a free slot; the attention is never read
        if not self._zero or self._seen != pos:
            raise ValueError(f"{self.name}: position {pos}'s queries, key and value were not handed over (see) before it "
                             "was admitted")
        i = self._admit(pos)
        self._keys[i], self._vnorm[i] = self._pending
        self._stamp[i] = -1
        period = period_of(pos, self.refresh)
        if period != self._period:  # this step is the period's first: the window holds its queries
            first = (self._next - self._count) % self.query_window  # the oldest query in the ring
            window_stats(self._window, first, self._count, self.query_window, *self._turn, *self._future, self._adv,
                         self._cols)
            self._period, self._stats_count = period, self._count
        n = self._len
        rows = np.arange(n, dtype=np.int64)
        sinks = min(self.sinks, n)
        key_logits(self._keys, rows, n, sinks, self._adv, self._cols, self._stats_count, self._logits, self._stamp, period)
        combine(self._logits, rows, self._vnorm, n, sinks, self._score)

    @property
    def scores(self) -> np.ndarray:
        """Each held position's expected attention x value norm, aligned with ``kept``; the sinks carry
        the press's padding (the highest score + 1)."""
        return self._score[: self._len].copy()

    def evict(self, budget: int) -> list[int]:
        return self._evict_lowest(budget, self._score[: self._len])


@kernel
def key_logits(keys, rows, n, sinks, adv, cols, count, logits, stamp, period):
    """The logits ``logits[i, g]`` of the held non-sink slots i (key ``keys[rows[i]]``) not yet scored
    against the statistics of ``period`` (``stamp[i] != period``), then stamped: ``k.adv_g / sqrt(d) +
    mean_j (k.cols_gj)^2 / (2 d)``, the second term ``k^T Sigma_g k / (2 d)`` with the window's
    covariance (divided by N). ``BLOCK`` keys at a time; each key's sums are the same whatever its block.

    ``z_j = k.cols_gj`` is summed over the dimensions x in order from 0.0 (``((z + k_0 c_0j) + k_1 c_1j) +
    ...``): four dimensions per pass over the window, each ``z_j`` loaded and stored once per four terms
    instead of once per term (the same additions in the same order, so the same bits; about twice as
    fast, the pass being bound by those loads and stores)."""
    G = adv.shape[0]
    d = adv.shape[1]
    todo = np.empty(max(n - sinks, 1), dtype=np.int64)
    m = 0
    for i in range(sinks, n):
        if stamp[i] != period:
            todo[m] = i
            m += 1
    z = np.empty((BLOCK, max(count, 1)))
    root = np.sqrt(np.float64(d))
    d4 = d - d % 4
    for i0 in range(0, m, BLOCK):
        nb = min(BLOCK, m - i0)
        for g in range(G):
            cg = cols[g]
            for b in range(nb):
                k = keys[rows[todo[i0 + b]]]
                lin = 0.0
                for x in range(d):
                    lin += k[x] * adv[g, x]
                logits[todo[i0 + b], g] = lin / root
            if count > 0:
                for b in range(nb):
                    k = keys[rows[todo[i0 + b]]]
                    zb = z[b]
                    for j in range(count):
                        zb[j] = 0.0
                    for x in range(0, d4, 4):  # four terms of every z_j, added in dimension order
                        c0, c1, c2, c3 = cg[x], cg[x + 1], cg[x + 2], cg[x + 3]
                        k0, k1, k2, k3 = k[x], k[x + 1], k[x + 2], k[x + 3]
                        for j in range(count):
                            zb[j] = (((zb[j] + k0 * c0[j]) + k1 * c1[j]) + k2 * c2[j]) + k3 * c3[j]
                    for x in range(d4, d):
                        col = cg[x]
                        kx = k[x]
                        for j in range(count):
                            zb[j] += kx * col[j]
                for b in range(nb):
                    quad = 0.0
                    for j in range(count):
                        quad += z[b, j] * z[b, j]
                    logits[todo[i0 + b], g] += quad / count / (2.0 * d)
    for b in range(m):
        stamp[todo[b]] = period


@kernel
def combine(logits, rows, vnorm, n, sinks, out):
    """The press's score of the held slots from their logits ``(slots, G)``: per head the softmax over
    the non-sink slots ``sinks .. n-1``, the mean over the heads, times ``|v|`` (``vnorm[rows[i]]``), into
    ``out``; the sinks get the highest score + 1 (the press's padding)."""
    G = logits.shape[1]
    for i in range(sinks, n):
        out[i] = 0.0
    for g in range(G):
        hi = -np.inf
        for i in range(sinks, n):
            hi = max(hi, logits[i, g])
        total = 0.0
        for i in range(sinks, n):
            total += np.exp(logits[i, g] - hi)
        for i in range(sinks, n):
            out[i] += np.exp(logits[i, g] - hi) / total
    top = -np.inf
    for i in range(sinks, n):
        v = out[i] / G * vnorm[rows[i]]
        out[i] = v
        top = max(top, v)
    pad = top + 1.0 if n > sinks else 1.0
    for i in range(sinks):
        out[i] = pad

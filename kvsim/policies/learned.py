"""Learned: evict the held position with the lowest score of a linear scorer fitted to the exact optimum's
evictions (docs/learned.md; ``kvsim learn`` fits it), outside the newest ``recent_window`` positions.

No paper: kvsim's own study. The scorer is ``sum_f w_f (x_f - mean_f) / scale_f`` over features every
online policy can compute from what it is shown at each step (docs/domain.md, "A policy learned from the
optimum"), per held position:

- ``log_cum``: log of its cumulative attention (h2o's score) plus ``EPS``;
- ``log_mean``: log of that sum over the rows it has been shown (h2o_normalized's idea), plus ``EPS``;
- ``log_recent``: log of the attention of its last ``WINDOW`` shown rows, plus ``EPS``;
- ``log_decayed``: log of the sum of its shown attention decayed by ``DECAY`` per shown row, plus ``EPS``;
- ``log_last``: log of its weight in the latest shown row (tova's score), plus ``EPS``;
- ``vote_rate``: the share of its shown rows in which it beat the fair share ``1 / n`` (scissorhands' vote,
  compared in float32 as there);
- ``log_age``: ``log(1 + rows shown since it was admitted)``;
- ``log_position``: ``log(1 + position)`` (position 0, the sink, is 0);
- ``log_key_norm``: log of its key's L2 norm (knorm's), only for weights fitted with it: the policy then
  reads the trace's keys and refuses a trace without them.

Every feature is a function of the rows shown, so ``attn=None`` ("no information") changes none of them:
the age counts rows shown, not steps. The weights are data, never code: a JSON file (``WEIGHTS_FORMAT``,
read by ``load_weights``), by default the one shipped beside this module (``DEFAULT_WEIGHTS``), else the
file ``KVSIM_LEARNED_WEIGHTS`` names, or ``weights=`` (a path or the document) when built in Python.

The score's terms are added in the weights' order, one at a time (``position_sum``), and the recent window's
sum over its ``WINDOW`` ring columns in column order, so the deployed cache's tensor step (below) computes the
same bits in torch (a BLAS product's order of additions is the library's own: NumPy's and torch's differ for
139 of 257 scores of 8 random features, the sequential sum for 167).

Eviction: repeated argmin of the score over ``kept[:len - recent_window]``; equal scores evict the lower
position; victims come back in ascending position order. Under a serving layout (pages) a page's score is
the sum of its positions' ``exp(score)`` (``layout_priorities``). Deterministic: ``rng`` is never used. No engine
binding: the reference harness replays it (about a second for 4096 steps).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..data.gqa import position_sum
from ..policykit import base
from ..policykit.base import DEFAULT_BUDGET, Display, SlotPolicy
from ..policykit.registry import register
from ..policykit.tensor_hooks import TensorHooks, TensorState, admitted, in_order, param, slots
from ..policykit.tensor_hooks import key_norms as tensor_key_norms
from .knorm import key_norms, one_key

#: the shipped weights: fitted by ``kvsim learn`` on the shipped gemma3-270m-L05 trace (docs/learned.md)
DEFAULT_WEIGHTS = Path(__file__).with_name("learned_weights.json")
#: the environment variable naming another weights file for every ``learned`` built without ``weights=``
WEIGHTS_ENV = "KVSIM_LEARNED_WEIGHTS"
WEIGHTS_FORMAT = "kvsim-learned-weights"
WEIGHTS_VERSION = 1
#: the rows of the recent-attention window, and the decay per shown row of the decayed sum
WINDOW = 8
DECAY = 0.95
#: added before every log, so a position never attended to has a finite feature
EPS = 1e-6
#: every feature this module computes, in the order the weights list them; the attention-only ones
FEATURES = ("log_cum", "log_mean", "log_recent", "log_decayed", "log_last", "vote_rate", "log_age", "log_position",
            "log_key_norm")
ATTENTION_FEATURES = FEATURES[:-1]
#: the trace members a feature needs beyond attention
NEEDS = {"log_key_norm": ("keys",)}

#: the shared window (``kvsim.policykit.base.RECENT_WINDOW``) at learned's own default: the one its weights were fitted at
RECENT_WINDOW = replace(base.RECENT_WINDOW, default=16)


class WeightsError(ValueError):
    """A weights file that is not the format, or for another feature set: one line naming the file."""


def feature_params() -> dict:
    """The constants the features are computed with: a weights file fitted under others is another feature set."""
    return {"window": WINDOW, "decay": DECAY, "eps": EPS}


def _numbers(doc: Mapping, key: str, n: int, where: str) -> list[float]:
    values = doc.get(key)
    if not isinstance(values, list) or len(values) != n or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise WeightsError(f"{where}: {key!r} must be a list of {n} finite numbers, one per feature")
    return [float(v) for v in values]


def check_weights(doc, where: str = "weights") -> dict:
    """``doc`` (a weights document) checked: the format and version, known features, a mean, a positive scale and
    a weight per feature, the feature constants this module computes with. Raises ``WeightsError`` (one line)."""
    if not isinstance(doc, Mapping) or doc.get("format") != WEIGHTS_FORMAT:
        raise WeightsError(f"{where}: not a learned-weights file (expected a JSON object with format {WEIGHTS_FORMAT!r})")
    if doc.get("version") != WEIGHTS_VERSION:
        raise WeightsError(f"{where}: weights version {doc.get('version')!r}, this kvsim reads version {WEIGHTS_VERSION}")
    features = doc.get("features")
    if not isinstance(features, list) or not features or not all(isinstance(f, str) for f in features):
        raise WeightsError(f"{where}: 'features' must be a non-empty list of feature names")
    unknown = [f for f in features if f not in FEATURES]
    if unknown or len(set(features)) != len(features):
        what = f"unknown feature {unknown[0]!r}" if unknown else "a feature named twice"
        raise WeightsError(f"{where}: weights for another feature set ({what}; this kvsim computes {', '.join(FEATURES)})")
    params = doc.get("feature_params")
    if params != feature_params():
        raise WeightsError(f"{where}: weights for another feature set (feature_params {params!r}, this kvsim computes "
                           f"{feature_params()!r})")
    n = len(features)
    mean, scale, weights = (_numbers(doc, k, n, where) for k in ("mean", "scale", "weights"))
    if min(scale) <= 0:
        raise WeightsError(f"{where}: every 'scale' must be positive")
    rw = doc.get("recent_window")
    if isinstance(rw, bool) or not isinstance(rw, int) or rw < 0:
        raise WeightsError(f"{where}: 'recent_window' must be a non-negative integer")
    return {**doc, "features": list(features), "mean": mean, "scale": scale, "weights": weights}


def load_weights(path) -> dict:
    """The weights document at ``path``, checked (``check_weights``); a ``WeightsError`` naming the file."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise WeightsError(f"{path}: cannot read the weights file ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: not a learned-weights file (not JSON: {e})") from None
    return check_weights(doc, str(path))


def default_weights() -> dict:
    """``KVSIM_LEARNED_WEIGHTS``'s file when it is set, else the shipped ``DEFAULT_WEIGHTS``."""
    return load_weights(os.environ.get(WEIGHTS_ENV) or DEFAULT_WEIGHTS)


def reads_of(features) -> tuple[str, ...]:
    """The trace members ``features`` need beyond attention, in ``vectors.MEMBERS`` order."""
    need = {m for f in features for m in NEEDS.get(f, ())}
    return tuple(m for m in ("keys", "values", "queries", "out_norms") if m in need)


def _log(x: np.ndarray) -> np.ndarray:
    return np.log(x + EPS)


# --------------------------------------------------------------------------------------------
# the tensor step (the deployed cache's, ``kvsim.hf.tensor``): every per-slot array of the reference a slot tensor
# (the recent window's ring ``(batch, heads, width, WINDOW)`` written at a per-(row, KV head) clock, as snapkv's),
# each feature the reference's arithmetic in torch, the score's terms added in the weights' order, the victim the
# first minimum outside the recent window. The weights are per (row, KV head); the rows of one layer share the
# feature list (a batch's rows built from one weights file).

_SLOTS = ("cum", "decayed", "last", "votes", "seen", "knorm")


def _learned_tensor_state(policies, batch, heads, width, device):
    import torch

    features = {p.features for row in policies for p in row}
    if len(features) != 1:
        raise ValueError("learned: one layer's rows are built from weights of different features")

    def per_head(name):
        return torch.as_tensor(np.array([[getattr(p, name) for p in row] for row in policies]), dtype=torch.float64, device=device)

    return TensorState({RECENT_WINDOW.name: param(policies, RECENT_WINDOW.name, device), "mean": per_head("_mean"),
                        "scale": per_head("_scale"), "w": per_head("_w"),
                        "clock": torch.zeros(batch, heads, dtype=torch.int64, device=device)},
                       {**{name: slots(batch, heads, width, device) for name in _SLOTS},
                        "hist": torch.zeros(batch, heads, width, WINDOW, dtype=torch.float64, device=device)},
                       host={"features": features.pop()})


def _learned_tensor_observe(state, shown, before):
    import torch

    seen = before.any(-1)  # a padded position is shown nothing: no feature moves
    on = seen[..., None] & before
    a, s, clock = shown.double(), state.slots, state.params["clock"]
    n = before.sum(-1, keepdim=True)  # what the row was shown over: the held before t
    s["cum"] += a
    s["decayed"] = torch.where(on, s["decayed"] * DECAY + a, s["decayed"])
    s["last"] = torch.where(on, a, s["last"])
    s["votes"] += on & (shown > (1.0 / n.clamp(min=1).double()).float())
    s["seen"] += on
    at = (clock % WINDOW)[..., None, None].expand(*s["hist"].shape[:3], 1)
    s["hist"] = torch.where(seen[..., None, None], s["hist"].scatter(-1, at, a[..., None]), s["hist"])
    state.params["clock"] = clock + seen


def _learned_tensor_admit(state, new, before):
    for name in _SLOTS:
        state.slots[name].masked_fill_(new, 0.0)
    state.slots["hist"].masked_fill_(new[..., None], 0.0)
    if "keys" in state.now:
        state.slots["knorm"] = admitted(state.slots["knorm"], new, tensor_key_norms(state.now["keys"]))


def _log1p(state, t: int):
    """NumPy's ``log1p`` of 0, 1, ..., at least t + 1 (an age or a position by step t), made on the host and kept on
    the device: torch's ``log1p`` is not NumPy's in the last bit for 817 of a million integers below 5,000."""
    import torch

    table = state.host.get("log1p")
    if table is None or table.shape[0] < t + 2:
        size = max(2 * (t + 2), 1024)
        table = state.host["log1p"] = torch.as_tensor(np.log1p(np.arange(size, dtype=np.float64)),
                                                       device=state.params["w"].device)
    return table


def _learned_tensor_rank(state, cols):
    import torch

    s = state.slots
    seen = s["seen"].clamp(min=1.0)
    feature = {"log_cum": lambda: s["cum"] + EPS, "log_mean": lambda: s["cum"] / seen + EPS,
               "log_recent": lambda: in_order(s["hist"]) + EPS, "log_decayed": lambda: s["decayed"] + EPS,
               "log_last": lambda: s["last"] + EPS, "log_key_norm": lambda: s["knorm"] + EPS}
    columns = []
    for f in state.host["features"]:
        if f == "vote_rate":
            columns.append(s["votes"] / seen)
        elif f == "log_age":
            columns.append(_log1p(state, cols.t).gather(-1, s["seen"].long().flatten()).view_as(seen))
        elif f == "log_position":
            columns.append(_log1p(state, cols.t).gather(-1, cols.pos.clamp(min=0).flatten()).view_as(seen))
        else:
            columns.append(torch.log(feature[f]()))
    x = torch.stack(columns, -1)  # (batch, heads, width, features)
    p = state.params
    score = in_order((x - p["mean"][:, :, None]) / p["scale"][:, :, None] * p["w"][:, :, None])
    return score, cols.newer >= p[RECENT_WINDOW.name][..., None]


#: learned's tensor step, which its ``tensor_step`` names
TENSOR = TensorHooks("learned", _learned_tensor_state, _learned_tensor_rank, observe=_learned_tensor_observe,
                     admit=_learned_tensor_admit)


@register
class Learned(SlotPolicy):
    name = "learned"
    order = 140
    summary = ("keep the newest recent_window positions and, of the rest, the highest score of a linear scorer "
               "fitted to the exact optimum (kvsim learn)")
    display = Display("#ff00ff", "9px,3px,2px,3px,2px,3px", 3, "star", score_name="learned score")
    reads_attention = True
    keeps_scores = True
    fitted = True
    tensor_step = TENSOR
    tunables = (RECENT_WINDOW,)
    table_rows = ({RECENT_WINDOW.name: RECENT_WINDOW.default},)

    def __init__(self, budget: int = DEFAULT_BUDGET, rng: np.random.Generator | None = None,
                 recent_window: int = RECENT_WINDOW.default, weights=None) -> None:
        super().__init__(budget, rng)
        self.recent_window = RECENT_WINDOW.check(recent_window, self.budget)
        if weights is None:
            doc = default_weights()
        elif isinstance(weights, Mapping):
            doc = check_weights(weights)
        else:
            doc = load_weights(weights)
        self.weights_doc = doc
        self.features = tuple(doc["features"])
        self._mean = np.asarray(doc["mean"], dtype=np.float64)
        self._scale = np.asarray(doc["scale"], dtype=np.float64)
        self._w = np.asarray(doc["weights"], dtype=np.float64)
        self.reads = reads_of(self.features)  # an instance's: the harness hands it the members these weights need
        width = self.budget + 1
        self._cum = np.zeros(width)
        self._decayed = np.zeros(width)
        self._last = np.zeros(width)
        self._votes = np.zeros(width)
        self._seen = np.zeros(width)
        self._hist = np.zeros((width, WINDOW))  # the last WINDOW shown weights, column ``_shown % WINDOW``
        self._knorm = np.zeros(width)
        self._shown = 0
        self._pending: tuple[int, float] | None = None

    def _slot_arrays(self) -> list[np.ndarray]:
        return [self._cum, self._decayed, self._last, self._votes, self._seen, self._hist, self._knorm]

    def see(self, pos: int, vectors: Mapping[str, np.ndarray]) -> None:
        if "keys" not in self.reads:
            return
        norm = float(key_norms(one_key(self.name, pos, vectors)))
        if pos == 0 and self._len == 1:
            self._knorm[0] = norm
        else:
            self._pending = (pos, norm)

    def on_decode_step(self, pos: int, attn: np.ndarray | None) -> None:
        attn = self._step_attention(attn)
        n = self._len
        if attn is not None:
            a = attn.astype(np.float64)
            self._cum[:n] += a
            self._decayed[:n] = self._decayed[:n] * DECAY + a
            self._last[:n] = a
            self._votes[:n] += attn.astype(np.float32) > np.float32(1.0 / n)
            self._seen[:n] += 1
            self._hist[:n, self._shown % WINDOW] = a
            self._shown += 1
        i = self._admit(pos)
        for arr in (self._cum, self._decayed, self._last, self._votes, self._seen, self._knorm):
            arr[i] = 0.0
        self._hist[i] = 0.0
        if "keys" in self.reads:
            if self._pending is None or self._pending[0] != pos:
                raise ValueError(f"{self.name}: position {pos} admitted before its key was seen (Policy.see)")
            self._knorm[i] = self._pending[1]
            self._pending = None

    def feature_matrix(self) -> np.ndarray:
        """``(len(kept), len(features))``: every held position's features, in kept order (what ``kvsim learn``
        fits on, and what the score is computed from)."""
        n = self._len
        seen = np.maximum(self._seen[:n], 1.0)
        cols = []
        for f in self.features:
            if f == "log_cum":
                cols.append(_log(self._cum[:n]))
            elif f == "log_mean":
                cols.append(_log(self._cum[:n] / seen))
            elif f == "log_recent":
                cols.append(_log(position_sum(self._hist[:n])))
            elif f == "log_decayed":
                cols.append(_log(self._decayed[:n]))
            elif f == "log_last":
                cols.append(_log(self._last[:n]))
            elif f == "vote_rate":
                cols.append(self._votes[:n] / seen)
            elif f == "log_age":
                cols.append(np.log1p(self._seen[:n]))
            elif f == "log_position":
                cols.append(np.log1p(self._pos[:n].astype(np.float64)))
            else:  # log_key_norm
                cols.append(np.log(self._knorm[:n] + EPS))
        return np.stack(cols, axis=1)

    @property
    def scores(self) -> np.ndarray:
        """The learned score of each held position, aligned with ``kept``: the lowest outside the window goes."""
        return position_sum((self.feature_matrix() - self._mean) / self._scale * self._w)

    def layout_priorities(self) -> np.ndarray:
        """What a serving layout sums over a page (docs/serving.md): ``exp(score)`` of each evictable position,
        ``inf`` in the recent window. The exponential keeps the single positions' order and makes the score
        additive: a linear function of log-features, exponentiated, is on the scale of attention, so a page's
        sum weighs its positions as their attention would (a sum of the raw, signed scores would not)."""
        out = np.full(self._len, np.inf)
        m = self.evictable()
        out[:m] = np.exp(np.minimum(self.scores[:m], 700.0))
        return out

    def evictable(self) -> int:
        """How many of the held positions (the oldest) may go now: all but the newest ``recent_window``."""
        return max(self._len - self.recent_window, 0)

    def evict(self, budget: int) -> list[int]:
        if self._len <= budget:
            return []
        return self._evict_lowest(budget, self.scores[: self.evictable()])

    def evict_position(self, pos: int) -> None:
        """Evict ``pos`` (held) whatever its score: how ``kvsim learn`` walks the optimum's own schedule."""
        i = int(np.searchsorted(self._pos[: self._len], pos))
        if i >= self._len or self._pos[i] != pos:
            raise ValueError(f"{self.name}: position {pos} is not held")
        n = self._len
        for arr in (self._pos, *self._slot_arrays()):
            arr[i : n - 1] = arr[i + 1 : n]
        self._len = n - 1

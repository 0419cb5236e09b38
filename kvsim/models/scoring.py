"""The output layer's verdict, and the full-cache pass kept on disk: what every truth measurement on
one model and one text shares (``kvsim.models.quality.Session``).

A measurement compares the evicted model's next-token distributions with the full cache's. The
full-cache side (the token ids, the traces with their values, the final hidden states, the
per-position loss) depends only on the model and the text, so it is computed once and kept under
``<cache_dir>/quality/fullpass-<key>.npz`` (uncompressed: it is read far more often than written).
With it, a new process measuring one more configuration needs neither the tokenizer (3 s of Gemma's
load: a 33 MB JSON) nor the full-cache pass (2-7 s) nor the output layer on the full cache's side
(``Scorer.summary``), and its numbers are bit-identical to a session that computed them (the tests
hold that).

torch is imported inside the functions: ``import kvsim`` never needs it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.files import atomic_write
from ..data.store import cache_dir

#: what a cached full pass means; bump it when its contents change meaning
FULL_PASS_VERSION = 3
#: the scorers' members a full pass keeps per layer beside the rows and values (3: they joined)
VECTOR_NAMES = ("keys", "queries", "out_norms")
#: rows of the output layer scored at once (262k words x 128 rows x 4 bytes = 134 MB)
CHUNK = 128


class Scorer:
    """The output layer's verdict on final hidden states ``(n, width)``: the NLL of the next token
    (``targets``: x_2 .. x_N) and KL(full || evicted) at positions 1 .. N-1, against the full-cache
    pass's ``hidden_full``.

    The full cache's side is summarised per position once (``summary``: its NLL, the log of its
    softmax's sum ``lse_full`` and, without a final soft-cap, ``expect``, the output embeddings averaged
    under its next-token distribution, ``W^T p_full``): then, since the logits are linear in the hidden
    state, KL(full || evicted) = (h_full - h) . expect + lse(h) - lse_full, the bias cancelling, and a
    measurement runs the output layer on its own rows only (it was both sides' 262k-word product for
    Gemma). Given a cached summary, the full side costs nothing at all. A model whose logits are
    soft-capped (not linear in h) keeps the full side's log-probabilities instead, a chunk at a time."""

    def __init__(self, model, hidden_full, targets, summary: dict | None = None):
        import torch

        self.model, self.hidden_full, self.targets = model, hidden_full, targets
        self.n = hidden_full.shape[0]
        capped = getattr(model.config, "final_logit_softcapping", None) is not None
        self._lp_full = {}  # chunk start -> full-cache log-probabilities (soft-capped models only)
        if summary is None:
            summary = {"nll": np.empty(self.n - 2), "lse": np.empty(self.n - 2),
                       "expect": None if capped else np.empty((self.n - 2, hidden_full.shape[1]), dtype=np.float32)}
            weight = self.model.get_output_embeddings().weight
            with torch.no_grad():
                for a in range(0, self.n - 2, CHUNK):
                    logits = self._logits(self.hidden_full[1 + a : min(1 + a + CHUNK, self.n - 1)])
                    lse = torch.logsumexp(logits, dim=1, keepdim=True)
                    lp = logits.sub_(lse)  # the log-probabilities, in the logits' memory
                    b = a + lp.shape[0]
                    summary["lse"][a:b] = lse[:, 0].double().numpy()
                    summary["nll"][a:b] = -lp.gather(1, targets[a:b, None])[:, 0].double().numpy()
                    if summary["expect"] is not None:
                        summary["expect"][a:b] = (lp.exp_() @ weight.float()).numpy()
        self.summary = summary
        self.nll_full_series = np.asarray(summary["nll"], dtype=np.float64)
        self._expect = None if summary["expect"] is None else torch.from_numpy(np.asarray(summary["expect"])).double()

    def _logits(self, hidden):
        """The (soft-capped) logits, float32; the capping done in place (the same arithmetic as
        ``tanh(logits / cap) * cap``, bit for bit, without two 134 MB temporaries per chunk)."""
        logits = self.model.get_output_embeddings()(hidden).float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def score(self, hiddens: list) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per-position NLL and KL(full || evicted) at positions 1 .. N-1 for each of ``hiddens``.
        Rows bit-identical to the full-cache pass take its NLL and a KL of exactly 0 without running
        the output layer (they are the rows before the first eviction, in open mode)."""
        import torch

        full = self.hidden_full[1 : self.n - 1]
        mine = [h[1 : self.n - 1] for h in hiddens]
        differ = [(full != m).any(dim=1) for m in mine]
        out = [(self.nll_full_series.copy(), np.zeros(full.shape[0])) for _ in hiddens]
        lse_full = torch.from_numpy(np.asarray(self.summary["lse"], dtype=np.float64))
        with torch.no_grad():
            for a in range(0, full.shape[0], CHUNK):
                for (nll, kl), m, d in zip(out, mine, differ, strict=True):
                    r = torch.nonzero(d[a : a + CHUNK])[:, 0] + a
                    if not r.numel():
                        continue
                    logits = self._logits(m[r])
                    lse = torch.logsumexp(logits, dim=1)
                    idx = r.numpy()
                    nll[idx] = (lse - logits.gather(1, self.targets[r, None])[:, 0]).double().numpy()
                    if self._expect is None:  # soft-capped: the full side's log-probabilities, this chunk
                        lp, ref = logits.sub_(lse[:, None]), self._full_log_probs(a)[r - a]
                        kl[idx] = torch.sub(ref, lp, out=lp).mul_(ref.exp()).sum(dim=1).double().numpy()
                    else:
                        shift = ((full[r] - m[r]).double() * self._expect[r]).sum(dim=1)
                        kl[idx] = (shift + lse.double() - lse_full[r]).numpy()
        return out

    def _full_log_probs(self, a: int):
        """The full-cache log-probabilities of positions ``1 + a ..`` (one chunk), kept in memory after
        the first use (a soft-capped model's KL needs them; about 1 GB for 1024 steps of Gemma-2)."""
        import torch

        if a not in self._lp_full:
            self._lp_full[a] = torch.log_softmax(self._logits(self.hidden_full[1 + a : min(1 + a + CHUNK, self.n - 1)]), dim=-1)
        return self._lp_full[a]


@dataclass
class FullPass:
    """What the full-cache pass leaves: token ids ``(n,)``, per layer the traces' rows ``(kv heads, n,
    n)`` float32 and values ``(kv heads, n, d)`` float32, the final hidden states ``(n, width)`` and the
    output layer's summary of them (``Scorer.summary``: per-position NLL and lse ``(n - 2,)``, and
    ``expect`` ``(n - 2, width)`` or None)."""

    ids: np.ndarray
    rows: list[np.ndarray]
    values: list[np.ndarray]
    hidden: np.ndarray
    summary: dict
    #: per layer, what the scorers beyond attention read (``MaskedPass.vectors``): keys, queries and,
    #: where the model has them, out_norms, each per KV head and position-major
    vectors: list[dict[str, np.ndarray]] | None = None


def full_pass_key(model_id: str, text: bytes, steps: int) -> dict:
    return {"version": FULL_PASS_VERSION, "model": model_id, "text": hashlib.sha256(text).hexdigest(), "steps": steps}


def full_pass_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "quality" / f"fullpass-{digest}.npz"


def read_full_pass(key: dict) -> FullPass | None:
    """The cached full pass for ``key``, or None (missing, damaged, or another key's)."""
    try:
        with np.load(full_pass_path(key), allow_pickle=False) as z:
            if json.loads(bytes(z["key"]).decode()) != key:
                return None
            layers = int(z["layers"])
            summary = {"nll": z["nll"], "lse": z["lse"], "expect": z["expect"] if "expect" in z.files else None}
            vectors = [{name: z[f"{name}{i}"] for name in VECTOR_NAMES if f"{name}{i}" in z.files} for i in range(layers)]
            return FullPass(z["ids"], [z[f"rows{i}"] for i in range(layers)], [z[f"values{i}"] for i in range(layers)],
                            z["hidden"], summary, vectors)
    except (OSError, KeyError, ValueError, UnicodeDecodeError, EOFError):
        return None


def write_full_pass(key: dict, fp: FullPass) -> None:
    """Keep ``fp`` under ``key`` (atomically); an unwritable cache costs a full pass next time, nothing else."""
    arrays = {"key": np.frombuffer(json.dumps(key).encode(), dtype=np.uint8), "layers": np.array(len(fp.rows)),
              "ids": fp.ids, "hidden": fp.hidden, "nll": fp.summary["nll"], "lse": fp.summary["lse"]}
    if fp.summary["expect"] is not None:
        arrays["expect"] = fp.summary["expect"]
    arrays.update({f"rows{i}": r for i, r in enumerate(fp.rows)})
    arrays.update({f"values{i}": v for i, v in enumerate(fp.values)})
    for i, layer in enumerate(fp.vectors or []):
        arrays.update({f"{name}{i}": a for name, a in layer.items()})
    path = full_pass_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: np.savez(f, **arrays))
    except OSError:
        pass


__all__ = ["CHUNK", "FullPass", "Scorer", "full_pass_key", "read_full_pass", "write_full_pass"]

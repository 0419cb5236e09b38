"""The output layer's verdict, and the full-cache pass kept on disk: what every truth measurement on
one model and one text shares (``kvsim.models.quality.Session``).

A measurement compares the evicted model's next-token distributions with the full cache's. The
full-cache side (the token ids, the traces with their values, the final hidden states, the
per-position loss) depends only on the model and the text, so it is computed once and kept under
``<cache_dir>/quality/fullpass-<key>.npz`` (uncompressed: it is read far more often than written).
With it, a new process measuring one more configuration needs neither the tokenizer (3 s of Gemma's
load: a 33 MB JSON) nor the full-cache pass (2-7 s), and its numbers are bit-identical to a
session that computed them (the tests hold that).

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
FULL_PASS_VERSION = 1
#: rows of the output layer scored at once (262k words x 128 rows x 4 bytes = 134 MB)
CHUNK = 128


class Scorer:
    """The output layer's verdict on final hidden states ``(n, width)``: the NLL of the next token
    (``targets``: x_2 .. x_N) and KL(full || evicted) at positions 1 .. N-1, against the full-cache
    pass's ``hidden_full``. ``nll_full_series``: the full cache's per-position NLL if known (a cached
    full pass), else computed here (one output-layer pass over every row)."""

    def __init__(self, model, hidden_full, targets, nll_full_series: np.ndarray | None = None):
        import torch

        self.model, self.hidden_full, self.targets = model, hidden_full, targets
        self.n = hidden_full.shape[0]
        self._lp_full = {}  # chunk start -> full-cache log-probabilities (see _full_log_probs)
        if nll_full_series is not None:
            self.nll_full_series = np.asarray(nll_full_series, dtype=np.float64)
            return
        self.nll_full_series = np.empty(self.n - 2)
        with torch.no_grad():
            for a in range(0, self.n - 2, CHUNK):
                lp = self._full_log_probs(a)
                self.nll_full_series[a : a + lp.shape[0]] = -lp.gather(1, targets[a : a + CHUNK, None])[:, 0].double().numpy()

    def _log_probs(self, hidden):
        """log-softmax of the (soft-capped) logits; the capping done in place (the same arithmetic as
        ``tanh(logits / cap) * cap``, bit for bit, without two 134 MB temporaries per chunk)."""
        import torch

        logits = self.model.get_output_embeddings()(hidden).float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
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
            for a in range(0, full.shape[0], CHUNK):
                rows = [torch.nonzero(d[a : a + CHUNK])[:, 0] + a for d in differ]
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
                    diff = torch.sub(ref, lp, out=lp)  # lp is not needed after this: reuse its memory
                    kl[idx] = diff.mul_(ref.exp()).sum(dim=1).double().numpy()
        return out

    def _full_log_probs(self, a: int):
        """The full-cache log-probabilities of positions ``1 + a ..`` (one chunk), kept in memory
        after the first use: the output layer (262k words for Gemma) is most of a measurement's cost,
        and this halves it. About 1 GB for 1024 steps of Gemma."""
        if a not in self._lp_full:
            self._lp_full[a] = self._log_probs(self.hidden_full[1 + a : min(1 + a + CHUNK, self.n - 1)])
        return self._lp_full[a]


@dataclass
class FullPass:
    """What the full-cache pass leaves: token ids ``(n,)``, per layer the traces' rows ``(kv heads, n,
    n)`` float32 and values ``(kv heads, n, d)`` float32, the final hidden states ``(n, width)`` and the
    per-position NLL ``(n - 2,)``."""

    ids: np.ndarray
    rows: list[np.ndarray]
    values: list[np.ndarray]
    hidden: np.ndarray
    nll_full_series: np.ndarray


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
            return FullPass(z["ids"], [z[f"rows{i}"] for i in range(layers)], [z[f"values{i}"] for i in range(layers)],
                            z["hidden"], z["nll"])
    except (OSError, KeyError, ValueError, UnicodeDecodeError, EOFError):
        return None


def write_full_pass(key: dict, fp: FullPass) -> None:
    """Keep ``fp`` under ``key`` (atomically); an unwritable cache costs a full pass next time, nothing else."""
    arrays = {"key": np.frombuffer(json.dumps(key).encode(), dtype=np.uint8), "layers": np.array(len(fp.rows)),
              "ids": fp.ids, "hidden": fp.hidden, "nll": fp.nll_full_series}
    arrays.update({f"rows{i}": r for i, r in enumerate(fp.rows)})
    arrays.update({f"values{i}": v for i, v in enumerate(fp.values)})
    path = full_pass_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: np.savez(f, **arrays))
    except OSError:
        pass


__all__ = ["CHUNK", "FullPass", "Scorer", "full_pass_key", "read_full_pass", "write_full_pass"]

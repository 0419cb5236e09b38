"""What deploys a tuning: the commands and the Python lines that run the recommended windows in a real
KV cache (kvsim.hf, docs/deploy.md), computed from a ``TuneResult``, and one sentence saying what the
tune file deploys by each figure. Text only; no torch."""

from __future__ import annotations

#: what the shipped bundle's manifest names as its model (``kvsim generate --model gemma3-270m`` loads it)
SHIPPED_MODEL = "gemma-3-270m"


def truth_window(result, truth) -> tuple[int, float] | None:
    """What ``kvsim tune``'s default (by the truth, KL) deploys in every layer, read from ``truth``
    (``kvsim.views.window_truth.Truth``): the best KL over tune's candidate windows, with that KL; None when
    the truth has not measured every candidate (then only the model can say)."""
    from ..analysis.tune import candidate_windows

    if truth is None:
        return None
    kl = dict(zip(truth.windows, truth.kl, strict=True))
    candidates = candidate_windows(result)
    if any(w not in kl for w in candidates):
        return None
    best = min(candidates, key=lambda w: (kl[w], w))
    return best, kl[best]


def deploy_snippets(result, bundle: str, model: str, truth=None) -> tuple[str, str, str]:
    """``(sentence, shell, python)`` for the per-layer windows ``result`` recommends by retained mass (what
    the "Your model" view shows): the tune file that deploys exactly them (``--by retained_mass
    --per-layer``) and ``kvsim generate`` run on it; the same windows as a dict handed to
    ``kvsim.hf.cache``; and a sentence naming them beside what tune's default deploys instead (by the
    truth, one window in every layer, with its KL where ``truth`` has every candidate measured).
    ``model`` is the bundle's manifest entry for its model."""
    shipped = SHIPPED_MODEL in model.lower()
    where = "gemma3-270m" if shipped else "MODEL_DIR"
    windows = {r["layer"]: r["recommended_window"] for r in result.per_layer()}
    flags = f"--trace {bundle} --policy {result.policy} --budget {result.budget}"
    shell = "\n".join([
        f"python -m kvsim tune {flags} --by retained_mass --per-layer --serial --json > tune.json",
        f"python -m kvsim generate --model {where} --policy {result.policy} --budget {result.budget} --windows tune.json \\",
        "    --max-new-tokens 200 --prompt-file prompt.txt",
    ])
    load = ("from kvsim.models.loading import load_model\nmodel, tokenizer = load_model()  # the shipped Gemma-3-270M"
            if shipped else "# model, tokenizer: the model this bundle was recorded from (transformers, float32)")
    python = "\n".join([
        "import kvsim.hf",
        load,
        "windows = {  # recommended recent_window per layer, by retained mass",
        *("    " + " ".join(f"{k}: {v}," for k, v in list(windows.items())[i : i + 8]) for i in range(0, len(windows), 8)),
        "}",
        f'cache = kvsim.hf.cache(model, "{result.policy}", {result.budget}, windows=windows)',
        'ids = tokenizer("def heappush(heap, item):", return_tensors="pt").input_ids',
        "out = model.generate(ids, cache=cache, max_new_tokens=200, do_sample=False)",
        "print(tokenizer.decode(out[0]))",
    ])
    lo, hi = min(windows.values()), max(windows.values())
    picked = truth_window(result, truth)
    default = (f"model_window **{picked[0]}** in every layer, KL {picked[1]:.4f} ({truth.source} truth, "
               f"{truth.meta.get('steps', '?')} steps, open loop)" if picked is not None else
               "its model_window in every layer, measured by the model where the recording's model and text are at hand")
    sentence = (f"**Deploy these windows.** A transformers KV cache that holds {result.budget} positions per layer and "
                f"evicts by {result.policy} (kvsim.hf), each layer at its recommended recent_window by retained mass "
                f"({lo} to {hi}; their KL not measured here): the tune file below deploys exactly these "
                f"(`--by retained_mass --per-layer`). Without those flags `tune` deploys what the truth recommends "
                f"(by KL): {default}; `--per-layer` then searches per-layer windows by the truth from there.")
    return sentence, shell, python

"""What deploys a tuning: the commands and the Python lines that run the recommended windows in a real
KV cache (kvsim.hf, docs/deploy.md), computed from a ``TuneResult``. Text only; no torch."""

from __future__ import annotations

#: what the shipped bundle's manifest names as its model (``kvsim generate --model gemma`` loads it)
SHIPPED_MODEL = "gemma-3-270m"


def deploy_snippets(result, bundle: str, model: str) -> tuple[str, str]:
    """``(shell, python)``: the tune file written and ``kvsim generate`` run on it; and the same windows
    as a dict handed to ``kvsim.hf.cache``. ``model`` is the bundle's manifest entry for its model."""
    shipped = SHIPPED_MODEL in model.lower()
    where = "gemma" if shipped else "MODEL_DIR"
    windows = {r["layer"]: r["recommended_window"] for r in result.per_layer()}
    shell = "\n".join([
        f"python -m kvsim tune --trace {bundle} --policy {result.policy} --budget {result.budget} --serial --json > tune.json",
        f"python -m kvsim generate --model {where} --policy {result.policy} --budget {result.budget} --windows tune.json \\",
        "    --max-new-tokens 200 --prompt-file prompt.txt",
    ])
    load = ("from kvsim.models.loading import load_model\nmodel, tokenizer = load_model()  # the shipped Gemma-3-270M"
            if shipped else "# model, tokenizer: the model this bundle was recorded from (transformers, float32)")
    python = "\n".join([
        "import kvsim.hf",
        load,
        "windows = {  # recommended recent_window per layer",
        *("    " + " ".join(f"{k}: {v}," for k, v in list(windows.items())[i : i + 8]) for i in range(0, len(windows), 8)),
        "}",
        f'cache = kvsim.hf.cache(model, "{result.policy}", {result.budget}, windows=windows)',
        'ids = tokenizer("def heappush(heap, item):", return_tensors="pt").input_ids',
        "out = model.generate(ids, cache=cache, max_new_tokens=200, do_sample=False)",
        "print(tokenizer.decode(out[0]))",
    ])
    return shell, python

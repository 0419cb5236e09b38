"""How many bytes a KV cache is: the arithmetic behind the app's memory panel, pure and small.

A decoder layer stores, for every position it holds, one key and one value vector per KV head, each
``head_dim`` numbers of the cache's dtype. So one position of the whole model costs

    layers x KV heads x head_dim x 2 (K and V) x bytes per number

and a cache of ``n`` positions in every layer and KV head costs ``n`` times that. A budget ``B`` (per
layer and KV head, as kvsim's policies and the deployed cache count it) holds ``min(B, n)`` of them.

The shapes are the models' published configs (Hugging Face ``config.json`` field names quoted in
``source``); the dtype is bf16 (2 bytes), as such models are served. kvsim's own CPU runs are float32,
twice these figures. Gemma 3 keeps most layers to a sliding window (``sliding_window``, one global layer
in every ``sliding_window_pattern``): ``windowed_bytes`` is the cache those layers really need.

Nothing here imports numpy or the simulator: the app draws the panel without loading either.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: bf16 and float16: the dtype these models are served in
BF16 = 2
#: one KiB, MiB, GiB: the panel's units are binary, as memory is sold and reported
UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
#: the lengths of the larger models' table: 32k and 128k tokens
TABLE_LENGTHS = (32_768, 131_072)


@dataclass(frozen=True)
class ModelShape:
    """What sets a model's KV-cache size: its attention layers, KV heads per layer, and dims per head."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    #: where the figures come from (the config's fields)
    source: str = ""
    dtype_bytes: int = BF16
    #: layers that attend only over a sliding window of ``window`` positions (Gemma 3's local layers)
    sliding_layers: int = 0
    window: int | None = None

    @property
    def per_layer_position(self) -> int:
        """Bytes of one position in one layer: K and V for every KV head."""
        return self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def per_position(self) -> int:
        """Bytes of one position in every layer."""
        return self.layers * self.per_layer_position

    def full_bytes(self, positions: int) -> int:
        """A full cache of ``positions``: every layer and KV head holds every position."""
        return positions * self.per_position

    def budget_bytes(self, budget: int, positions: int) -> int:
        """A cache holding at most ``budget`` positions in each layer and KV head, after ``positions``."""
        return min(budget, positions) * self.per_position

    def windowed_bytes(self, positions: int) -> int:
        """The full cache as the model itself needs it: its sliding-window layers hold only their window."""
        if not self.sliding_layers or self.window is None:
            return self.full_bytes(positions)
        global_layers = self.layers - self.sliding_layers
        return self.per_layer_position * (global_layers * positions + self.sliding_layers * min(positions, self.window))

    def arithmetic(self) -> str:
        """``18 layers x 1 KV head x 256 dims x 2 (K and V) x 2 bytes = 18,432 bytes``."""
        heads = f"{self.kv_heads} KV head{'s' if self.kv_heads != 1 else ''}"
        layers = f"{self.layers} layer{'s' if self.layers != 1 else ''}"
        return (f"{layers} x {heads} x {self.head_dim} dims x 2 (K and V) x {self.dtype_bytes} bytes "
                f"= {self.per_position:,} bytes")


#: the models kvsim records, as their configs (and the shipped GGUF's header) state them
GEMMA3_270M = ModelShape(
    "Gemma-3-270M", 18, 1, 256, "config: num_hidden_layers 18, num_key_value_heads 1, head_dim 256, sliding_window 512 "
    "(the shipped GGUF: gemma3.block_count, attention.head_count_kv, attention.key_length)", sliding_layers=15, window=512)
SMOLLM2_135M = ModelShape(
    "SmolLM2-135M", 30, 3, 64, "config: num_hidden_layers 30, num_key_value_heads 3, "
    "hidden_size 576 / num_attention_heads 9 = head_dim 64")
#: patterns of a trace's ``model`` field (case and separators ignored) to the model's shape
RECORDED = {"gemma3270m": GEMMA3_270M, "smollm2135m": SMOLLM2_135M}

#: larger models, for scale (bf16, every layer at the full length unless ``windowed_bytes``)
LARGER = (
    ModelShape("Llama-3.1-8B", 32, 8, 128, "num_hidden_layers 32, num_key_value_heads 8, hidden_size 4096 / "
               "num_attention_heads 32 = head_dim 128 (Llama-3-8B has the same shapes and an 8k context)"),
    ModelShape("Qwen3-8B", 36, 8, 128, "num_hidden_layers 36, num_key_value_heads 8, head_dim 128"),
    ModelShape("Gemma-3-27B", 62, 16, 128, "text_config: num_hidden_layers 62, num_key_value_heads 16, head_dim 128, "
               "sliding_window 1024, sliding_window_pattern 6 (52 of 62 layers local)", sliding_layers=52, window=1024),
)

#: one KV head of one layer at a common head_dim: the unit the simulator replays, for a trace with no model
ONE_HEAD = ModelShape("one KV head of one layer (head_dim 128, bf16)", 1, 1, 128, "an example: head_dim 128 is "
                      "Llama-3's, Qwen3's and Gemma-3-27B's")


def model_of(meta: Mapping) -> ModelShape | None:
    """The shape of the model a trace was recorded from, by its meta's ``model`` (None when it names no
    model kvsim knows the config of)."""
    model = meta.get("model") if isinstance(meta, Mapping) else None
    if not isinstance(model, str):
        return None
    squeezed = re.sub(r"[^a-z0-9]", "", model.lower())
    return next((shape for key, shape in RECORDED.items() if key in squeezed), None)


def human(n: float) -> str:
    """``18.0 KiB``, ``4.00 GiB``, ``512 bytes``: three significant figures in binary units."""
    for unit, size in UNITS:
        if n >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 1000 else f"{v:,.0f} {unit}"
    return f"{int(n):,} bytes"


def table(shapes: Sequence[ModelShape], budget: int, lengths: Sequence[int] = TABLE_LENGTHS) -> list[dict]:
    """A row per model and length: the full cache, the budget's cache, and the budget's share of the full."""
    rows = []
    for shape in shapes:
        for n in lengths:
            full, kept = shape.full_bytes(n), shape.budget_bytes(budget, n)
            rows.append({"model": shape.name, "tokens": n, "per position": shape.per_position, "full cache": full,
                         "own windows": shape.windowed_bytes(n), f"budget {budget}": kept, "share": kept / full})
    return rows


__all__ = ["BF16", "GEMMA3_270M", "LARGER", "ONE_HEAD", "RECORDED", "SMOLLM2_135M", "TABLE_LENGTHS", "ModelShape",
           "human", "model_of", "table"]

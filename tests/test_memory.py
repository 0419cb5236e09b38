"""Issue 44, item 4: how many bytes a KV cache is (``kvsim.analysis.memory``). Every expected value is
the arithmetic written out: layers x KV heads x head_dim x 2 (K and V) x 2 bytes (bf16)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvsim.analysis import memory

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30


def test_bytes_per_position_is_layers_heads_dims_k_and_v_bytes():
    assert memory.GEMMA3_270M.per_position == 18 * 1 * 256 * 2 * 2 == 18_432
    assert memory.SMOLLM2_135M.per_position == 30 * 3 * 64 * 2 * 2 == 23_040
    llama, qwen, gemma = memory.LARGER
    assert llama.per_position == 32 * 8 * 128 * 2 * 2 == 131_072  # 128 KiB a token
    assert qwen.per_position == 36 * 8 * 128 * 2 * 2 == 147_456
    assert gemma.per_position == 62 * 16 * 128 * 2 * 2 == 507_904
    assert memory.ONE_HEAD.per_position == 128 * 2 * 2 == 512
    assert memory.GEMMA3_270M.arithmetic() == "18 layers x 1 KV head x 256 dims x 2 (K and V) x 2 bytes = 18,432 bytes"


def test_the_larger_models_at_32k_and_128k():
    llama, qwen, gemma = memory.LARGER
    assert llama.full_bytes(32_768) == 4 * GIB and llama.full_bytes(131_072) == 16 * GIB
    assert qwen.full_bytes(131_072) == 18 * GIB
    assert gemma.full_bytes(131_072) == 62 * GIB
    # Gemma 3's 52 local layers hold 1,024 positions each, its 10 global layers all 131,072
    assert gemma.windowed_bytes(131_072) == 16 * 128 * 2 * 2 * (10 * 131_072 + 52 * 1_024) == 11_173_625_856
    assert llama.windowed_bytes(131_072) == llama.full_bytes(131_072)  # no sliding layers


def test_a_budget_holds_its_positions_in_every_layer_and_head():
    llama = memory.LARGER[0]
    assert llama.budget_bytes(256, 131_072) == 256 * 131_072 == 32 * (1 << 20)
    assert llama.budget_bytes(256, 100) == llama.full_bytes(100)  # a budget above the length holds everything
    g = memory.GEMMA3_270M
    assert g.full_bytes(1_025) == 18_892_800 and g.budget_bytes(256, 1_025) == 4_718_592
    rows = memory.table(memory.LARGER, 256)
    assert [(r["model"], r["tokens"]) for r in rows] == [(s.name, n) for s in memory.LARGER for n in (32_768, 131_072)]
    assert rows[1]["full cache"] == 16 * GIB and rows[1]["budget 256"] == 32 * (1 << 20)
    assert rows[1]["share"] == pytest.approx(256 / 131_072)


def test_human_units_are_binary_and_short():
    assert memory.human(512) == "512 bytes"
    assert memory.human(18_432) == "18 KiB"
    assert memory.human(4_718_592) == "4.5 MiB"
    assert memory.human(16 * GIB) == "16 GiB"
    assert memory.human(11_173_625_856) == "10.4 GiB"
    assert memory.human(2_000 * GIB) == "2,000 GiB"


def test_the_model_is_read_from_the_trace_meta():
    shipped = json.loads((ROOT / "traces" / "gemma3-270m-heapq" / "manifest.json").read_text())
    assert memory.model_of(shipped) is memory.GEMMA3_270M
    assert memory.model_of({"model": "HuggingFaceTB/SmolLM2-135M-Instruct, 4-bit GGUF (Q4_1)"}) is memory.SMOLLM2_135M
    assert memory.model_of({"name": "canonical", "source": "kvsim.canonical.generate"}) is None
    assert memory.model_of({"model": "some/other-model"}) is None and memory.model_of({"model": 3}) is None


def test_the_shipped_bundle_agrees_with_the_gemma_shape():
    """The recorded bundle's own manifest: its layers, KV heads, sliding layers and window are the shape's."""
    shipped = json.loads((ROOT / "traces" / "gemma3-270m-heapq" / "manifest.json").read_text())
    g = memory.GEMMA3_270M
    assert len(shipped["layers"]) == g.layers and shipped["kv_heads"] == g.kv_heads
    assert sum(t["attention"] == "sliding" for t in shipped["traces"]) == g.sliding_layers
    assert shipped["sliding_window"] == g.window


def test_the_module_itself_imports_nothing_heavy():
    """Run on its own (not through kvsim's package), the module loads neither numpy nor plotly nor pandas."""
    code = ("import runpy, sys; runpy.run_path('kvsim/analysis/memory.py'); "
            "print(sorted(m for m in ('numpy', 'numba', 'pandas', 'plotly', 'streamlit') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"

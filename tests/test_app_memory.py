"""Issue 44, item 4: the sidebar's memory panel, through AppTest. Folded, it draws nothing; open, it says the
bytes of the trace's own model (or that the trace names none), what the budget holds against the full
cache at the trace's length, the larger models' table, and that the simulator masks where the deployed
cache frees."""

from __future__ import annotations

from test_app import problems, run, widget

from kvsim.app.memory_panel import LABEL, MEMORY_OPEN


def sidebar_text(at) -> str:
    return " ".join(m.value for m in at.sidebar.markdown)


def opened(query: dict):
    at = run(query)
    assert problems(at) == [] and LABEL in {e.label for e in at.expander}
    assert "bytes" not in sidebar_text(at)  # folded: nothing of it is drawn
    at.session_state[MEMORY_OPEN] = True
    return at.run()


def test_the_panel_gives_the_recorded_models_bytes_and_the_budgets_share():
    at = opened({"trace": "gemma3-270m-heapq:L05", "policies": "h2o"})
    text = sidebar_text(at)
    assert problems(at) == []
    # 18 layers x 1 KV head x 256 x 2 x 2 = 18,432 bytes; 1,025 positions; budget 256 of them
    assert "**Gemma-3-270M**, this trace's model" in text
    assert "18 layers x 1 KV head x 256 dims x 2 (K and V) x 2 bytes = 18,432 bytes" in text
    assert "full cache is **18 MiB**; budget 256 in every layer and KV head holds **4.5 MiB**, 25% of the full cache" in text
    assert ("- **Llama-3.1-8B**, 128 KiB a token: full cache 4 GiB at 32k, 16 GiB at 128k; budget 256: **32 MiB** "
            "(0.78%, 0.2%)") in text
    assert "- **Gemma-3-27B**, 496 KiB a token: full cache 15.5 GiB at 32k, 62 GiB at 128k; budget 256: **124 MiB**" in text
    assert "only masked out of attention" in text and "really frees them" in text
    widget(at, "number_input", "budget").set_value(512).run()
    text = sidebar_text(at)
    assert "budget 512 in every layer and KV head holds **9 MiB**, 50% of the full cache" in text
    assert "- **Llama-3.1-8B**, 128 KiB a token: full cache 4 GiB at 32k, 16 GiB at 128k; budget 512: **64 MiB** (1.6%, 0.39%)" in text


def test_a_trace_with_no_model_says_so_and_shows_one_head():
    at = opened({})
    text = sidebar_text(at)
    assert problems(at) == []
    assert "**This trace names no model**" in text
    # one KV head of one layer at head_dim 128, bf16: 512 bytes a position; 4,097 positions; budget 256
    assert "= **512 bytes**. Its 4,097 positions: 2 MiB; budget 256: **128 KiB**, 6.25% of the full cache" in text

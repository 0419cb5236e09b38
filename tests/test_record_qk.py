"""``kvsim record --store qk``: the query/key trace (traces/README.md, "Query/key traces"; docs/domain.md, "Query/key traces") on tiny
Hugging Face models built here from configs (random weights, grouped-query attention, sliding-window
layers, Gemma 2's soft-capped logits); nothing is downloaded.

The check that matters: a qk file's rows, computed here with plain NumPy from its ``q``, ``k`` and the
constants in its meta exactly as the contract states them, equal the dense recorder's rows of the same
text and model, and a plain eager forward's, for every layer and KV head, mean and max GQA.

Needs the recorder's extra (torch, transformers, tokenizers); skipped with that reason without it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvsim.models.qkv_capture import block_rows
from kvsim.models.record import choose_store

torch = pytest.importorskip("torch", reason="the recorder's extra is not installed (pip install -r requirements-record.txt)")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import tiny_models  # noqa: E402  (tests/, beside this file)
from tolerance import qk_file_rows, rounding  # noqa: E402

from kvsim import cli  # noqa: E402
from kvsim.data.bundle import load_bundle  # noqa: E402
from kvsim.data.trace import unpack_lower  # noqa: E402
from kvsim.models.errors import RecordError  # noqa: E402
from kvsim.models.record import RecordConfig, record  # noqa: E402
from kvsim.models.recorder import kv_head_rows  # noqa: E402

TEXT = tiny_models.TEXT
STEPS = 40
WINDOW = 6
CHUNK = 4 * 7 * (STEPS + 1)  # blocks of 7 rows (global) or more (sliding): block seams and key spans are tested
#: family -> (global layers, sliding layers)
FAMILIES = {"llama": ([0, 1], []), "qwen2": ([0], [1, 2]), "gemma3": ([1], [0, 2]), "gemma2": ([1], [0])}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> folder of a saved tiny model with its tokenizer, and the text file."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny-qk")
    tokenizer, vocab = tiny_models.tokenizer(TEXT, 300)
    folders = {}
    for i, family in enumerate(FAMILIES):
        torch.manual_seed(10 + i)
        cfg = tiny_models.config(family, vocab, hidden=32, intermediate=64, max_positions=256, head_dim=8, window=WINDOW)
        model = AutoModelForCausalLM.from_config(cfg)
        _sharpen(model)
        model.save_pretrained(root / family)
        tokenizer.save_pretrained(root / family)
        folders[family] = root / family
    text = root / "text.txt"
    text.write_text(TEXT)
    return folders, text


def _sharpen(model) -> None:
    """Logits of a few units instead of a random model's near-zero ones, so the rows are far from uniform
    and Gemma 2's cap at 0.5 bends them (Gemma 3 normalises q and k, so its norms' weights are raised)."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "q_norm"):
                attn.q_norm.weight.fill_(3.0)
                attn.k_norm.weight.fill_(3.0)
            else:
                attn.q_proj.weight.mul_(20.0)
                attn.k_proj.weight.mul_(20.0)


def contract_rows(path) -> np.ndarray:
    """The ``(T + 1, T + 1)`` rows a qk file stands for, from its members alone, as qk_format.md states them."""
    with np.load(path, allow_pickle=False) as z:
        q, k = z["q"].astype(np.float64), z["k"].astype(np.float64)
        meta = json.loads(bytes(z["meta"]).decode("utf-8"))
    n = k.shape[0]
    s = np.einsum("gtd,pd->gtp", q, k) * meta["scale"]
    if meta["softcap"] is not None:
        s = meta["softcap"] * np.tanh(s / meta["softcap"])
    t, p = np.arange(n)[:, None], np.arange(n)[None, :]
    visible = p <= t if meta["sliding_window"] is None else (p <= t) & (p > t - meta["sliding_window"])
    s = np.where(visible, s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    rows = np.tril(w.mean(axis=0) if meta["gqa"] == "mean" else w.max(axis=0), -1)
    rows[1:] /= rows[1:].sum(axis=1, keepdims=True)
    return rows


def _dense(path) -> np.ndarray:
    with np.load(path, allow_pickle=False) as z:
        return unpack_lower(z["attention_packed"], int(z["steps"])).astype(np.float64)


def _plain_eager(folder, text, layer: int, gqa: str) -> list[np.ndarray]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder)(text.read_text(), return_tensors="pt").input_ids[:, : STEPS + 1]
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions[layer][0].double().numpy()
    return kv_head_rows(att, model.config.num_key_value_heads, gqa)


def _record(folders, text, out, family, store, gqa="mean", dtype="float32"):
    return record(RecordConfig(text, out, model=folders[family], steps=STEPS, layers="all", gqa=gqa, dtype=dtype,
                               store=store, chunk_elements=CHUNK), progress=None)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("gqa", ["mean", "max"])
def test_qk_rows_equal_the_dense_recorders_and_a_plain_eager_forwards(tiny, tmp_path, family, gqa):
    folders, text = tiny
    qk = _record(folders, text, tmp_path / "qk", family, "qk", gqa)
    _record(folders, text, tmp_path / "dense", family, "dense", gqa)
    assert qk["store"] == "qk" and all(f["path"].endswith(".qk.npz") for f in qk["files"])
    for layer in sorted(sum(FAMILIES[family], [])):
        eager = _plain_eager(folders[family], text, layer, gqa)
        for h in (0, 1):
            path = tmp_path / "qk" / f"{family}-L{layer:02d}-kv{h}.qk.npz"
            got, bound = contract_rows(path), qk_file_rows(path)
            dense = _dense(tmp_path / "dense" / f"{family}-L{layer:02d}-kv{h}.npz")
            # both are float32 softmaxes of these queries and keys: within float32 rounding of the exact rows
            np.testing.assert_allclose(got, dense, rtol=0, atol=bound, err_msg=f"{family} L{layer} kv{h} vs dense")
            np.testing.assert_allclose(got, eager[h], rtol=0, atol=bound, err_msg=f"{family} L{layer} kv{h} vs eager")


def test_qk_file_holds_what_the_contract_lists(tiny, tmp_path):
    folders, text = tiny
    _record(folders, text, tmp_path / "g3", "gemma3", "qk", dtype="float16")
    bundle = load_bundle(tmp_path / "g3")
    assert bundle.manifest["store"] == "qk" and bundle.manifest["steps"] == STEPS
    cfg = transformers.AutoConfig.from_pretrained(folders["gemma3"])
    for entry in bundle.traces:
        with np.load(entry.path, allow_pickle=False) as z:
            assert sorted(z.files) == ["k", "meta", "out_norms", "q", "v"]
            assert z["q"].shape == (2, STEPS + 1, 8) and z["k"].shape == z["v"].shape == (STEPS + 1, 8)
            assert z["out_norms"].shape == (STEPS + 1, 2)
            assert {z[m].dtype for m in ("q", "k", "v", "out_norms")} == {np.dtype(np.float16)} and z["meta"].dtype == np.uint8
            meta = json.loads(bytes(z["meta"]).decode("utf-8"))
        sliding = entry.layer in FAMILIES["gemma3"][1]
        assert (meta["format"], meta["version"], meta["steps"], meta["dtype"]) == ("kvsim-qk", 1, STEPS, "float16")
        assert (meta["layer"], meta["head"], meta["query_heads"]) == (entry.layer, entry.head, [2 * entry.head, 2 * entry.head + 1])
        # the module's scale, a float32 power of the config's scalar, against the float64 one: one rounding
        assert meta["scale"] == pytest.approx(cfg.query_pre_attn_scalar ** -0.5, rel=rounding(1)) and meta["softcap"] is None
        assert meta["sliding_window"] == (WINDOW if sliding else None) == entry.sliding_window
        assert entry.attention == ("sliding" if sliding else "global") and meta["gqa"] == "mean"
        assert meta["text"]["sha256"] == meta["source_sha256"] and len(meta["tokens"]) == STEPS + 1
        # the layer's own RoPE base (tests/test_record_vectors.py checks it rotates the model's keys)
        assert (meta["rope_theta"], meta["rope_layout"], meta["head_dim"]) == (
            cfg.rope_parameters["sliding_attention" if sliding else "full_attention"]["rope_theta"], "rotate_half", 8)
        # float16 queries and keys: the rows stay within float16 rounding of the float32 ones
        dense = _dense(_record_once_dense(folders, text, tmp_path) / f"gemma3-L{entry.layer:02d}-kv{entry.head}.npz")
        np.testing.assert_allclose(contract_rows(entry.path), dense, rtol=0, atol=qk_file_rows(entry.path))


def _record_once_dense(folders, text, tmp_path):
    out = tmp_path / "g3-dense"
    if not out.exists():
        _record(folders, text, out, "gemma3", "dense")
    return out


def test_gemma2_softcap_is_recorded_and_changes_the_rows(tiny, tmp_path):
    folders, text = tiny
    _record(folders, text, tmp_path / "g2", "gemma2", "qk")
    path = tmp_path / "g2" / "gemma2-L01-kv0.qk.npz"
    with np.load(path, allow_pickle=False) as z:
        arrays = {m: z[m] for m in z.files}
    meta = json.loads(bytes(arrays["meta"]).decode())
    assert meta["softcap"] == 0.5 and meta["sliding_window"] is None
    uncapped = tmp_path / "uncapped.qk.npz"
    arrays["meta"] = np.frombuffer(json.dumps({**meta, "softcap": None}).encode(), dtype=np.uint8)
    np.savez(uncapped, **arrays)
    # so the equality test above can fail: the cap moves the rows far past their rounding
    assert np.abs(contract_rows(uncapped) - contract_rows(path)).max() > 2 * qk_file_rows(path)


def test_attention_sinks_are_refused_for_qk_in_one_line(tmp_path, tiny):
    from transformers import AutoModelForCausalLM, GptOssConfig

    _, text = tiny
    tokenizer, vocab = tiny_models.tokenizer(TEXT, 300)
    cfg = GptOssConfig(vocab_size=vocab, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=WINDOW,
                       layer_types=["full_attention"], max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.model.layers[0].self_attn.sinks.fill_(3.0)  # a sink worth e^3: the weights are far from plain softmax
    model.save_pretrained(tmp_path / "oss")
    tokenizer.save_pretrained(tmp_path / "oss")
    with pytest.raises(RecordError, match=r"^layer 0: the model's eager attention is not softmax\(softcap\(scale q\.k\)\).*"
                                          r"record it with --store dense$"):
        record(RecordConfig(text, tmp_path / "out", model=tmp_path / "oss", steps=STEPS, layers="all", store="qk"),
               progress=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["oss"]  # nothing half-written, no temporary folder left


@pytest.mark.parametrize("words, steps, message, status", [
    (360, 300, "--steps 300: the model's context is 256 tokens (max_position_embeddings), so at most --steps 255", 2),
    (5, 40, "TEXT: {tmp}/short.txt: the text has", 1),  # the text is short, not the command line wrong
])
def test_bad_steps_are_one_line_and_leave_nothing(tiny, tmp_path, capsys, words, steps, message, status):
    folders, _ = tiny
    text = tmp_path / "short.txt"
    text.write_text(" ".join((TEXT.split() * 3)[:words]))
    out = tmp_path / "out"
    code = cli.main(["record", str(text), "--model", str(folders["llama"]), "--out", str(out), "--store", "qk", "--quiet",
                     "--steps", str(steps)])
    _, err = capsys.readouterr()
    assert code == status and err.count("\n") == 1 and message.format(tmp=tmp_path) in err
    assert [p.name for p in tmp_path.iterdir()] == ["short.txt"]


def test_an_existing_output_folder_is_refused_and_kept(tiny, tmp_path, capsys):
    folders, text = tiny
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    code = cli.main(["record", str(text), "--model", str(folders["llama"]), "--out", str(out), "--steps", "10", "--quiet"])
    _, err = capsys.readouterr()
    assert code == 1 and err == (f"kvsim: error: --out: {out}: already exists; give a new folder (a recording never writes "
                                 "into an old one)\n")
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_without_out_the_bundle_is_recorded_once_into_the_cache(tiny, tmp_path, capsys, monkeypatch):
    folders, text = tiny
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    args = ["record", str(text), "--model", str(folders["qwen2"]), "--steps", "20", "--layers", "all", "--store", "qk", "--json"]
    assert cli.main(args) == 0
    first, err = capsys.readouterr()
    first = json.loads(first)
    assert "loading" in err and "cached" not in first
    bundle = tmp_path / "cache" / "recordings"
    [folder] = bundle.iterdir()
    assert folder.name.startswith("qwen2-20-qk-") and first["bundle"] == str(folder)
    assert cli.main(args) == 0
    again, err = capsys.readouterr()
    again = json.loads(again)
    assert "loading" not in err and "already recorded" in err and again["cached"] is True
    assert again["files"] == first["files"] and again["bundle"] == first["bundle"]
    assert cli.main([*args[:5], "30", *args[6:]]) == 0  # other settings: another entry
    capsys.readouterr()
    assert len(list(bundle.iterdir())) == 2


def test_auto_store_is_the_smaller_file():
    # Gemma-3-270M: 4 query heads per KV head, head_dim 256: dense up to 4096 steps, qk above
    assert [choose_store("auto", s, 4, 256) for s in (1024, 3073, 4096, 4097, 20000)] == ["dense", "dense", "dense", "qk", "qk"]
    assert choose_store("auto", 8192, 64, 256) == "dense"  # 66 x 256 floats per position: larger than the rows at 8192
    assert choose_store("auto", 20000, 64, 4096) == "qk"  # beyond the dense format's 16384 steps whatever the size
    assert choose_store("dense", 10**4, 4, 256) == "dense" and choose_store("qk", 8, 4, 256) == "qk"


@pytest.mark.parametrize("heads, n, window", [(4, 32768, None), (4, 32768, 512), (4, 100, 512), (1, 7, 3), (8, 5000, 4096)])
def test_a_block_holds_at_most_chunk_elements_of_weights(heads, n, window):
    chunk = 1 << 24
    rows = block_rows(heads, n, window, chunk)
    seen = n if window is None else min(n, rows + window - 1)
    assert rows >= 1 and heads * rows * seen <= max(chunk, heads * seen)
    if window is not None and window < n // 4:
        assert rows > block_rows(heads, n, None, chunk)  # a sliding layer takes more rows per block


@pytest.mark.parametrize("window", [None, 5, 64])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_a_blocks_keys_are_every_key_its_mask_shows(window, use_vmap):
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    from kvsim.models.qkv_capture import LazyMask, stripes

    n = 50
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    args = dict(batch_size=1, q_length=n, kv_length=n, mask_function=fn, attention_mask=None, local_size=window,
                device="cpu", dtype=torch.float32, use_vmap=use_vmap)
    full = sdpa_mask(**{**args, "allow_is_causal_skip": False})[0, 0]
    blocks = list(stripes(LazyMask(args), n, 7))
    assert [b[0] for b in blocks] == list(range(0, n, 7))
    for i, j, stripe, lo, hi in blocks:
        seen = torch.nonzero(full[i:j].any(dim=0)).flatten()
        assert (lo, hi) == (int(seen[0]), int(seen[-1]) + 1)
        assert torch.equal(stripe, full[i:j, lo:hi]) and not full[i:j, :lo].any() and not full[i:j, hi:].any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_device_cuda_without_a_cuda_device_is_one_line_before_anything_is_loaded(tiny, tmp_path, capsys, monkeypatch):
    folders, text = tiny
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    code = cli.main(["record", str(text), "--model", str(folders["gemma3"]), "--store", "qk", "--steps", "20",
                     "--device", "cuda"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err == "kvsim: error: --device cuda: torch sees no CUDA device\n"
    assert list(tmp_path.iterdir()) == []  # no cache folder, no temporary bundle

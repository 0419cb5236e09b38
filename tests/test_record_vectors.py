"""What the recorder stores besides attention (issue 34, item 4): the per-head output norms
``|W_O^h v_p|`` (``out_norms``), the keys and queries of a dense recording with ``--vectors``, and the
rotary constants in every meta (``kvsim.models.layer_vectors``; docs/domain.md section 10).

On tiny Hugging Face models built here from configs (random weights; nothing is downloaded): the out_norms
equal the model's own o_proj applied to each head's value; the rotary constants in the meta rotate the
model's own pre-RoPE keys into the recorded keys; qk and dense files round-trip their members; files
without them still load; bad members are refused in one line naming the file and the member.

Needs the recorder's extra (torch, transformers, tokenizers); skipped with that reason without it.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from kvsim.data import vectors
from kvsim.data.qk_files import load_qk, save_qk
from kvsim.data.trace import TraceError, from_array, load_npz, save_npz

torch = pytest.importorskip("torch", reason="the recorder's extra is not installed (pip install -r requirements-record.txt)")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import tiny_models  # noqa: E402  (tests/, beside this file)
from tolerance import EPS32, forward_pass, rounding64  # noqa: E402

from kvsim import cli  # noqa: E402
from kvsim.models.record import RecordConfig, record  # noqa: E402

TEXT = tiny_models.TEXT
STEPS = 30
WINDOW = 6
HEAD_DIM = 8
#: family -> its layers (Gemma 3: sliding, global, sliding, with RoPE bases 10,000 and 1,000,000)
FAMILIES = {"gemma3": 3, "llama": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> folder of a saved tiny model with its tokenizer, and the text file."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny-vectors")
    tokenizer, vocab = tiny_models.tokenizer(TEXT, 300)
    folders = {}
    for i, family in enumerate(FAMILIES):
        torch.manual_seed(30 + i)
        cfg = tiny_models.config(family, vocab, hidden=32, intermediate=64, max_positions=256, head_dim=HEAD_DIM,
                                 window=WINDOW)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # output norms of a few units rather than a random init's small ones
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(3.0)
        model.save_pretrained(root / family)
        tokenizer.save_pretrained(root / family)
        folders[family] = root / family
    text = root / "text.txt"
    text.write_text(TEXT)
    return folders, text


@pytest.fixture(scope="module")
def recorded(tiny, tmp_path_factory):
    """family -> {"qk": folder, "dense": folder}: every layer, float32, qk and dense --vectors."""
    folders, text = tiny
    root = tmp_path_factory.mktemp("recorded")
    out = {}
    for family in FAMILIES:
        out[family] = {}
        for store in ("qk", "dense"):
            folder = root / f"{family}-{store}"
            record(RecordConfig(text, folder, model=folders[family], steps=STEPS, layers="all", dtype="float32",
                                store=store, vectors=store == "dense"), progress=None)
            out[family][store] = folder
    return out


def _model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def _files(folder, layer: int, suffix: str):
    return [folder / f"{folder.name.split('-')[0]}-L{layer:02d}-kv{h}{suffix}" for h in (0, 1)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_out_norms_are_the_o_proj_of_each_heads_value(tiny, recorded, family):
    folders, _ = tiny
    model = _model(folders[family])
    heads, group = model.config.num_attention_heads, 2
    for layer in range(FAMILIES[family]):
        o_proj = model.model.layers[layer].self_attn.o_proj
        weight = o_proj.weight.detach().double()
        for h, path in enumerate(_files(recorded[family]["qk"], layer, ".qk.npz")):
            with np.load(path, allow_pickle=False) as z:
                v, norms = z["v"], z["out_norms"]
            assert norms.shape == (STEPS + 1, group) and norms.dtype == np.float32
            for g in range(group):
                head = h * group + g
                # the o_proj's input with head `head`'s value in its slot and zeros elsewhere, through the
                # layer's own Linear (bias removed: it is added for every head and position alike)
                x = torch.zeros((STEPS + 1, heads * HEAD_DIM), dtype=torch.float64)
                x[:, head * HEAD_DIM : (head + 1) * HEAD_DIM] = torch.from_numpy(v.astype(np.float64))
                direct = torch.nn.functional.linear(x, weight).norm(dim=-1).numpy()
                # both in float64 from the same float32 weights and values; the stored one rounded once to
                # float32 (EPS32 relative), each float64 norm within rounding64 of a hidden x d_v sum
                tol = EPS32 + 2 * rounding64(model.config.hidden_size * HEAD_DIM)
                np.testing.assert_allclose(norms[:, g], direct, rtol=tol, atol=0, err_msg=f"L{layer} kv{h} g{g}")
            assert (norms > 0).all()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dense_vectors_are_the_qk_files_members(recorded, family):
    for layer in range(FAMILIES[family]):
        for qk_path, dense_path in zip(_files(recorded[family]["qk"], layer, ".qk.npz"),
                                       _files(recorded[family]["dense"], layer, ".npz"), strict=True):
            qk, dense = load_qk(qk_path), load_npz(dense_path)
            # one pass each, the same blocks over the same layers: the same float32 numbers
            np.testing.assert_array_equal(dense.keys, qk.keys)
            np.testing.assert_array_equal(dense.queries, qk.queries)
            np.testing.assert_array_equal(dense.values, qk.values)
            np.testing.assert_array_equal(dense.out_norms, qk.out_norms)
            assert dense.queries.shape == (STEPS + 1, 2, HEAD_DIM) and dense.out_norms.shape == (STEPS + 1, 2)
            assert dense.meta["vectors"] == ["keys", "out_norms", "queries", "values"]
            got = vectors.require(dense, vectors.MEMBERS, "test")
            assert sorted(got) == sorted(vectors.MEMBERS)


def _rotate(x: np.ndarray, positions: np.ndarray, meta: dict) -> np.ndarray:
    """RoPE as the meta states it: angle i of position p is ``p * theta ** (-2 i / d)``, dimension i paired
    with i + d/2 (``rotate_half``)."""
    assert meta["rope_layout"] == "rotate_half"
    d = meta["rope_dim"]
    inv = 1.0 / meta["rope_theta"] ** (np.arange(0, d, 2) / d)
    angle = positions[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([angle, angle], 1)), np.sin(np.concatenate([angle, angle], 1))
    half = np.concatenate([-x[:, d // 2 :], x[:, : d // 2]], axis=1)
    return x * cos + half * sin


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_meta_rotary_constants_turn_the_models_keys_into_the_recorded_ones(tiny, recorded, family):
    folders, text = tiny
    model = _model(folders[family])
    cfg = model.config
    ids = transformers.AutoTokenizer.from_pretrained(folders[family])(text.read_text(), return_tensors="pt").input_ids
    ids = ids[:, : STEPS + 1]
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    positions = np.arange(STEPS + 1, dtype=np.float64)
    for layer in range(FAMILIES[family]):
        block = model.model.layers[layer]
        attn = block.self_attn
        with torch.no_grad():
            k = attn.k_proj(block.input_layernorm(hidden[layer]))[0].view(STEPS + 1, 2, HEAD_DIM)
            if hasattr(attn, "k_norm"):
                k = attn.k_norm(k)
        for h, path in enumerate(_files(recorded[family]["qk"], layer, ".qk.npz")):
            trace = load_qk(path)
            meta = trace.meta
            kind = cfg.layer_types[layer] if getattr(cfg, "layer_types", None) else None
            params = cfg.rope_parameters[kind] if family == "gemma3" else cfg.rope_parameters
            assert meta["rope_theta"] == params["rope_theta"] and meta["head_dim"] == HEAD_DIM
            assert meta["rope_inv_freq"] == pytest.approx(1.0 / params["rope_theta"] ** (np.arange(0, 8, 2) / 8), rel=1e-6)
            rotated = _rotate(k[:, h].double().numpy(), positions, meta)
            # the recorder's pass and this plain forward order their float32 sums differently up to this
            # layer (forward_pass counts every layer's once), relative to the keys' size
            tol = forward_pass(cfg, STEPS + 1, float(np.abs(rotated).max()))
            np.testing.assert_allclose(trace.keys, rotated, rtol=0, atol=tol, err_msg=f"{family} L{layer} kv{h}")
    if family == "gemma3":  # per layer: the sliding layers' base is not the global one's
        thetas = [load_qk(_files(recorded[family]["qk"], layer, ".qk.npz")[0]).meta["rope_theta"] for layer in range(3)]
        assert thetas == [10000.0, 1000000.0, 10000.0]


def test_qk_and_dense_files_round_trip_their_members(recorded, tmp_path):
    qk = load_qk(_files(recorded["gemma3"]["qk"], 1, ".qk.npz")[1])
    path = tmp_path / "again.qk.npz"
    meta = {k: qk.meta[k] for k in ("layer", "head", "query_heads", "scale", "softcap", "sliding_window", "gqa")}
    save_qk(path, qk.qk.Q, qk.qk.K, qk.values, meta, out_norms=qk.out_norms.astype(np.float16))
    again = load_qk(path)
    assert again.out_norms.dtype == np.float16 and again.out_norms.shape == qk.out_norms.shape
    np.testing.assert_array_equal(again.out_norms, qk.out_norms.astype(np.float16))
    np.testing.assert_array_equal(again.keys, qk.keys)
    np.testing.assert_array_equal(again.queries, qk.queries)
    # a prefix and a trip to a worker keep them
    np.testing.assert_array_equal(again.prefix(10).out_norms, again.out_norms[:11])
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(again)).out_norms, again.out_norms)

    dense = load_npz(_files(recorded["gemma3"]["dense"], 0, ".npz")[0])
    out = tmp_path / "again.npz"
    save_npz(dense, out, packed=True)
    back = load_npz(out)
    for name in vectors.MEMBERS:
        np.testing.assert_array_equal(getattr(back, name), getattr(dense, name), err_msg=name)
    np.testing.assert_array_equal(back.attention, dense.attention)


def test_files_without_the_members_still_load(tiny, tmp_path):
    folders, text = tiny
    record(RecordConfig(text, tmp_path / "plain", model=folders["llama"], steps=STEPS, layers=[0], store="dense"),
           progress=None)
    plain = load_npz(tmp_path / "plain" / "llama-L00-kv0.npz")
    assert plain.values is not None and plain.keys is None and plain.queries is None and plain.out_norms is None
    assert plain.meta["vectors"] == ["values"] and plain.meta["rope_layout"] == "rotate_half"
    with pytest.raises(TraceError) as e:
        vectors.require(plain, ["values", "keys"], "knorm")
    assert str(e.value).count("\n") == 0 and "keys" in str(e.value) and "--vectors" in str(e.value)
    # a qk file as version 1 wrote it before out_norms existed: no member, the same trace otherwise
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(2, 9, 4)), rng.normal(size=(9, 4)), rng.normal(size=(9, 4))
    meta = {"layer": 0, "head": 0, "query_heads": [0, 1], "scale": 0.5, "softcap": None, "sliding_window": None, "gqa": "mean"}
    save_qk(tmp_path / "old.qk.npz", q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), meta)
    with np.load(tmp_path / "old.qk.npz", allow_pickle=False) as z:
        assert sorted(z.files) == ["k", "meta", "q", "v"]
    old = load_qk(tmp_path / "old.qk.npz")
    assert old.out_norms is None and old.keys.shape == (9, 4)
    with pytest.raises(TraceError, match=r"reads out_norms, which this trace does not hold; .*--vectors"):
        vectors.require(old, ["out_norms"], "critical")


def _qk_members(tmp_path, **replace):
    """A small qk file's members (``q``, ``k``, ``v``, ``out_norms``, ``meta``) with some replaced, written raw."""
    rng = np.random.default_rng(1)
    meta = {"format": "kvsim-qk", "version": 1, "steps": 8, "layer": 0, "head": 0, "query_heads": [0, 1], "scale": 0.5,
            "softcap": None, "sliding_window": None, "gqa": "mean", "dtype": "float32"}
    members = {"q": rng.normal(size=(2, 9, 4)).astype(np.float32), "k": rng.normal(size=(9, 4)).astype(np.float32),
               "v": rng.normal(size=(9, 4)).astype(np.float32), "out_norms": rng.random((9, 2)).astype(np.float32),
               "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    members.update(replace)
    path = tmp_path / "bad.qk.npz"
    np.savez(path, **members)
    return path


@pytest.mark.parametrize("member, message", [
    (np.ones((9, 3), np.float32), "'out_norms' has shape (9, 3), but 'q' (2, 9, 4) needs (9, 2)"),
    (np.ones((8, 2), np.float32), "'out_norms' has shape (8, 2), but 'q' (2, 9, 4) needs (9, 2)"),
    (np.ones((9, 2), np.int32), "'out_norms' dtype int32 is not float16 or float32"),
    (np.ones((9, 2), np.float64), "'out_norms' dtype float64 is not float16 or float32"),
    (np.array([[1.0, np.nan]] * 9, np.float32), "'out_norms' has NaN or infinite values"),
    (np.array([[1.0, np.inf]] * 9, np.float16), "'out_norms' has NaN or infinite values"),
])
def test_a_bad_qk_out_norms_member_is_refused_in_one_line(tmp_path, member, message):
    path = _qk_members(tmp_path, out_norms=member)
    with pytest.raises(TraceError) as e:
        load_qk(path)
    assert str(e.value) == f"{path}: {message}"
    with pytest.raises(TraceError) as e:  # and the writer refuses what the reader would
        save_qk(tmp_path / "w.qk.npz", np.zeros((2, 9, 4), np.float32), np.zeros((9, 4), np.float32),
                np.zeros((9, 4), np.float32), {"layer": 0, "head": 0, "query_heads": [0, 1], "scale": 0.5, "gqa": "mean"},
                out_norms=member)
    assert str(e.value) == f"{tmp_path / 'w.qk.npz'}: {message}" and not (tmp_path / "w.qk.npz").exists()


@pytest.mark.parametrize("name, member, problem", [
    ("keys", np.ones((9, 4, 1), np.float32), "keys must be (9, d) float16/32/64"),
    ("keys", np.ones((8, 4), np.float32), "keys must be (9, d) float16/32/64"),
    ("queries", np.ones((9, 8), np.float32), "queries must be (9, G, d) float16/32/64"),
    ("out_norms", np.ones((9, 2), np.int64), "out_norms must be (9, G) float16/32/64"),
    ("out_norms", np.array([[1.0, np.nan]] * 9, np.float32), "out_norms holds NaN or infinite numbers"),
    ("queries", np.full((9, 2, 4), np.inf, np.float16), "queries holds NaN or infinite numbers"),
])
def test_a_bad_dense_member_is_refused_in_one_line(tmp_path, name, member, problem):
    trace = from_array(np.tril(np.ones((9, 9)), -1), name="t")
    path = tmp_path / "bad.npz"
    save_npz(trace, path)
    with np.load(path, allow_pickle=False) as z:
        members = {k: z[k] for k in z.files}
    np.savez(path, **members, **{name: member})
    with pytest.raises(TraceError) as e:
        load_npz(path)
    assert str(e.value).startswith(f"{path}: {problem}") and "\n" not in str(e.value)


def test_cli_vectors_flag_stores_them_in_a_dense_recording(tiny, tmp_path, capsys):
    folders, text = tiny
    out = tmp_path / "cli"
    code = cli.main(["record", str(text), "--model", str(folders["gemma3"]), "--out", str(out), "--steps", "12",
                     "--layers", "1", "--store", "dense", "--vectors", "--quiet", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and len(doc["files"]) == 2
    with np.load(out / "gemma3-L01-kv0.npz", allow_pickle=False) as z:
        assert sorted(z.files) == ["attention_packed", "keys", "meta", "out_norms", "queries", "steps", "values"]
        assert {z[m].dtype for m in ("keys", "queries", "values", "out_norms")} == {np.dtype(np.float16)}
        assert z["queries"].shape == (13, 2, HEAD_DIM) and z["out_norms"].shape == (13, 2)
        meta = json.loads(str(z["meta"][()]))
    assert (meta["rope_theta"], meta["rope_layout"], meta["head_dim"]) == (1000000.0, "rotate_half", HEAD_DIM)
    assert json.loads((out / "manifest.json").read_text())["vectors"] is True

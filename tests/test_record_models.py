"""The recorder on any Hugging Face causal LM: tiny Llama-, Qwen2- and Gemma-3-style models built here
from configs (random weights, grouped-query attention, sliding-window layers) with a tokenizer built
here from a small vocabulary; nothing is downloaded. Each recorded trace is checked against attention
computed independently: a plain eager forward with ``output_attentions`` reduced in NumPy, and for
Llama's first layer from the weights by hand (RMSNorm, q/k projections, RoPE, causal softmax).

Needs the recorder's extra (torch, transformers, tokenizers); skipped with that reason without it.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the recorder's extra is not installed (pip install -r requirements-record.txt)")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import tiny_models  # noqa: E402  (tests/, beside this file)
from tolerance import attention_rows, logit_magnitude  # noqa: E402

from kvsim import cli  # noqa: E402
from kvsim.data.bundle import load_bundle  # noqa: E402
from kvsim.data.trace import load_npz, unpack_lower  # noqa: E402
from kvsim.models.errors import RecordError  # noqa: E402
from kvsim.models.record import RecordConfig, record  # noqa: E402
from kvsim.models.recorder import kv_head_rows  # noqa: E402

TEXT = tiny_models.TEXT
STEPS = 48
WINDOW = 6  # the sliding window of the sliding layers: short, so it shows well inside 48 steps
# a block of 4 query heads x 11 rows x 49 keys: layers are recorded in 5 blocks, so the block seams are tested
CHUNK = 4 * 11 * (STEPS + 1)


def _tokenizer():
    return tiny_models.tokenizer(TEXT, 300)


def _config(family: str, vocab: int):
    return tiny_models.config(family, vocab, hidden=32, intermediate=64, max_positions=256, head_dim=8, window=WINDOW)


FAMILIES = {"llama": ([0, 1], []), "qwen2": ([0], [1, 2]), "gemma3": ([1], [0, 2])}  # global, sliding layers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> folder of a saved tiny model with its tokenizer, and the text file."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    tokenizer, vocab = _tokenizer()
    folders = {}
    for i, family in enumerate(FAMILIES):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(_config(family, vocab))
        folder = root / family
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[family] = folder
    text = root / "text.txt"
    text.write_text(TEXT)
    return folders, text


def _reference(folder, text, layer: int, gqa: str) -> list[np.ndarray]:
    """The rows the recorder should write, from a plain eager forward that returns every layer's weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder)(text.read_text(), return_tensors="pt").input_ids[:, : STEPS + 1]
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions[layer][0].double().numpy()
    return kv_head_rows(att, model.config.num_key_value_heads, gqa)


def _float32_rows(folder, text, layer: int) -> float:
    """How far two float32 computations of a layer's rows from the same queries and keys (the recorder's, a
    plain eager forward's) may be apart: twice ``tolerance.attention_rows``, with the queries and keys the
    model's pass gives that layer (``qkv_capture``), their head size, grouping, length and largest logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvsim.models.qkv_capture import capture_qkv

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder)(text.read_text(), return_tensors="pt").input_ids[:, : STEPS + 1]
    seen = []
    with torch.no_grad():
        capture_qkv(model, ids, [layer], seen.append)
    (qkv,) = seen
    q, k = qkv.query.double().numpy(), qkv.key.double().numpy()  # (heads, n, d), (kv heads, n, d)
    bounds = [attention_rows(k.shape[2], logit_magnitude(q[h * qkv.group : (h + 1) * qkv.group], k[h], qkv.scale),
                             k.shape[1], qkv.group) for h in range(k.shape[0])]
    return 2 * max(bounds)


def _raw(path) -> np.ndarray:
    with np.load(path, allow_pickle=False) as z:
        return unpack_lower(z["attention_packed"], int(z["steps"])).astype(np.float64)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("gqa", ["mean", "max"])
def test_every_layer_and_kv_head_matches_a_plain_eager_forward(tiny, tmp_path, family, gqa):
    folders, text = tiny
    doc = record(RecordConfig(text, tmp_path, model=folders[family], steps=STEPS, layers="all", gqa=gqa,
                              dtype=np.float32, chunk_elements=CHUNK), progress=None)
    n_layers = len(FAMILIES[family][0]) + len(FAMILIES[family][1])
    assert [(f["layer"], f["head"]) for f in doc["files"]] == [(x, h) for x in range(n_layers) for h in (0, 1)]
    for layer in range(n_layers):
        expected, bound = _reference(folders[family], text, layer, gqa), _float32_rows(folders[family], text, layer)
        for h in (0, 1):
            got = _raw(tmp_path / f"{family}-L{layer:02d}-kv{h}.npz")
            np.testing.assert_allclose(got, expected[h], rtol=0, atol=bound, err_msg=f"{family} layer {layer} KV head {h}")
            assert not np.allclose(expected[0], expected[1], rtol=0, atol=bound)  # the two KV heads differ beyond rounding


def test_llama_layer_0_matches_attention_computed_by_hand_from_the_weights(tiny, tmp_path):
    folders, text = tiny
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record(RecordConfig(text, tmp_path, model=folders["llama"], steps=STEPS, layers=[0], dtype=np.float32), progress=None)
    model = AutoModelForCausalLM.from_pretrained(folders["llama"])
    cfg = model.config
    ids = AutoTokenizer.from_pretrained(folders["llama"])(text.read_text()).input_ids[: STEPS + 1]
    sd = {k: v.double().numpy() for k, v in model.state_dict().items()}
    x = sd["model.embed_tokens.weight"][ids]
    x = x / np.sqrt((x**2).mean(axis=1, keepdims=True) + cfg.rms_norm_eps) * sd["model.layers.0.input_layernorm.weight"]
    d, n = cfg.hidden_size // cfg.num_attention_heads, len(ids)
    q = (x @ sd["model.layers.0.self_attn.q_proj.weight"].T).reshape(n, cfg.num_attention_heads, d)
    k = (x @ sd["model.layers.0.self_attn.k_proj.weight"].T).reshape(n, cfg.num_key_value_heads, d)
    inv = 1.0 / (cfg.rope_parameters["rope_theta"] ** (np.arange(0, d, 2) / d))
    ang = np.arange(n)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], 1))[:, None], np.sin(np.concatenate([ang, ang], 1))[:, None]

    def rope(v):
        half = np.concatenate([-v[..., d // 2 :], v[..., : d // 2]], axis=-1)
        return v * cos + half * sin

    def rope_size(v):  # a bound on |rope(q)| from one on |q|
        half = np.concatenate([v[..., d // 2 :], v[..., : d // 2]], axis=-1)
        return v * np.abs(cos) + half * np.abs(sin)

    q, k = rope(q), rope(k)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for h in range(cfg.num_key_value_heads):
        rows = np.zeros((n, n))
        for qh in range(h * group, (h + 1) * group):
            s = q[:, qh] @ k[:, h].T / math.sqrt(d)
            s = np.where(np.tril(np.ones((n, n))) > 0, s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            rows += p / p.sum(axis=1, keepdims=True) / group
        rows = np.tril(rows, -1)
        rows[1:] /= rows[1:].sum(axis=1, keepdims=True)
        # the recorder's float32: the norm (a mean over `hidden` squares) and each projection (over `hidden`
        # terms) move q and k by (2 hidden + 3) roundings of sum |x||W|; RoPE by 3 more and by its angle's (up
        # to the position, n radians); a logit then by that many of sum |q||k|, as its own d terms do
        qa = (np.abs(x) @ np.abs(sd["model.layers.0.self_attn.q_proj.weight"]).T).reshape(n, cfg.num_attention_heads, d)
        ka = (np.abs(x) @ np.abs(sd["model.layers.0.self_attn.k_proj.weight"]).T).reshape(n, cfg.num_key_value_heads, d)
        qa, ka = rope_size(qa), rope_size(ka)
        largest = max(float(np.einsum("td,pd->tp", qa[:, qh], ka[:, h]).max()) for qh in range(h * group, (h + 1) * group))
        bound = attention_rows(d + 2 * (2 * cfg.hidden_size + 6 + n), largest / math.sqrt(d), n, group)
        np.testing.assert_allclose(_raw(tmp_path / f"llama-L00-kv{h}.npz"), rows, rtol=0, atol=bound)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_sliding_layers_are_recorded_as_they_attend_and_say_so(tiny, tmp_path, family):
    folders, text = tiny
    record(RecordConfig(text, tmp_path, model=folders[family], steps=STEPS, layers="all"), progress=None)
    global_, sliding = FAMILIES[family]
    bundle = load_bundle(tmp_path)
    for layer in global_ + sliding:
        kind = "sliding" if layer in sliding else "global"
        for h in (0, 1):
            entry = bundle.select(layer, h)
            meta = entry.load().meta
            assert entry.attention == kind and meta["attention"].startswith(kind)
            raw = _raw(entry.path)
            if kind == "sliding":
                assert entry.sliding_window == meta["sliding_window"] == WINDOW
                assert "older positions get zero" in meta["attention"]
                for t in range(WINDOW, STEPS + 1):  # the window holds the query and the WINDOW - 1 before it
                    assert np.all(raw[t, : t - WINDOW + 1] == 0) and np.all(raw[t, t - WINDOW + 1 : t] > 0)
            else:
                assert entry.sliding_window is None and meta["sliding_window"] is None
                assert np.all(raw[1:][np.tril(np.ones((STEPS, STEPS + 1)), 0) > 0] > 0)


def test_layers_global_is_the_default_and_the_forward_stops_after_the_last_recorded_layer(tiny, tmp_path):
    folders, text = tiny
    doc = record(RecordConfig(text, tmp_path / "g", model=folders["gemma3"], steps=STEPS), progress=None)
    assert [(f["layer"], f["head"]) for f in doc["files"]] == [(1, 0), (1, 1)]
    seen = []
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folders["gemma3"], attn_implementation="eager").eval()
    model.model.layers[2].register_forward_hook(lambda *_a: seen.append(2))
    doc = record(RecordConfig(text, tmp_path / "o", steps=STEPS, layers=[0], dtype=np.float32), progress=None,
                 model_and_tokenizer=(model, AutoTokenizer.from_pretrained(folders["gemma3"])))
    assert seen == [] and [f["layer"] for f in doc["files"]] == [0, 0]
    assert doc["files"][1]["path"].endswith("gemma3-L00-kv1.npz")  # named after the model's folder
    np.testing.assert_allclose(_raw(doc["files"][1]["path"]), _reference(folders["gemma3"], text, 0, "mean")[1], rtol=0,
                               atol=_float32_rows(folders["gemma3"], text, 0))
    assert model.config._attn_implementation == "eager"  # the caller's model is left as it was


def test_manifest_and_meta_name_model_layer_heads_tokens_text_and_licences(tiny, tmp_path):
    folders, text = tiny
    record(RecordConfig(text, tmp_path, model=folders["qwen2"], steps=STEPS, layers="all", source="the test's own words",
                        licence="CC0", model_licence="random weights, no licence needed"), progress=None)
    bundle = load_bundle(tmp_path)
    m = bundle.manifest
    assert bundle.name == "qwen2" and bundle.steps == STEPS and bundle.layers == [0, 1, 2]
    assert m["text"]["source"] == "the test's own words" and m["text"]["licence"] == "CC0" and len(m["text"]["sha256"]) == 64
    assert m["text"]["path"] == str(text.resolve()) == bundle.traces[0].load().meta["source_path"]  # found again by it
    assert m["model_licence"] == "random weights, no licence needed" and "qwen2" in m["model"]
    assert m["gqa"] == "mean" and m["kv_heads"] == 2 and m["query_heads"] == 4 and m["dtype"] == "float16"
    for entry in bundle.traces:
        trace = entry.load()
        meta = trace.meta
        assert (meta["layer"], meta["head"]) == (entry.layer, entry.head)
        assert meta["query_heads"] == list(entry.query_heads) == [2 * entry.head, 2 * entry.head + 1]
        assert meta["source"] == "the test's own words" and meta["licence"] == "CC0" and "qwen2" in meta["model"]
        assert meta["tokens"][0] == "<bos>" and len(meta["tokens"]) == STEPS + 1
        assert TEXT.startswith("".join(meta["tokens"][1:]))  # the positions are the text's own tokens
        assert trace.steps == STEPS and trace.name == f"qwen2-L{entry.layer:02d}-kv{entry.head}"


def test_cli_record_json_lists_every_file_with_layer_and_head(tiny, tmp_path, capsys):
    folders, text = tiny
    out = tmp_path / "b"
    code = cli.main(["record", str(text), "--model", str(folders["llama"]), "--out", str(out), "--steps", "20",
                     "--layers", "all", "--gqa", "max", "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert [(f["layer"], f["head"]) for f in doc["files"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(f["bytes"] > 0 and (out / f["path"].rsplit("/", 1)[-1]).is_file() for f in doc["files"])
    assert doc["steps"] == 20 and doc["manifest"].endswith("manifest.json")
    assert "layer 1 recorded" in stderr  # progress on stderr, one JSON document on stdout
    assert "layer 0 recorded (1/2 layers" in stderr and re.search(r"layer 1 recorded \(2/2 layers, .* s\) 100%", stderr)
    assert load_bundle(out).manifest["gqa"] == "max"
    assert load_npz(out / "llama-L01-kv1.npz").meta["gqa"] == "max"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "5000"], "tokens after position 0, fewer than the 5000 steps asked for"),
        (["--layers", "0,7"], "layer 7 does not exist: the model has layers 0-1"),
        (["--layers", "x"], "layers must be all, global or comma-separated integers"),
        (["--gqa", "sum"], "invalid choice"),
    ],
)
def test_cli_record_refuses_bad_input_in_one_line(tiny, tmp_path, capsys, args, message):
    folders, text = tiny
    code = cli.main(["record", str(text), "--model", str(folders["llama"]), "--out", str(tmp_path / "o"), "--quiet", *args])
    out, err = capsys.readouterr()
    assert code != 0 and out == "" and err.count("\n") == 1 and message in err, err


def test_missing_tokenizer_missing_folder_and_uncached_hub_id_are_one_line_errors(tiny, tmp_path, monkeypatch):
    folders, text = tiny
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(folders["llama"], bare)
    for f in bare.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            f.unlink()
    with pytest.raises(RecordError, match=r"bare: no usable tokenizer"):
        record(RecordConfig(text, tmp_path / "o", model=bare, steps=8), progress=None)
    with pytest.raises(RecordError, match=r"no such model folder"):
        record(RecordConfig(text, tmp_path / "o", model=tmp_path / "nowhere", steps=8), progress=None)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecordError, match=r"kvsim-test/absent-model: \(a hub id, looked up in the local Hugging Face cache only\)"):
        record(RecordConfig(text, tmp_path / "o", model="kvsim-test/absent-model", steps=8), progress=None)


def test_a_model_without_attention_is_refused_in_one_line(tiny, tmp_path):
    folders, text = tiny
    from transformers import MambaConfig, MambaForCausalLM

    folder = tmp_path / "mamba"
    MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=4)).save_pretrained(folder)
    _tokenizer()[0].save_pretrained(folder)
    with pytest.raises(RecordError, match="mamba has no attention heads"):
        record(RecordConfig(text, tmp_path / "o", model=folder, steps=8), progress=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_device_cuda_without_a_cuda_device_is_one_line(tiny, tmp_path, capsys):
    folders, text = tiny
    code = cli.main(["record", str(text), "--model", str(folders["llama"]), "--out", str(tmp_path / "o"), "--steps", "8",
                     "--device", "cuda", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err == "kvsim: error: --device cuda: torch sees no CUDA device\n"

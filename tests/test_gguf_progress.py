"""The first load of a GGUF model says how far it has got (issue 44): the metadata parse, counted in the
values gguf's reader visits (``_gguf_values`` gives the total from a quick scan), then the dequantisation,
in the tensors' bytes; one parse serves the tokenizer, the config and the weights. Tested on a small GGUF
written here, so no model loads."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the recorder's extra is not installed (pip install -e '.[record]')")
pytest.importorskip("transformers", reason="the recorder's extra is not installed (pip install -e '.[record]')")

import gguf  # noqa: E402
import transformers.modeling_gguf_pytorch_utils as loader  # noqa: E402

from kvsim.models import loading  # noqa: E402


@pytest.fixture
def small_gguf(tmp_path):
    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("kvsim test")
    w.add_uint32("test.count", 7)
    w.add_float32("test.scale", 0.5)
    w.add_array("test.tokens", [f"tok{i}" for i in range(1000)])
    w.add_array("test.scores", [float(i) for i in range(500)])
    w.add_array("test.types", list(range(300)))
    w.add_tensor("a.weight", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    w.add_tensor("b.weight", np.ones((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_quick_scan_counts_every_value_the_reader_visits(small_gguf):
    visited = 0

    class Counting(gguf.GGUFReader):
        def _get_field_parts(self, *args, **kwargs):
            nonlocal visited
            visited += 1
            return super()._get_field_parts(*args, **kwargs)

    Counting(str(small_gguf))
    assert loading._gguf_values(small_gguf) == visited > 1800


def test_the_scan_refuses_a_file_that_is_not_gguf(tmp_path):
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        loading._gguf_values(other)


def test_one_parse_reported_in_steps_then_the_dequantisation_by_bytes(small_gguf):
    heard = []
    original_reader, original_bar = gguf.GGUFReader, loader.tqdm
    original_parse = loader._gguf_parse_value

    def values(reader):
        return {k: [loader._gguf_parse_value(f.parts[i], f.types) for i in f.data] for k, f in reader.fields.items()}

    with loading._gguf_progress(lambda fraction, note="": heard.append((fraction, note)), small_gguf, then="next"):
        first = gguf.GGUFReader(str(small_gguf))
        assert gguf.GGUFReader(small_gguf) is first  # the tokenizer, the config and the weights share it
        converted = values(first)
        notes = len(heard)
        assert values(first) == converted and len(heard) == notes  # converted once: the second pass is silent
        names = [t.name for t in loader.tqdm(first.tensors, desc="Converting and de-quantizing GGUF tensors...")]
    assert gguf.GGUFReader is original_reader and loader.tqdm is original_bar and loader._gguf_parse_value is original_parse
    plain = original_reader(str(small_gguf))
    assert converted == {k: [original_parse(f.parts[i], f.types) for i in f.data] for k, f in plain.fields.items()}
    assert converted["test.tokens"][:2] == ["tok0", "tok1"] and converted["test.scale"] == [0.5]
    conversion = [f for f, note in heard if note == "converting the metadata"]
    assert conversion[0] < 0.1 and conversion[-1] == 1.0 and conversion == sorted(conversion) and len(conversion) <= 21
    assert heard[heard.index((1.0, "converting the metadata")) + 1] == (None, "next") and heard.count((None, "next")) == 1
    assert names == [t.name for t in original_reader(str(small_gguf)).tensors]
    reading = [f for f, note in heard if note.startswith("reading")]
    assert reading[0] == 0.0 and reading[-1] == 1.0 and reading == sorted(reading) and 5 <= len(reading) <= 22
    dequantising = [f for f, note in heard if note == "dequantising 2 tensors"]
    assert dequantising[0] == 0.0 and dequantising[-1] == 1.0 and dequantising == sorted(dequantising)
    assert 0.85 <= dequantising[1] < 1.0  # a's 8 KiB of the 9 KiB: the bar follows the bytes, not the count


def test_the_patches_are_undone_when_the_load_fails(small_gguf):
    original_reader, original_bar = gguf.GGUFReader, loader.tqdm
    with pytest.raises(RuntimeError), loading._gguf_progress(lambda *a: None, small_gguf):
        raise RuntimeError("the load failed")
    assert gguf.GGUFReader is original_reader and loader.tqdm is original_bar

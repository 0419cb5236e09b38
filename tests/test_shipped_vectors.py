"""The shipped real trace carries what the key-, value-, query- and output-aware policies read (issue 34,
item 4), and keeps carrying it through the disk cache that shipped traces are read from
(``kvsim.data.store.file_trace``: it kept the attention alone, so a second process lost the members).

Core only: no torch. The members themselves are checked against the model in tests/test_record_vectors.py;
here, what ships and what the cache gives back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvsim.data import vectors
from kvsim.data.catalog import resolve_trace, shipped_traces
from kvsim.data.store import file_trace
from kvsim.data.trace import from_array, load_npz, save_npz

SHIPPED = "gemma3-270m-L11"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_shipped_real_trace_carries_every_member_and_its_rotary_constants(cache):
    first = resolve_trace(SHIPPED)  # decoded from the .npz
    again = resolve_trace(SHIPPED)  # from the cache entry
    for trace in (first, again):
        got = vectors.require(trace, vectors.MEMBERS, "test")
        shapes = {name: (a.shape, a.dtype) for name, a in got.items()}
        assert shapes == {"keys": ((4097, 256), np.float16), "values": ((4097, 256), np.float16),
                          "queries": ((4097, 4, 256), np.float16), "out_norms": ((4097, 4), np.float16)}
        assert all(np.isfinite(a.astype(np.float32)).all() for a in got.values())
        assert (got["out_norms"] > 0).all()
        m = trace.meta
        assert (m["rope_theta"], m["rope_layout"], m["head_dim"]) == (1e6, "rotate_half", 256)  # a global layer
        assert m["vectors"] == ["keys", "out_norms", "queries", "values"]
    for name in vectors.MEMBERS:
        np.testing.assert_array_equal(getattr(again, name), getattr(first, name), err_msg=name)
    assert again.fingerprint == first.fingerprint


def test_only_the_default_real_trace_carries_them():
    """The checkout stays small: the other shipped traces are attention only (13 MB each, not 26)."""
    for name, path in shipped_traces().items():
        with np.load(path, allow_pickle=False) as z:
            carries = {"keys", "queries", "out_norms"} <= set(z.files)
        assert carries == (name == SHIPPED), name


def _trace_with_members(path):
    rng = np.random.default_rng(3)
    trace = from_array(np.tril(rng.random((9, 9)) + 0.01, -1), name="t")
    trace.values = rng.normal(size=(9, 4)).astype(np.float16)
    trace.keys = rng.normal(size=(9, 4)).astype(np.float16)
    trace.queries = rng.normal(size=(9, 2, 4)).astype(np.float32)
    trace.out_norms = rng.random((9, 2)).astype(np.float16)
    save_npz(trace, path, packed=True)
    return trace


def test_the_cache_gives_back_the_members_and_rereads_a_damaged_one(cache, tmp_path):
    path = tmp_path / "t.npz"
    made = _trace_with_members(path)
    first = file_trace(path, load_npz)
    assert not any(getattr(first, n) is None for n in vectors.MEMBERS)
    second = file_trace(path, load_npz)
    for name in vectors.MEMBERS:
        assert getattr(second, name).dtype == getattr(made, name).dtype
        np.testing.assert_array_equal(getattr(second, name), getattr(made, name), err_msg=name)
    [entry] = cache.glob("file-t-*[0-9a-f].json")
    assert set(json.loads(entry.read_text())["members"]) == set(vectors.MEMBERS)
    # a member file damaged in the cache: read afresh from the .npz, not handed on
    [queries] = cache.glob("file-t-*-queries.npy")
    np.save(queries, np.zeros((9, 2, 4), np.float32))
    third = file_trace(path, load_npz)
    np.testing.assert_array_equal(third.queries, made.queries)
    # an entry written before members were kept (no "members" in its .json) is read afresh too
    record = json.loads(entry.read_text())
    del record["members"]
    entry.write_text(json.dumps(record))
    np.testing.assert_array_equal(file_trace(path, load_npz).out_norms, made.out_norms)
    assert "members" in json.loads(entry.read_text())


def test_a_trace_without_members_comes_back_without_them(cache, tmp_path):
    path = tmp_path / "plain.npz"
    save_npz(from_array(np.tril(np.ones((9, 9)), -1), name="plain"), path)
    for _ in range(2):
        trace = file_trace(path, load_npz)
        assert all(getattr(trace, n) is None for n in vectors.MEMBERS)

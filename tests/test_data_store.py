"""A trace's derived data in its ``TraceStore`` (computed once, shared by threads, kept through a
pickle) and the store's ``atomic_write``."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

import kvsim
from kvsim.data import derived
from kvsim.data.files import atomic_write


@pytest.fixture
def trace(make_trace):
    return make_trace(60, seed=4, ties=True)


def test_the_store_computes_each_thing_once_for_every_thread(trace, monkeypatch):
    calls = []
    real = derived._topk_positions

    def counted(A, k):
        calls.append(k)
        return real(A, k)

    monkeypatch.setattr(derived, "_topk_positions", counted)
    got = []
    threads = [threading.Thread(target=lambda: got.append(trace.derived.topk(5))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [5] and all(g is got[0] for g in got)
    mask = trace.topk_mask(5)
    for t in range(1, trace.steps + 1):  # the positions are the mask's set
        assert set(got[0][t][got[0][t] >= 0].tolist()) == set(np.flatnonzero(mask[t]).tolist())
    with pytest.raises(ValueError, match="top_k must be at least 1"):
        trace.derived.topk(0)


def test_the_kernels_attention_is_contiguous_read_only_and_a_kernel_dtype():
    a = np.tril(np.ones((6, 6)), -1).astype(np.float16)
    half = kvsim.Trace(a)  # built directly: float16, which no kernel is compiled for
    A = half.derived.kernel_attention()
    assert A.dtype == np.float32 and A.flags.c_contiguous and not A.flags.writeable
    assert np.array_equal(A, a.astype(np.float32)) and half.derived.kernel_attention() is A


def test_a_trace_pickles_with_its_store(trace):
    """A trace sent to another process (a Dask worker) keeps what was derived, and a lock of its own."""
    fingerprint = trace.fingerprint
    again = pickle.loads(pickle.dumps(trace))
    assert again.derived.has_fingerprint and again.fingerprint == fingerprint
    assert np.array_equal(again.derived.topk(3), trace.derived.topk(3))


def test_atomic_write_leaves_the_old_file_or_the_new_one(tmp_path):
    path = tmp_path / "file.bin"
    atomic_write(path, lambda f: f.write(b"old"))

    def fails(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fails)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["file.bin"]

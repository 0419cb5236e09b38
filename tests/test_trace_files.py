"""Users' own trace files: every kind of bad file is refused with one line naming the file and the
problem, before any large read; the packed layout round-trips; the interchange layout keeps loading."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
from tolerance import rounding

from kvsim import cli
from kvsim.data.trace import MAX_META_BYTES, MAX_STEPS, TraceError, from_array, load_npz, pack_lower, save_npz, unpack_lower


def _rows(steps: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = np.tril(rng.random((steps + 1, steps + 1)) + 0.01, k=-1)
    a[1:] /= a[1:].sum(axis=1, keepdims=True)
    return a


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, allow_pickle=True)
    return buf.getvalue()


def _header_only(shape: tuple, descr: str = "<f4") -> bytes:
    """A .npy header declaring ``shape`` with no data behind it."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _zip(path, members: dict[str, bytes], compress: bool = False):
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", method) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _meta(d) -> bytes:
    return _npy(np.array(json.dumps(d)))


def _refused(path, *needles: str) -> str:
    with pytest.raises(TraceError) as e:
        load_npz(path)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(str(path)), msg
    for needle in needles:
        assert needle in msg, msg
    return msg


# --- bad weights: the interchange layout and the packed layout alike ---------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["full", "packed"])
@pytest.mark.parametrize(
    ("poison", "needle"),
    [(np.nan, "NaN or infinite"), (np.inf, "NaN or infinite"), (-0.25, "negative")],
    ids=["nan", "inf", "negative"],
)
def test_bad_weights_name_the_step(tmp_path, packed, poison, needle):
    a = _rows(8)
    a[5, 2] = poison
    if packed:
        path = _zip(tmp_path / "bad.npz", {"attention_packed.npy": _npy(pack_lower(a)), "steps.npy": _npy(np.array(8))})
    else:
        path = _zip(tmp_path / "bad.npz", {"attention.npy": _npy(a)})
    _refused(path, "step 5", needle)


def test_weights_above_the_diagonal_are_ignored(tmp_path):
    a = _rows(8)
    a[3, 3] = np.nan  # the diagonal and above are not part of the trace
    a[2, 7] = -1.0
    t = load_npz(_zip(tmp_path / "ok.npz", {"attention.npy": _npy(a)}))
    # float32 weights of rows renormalised in float64 (half an ulp each), summed here in float32 (7 terms at most)
    np.testing.assert_allclose(t.attention[1:].sum(axis=1), 1.0, rtol=rounding(2 * 8))


def test_zero_row(tmp_path):
    a = _rows(8)
    a[4, :4] = 0.0
    _refused(_zip(tmp_path / "zero.npz", {"attention.npy": _npy(a)}), "step 4", "sums to zero")


# --- wrong shapes, dtypes and keys ------------------------------------------------------------


@pytest.mark.parametrize(
    ("array", "needle"),
    [
        (np.ones(9, dtype=np.float32), "square"),
        (np.ones((2, 9, 9), dtype=np.float32), "square"),
        (np.ones((9, 8), dtype=np.float32), "square"),
        (np.ones((1, 1), dtype=np.float32), "at least 1"),
        (np.ones((9, 9), dtype=np.int64), "dtype int64"),
        (np.ones((9, 9), dtype=np.complex64), "dtype complex64"),
        (np.ones((9, 9), dtype=bool), "dtype bool"),
        (np.zeros((9, 9), dtype=[("w", "<f4")]), "is not float16"),
    ],
    ids=["1d", "3d", "not-square", "no-steps", "int", "complex", "bool", "structured"],
)
def test_wrong_shape_or_dtype(tmp_path, array, needle):
    _refused(_zip(tmp_path / "shape.npz", {"attention.npy": _npy(array)}), needle)


def test_missing_attention_names_what_was_found(tmp_path):
    path = _zip(tmp_path / "keys.npz", {"weights.npy": _npy(_rows(4)), "meta.npy": _meta({})})
    _refused(path, "missing key 'attention'", "weights")


def test_empty_archive(tmp_path):
    _refused(_zip(tmp_path / "empty.npz", {}), "missing key 'attention'", "nothing")


def test_packed_without_steps(tmp_path):
    _refused(_zip(tmp_path / "p.npz", {"attention_packed.npy": _npy(pack_lower(_rows(4)))}), "'steps'", "missing")


def test_both_layouts_at_once(tmp_path):
    a = _rows(4)
    path = _zip(tmp_path / "both.npz", {
        "attention.npy": _npy(a), "attention_packed.npy": _npy(pack_lower(a)), "steps.npy": _npy(np.array(4))})
    _refused(path, "both")


@pytest.mark.parametrize(
    ("steps", "needle"),
    [(np.array(4.0), "0-d integer"), (np.array([4]), "0-d integer"), (np.array(0), "at least 1 step"),
     (np.array(5), "15 values for 5 steps")],
    ids=["float", "1d", "zero", "mismatch"],
)
def test_packed_steps_must_match(tmp_path, steps, needle):
    a = _rows(4)  # 10 packed values; 'steps' says how many there must be
    path = _zip(tmp_path / "p.npz", {"attention_packed.npy": _npy(pack_lower(a)), "steps.npy": _npy(steps)})
    _refused(path, needle)


def test_packed_wrong_dtype(tmp_path):
    packed = (pack_lower(_rows(4)) * 1000).astype(np.int32)
    path = _zip(tmp_path / "p.npz", {"attention_packed.npy": _npy(packed), "steps.npy": _npy(np.array(4))})
    _refused(path, "attention_packed dtype int32")


def test_member_that_is_not_npy(tmp_path):
    # stored without the .npy suffix, np.load would hand back raw bytes; the loader says what it is
    _refused(_zip(tmp_path / "raw.npz", {"attention": b"not an array at all"}), "'attention' is not a NumPy .npy array")


# --- pickles ----------------------------------------------------------------------------------


def test_pickled_attention(tmp_path):
    obj = np.empty((3, 3), dtype=object)
    obj[:] = 0.5
    _refused(_zip(tmp_path / "pickle.npz", {"attention.npy": _npy(obj)}), "pickled objects")


def test_pickled_meta(tmp_path):
    meta = np.array({"name": "evil"}, dtype=object)
    path = _zip(tmp_path / "pickle.npz", {"attention.npy": _npy(_rows(4)), "meta.npy": _npy(meta)})
    _refused(path, "'meta'", "pickled objects")


# --- meta -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("meta", "needle"),
    [
        (np.array("{not json"), "meta is not valid JSON"),
        (np.array("[1, 2]"), "must be an object"),
        (np.array(3.0), "0-d string array"),
        (np.array(["{}", "{}"]), "0-d string array"),
    ],
    ids=["bad-json", "list", "number", "1d"],
)
def test_bad_meta(tmp_path, meta, needle):
    path = _zip(tmp_path / "meta.npz", {"attention.npy": _npy(_rows(4)), "meta.npy": _npy(meta)})
    _refused(path, needle)


# --- truncated and non-zip files --------------------------------------------------------------


def test_not_a_zip(tmp_path):
    path = tmp_path / "text.npz"
    path.write_text("attention,0.5\n")
    _refused(path, "not a .npz")


def test_plain_npy_is_not_an_npz(tmp_path):
    path = tmp_path / "plain.npz"
    path.write_bytes(_npy(_rows(4)))
    _refused(path, "not a .npz")


def test_truncated_at_the_end(tmp_path):
    full = tmp_path / "full.npz"
    save_npz(from_array(_rows(64)), full)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    _refused(cut, "truncated")


def test_corrupted_compressed_data(tmp_path):
    full = tmp_path / "full.npz"
    save_npz(from_array(_rows(64)), full)
    data = bytearray(full.read_bytes())
    # damage the deflate stream of the first member, keeping the zip directory intact
    for i in range(200, 400):
        data[i] ^= 0x5A
    bad = tmp_path / "bad.npz"
    bad.write_bytes(bytes(data))
    _refused(bad, "unreadable or truncated")


def test_member_shorter_than_its_header(tmp_path):
    a = _rows(16).astype(np.float32)
    data = _npy(a)[:-100]  # the header promises 17 x 17 floats; the data stops short
    _refused(_zip(tmp_path / "short.npz", {"attention.npy": data}), "'attention' is truncated", "array data")


def test_no_such_file(tmp_path):
    _refused(tmp_path / "missing.npz", "no such file")
    _refused(tmp_path, "is a folder")


# --- absurd sizes: refused from the header, before any data is read ---------------------------


@pytest.fixture
def no_data_reads(monkeypatch):
    """Make every array-data read fail loudly: a refusal that happens here came from a header."""

    def boom(*_a, **_k):
        raise AssertionError("array data was read")

    monkeypatch.setattr(np.lib.format, "read_array", boom)
    monkeypatch.setattr(np, "fromfile", boom)


def test_absurd_full_header_is_refused_unread(tmp_path, no_data_reads):
    n = MAX_STEPS + 2
    path = _zip(tmp_path / "huge.npz", {"attention.npy": _header_only((n, n))})
    _refused(path, f"declares {n - 1} steps", f"limit of {MAX_STEPS}")


def test_absurd_packed_length_is_refused_before_the_packed_data(tmp_path):
    calls = []
    real = np.lib.format.read_array

    def spy(fp, *a, **k):
        out = real(fp, *a, **k)
        calls.append(out.shape)
        return out

    path = _zip(tmp_path / "huge.npz", {
        "attention_packed.npy": _header_only((10**12,)), "steps.npy": _npy(np.array(4))})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(np.lib.format, "read_array", spy)
        _refused(path, "must be 1-D with 10 values for 4 steps")
    assert calls == [()], calls  # only the 0-d 'steps' was read


def test_absurd_steps_is_refused_before_the_packed_data(tmp_path):
    path = _zip(tmp_path / "huge.npz", {
        "attention_packed.npy": _header_only((10**12,)), "steps.npy": _npy(np.array(MAX_STEPS + 1))})
    _refused(path, f"declares {MAX_STEPS + 1} steps", f"limit of {MAX_STEPS}")


def test_absurd_meta_header_is_refused_unread(tmp_path, no_data_reads):
    chars = MAX_META_BYTES // 4 + 1  # unicode strings take 4 bytes a character
    path = _zip(tmp_path / "meta.npz", {
        "attention.npy": _header_only((5, 5)), "meta.npy": _header_only((), f"<U{chars}")})
    _refused(path, "meta declares", f"limit of {MAX_META_BYTES}")


def test_unknown_npy_version(tmp_path):
    data = bytearray(_npy(_rows(4)))
    data[6] = 9  # the format's major version byte
    _refused(_zip(tmp_path / "v9.npz", {"attention.npy": bytes(data)}), "unknown .npy format version")


# --- the layouts that load --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_packed_round_trip(tmp_path, dtype):
    trace = from_array(_rows(50, seed=3), name="mine", meta={"source": "test", "layer": 5})
    path = tmp_path / "packed.npz"
    save_npz(trace, path, dtype=dtype, packed=True)
    with np.load(path) as z:
        assert sorted(z.files) == ["attention_packed", "meta", "steps"]
        assert z["attention_packed"].dtype == dtype
        assert z["attention_packed"].shape == (50 * 51 // 2,)
    back = load_npz(path)
    assert back.steps == 50 and back.name == "mine" and back.meta["layer"] == 5
    # each weight stored in dtype (half an ulp), its row's sum moved as much, renormalised and stored as float32
    np.testing.assert_allclose(back.attention, trace.attention, rtol=rounding(1, 1.0, dtype) + rounding(2), atol=0)
    assert np.all(np.triu(back.attention) == 0)


def test_full_layout_still_loads_and_matches_packed(tmp_path):
    trace = from_array(_rows(30, seed=4), name="same")
    save_npz(trace, tmp_path / "full.npz")
    save_npz(trace, tmp_path / "packed.npz", packed=True)
    with np.load(tmp_path / "full.npz") as z:
        assert "attention" in z.files and z["attention"].shape == (31, 31)
    full, packed = load_npz(tmp_path / "full.npz"), load_npz(tmp_path / "packed.npz")
    np.testing.assert_array_equal(full.attention, packed.attention)


def test_pack_unpack_inverse():
    a = np.tril(np.arange(36, dtype=np.float32).reshape(6, 6), k=-1)
    packed = pack_lower(a)
    assert packed.tolist() == [6, 12, 13, 18, 19, 20, 24, 25, 26, 27, 30, 31, 32, 33, 34]
    np.testing.assert_array_equal(unpack_lower(packed, 5), a)


def test_packed_float16_is_smaller(tmp_path):
    trace = from_array(_rows(200, seed=5))
    save_npz(trace, tmp_path / "full.npz")
    save_npz(trace, tmp_path / "packed.npz", dtype=np.float16, packed=True)
    assert (tmp_path / "packed.npz").stat().st_size < 0.6 * (tmp_path / "full.npz").stat().st_size


def test_upload_from_a_file_object_names_the_upload():
    buf, good = io.BytesIO(), io.BytesIO()
    a = _rows(6)
    a[3, 1] = np.nan
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("attention.npy", _npy(a))
    buf.seek(0)
    with pytest.raises(TraceError, match=r"^my upload\.npz: step 3: attention has NaN"):
        load_npz(buf, source="my upload.npz")
    with zipfile.ZipFile(good, "w") as z:
        z.writestr("attention.npy", _npy(_rows(6)))
    good.seek(0)
    assert load_npz(good, source="good.npz").name == "good"


# --- the CLI refuses them the same way --------------------------------------------------------


def test_cli_prints_one_line_naming_the_file(tmp_path, capsys):
    a = _rows(8)
    a[6, 0] = -1.0
    path = _zip(tmp_path / "neg.npz", {"attention.npy": _npy(a)})
    assert cli.main(["describe", "--trace", str(path)]) != 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and str(path) in err and "step 6" in err and "negative" in err


# --- the block-wise validation is the row-by-row one ------------------------------------------


def _from_array_row_by_row(a: np.ndarray) -> np.ndarray | str:
    """The definition ``from_array`` implements by blocks: each row in float64, checked in order
    (finite, then non-negative, then a positive sum), normalised by its own ``sum()``."""
    n = a.shape[0]
    out = np.zeros((n, n), dtype=np.float32)
    for t in range(1, n):
        row = a[t, :t].astype(np.float64)
        if not np.all(np.isfinite(row)):
            return f"x: step {t}: attention has NaN or infinite weights"
        if np.any(row < 0):
            return f"x: step {t}: attention has negative weights"
        s = row.sum()
        if s <= 0:
            return f"x: step {t}: attention row sums to zero"
        out[t, :t] = row / s
    return out


def test_from_array_matches_the_row_by_row_definition_bit_for_bit():
    """Same float32 bits, same first error, across dtypes (float16 takes a table), memory layouts,
    byte orders, block boundaries (rows past 256) and poisoned rows of every kind."""
    rng = np.random.default_rng(3)
    for trial in range(90):
        n = int(rng.integers(2, 600))
        a = (rng.random((n, n)) ** rng.uniform(1, 30)).astype((np.float16, np.float32, np.float64)[trial % 3])
        if trial % 5 == 0:
            a = np.asfortranarray(a)
        if trial % 7 == 0:
            a = a.astype(a.dtype.newbyteorder(">"))
        for _ in range(int(rng.integers(0, 4))):
            t, p, kind = int(rng.integers(1, n)), int(rng.integers(0, n)), int(rng.integers(0, 5))
            if kind == 3:
                a[t, :t] = 0
            else:
                a[t, p] = (np.nan, np.inf, -float(rng.random()), 0, -np.inf)[kind]
        want = _from_array_row_by_row(a)
        try:
            got = from_array(a, source="x").attention
        except TraceError as e:
            got = str(e)
        if isinstance(want, str) or isinstance(got, str):
            assert got == want, trial
        else:
            assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32)), trial

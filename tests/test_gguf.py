"""gemma4_mlx.gguf: round trip through write_gguf/read_gguf, agreement with gguf.GGUFReader, zero-copy views."""

import time

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from gemma4_mlx.gguf import (
    GGML_TYPES,
    GGMLType,
    GGUFError,
    GGUFFile,
    GGUFTensor,
    read_gguf,
    write_gguf,
)

METADATA = {
    "general.architecture": "gemma4",
    "general.name": "tiny \u2581test \U0001F600",
    "general.empty": "",
    "t.u8": 255,
    "t.i8": -128,
    "t.u16": 65535,
    "t.i16": -32768,
    "t.u32": 2**32 - 1,
    "t.i32": -(2**31),
    "t.f32": 0.95,  # not exactly representable: stored as the nearest f32
    "t.bool_true": True,
    "t.bool_false": False,
    "t.u64": 2**64 - 1,
    "t.i64": -(2**63),
    "t.f64": 1e-300,
    "a.strings": ["<pad>", "\u2581hello", "<0x0A>", "", "\u00e9\U0001F600"],
    "a.u8": np.array([0, 7, 255], np.uint8),
    "a.i8": np.array([-128, 0, 127], np.int8),
    "a.u16": np.array([1, 65535], np.uint16),
    "a.i16": np.array([-32768, 5], np.int16),
    "a.u32": np.array([0, 2**32 - 1], np.uint32),
    "a.i32": np.array([6144] * 15 + [12288] * 20, np.int32),
    "a.f32": np.array([-1000.0, 0.5, np.inf], np.float32),
    "a.u64": np.array([2**64 - 1, 0], np.uint64),
    "a.i64": np.array([-(2**63), 2**63 - 1], np.int64),
    "a.f64": np.array([np.pi, -0.0], np.float64),
    "a.bool": np.array([True, False, True, True, False], np.bool_),
    "a.nested": [np.array([1, 2, 3], np.int32), np.array([-4], np.int32)],
}
TYPES = {
    "general.architecture": 8, "general.name": 8, "general.empty": 8,
    "t.u8": 0, "t.i8": 1, "t.u16": 2, "t.i16": 3, "t.u32": 4, "t.i32": 5, "t.f32": 6,
    "t.bool_true": 7, "t.bool_false": 7, "t.u64": 10, "t.i64": 11, "t.f64": 12,
    "a.strings": (9, 8), "a.u8": (9, 0), "a.i8": (9, 1), "a.u16": (9, 2), "a.i16": (9, 3),
    "a.u32": (9, 4), "a.i32": (9, 5), "a.f32": (9, 6), "a.u64": (9, 10), "a.i64": (9, 11),
    "a.f64": (9, 12), "a.bool": (9, 7), "a.nested": (9, (9, 5)),
}


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _tensors() -> list[tuple[str, int, tuple[int, ...], np.ndarray]]:
    """(name, ggml type, logical shape, data) with data in the forms write_gguf accepts (same every call)."""
    rng = np.random.default_rng(20240611)
    w_q4 = rng.standard_normal((8, 64), dtype=np.float32)
    w_q8 = rng.standard_normal((2, 3, 96), dtype=np.float32)
    return [
        ("token_embd.weight", GGMLType.F32, (5, 7), rng.standard_normal((5, 7), dtype=np.float32)),
        ("output_norm.weight", GGMLType.F16, (7,), rng.standard_normal(7).astype(np.float16)),
        ("blk.0.attn_q.weight", GGMLType.BF16, (3, 4), _bf16_bits(rng.standard_normal((3, 4)))),
        ("blk.0.ffn_up.weight", GGMLType.Q4_0, (8, 64), quantize(w_q4, gguf.GGMLQuantizationType.Q4_0)),
        ("blk.0.ffn_down_exps.weight", GGMLType.Q8_0, (2, 3, 96), quantize(w_q8, gguf.GGMLQuantizationType.Q8_0)),
        ("blk.0.f32_raw.weight", GGMLType.F32, (1, 2, 1, 3),
         np.arange(6, dtype=np.float32).view(np.uint8)),  # raw uint8 bytes also accepted
    ]


def _raw(data: np.ndarray) -> bytes:
    return np.ascontiguousarray(data).tobytes()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "roundtrip.gguf"
    write_gguf(path, METADATA, TYPES, _tensors())
    return path


def _assert_value_equal(got, want, vtype):
    if isinstance(vtype, tuple):
        elem = vtype[1]
        if isinstance(elem, tuple):
            assert isinstance(got, list) and len(got) == len(want)
            for g, w in zip(got, want):
                _assert_value_equal(g, w, elem)
        elif elem == 8:
            assert isinstance(got, list) and got == want
        else:
            want = np.asarray(want)
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype, (got, want)
            np.testing.assert_array_equal(got, want)
    elif vtype == 6:
        assert isinstance(got, float) and got == float(np.float32(want))
    elif vtype == 7:
        assert got is want
    else:
        assert type(got) is type(want) and got == want


def test_round_trip_metadata_and_tensors(written):
    with read_gguf(written) as f:
        assert isinstance(f, GGUFFile)
        assert f.version == 3 and f.alignment == 32 and f.data_offset % 32 == 0
        assert list(f.metadata) == list(METADATA)  # file order, architecture first
        assert f.metadata_types == TYPES
        for key, want in METADATA.items():
            _assert_value_equal(f.metadata[key], want, TYPES[key])
        want_tensors = _tensors()
        assert list(f.tensors) == [t[0] for t in want_tensors]
        for name, ggml_type, shape, data in want_tensors:
            t = f.tensors[name]
            assert isinstance(t, GGUFTensor)
            assert t.name == name and t.ggml_type == ggml_type and t.shape == shape
            assert t.data.dtype == np.uint8 and t.data.ndim == 1
            assert t.nbytes == len(_raw(data))
            assert t.data.tobytes() == _raw(data)
            assert t.offset % 32 == 0 and t.offset >= f.data_offset
            assert t.offset + t.nbytes <= f.file_size


def test_rewrite_from_read_is_byte_identical(written, tmp_path):
    again = tmp_path / "again.gguf"
    with read_gguf(written) as f:
        write_gguf(again, f.metadata, f.metadata_types,
                   [(t.name, t.ggml_type, t.shape, t.data) for t in f.tensors.values()], alignment=f.alignment)
    assert again.read_bytes() == written.read_bytes()


def test_custom_alignment_round_trip(tmp_path):
    path = tmp_path / "a64.gguf"
    md = {"general.architecture": "gemma4", "x": 1}
    tensors = [("a", GGMLType.F32, (3,), np.ones(3, np.float32)), ("b", GGMLType.F16, (5,), np.ones(5, np.float16))]
    write_gguf(path, md, {"general.architecture": 8, "x": 4}, tensors, alignment=64)
    with read_gguf(path) as f:
        assert f.alignment == 64 and f.metadata["general.alignment"] == 64 and f.metadata_types["general.alignment"] == 4
        assert f.data_offset % 64 == 0 and all(t.offset % 64 == 0 for t in f.tensors.values())
        again = tmp_path / "again.gguf"
        write_gguf(again, f.metadata, f.metadata_types,
                   [(t.name, t.ggml_type, t.shape, t.data) for t in f.tensors.values()], alignment=f.alignment)
    assert again.read_bytes() == path.read_bytes()


def test_gguf_package_reader_agrees(written):
    ref = gguf.GGUFReader(written)
    with read_gguf(written) as f:
        assert ref.data_offset == f.data_offset and ref.alignment == f.alignment
        assert list(ref.fields)[3:] == list(f.metadata)  # GGUFReader prepends 3 GGUF.* header fields
        for key, value in f.metadata.items():
            field = ref.fields[key]
            vtype = f.metadata_types[key]
            if isinstance(vtype, tuple):
                assert field.types[0] == 9
                if isinstance(vtype[1], tuple):
                    continue  # GGUFReader does not decode arrays of arrays
                assert field.types[-1] == vtype[1]
                got = field.contents()
                want = value if vtype[1] == 8 else np.asarray(value).tolist()
                assert got == want
            else:
                assert field.types == [vtype]
                assert field.contents() == value
        assert [t.name for t in ref.tensors] == list(f.tensors)
        for rt in ref.tensors:
            t = f.tensors[rt.name]
            assert int(rt.tensor_type) == t.ggml_type
            assert [int(d) for d in rt.shape] == list(reversed(t.shape))  # GGUFReader shows ne order
            assert rt.data_offset == t.offset and rt.n_bytes == t.nbytes
            assert rt.data.tobytes() == t.data.tobytes()


def test_tensor_data_is_a_view_of_the_mapping(written):
    f = read_gguf(written)
    mapped = np.frombuffer(f.mapping, dtype=np.uint8)
    for t in f.tensors.values():
        assert not t.data.flags.owndata and not t.data.flags.writeable
        assert np.shares_memory(t.data, mapped)
        assert t.data.ctypes.data - mapped.ctypes.data == t.offset
    del mapped
    f.close()


def test_close_releases_the_mapping(written):
    f = read_gguf(written)
    f.close()
    assert f.mapping is None
    f.close()  # idempotent


def test_ggml_types_match_gguf_package():
    sizes = gguf.constants.GGML_QUANT_SIZES
    for type_id, (name, block_elems, block_bytes) in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType(type_id)
        assert qtype.name == name
        assert sizes[qtype] == (block_elems, block_bytes), name
        assert GGMLType[name] == type_id
    assert set(GGMLType) == set(GGML_TYPES)
    expected = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                12: (256, 144), 13: (256, 176), 14: (256, 210), 24: (1, 1), 25: (1, 2), 26: (1, 4),
                27: (1, 8), 28: (1, 8), 30: (1, 2)}
    for type_id, sizes_expected in expected.items():
        assert GGML_TYPES[type_id][1:] == sizes_expected
    assert all(t in GGML_TYPES for t in range(10, 16))


def test_big_token_array_parses_fast(tmp_path):
    """262144 token strings + scores + types (a Gemma vocabulary's size) parse in well under a second."""
    n = 262144
    tokens = [f"\u2581tok{i}" for i in range(n)]
    path = tmp_path / "vocab.gguf"
    write_gguf(path, {"general.architecture": "gemma4", "tokenizer.ggml.tokens": tokens,
                      "tokenizer.ggml.scores": np.full(n, -1000.0, np.float32)},
               {"general.architecture": 8, "tokenizer.ggml.tokens": (9, 8), "tokenizer.ggml.scores": (9, 6)}, [])
    start = time.perf_counter()
    with read_gguf(path) as f:
        elapsed = time.perf_counter() - start
        assert f.metadata["tokenizer.ggml.tokens"] == tokens
        assert f.metadata["tokenizer.ggml.scores"].shape == (n,) and f.tensors == {}
    assert elapsed < 1.0, elapsed  # measured ~0.2-0.3 s on 2 cores


# --- write_gguf input validation -----------------------------------------------------------

def _write(tmp_path, metadata=None, types=None, tensors=(), **kw):
    metadata = {"general.architecture": "gemma4", **(metadata or {})}
    types = {"general.architecture": 8, **(types or {})}
    write_gguf(tmp_path / "w.gguf", metadata, types, tensors, **kw)


@pytest.mark.parametrize("metadata, types, match", [
    ({"k": 1}, {}, "no entry in metadata_types"),
    ({"k": 256}, {"k": 0}, "outside"),
    ({"k": -1}, {"k": 10}, "outside"),
    ({"k": 1.5}, {"k": 5}, "needs an int"),
    ({"k": True}, {"k": 5}, "needs an int"),
    ({"k": 1}, {"k": 7}, "needs a bool"),
    ({"k": 1e39}, {"k": 6}, "does not fit"),
    ({"k": b"x"}, {"k": 8}, "needs a str"),
    ({"k": 1}, {"k": 13}, "unknown value type"),
    ({"k": []}, {"k": (9, 5)}, "empty arrays"),
    ({"k": np.array([1, 300])}, {"k": (9, 0)}, "outside"),
    ({"k": np.array([1e39])}, {"k": (9, 6)}, "overflow"),
    ({"k": [1, 2]}, {"k": (9, 7)}, "dtype bool"),
    ({"k": [[1]]}, {"k": (9, (9, 0))}, "inner arrays"),
    ({"k": [1]}, {"k": 9}, "array type"),
])
def test_write_rejects_bad_metadata(tmp_path, metadata, types, match):
    with pytest.raises(ValueError, match=match):
        _write(tmp_path, metadata, types)
    assert not (tmp_path / "w.gguf").exists()


def test_write_requires_architecture(tmp_path):
    with pytest.raises(ValueError, match="general.architecture"):
        write_gguf(tmp_path / "w.gguf", {"x": 1}, {"x": 4}, [])


@pytest.mark.parametrize("tensor, match", [
    (("t", 99, (4,), np.zeros(4, np.uint8)), "unknown ggml type"),
    (("t", GGMLType.F32, (), np.zeros(4, np.uint8)), "positive dims"),
    (("t", GGMLType.F32, (2, 0), np.zeros(0, np.uint8)), "positive dims"),
    (("t", GGMLType.F32, (1, 1, 1, 1, 1), np.zeros(4, np.uint8)), "positive dims"),
    (("t", GGMLType.Q4_0, (2, 48), np.zeros(54, np.uint8)), "block"),
    (("t", GGMLType.F32, (3,), np.zeros(3, np.float64)), "dtype"),
    (("t", GGMLType.F32, (3,), np.zeros(11, np.uint8)), "bytes given"),
])
def test_write_rejects_bad_tensors(tmp_path, tensor, match):
    with pytest.raises(ValueError, match=match):
        _write(tmp_path, tensors=[tensor])


def test_write_rejects_bad_alignment(tmp_path):
    for alignment in (0, 24, -32):
        with pytest.raises(ValueError, match="power of two"):
            _write(tmp_path, alignment=alignment)
    with pytest.raises(ValueError, match="general.alignment"):
        _write(tmp_path, {"general.alignment": 64}, {"general.alignment": 4}, alignment=32)


def test_gguf_error_is_value_error_with_offset_and_field(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + (7).to_bytes(4, "little"))
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.offset == 4 and err.field == "version"
    assert str(err).startswith("offset 4: version 7")

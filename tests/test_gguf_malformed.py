"""gemma4_mlx.gguf.read_gguf on hand-built malformed files and seeded random mutations: every bad input
is a GGUFError naming the offset and field, raised quickly; nothing else ever escapes."""

import random
import struct
import time

import numpy as np
import pytest

from gemma4_mlx.gguf import GGMLType, GGUFError, read_gguf, write_gguf

F32, F16, Q8_0, Q6_K = GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.Q6_K


class Builder:
    """Little-endian GGUF bytes, recording where each named field starts in `at`."""

    def __init__(self):
        self.buf = bytearray()
        self.at: dict[str, int] = {}

    def raw(self, data: bytes, name: str | None = None) -> "Builder":
        if name:
            self.at[name] = len(self.buf)
        self.buf += data
        return self

    def u32(self, value: int, name: str | None = None) -> "Builder":
        return self.raw(struct.pack("<I", value), name)

    def u64(self, value: int, name: str | None = None) -> "Builder":
        return self.raw(struct.pack("<Q", value), name)

    def string(self, text: str | bytes, name: str) -> "Builder":
        data = text.encode() if isinstance(text, str) else text
        return self.u64(len(data), name + ".len").raw(data, name)

    def pad(self, alignment: int) -> "Builder":
        return self.raw(bytes(-len(self.buf) % alignment))


def s(text: str | bytes) -> bytes:
    """A GGUF string payload."""
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def arr(elem: int, items: bytes, count: int) -> bytes:
    """A GGUF array payload (after the value type 9)."""
    return struct.pack("<IQ", elem, count) + items


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


# The valid base file. kv0 is a 320-byte blob so that cuts in later fields still pass the count
# plausibility check and reach the field's own bounded read.
BLOB = bytes(range(256)) + bytes(64)
KVS = [
    ("blob", 9, arr(0, BLOB, len(BLOB))),
    ("general.architecture", 8, s("gemma4")),
    ("gemma4.block_count", 4, u32(2)),
    ("tokenizer.ggml.tokens", 9, arr(8, s("abcdefghij") + s("bc"), 2)),
]
TENSORS = [  # name, ne (ggml order), type, offset relative to the data section
    ("a.weight", [4, 2], F32, 0),      # 32 bytes
    ("b.weight", [32, 2], Q8_0, 32),   # 68 bytes
    ("c.weight", [3], F16, 128),       # 6 bytes
]
DATA_LEN = 160


def build(kvs=KVS, tensors=TENSORS, *, magic=b"GGUF", version=3, n_tensors=None, n_kv=None,
          alignment=32, data_len=DATA_LEN) -> Builder:
    b = Builder()
    b.raw(magic, "magic").u32(version, "version")
    b.u64(len(tensors) if n_tensors is None else n_tensors, "tensor_count")
    b.u64(len(kvs) if n_kv is None else n_kv, "kv_count")
    for i, (key, vtype, payload) in enumerate(kvs):
        b.string(key, f"kv{i}.key").u32(vtype, f"kv{i}.type").raw(payload, f"kv{i}.value")
    for i, (name, ne, ggml_type, offset) in enumerate(tensors):
        b.string(name, f"t{i}.name").u32(len(ne), f"t{i}.n_dims")
        for d, dim in enumerate(ne):
            b.u64(dim, f"t{i}.ne{d}")
        b.u32(ggml_type, f"t{i}.type").u64(offset, f"t{i}.offset")
    b.at["header_end"] = len(b.buf)
    b.pad(alignment)
    b.at["data"] = len(b.buf)
    pattern = bytes(i % 251 for i in range(data_len))
    return b.raw(pattern)


def with_kv(i, entry):
    kvs = list(KVS)
    kvs[i] = entry
    return kvs


def with_tensor(i, entry):
    tensors = list(TENSORS)
    tensors[i] = entry
    return tensors


def cut(at_name: str, plus: int, expect_at: str | None = None, expect_plus: int = 0, **kw):
    """The base file truncated `plus` bytes into field `at_name`; expected offset = start of
    `expect_at` (default: the same field) + `expect_plus`."""
    b = build(**kw)
    return bytes(b.buf[:b.at[at_name] + plus]), b.at[expect_at or at_name] + expect_plus


def patched(at_name: str, fmt: str, value: int, plus_offset: int = 0, **kw):
    """The base file with struct `fmt` value written `plus_offset` bytes into field `at_name`;
    expected offset = where it was written."""
    b = build(**kw)
    struct.pack_into("<" + fmt, b.buf, b.at[at_name] + plus_offset, value)
    return bytes(b.buf), b.at[at_name] + plus_offset


def built(expect_at: str, plus: int = 0, **kw):
    b = build(**kw)
    return bytes(b.buf), b.at[expect_at] + plus


def nested(levels: int) -> bytes:
    """An array payload nesting `levels` arrays of arrays around a 1-element u8 array."""
    payload = arr(0, b"\x01", 1)
    for _ in range(levels):
        payload = arr(9, payload, 1)
    return payload


T1 = "tensor[1] 'b.weight'"
K2 = "kv[2] 'gemma4.block_count'"
K3 = "kv[3] 'tokenizer.ggml.tokens'"

# id -> (lambda returning (file bytes, expected error offset), expected field substring, message substring)
CASES = {
    # truncated at each header field
    "empty_file": (lambda: (b"", 0), "magic", "needs 4 bytes"),
    "trunc_magic": (lambda: cut("magic", 2), "magic", "needs 4 bytes"),
    "trunc_version": (lambda: cut("version", 3), "version", "needs 4 bytes"),
    "trunc_tensor_count": (lambda: cut("tensor_count", 5), "tensor_count", "needs 8 bytes"),
    "trunc_kv_count": (lambda: cut("kv_count", 7), "kv_count", "needs 8 bytes"),
    "trunc_after_counts": (lambda: cut("kv0.key.len", 0, "tensor_count"), "tensor_count", "remaining bytes"),
    "trunc_in_blob_items": (lambda: cut("kv0.value", 12 + 100, "kv_count"), "kv_count", "remaining bytes"),
    "trunc_key_length": (lambda: cut("kv1.key.len", 3), "kv[1].key length", "needs 8 bytes"),
    "trunc_key_bytes": (lambda: cut("kv1.key", 5, "kv1.key.len"), "kv[1].key length", "exceeds"),
    "trunc_value_type": (lambda: cut("kv2.type", 2), f"{K2} value type", "needs 4 bytes"),
    "trunc_u32_value": (lambda: cut("kv2.value", 2), f"{K2} value", "needs 4 bytes"),
    "trunc_string_value": (lambda: cut("kv1.value", 10, "kv1.value"), "value length", "exceeds"),
    "trunc_array_type": (lambda: cut("kv3.value", 2), f"{K3} value element type", "needs 4 bytes"),
    "trunc_array_count": (lambda: cut("kv3.value", 4 + 3, "kv3.value", 4), f"{K3} value count", "needs 8 bytes"),
    "trunc_array_item": (lambda: cut("kv3.value", 12 + 18 + 4, "kv3.value", 12 + 18), f"{K3} value[1] length",
                         "needs 8"),
    "trunc_tensor_name": (lambda: cut("t1.name", 3, "t1.name.len"), "tensor[1].name length", "exceeds"),
    "trunc_n_dims": (lambda: cut("t1.n_dims", 1), f"{T1}.n_dims", "needs 4 bytes"),
    "trunc_ne0": (lambda: cut("t1.ne0", 4), f"{T1}.ne[0]", "needs 8 bytes"),
    "trunc_ne1": (lambda: cut("t1.ne1", 7), f"{T1}.ne[1]", "needs 8 bytes"),
    "trunc_tensor_type": (lambda: cut("t1.type", 3), f"{T1}.type", "needs 4 bytes"),
    "trunc_tensor_offset": (lambda: cut("t1.offset", 6), f"{T1}.offset", "needs 8 bytes"),
    "trunc_before_data": (lambda: cut("header_end", 0), "data section", "past the end"),
    "trunc_in_data": (lambda: cut("data", 130, "t2.offset"), "tensor 'c.weight'.offset", "past the end"),
    # huge counts and lengths
    "tensor_count_2_62": (lambda: patched("tensor_count", "Q", 2**62), "tensor_count", "remaining bytes can hold"),
    "kv_count_2_62": (lambda: patched("kv_count", "Q", 2**62), "kv_count", "remaining bytes can hold"),
    "kv_count_max_u64": (lambda: patched("kv_count", "Q", 2**64 - 1), "kv_count", "remaining bytes can hold"),
    "key_length_2_63": (lambda: patched("kv1.key.len", "Q", 2**63), "kv[1].key length", "exceeds"),
    "string_value_length_2_63": (lambda: patched("kv1.value", "Q", 2**63), "value length", "exceeds"),
    "array_count_2_60": (lambda: patched("kv3.value", "Q", 2**60, plus_offset=4), f"{K3} value count",
                         "remaining bytes can hold"),
    "blob_count_2_60": (lambda: patched("kv0.value", "Q", 2**60, plus_offset=4), "value count",
                        "remaining bytes can hold"),
    "tensor_name_length_2_63": (lambda: patched("t1.name.len", "Q", 2**63), "tensor[1].name length", "exceeds"),
    # unknown types
    "unknown_value_type": (lambda: patched("kv2.type", "I", 13), f"{K2} value type", "not a known GGUF value type"),
    "unknown_array_elem_type": (lambda: patched("kv3.value", "I", 99), "value element type", "not a known"),
    "unknown_ggml_type": (lambda: patched("t1.type", "I", 31), f"{T1}.type", "not a known ggml type"),
    "huge_ggml_type": (lambda: patched("t1.type", "I", 2**32 - 1), f"{T1}.type", "not a known ggml type"),
    # shapes
    "n_dims_0": (lambda: built("t1.n_dims", tensors=with_tensor(1, ("b.weight", [], Q8_0, 32))),
                 f"{T1}.n_dims", "outside 1..4"),
    "n_dims_5": (lambda: built("t1.n_dims", tensors=with_tensor(1, ("b.weight", [32, 1, 1, 1, 2], Q8_0, 32))),
                 f"{T1}.n_dims", "outside 1..4"),
    "dim_0": (lambda: patched("t1.ne1", "Q", 0), f"{T1}.ne[1]", "is 0"),
    "shape_overflows_int64": (lambda: built("t1.ne1", tensors=with_tensor(1, ("b.weight", [2**32, 2**32, 2**32], F32, 32))),
                              f"{T1}.ne[1]", "exceed 2**62"),
    "shape_max_u64_dims": (lambda: built("t1.ne0", tensors=with_tensor(1, ("b.weight", [2**64 - 1], F32, 32))),
                           f"{T1}.ne[0]", "exceed 2**62"),
    "shape_too_big_for_file": (lambda: built("t1.offset", tensors=with_tensor(1, ("b.weight", [2**20, 2**20], F32, 32))),
                               "tensor 'b.weight'.offset", "past the end"),
    "ne0_not_multiple_of_q8_0_block": (lambda: patched("t1.ne0", "Q", 33), f"{T1}.ne[0]", "block size 32"),
    "ne0_not_multiple_of_q6_k_block": (lambda: built("t1.ne0", tensors=with_tensor(1, ("b.weight", [128], Q6_K, 32))),
                                       f"{T1}.ne[0]", "block size 256"),
    # alignment and placement
    "misaligned_tensor_offset": (lambda: patched("t1.offset", "Q", 36), f"{T1}.offset", "not a multiple of the alignment 32"),
    "alignment_not_power_of_two": (lambda: built("kv2.value", kvs=with_kv(2, ("general.alignment", 4, u32(24)))),
                                   "general.alignment", "not a power of two"),
    "alignment_zero": (lambda: built("kv2.value", kvs=with_kv(2, ("general.alignment", 4, u32(0)))),
                       "general.alignment", "not a power of two"),
    "alignment_wrong_type": (lambda: built("kv2.value", kvs=with_kv(2, ("general.alignment", 10, struct.pack("<Q", 32)))),
                             "general.alignment", "expected 4 (u32)"),
    "offset_misaligned_for_alignment_64": (
        lambda: built("t1.offset", kvs=with_kv(2, ("general.alignment", 4, u32(64))), alignment=64),
        f"{T1}.offset", "alignment 64"),
    "overlapping_tensors_same_offset": (lambda: patched("t1.offset", "Q", 0), "tensor 'b.weight'.offset", "overlapping"),
    "overlapping_tensors_partial": (lambda: patched("t2.offset", "Q", 96), "tensor 'c.weight'.offset", "overlapping"),
    "tensor_past_end_of_file": (lambda: patched("t2.offset", "Q", 1024), "tensor 'c.weight'.offset", "past the end"),
    "tensor_offset_max_u64": (lambda: patched("t2.offset", "Q", 2**64 - 32), "tensor 'c.weight'.offset", "past the end"),
    # duplicates and text
    "duplicate_tensor_names": (lambda: built("t1.name.len", tensors=with_tensor(1, ("a.weight", [32, 2], Q8_0, 32))),
                               "tensor[1].name", "duplicates tensor name 'a.weight'"),
    "duplicate_keys": (lambda: built("kv2.key.len", kvs=with_kv(2, ("general.architecture", 8, s("x")))),
                       "kv[2].key", "duplicates key 'general.architecture'"),
    "invalid_utf8_key": (lambda: built("kv2.key", 3, kvs=with_kv(2, (b"bad\xff", 4, u32(1)))), "kv[2].key", "UTF-8"),
    "invalid_utf8_string_value": (lambda: built("kv1.value", 8 + 1, kvs=with_kv(1, ("general.architecture", 8, s(b"g\xc3(")))),
                                  "value", "UTF-8"),
    "invalid_utf8_in_string_array": (
        lambda: built("kv3.value", 12 + 9 + 8, kvs=with_kv(3, ("tokenizer.ggml.tokens", 9, arr(8, s("a") + s(b"\xed\xa0\x80"), 2)))),
        f"{K3} value[1]", "UTF-8"),
    # header identity
    "bad_magic": (lambda: built("magic", magic=b"GGML"), "magic", "expected b'GGUF'"),
    "version_1": (lambda: built("version", version=1), "version", "1 is not supported"),
    "version_4": (lambda: built("version", version=4), "version", "4 is not supported"),
    "version_big_endian": (lambda: built("version", version=3 << 24), "version", "big-endian"),
    # values
    "bool_value_2": (lambda: built("kv2.value", kvs=with_kv(2, ("flag", 7, b"\x02"))), f"kv[2] 'flag' value", "bool byte is 2"),
    "bool_array_value_5": (lambda: built("kv2.value", 12 + 2, kvs=with_kv(2, ("flags", 9, arr(7, b"\x00\x01\x05", 3)))),
                           "kv[2] 'flags' value[2]", "bool byte is 5"),
    "arrays_nested_too_deep": (lambda: built("kv2.value", 12 * 7, kvs=with_kv(2, ("deep", 9, nested(8)))),
                               "element type", "deeper than 8"),
    "nested_arrays_of_mixed_types": (
        lambda: built("kv2.value", 12 + 13, kvs=with_kv(2, ("mix", 9, arr(9, arr(0, b"\x01", 1) + arr(5, u32(7), 1), 2)))),
        "kv[2] 'mix' value[1]", "not supported"),
}


def test_base_file_is_valid(tmp_path):
    path = tmp_path / "base.gguf"
    b = build()
    path.write_bytes(b.buf)
    with read_gguf(path) as f:
        assert f.metadata["blob"].tobytes() == BLOB and f.metadata["tokenizer.ggml.tokens"] == ["abcdefghij", "bc"]
        assert f.data_offset == b.at["data"]
        assert [(t.name, t.shape, t.offset - f.data_offset) for t in f.tensors.values()] == [
            ("a.weight", (2, 4), 0), ("b.weight", (2, 32), 32), ("c.weight", (3,), 128)]
        assert f.tensors["b.weight"].data.tobytes() == bytes(b.buf[b.at["data"] + 32:b.at["data"] + 100])


def test_nesting_at_the_limit_is_accepted(tmp_path):
    path = tmp_path / "nested.gguf"
    path.write_bytes(build(kvs=with_kv(2, ("deep", 9, nested(7)))).buf)
    with read_gguf(path) as f:
        value, vtype = f.metadata["deep"], f.metadata_types["deep"]
        for _ in range(7):
            assert isinstance(value, list) and len(value) == 1 and vtype[0] == 9
            value, vtype = value[0], vtype[1]
        assert value.tolist() == [1] and vtype == (9, 0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_file_raises_gguf_error(tmp_path, case):
    make, field, message = CASES[case]
    data, offset = make()
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(data)
    start = time.perf_counter()
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    assert time.perf_counter() - start < 1.0
    err = info.value
    assert field in err.field, (err.field, str(err))
    assert message in str(err), str(err)
    assert err.offset == offset, str(err)
    assert str(err).startswith(f"offset {offset}: ")


def test_case_count():
    assert len(CASES) >= 30


# --- seeded mutations --------------------------------------------------------------------------

INTERESTING_U64 = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 2**31, 2**32 - 1, 2**32,
                   2**60, 2**62, 2**63, 2**64 - 1]
INTERESTING_U32 = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 12, 13, 14, 24, 30, 31, 255, 2**31, 2**32 - 1]


def _written_base(tmp_path) -> bytes:
    """A few-KB file from write_gguf: strings, arrays, 4 tensors of mixed types."""
    rng = np.random.default_rng(7)
    path = tmp_path / "written.gguf"
    write_gguf(
        path,
        {"general.architecture": "gemma4", "gemma4.block_count": 2, "gemma4.rope.freq_base": 1e6,
         "tokenizer.ggml.tokens": [f"\u2581t{i}" for i in range(40)],
         "tokenizer.ggml.scores": np.zeros(40, np.float32),
         "gemma4.attention.sliding_window_pattern": np.array([True, False]),
         "gemma4.feed_forward_length": np.array([64, 128], np.int32)},
        {"general.architecture": 8, "gemma4.block_count": 4, "gemma4.rope.freq_base": 6,
         "tokenizer.ggml.tokens": (9, 8), "tokenizer.ggml.scores": (9, 6),
         "gemma4.attention.sliding_window_pattern": (9, 7), "gemma4.feed_forward_length": (9, 5)},
        [("token_embd.weight", GGMLType.Q8_0, (8, 64), rng.integers(0, 256, 8 * 2 * 34, dtype=np.uint8)),
         ("output_norm.weight", GGMLType.F32, (64,), rng.standard_normal(64).astype(np.float32)),
         ("blk.0.attn_q.weight", GGMLType.Q4_0, (4, 64), rng.integers(0, 256, 4 * 2 * 18, dtype=np.uint8)),
         ("blk.0.attn_k.weight", GGMLType.F16, (2, 64), rng.standard_normal(128).astype(np.float16))])
    return path.read_bytes()


def _mutate(rng: random.Random, data: bytes, header_end: int, fields: list[int]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        if not buf:
            break
        header_end = min(header_end, len(buf))
        fields = [pos for pos in fields if pos < len(buf)]
        kind = rng.randrange(6)
        if kind == 0:  # bit flip, mostly in the header
            pos = rng.randrange(header_end if rng.random() < 0.8 else len(buf))
            buf[pos] ^= 1 << rng.randrange(8)
        elif kind == 1:  # random byte value at a header position
            buf[rng.randrange(header_end)] = rng.randrange(256)
        elif kind == 2:  # truncation
            del buf[rng.randrange(len(buf)):]
        elif kind == 3 and fields:  # u64 overwrite at a known header field
            pos = rng.choice(fields)
            value = rng.choice(INTERESTING_U64) if rng.random() < 0.7 else rng.getrandbits(64)
            buf[pos:pos + 8] = struct.pack("<Q", value)[:max(0, len(buf) - pos)]
        elif kind == 4 and fields:  # u32 overwrite at a known header field
            pos = rng.choice(fields)
            value = rng.choice(INTERESTING_U32) if rng.random() < 0.7 else rng.getrandbits(32)
            buf[pos:pos + 4] = struct.pack("<I", value)[:max(0, len(buf) - pos)]
        else:  # u64 overwrite at a random header position
            pos = rng.randrange(max(1, header_end - 8))
            if pos + 8 > len(buf):
                continue
            buf[pos:pos + 8] = struct.pack("<Q", rng.choice(INTERESTING_U64))
    return bytes(buf)


def _header_field_starts(data: bytes) -> list[int]:
    """Start offsets of every u32/u64/length field of a valid file, found with our own reader's layout."""
    b = build()
    assert bytes(b.buf) == data
    return sorted(b.at[k] for k in b.at if k not in ("data", "header_end") and not k.endswith((".key", ".name")))


def test_seeded_mutations_only_raise_gguf_error(tmp_path):
    rng = random.Random(20240611)
    base = bytes(build().buf)
    bases = [
        (base, build().at["header_end"], _header_field_starts(base)),
        (_written_base(tmp_path), None, []),
    ]
    with read_gguf(tmp_path / "written.gguf") as f:
        bases[1] = (bases[1][0], f.data_offset, [])
    path = tmp_path / "mutant.gguf"
    outcomes = {"ok": 0, "error": 0}
    slowest = 0.0
    for n in range(700):
        data, header_end, fields = bases[n % 2]
        mutant = _mutate(rng, data, header_end, fields)
        path.write_bytes(mutant)
        start = time.perf_counter()
        try:
            f = read_gguf(path)
        except GGUFError as err:
            assert str(err).startswith(f"offset {err.offset}: ") and 0 <= err.offset <= len(mutant)
            outcomes["error"] += 1
        else:
            outcomes["ok"] += 1
            with f:
                assert f.file_size == len(mutant)
                for t in f.tensors.values():
                    assert f.data_offset <= t.offset and t.offset + t.nbytes <= len(mutant)
                    assert t.data.tobytes() == mutant[t.offset:t.offset + t.nbytes]
        slowest = max(slowest, time.perf_counter() - start)
    assert slowest < 1.0
    assert outcomes["error"] >= 200 and outcomes["ok"] >= 20, outcomes

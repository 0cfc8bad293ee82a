"""Strict GGUF v2/v3 reading over a memory map, and writing through the `gguf` package.

Reading checks every count, length, type, shape, alignment and extent against the bytes that are
actually there before trusting it; any malformed input raises `GGUFError` (a `ValueError`) whose
message starts with "offset N: FIELD ...". Tensor data is never copied: `GGUFTensor.data` is a
read-only uint8 view into the memory map.

Layout (little-endian): magic "GGUF", version u32, tensor_count u64, kv_count u64, kv_count x
(key string, value_type u32, value), tensor_count x (name string, n_dims u32, ne u64[n_dims],
ggml_type u32, offset u64), padding to `general.alignment` (default 32), tensor data.
A string is a u64 byte length followed by UTF-8 bytes; an array is elem_type u32, count u64, elems.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Iterable

import numpy as np

__all__ = [
    "GGUFError",
    "GGMLType",
    "GGML_TYPES",
    "GGUFValueCode",
    "GGUFTensor",
    "GGUFFile",
    "read_gguf",
    "write_gguf",
]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4
# Upper bound on a tensor's element count: leaves headroom below 2**63 for byte offsets.
MAX_ELEMENTS = 2**62
# Deepest array-of-array nesting accepted (bounds recursion on hostile input).
MAX_ARRAY_NESTING = 8


class GGUFError(ValueError):
    """A malformed GGUF file. `.offset` is the absolute byte offset of the bad field, `.field` its name."""

    def __init__(self, offset: int, field: str, problem: str):
        self.offset = int(offset)
        self.field = field
        self.problem = problem
        super().__init__(f"offset {self.offset}: {field} {problem}")


class GGMLType(IntEnum):
    """ggml tensor type ids (ggml.h `enum ggml_type`)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


# type -> (elements per block, bytes per block); equal to gguf.constants.GGML_QUANT_SIZES (tested).
_BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 40),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ2_XS: (256, 74),
    GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (256, 56),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66),
    GGMLType.MXFP4: (32, 17),
    GGMLType.NVFP4: (64, 36),
    GGMLType.Q1_0: (128, 18),
}

GGML_TYPES: dict[int, tuple[str, int, int]] = {
    int(t): (t.name, block_elems, block_bytes) for t, (block_elems, block_bytes) in _BLOCK_SIZES.items()
}


class GGUFValueCode(IntEnum):
    """GGUF metadata value type codes."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Fixed-size scalar codes -> little-endian numpy dtype (bool read as u8, then checked to be 0/1).
_SCALAR_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("<u1"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_SCALAR_STRUCTS: dict[int, struct.Struct] = {
    code: struct.Struct("<" + fmt)
    for code, fmt in {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}.items()
}
_INT_RANGES: dict[int, tuple[int, int]] = {
    0: (0, 2**8 - 1),
    1: (-(2**7), 2**7 - 1),
    2: (0, 2**16 - 1),
    3: (-(2**15), 2**15 - 1),
    4: (0, 2**32 - 1),
    5: (-(2**31), 2**31 - 1),
    10: (0, 2**64 - 1),
    11: (-(2**63), 2**63 - 1),
}
_FLOAT_CODES = (6, 12)
_STRING, _ARRAY, _BOOL = 8, 9, 7
# Fewest bytes one encoded array element of each type can occupy.
_MIN_ELEM_BYTES = {**{c: dt.itemsize for c, dt in _SCALAR_DTYPES.items()}, _STRING: 8, _ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one ne, type, offset

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor. `shape` is the logical numpy order (reversed ggml ne): a PyTorch [out, in] matrix
    has shape (out, in). `data` is a read-only uint8 view of the raw bytes (quant blocks as stored)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int  # absolute file offset of the first byte

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]


class GGUFFile:
    """A parsed GGUF file backed by a read-only memory map.

    metadata: key -> Python int/float/bool/str; arrays of numbers/bools as numpy arrays (copies, dtype
    of the element type); arrays of strings as list[str]; arrays of arrays as lists.
    metadata_types: key -> value type code (0..12), or (9, elem) for arrays where elem is the element
    code, or for arrays of arrays (9, inner) recursively; an empty array of arrays is (9, 9).
    tensors: name -> GGUFTensor in file order.
    close() releases the mapping; if tensor views are still referenced the mapping stays alive until
    the last of them is gone.
    """

    def __init__(self, path: str, version: int, alignment: int, data_offset: int, file_size: int,
                 metadata: dict[str, Any], metadata_types: dict[str, Any],
                 tensors: dict[str, GGUFTensor], mapping: mmap.mmap | None):
        self.path = path
        self.version = version
        self.alignment = alignment
        self.data_offset = data_offset
        self.file_size = file_size
        self.metadata = metadata
        self.metadata_types = metadata_types
        self.tensors = tensors
        self._mapping = mapping

    @property
    def mapping(self) -> mmap.mmap | None:
        """The underlying read-only mmap (None for files without a mapping, i.e. empty files)."""
        return self._mapping

    def close(self) -> None:
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # tensor views still reference it; it is unmapped when they are collected

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, version={self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors, alignment={self.alignment})")


class _Cursor:
    """Bounded little-endian reads over a buffer; every short read raises GGUFError."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: Any, end: int):
        self.buf = buf
        self.pos = 0
        self.end = end

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def need(self, n: int, field: str) -> None:
        if n > self.end - self.pos:
            raise GGUFError(self.pos, field, f"needs {n} bytes but only {self.end - self.pos} remain")

    def u32(self, field: str) -> int:
        self.need(4, field)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self, field: str) -> int:
        self.need(8, field)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def raw(self, n: int, field: str) -> bytes:
        self.need(n, field)
        value = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return value

    def string(self, field: str) -> str:
        length_offset = self.pos
        length = self.u64(field + " length")
        if length > self.end - self.pos:
            raise GGUFError(length_offset, field + " length",
                            f"{length} exceeds the {self.end - self.pos} remaining bytes")
        start = self.pos
        try:
            value = str(self.buf[start:start + length], "utf-8")
        except UnicodeDecodeError as err:
            raise GGUFError(start + err.start, field, f"is not valid UTF-8 ({err.reason})") from None
        self.pos = start + length
        return value

    def count(self, per_item_bytes: int, field: str) -> int:
        """Read a u64 count and check count * per_item_bytes fits in what remains."""
        count_offset = self.pos
        n = self.u64(field)
        if n * per_item_bytes > self.end - self.pos:
            raise GGUFError(count_offset, field,
                            f"{n} exceeds what {self.end - self.pos} remaining bytes can hold "
                            f"(>= {per_item_bytes} bytes each)")
        return n


def _read_scalar(cur: _Cursor, code: int, field: str) -> Any:
    size = _SCALAR_DTYPES[code].itemsize
    cur.need(size, field)
    (value,) = _SCALAR_STRUCTS[code].unpack_from(cur.buf, cur.pos)
    if code == _BOOL:
        if value > 1:
            raise GGUFError(cur.pos, field, f"bool byte is {value}, expected 0 or 1")
        value = bool(value)
    cur.pos += size
    return value


def _read_string_array(cur: _Cursor, n: int, field: str) -> list[str]:
    """n strings; n was already checked against the remaining bytes (8 bytes minimum each)."""
    buf, pos, end = cur.buf, cur.pos, cur.end
    unpack = _U64.unpack_from
    out: list[str] = [""] * n
    for i in range(n):
        if end - pos < 8:
            raise GGUFError(pos, f"{field}[{i}] length", f"needs 8 bytes but only {end - pos} remain")
        (length,) = unpack(buf, pos)
        pos += 8
        if length > end - pos:
            raise GGUFError(pos - 8, f"{field}[{i}] length", f"{length} exceeds the {end - pos} remaining bytes")
        try:
            out[i] = str(buf[pos:pos + length], "utf-8")
        except UnicodeDecodeError as err:
            raise GGUFError(pos + err.start, f"{field}[{i}]", f"is not valid UTF-8 ({err.reason})") from None
        pos += length
    cur.pos = pos
    return out


def _read_array(cur: _Cursor, field: str, depth: int) -> tuple[Any, Any]:
    """Returns (value, type descriptor (9, elem))."""
    type_offset = cur.pos
    elem = cur.u32(field + " element type")
    if elem not in _MIN_ELEM_BYTES:
        raise GGUFError(type_offset, field + " element type", f"{elem} is not a known GGUF value type")
    n = cur.count(_MIN_ELEM_BYTES[elem], field + " count")
    if elem == _STRING:
        return _read_string_array(cur, n, field), (_ARRAY, _STRING)
    if elem == _ARRAY:
        if depth >= MAX_ARRAY_NESTING:
            raise GGUFError(type_offset, field + " element type",
                            f"nests arrays deeper than {MAX_ARRAY_NESTING} levels")
        items: list[Any] = []
        inner_type: Any = None
        for i in range(n):
            item_offset = cur.pos
            item, item_type = _read_array(cur, f"{field}[{i}]", depth + 1)
            if inner_type is None:
                inner_type = item_type
            elif item_type != inner_type:
                raise GGUFError(item_offset, f"{field}[{i}]",
                                f"has type {item_type}, unlike the first element's {inner_type}; "
                                "arrays of differently typed arrays are not supported")
            items.append(item)
        return items, (_ARRAY, _ARRAY if inner_type is None else inner_type)
    dtype = _SCALAR_DTYPES[elem]
    values = np.frombuffer(cur.buf, dtype=dtype, count=n, offset=cur.pos).copy()
    if elem == _BOOL:
        if n and int(values.max()) > 1:
            bad = int(np.argmax(values > 1))
            raise GGUFError(cur.pos + bad, f"{field}[{bad}]", f"bool byte is {int(values[bad])}, expected 0 or 1")
        values = values.view(np.bool_)
    else:
        values = values.astype(dtype.newbyteorder("="), copy=False)
    cur.pos += n * dtype.itemsize
    return values, (_ARRAY, elem)


def _read_value(cur: _Cursor, code: int, field: str) -> tuple[Any, Any]:
    if code == _STRING:
        return cur.string(field), _STRING
    if code == _ARRAY:
        return _read_array(cur, field, 1)
    return _read_scalar(cur, code, field), code


def _parse(buf: Any, size: int, path: str, mapping: mmap.mmap | None) -> GGUFFile:
    cur = _Cursor(buf, size)
    magic = cur.raw(4, "magic")
    if magic != GGUF_MAGIC:
        raise GGUFError(0, "magic", f"is {magic!r}, expected {GGUF_MAGIC!r}")
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS else ""
        raise GGUFError(4, "version", f"{version} is not supported{hint}; expected 2 or 3")
    tensor_count = cur.u64("tensor_count")
    kv_count = cur.u64("kv_count")
    left = cur.remaining
    if tensor_count * _MIN_TENSOR_INFO_BYTES > left:
        raise GGUFError(8, "tensor_count", f"{tensor_count} exceeds what {left} remaining bytes can hold "
                        f"(>= {_MIN_TENSOR_INFO_BYTES} bytes per tensor info)")
    if kv_count * _MIN_KV_BYTES + tensor_count * _MIN_TENSOR_INFO_BYTES > left:
        raise GGUFError(16, "kv_count", f"{kv_count} (with {tensor_count} tensor infos) exceeds what {left} "
                        f"remaining bytes can hold (>= {_MIN_KV_BYTES} bytes per key/value)")

    metadata: dict[str, Any] = {}
    metadata_types: dict[str, Any] = {}
    value_offsets: dict[str, int] = {}
    for i in range(kv_count):
        key_offset = cur.pos
        key = cur.string(f"kv[{i}].key")
        if key in metadata:
            raise GGUFError(key_offset, f"kv[{i}].key", f"duplicates key {key!r}")
        type_offset = cur.pos
        code = cur.u32(f"kv[{i}] {key!r} value type")
        if code not in _MIN_ELEM_BYTES:
            raise GGUFError(type_offset, f"kv[{i}] {key!r} value type", f"{code} is not a known GGUF value type")
        value_offsets[key] = cur.pos
        metadata[key], metadata_types[key] = _read_value(cur, code, f"kv[{i}] {key!r} value")

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        field_offset = value_offsets["general.alignment"]
        if metadata_types["general.alignment"] != GGUFValueCode.UINT32:
            raise GGUFError(field_offset, "general.alignment",
                            f"has value type {metadata_types['general.alignment']}, expected 4 (u32)")
        alignment = metadata["general.alignment"]
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(field_offset, "general.alignment", f"{alignment} is not a power of two")

    infos: list[tuple[str, int, tuple[int, ...], int, int, int]] = []  # name, type, shape, rel offset, nbytes, field pos
    seen: set[str] = set()
    for i in range(tensor_count):
        name_offset = cur.pos
        name = cur.string(f"tensor[{i}].name")
        if name in seen:
            raise GGUFError(name_offset, f"tensor[{i}].name", f"duplicates tensor name {name!r}")
        seen.add(name)
        label = f"tensor[{i}] {name!r}"
        ndim_offset = cur.pos
        n_dims = cur.u32(f"{label}.n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(ndim_offset, f"{label}.n_dims", f"{n_dims} is outside 1..{MAX_DIMS}")
        ne: list[int] = []
        n_elements = 1
        for d in range(n_dims):
            dim_offset = cur.pos
            dim = cur.u64(f"{label}.ne[{d}]")
            if dim == 0:
                raise GGUFError(dim_offset, f"{label}.ne[{d}]", "is 0; empty tensors are not accepted")
            n_elements *= dim
            if n_elements > MAX_ELEMENTS:
                raise GGUFError(dim_offset, f"{label}.ne[{d}]",
                                f"{dim} makes the element count {n_elements} exceed 2**62")
            ne.append(dim)
        type_offset = cur.pos
        ggml_type = cur.u32(f"{label}.type")
        if ggml_type not in GGML_TYPES:
            raise GGUFError(type_offset, f"{label}.type", f"{ggml_type} is not a known ggml type")
        type_name, block_elems, block_bytes = GGML_TYPES[ggml_type]
        if ne[0] % block_elems:
            raise GGUFError(ndim_offset + 4, f"{label}.ne[0]",
                            f"{ne[0]} is not a multiple of the {type_name} block size {block_elems}")
        offset_pos = cur.pos
        rel_offset = cur.u64(f"{label}.offset")
        if rel_offset % alignment:
            raise GGUFError(offset_pos, f"{label}.offset", f"{rel_offset} is not a multiple of the alignment {alignment}")
        nbytes = n_elements // block_elems * block_bytes
        infos.append((name, ggml_type, tuple(reversed(ne)), rel_offset, nbytes, offset_pos))

    header_end = cur.pos
    data_offset = -(-header_end // alignment) * alignment
    if infos and data_offset > size:
        raise GGUFError(header_end, "data section",
                        f"would start at {data_offset} (aligned to {alignment}), past the end of the {size}-byte file")

    prev_end, prev_name = data_offset, None
    for name, _, _, rel_offset, nbytes, offset_pos in sorted(infos, key=lambda info: info[3]):
        start = data_offset + rel_offset
        if start + nbytes > size:
            raise GGUFError(offset_pos, f"tensor {name!r}.offset",
                            f"places bytes [{start}, {start + nbytes}) past the end of the {size}-byte file")
        if start < prev_end:
            raise GGUFError(offset_pos, f"tensor {name!r}.offset",
                            f"places bytes [{start}, {start + nbytes}) overlapping tensor {prev_name!r}, "
                            f"which ends at {prev_end}")
        prev_end, prev_name = start + nbytes, name

    tensors: dict[str, GGUFTensor] = {}
    for name, ggml_type, shape, rel_offset, nbytes, _ in infos:
        start = data_offset + rel_offset
        view = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start)
        tensors[name] = GGUFTensor(name=name, ggml_type=ggml_type, shape=shape, data=view, offset=start)
    return GGUFFile(path, version, alignment, data_offset, size, metadata, metadata_types, tensors, mapping)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and validate a GGUF v2/v3 file; tensor data stays in a read-only memory map.

    Raises GGUFError (a ValueError naming the byte offset and field) for any malformed content,
    OSError if the file cannot be opened.
    """
    path = os.fspath(path)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    try:
        return _parse(mapping if mapping is not None else b"", size, path, mapping)
    except BaseException:
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass
        raise


# ---------------------------------------------------------------------------------------------
# Writing (through gguf.GGUFWriter)
# ---------------------------------------------------------------------------------------------

# Natural numpy dtypes accepted for tensor data besides raw uint8 bytes.
_TENSOR_DTYPES: dict[int, np.dtype] = {
    GGMLType.F32: np.dtype("<f4"),
    GGMLType.F16: np.dtype("<f2"),
    GGMLType.BF16: np.dtype("<u2"),  # raw bf16 bit patterns
    GGMLType.F64: np.dtype("<f8"),
    GGMLType.I8: np.dtype("<i1"),
    GGMLType.I16: np.dtype("<i2"),
    GGMLType.I32: np.dtype("<i4"),
    GGMLType.I64: np.dtype("<i8"),
}
# Element types gguf.GGUFWriter infers for Python values inside nested arrays (GGUFValueType.get_type).
_WRITER_INFERABLE = {_STRING, 5, 6, _BOOL}


def _is_array_type(vtype: Any) -> bool:
    return isinstance(vtype, tuple) and len(vtype) == 2 and vtype[0] == _ARRAY


def _check_scalar(key: str, code: int, value: Any) -> Any:
    """Validate a scalar against its type code; returns the plain Python value to pack."""
    if code in _INT_RANGES:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"metadata {key!r}: type {code} needs an int, got {type(value).__name__}")
        lo, hi = _INT_RANGES[code]
        if not lo <= int(value) <= hi:
            raise ValueError(f"metadata {key!r}: {value} is outside [{lo}, {hi}] for type {code}")
        return int(value)
    if code in _FLOAT_CODES:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"metadata {key!r}: type {code} needs a float, got {type(value).__name__}")
        try:
            _SCALAR_STRUCTS[code].pack(float(value))
        except (OverflowError, struct.error) as err:
            raise ValueError(f"metadata {key!r}: {value} does not fit type {code}: {err}") from None
        return float(value)
    if code == _BOOL:
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"metadata {key!r}: type 7 needs a bool, got {type(value).__name__}")
        return bool(value)
    if code == _STRING:
        if not isinstance(value, str):
            raise ValueError(f"metadata {key!r}: type 8 needs a str, got {type(value).__name__}")
        return value
    raise ValueError(f"metadata {key!r}: unknown value type {code!r}")


def _check_array(key: str, elem: Any, value: Any, nested: bool) -> list[Any]:
    """Validate an array's elements against elem (a code or a nested (9, ...) descriptor); returns a list."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"metadata {key!r}: an array value must be a sequence, not {type(value).__name__}")
    if len(value) == 0:
        raise ValueError(f"metadata {key!r}: gguf.GGUFWriter cannot write empty arrays")
    if nested and not (_is_array_type(elem) or elem in _WRITER_INFERABLE):
        raise ValueError(f"metadata {key!r}: gguf.GGUFWriter writes inner arrays only with element types "
                         f"{sorted(_WRITER_INFERABLE)} or arrays, got {elem!r}")
    if _is_array_type(elem):
        return [_check_array(key, elem[1], item, nested=True) for item in value]
    if elem == _STRING:
        return [_check_scalar(key, _STRING, item) for item in value]
    if elem in _INT_RANGES or elem in _FLOAT_CODES or elem == _BOOL:
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise ValueError(f"metadata {key!r}: array of type {elem} must be 1-D, got shape {arr.shape}")
        if elem == _BOOL:
            if arr.dtype != np.bool_:
                raise ValueError(f"metadata {key!r}: bool array needs dtype bool, got {arr.dtype}")
            return arr.tolist()
        if elem in _INT_RANGES:
            if arr.dtype.kind not in "iu":
                raise ValueError(f"metadata {key!r}: int array of type {elem} needs integers, got {arr.dtype}")
            lo, hi = _INT_RANGES[elem]
            if int(arr.min()) < lo or int(arr.max()) > hi:
                raise ValueError(f"metadata {key!r}: values outside [{lo}, {hi}] for element type {elem}")
            return [int(v) for v in arr.tolist()]
        if arr.dtype.kind not in "iuf":
            raise ValueError(f"metadata {key!r}: float array needs numbers, got {arr.dtype}")
        target = _SCALAR_DTYPES[elem].newbyteorder("=")
        with np.errstate(over="ignore"):
            converted = arr.astype(target)
        if np.any(np.isfinite(arr) & ~np.isfinite(converted)):
            raise ValueError(f"metadata {key!r}: values overflow element type {elem}")
        return converted.tolist()
    raise ValueError(f"metadata {key!r}: unknown array element type {elem!r}")


def _tensor_bytes(name: str, ggml_type: int, shape: tuple[int, ...], data: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """Validate one tensor; returns (flat uint8 bytes, byte shape for GGUFWriter.add_tensor)."""
    if ggml_type not in GGML_TYPES:
        raise ValueError(f"tensor {name!r}: unknown ggml type {ggml_type}")
    type_name, block_elems, block_bytes = GGML_TYPES[ggml_type]
    if not 1 <= len(shape) <= MAX_DIMS or any(not isinstance(d, (int, np.integer)) or d < 1 for d in shape):
        raise ValueError(f"tensor {name!r}: shape {shape} needs 1..{MAX_DIMS} positive dims")
    if shape[-1] % block_elems:
        raise ValueError(f"tensor {name!r}: last dim {shape[-1]} is not a multiple of the {type_name} block {block_elems}")
    data = np.asarray(data)
    natural = _TENSOR_DTYPES.get(ggml_type)
    if data.dtype != np.uint8 and not (natural is not None and data.dtype == natural):
        allowed = "uint8" + (f" or {natural}" if natural is not None else "")
        raise ValueError(f"tensor {name!r}: {type_name} data must have dtype {allowed}, got {data.dtype}")
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    expected = math.prod(shape) // block_elems * block_bytes
    if raw.nbytes != expected:
        raise ValueError(f"tensor {name!r}: {raw.nbytes} bytes given, {type_name} {shape} needs {expected}")
    byte_shape = (*shape[:-1], shape[-1] // block_elems * block_bytes)
    return raw.reshape(byte_shape), byte_shape


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any], metadata_types: dict[str, Any],
               tensors: Iterable[tuple[str, int, tuple[int, ...], np.ndarray]], alignment: int = DEFAULT_ALIGNMENT) -> None:
    """Write a GGUF v3 file with gguf.GGUFWriter.

    metadata: key -> value, in the order to write (general.architecture, a str, is required and always
    written first). metadata_types: key -> code or (9, elem) as in GGUFFile.metadata_types; a metadata key
    without a type raises ValueError (extra entries are ignored). Empty arrays cannot be written.
    tensors: (name, ggml_type, logical numpy shape, data). data is the raw tensor bytes as a uint8 array
    of any shape, or for unquantised types an array in the natural dtype (F32 float32, F16 float16,
    BF16 uint16 bit patterns, F64 float64, I8..I64 int8..int64); only its byte count must match.
    alignment: power of two; if not 32 it is written as general.alignment (u32) unless metadata has it,
    in which case the two must agree.
    """
    import gguf  # the gguf package (not this module)

    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment!r} is not a positive power of two")
    for key in metadata:
        if key not in metadata_types:
            raise ValueError(f"metadata {key!r} has no entry in metadata_types")
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or metadata_types["general.architecture"] != _STRING:
        raise ValueError("metadata needs general.architecture as a str (type 8)")
    if "general.alignment" in metadata:
        if metadata_types["general.alignment"] != GGUFValueCode.UINT32 or metadata["general.alignment"] != alignment:
            raise ValueError(f"metadata general.alignment ({metadata['general.alignment']!r}, type "
                             f"{metadata_types['general.alignment']!r}) must be u32 and equal alignment={alignment}")

    packed: list[tuple[str, Any, Any, Any]] = []  # key, value, GGUFValueType, sub_type
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        vtype = metadata_types[key]
        if _is_array_type(vtype):
            elem = vtype[1]
            items = _check_array(key, elem, value, nested=False)
            sub = gguf.GGUFValueType(_ARRAY if _is_array_type(elem) else int(elem))
            packed.append((key, items, gguf.GGUFValueType.ARRAY, sub))
        else:
            if isinstance(vtype, tuple) or vtype == _ARRAY:
                raise ValueError(f"metadata {key!r}: array type must be (9, elem), got {vtype!r}")
            packed.append((key, _check_scalar(key, int(vtype), value), gguf.GGUFValueType(int(vtype)), None))

    tensor_list = [(name, int(t), tuple(int(d) for d in shape), data) for name, t, shape, data in tensors]
    writer = gguf.GGUFWriter(path, arch)
    writer.data_alignment = alignment
    if alignment != DEFAULT_ALIGNMENT and "general.alignment" not in metadata:
        writer.add_custom_alignment(alignment)
    for key, value, vtype, sub in packed:
        writer.add_key_value(key, value, vtype, sub)
    for name, ggml_type, shape, data in tensor_list:
        raw, byte_shape = _tensor_bytes(name, ggml_type, shape, data)
        writer.add_tensor(name, raw, raw_shape=byte_shape, raw_dtype=gguf.GGMLQuantizationType(ggml_type))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()

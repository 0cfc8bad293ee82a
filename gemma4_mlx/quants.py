"""GGML block formats in numpy: quantize, dequantize, and lossless GGUF -> MLX affine mapping.

All functions are vectorised numpy. Large tensors are processed in block chunks (bounded temporary
memory) spread over a small thread pool; numpy releases the GIL inside its ufuncs.

Block layouts (gemma4-spec.md section 8); ``d``/``dmin``/``m`` are little-endian IEEE fp16:

- Q4_0 (32 el / 18 B):  d, qs[16];  el j = qs[j] & 0xF, el j+16 = qs[j] >> 4;  x = d*(q-8)
- Q4_1 (32 el / 20 B):  d, m, qs[16];  nibbles as Q4_0;  x = d*q + m
- Q5_0 (32 el / 22 B):  d, qh (u32), qs[16];  q = nibble | bit e of qh << 4;  x = d*(q-16)
- Q8_0 (32 el / 34 B):  d, qs[32] int8;  x = d*q
- Q4_K (256 el / 144 B): d, dmin, scales[12] (8 packed 6-bit scale/min pairs), qs[128];
  64-element groups g use qs[32g:32g+32]: low nibbles -> sub-block 2g, high -> 2g+1;
  x = (d*sc)*q - dmin*mn
- Q6_K (256 el / 210 B): ql[128], qh[64], scales[16] int8, d;  x = (d*scale)*(q-32)

Every product above is exact in float32 except the final rounding, so results are bit-exact with
ggml / gguf-py regardless of evaluation order.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

# ggml type ids (same numbering as ggml / gguf.GGMLQuantizationType)
F32 = 0
F16 = 1
Q4_0 = 2
Q4_1 = 3
Q5_0 = 6
Q8_0 = 8
Q4_K = 12
Q6_K = 14
BF16 = 30

# type id -> (name, elements per block, bytes per block) for the types this module dequantizes
BLOCK_SIZES: dict[int, tuple[str, int, int]] = {
    F32: ("F32", 1, 4),
    F16: ("F16", 1, 2),
    BF16: ("BF16", 1, 2),
    Q4_0: ("Q4_0", 32, 18),
    Q4_1: ("Q4_1", 32, 20),
    Q5_0: ("Q5_0", 32, 22),
    Q8_0: ("Q8_0", 32, 34),
    Q4_K: ("Q4_K", 256, 144),
    Q6_K: ("Q6_K", 256, 210),
}

# a few more names, only to make error messages readable
_OTHER_NAMES = {7: "Q5_1", 10: "Q2_K", 11: "Q3_K", 13: "Q5_K", 15: "Q8_K", 16: "IQ2_XXS",
                17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
                23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
                34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}

_CHUNK_ELEMS = 1 << 20  # elements per work item: ~4 MB of float32 output, a few temporaries of that size
_MAX_THREADS = 8
_pool: ThreadPoolExecutor | None = None


def type_name(ggml_type: int) -> str:
    """Readable name of a ggml type id, e.g. 14 -> 'Q6_K'."""
    if ggml_type in BLOCK_SIZES:
        return BLOCK_SIZES[ggml_type][0]
    return _OTHER_NAMES.get(int(ggml_type), f"ggml type {int(ggml_type)}")


def _threads() -> int:
    return max(1, min(_MAX_THREADS, os.cpu_count() or 1))


def _for_ranges(n: int, step: int, fn: Callable[[int, int], None]) -> None:
    """Call fn(start, stop) over [0, n) in pieces of `step`, on a thread pool when there are several."""
    global _pool
    ranges = [(i, min(i + step, n)) for i in range(0, n, step)]
    if len(ranges) <= 1 or _threads() == 1:
        for a, b in ranges:
            fn(a, b)
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_threads(), thread_name_prefix="gemma4-quants")
    for _ in _pool.map(lambda r: fn(*r), ranges):
        pass


def _as_bytes(raw: np.ndarray) -> np.ndarray:
    """Flat uint8 view of a contiguous array of any dtype (a copy only if it is not contiguous)."""
    raw = np.asarray(raw)
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)


def _fp16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """blocks uint8 [nb, B] -> float32 [nb, 1] of the fp16 at byte `offset` of each block."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(np.float32)


# --------------------------------------------------------------------------------------------
# bf16 helpers


def bf16_to_f32(raw_u16: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16 or int16 array, any shape) -> float32 array of the same shape."""
    u = np.asarray(raw_u16)
    return (u.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x) -> np.ndarray:
    """float32 (any shape) -> uint16 bf16 bit patterns, round to nearest even (as torch's
    c10::BFloat16 and ggml). Every NaN becomes the canonical quiet NaN 0x7FC0 (torch's scalar rule;
    torch's x86 vector path writes 0xFFFF instead, which is also a NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        out[nan] = 0x7FC0
    return out


# --------------------------------------------------------------------------------------------
# quantizers (bit-exact with ggml's reference quantize_row_*_ref and gguf-py)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf: round to nearest, ties away from zero (float32 in, float32 out)."""
    r = np.rint(v)
    t = np.trunc(v)
    tie = np.abs(v - t) == np.float32(0.5)  # v - trunc(v) is exact
    return np.where(tie, t + np.sign(v), r)


def _quantize_q4_0_blocks(x: np.ndarray, out: np.ndarray) -> None:
    """x float32 [nb, 32] -> out uint8 [nb, 18]."""
    nb = x.shape[0]
    imax = np.abs(x).argmax(axis=1)
    vmax = x[np.arange(nb), imax]  # signed value of largest magnitude (first one on ties)
    d = vmax / np.float32(-8)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    q = np.trunc(x * inv[:, None] + np.float32(8.5))
    q = np.minimum(q, np.float32(15)).astype(np.uint8)
    out[:, 0:2] = d.astype(np.float16)[:, None].view(np.uint8)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << np.uint8(4))


def _quantize_q8_0_blocks(x: np.ndarray, out: np.ndarray) -> None:
    """x float32 [nb, 32] -> out uint8 [nb, 34]."""
    d = np.abs(x).max(axis=1) / np.float32(127)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    q = _round_half_away(x * inv[:, None])
    out[:, 0:2] = d.astype(np.float16)[:, None].view(np.uint8)
    out[:, 2:] = q.astype(np.int8).view(np.uint8)


def _quantize_blocks(x: np.ndarray, block_elems: int, block_bytes: int, fn) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % block_elems != 0:
        raise ValueError(f"last dimension of shape {x.shape} is not a multiple of {block_elems}")
    src = np.ascontiguousarray(x).reshape(-1, block_elems)
    nb = src.shape[0]
    out = np.empty((nb, block_bytes), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMS // block_elems)
    _for_ranges(nb, step, lambda a, b: fn(src[a:b], out[a:b]))
    return out.reshape(*x.shape[:-1], x.shape[-1] // block_elems * block_bytes)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K % 32 == 0) -> Q4_0 bytes uint8 [..., K//32*18]."""
    return _quantize_blocks(x, 32, 18, _quantize_q4_0_blocks)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K % 32 == 0) -> Q8_0 bytes uint8 [..., K//32*34]."""
    return _quantize_blocks(x, 32, 34, _quantize_q8_0_blocks)


def quantize(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """float array [..., K] -> uint8 bytes [..., row bytes] in ggml type F32, F16, BF16, Q4_0 or Q8_0
    (F32/F16/BF16: raw little-endian values). Other types raise ValueError."""
    x = np.asarray(x)
    if ggml_type == Q4_0:
        return quantize_q4_0(x)
    if ggml_type == Q8_0:
        return quantize_q8_0(x)
    if ggml_type in (F32, F16, BF16):
        if x.ndim == 0:
            raise ValueError("quantize needs at least one dimension")
        if ggml_type == F32:
            vals = np.ascontiguousarray(x, dtype="<f4")
        elif ggml_type == F16:
            vals = np.ascontiguousarray(x.astype("<f2"))
        else:
            vals = f32_to_bf16(x.astype(np.float32, copy=False)).astype("<u2", copy=False)
        return vals.view(np.uint8).reshape(*x.shape[:-1], -1)
    raise ValueError(f"quantize: unsupported ggml type {type_name(ggml_type)}")


# --------------------------------------------------------------------------------------------
# dequantizers: blocks uint8 [nb, block_bytes] -> out float32 [nb, block_elems]

_SHIFT_0_4 = np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """qs uint8 [nb, 16] -> uint8 [nb, 32]: low nibbles (elements 0..15) then high (16..31)."""
    return ((qs[:, None, :] >> _SHIFT_0_4) & np.uint8(0x0F)).reshape(qs.shape[0], 32)


def _dequant_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _fp16_field(blocks, 0)
    q = _nibbles32(blocks[:, 2:18]).view(np.int8) - np.int8(8)
    np.multiply(d, q, out=out, dtype=np.float32)


def _dequant_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _fp16_field(blocks, 0)
    m = _fp16_field(blocks, 2)
    q = _nibbles32(blocks[:, 4:20])
    np.multiply(d, q, out=out, dtype=np.float32)
    out += m


_BITS32 = np.arange(32, dtype=np.uint32).reshape(1, 32)


def _dequant_q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _fp16_field(blocks, 0)
    qh = np.ascontiguousarray(blocks[:, 2:6]).view("<u4")  # [nb, 1]
    high = (((qh >> _BITS32) & np.uint32(1)).astype(np.uint8)) << np.uint8(4)
    q = (_nibbles32(blocks[:, 6:22]) | high).view(np.int8) - np.int8(16)
    np.multiply(d, q, out=out, dtype=np.float32)


def _dequant_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _fp16_field(blocks, 0)
    np.multiply(d, blocks[:, 2:34].view(np.int8), out=out, dtype=np.float32)


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """packed uint8 [nb, 12] -> (scales, mins) uint8 [nb, 8] each (6-bit values).
    Sub-block j < 4: sc = p[j] & 63, mn = p[j+4] & 63;
    j >= 4: sc = (p[j+4] & 15) | (p[j-4] >> 6) << 4, mn = (p[j+4] >> 4) | (p[j] >> 6) << 4."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & np.uint8(63), (c & np.uint8(15)) | ((a >> np.uint8(6)) << np.uint8(4))], axis=1)
    mn = np.concatenate([b & np.uint8(63), (c >> np.uint8(4)) | ((b >> np.uint8(6)) << np.uint8(4))], axis=1)
    return sc, mn


def _dequant_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    nb = blocks.shape[0]
    d = _fp16_field(blocks, 0)
    dmin = _fp16_field(blocks, 2)
    sc, mn = _q4_k_scales_mins(blocks[:, 4:16])
    scale = (d * sc)[:, :, None]          # [nb, 8, 1], exact
    offset = (dmin * mn)[:, :, None]      # [nb, 8, 1], exact
    qs = blocks[:, 16:144].reshape(nb, 4, 1, 32)
    q = ((qs >> _SHIFT_0_4[:, None]) & np.uint8(0x0F)).reshape(nb, 8, 32)
    o = out.reshape(nb, 8, 32)
    np.multiply(scale, q, out=o, dtype=np.float32)
    o -= offset


_SHIFT_Q6_HIGH = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _dequant_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    nb = blocks.shape[0]
    # low 4 bits: element 128h + 32j + l reads ql[64h + 32(j&1) + l], low nibble for j<2, high for j>=2
    ql = blocks[:, 0:128].reshape(nb, 2, 1, 64)
    low = ((ql >> _SHIFT_0_4[:, None]) & np.uint8(0x0F)).reshape(nb, 2, 4, 32)
    # high 2 bits: (qh[32h + l] >> 2j) & 3
    qh = blocks[:, 128:192].reshape(nb, 2, 1, 32)
    high = ((qh >> _SHIFT_Q6_HIGH) & np.uint8(3)) << np.uint8(4)
    q = (low | high).view(np.int8) - np.int8(32)          # [nb, 2, 4, 32] in [-32, 31]
    scale = _fp16_field(blocks, 208) * blocks[:, 192:208].view(np.int8)  # [nb, 16], exact
    np.multiply(scale[:, :, None], q.reshape(nb, 16, 16), out=out.reshape(nb, 16, 16), dtype=np.float32)


_DEQUANT_BLOCKS = {
    Q4_0: _dequant_q4_0,
    Q4_1: _dequant_q4_1,
    Q5_0: _dequant_q5_0,
    Q8_0: _dequant_q8_0,
    Q4_K: _dequant_q4_k,
    Q6_K: _dequant_q6_k,
}


def _check_size(flat: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """-> (n_elements, block_elems, block_bytes); ValueError if `flat` does not hold `shape`."""
    name, be, bb = BLOCK_SIZES[ggml_type]
    if len(shape) == 0 or any(int(s) < 0 for s in shape):
        raise ValueError(f"{name}: invalid shape {shape}")
    if shape[-1] % be != 0:
        raise ValueError(f"{name}: row length {shape[-1]} is not a multiple of the block size {be}")
    n = int(np.prod(shape, dtype=np.int64))
    want = n // be * bb
    if flat.size != want:
        raise ValueError(f"{name}: shape {shape} needs {want} bytes, got {flat.size}")
    return n, be, bb


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """GGUF tensor bytes -> float32 array of logical numpy `shape` (row-major, last dim = ne[0]).

    raw: contiguous bytes (uint8 or any dtype, any shape; e.g. a zero-copy view of a GGUF mmap).
    Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K; others raise ValueError.
    F32 input comes back as a (possibly read-only) view of `raw`, everything else as a new array.
    """
    if ggml_type not in BLOCK_SIZES:
        raise ValueError(f"dequantize: unsupported ggml type {type_name(ggml_type)}")
    shape = tuple(int(s) for s in shape)
    flat = _as_bytes(raw)
    n, be, bb = _check_size(flat, ggml_type, shape)
    if ggml_type == F32:
        return flat.view("<f4").astype(np.float32, copy=False).reshape(shape)
    out = np.empty(n, dtype=np.float32)
    if ggml_type in (F16, BF16):
        src = flat.view("<f2" if ggml_type == F16 else "<u2")
        out_bits = out.view(np.uint32)

        def convert(a: int, b: int) -> None:
            if ggml_type == F16:
                out[a:b] = src[a:b]
            else:  # bf16 bits are the high half of the float32 bits
                out_bits[a:b] = src[a:b]
                out_bits[a:b] <<= np.uint32(16)

        _for_ranges(n, _CHUNK_ELEMS * 4, convert)
        return out.reshape(shape)
    blocks = flat.reshape(-1, bb)
    out_blocks = out.reshape(-1, be)
    fn = _DEQUANT_BLOCKS[ggml_type]

    def convert_blocks(a: int, b: int) -> None:
        with np.errstate(all="ignore"):  # inf/nan scale fields just give inf/nan weights
            fn(blocks[a:b], out_blocks[a:b])

    _for_ranges(blocks.shape[0], max(1, _CHUNK_ELEMS // be), convert_blocks)
    return out.reshape(shape)


# --------------------------------------------------------------------------------------------
# lossless GGUF -> MLX affine (group 32) mapping


def _mlx_affine(raw: np.ndarray, shape: tuple[int, ...], ggml_type: int, bits: int):
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"MLX affine mapping needs a shape (..., N, K), got {shape}")
    flat = _as_bytes(raw)
    n, be, bb = _check_size(flat, ggml_type, shape)
    blocks = flat.reshape(-1, bb)
    nb = blocks.shape[0]
    w = np.empty((nb, bits), dtype=np.uint32)  # a group of 32 elements fills `bits` words
    w_bytes = w.view(np.uint8)  # [nb, 4*bits]; MLX hosts are little-endian: byte 0 = low bits
    scales = np.empty(nb, dtype=np.float16)
    biases = np.empty(nb, dtype=np.float16)
    zero_point = np.float16(-(1 << (bits - 1)))  # -8 (Q4_0) or -128 (Q8_0)

    def convert(a: int, b: int) -> None:
        blk = blocks[a:b]
        d = np.ascontiguousarray(blk[:, 0:2]).view(np.float16)[:, 0]
        scales[a:b] = d
        with np.errstate(over="ignore", invalid="ignore"):
            biases[a:b] = d * zero_point  # exact (power-of-two scaling) unless it overflows fp16
        if bits == 4:
            qs = blk[:, 2:18]
            even, odd = qs[:, 0::2], qs[:, 1::2]
            # MLX byte i holds elements 2i (low nibble) and 2i+1 (high nibble);
            # GGUF element j < 16 is the low nibble of qs[j], element j+16 the high nibble
            w_bytes[a:b, 0:8] = (even & np.uint8(0x0F)) | (odd << np.uint8(4))
            w_bytes[a:b, 8:16] = (even >> np.uint8(4)) | (odd & np.uint8(0xF0))
        else:
            w_bytes[a:b] = blk[:, 2:34] ^ np.uint8(0x80)  # int8 q -> unsigned q + 128

    _for_ranges(nb, max(1, _CHUNK_ELEMS // 32), convert)
    if np.isinf(biases).any():
        bad = np.isinf(biases) & np.isfinite(scales)
        if bad.any():
            raise ValueError(f"{type_name(ggml_type)}: block scale too large for an fp16 bias "
                             f"({zero_point} * d overflows)")
    lead = shape[:-1]
    k = shape[-1]
    return (w.reshape(*lead, k * bits // 32), scales.reshape(*lead, k // 32), biases.reshape(*lead, k // 32))


def q4_0_to_mlx_affine(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 bytes of logical shape (..., N, K) -> MLX affine 4-bit group-32 triple, lossless:
    (w uint32 [..., N, K/8], scales float16 [..., N, K/32] = d, biases float16 [..., N, K/32] = -8d),
    element i of a word in bits 4i..4i+3. Use with mx.dequantize / mx.quantized_matmul(group_size=32,
    bits=4). fp16 holds d and -8d exactly. MLX computes in the scales' dtype and promotes bf16
    activations with fp16 scales to float32 outputs: callers running bf16/f32 should cast
    scales/biases to that dtype first (f32 keeps every weight exact; bf16 rounds d to 8 bits)."""
    return _mlx_affine(raw, shape, Q4_0, 4)


def q8_0_to_mlx_affine(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_0 bytes of logical shape (..., N, K) -> MLX affine 8-bit group-32 triple, lossless:
    (w uint32 [..., N, K/4] with byte = int8 q XOR 0x80, scales float16 = d, biases float16 = -128d).
    Same dtype caveat as q4_0_to_mlx_affine."""
    return _mlx_affine(raw, shape, Q8_0, 8)

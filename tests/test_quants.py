"""gemma4_mlx.quants against gguf-py (bit-exact), torch (bf16 rounding) and MLX (affine mapping)."""

import time

import mlx.core as mx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq

from gemma4_mlx import quants as Q

SEEDS = [0, 1, 2]
# (rows, K): odd row counts, K from one block to 4096, including 704/2112 (not multiples of 256)
SHAPES_32 = [(1, 32), (3, 64), (7, 704), (5, 2112), (9, 4096)]
SHAPES_256 = [(1, 256), (3, 512), (5, 1536), (7, 4096)]
# byte offsets of the fp16 scale fields inside each block
FP16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208]}


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact float32 comparison (distinguishes -0.0 and compares NaNs by payload)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def values_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact float equality that treats -0.0 == +0.0 (MLX's d*u + bias turns a -0.0 weight of an
    all-zero block, whose d is -0.0, into +0.0; the sign of a zero weight changes no product sum)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.isfinite(a).all() and np.array_equal(a, b)


def weights(rng: np.random.Generator, shape) -> np.ndarray:
    """float32 test weights with per-row magnitudes spanning many octaves, plus hard blocks."""
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.exp2(rng.integers(-12, 6, size=shape[:-1] + (1,))).astype(np.float32)
    flat = x.reshape(-1, 32)
    if flat.shape[0] >= 4:
        flat[0] = 0.0                                     # all-zero block: d = 0
        flat[1, :] = 0.5
        flat[1, 7] = -0.5                                 # magnitude tie of opposite signs
        flat[2] = (rng.permutation(np.arange(-16, 16)) + np.float32(0.5)) / np.float32(2)
        flat[2, 5] = 63.5                                 # Q8_0: d = 0.5, x*id = m + 0.5 exactly (ties)
        flat[3] = rng.standard_normal(32).astype(np.float32) * np.float32(1e-6)   # fp16-subnormal d
    return x


def random_blocks(rng: np.random.Generator, ggml_type: int, rows: int, k: int) -> np.ndarray:
    """Random raw block bytes [rows, row_bytes] whose fp16 scale fields are finite."""
    _, be, bb = Q.BLOCK_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows, k // be * bb), dtype=np.uint8)
    blocks = raw.reshape(-1, bb)
    for off in FP16_FIELDS[ggml_type]:
        scale = (rng.standard_normal(blocks.shape[0]) * np.exp2(rng.integers(-14, 3, blocks.shape[0])))
        blocks[:, off:off + 2] = scale.astype(np.float16)[:, None].view(np.uint8)
    return raw


# ------------------------------------------------------------------ quantizers vs gguf-py


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows,k", SHAPES_32)
@pytest.mark.parametrize("ggml_type,fn", [(Q.Q4_0, Q.quantize_q4_0), (Q.Q8_0, Q.quantize_q8_0)])
def test_quantize_matches_gguf(seed, rows, k, ggml_type, fn):
    x = weights(np.random.default_rng(seed), (rows, k))
    ours = fn(x)
    ref = gq.quantize(x, GT(ggml_type))
    assert ours.dtype == np.uint8 and ours.shape == ref.shape == (rows, k // 32 * Q.BLOCK_SIZES[ggml_type][2])
    assert np.array_equal(ours, ref)
    assert np.array_equal(Q.quantize(x, ggml_type), ref)
    assert bits_equal(Q.dequantize(ours, ggml_type, x.shape), gq.dequantize(ref, GT(ggml_type)))


def test_quantize_keeps_leading_dims():
    x = weights(np.random.default_rng(5), (3, 5, 96))
    assert Q.quantize_q4_0(x).shape == (3, 5, 3 * 18)
    assert np.array_equal(Q.quantize_q8_0(x), gq.quantize(x, GT.Q8_0))


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError):
        Q.quantize_q4_0(np.zeros((2, 48), np.float32))
    for t in (Q.Q4_1, Q.Q6_K, Q.Q4_K, 99):
        with pytest.raises(ValueError, match=Q.type_name(t)):
            Q.quantize(np.zeros((2, 256), np.float32), t)


# ------------------------------------------------------------------ dequantizers vs gguf-py


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ggml_type", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_dequantize_random_blocks_matches_gguf(seed, ggml_type):
    rng = np.random.default_rng(100 + seed)
    shapes = SHAPES_256 if Q.BLOCK_SIZES[ggml_type][1] == 256 else SHAPES_32
    for rows, k in shapes:
        raw = random_blocks(rng, ggml_type, rows, k)
        ours = Q.dequantize(raw, ggml_type, (rows, k))
        assert ours.dtype == np.float32 and ours.shape == (rows, k)
        assert bits_equal(ours, gq.dequantize(raw, GT(ggml_type)))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ggml_type", [Q.Q4_1, Q.Q5_0])
def test_dequantize_gguf_quantized_blocks(seed, ggml_type):
    """Q4_1/Q5_0 blocks as gguf-py's quantizer writes them (realistic scale/min fields)."""
    rng = np.random.default_rng(200 + seed)
    for rows, k in SHAPES_32:
        raw = gq.quantize(weights(rng, (rows, k)), GT(ggml_type))
        assert bits_equal(Q.dequantize(raw, ggml_type, (rows, k)), gq.dequantize(raw, GT(ggml_type)))


def test_dequantize_raw_of_any_shape_and_stacks():
    """raw may be flat, 1-D, or carry another dtype; shape may have leading expert dims."""
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, Q.Q6_K, 3 * 5, 512)
    ref = gq.dequantize(raw, GT.Q6_K).reshape(3, 5, 512)
    assert bits_equal(Q.dequantize(raw.reshape(-1), Q.Q6_K, (3, 5, 512)), ref)
    assert bits_equal(Q.dequantize(raw.reshape(3, 5, -1), Q.Q6_K, (3, 5, 512)), ref)
    assert bits_equal(Q.dequantize(raw.reshape(-1).view(np.uint16), Q.Q6_K, (3, 5, 512)), ref)


def test_dequantize_many_chunks_threaded(monkeypatch):
    """Force tiny work items so the thread pool splits every tensor into many pieces."""
    monkeypatch.setattr(Q, "_CHUNK_ELEMS", 512)
    rng = np.random.default_rng(8)
    for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K):
        raw = random_blocks(rng, t, 33, 1024)
        assert bits_equal(Q.dequantize(raw, t, (33, 1024)), gq.dequantize(raw, GT(t)))
    x = weights(rng, (33, 1024))
    assert np.array_equal(Q.quantize_q4_0(x), gq.quantize(x, GT.Q4_0))
    assert np.array_equal(Q.quantize_q8_0(x), gq.quantize(x, GT.Q8_0))
    bf = rng.integers(0, 1 << 16, 33 * 1024, dtype=np.uint16)
    assert bits_equal(Q.dequantize(bf, Q.BF16, (33, 1024)), gq.dequantize(bf.view(np.uint8), GT.BF16).reshape(33, 1024))


def test_dequantize_errors_name_the_type():
    raw = np.zeros(210, np.uint8)
    for t, name in [(13, "Q5_K"), (10, "Q2_K"), (7, "Q5_1"), (123, "123")]:
        with pytest.raises(ValueError, match=name):
            Q.dequantize(raw, t, (1, 256))
    with pytest.raises(ValueError, match="Q6_K"):
        Q.dequantize(raw, Q.Q6_K, (2, 256))          # too few bytes
    with pytest.raises(ValueError, match="Q4_0"):
        Q.dequantize(np.zeros(18, np.uint8), Q.Q4_0, (1, 16))  # row not a multiple of 32


def test_dequantize_speed_is_vectorised():
    """4096 x 5376 Q6_K (22M weights); the full 262144-row table is 64x this."""
    raw = random_blocks(np.random.default_rng(9), Q.Q6_K, 4096, 5376)
    t0 = time.perf_counter()
    Q.dequantize(raw, Q.Q6_K, (4096, 5376))
    assert time.perf_counter() - t0 < 3.0


# ------------------------------------------------------------------ float formats


@pytest.mark.parametrize("seed", SEEDS)
def test_float_round_trips(seed):
    rng = np.random.default_rng(300 + seed)
    x = weights(rng, (7, 160))
    raw32 = Q.quantize(x, Q.F32)
    assert raw32.dtype == np.uint8 and raw32.shape == (7, 640)
    assert bits_equal(Q.dequantize(raw32, Q.F32, x.shape), x)
    raw16 = Q.quantize(x, Q.F16)
    assert raw16.shape == (7, 320)
    assert bits_equal(Q.dequantize(raw16, Q.F16, x.shape), x.astype(np.float16).astype(np.float32))
    assert bits_equal(Q.dequantize(raw16, Q.F16, x.shape), gq.dequantize(raw16, GT.F16))
    rawbf = Q.quantize(x, Q.BF16)
    assert rawbf.shape == (7, 320)
    back = Q.dequantize(rawbf, Q.BF16, x.shape)
    assert bits_equal(back, torch.from_numpy(x).to(torch.bfloat16).float().numpy())
    assert bits_equal(back, gq.dequantize(rawbf, GT.BF16))
    assert bits_equal(Q.dequantize(Q.quantize(back, Q.BF16), Q.BF16, x.shape), back)  # idempotent


def test_f32_to_bf16_matches_torch_rounding():
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits[:1000] = (bits[:1000] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)   # exact ties
    bits[1000:2000] &= np.uint32(0x807FFFFF)                                   # subnormals
    bits[2000:2008] = [0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0, 0x80000000, 0x7F7F8000, 0x3F808000]
    x = bits.view(np.float32)
    finite = ~np.isnan(x)
    ours = Q.f32_to_bf16(x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert ours.dtype == np.uint16
    assert np.array_equal(ours[finite], ref[finite])
    nan_out = ours[~finite]
    assert nan_out.size > 0 and np.isnan(Q.bf16_to_f32(nan_out)).all()
    assert np.array_equal(Q.f32_to_bf16(x.reshape(400, 500)), ours.reshape(400, 500))
    assert bits_equal(Q.bf16_to_f32(ref), torch.from_numpy(x).to(torch.bfloat16).float().numpy())


# ------------------------------------------------------------------ MLX affine mapping

AFFINE = [(Q.Q4_0, 4, Q.quantize_q4_0, Q.q4_0_to_mlx_affine),
          (Q.Q8_0, 8, Q.quantize_q8_0, Q.q8_0_to_mlx_affine)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ggml_type,bits,quantize_fn,to_mlx", AFFINE)
def test_mlx_affine_dequantize_exact(seed, ggml_type, bits, quantize_fn, to_mlx):
    rng = np.random.default_rng(400 + seed)
    for rows, k in SHAPES_32:
        raw = quantize_fn(weights(rng, (rows, k)))
        ref = Q.dequantize(raw, ggml_type, (rows, k))
        w, scales, biases = to_mlx(raw, (rows, k))
        assert w.dtype == np.uint32 and w.shape == (rows, k * bits // 32)
        assert scales.dtype == biases.dtype == np.float16 and scales.shape == biases.shape == (rows, k // 32)
        d = raw.reshape(-1, Q.BLOCK_SIZES[ggml_type][2])[:, :2].copy().view(np.float16).reshape(rows, k // 32)
        assert np.array_equal(scales.view(np.uint16), d.view(np.uint16))
        assert np.array_equal(biases, d * np.float16(-(1 << (bits - 1))))
        # with float32 scales/biases MLX computes d*u + bias exactly: every term and the sum fit in 24 bits
        got32 = mx.dequantize(mx.array(w), mx.array(scales).astype(mx.float32), mx.array(biases).astype(mx.float32),
                              group_size=32, bits=bits)
        assert values_equal(np.array(got32), ref)
        # with float16 scales MLX rounds d*u and then d*u + bias in fp16 (u < 2^bits), so each weight
        # is off by at most 2^-10 * |d| * 2^bits; that bound is the promise, not equality
        got16 = np.array(mx.dequantize(mx.array(w), mx.array(scales), mx.array(biases), group_size=32, bits=bits)
                         .astype(mx.float32))
        bound = np.repeat(np.abs(d.astype(np.float32)), 32, axis=1) * np.float32(2.0 ** (bits - 10))
        assert np.all(np.abs(got16 - ref) <= bound)


@pytest.mark.parametrize("ggml_type,bits,quantize_fn,to_mlx", AFFINE)
def test_mlx_affine_expert_stack(ggml_type, bits, quantize_fn, to_mlx):
    rng = np.random.default_rng(500)
    x = weights(rng, (4, 6, 128))                              # (experts, N, K)
    raw = quantize_fn(x)
    w, scales, biases = to_mlx(raw, x.shape)
    assert w.shape == (4, 6, 128 * bits // 32) and scales.shape == biases.shape == (4, 6, 4)
    for e in range(4):
        we, se, be = to_mlx(raw[e], (6, 128))
        assert np.array_equal(w[e], we) and np.array_equal(scales[e], se) and np.array_equal(biases[e], be)
    got = mx.dequantize(mx.array(w), mx.array(scales).astype(mx.float32), mx.array(biases).astype(mx.float32),
                        group_size=32, bits=bits)
    assert values_equal(np.array(got), Q.dequantize(raw, ggml_type, x.shape))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ggml_type,bits,quantize_fn,to_mlx", AFFINE)
def test_mlx_quantized_matmul(seed, ggml_type, bits, quantize_fn, to_mlx):
    rng = np.random.default_rng(600 + seed)
    n, k = 67, 2112
    raw = quantize_fn(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    w_ref = Q.dequantize(raw, ggml_type, (n, k)).astype(np.float64)
    w, scales, biases = to_mlx(raw, (n, k))
    x = rng.standard_normal((5, k)).astype(np.float32)
    want = x.astype(np.float64) @ w_ref.T
    got = mx.quantized_matmul(mx.array(x), mx.array(w), mx.array(scales).astype(mx.float32),
                              mx.array(biases).astype(mx.float32), transpose=True, group_size=32, bits=bits)
    assert got.dtype == mx.float32
    scale = np.abs(x).astype(np.float64) @ np.abs(w_ref).T     # float32 accumulation error scales with this
    assert np.all(np.abs(np.array(got) - want) <= 1e-5 * scale + 1e-6)


def test_mlx_fp16_scales_promote_bf16_activations():
    """The caveat documented on q4_0_to_mlx_affine: fp16 scales with bf16 activations give float32
    outputs in MLX, so callers cast scales/biases to their activation dtype (or float32)."""
    raw = Q.quantize_q4_0(np.random.default_rng(700).standard_normal((8, 64)).astype(np.float32))
    w, scales, biases = (mx.array(a) for a in Q.q4_0_to_mlx_affine(raw, (8, 64)))
    x = mx.ones((1, 64), dtype=mx.bfloat16)
    mixed = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=32, bits=4)
    cast = mx.quantized_matmul(x, w, scales.astype(mx.bfloat16), biases.astype(mx.bfloat16),
                               transpose=True, group_size=32, bits=4)
    assert mixed.dtype == mx.float32 and cast.dtype == mx.bfloat16


@pytest.mark.parametrize("ggml_type,to_mlx,d", [(Q.Q4_0, Q.q4_0_to_mlx_affine, 8192.0),
                                                 (Q.Q8_0, Q.q8_0_to_mlx_affine, 512.0)])
def test_mlx_affine_rejects_bias_overflow(ggml_type, to_mlx, d):
    """-8d / -128d must fit in fp16; a larger block scale raises instead of giving an inf bias."""
    bb = Q.BLOCK_SIZES[ggml_type][2]
    raw = np.zeros((1, 2 * bb), np.uint8)
    raw[0, bb:bb + 2] = np.array([d], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match=Q.type_name(ggml_type)):
        to_mlx(raw, (1, 64))
    raw[0, bb:bb + 2] = np.array([d / 2], np.float16).view(np.uint8)   # largest power of two that fits
    _, _, biases = to_mlx(raw, (1, 64))
    assert np.isfinite(biases).all() and biases[0, 1] == -np.float16(d / 2) * (8 if ggml_type == Q.Q4_0 else 128)

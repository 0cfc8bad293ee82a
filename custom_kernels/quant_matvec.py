"""Fused dequantize x matrix-vector products on raw GGUF blocks (Q4_0, Q8_0, Q6_K), M = 1..8.

Weights are the GGUF bytes as stored, a uint8 array per tensor, never requantized:

- Q4_0: 18-byte blocks of 32 weights: fp16 ``d``, then 16 bytes; weight j < 16 is the low nibble
  of byte j, weight j + 16 its high nibble; value ``d * (q - 8)``.
- Q8_0: 34-byte blocks of 32 weights: fp16 ``d``, then 32 int8; value ``d * q``.
- Q6_K: 210-byte super-blocks of 256 weights (ql[128], qh[64], int8 scales[16], fp16 d);
  value ``d * scale * (q - 32)`` (gemma4-spec.md §8.3).

A PyTorch-layout weight [N, K] is ``blocks`` uint8 [N, K // 32 * 18] (Q4_0), [N, K // 32 * 34]
(Q8_0) or [N, K // 256 * 210] (Q6_K); expert stacks add a leading E axis.

Ops (activations bf16, f32 or f16; output dtype = activation dtype; f32 accumulation):

- ``q4_0_matvec(x, blocks, n)``, ``q8_0_matvec``, ``q6_k_matvec``: x [..., K] -> [..., N].
- ``q4_0_matvec_gather(x, ids, blocks, n)``, ``q8_0_matvec_gather``: experts; ids int32 [..., k]
  (the lead dims are the M tokens, any shape), x [..., K] (every slot reads its token's row) or
  [..., k, K] (one row per slot, e.g. the down projection), blocks [E, N, ...] -> [..., k, N].
- ``q4_0_gate_up_gather(x, ids, blocks, f)``, ``q8_0_gate_up_gather``: x [..., K], blocks
  [E, 2F, ...] whose rows 0..F-1 are gate and F..2F-1 up (``ffn_gate_up_exps``) ->
  gelu_tanh(gate) * up, [..., k, F], computed in f32 and rounded once.
- ``quant_matvec(x, blocks, ggml_type, n)``: the dense op chosen by GGML type id (2, 8, 14).
- ``gate_up(x, blocks, ggml_type, f)``: a dense MLP's gate and up projections stored as one
  [2F, ...] matrix -> gelu_tanh(gate) * up [..., F] (one row: the gate/up kernel with one expert,
  split K on CUDA; 2..8 rows: the dense kernel, then the product).
- ``quant_matvec_gelu_mul(x, blocks, ggml_type, n, mul)``: gelu_tanh(x @ W.T) * mul, mul [..., N]
  (E-series' per-layer-input gate; one launch with family "matvec_gelu_mul", a CUDA default).
- ``q4_0_moe_down(x, ids, weights, blocks, n)``, ``q8_0_moe_down``: MoE down projection and the
  router-weighted sum over the k slots: x [..., k, K], ids/weights [..., k] -> [..., N] (Q4_0: one
  launch on CUDA).

On a GPU build with at most 8 activation rows these run the custom kernel; on CPU, for M > 8, or
with ``GEMMA4_MLX_KERNELS=reference`` they run the pure-MLX reference (dequantize to f32, matmul,
cast), which is also the test oracle's twin (on CUDA, MLX's f32 matmul uses TF32, so the
reference is then only accurate to ~1e-3 relative; the kernels accumulate in true f32). On CUDA,
Q4_0 with bf16 activations runs the "stream" kernels (cp.async staging + mma.sync, see below) for
dense M >= 2 and every expert form, when a row is an even number of blocks (else the older
tensor-core kernel for M >= 2). The CPU model path may prefer the lossless MLX-affine
mapping with ``mx.quantized_matmul`` (gemma4_mlx.quants) for memory; that choice belongs to the
caller.

Kernel design (one body for Metal and CUDA, see custom_kernels.dialect): a threadgroup is NSG SIMD
groups of 32 lanes; each SIMD group owns R consecutive output rows (four rows per SIMD group won on
Metal, seed 000 K2). Lanes split each 32-weight block LPB ways (LPB = lanes per block), so one
SIMD-group iteration covers 32 / LPB consecutive blocks of all R rows: the lane loads its share of
the activations for all M rows once into registers and reuses them for the R rows; weights are
read with 16-bit loads (blocks are only 2-byte aligned) and converted to f32 exactly with the
2^23 magic-number trick (no int->float conversion instructions). Per block the lane accumulates
sum_j (q_j - 8) x_j in f32 and adds d times that to its f32 accumulator; a SIMD-group sum reduces
the lanes at the end. Rows past N are skipped, so any N works; K must be a multiple of 32
(256 for Q6_K).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from . import (KernelSource, backend, cuda_arch, dtype_name, geometry_fields, geometry_override, get_kernel, replace_geometry,
               template_args, use_kernel)
from .dialect import emit, prelude

__all__ = [
    "Q4_0",
    "Q8_0",
    "Q6_K",
    "MAX_ROWS",
    "q4_0_matvec",
    "q8_0_matvec",
    "q6_k_matvec",
    "quant_matvec",
    "gate_up",
    "gate_up_reference",
    "q4_0_matvec_gather",
    "q8_0_matvec_gather",
    "q4_0_gate_up_gather",
    "q8_0_gate_up_gather",
    "dequantize",
    "matvec_reference",
    "matvec_gather_reference",
    "gate_up_gather_reference",
    "moe_down_reference",
    "q4_0_moe_down",
    "q8_0_moe_down",
    "gelu_tanh",
    "quant_matvec_gelu_mul",
    "KernelConfig",
    "kernel_specs",
]

Q4_0 = 2
Q8_0 = 8
Q6_K = 14
MAX_ROWS = 8
"""Largest number of activation rows (M) the matvec kernels take; larger M uses the reference."""


@dataclass(frozen=True)
class _Format:
    name: str
    ggml_type: int
    block_weights: int  # weights per block
    block_bytes: int  # bytes per block


_FORMATS = {
    Q4_0: _Format("q4_0", Q4_0, 32, 18),
    Q8_0: _Format("q8_0", Q8_0, 32, 34),
    Q6_K: _Format("q6_k", Q6_K, 256, 210),
}


def _fmt(ggml_type: int) -> _Format:
    if ggml_type not in _FORMATS:
        raise ValueError(f"unsupported GGML type {ggml_type}; expected Q4_0 (2), Q8_0 (8) or Q6_K (14)")
    return _FORMATS[ggml_type]


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one weight row of ``k`` weights in ``ggml_type``."""
    f = _fmt(ggml_type)
    if k % f.block_weights:
        raise ValueError(f"{f.name}: K={k} is not a multiple of {f.block_weights}")
    return k // f.block_weights * f.block_bytes


# --------------------------------------------------------------------------------------------
# Pure-MLX references
# --------------------------------------------------------------------------------------------


def _f16_from_bytes(lo: mx.array, hi: mx.array) -> mx.array:
    bits = lo.astype(mx.uint16) | (hi.astype(mx.uint16) << 8)
    return mx.view(bits, mx.float16).astype(mx.float32)


def _int8_from_bytes(b: mx.array) -> mx.array:
    v = b.astype(mx.int16)
    return mx.where(v > 127, v - 256, v).astype(mx.float32)


def dequantize(blocks: mx.array, ggml_type: int, k: int) -> mx.array:
    """Raw GGUF blocks uint8 [..., K // bw * bb] -> float32 [..., K] (exact for Q4_0/Q8_0)."""
    f = _fmt(ggml_type)
    lead = blocks.shape[:-1]
    if blocks.dtype != mx.uint8 or blocks.shape[-1] != row_bytes(ggml_type, k):
        raise ValueError(
            f"{f.name}: expected uint8 blocks [..., {row_bytes(ggml_type, k)}] for K={k}, "
            f"got {blocks.dtype} {blocks.shape}"
        )
    nb = k // f.block_weights
    b = blocks.reshape(*lead, nb, f.block_bytes)
    if ggml_type == Q4_0:
        d = _f16_from_bytes(b[..., 0], b[..., 1])
        qs = b[..., 2:]
        q = mx.concatenate([qs & 15, qs >> 4], axis=-1).astype(mx.float32) - 8.0
        w = q * d[..., None]
    elif ggml_type == Q8_0:
        d = _f16_from_bytes(b[..., 0], b[..., 1])
        w = _int8_from_bytes(b[..., 2:]) * d[..., None]
    else:  # Q6_K
        ql = b[..., 0:128].astype(mx.uint32)
        qh = b[..., 128:192].astype(mx.uint32)
        sc = _int8_from_bytes(b[..., 192:208])
        d = _f16_from_bytes(b[..., 208], b[..., 209])
        halves = []
        for h in range(2):
            l_lo = ql[..., 64 * h : 64 * h + 32]
            l_hi = ql[..., 64 * h + 32 : 64 * h + 64]
            hbits = qh[..., 32 * h : 32 * h + 32]
            low4 = [l_lo & 15, l_hi & 15, l_lo >> 4, l_hi >> 4]
            for j in range(4):
                q = (low4[j] | (((hbits >> (2 * j)) & 3) << 4)).astype(mx.float32) - 32.0
                s = mx.repeat(sc[..., 8 * h + 2 * j : 8 * h + 2 * j + 2], 16, axis=-1)
                halves.append(q * s)
        w = mx.concatenate(halves, axis=-1) * d[..., None]
    return w.reshape(*lead, k)


def gelu_tanh(v: mx.array) -> mx.array:
    """0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), Gemma's GeGLU activation (gelu_pytorch_tanh),
    in v's dtype: the model's only definition, so every path rounds the same way."""
    return 0.5 * v * (1.0 + mx.tanh(0.7978845608028654 * (v + 0.044715 * (v * v * v))))


def _infer_k(blocks: mx.array, ggml_type: int) -> int:
    f = _fmt(ggml_type)
    if blocks.shape[-1] % f.block_bytes:
        raise ValueError(f"{f.name}: row of {blocks.shape[-1]} bytes is not whole blocks")
    return blocks.shape[-1] // f.block_bytes * f.block_weights


_CHUNK_WEIGHTS = 1 << 26  # dequantize at most this many weights (256 MiB f32) at a time


def matvec_reference(x: mx.array, blocks: mx.array, ggml_type: int, n: int) -> mx.array:
    """Reference: x [..., K] @ dequantize(blocks [N, ...]).T in f32, cast to x.dtype -> [..., N].

    Large weights (e.g. the 262144-row head) are dequantized in row chunks of at most
    2^26 weights, so the f32 copy never exists whole."""
    k = _check_dense(x, blocks, ggml_type, n)
    return _matvec_f32(x, blocks, ggml_type, k, n).astype(x.dtype)


def _matvec_f32(x: mx.array, blocks: mx.array, ggml_type: int, k: int, n: int) -> mx.array:
    xf = x.astype(mx.float32)
    step = max(1, _CHUNK_WEIGHTS // k)
    parts = [xf @ dequantize(blocks[a : a + step], ggml_type, k).T for a in range(0, n, step)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def gate_up_reference(x: mx.array, blocks: mx.array, ggml_type: int, f: int) -> mx.array:
    """Reference for the dense fused gate/up: gelu_tanh(gate) * up in f32 -> [..., F], x.dtype."""
    k = _check_dense(x, blocks, ggml_type, 2 * f)
    gu = _matvec_f32(x, blocks, ggml_type, k, 2 * f)
    return (gelu_tanh(gu[..., :f]) * gu[..., f:]).astype(x.dtype)


def _pairs(x: mx.array, ids: mx.array) -> tuple[int, int, bool]:
    """(M tokens, k slots, whether x holds a row per slot) of a gathered call: ids [..., k], x
    [..., K] or [..., k, K] (the lead dims flattened into M)."""
    return math.prod(ids.shape[:-1]), ids.shape[-1], x.ndim > ids.ndim


def _expert_products(x: mx.array, ids: mx.array, blocks: mx.array, ggml_type: int, k: int) -> mx.array:
    """f32 W[ids[m, s]] @ row(m, s) -> [..., k, N]; row = x[m] (x [..., K]) or x[m, s] (x [..., k, K]).

    Few (token, slot) pairs: dequantize just the selected experts. Many (prefill): dequantize the
    stack once and let gather_mm pick, instead of an [M, k, N, K] copy of the weights."""
    m, slots, per_pair = _pairs(x, ids)
    lead = ids.shape[:-1]
    x, ids = x.reshape(m, slots, k) if per_pair else x.reshape(m, k), ids.reshape(m, slots)
    return _expert_products_2d(x, ids, blocks, ggml_type, k).reshape(*lead, slots, blocks.shape[1])


def _expert_products_2d(x: mx.array, ids: mx.array, blocks: mx.array, ggml_type: int, k: int) -> mx.array:
    xf = x.astype(mx.float32)
    rows = xf[:, None, None, :] if x.ndim == 2 else xf[..., None, :]  # [M, 1 | k, 1, K]
    if ids.size < blocks.shape[0]:
        w = dequantize(mx.take(blocks, ids, axis=0), ggml_type, k)  # [M, k, N, K]
        return (w @ mx.swapaxes(rows, -1, -2))[..., 0]
    w = dequantize(blocks, ggml_type, k)  # [E, N, K]
    return mx.gather_mm(rows, mx.swapaxes(w, -1, -2), rhs_indices=ids)[..., 0, :]


def matvec_gather_reference(
    x: mx.array, ids: mx.array, blocks: mx.array, ggml_type: int, n: int
) -> mx.array:
    """Reference for expert-gathered matvec: out[m, s] = W[ids[m, s]] @ x[m] (or x[m, s]) -> [..., k, N]."""
    k = _check_gather(x, ids, blocks, ggml_type, n)
    return _expert_products(x, ids, blocks, ggml_type, k).astype(x.dtype)


def gate_up_gather_reference(
    x: mx.array, ids: mx.array, blocks: mx.array, ggml_type: int, f: int
) -> mx.array:
    """Reference for the fused expert gate/up: gelu_tanh(gate) * up in f32 -> [..., k, F], x.dtype."""
    k = _check_gather(x, ids, blocks, ggml_type, 2 * f)
    _check_gate_up(x, ids)
    gu = _expert_products(x, ids, blocks, ggml_type, k)
    return (gelu_tanh(gu[..., :f]) * gu[..., f:]).astype(x.dtype)


def moe_down_reference(x: mx.array, ids: mx.array, weights: mx.array, blocks: mx.array, ggml_type: int,
                       n: int) -> mx.array:  # fmt: skip
    """Reference for the fused MoE down projection: sum_s weights[m, s] * W[ids[m, s]] @ x[m, s] in
    f32 -> [..., N], x.dtype. x [..., k, K], ids int32 [..., k], weights [..., k]."""
    k = _check_gather(x, ids, blocks, ggml_type, n)
    _check_moe_down(x, ids, weights)
    prod = _expert_products(x, ids, blocks, ggml_type, k)  # [..., k, N] f32
    return (prod * weights.astype(mx.float32)[..., None]).sum(axis=-2).astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------

_ACT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)


def _check_dense(x: mx.array, blocks: mx.array, ggml_type: int, n: int) -> int:
    f = _fmt(ggml_type)
    if x.dtype not in _ACT_DTYPES:
        raise TypeError(f"activations must be float32/bfloat16/float16, got {x.dtype}")
    if blocks.dtype != mx.uint8 or blocks.ndim != 2:
        raise ValueError(f"{f.name}: blocks must be uint8 [N, bytes], got {blocks.dtype} {blocks.shape}")
    k = x.shape[-1]
    if blocks.shape != (n, row_bytes(ggml_type, k)):
        raise ValueError(
            f"{f.name}: blocks {blocks.shape} do not hold [N={n}, K={k}] "
            f"(expected {(n, row_bytes(ggml_type, k))})"
        )
    return k


def _check_gather(x: mx.array, ids: mx.array, blocks: mx.array, ggml_type: int, n: int) -> int:
    f = _fmt(ggml_type)
    if x.dtype not in _ACT_DTYPES:
        raise TypeError(f"activations must be float32/bfloat16/float16, got {x.dtype}")
    if ids.ndim < 2 or ids.dtype != mx.int32:
        raise ValueError(f"ids must be int32 [M, k] (or [..., M, k]), got {ids.dtype} {ids.shape}")
    if x.shape[:-1] not in (ids.shape, ids.shape[:-1]):
        raise ValueError(f"x must be [..., K] (a row per token) or [..., k, K] (a row per slot) with ids' "
                         f"lead dims, got x {x.shape} and ids {ids.shape}")  # fmt: skip
    k = x.shape[-1]
    if blocks.dtype != mx.uint8 or blocks.ndim != 3 or blocks.shape[1:] != (n, row_bytes(ggml_type, k)):
        raise ValueError(
            f"{f.name}: expert blocks must be uint8 [E, {n}, {row_bytes(ggml_type, k)}] for K={k}, "
            f"got {blocks.dtype} {blocks.shape}"
        )
    return k


def _check_gate_up(x: mx.array, ids: mx.array) -> None:
    if x.ndim > ids.ndim:
        raise ValueError(f"gate_up: x must be [..., K] (every slot reads its token's row), got {x.shape}")


def _check_moe_down(x: mx.array, ids: mx.array, weights: mx.array) -> None:
    if x.ndim == ids.ndim or weights.shape != ids.shape:
        raise ValueError(f"moe_down: x must be [..., k, K] and weights [..., k] like ids {ids.shape}; got "
                         f"{x.shape}, {weights.shape}")  # fmt: skip


# --------------------------------------------------------------------------------------------
# Kernel bodies (shared dialect: $placeholders and g4_* helpers, see custom_kernels.dialect)
# --------------------------------------------------------------------------------------------

# Template arguments, per kernel:
#   T    activation/output dtype          M    activation rows (dense kernels, 1..8)
#   R    output rows per SIMD group       NSG  SIMD groups per threadgroup
#   LPB  lanes per 32-weight block (1, 2 or 4; Q4_0/Q8_0 only)
#   XPP  (gather) 1: x is [M*k, K], one row per (token, slot); 0: x is [M, K]

_SETUP_DENSE = """
  const int K = x_shape[x_ndim - 1];  // x [..., K]: callers pass it unreshaped
  const int N = wq_shape[0];
  const int row_bytes = wq_shape[1];
  const $device T* xrow = x;
  const $device uint8_t* wmat = wq;
  const int row0 = ($tg_x * NSG + $simd) * R;
  const bool live = true;
"""

_SETUP_GATHER = """
  const int K = x_shape[x_ndim - 1];  // x [..., K]: callers pass it unreshaped
  const int n_experts = wq_shape[0];
  const int N = wq_shape[1];
  const int row_bytes = wq_shape[2];
  const int pair = $tg_y;
  const int expert = ids[pair];
  const int token = pair / ids_shape[ids_ndim - 1];
  const $device T* xrow = x + (size_t)(XPP ? pair : token) * K;
  const bool live = expert >= 0 && expert < n_experts;
  const $device uint8_t* wmat = wq + (size_t)(live ? expert : 0) * N * row_bytes;
  const int row0 = ($tg_x * NSG + $simd) * R;
"""

_SETUP_GATE_UP = """
  const int K = x_shape[x_ndim - 1];  // x [..., K]: callers pass it unreshaped
  const int n_experts = wq_shape[0];
  const int F = wq_shape[1] / 2;
  const int row_bytes = wq_shape[2];
  const int pair = $tg_y;
  const int expert = ids[pair];
  const int token = pair / ids_shape[ids_ndim - 1];
  const $device T* xrow = x + (size_t)token * K;
  const bool live = expert >= 0 && expert < n_experts;
  const $device uint8_t* wmat = wq + (size_t)(live ? expert : 0) * 2 * F * row_bytes;
  const int row0 = ($tg_x * NSG + $simd) * R;
"""

# Accumulator row i of RT -> weight row, and whether it exists.
_ROWS_PLAIN = """
  constexpr int RT = R;
  int wrow[RT];
  bool wok[RT];
  $unroll for (int i = 0; i < RT; ++i) { wrow[i] = row0 + i; wok[i] = live && row0 + i < N; }
"""

_ROWS_GATE_UP = """
  constexpr int RT = 2 * R;
  int wrow[RT];
  bool wok[RT];
  $unroll for (int i = 0; i < R; ++i) {
    wrow[i] = row0 + i;          // gate row
    wrow[R + i] = F + row0 + i;  // the matching up row
    wok[i] = live && row0 + i < F;
    wok[R + i] = wok[i];
  }
"""

# Q4_0 / Q8_0 main loop. MX = activation rows the SIMD group multiplies (M dense, 1 gathered).
_LOOP_32 = """
  constexpr int WPL = 32 / LPB;  // weights per lane per block
  constexpr int BPI = 32 / LPB;  // blocks per SIMD-group iteration
  const int lane = $lane;
  const int part = lane % LPB;
  const int nblocks = K / 32;
@MAGIC@
  float acc[RT][MX];
  $unroll for (int i = 0; i < RT; ++i) { $unroll for (int m = 0; m < MX; ++m) acc[i][m] = 0.0f; }
  for (int b = lane / LPB; b < nblocks; b += BPI) {
    float xv[MX][WPL];
    $unroll for (int m = 0; m < MX; ++m) {
@LOAD_X@
    }
    $unroll for (int i = 0; i < RT; ++i) {
      if (wok[i]) {
        const $device uint8_t* blk = wmat + (size_t)wrow[i] * row_bytes + (size_t)b * @BLOCK_BYTES@;
        const float d = g4_half_bits(g4_u16(blk));
@DOT@
      }
    }
  }
"""

# the shift-and-mask decode: the block's WPL weights of this lane into w, then one dot per row
_DOT_SHIFT_MASK = """
        float w[WPL];
@DECODE@
        $unroll for (int m = 0; m < MX; ++m) {
          float p = 0.0f;
          $unroll for (int j = 0; j < WPL; ++j) p += w[j] * xv[m][j];
          acc[i][m] += d * p;
        }"""

# Q4_0: the lane's part covers qs bytes [part*QB, part*QB+QB): low nibbles are weights
# part*QB + j, high nibbles weights 16 + part*QB + j. w[j] / w[QB + j] hold them in that order.
_LOAD_X_Q4_0 = """
      {
        constexpr int QB = WPL / 2;
        const $device T* xp = xrow + (size_t)m * K + b * 32 + part * QB;
        $unroll for (int j = 0; j < QB; j += 4) {
          g4_load4(xp + j, &xv[m][j]);
          g4_load4(xp + 16 + j, &xv[m][QB + j]);
        }
      }"""

_DECODE_Q4_0 = """
        {
          constexpr int QB = WPL / 2;
          const $device uint8_t* qs = blk + 2 + part * QB;
          $unroll for (int j = 0; j < QB; j += 2) {
            const uint32_t u = g4_u16(qs + j);
            w[j] = g4_as_float(0x4B000000u | (u & 15u)) - 8388616.0f;
            w[j + 1] = g4_as_float(0x4B000000u | ((u >> 8) & 15u)) - 8388616.0f;
            w[QB + j] = g4_as_float(0x4B000000u | ((u >> 4) & 15u)) - 8388616.0f;
            w[QB + j + 1] = g4_as_float(0x4B000000u | (u >> 12)) - 8388616.0f;
          }
        }"""

# Q8_0: the lane's part covers the WPL consecutive int8 weights part*WPL + j.
_LOAD_X_Q8_0 = """
      {
        const $device T* xp = xrow + (size_t)m * K + b * 32 + part * WPL;
        $unroll for (int j = 0; j < WPL; j += 4) g4_load4(xp + j, &xv[m][j]);
      }"""

_DECODE_Q8_0 = """
        {
          const $device uint8_t* qs = blk + 2 + part * WPL;
          $unroll for (int j = 0; j < WPL; j += 2) {
            const uint32_t u = g4_u16(qs + j);
            w[j] = g4_as_float(0x4B000000u | ((u & 255u) ^ 128u)) - 8388736.0f;
            w[j + 1] = g4_as_float(0x4B000000u | ((u >> 8) ^ 128u)) - 8388736.0f;
          }
        }"""

# In-place decode (opt-in: KernelConfig.in_place; kernels g4_q4_0_matvec_inplace / g4_q8_0_...):
# each 4-bit (8-bit) field of a 16-bit word becomes a float where it sits, with one AND and one OR
# (XOR for Q8_0's sign) against a magic exponent word: field p of the word is worth 16^p (256^p),
# so the f32 value minus a constant is exactly 16^p (q - 8) (256^p q). Products are summed per
# position and the sums scaled back by exact powers of two at the end of the block: three
# instructions per weight (LOP3, FADD, FFMA) where the shift-and-mask decode compiles to ~5, with
# the same f32 rounding per product. The magic words are built from a value the compiler cannot
# fold, so they live in registers and each AND+OR is one LOP3.
_MAGIC_Q4_0 = """
  const uint32_t zero = (uint32_t)K >> 31;  // 0 (K >= 0), unknown at compile time
  const uint32_t mq = 0x4B000000u | zero;"""

# p[m][k]: products of the word's field k (weights j, 16 + j, j + 1, 17 + j), scaled by 16^k
_DOT_Q4_0 = """
        {
          constexpr int QB = WPL / 2;
          const $device uint8_t* qs = blk + 2 + part * QB;
          float p[MX][4];
          $unroll for (int m = 0; m < MX; ++m) { $unroll for (int k = 0; k < 4; ++k) p[m][k] = 0.0f; }
          $unroll for (int j = 0; j < QB; j += 2) {
            const uint32_t u = g4_u16(qs + j);
            const float w0 = g4_as_float((u & 0x000Fu) | mq) - 8388616.0f;  // q - 8
            const float w1 = g4_as_float((u & 0x00F0u) | mq) - 8388736.0f;  // 16 (q - 8)
            const float w2 = g4_as_float((u & 0x0F00u) | mq) - 8390656.0f;  // 256 (q - 8)
            const float w3 = g4_as_float((u & 0xF000u) | mq) - 8421376.0f;  // 4096 (q - 8)
            $unroll for (int m = 0; m < MX; ++m) {
              p[m][0] += w0 * xv[m][j];
              p[m][1] += w1 * xv[m][QB + j];
              p[m][2] += w2 * xv[m][j + 1];
              p[m][3] += w3 * xv[m][QB + j + 1];
            }
          }
          $unroll for (int m = 0; m < MX; ++m) {
            acc[i][m] += d * (p[m][0] + 0.0625f * (p[m][1] + 0.0625f * (p[m][2] + 0.0625f * p[m][3])));
          }
        }"""

_MAGIC_Q8_0 = """
  const uint32_t zero = (uint32_t)K >> 31;  // 0 (K >= 0), unknown at compile time
  const uint32_t m8lo = 0x4B000080u | zero;  // magic exponent, and the sign bit of byte 0 flipped
  const uint32_t m8hi = 0x4B008000u | zero;  // ... of byte 1"""

# p[m][k]: products of byte k of the word (weights j, j + 1), scaled by 256^k
_DOT_Q8_0 = """
        {
          const $device uint8_t* qs = blk + 2 + part * WPL;
          float p[MX][2];
          $unroll for (int m = 0; m < MX; ++m) { p[m][0] = 0.0f; p[m][1] = 0.0f; }
          $unroll for (int j = 0; j < WPL; j += 2) {
            const uint32_t u = g4_u16(qs + j);
            const float w0 = g4_as_float((u & 0x00FFu) ^ m8lo) - 8388736.0f;  // int8
            const float w1 = g4_as_float((u & 0xFF00u) ^ m8hi) - 8421376.0f;  // 256 int8
            $unroll for (int m = 0; m < MX; ++m) {
              p[m][0] += w0 * xv[m][j];
              p[m][1] += w1 * xv[m][j + 1];
            }
          }
          $unroll for (int m = 0; m < MX; ++m) acc[i][m] += d * (p[m][0] + 0.00390625f * p[m][1]);
        }"""

# Q6_K: one super-block (256 weights) of all RT rows per SIMD-group iteration. Lane t covers the
# 8 weights 128*h + 32*j + l0 + {0, 1} (h = t / 16, l0 = 2 * (t % 16), j = 0..3); xv[m][2j + c].
_LOOP_Q6_K = """
  const int lane = $lane;
  const int h = lane / 16;
  const int l0 = (lane % 16) * 2;
  const int nsuper = K / 256;
  float acc[RT][MX];
  $unroll for (int i = 0; i < RT; ++i) { $unroll for (int m = 0; m < MX; ++m) acc[i][m] = 0.0f; }
  for (int sb = 0; sb < nsuper; ++sb) {
    float xv[MX][8];
    $unroll for (int m = 0; m < MX; ++m) {
      const $device T* xp = xrow + (size_t)m * K + sb * 256 + 128 * h + l0;
      $unroll for (int j = 0; j < 4; ++j) g4_load2(xp + 32 * j, &xv[m][2 * j]);
    }
    $unroll for (int i = 0; i < RT; ++i) {
      if (wok[i]) {
        const $device uint8_t* blk = wmat + (size_t)wrow[i] * row_bytes + (size_t)sb * 210;
        const uint32_t ql_a = g4_u16(blk + 64 * h + l0);       // j = 0 (low nibbles), 2 (high)
        const uint32_t ql_b = g4_u16(blk + 64 * h + 32 + l0);  // j = 1 (low nibbles), 3 (high)
        const uint32_t qh = g4_u16(blk + 128 + 32 * h + l0);
        const $device uint8_t* scales = blk + 192 + 8 * h + (l0 >> 4);
        const float d = g4_half_bits(g4_u16(blk + 208));
        float w[8];
        float sc[4];
        $unroll for (int c = 0; c < 2; ++c) {
          const uint32_t a = (ql_a >> (8 * c)) & 255u;
          const uint32_t bq = (ql_b >> (8 * c)) & 255u;
          const uint32_t hb = (qh >> (8 * c)) & 255u;
          w[0 + c] = g4_as_float(0x4B000000u | (a & 15u) | ((hb & 3u) << 4)) - 8388640.0f;
          w[2 + c] = g4_as_float(0x4B000000u | (bq & 15u) | (((hb >> 2) & 3u) << 4)) - 8388640.0f;
          w[4 + c] = g4_as_float(0x4B000000u | (a >> 4) | (((hb >> 4) & 3u) << 4)) - 8388640.0f;
          w[6 + c] = g4_as_float(0x4B000000u | (bq >> 4) | ((hb >> 6) << 4)) - 8388640.0f;
        }
        $unroll for (int j = 0; j < 4; ++j) {
          sc[j] = g4_as_float(0x4B000000u | ((uint32_t)scales[2 * j] ^ 128u)) - 8388736.0f;
        }
        $unroll for (int m = 0; m < MX; ++m) {
          float p = 0.0f;
          $unroll for (int j = 0; j < 4; ++j) p += sc[j] * (w[2 * j] * xv[m][2 * j] + w[2 * j + 1] * xv[m][2 * j + 1]);
          acc[i][m] += d * p;
        }
      }
    }
  }
"""

_STORE_DENSE = """
  $unroll for (int i = 0; i < RT; ++i) {
    $unroll for (int m = 0; m < MX; ++m) {
      const float s = g4_simd_sum(acc[i][m]);
      if (lane == 0 && wok[i]) out[(size_t)m * N + wrow[i]] = static_cast<T>(s);
    }
  }
"""

# k_split (KS > 1): KS SIMD groups share a set of R rows, each taking every KS-th run of BPI
# blocks; their per-row sums meet in threadgroup memory and the first group of the set adds them
# in ascending order (deterministic). Small N (o_proj, FFN down: N = 5376) then still puts
# enough warps, and bytes, in flight. Dense kernel, and the gate/up kernel (R gate + R up rows,
# gelu_tanh(g) * u from the merged f32 sums).
_SPLIT_ROW0 = ("($tg_x * NSG + $simd) * R", "($tg_x * (NSG / KS) + $simd / KS) * R")
_SPLIT_LOOP = ("for (int b = lane / LPB; b < nblocks; b += BPI)",
               "for (int b = ($simd % KS) * BPI + lane / LPB; b < nblocks; b += BPI * KS)")  # fmt: skip

_STORE_DENSE_SPLIT = """
  $shared float kpart[NSG * RT * MX];
  $unroll for (int i = 0; i < RT; ++i) {
    $unroll for (int m = 0; m < MX; ++m) {
      const float s = g4_simd_sum(acc[i][m]);
      if (lane == 0) kpart[($simd * RT + i) * MX + m] = s;
    }
  }
  $barrier;
  if ($simd % KS == 0) {
    for (int e = lane; e < RT * MX; e += 32) {
      const int i = e / MX;
      const int m = e % MX;
      float s = kpart[($simd * RT + i) * MX + m];
      for (int j = 1; j < KS; ++j) s += kpart[(($simd + j) * RT + i) * MX + m];
      if (row0 + i < N) out[(size_t)m * N + row0 + i] = static_cast<T>(s);
    }
  }
"""

_STORE_GATE_UP_SPLIT = """
  $shared float kpart[NSG * RT];
  $unroll for (int i = 0; i < RT; ++i) {
    const float s = g4_simd_sum(acc[i][0]);
    if (lane == 0) kpart[$simd * RT + i] = s;
  }
  $barrier;
  if ($simd % KS == 0) {
    for (int i = lane; i < R; i += 32) {
      float g = kpart[$simd * RT + i];
      float u = kpart[$simd * RT + R + i];
      for (int j = 1; j < KS; ++j) {
        g += kpart[($simd + j) * RT + i];
        u += kpart[($simd + j) * RT + R + i];
      }
      if (row0 + i < F) out[(size_t)pair * F + row0 + i] = static_cast<T>(live ? g4_gelu_tanh(g) * u : g4_nan());
    }
  }
"""

_STORE_GATHER = """
  $unroll for (int i = 0; i < RT; ++i) {
    const float s = g4_simd_sum(acc[i][0]);
    if (lane == 0 && row0 + i < N) {
      out[(size_t)pair * N + row0 + i] = static_cast<T>(live ? s : g4_nan());
    }
  }
"""

_STORE_GATE_UP = """
  $unroll for (int i = 0; i < R; ++i) {
    const float g = g4_simd_sum(acc[i][0]);
    const float u = g4_simd_sum(acc[R + i][0]);
    if (lane == 0 && row0 + i < F) {
      out[(size_t)pair * F + row0 + i] = static_cast<T>(live ? g4_gelu_tanh(g) * u : g4_nan());
    }
  }
"""


@dataclass(frozen=True)
class _KernelDef:
    """One kernel source: its name, I/O names, template parameter names and both dialects."""

    name: str
    kind: str  # "dense" | "gather" | "gate_up"
    ggml_type: int
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    template_names: tuple[str, ...]
    text: dict  # {"metal": (header, source), "cuda": (header, source)}


# gelu_mul (dense Q4_0 / Q8_0, plain or split K): the output row is gelu_tanh(s) * mul[m, row] from
# the f32 sum s and the input mul [M, N] (x.dtype), rounded once: E-series' per-layer-input gate,
# whose product with the per-layer input is otherwise one more node of every layer's decode step.
_GELU_MUL_STORE = {  # k_split -> (the dense store's write, its gelu_mul form)
    False: ("out[(size_t)m * N + wrow[i]] = static_cast<T>(s);",
            "out[(size_t)m * N + wrow[i]] = static_cast<T>(g4_gelu_tanh(s) * static_cast<float>(mul[(size_t)m * N + wrow[i]]));"),
    True: ("out[(size_t)m * N + row0 + i] = static_cast<T>(s);",
           "out[(size_t)m * N + row0 + i] = static_cast<T>(g4_gelu_tanh(s) * static_cast<float>(mul[(size_t)m * N + row0 + i]));"),
}  # fmt: skip


def _body(ggml_type: int, kind: str, in_place: bool = False, k_split: bool = False, gelu_mul: bool = False) -> str:
    setup = {"dense": _SETUP_DENSE, "gather": _SETUP_GATHER, "gate_up": _SETUP_GATE_UP}[kind]
    rows = _ROWS_GATE_UP if kind == "gate_up" else _ROWS_PLAIN
    mx_rows = "  constexpr int MX = M;\n" if kind == "dense" else "  constexpr int MX = 1;\n"
    if ggml_type == Q6_K:
        loop = _LOOP_Q6_K
    else:
        load_x = {Q4_0: _LOAD_X_Q4_0, Q8_0: _LOAD_X_Q8_0}[ggml_type]
        if in_place:
            magic, dot = {Q4_0: (_MAGIC_Q4_0, _DOT_Q4_0), Q8_0: (_MAGIC_Q8_0, _DOT_Q8_0)}[ggml_type]
        else:
            decode = {Q4_0: _DECODE_Q4_0, Q8_0: _DECODE_Q8_0}[ggml_type]
            magic, dot = "", _DOT_SHIFT_MASK.replace("@DECODE@", decode.strip("\n"))
        loop = (
            _LOOP_32.replace("@MAGIC@\n", magic.strip("\n") + "\n" if magic else "")
            .replace("@LOAD_X@", load_x.strip("\n"))
            .replace("@DOT@", dot.strip("\n"))
            .replace("@BLOCK_BYTES@", str(_fmt(ggml_type).block_bytes))
        )
    store = {"dense": _STORE_DENSE, "gather": _STORE_GATHER, "gate_up": _STORE_GATE_UP}[kind]
    if k_split:
        assert kind in ("dense", "gate_up") and ggml_type != Q6_K and _SPLIT_LOOP[0] in loop
        store = _STORE_DENSE_SPLIT if kind == "dense" else _STORE_GATE_UP_SPLIT
        setup, loop = setup.replace(*_SPLIT_ROW0), loop.replace(*_SPLIT_LOOP)
    if gelu_mul:
        assert kind == "dense" and ggml_type != Q6_K and not in_place
        old, new = _GELU_MUL_STORE[k_split]
        assert store.count(old) == 1
        store = store.replace(old, new)
    name = (f"{_fmt(ggml_type).name}_{kind}" + ("_gelu_mul" if gelu_mul else "") + ("_inplace" if in_place else "")
            + ("_ksplit" if k_split else ""))  # fmt: skip
    return f"  // gemma4-mlx {name}: fused dequantize x matvec on raw GGUF blocks\n" + (
        setup + rows + mx_rows + loop + store
    )


def _make_def(ggml_type: int, kind: str, in_place: bool = False, k_split: bool = False,
              gelu_mul: bool = False) -> _KernelDef:  # fmt: skip
    fmt = _fmt(ggml_type)
    name = {
        "dense": f"g4_{fmt.name}_matvec",
        "gather": f"g4_{fmt.name}_matvec_gather",
        "gate_up": f"g4_{fmt.name}_gate_up_gather",
    }[kind] + ("_gelu_mul" if gelu_mul else "") + ("_inplace" if in_place else "") + ("_ksplit" if k_split else "")
    inputs = (("x", "wq", "mul") if gelu_mul else ("x", "wq")) if kind == "dense" else ("x", "ids", "wq")
    tmpl = ["T"]
    tmpl += ["M"] if kind == "dense" else []
    tmpl += ["R", "NSG"]
    tmpl += [] if ggml_type == Q6_K else ["LPB"]
    tmpl += ["XPP"] if kind == "gather" else []
    tmpl += ["KS"] if k_split else []
    body = _body(ggml_type, kind, in_place, k_split, gelu_mul)
    return _KernelDef(name, kind, ggml_type, inputs, ("out",), tuple(tmpl), emit(body))


_KERNEL_DEFS: dict[tuple, _KernelDef] = {}


def _kernel_def(ggml_type: int, kind: str, in_place: bool = False, k_split: bool = False,
                gelu_mul: bool = False) -> _KernelDef:  # fmt: skip
    key = (ggml_type, kind, in_place, k_split, gelu_mul)
    if key not in _KERNEL_DEFS:
        _KERNEL_DEFS[key] = _make_def(ggml_type, kind, in_place, k_split, gelu_mul)
    return _KERNEL_DEFS[key]


_ALL_KERNELS = ((Q4_0, "dense"), (Q8_0, "dense"), (Q6_K, "dense"), (Q4_0, "gather"),
                (Q8_0, "gather"), (Q4_0, "gate_up"), (Q8_0, "gate_up"))  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launch planning (shared by dispatch, tests, the emulator registry and the benchmark)
# --------------------------------------------------------------------------------------------


DENSE_M1_GEOMETRY_ENV = "GEMMA4_MLX_MATVEC_GEOMETRY"
"""KernelConfig fields over default_config's for the dense kernel at M = 1 (the decode step's
projections), e.g. "rows_per_simd=1,simd_groups=4,lanes_per_block=1" (tuning)."""


@dataclass(frozen=True)
class KernelConfig:
    """Geometry of one launch: R rows per SIMD group, NSG SIMD groups per threadgroup, LPB lanes
    per 32-weight block (ignored for Q6_K); in_place = 1 runs the in-place decode variant of the
    dense Q4_0 / Q8_0 kernel (opt-in, see _DOT_Q4_0); k_split > 1 runs the dense or gate/up
    Q4_0 / Q8_0 kernel with that many SIMD groups sharing each set of R rows (see _SPLIT_ROW0), so
    a threadgroup covers R * NSG / k_split rows."""

    rows_per_simd: int = 4
    simd_groups: int = 2
    lanes_per_block: int = 2
    in_place: int = 0
    k_split: int = 1

    def __post_init__(self):
        if self.rows_per_simd < 1 or self.rows_per_simd > 8:
            raise ValueError("rows_per_simd must be 1..8")
        if self.simd_groups not in (1, 2, 4, 8):
            raise ValueError("simd_groups must be 1, 2, 4 or 8")
        if self.lanes_per_block not in (1, 2, 4):
            raise ValueError("lanes_per_block must be 1, 2 or 4")
        if self.in_place not in (0, 1):
            raise ValueError("in_place must be 0 or 1")
        if self.k_split not in (1, 2, 4, 8) or self.simd_groups % self.k_split:
            raise ValueError("k_split must be 1, 2, 4 or 8 and divide simd_groups")


SPLIT_K_MAX_ROWS = 65536
"""CUDA dense M = 1 splits K below this many rows: the 262144-row head was slower split (463 ->
476-510 us), every projection of 31B and E4B faster."""


def default_config(ggml_type: int, kind: str, m: int, n: int, k: int, pairs: int = 1,
                   which: str | None = None) -> KernelConfig:  # fmt: skip
    """The launch geometry used by dispatch (a starting point, to be tuned by bench/kernels.py).

    R = 4 rows per SIMD group (seed 000: four rows per SIMD group won on Metal). Two lanes per
    block at M <= 4; four at M > 4 or when the row has fewer than 32 blocks (shorter per-lane
    vectors keep M x weights-per-lane activations in registers and idle fewer lanes on short
    rows). Threadgroups of 4 warps on CUDA, 2 SIMD groups on Metal, halved while that leaves
    fewer than 256 threadgroups (small N must still fill the GPU). CUDA dense M = 1: R = 2,
    2 warps (the best of the H200 geometry sweep); below SPLIT_K_MAX_ROWS rows (every decode
    projection; not the tied head) 4 warps sharing each row pair (k_split = 4).
    GEMMA4_MLX_MATVEC_GEOMETRY overrides it.
    """
    which = which or backend()
    r = 4
    lpb = 2
    nblocks = k // 32
    if ggml_type != Q6_K and (m > 4 or nblocks < 32):
        lpb = 4
    nsg = 4 if which == "cuda" else 2
    ks = 1
    if which == "cuda" and m == 1 and kind == "dense":
        r, nsg = 2, 2  # H200, 31B FFN gate: 32.7 us vs 34.8 us for (4, 4, 2) (bench/NOTES.md)
        if ggml_type != Q6_K and n < SPLIT_K_MAX_ROWS:
            nsg, ks = 4, 4  # H200 decode step: 31B down 55 -> 38 us, o_proj 23 -> 16 (bench/NOTES.md)
    rows = n if kind != "gate_up" else n  # gate_up: n is F (rows of gate)
    while ks == 1 and nsg > 1 and math.ceil(rows / (r * nsg)) * pairs < 256:
        nsg //= 2
    cfg = KernelConfig(r, nsg, lpb, 0, ks)
    return _dense_m1_override(cfg, ggml_type) if kind == "dense" and m == 1 else cfg


def _dense_m1_override(cfg: KernelConfig, ggml_type: int) -> KernelConfig:
    """cfg with GEMMA4_MLX_MATVEC_GEOMETRY's fields over it. The fields it leaves out adapt to the
    ones it names, so every shape keeps a valid geometry: k_split shrinks to divide a named
    simd_groups, simd_groups grows to a named k_split; a Q6_K head ignores in_place and k_split
    (they name Q4_0 / Q8_0 kernel variants)."""
    named = geometry_fields(cfg, DENSE_M1_GEOMETRY_ENV)
    if ggml_type == Q6_K:
        named = {k: v for k, v in named.items() if k not in ("in_place", "k_split")}
    if "simd_groups" in named and "k_split" not in named and named["simd_groups"] > 0:
        named["k_split"] = math.gcd(cfg.k_split, named["simd_groups"])
    if "k_split" in named and "simd_groups" not in named:
        named["simd_groups"] = max(cfg.simd_groups, named["k_split"])
    return replace_geometry(cfg, named, DENSE_M1_GEOMETRY_ENV) if named else cfg


@dataclass(frozen=True)
class LaunchPlan:
    """Everything an MLX custom-kernel call needs besides the arrays."""

    template: list  # [(name, dtype name str | int | bool)]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shape: tuple[int, ...]
    in_place: bool = False  # the dense kernel's in-place decode variant
    k_split: bool = False  # the dense or gate/up kernel's split-K variant (template KS)


def plan_launch(ggml_type: int, kind: str, dtype_name: str, m: int, n: int, k: int,
                slots: int = 1, x_per_pair: bool = False,
                config: KernelConfig | None = None) -> LaunchPlan:  # fmt: skip
    """Launch plan for one op. ``n`` is N (dense/gather) or F (gate_up); ``m`` activation rows
    (tokens); ``slots`` experts per token (gather/gate_up)."""
    pairs = m * slots if kind != "dense" else 1
    cfg = config or default_config(ggml_type, kind, m, n, k, pairs)
    r, nsg, lpb = cfg.rows_per_simd, cfg.simd_groups, cfg.lanes_per_block
    if cfg.in_place and (kind != "dense" or ggml_type == Q6_K):
        raise ValueError("in_place decode exists for the dense Q4_0 / Q8_0 kernels only")
    ks = cfg.k_split
    if ks > 1 and (kind == "gather" or ggml_type == Q6_K):
        raise ValueError("k_split exists for the dense and gate/up Q4_0 / Q8_0 kernels only")
    template: list = [("T", dtype_name)]
    if kind == "dense":
        template.append(("M", m))
    template += [("R", r), ("NSG", nsg)]
    if ggml_type != Q6_K:
        template.append(("LPB", lpb))
    if kind == "gather":
        template.append(("XPP", int(bool(x_per_pair))))  # an int: MLX spells bools 1/0 on Metal
    if ks > 1:
        template.append(("KS", ks))
    groups = math.ceil(n / (r * nsg // ks))
    threads = 32 * nsg
    grid = (groups * threads, pairs, 1)
    out_shape = (m, n) if kind == "dense" else (m, slots, n)
    return LaunchPlan(template, grid, (threads, 1, 1), out_shape, bool(cfg.in_place), ks > 1)


def _run(kdef: _KernelDef | KernelSource, inputs: Sequence[mx.array], plan: LaunchPlan, dtype: mx.Dtype,
         init_value: float | None = None, out_shape: tuple[int, ...] | None = None,
         cuda_shared_memory: int = 0) -> mx.array:  # fmt: skip
    """One launch -> the output, in ``out_shape`` when given (the plan's element count in another
    shape: the kernels index their output flat, so the caller needs no reshape node);
    ``cuda_shared_memory``: dynamic shared memory of the CUDA kernel, bytes."""
    if out_shape is not None and math.prod(out_shape) != math.prod(plan.output_shape):
        raise ValueError(f"output shape {out_shape} does not hold the {plan.output_shape} result")
    kernel = get_kernel(kdef.name, kdef.input_names, kdef.output_names, kdef.text["metal"], kdef.text["cuda"],
                        cuda_shared_memory=cuda_shared_memory)  # fmt: skip
    template = template_args(plan.template)
    (out,) = kernel(
        inputs=list(inputs),
        template=template,
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=[out_shape or plan.output_shape],
        output_dtypes=[dtype],
        init_value=init_value,
    )
    return out


def launch_dense(x2: mx.array, blocks: mx.array, ggml_type: int, n: int,
                 config: KernelConfig | None = None, init_value: float | None = None,
                 out_shape: tuple[int, ...] | None = None) -> mx.array:  # fmt: skip
    """Run the dense kernel on x2 [..., K] with M <= 8 rows in all (no fallback; GPU builds only)
    -> [M, N] (or out_shape)."""
    m, k = math.prod(x2.shape[:-1]), x2.shape[-1]
    plan = plan_launch(ggml_type, "dense", dtype_name(x2.dtype), m, n, k, config=config)
    kdef = _kernel_def(ggml_type, "dense", plan.in_place, plan.k_split)
    return _run(kdef, [x2, blocks], plan, x2.dtype, init_value, out_shape)


def launch_dense_gelu_mul(x2: mx.array, blocks: mx.array, ggml_type: int, n: int, mul: mx.array,
                          config: KernelConfig | None = None, init_value: float | None = None,
                          out_shape: tuple[int, ...] | None = None) -> mx.array:  # fmt: skip
    """Run the dense kernel with the gelu_tanh(y) * mul epilogue (Q4_0 / Q8_0; no fallback; GPU
    builds only): x2 [..., K] with M <= 8 rows, mul [..., N] of M * N elements in x2.dtype -> [M, N]
    (or out_shape). The in-place decode variant has no such form: a geometry asking for it gets
    the plain decode."""
    m, k = math.prod(x2.shape[:-1]), x2.shape[-1]
    if ggml_type not in (Q4_0, Q8_0):
        raise ValueError(f"the gelu_mul kernels read Q4_0 or Q8_0 blocks, got GGML type {ggml_type}")
    if mul.size != m * n or mul.dtype != x2.dtype:
        raise ValueError(f"mul must hold {m} x {n} elements in {x2.dtype}, got {mul.shape} {mul.dtype}")
    cfg = config or default_config(ggml_type, "dense", m, n, k)
    plan = plan_launch(ggml_type, "dense", dtype_name(x2.dtype), m, n, k, config=dataclasses.replace(cfg, in_place=0))
    kdef = _kernel_def(ggml_type, "dense", False, plan.k_split, gelu_mul=True)
    return _run(kdef, [x2, blocks, mul], plan, x2.dtype, init_value, out_shape)


def launch_gather(x: mx.array, ids: mx.array, blocks: mx.array, ggml_type: int, n: int,
                  config: KernelConfig | None = None, init_value: float | None = None) -> mx.array:  # fmt: skip
    """Run the gathered kernel (no fallback; GPU builds only) -> [..., k, N]."""
    m, slots, per_pair = _pairs(x, ids)
    plan = plan_launch(ggml_type, "gather", dtype_name(x.dtype), m, n, x.shape[-1], slots, per_pair, config)
    return _run(_kernel_def(ggml_type, "gather"), [x, ids, blocks], plan, x.dtype, init_value, (*ids.shape, n))


def launch_gate_up(x: mx.array, ids: mx.array, blocks: mx.array, ggml_type: int, f: int,
                   config: KernelConfig | None = None, init_value: float | None = None,
                   out_shape: tuple[int, ...] | None = None) -> mx.array:  # fmt: skip
    """Run the fused gate/up kernel (no fallback; GPU builds only) -> [..., k, F] (or out_shape)."""
    m, slots, _ = _pairs(x, ids)
    plan = plan_launch(ggml_type, "gate_up", dtype_name(x.dtype), m, f, x.shape[-1], slots, config=config)
    kdef = _kernel_def(ggml_type, "gate_up", False, plan.k_split)
    return _run(kdef, [x, ids, blocks], plan, x.dtype, init_value, out_shape or (*ids.shape, f))


# --------------------------------------------------------------------------------------------
# CUDA only: Q4_0 on tensor cores for bf16 activations, M = 2..8
# --------------------------------------------------------------------------------------------
# The f32-FMA kernel above does M multiply-adds per weight; at M = 8 that, not memory, bounds it
# on an H200 (measured: 2.9x the M = 1 time at the 31B FFN shape). Here each warp runs
# mma.sync.m16n8k16 (bf16 inputs, f32 accumulation): A = 16 weight rows x 16 k of (q - 8), exact
# in bf16; B = 16 k x 8 activation rows (bf16, exact); per block the two k-steps accumulate in f32
# and the f32 accumulator adds d times that, so the arithmetic is the FMA kernel's up to the
# order of the f32 additions. Metal has no counterpart yet (simdgroup_matrix would be its twin).
# Fragment layouts (PTX ISA, mma.m16n8k16 .bf16): g = lane / 4, t = lane % 4;
#   A regs {row g, k 2t..2t+1}, {row g+8, k 2t..}, {row g, k 2t+8..}, {row g+8, k 2t+8..}
#   B regs {k 2t..2t+1, col g}, {k 2t+8.., col g};  C/D {row g, col 2t, 2t+1}, {row g+8, col 2t, 2t+1}
# Q4_0 weight j < 16 of a block is the low nibble of qs[j], j + 16 the high nibble: k-step 0
# takes low nibbles, k-step 1 high nibbles, of the same bytes qs[2t, 2t+1] and qs[2t+8, 2t+9].

_MMA_HEADER_CUDA = r"""
// bytes b0, b1 of u -> bf16x2 {q(b0) - 8, q(b1) - 8} from the low (lo) or high (hi) nibbles, exact:
// 0x4300 | q is the bf16 of 128 + q; subtracting 136 leaves q - 8.
__device__ __forceinline__ uint32_t g4_q4_bf16x2_minus8(uint32_t v) {
  v |= 0x43004300u;
  __nv_bfloat162 a = *reinterpret_cast<__nv_bfloat162*>(&v);
  const uint32_t c = 0x43084308u;
  __nv_bfloat162 r = __hsub2(a, *reinterpret_cast<const __nv_bfloat162*>(&c));
  return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t g4_q4_lo(uint32_t u) {
  return g4_q4_bf16x2_minus8((u & 0x000Fu) | ((u & 0x0F00u) << 8));
}
__device__ __forceinline__ uint32_t g4_q4_hi(uint32_t u) {
  return g4_q4_bf16x2_minus8(((u >> 4) & 0x000Fu) | ((u & 0xF000u) << 4));
}
__device__ __forceinline__ void g4_mma_bf16(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""

# Template: T (bfloat16 only), M (1..8 activation rows), TILES (16-row tiles per warp), NW (warps
# per block; warp w takes blocks w, w + NW, ... of K and the block's warps are summed at the end).
_MMA_BODY_CUDA = r"""
  // gemma4-mlx q4_0_matvec_mma (CUDA tensor cores, bf16 activations)
  const int K = x_shape[x_ndim - 1];  // x [..., K]: callers pass it unreshaped
  const int N = wq_shape[0];
  const int row_bytes = wq_shape[1];
  const int nblocks = K / 32;
  const int lane = (int)(threadIdx.x & 31u);
  const int warp = (int)(threadIdx.x >> 5);
  const int g = lane >> 2;
  const int t = lane & 3;
  const int row_base = (int)blockIdx.x * 16 * TILES;
  const bool x_ok = g < M;
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(x + (size_t)(x_ok ? g : 0) * K) + t;
  const uint8_t* rows[TILES][2];
  bool row_ok[TILES][2];
  _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
    _Pragma("unroll") for (int h = 0; h < 2; ++h) {
      const int r = row_base + 16 * i + 8 * h + g;
      row_ok[i][h] = r < N;
      rows[i][h] = wq + (size_t)(r < N ? r : 0) * row_bytes + 2 * t;
    }
  }
  float acc[TILES][4];
  _Pragma("unroll") for (int i = 0; i < TILES; ++i) { acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f; }
  _Pragma("unroll 2") for (int b = warp; b < nblocks; b += NW) {
    uint32_t xb[4] = {0u, 0u, 0u, 0u};  // bf16 pairs at k = 32b + 2t + {0, 8, 16, 24}
    if (x_ok) {
      const uint32_t* xp = xw + 16 * b;
      xb[0] = __ldg(xp); xb[1] = __ldg(xp + 4); xb[2] = __ldg(xp + 8); xb[3] = __ldg(xp + 12);
    }
    _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
      uint32_t u[2][2] = {{0u, 0u}, {0u, 0u}};
      float d[2] = {0.0f, 0.0f};
      _Pragma("unroll") for (int h = 0; h < 2; ++h) {
        if (row_ok[i][h]) {
          const uint8_t* p = rows[i][h] + (size_t)b * 18;  // = block start + 2t
          d[h] = g4_half_bits(g4_u16(p - 2 * t));
          u[h][0] = g4_u16(p + 2);   // qs[2t], qs[2t+1]
          u[h][1] = g4_u16(p + 10);  // qs[2t+8], qs[2t+9]
        }
      }
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      g4_mma_bf16(part, g4_q4_lo(u[0][0]), g4_q4_lo(u[1][0]), g4_q4_lo(u[0][1]), g4_q4_lo(u[1][1]), xb[0], xb[1]);
      g4_mma_bf16(part, g4_q4_hi(u[0][0]), g4_q4_hi(u[1][0]), g4_q4_hi(u[0][1]), g4_q4_hi(u[1][1]), xb[2], xb[3]);
      acc[i][0] += d[0] * part[0];
      acc[i][1] += d[0] * part[1];
      acc[i][2] += d[1] * part[2];
      acc[i][3] += d[1] * part[3];
    }
  }
  __shared__ float partial[NW > 1 ? NW - 1 : 1][TILES][4][32];
  if (NW > 1) {
    if (warp > 0) {
      _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
        _Pragma("unroll") for (int c = 0; c < 4; ++c) partial[warp - 1][i][c][lane] = acc[i][c];
      }
    }
    __syncthreads();
  }
  if (warp == 0) {
    _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
      _Pragma("unroll") for (int c = 0; c < 4; ++c) {
        float s = acc[i][c];
        for (int w = 1; w < NW; ++w) s += partial[w - 1][i][c][lane];
        const int r = row_base + 16 * i + g + 8 * (c >> 1);
        const int m = 2 * t + (c & 1);
        if (r < N && m < M) out[(size_t)m * N + r] = static_cast<T>(s);
      }
    }
  }
"""

MMA_MIN_ROWS = 2
"""Smallest M that the CUDA tensor-core Q4_0 kernel takes by default (bf16 activations)."""


@dataclass(frozen=True)
class MmaConfig:
    """Geometry of the CUDA tensor-core kernel: 16-row tiles per warp, warps per block (K split)."""

    tiles: int = 2
    warps: int = 4

    def __post_init__(self):
        if self.tiles not in (1, 2, 4) or self.warps not in (1, 2, 4, 8):
            raise ValueError("tiles must be 1, 2 or 4 and warps 1, 2, 4 or 8")


def default_mma_config(n: int) -> MmaConfig:
    """Two 16-row tiles per warp and 4 warps splitting K; smaller tiles / more warps while that
    leaves fewer than 264 blocks (2 per H200 SM)."""
    tiles, warps = 2, 4
    if math.ceil(n / (16 * tiles)) < 264:
        tiles, warps = 1, 8
    return MmaConfig(tiles, warps)


_MMA_DEF = _KernelDef(
    "g4_q4_0_matvec_mma", "dense_mma", Q4_0, ("x", "wq"), ("out",), ("T", "M", "TILES", "NW"),
    {"metal": ("", ""), "cuda": (prelude("cuda") + _MMA_HEADER_CUDA, _MMA_BODY_CUDA)},
)  # fmt: skip


def plan_mma(m: int, n: int, config: MmaConfig | None = None) -> LaunchPlan:
    """Launch plan of the CUDA tensor-core Q4_0 kernel for x [m, K] bf16 and N rows."""
    cfg = config or default_mma_config(n)
    template = [("T", "bfloat16"), ("M", m), ("TILES", cfg.tiles), ("NW", cfg.warps)]
    threads = 32 * cfg.warps
    return LaunchPlan(template, (math.ceil(n / (16 * cfg.tiles)) * threads, 1, 1), (threads, 1, 1), (m, n))


def launch_dense_mma(x2: mx.array, blocks: mx.array, n: int, config: MmaConfig | None = None,
                     init_value: float | None = None, out_shape: tuple[int, ...] | None = None) -> mx.array:  # fmt: skip
    """Run the CUDA tensor-core Q4_0 kernel on bf16 x2 [..., K] with M <= 8 rows in all (CUDA builds
    only) -> [M, N] (or out_shape)."""
    if x2.dtype != mx.bfloat16:
        raise TypeError("the tensor-core Q4_0 kernel takes bfloat16 activations")
    return _run(_MMA_DEF, [x2, blocks], plan_mma(math.prod(x2.shape[:-1]), n, config), x2.dtype, init_value,
                out_shape)  # fmt: skip


# --------------------------------------------------------------------------------------------
# CUDA only: Q4_0 "stream" kernels (cp.async staging + tensor cores), bf16 activations
# --------------------------------------------------------------------------------------------
# Why: at M = 1 the f32-FMA kernel spends ~4-5 instructions per weight (nibble shift/mask, the
# magic-number conversion, FMA) and reads the 18-byte blocks with 2-byte loads, so it is bounded
# by instruction issue and load-unit requests, not by HBM (52% of copy at the 31B FFN shape).
# Here every warp streams its rows' bytes into shared memory with 16-byte (8/4 when the row
# length allows no more) cp.async copies, ST groups of GB blocks in flight per warp, and decodes
# them for mma.sync m16n8k16: 8 nibbles of one 32-bit word -> four bf16x2 (q - 8) registers with
# a mask, an OR and one bf16x2 subtraction each (exact), x as the B operand (column m = token m),
# f32 accumulation, d applied per block in f32. That is ~2 instructions per weight, and the same
# for M = 1..8 (columns of the mma). Metal has no cp.async/mma.sync: there the FMA kernel stays.
#
# Lane (g = lane / 4, t = lane % 4) of a 16-row tile takes bytes qs[4t .. 4t+3] of rows g and
# g + 8 of every block (one word u): the k order inside an mma is free as long as A and B agree,
# so k-step 0 pairs {w_4t, w_4t+2} (low nibbles of bytes 0, 2 of u) with x {4t, 4t+2} and
# {w_4t+1, w_4t+3} with x {4t+1, 4t+3}; k-step 1 does the same with the high nibbles (w_16+..).
# Staged rows are GB * 18 bytes apart (+16 when GB > 8), so the 8 rows of a tile fall in distinct
# banks. GB (blocks per row piece) sets how long a contiguous run each row read is: a read-only
# probe in this order (144-byte runs, 16 rows per warp) reads HBM at 84% of the copy rate, against
# 99.5% when each warp reads its rows front to back (bench/NOTES.md, 2026-11-30). Every GGUF row is
# whole blocks; the copy width CH needs row_bytes % CH == 0 (host) and a CH-aligned base pointer
# (checked here; else 2-byte copies). ROT (rotate) measured no gain and is kept off.

_STREAM_CP_ASYNC_CUDA = r"""
// cp.async: CH bytes global -> shared (16: bypass L1; 4 and 8 only exist with .ca)
template <int CH> __device__ __forceinline__ void g4_cp_async(uint32_t dst, const uint8_t* src);
template <> __device__ __forceinline__ void g4_cp_async<16>(uint32_t dst, const uint8_t* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
template <> __device__ __forceinline__ void g4_cp_async<8>(uint32_t dst, const uint8_t* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}
template <> __device__ __forceinline__ void g4_cp_async<4>(uint32_t dst, const uint8_t* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ uint32_t g4_shared_addr(const void* p) {  // generic -> shared window address
  uint32_t a;
  asm("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }\n" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void g4_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void g4_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
"""
_STREAM_HEADER_CUDA = _STREAM_CP_ASYNC_CUDA + r"""// nibbles of bytes {0, 2} (even) or {1, 3} (odd) of u, low or high half -> bf16x2 {q - 8, q - 8}
__device__ __forceinline__ uint32_t g4_q4w_lo_even(uint32_t u) { return g4_q4_bf16x2_minus8(u & 0x000F000Fu); }
__device__ __forceinline__ uint32_t g4_q4w_lo_odd(uint32_t u) { return g4_q4_bf16x2_minus8((u >> 8) & 0x000F000Fu); }
__device__ __forceinline__ uint32_t g4_q4w_hi_even(uint32_t u) { return g4_q4_bf16x2_minus8((u >> 4) & 0x000F000Fu); }
__device__ __forceinline__ uint32_t g4_q4w_hi_odd(uint32_t u) { return g4_q4_bf16x2_minus8((u >> 12) & 0x000F000Fu); }
"""

# Template: T (bfloat16), M (dense: 1..8 activation rows), TILES (16-row tiles per warp), NW (warps
# per block, each with its own rows), ST (stages in flight per warp), GB (blocks per stage), CH (copy width,
# bytes), XPP (gather: 1 = x holds one row per (token, slot)). @KIND@: 0 dense, 1 gather, 2 gate_up.
_STREAM_BODY_CUDA = r"""
  // gemma4-mlx q4_0 stream kernel (CUDA: cp.async staging, tensor cores, bf16 activations)
  constexpr int KIND = @KIND@;     // 0 dense, 1 gather, 2 gate_up, 3 down_sum
  constexpr int RT = 16 * TILES;   // staged weight rows per warp
  constexpr int GBYTES = GB * 18;  // bytes of one staged row piece: GB blocks (a multiple of 16)
  constexpr int RW = GB * 18 / 4 + (GB > 8 ? 4 : 0);  // words per staged row (padded: 8 rows, 8 bank groups)
  constexpr int SLOT = RT * RW;    // words per stage
  __shared__ __align__(16) uint32_t g4_stage[NW * ST * SLOT + 4];
  const int lane = (int)(threadIdx.x & 31u);
  const int warp = (int)(threadIdx.x >> 5);
  const int g = lane >> 2;
  const int t = lane & 3;
  uint32_t* stage = g4_stage + warp * ST * SLOT;
  const uint32_t stage_addr = g4_shared_addr(stage);
  const int K = x_shape[x_ndim - 1];  // x [..., K]: callers pass it unreshaped
  const int nblocks = K / 32;
  const int ngroups = (nblocks + GB - 1) / GB;
  // unit: this warp's tile group (down_sum: the block's; its warps take different slots)
  const int unit = KIND == 3 ? (int)blockIdx.x : (int)blockIdx.x * NW + warp;
  int pair = 0, xrow = 0;
  bool live = true;
  const uint8_t* wmat = wq;
@SETUP@
  const int F = N / 2;  // gate_up: rows 0..F-1 gate, F..2F-1 up
  // staged row r (tile r / 16, fragment row r % 16) -> weight row; false past the end
  auto weight_row = [&](int r, int& wr) -> bool {
    if (KIND == 2) {
      const int f = unit * 8 * TILES + 8 * (r >> 4) + (r & 7);
      wr = ((r >> 3) & 1) ? F + f : f;
      return live && f < F;
    }
    wr = unit * RT + r;
    return live && wr < N;
  };
  {
    const int first = KIND == 2 ? unit * 8 * TILES : unit * RT;
    if (first >= (KIND == 2 ? F : N)) return;  // a whole warp (down_sum: block) past the last row
  }
  bool aligned = true;
  auto copy_group = [&](int grp, int slot, int rc) {  // rc = copies per row (of CH bytes)
    for (int c = lane; c < RT * rc; c += 32) {
      const int r = c / rc;
      const int p = c - r * rc;
      int wr;
      if (weight_row(r, wr)) {
        g4_cp_async<CH>(stage_addr + (uint32_t)((slot * SLOT + r * RW) * 4 + p * CH),
                        wmat + (size_t)wr * row_bytes + (size_t)grp * GBYTES + p * CH);
      }
    }
  };
  // ROT: warp (tile group) u reads its row groups starting at group u % ngroups (then wraps), so
  // the ~thousands of rows streamed at once are not all read at the same offset
  const int rot = ROT ? unit % ngroups : 0;
  auto issue = [&](int j) {  // j-th group of this warp's sequence -> stage slot j % ST
    if (j >= ngroups) return;
    const int grp = ROT ? (j + rot) % ngroups : j;
    const int nvalid = min(GB, nblocks - GB * grp);
    const int slot = j % ST;
    if (aligned) {
      if (nvalid == GB) {
        copy_group(grp, slot, GBYTES / CH);
      } else {
        copy_group(grp, slot, nvalid * 18 / CH);
      }
    } else {  // base pointer not CH-aligned (a view): plain 2-byte copies, same layout
      unsigned short* s16 = reinterpret_cast<unsigned short*>(stage + slot * SLOT);
      const int rc = nvalid * 9;
      for (int c = lane; c < RT * rc; c += 32) {
        const int r = c / rc;
        const int p = c - r * rc;
        int wr;
        if (weight_row(r, wr)) {
          s16[r * RW * 2 + p] = __ldg(reinterpret_cast<const unsigned short*>(wmat + (size_t)wr * row_bytes + (size_t)grp * GBYTES) + p);
        }
      }
    }
  };
  float acc[TILES][4];
  float total[TILES][4];
  _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
    _Pragma("unroll") for (int c = 0; c < 4; ++c) total[i][c] = 0.0f;
  }
@SLOT_LOOP@ {
@SLOT_BEGIN@
    aligned = ((reinterpret_cast<size_t>(wmat) | (size_t)row_bytes) & (size_t)(CH - 1)) == 0;
    const __nv_bfloat16* xr = x + (size_t)xrow * K + 4 * t;
    _Pragma("unroll") for (int i = 0; i < TILES; ++i) { acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f; }
    _Pragma("unroll") for (int s = 0; s < ST - 1; ++s) { issue(s); g4_cp_async_commit(); }
    for (int j = 0; j < ngroups; ++j) {
      issue(j + ST - 1);
      g4_cp_async_commit();
      g4_cp_async_wait<ST - 1>();  // group j has landed (this lane's copies) ...
      __syncwarp();                // ... and every lane's
      const int grp = ROT ? (j + rot) % ngroups : j;
      const uint32_t* S = stage + (j % ST) * SLOT;
      const unsigned short* S16 = reinterpret_cast<const unsigned short*>(S);
      const int nvalid = min(GB, nblocks - GB * grp);
      _Pragma("unroll 2") for (int bl = 0; bl < nvalid; ++bl) {
        const int kb = (GB * grp + bl) * 32;
        const uint2 xa = __ldg(reinterpret_cast<const uint2*>(xr + kb));       // x[4t .. 4t+3]
        const uint2 xc = __ldg(reinterpret_cast<const uint2*>(xr + kb + 16));  // x[16+4t ..]
        const uint32_t b00 = __byte_perm(xa.x, xa.y, 0x5410), b01 = __byte_perm(xa.x, xa.y, 0x7632);
        const uint32_t b10 = __byte_perm(xc.x, xc.y, 0x5410), b11 = __byte_perm(xc.x, xc.y, 0x7632);
        _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
          uint32_t u[2];
          float d[2];
          _Pragma("unroll") for (int h = 0; h < 2; ++h) {
            const int o = (16 * i + 8 * h + g) * RW * 4 + 18 * bl;  // block start in the stage
            d[h] = g4_half_bits(S16[o >> 1]);
            const int ob = o + 2 + 4 * t;                         // qs[4t .. 4t+3], 2-byte aligned
            u[h] = __funnelshift_r(S[ob >> 2], S[(ob >> 2) + 1], (ob & 3) * 8);
          }
          float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          g4_mma_bf16(part, g4_q4w_lo_even(u[0]), g4_q4w_lo_even(u[1]), g4_q4w_lo_odd(u[0]), g4_q4w_lo_odd(u[1]), b00, b01);
          g4_mma_bf16(part, g4_q4w_hi_even(u[0]), g4_q4w_hi_even(u[1]), g4_q4w_hi_odd(u[0]), g4_q4w_hi_odd(u[1]), b10, b11);
          acc[i][0] += d[0] * part[0];
          acc[i][1] += d[0] * part[1];
          acc[i][2] += d[1] * part[2];
          acc[i][3] += d[1] * part[3];
        }
      }
      __syncwarp();  // the slot is refilled by a later issue
    }
@SLOT_END@
  }
@STORE@
"""


_ONE_JOB = "  for (int job = 0; job < 1; ++job)"
_STREAM_SETUP = {
    "dense": """
  const int N = wq_shape[0];
  const int row_bytes = wq_shape[1];
  xrow = g < M ? g : 0;  // B column g = token g (columns >= M are discarded)
""",
    "gather": """
  const int n_experts = wq_shape[0];
  const int N = wq_shape[1];
  const int row_bytes = wq_shape[2];
  pair = (int)blockIdx.y;
  {
    const int expert = ids[pair];
    live = expert >= 0 && expert < n_experts;
    wmat = wq + (size_t)(live ? expert : 0) * N * row_bytes;
  }
  xrow = XPP ? pair : pair / ids_shape[ids_ndim - 1];
""",
    "down_sum": """
  const int n_experts = wq_shape[0];
  const int N = wq_shape[1];
  const int row_bytes = wq_shape[2];
  const int slots = ids_shape[ids_ndim - 1];
  const int token = (int)blockIdx.y;
""",
}
_STREAM_SETUP["gate_up"] = _STREAM_SETUP["gather"].replace("XPP ? pair : pair / ids_shape[ids_ndim - 1]",
                                                            "pair / ids_shape[ids_ndim - 1]")

# down_sum: warp w takes slots w, w + NW, ... of its token; each slot's expert is a new pipeline
_STREAM_SLOTS = {
    "down_sum": ("  for (int sl = warp; sl < slots; sl += NW)", """
    pair = token * slots + sl;
    const int expert = ids[pair];
    live = expert >= 0 && expert < n_experts;
    wmat = wq + (size_t)(live ? expert : 0) * N * row_bytes;
    xrow = pair;""", """
    const float wt = live ? wts[pair] : g4_nan();
    _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
      _Pragma("unroll") for (int c = 0; c < 4; ++c) total[i][c] += wt * acc[i][c];
    }"""),
}
_ONE_PASS = (_ONE_JOB, "", """
    _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
      _Pragma("unroll") for (int c = 0; c < 4; ++c) total[i][c] = acc[i][c];
    }""")

_STREAM_STORE = {
    "dense": """
  _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
    _Pragma("unroll") for (int c = 0; c < 4; ++c) {
      const int row = unit * RT + 16 * i + g + 8 * (c >> 1);
      const int m = 2 * t + (c & 1);
      if (m < M && row < N) out[(size_t)m * N + row] = static_cast<T>(total[i][c]);
    }
  }
""",
    "gather": """
  _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
    _Pragma("unroll") for (int h = 0; h < 2; ++h) {
      const int row = unit * RT + 16 * i + 8 * h + g;
      if (t == 0 && row < N) out[(size_t)pair * N + row] = static_cast<T>(live ? total[i][2 * h] : g4_nan());
    }
  }
""",
    "gate_up": """
  _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
    const int f = unit * 8 * TILES + 8 * i + g;
    if (t == 0 && f < F) {
      out[(size_t)pair * F + f] = static_cast<T>(live ? g4_gelu_tanh(total[i][0]) * total[i][2] : g4_nan());
    }
  }
""",
    "down_sum": """
  __shared__ float g4_red[NW][TILES][16];  // each warp's weighted sum over its slots, column 0
  if (t == 0) {
    _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
      g4_red[warp][i][g] = total[i][0];
      g4_red[warp][i][8 + g] = total[i][2];
    }
  }
  __syncthreads();
  if (warp == 0 && t == 0) {
    _Pragma("unroll") for (int i = 0; i < TILES; ++i) {
      _Pragma("unroll") for (int h = 0; h < 2; ++h) {
        const int row = unit * RT + 16 * i + 8 * h + g;
        float s = 0.0f;
        for (int w = 0; w < NW; ++w) s += g4_red[w][i][8 * h + g];  // slots in a fixed order
        if (row < N) out[(size_t)token * N + row] = static_cast<T>(s);
      }
    }
  }
""",
}


GATE_UP_M1_GEOMETRY_ENV = "GEMMA4_MLX_GATE_UP_GEOMETRY"
"""StreamConfig fields for the gate/up stream kernel at M = 1, e.g. "warps=8,stages=6" (tuning)."""


@dataclass(frozen=True)
class StreamConfig:
    """Geometry of the CUDA stream kernels: 16-row tiles per warp, warps per block (each with its
    own rows), stages in flight per warp, and blocks per staged row piece (group_blocks)."""

    tiles: int = 1
    warps: int = 4
    stages: int = 4
    group_blocks: int = 8  # blocks per staged row piece (one contiguous read of each row per stage)
    rotate: bool = False  # each warp starts at its own row group (unit % groups) and wraps around

    def __post_init__(self):
        if self.tiles not in (1, 2, 4) or self.warps not in (1, 2, 4, 8) or not 2 <= self.stages <= 8:
            raise ValueError("tiles must be 1, 2 or 4, warps 1, 2, 4 or 8, stages 2..8")
        if self.group_blocks not in (8, 16, 32, 64):
            raise ValueError("group_blocks must be 8, 16, 32 or 64")
        if self.shared_bytes() > 48 * 1024:
            raise ValueError(f"{self}: {self.shared_bytes()} bytes of static shared memory (> 48 KiB)")

    def shared_bytes(self) -> int:
        return self.warps * self.stages * 16 * self.tiles * self.row_stride() + 16

    def row_stride(self) -> int:
        """Bytes per staged row: group_blocks * 18, padded by 16 beyond 8 blocks (bank spread)."""
        return self.group_blocks * 18 + (16 if self.group_blocks > 8 else 0)


def stream_copy_width(row_bytes: int) -> int:
    """Bytes per cp.async of the stream kernels for rows of ``row_bytes`` (16, 8 or 4; 0: none fits,
    i.e. an odd number of blocks per row, which the stream kernels do not take)."""
    for ch in (16, 8, 4):
        if row_bytes % ch == 0:
            return ch
    return 0


_STREAM_KINDS = {"dense": 0, "gather": 1, "gate_up": 2, "down_sum": 3}


def _stream_def(kind: str) -> _KernelDef:
    key = (Q4_0, "stream_" + kind)
    if key not in _KERNEL_DEFS:
        name = {"dense": "g4_q4_0_matvec_stream", "gather": "g4_q4_0_matvec_gather_stream",
                "gate_up": "g4_q4_0_gate_up_gather_stream", "down_sum": "g4_q4_0_down_sum_gather_stream"}[kind]
        inputs = {"dense": ("x", "wq"), "down_sum": ("x", "ids", "wts", "wq")}.get(kind, ("x", "ids", "wq"))
        tmpl = ("T",) + (("M",) if kind == "dense" else ()) + ("TILES", "NW", "ST", "GB", "ROT", "CH")
        tmpl += ("XPP",) if kind == "gather" else ()
        loop, begin, end = _STREAM_SLOTS.get(kind, _ONE_PASS)
        body = _STREAM_BODY_CUDA.replace("@KIND@", str(_STREAM_KINDS[kind]))
        for key, text in (("@SETUP@", _STREAM_SETUP[kind]), ("@SLOT_LOOP@", loop), ("@SLOT_BEGIN@", begin),
                          ("@SLOT_END@", end), ("@STORE@", _STREAM_STORE[kind])):  # fmt: skip
            body = body.replace(key, text.strip("\n"))
        header = prelude("cuda") + _MMA_HEADER_CUDA + _STREAM_HEADER_CUDA
        _KERNEL_DEFS[key] = _KernelDef(name, kind, Q4_0, inputs, ("out",), tmpl,
                                       {"metal": ("", ""), "cuda": (header, body)})  # fmt: skip
    return _KERNEL_DEFS[key]


def default_stream_config(kind: str, m: int, n: int, k: int, pairs: int = 1, slots: int = 8) -> StreamConfig:
    """One 16-row tile per warp, 4 warps, 4 stages (a starting point; bench/kernels.py --focus);
    a dense FFN's fused gate|up at M = 1 (one "expert"): 8 warps, 2 stages (in the 31B decode step on
    the H200, 0.1-0.24 ms less GPU time per 12 layers than 4 warps, 4 stages; bench/NOTES.md
    2026-11-30; MoE experts keep 4 x 4, not measured there); down_sum: a warp per slot
    (up to 8), 2 stages (static shared memory). GEMMA4_MLX_GATE_UP_GEOMETRY overrides the gate/up
    kernel's at M = 1 (a dense FFN's fused gate|up, or a token's experts)."""
    if kind == "down_sum":
        warps = 1 << max(0, math.ceil(math.log2(max(1, min(slots, 8)))))
        return StreamConfig(1, warps, 2)
    if kind == "gate_up" and m == 1:
        cfg = StreamConfig(1, 8, 2) if pairs == 1 else StreamConfig(1, 4, 4)
        return geometry_override(cfg, GATE_UP_M1_GEOMETRY_ENV)
    return StreamConfig(1, 4, 4)


def stream_supported(x_dtype: mx.Dtype, k: int) -> bool:
    """True when the stream kernels take this input: bf16 activations, whole 4-byte words per row."""
    return x_dtype == mx.bfloat16 and k % 32 == 0 and stream_copy_width(row_bytes(Q4_0, k)) > 0


def plan_stream(kind: str, m: int, n: int, k: int, slots: int = 1, x_per_pair: bool = False,
                config: StreamConfig | None = None) -> LaunchPlan:  # fmt: skip
    """Launch plan of a CUDA stream kernel; ``n`` is N (dense/gather) or F (gate_up)."""
    pairs = m if kind == "down_sum" else m * slots if kind != "dense" else 1
    cfg = config or default_stream_config(kind, m, n, k, pairs, slots)
    ch = stream_copy_width(row_bytes(Q4_0, k))
    if not ch:
        raise ValueError(f"stream kernels: K={k} gives rows of an odd number of blocks")
    template: list = [("T", "bfloat16")] + ([("M", m)] if kind == "dense" else [])
    template += [("TILES", cfg.tiles), ("NW", cfg.warps), ("ST", cfg.stages), ("GB", cfg.group_blocks),
                 ("ROT", int(cfg.rotate)), ("CH", ch)]
    if kind == "gather":
        template.append(("XPP", int(bool(x_per_pair))))
    rows_per_block = (8 if kind == "gate_up" else 16) * cfg.tiles * (1 if kind == "down_sum" else cfg.warps)
    threads = 32 * cfg.warps
    grid = (math.ceil(n / rows_per_block) * threads, pairs, 1)
    out_shape = (m, n) if kind in ("dense", "down_sum") else (m, slots, n)
    return LaunchPlan(template, grid, (threads, 1, 1), out_shape)


STREAM_KERNELS: bool | None = None
"""Whether dispatch sends Q4_0 with bf16 activations on CUDA to the stream kernels: dense at
M >= STREAM_MIN_ROWS (replacing the tensor-core kernel), gathered, fused gate/up and fused down +
weighted sum at any M <= 8. They passed ``pytest -m gpu`` on the H200 (operator and model-level
checks) and measured faster there (bench/NOTES.md, 2026-11-29): 31B FFN gate M = 8 38-39 us vs 45 us
(mma); 26B-A4B expert step with the router-weighted sum 24.6 us vs 52.2 us. None: on where the
kernel family "quant_matvec_stream" is (custom_kernels.PROVEN); True/False force them (where no
runs kernel takes the call first: one token through quant_matvec_runs / gate_up_runs, 2..8 tokens
with K a multiple of 256 through quant_matvec_runs_m)."""

STREAM_MIN_ROWS = 2
"""Dense M below this keeps the f32-FMA kernel: at M = 1 the stream kernel measured the same
(31.9-32.9 us vs 31.9-32.3 us at the 31B FFN gate shape, within noise), so it is not promoted there."""


def _use_stream(x_dtype: mx.Dtype, k: int, rows: int | None = None) -> bool:
    """Stream kernels for this call? ``rows``: M of a dense call (None for the expert forms)."""
    if rows is not None and rows < STREAM_MIN_ROWS:
        return False
    enabled = use_kernel("quant_matvec_stream") if STREAM_KERNELS is None else STREAM_KERNELS
    return enabled and backend() == "cuda" and stream_supported(x_dtype, k) and _arch_at_least(MMA_ARCH)


def _need_bf16(x: mx.array) -> None:
    if x.dtype != mx.bfloat16:
        raise TypeError("the CUDA tensor-core Q4_0 kernels (stream, runs) take bfloat16 activations")


def launch_dense_stream(x2: mx.array, blocks: mx.array, n: int, config: StreamConfig | None = None,
                        init_value: float | None = None, out_shape: tuple[int, ...] | None = None) -> mx.array:  # fmt: skip
    """CUDA stream kernel, Q4_0: bf16 x2 [..., K] with M <= 8 rows in all @ blocks [N, ...].T -> [M, N]
    (or out_shape; CUDA builds only)."""
    _need_bf16(x2)
    m, k = math.prod(x2.shape[:-1]), x2.shape[-1]
    return _run(_stream_def("dense"), [x2, blocks], plan_stream("dense", m, n, k, config=config), x2.dtype,
                init_value, out_shape)  # fmt: skip


def launch_gather_stream(x: mx.array, ids: mx.array, blocks: mx.array, n: int,
                         config: StreamConfig | None = None, init_value: float | None = None) -> mx.array:  # fmt: skip
    """CUDA stream kernel for Q4_0 experts: x [..., K] or [..., k, K] bf16, ids [..., k] -> [..., k, N]."""
    _need_bf16(x)
    m, slots, per_pair = _pairs(x, ids)
    plan = plan_stream("gather", m, n, x.shape[-1], slots, per_pair, config)
    return _run(_stream_def("gather"), [x, ids, blocks], plan, x.dtype, init_value, (*ids.shape, n))


def launch_down_sum_stream(x: mx.array, ids: mx.array, weights: mx.array, blocks: mx.array, n: int,
                           config: StreamConfig | None = None, init_value: float | None = None) -> mx.array:  # fmt: skip
    """CUDA stream kernel, fused MoE down projection and weighted sum over the slots: x [..., k, K]
    bf16, ids int32 [..., k], weights [..., k] (f32) -> sum_s weights[m, s] * W[ids[m, s]] @ x[m, s],
    [..., N] bf16 (f32 sums, one rounding)."""
    _need_bf16(x)
    m, slots, _ = _pairs(x, ids)
    plan = plan_stream("down_sum", m, n, x.shape[-1], slots, True, config)
    return _run(_stream_def("down_sum"), [x, ids, weights.astype(mx.float32), blocks], plan, x.dtype,
                init_value, (*ids.shape[:-1], n))  # fmt: skip


def launch_gate_up_stream(x: mx.array, ids: mx.array, blocks: mx.array, f: int,
                          config: StreamConfig | None = None, init_value: float | None = None) -> mx.array:  # fmt: skip
    """CUDA stream kernel for the fused Q4_0 expert gate/up: x [..., K] bf16, ids [..., k] -> gelu(g) *
    u [..., k, F]."""
    _need_bf16(x)
    m, slots, _ = _pairs(x, ids)
    plan = plan_stream("gate_up", m, f, x.shape[-1], slots, config=config)
    return _run(_stream_def("gate_up"), [x, ids, blocks], plan, x.dtype, init_value, (*ids.shape, f))


# --------------------------------------------------------------------------------------------
# CUDA only: Q4_0 "runs" kernels for one token (tensor cores, 144-byte loads per lane)
# --------------------------------------------------------------------------------------------
# Why: at M = 1 the f32-FMA kernel reads its blocks with 2-byte loads, and Nsight Compute shows it
# waiting on them: at E4B's gate|up (K = 2560) DRAM 15% busy, 0.7 eligible warps per scheduler,
# 62% of stalls on L1TEX, 8.9 of 32 bytes used per sector (results/ncu-E4B-short-rows-2026-11-30.txt).
# Here each lane owns runs of 8 blocks (256 weights, 144 bytes: 16-byte aligned when the row and
# the base are) of one row and reads a run with nine 16-byte loads, so one warp has 4.6 KB in
# flight per run. The 8 rows of a warp are the 8 columns n of mma.sync m16n8k16 (B = weights,
# lane (g, t) holds row g), and its 4 lanes t of a row hold 4 different runs: k-columns
# {2t, 2t+1, 2t+8, 2t+9} of every mma are 4 weights of lane t's current block. A (16 x 16) has x
# in row m = t at those columns and zeros elsewhere, so D[m, n] is the unscaled dot of block
# (run of group m) of row n; only the lanes g == t load x (bf16 pairs straight into A, no
# conversion). After the block's 8 mmas (32 weights), each D[m, n] is scaled by its block's d (a
# shuffle from the lane that read it) into f32 sums; lanes of a row add their groups at the end
# (two xor shuffles, fixed order) and the NW warps of a threadgroup split the runs, added in warp
# order. Nibble pairs become bf16x2 (128 + q) with one byte permute against 0x43 and one bf16x2
# subtraction of 136 (exact q - 8). K must be a multiple of 256; a misaligned base falls back to
# 2-byte loads inside the kernel. Measured (H200, 12-layer traces, bench/NOTES.md session 12): a
# dense MLP's gate|up 37-45 -> 22.5 us per E4B layer, 102 -> 86-90 us per 31B layer (family
# "gate_up_runs"; the 16-row form below has since replaced it as the default); the dense form is
# slower than the split-K FMA kernel on the step's other projections (31B q|k|v 33 -> 41 us, down
# 38 -> 46 us), so "quant_matvec_runs" stayed opt-in then. Nsight Compute: 79 registers (37.5%
# occupancy), stalls on L1TEX loads, issue 28-33%.

_RUNS_HEADER_CUDA = r"""
// the 144 bytes of one run (8 blocks) into 36 words: 16-byte loads, or 2-byte loads off alignment
__device__ __forceinline__ void g4_load_run(uint32_t (&q)[36], const uint8_t* run, bool aligned) {
  if (aligned) {
    _Pragma("unroll") for (int s = 0; s < 9; ++s) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(run) + s);
      q[4 * s] = v.x; q[4 * s + 1] = v.y; q[4 * s + 2] = v.z; q[4 * s + 3] = v.w;
    }
  } else {
    _Pragma("unroll") for (int i = 0; i < 36; ++i) q[i] = g4_u16(run + 4 * i) | (g4_u16(run + 4 * i + 2) << 16);
  }
}
// bytes i0, i1 of v (low nibbles already masked) -> bf16x2 {q0 - 8, q1 - 8}, exact
__device__ __forceinline__ uint32_t g4_q4_pair(uint32_t v, uint32_t sel) {
  uint32_t p = __byte_perm(v, 0x43434343u, sel);  // {0x43 q0, 0x43 q1}: bf16 128 + q
  const uint32_t c = 0x43084308u;                   // bf16x2 {136, 136}
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&p), *reinterpret_cast<const __nv_bfloat162*>(&c));
  return *reinterpret_cast<uint32_t*>(&r);
}
"""

# Template: T (bfloat16), NW (warps per threadgroup, splitting the runs), PF (1: each lane loads its
# next run while it computes on this one). @GU@: 0 dense (8 rows per threadgroup), 1 gate|up (gate
# rows r..r+3 and up rows F+r..F+r+3 -> gelu_tanh(g) * u).
def _runs_epilogue(rows: int) -> str:
    """The end of a runs kernel body, once every warp has put its partial sums of the threadgroup's
    `rows` weight rows in rows_s: the warps' partials added in warp order, then GeGLU (gate|up: the
    first half of the rows are gate, the second up) or the plain store."""
    half = rows // 2
    return f"""  __syncthreads();
  if (warp == 0 && lane < (GU ? {half} : {rows})) {{
    float s = rows_s[0][lane];
    for (int w = 1; w < NW; ++w) s += rows_s[w][lane];
    if (GU) {{
      float u = rows_s[0][lane + {half}];
      for (int w = 1; w < NW; ++w) u += rows_s[w][lane + {half}];
      if (out0 + lane < N) out[out0 + lane] = static_cast<T>(g4_gelu_tanh(s) * u);
    }} else if (out0 + lane < N) {{
      out[out0 + lane] = static_cast<T>(s);
    }}
  }}
"""


_RUNS_BODY_CUDA = r"""
  // gemma4-mlx q4_0 runs kernel (CUDA tensor cores, one token, 144-byte runs per lane)
  constexpr int GU = @GU@;
  const int K = x_shape[x_ndim - 1];  // x [..., K] holding one token
  const int NR = wq_shape[0];         // weight rows
  const int row_bytes = wq_shape[1];
  const int N = GU ? NR / 2 : NR;     // output rows
  const int C = K >> 8;               // runs of 8 blocks per row
  const int lane = (int)(threadIdx.x & 31u);
  const int warp = (int)(threadIdx.x >> 5);
  const int g = lane >> 2;
  const int t = lane & 3;
  const int out0 = (int)blockIdx.x * (GU ? 4 : 8);
  const int wrow = GU ? (g < 4 ? out0 + g : N + out0 + g - 4) : out0 + g;
  const bool row_ok = GU ? out0 + (g & 3) < N : wrow < NR;
  const uint8_t* rowp = wq + (size_t)(row_ok ? wrow : 0) * row_bytes;
  const bool w_aligned = (reinterpret_cast<uintptr_t>(wq) & 15u) == 0;
  const bool x_aligned = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  const bool diag = g == t;  // the lanes holding x in A (row m = t)
  const uint8_t* xb = reinterpret_cast<const uint8_t*>(x);
  float acc0 = 0.0f, acc1 = 0.0f;  // rows 2t, 2t + 1 of group g's runs (lanes g < 4)
  uint32_t xa[16];
  _Pragma("unroll") for (int i = 0; i < 16; ++i) xa[i] = 0u;
  uint32_t q[36];
  if (PF && 4 * warp < C) g4_load_run(q, rowp + (size_t)min(4 * warp + t, C - 1) * 144, w_aligned);
  for (int j = warp; 4 * j < C; j += NW) {
    const int c = 4 * j + t;
    const bool live = c < C;
    uint32_t qn[36];  // PF: the next run of this lane, loading while this one is used
    if (!PF) {
      g4_load_run(q, rowp + (size_t)min(c, C - 1) * 144, w_aligned);
    } else if (4 * (j + NW) < C) {
      g4_load_run(qn, rowp + (size_t)min(c + 4 * NW, C - 1) * 144, w_aligned);
    }
    const uint8_t* xr = xb + (size_t)(live ? c : C - 1) * 512;  // x of the run: 256 bf16
    _Pragma("unroll") for (int b = 0; b < 8; ++b) {
      // block b of the run: 18 bytes at 18 b; even b: d in the low half of a word and qs at +2,
      // odd b: d in the high half and qs word-aligned
      const int w0 = (18 * b) >> 2;
      uint32_t u[4];
      uint32_t dbits;
      if ((b & 1) == 0) {
        dbits = q[w0] & 0xFFFFu;
        _Pragma("unroll") for (int i = 0; i < 4; ++i) u[i] = __funnelshift_r(q[w0 + i], q[w0 + i + 1], 16);
      } else {
        dbits = q[w0] >> 16;
        _Pragma("unroll") for (int i = 0; i < 4; ++i) u[i] = q[w0 + 1 + i];
      }
      const float d = live ? g4_half_bits(dbits) : 0.0f;
      if (diag) {
        const uint8_t* xp = xr + 64 * b;
        if (x_aligned) {
          _Pragma("unroll") for (int s = 0; s < 4; ++s) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(xp) + s);
            xa[4 * s] = v.x; xa[4 * s + 1] = v.y; xa[4 * s + 2] = v.z; xa[4 * s + 3] = v.w;
          }
        } else {
          _Pragma("unroll") for (int i = 0; i < 16; ++i) xa[i] = g4_u16(xp + 4 * i) | (g4_u16(xp + 4 * i + 2) << 16);
        }
      }
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      _Pragma("unroll") for (int i = 0; i < 4; ++i) {
        const uint32_t lo = u[i] & 0x0F0F0F0Fu;         // weights 4i .. 4i+3 of the block
        const uint32_t hi = (u[i] >> 4) & 0x0F0F0F0Fu;  // weights 16+4i .. 16+4i+3
        g4_mma_bf16(part, xa[2 * i], 0u, xa[2 * i + 1], 0u, g4_q4_pair(lo, 0x4140u), g4_q4_pair(lo, 0x4342u));
        g4_mma_bf16(part, xa[8 + 2 * i], 0u, xa[9 + 2 * i], 0u, g4_q4_pair(hi, 0x4140u), g4_q4_pair(hi, 0x4342u));
      }
      // part[0] = D[m = g][n = 2t], part[1] = D[g][2t + 1]: block of lane (row n, t = g)
      const float d0 = __shfl_sync(0xFFFFFFFFu, d, 8 * t + g);
      const float d1 = __shfl_sync(0xFFFFFFFFu, d, 8 * t + 4 + g);
      acc0 += d0 * part[0];
      acc1 += d1 * part[1];
    }
    if (PF) {
      _Pragma("unroll") for (int i = 0; i < 36; ++i) q[i] = qn[i];
    }
  }
  acc0 += __shfl_xor_sync(0xFFFFFFFFu, acc0, 4);
  acc1 += __shfl_xor_sync(0xFFFFFFFFu, acc1, 4);
  acc0 += __shfl_xor_sync(0xFFFFFFFFu, acc0, 8);
  acc1 += __shfl_xor_sync(0xFFFFFFFFu, acc1, 8);
  __shared__ float rows_s[NW][8];
  if (lane < 4) {
    rows_s[warp][2 * lane] = acc0;
    rows_s[warp][2 * lane + 1] = acc1;
  }
""" + _runs_epilogue(8)


# The 16-row form (RunsConfig.rows = 16, kernels g4_q4_0_matvec_runs16 / g4_q4_0_gate_up_runs16):
# the weights are the A operand instead. Lane (g, t) holds rows g and g + 8 of a 16-row set (gate|up:
# gate row g and up row g of 8 outputs) and reads the same run of 4 blocks (72 bytes) of both; its A
# pairs are the same bf16x2 nibble pairs as above, written straight into the quads that mma.sync
# reads, and x is B: lane (t, t) loads x of lane t's run (read-only path, predicated), every other
# lane holds zeros, so D[m][n] is row m's block of the run of lanes t = n. Per mma 16 x 16 weights
# (twice the 8 x 16 above) and no register copies of x. Each lane alternates between the even and
# the odd run of a pair (16-byte loads, then an 8-byte one, or the other way round: one layout per
# phase, the same for every lane). Same K and alignment rules as the 8-row form. SASS: 2.0
# instructions per weight (the 8-row form ~3); Nsight Compute on the 31B gate|up: 17.2M issued
# instructions (27.9M), 71 us (95), DRAM 40%, 80 registers, still waiting on loads (10.5 of 17.1
# cycles per instruction). Measured (H200, bench/NOTES.md session 13): a dense MLP's gate|up per
# 31B layer 88 -> 71 us, per E4B layer 22.6 -> 20.7 us; the default (RUNS_ROWS). The dense form
# about equals the split-K kernel on the 31B step's other projections (the staged bulk-copy form of
# session 15 beats it there: quant_matvec_runs became a CUDA default for wide rows).

_RUNS16_HEADER_CUDA = r"""
// 16 bytes through the read-only path; L2P: with the L2::256B prefetch-size hint (the L2 fetches
// the aligned 256 bytes around it from DRAM, which the warp's neighbouring runs read next)
template <int L2P>
__device__ __forceinline__ uint4 g4_ld16(const uint4* p) {
  if (L2P) {
    uint4 v;
    asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
  }
  return __ldg(p);
}
// the 72 bytes of one run (4 blocks) into 18 words; ODD: the run starts 8 bytes past a 16-byte
// boundary (8-byte load first), else on it (8-byte load last); 2-byte loads off alignment
template <int ODD, int L2P>
__device__ __forceinline__ void g4_load_run72(uint32_t (&q)[18], const uint8_t* run, bool aligned) {
  if (aligned) {
    const uint2 e = __ldg(reinterpret_cast<const uint2*>(run + (ODD ? 0 : 64)));
    const uint4* v = reinterpret_cast<const uint4*>(run + (ODD ? 8 : 0));
    constexpr int o = ODD ? 2 : 0;
    _Pragma("unroll") for (int s = 0; s < 4; ++s) {
      const uint4 w = g4_ld16<L2P>(v + s);
      q[o + 4 * s] = w.x; q[o + 4 * s + 1] = w.y; q[o + 4 * s + 2] = w.z; q[o + 4 * s + 3] = w.w;
    }
    q[ODD ? 0 : 16] = e.x; q[ODD ? 1 : 17] = e.y;
  } else {
    _Pragma("unroll") for (int i = 0; i < 18; ++i) q[i] = g4_u16(run + 4 * i) | (g4_u16(run + 4 * i + 2) << 16);
  }
}
// bf16x2 {q - 8} of qs pair p (bytes 2p, 2p + 1) of block b of a 72-byte run, low or high (hi)
// nibbles; b, p, hi are constants once the callers' loops are unrolled
template <typename Q>  // Q: uint32_t[18] in registers, or a pointer to the run's words
__device__ __forceinline__ uint32_t g4_run72_pair(const Q& q, int b, int p, int hi) {
  const int o = 18 * b + 2 + 2 * p;  // byte offset of the pair in the run
  const uint32_t w = hi ? (q[o >> 2] >> 4) & 0x0F0F0F0Fu : q[o >> 2] & 0x0F0F0F0Fu;
  return g4_q4_pair(w, (o & 2) ? 0x4342u : 0x4140u);
}
template <typename Q>
__device__ __forceinline__ float g4_run72_scale(const Q& q, int b) {
  const int o = 18 * b;
  return g4_half_bits((o & 2) ? q[o >> 2] >> 16 : q[o >> 2] & 0xFFFFu);
}
// x elements 4w .. 4w + 3 of a block half (8 bytes of x at p, read-only path) as B's two bf16x2 on
// the lanes that hold x (xl: g == t), zeros on the others (predicated loads, no branch): one load
// when x is 8-byte aligned (XA), else 2-byte loads
template <int XA>
__device__ __forceinline__ void g4_x8(uint32_t& b0, uint32_t& b1, const uint8_t* p, bool xl) {
  if (XA) {
    uint2 v = make_uint2(0u, 0u);
    if (xl) v = __ldg(reinterpret_cast<const uint2*>(p));
    b0 = v.x; b1 = v.y;
  } else {
    b0 = xl ? g4_u16(p) | (g4_u16(p + 2) << 16) : 0u;
    b1 = xl ? g4_u16(p + 4) | (g4_u16(p + 6) << 16) : 0u;
  }
}
// One run of each of rows g (q0) and g + 8 (q1) against x of the run (xr): the 4 blocks' dots, scaled
// by their d, into acc: (row g, column 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1). live: the run
// exists (else d = 0 and q0 / q1 hold some other run of the rows, finite)
template <int XA, typename Q>
__device__ __forceinline__ void g4_runs16_run(float (&acc)[4], const Q& q0, const Q& q1,
                                              const uint8_t* xr, bool xl, bool live, int g, int t) {
  const int s0 = 4 * g + ((2 * t) & 3);  // the lanes holding the d of columns 2t, 2t + 1 (t < 2)
  _Pragma("unroll") for (int b = 0; b < 4; ++b) {
    const float d0 = live ? g4_run72_scale(q0, b) : 0.0f;
    const float d1 = live ? g4_run72_scale(q1, b) : 0.0f;
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    _Pragma("unroll") for (int hi = 0; hi < 2; ++hi) {
      _Pragma("unroll") for (int w = 0; w < 4; ++w) {  // qs pairs 2w, 2w + 1: weights 4w .. 4w + 3 (+16)
        uint32_t b0, b1;
        g4_x8<XA>(b0, b1, xr + 64 * b + 32 * hi + 8 * w, xl);
        g4_mma_bf16(part, g4_run72_pair(q0, b, 2 * w, hi), g4_run72_pair(q1, b, 2 * w, hi),
                    g4_run72_pair(q0, b, 2 * w + 1, hi), g4_run72_pair(q1, b, 2 * w + 1, hi), b0, b1);
      }
    }
    // D[m][n]: row m's block b of the run of lanes t = n; its d is on lane (g, n)
    const float e0 = __shfl_sync(0xFFFFFFFFu, d0, s0), e1 = __shfl_sync(0xFFFFFFFFu, d0, s0 + 1);
    const float f0 = __shfl_sync(0xFFFFFFFFu, d1, s0), f1 = __shfl_sync(0xFFFFFFFFu, d1, s0 + 1);
    if (t < 2) {
      acc[0] += e0 * part[0]; acc[1] += e1 * part[1]; acc[2] += f0 * part[2]; acc[3] += f1 * part[3];
    }
  }
}
// Every pair of runs of a warp (j = warp, warp + NW, ...): the 16-row loop of the runs16 kernels.
// xb: x's bytes (256 per run), read by the lanes xl (g == t)
template <int XA, int L2P>
__device__ __forceinline__ void g4_runs16_loop(float (&acc)[4], const uint8_t* row0, const uint8_t* row1,
                                               const uint8_t* xb, bool xl, int C, int warp, int nw, int g,
                                               int t, bool w_aligned) {
  for (int j = warp; 8 * j < C; j += nw) {
    _Pragma("unroll") for (int ph = 0; ph < 2; ++ph) {
      const int c = 8 * j + 2 * t + ph;  // run of this lane: even in phase 0, odd in phase 1
      const bool live = c < C;
      const int cc = live ? c : C - 2 + ph;
      uint32_t q0[18], q1[18];
      if (ph) {
        g4_load_run72<1, L2P>(q0, row0 + (size_t)cc * 72, w_aligned);
        g4_load_run72<1, L2P>(q1, row1 + (size_t)cc * 72, w_aligned);
      } else {
        g4_load_run72<0, L2P>(q0, row0 + (size_t)cc * 72, w_aligned);
        g4_load_run72<0, L2P>(q1, row1 + (size_t)cc * 72, w_aligned);
      }
      g4_runs16_run<XA>(acc, q0, q1, xb + (size_t)cc * 256, xl, live, g, t);
    }
  }
}
"""

# Template: T (bfloat16), NW (warps per threadgroup, splitting the row set's runs), and L2P (1: the
# 16-byte weight loads carry the L2::256B prefetch-size hint) for runs16 or STG (slots per warp)
# for the staged form; @LOOP@: _RUNS16_LOOP or _RUNS16S_LOOP. @GU@: 0 dense (16 rows per
# threadgroup), 1 gate|up (gate rows r..r+7 and up rows F+r..F+r+7 -> gelu_tanh(g) * u).
_RUNS16_BODY_CUDA = r"""
  // gemma4-mlx q4_0 runs16 kernel (CUDA tensor cores, one token, weights as A: 16 rows per warp)
  constexpr int GU = @GU@;
  const int K = x_shape[x_ndim - 1];  // x [..., K] holding one token
  const int NR = wq_shape[0];         // weight rows
  const int row_bytes = wq_shape[1];
  const int N = GU ? NR / 2 : NR;     // output rows
  const int C = K >> 7;               // runs of 4 blocks per row (even: K % 256 == 0)
  const int lane = (int)(threadIdx.x & 31u);
  const int warp = (int)(threadIdx.x >> 5);
  const int g = lane >> 2;
  const int t = lane & 3;
  const int out0 = (int)blockIdx.x * (GU ? 8 : 16);
  const int r0 = out0 + g;                          // A row g
  const int r1 = GU ? N + out0 + g : out0 + 8 + g;  // A row g + 8
  const bool ok0 = r0 < N;
  const bool ok1 = GU ? ok0 : r1 < NR;
  const uint8_t* row0 = wq + (size_t)(ok0 ? r0 : 0) * row_bytes;
  const uint8_t* row1 = wq + (size_t)(ok1 ? r1 : 0) * row_bytes;
  const bool w_aligned = (reinterpret_cast<uintptr_t>(wq) & 15u) == 0;
  const uint8_t* xb = reinterpret_cast<const uint8_t*>(x);
  const bool xl = g == t;  // lanes holding x in B (the others hold zeros)
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
@LOOP@  // row g: lanes t = 0, 1 hold its four columns (lanes 2, 3 zeros); add them in a fixed order
  float s0 = acc[0] + acc[1], s1 = acc[2] + acc[3];
  s0 += __shfl_xor_sync(0xFFFFFFFFu, s0, 1);
  s1 += __shfl_xor_sync(0xFFFFFFFFu, s1, 1);
  __shared__ float rows_s[NW][16];
  if (t == 0) {
    rows_s[warp][g] = s0;
    rows_s[warp][8 + g] = s1;
  }
""" + _runs_epilogue(16)


_RUNS16_LOOP = r"""  if ((reinterpret_cast<uintptr_t>(x) & 7u) == 0) {
    g4_runs16_loop<1, L2P>(acc, row0, row1, xb, xl, C, warp, NW, g, t, w_aligned);
  } else {
    g4_runs16_loop<0, L2P>(acc, row0, row1, xb, xl, C, warp, NW, g, t, w_aligned);
  }
"""

# The staged 16-row form (RunsConfig.stages = STG >= 1, kernels g4_q4_0_matvec_runs16s /
# g4_q4_0_gate_up_runs16s): runs16's arithmetic, but the weights reach the lanes through shared
# memory. runs16's lanes each read their own 72-byte runs, so every 16-byte load instruction of a
# warp touches 32 rows' worth of scattered half-sectors: Nsight Compute had L1/TEX at 76-81% of its
# throughput, 58% excess sectors and a 63% L1 hit rate on the 31B gate|up, and a read-only probe in
# that order reaches 50% of copy (bench/NOTES.md, session 14). Here a step is 4 consecutive runs
# (288 bytes) of each of the warp's 16 rows, copied with 16-byte cp.async, consecutive lanes on
# consecutive words of a row (a probe in this kind of order: 86-91%), into a slot of 16 x 288
# bytes; the lanes read their runs from the slot where the arithmetic needs them. STG slots: the
# copy of step u + STG - 1 overlaps the work on step u (STG = 1: the copy follows the work). Rows
# whose base is not 16-byte aligned take runs16's loop (2-byte loads). Registers and shared memory
# decide the occupancy here: 79 registers and 2 slots (9.5 KB) per warp fit 21 one-warp
# threadgroups per SM, one wave for the 31B gate|up's 2688 row sets.

_RUNS16S_HEADER_CUDA = r"""
// the words of a run in shared memory, read where used (q[i]: word i; 8-byte reads)
struct g4_words8 {
  const uint2* p;
  __device__ explicit g4_words8(const uint2* run) : p(run) {}
  __device__ uint32_t operator[](int i) const {
    const uint2 v = p[i >> 1];
    return (i & 1) ? v.y : v.x;
  }
};
// runs16's work with the weights staged: this warp's steps s = warp, warp + nw, ... each hold runs
// 4 s .. 4 s + 3 (288 bytes) of the 16 rows, step u of the warp in slot u % STG (row r at byte
// 288 r; A row r starts at byte row_off(r, key) of wq, key a 0 the compiler cannot see through,
// which keeps the 16 offsets from being hoisted into registers; a missing row: any valid one,
// finite, never stored). The lanes read their runs from the slot while they compute (8-byte reads:
// runs start 8 bytes past 16 every other one; a half warp's reads fall in distinct banks). Needs
// 16-byte aligned rows (row_bytes = 72 C, C even, always is a multiple of 16).
template <int XA, int STG, typename RowOffset>
__device__ __forceinline__ void g4_runs16_staged_loop(float (&acc)[4], uint8_t* stage, const uint8_t* wq,
                                                      RowOffset row_off, const uint8_t* xb, bool xl, int C,
                                                      int warp, int nw, int g, int t) {
  constexpr int SB = 16 * 288;  // bytes of a slot
  const int nsteps = (C + 3) / 4;
  auto issue = [&](int st, int slot) {  // copy step st into a slot: 16-byte word i = 18 r + p of it
    if (st >= nsteps) return;
    const int np = 18 * min(4, C - 4 * st) / 4;  // 16-byte words of each row in this step
    const uint32_t dst = g4_shared_addr(stage) + (uint32_t)(slot * SB);
    const uint8_t* src = wq + (size_t)288 * st;
    int key = 0;
    asm volatile("" : "+r"(key));
    const int ln = (int)(threadIdx.x & 31u);
    _Pragma("unroll") for (int m = 0; m < 9; ++m) {
      const int i = ln + 32 * m;
      const int r = i / 18, p = i - 18 * r;
      if (p < np) g4_cp_async<16>(dst + (uint32_t)(16 * i), src + row_off(r, key) + 16 * p);
    }
  };
  _Pragma("unroll") for (int u = 0; u < (STG > 1 ? STG - 1 : 1); ++u) { issue(warp + nw * u, u); g4_cp_async_commit(); }
  for (int u = 0; warp + nw * u < nsteps; ++u) {
    const int st = warp + nw * u;
    g4_cp_async_wait<(STG > 1 ? STG - 2 : 0)>();  // step u's copies of this lane have landed ...
    __syncwarp();                                  // ... and every lane's
    if (STG > 1) {  // refill the slot read last step while this one is used
      issue(st + nw * (STG - 1), (u + STG - 1) % STG);
      g4_cp_async_commit();
    }
    const bool live = 4 * st + t < C;  // run 4 st + t of this lane
    const int k = live ? t : t - 2;    // a step holds 4 runs or (the last) 2
    const uint2* q0 = reinterpret_cast<const uint2*>(stage + (u % STG) * SB + 288 * g + 72 * k);
    g4_runs16_run<XA>(acc, g4_words8(q0), g4_words8(q0 + 8 * 288 / 8), xb + (size_t)(4 * st + k) * 256, xl, live, g, t);
    __syncwarp();  // every lane has read the slot
    if (STG == 1) {  // one slot: refill it now (the copy overlaps other warps' work only)
      issue(st + nw, 0);
      g4_cp_async_commit();
    }
  }
}
"""

_RUNS16S_LOOP_TEXT = r"""  @STAGE@
  uint8_t* stage = stage_s + warp * STG * 16 * 288;
  // byte offset of A row r's weight row (a missing row: row 0), from the launch's parameters each
  // time it is asked: values held across the staged loop would cost registers (occupancy)
  auto row_off = [&](int r, int key) -> size_t {
    const int nr = wq_shape[0];
    const int n = GU ? nr / 2 : nr;
    const int o = (int)blockIdx.x * (GU ? 8 : 16) + (r & 7) + key;
    const int row = r < 8 ? (o < n ? o : 0) : GU ? (o < n ? n + o : 0) : (o + 8 < nr ? o + 8 : 0);
    return (size_t)row * wq_shape[1];
  };
  if ((reinterpret_cast<uintptr_t>(x) & 7u) == 0) {
    if (w_aligned) {
      @FN@<1, STG>(acc, stage, wq, row_off, xb, xl, C, warp, NW, g, t);
    } else {
      g4_runs16_loop<1, 0>(acc, row0, row1, xb, xl, C, warp, NW, g, t, w_aligned);
    }
  } else if (w_aligned) {
    @FN@<0, STG>(acc, stage, wq, row_off, xb, xl, C, warp, NW, g, t);
  } else {
    g4_runs16_loop<0, 0>(acc, row0, row1, xb, xl, C, warp, NW, g, t, w_aligned);
  }
"""

_STATIC_STAGE = "__shared__ __align__(16) uint8_t stage_s[NW * STG * 16 * 288];"
_DYNAMIC_STAGE = "extern __shared__ __align__(16) uint8_t stage_s[];  // NW * STG * 16 * 288 bytes, given at launch"
_RUNS16S_LOOP = _RUNS16S_LOOP_TEXT.replace("@FN@", "g4_runs16_staged_loop").replace("@STAGE@", _STATIC_STAGE)
_RUNS16B_LOOP = _RUNS16S_LOOP_TEXT.replace("@FN@", "g4_runs16_bulk_loop").replace("@STAGE@", _STATIC_STAGE)
_RUNS16D_LOOP = _RUNS16S_LOOP_TEXT.replace("@FN@", "g4_runs16_staged_loop").replace("@STAGE@", _DYNAMIC_STAGE)

# The bulk-copy form of the staged kernels (RunsConfig.bulk = 1, kernels g4_q4_0_matvec_runs16b /
# g4_q4_0_gate_up_runs16b; RUNS_BULK, the default since session 15): the same slots and arithmetic, but each step is
# copied by the Hopper bulk-copy unit (cp.async.bulk, one per row: lanes 0..15 each copy their
# row's 288 bytes) and waited for on an mbarrier per slot, instead of 9 16-byte cp.async per lane
# through the load/store unit. SASS: 71 registers (staged 79); per step about as many
# instructions as the staged loop (~580 plus a 16-pass loop of ~10 that issues the copies, against
# ~730), so what it can save is load/store-unit work and occupancy, not issue slots.
_MBAR_BULK_CUDA = r"""
// mbarrier and bulk-copy helpers (sm_90): a slot's barrier expects the step's bytes, the bulk
// copies complete them, the lanes wait for the phase (parity) of that use of the slot
__device__ __forceinline__ void g4_mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void g4_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void g4_mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void g4_mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}
__device__ __forceinline__ void g4_bulk_copy(uint32_t dst, const uint8_t* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
"""
_RUNS16B_HEADER_CUDA = _MBAR_BULK_CUDA + r"""// the slot barriers of a thread block, [warp][slot] (NW <= 8, STG <= 4): one array for every
// instantiation of the loop below
__device__ __forceinline__ uint64_t* g4_runs16_bars() {
  __shared__ __align__(8) uint64_t bars_s[8 * 4];
  return bars_s;
}
// the staged loop with bulk copies: same slots (row r at byte 288 r), steps and arithmetic as
// g4_runs16_staged_loop; use n of a slot completes phase n of its barrier. Lanes 0..15 copy a row
// each (the bulk-copy instruction takes warp-uniform operands, so the compiler serializes them in
// a loop of ~10 instructions per row; lane 0 copying all 16 rows compiled worse, ~850 instructions
// per step against ~580 plus that loop, the row offsets moved into uniform registers one by one)
template <int XA, int STG, typename RowOffset>
__device__ __forceinline__ void g4_runs16_bulk_loop(float (&acc)[4], uint8_t* stage, const uint8_t* wq,
                                                    RowOffset row_off, const uint8_t* xb, bool xl, int C,
                                                    int warp, int nw, int g, int t) {
  constexpr int SB = 16 * 288;
  const int lane = (int)(threadIdx.x & 31u);
  const int nsteps = (C + 3) / 4;
  const uint32_t bar0 = g4_shared_addr(g4_runs16_bars() + warp * STG);
  const uint8_t* my_row = wq + row_off(lane & 15, 0);  // lanes 0..15 copy A row `lane`
  if (lane == 0) {
    _Pragma("unroll") for (int s = 0; s < STG; ++s) g4_mbar_init(bar0 + 8 * s, 1);
    g4_mbar_init_fence();
  }
  __syncwarp();
  auto issue = [&](int st, int slot) {
    if (st >= nsteps) return;
    const uint32_t bytes = 72 * min(4, C - 4 * st);  // of each row
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the slot's earlier reads, before the copy
    if (lane == 0) g4_mbar_expect_tx(bar0 + 8 * slot, 16 * bytes);
    __syncwarp();
    if (lane < 16) {
      g4_bulk_copy(g4_shared_addr(stage) + (uint32_t)(slot * SB + 288 * lane), my_row + (size_t)288 * st, bytes,
                   bar0 + 8 * slot);
    }
  };
  _Pragma("unroll") for (int u = 0; u < (STG > 1 ? STG - 1 : 1); ++u) issue(warp + nw * u, u);
  for (int u = 0; warp + nw * u < nsteps; ++u) {
    const int st = warp + nw * u;
    g4_mbar_wait(bar0 + 8 * (u % STG), (uint32_t)(u / STG) & 1u);
    if (STG > 1) issue(st + nw * (STG - 1), (u + STG - 1) % STG);  // the slot read last step
    const bool live = 4 * st + t < C;
    const int k = live ? t : t - 2;
    const uint2* q0 = reinterpret_cast<const uint2*>(stage + (u % STG) * SB + 288 * g + 72 * k);
    g4_runs16_run<XA>(acc, g4_words8(q0), g4_words8(q0 + 8 * 288 / 8), xb + (size_t)(4 * st + k) * 256, xl, live, g, t);
    __syncwarp();  // every lane has read the slot
    if (STG == 1) issue(st + nw, 0);
  }
}
"""

# The many-token form (kernels g4_q4_0_matvec_runs16m / g4_q4_0_gate_up_runs16m; RunsMConfig): M = 1..8
# tokens of x are mma's 8 columns, so the weights are read once for all of them. The one-token
# kernels above put 4 runs of one row side by side in A's k (their per-run scales are applied per
# column); here A's 16 k are one block half of one row, so each block's scale applies after its two
# mma. That layout needs any lane to reach any row: the weights go through shared memory, each warp
# owns its own 16 rows (8 gate + 8 up for gate|up) and walks all of K, and a step (4 runs, 512
# weights) of the threadgroup's NW x 16 rows and of the M tokens' x arrives by bulk copies into one
# of STG slots (the x of a step is shared by the NW warps: at M = 8 it is 1 KB per token per step,
# against 4.6 KB of weights per warp). Slot rows are 304 bytes apart and tokens 1056, so that the
# lanes' 4- and 8-byte reads of a block fall in distinct banks. Rows or x not 16-byte aligned are
# copied by 2-byte loads instead (the same slots, a threadgroup barrier in place of the mbarrier).
_RUNS16M_HEADER_CUDA = r"""
// 2 bytes at p in shared memory (g4_u16 reads through the read-only global path)
__device__ __forceinline__ uint32_t g4_s16(const uint8_t* p) { return *reinterpret_cast<const unsigned short*>(p); }
// 4 bytes at p in shared memory, 4-byte aligned (a4) or 2-byte aligned (two 2-byte loads); a4 is a
// constant once the caller's loop is unrolled
__device__ __forceinline__ uint32_t g4_s32_at(const uint8_t* p, bool a4) {
  return a4 ? *reinterpret_cast<const uint32_t*>(p) : g4_s16(p) | (g4_s16(p + 2) << 16);
}
// One step of lane (g, t) of a runs16m warp: blocks 0..nb-1 of the step of rows g (w0, 18 bytes a
// block) and g + 8 (w0 + 8 RS) against token g's x of the step (xg; zeros when tok is false, a
// token past M). A's k pair (2t, 2t + 1) is weights 4t, 4t + 1 of the block half and (2t + 8, 2t + 9)
// weights 4t + 2, 4t + 3 (qs bytes 4t .. 4t + 3: low nibbles, then high for the second half);
// B takes x in the same order, so the sum over k is the block's dot. acc: (row g, token 2t),
// (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
template <int RS>
__device__ __forceinline__ void g4_runs16m_step(float (&acc)[4], const uint8_t* w0, const uint8_t* xg, bool tok,
                                                int nb, int t) {
  _Pragma("unroll") for (int b = 0; b < 16; ++b) {
    if (b < nb) {  // warp-uniform: the last step of a row can hold 2 runs (8 blocks)
      const uint8_t* p0 = w0 + 18 * b;
      const uint8_t* p1 = p0 + 8 * RS;
      // qs bytes 4t .. 4t + 3 sit at 18 b + 2 + 4t: 4-byte aligned for odd b (RS and slots are multiples of 16)
      const uint32_t q0 = g4_s32_at(p0 + 2 + 4 * t, b & 1), q1 = g4_s32_at(p1 + 2 + 4 * t, b & 1);
      uint2 xl = make_uint2(0u, 0u), xh = make_uint2(0u, 0u);
      if (tok) {
        xl = *reinterpret_cast<const uint2*>(xg + 64 * b + 8 * t);
        xh = *reinterpret_cast<const uint2*>(xg + 64 * b + 32 + 8 * t);
      }
      const uint32_t l0 = q0 & 0x0F0F0F0Fu, l1 = q1 & 0x0F0F0F0Fu;
      const uint32_t h0 = (q0 >> 4) & 0x0F0F0F0Fu, h1 = (q1 >> 4) & 0x0F0F0F0Fu;
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      g4_mma_bf16(part, g4_q4_pair(l0, 0x4140u), g4_q4_pair(l1, 0x4140u), g4_q4_pair(l0, 0x4342u),
                  g4_q4_pair(l1, 0x4342u), xl.x, xl.y);
      g4_mma_bf16(part, g4_q4_pair(h0, 0x4140u), g4_q4_pair(h1, 0x4140u), g4_q4_pair(h0, 0x4342u),
                  g4_q4_pair(h1, 0x4342u), xh.x, xh.y);
      const float d0 = g4_half_bits(g4_s16(p0)), d1 = g4_half_bits(g4_s16(p1));
      acc[0] += d0 * part[0]; acc[1] += d0 * part[1]; acc[2] += d1 * part[2]; acc[3] += d1 * part[3];
    }
  }
}
"""

# Template: T (bfloat16), NW (warps per threadgroup, each with its own row set), STG (slots).
# @GU@: 0 dense (16 rows per warp), 1 gate|up (gate rows r..r+7 and up rows F+r..F+r+7 -> gelu_tanh(g) * u).
_RUNS16M_BODY_CUDA = r"""
  // gemma4-mlx q4_0 runs16m kernel (CUDA tensor cores, 1..8 tokens as mma's columns)
  constexpr int GU = @GU@;
  constexpr int RS = 304;            // bytes from one row to the next in a slot (288 used)
  constexpr int XS = 1056;           // bytes from one token's x to the next in a slot (1024 used)
  constexpr int SB = NW * 16 * RS + 8 * XS;  // a slot: the warps' rows, then x
  const int K = x_shape[x_ndim - 1];  // x [..., K]: M = the other dimensions' product, 1..8
  int M = 1;
  for (int i = 0; i + 1 < x_ndim; ++i) M *= x_shape[i];
  const int NR = wq_shape[0];
  const int N = GU ? NR / 2 : NR;
  const int C = K >> 7;               // runs of 4 blocks per row (even: K % 256 == 0)
  const int nsteps = (C + 3) >> 2;    // steps of 4 runs
  const int lane = (int)(threadIdx.x & 31u);
  const int warp = (int)(threadIdx.x >> 5);
  const int g = lane >> 2;
  const int t = lane & 3;
  const int out0 = ((int)blockIdx.x * NW + warp) * (GU ? 8 : 16);  // this warp's first output row
  // lanes 0..15 copy A row `lane` of this warp (a missing row: row 0, finite, never stored)
  const int o = out0 + (lane & 7);
  const int arow = (lane & 15) < 8 ? (o < N ? o : 0) : GU ? (o < N ? N + o : 0) : (o + 8 < NR ? o + 8 : 0);
  const uint8_t* my_row = wq + (size_t)arow * wq_shape[1];
  const uint8_t* xb = reinterpret_cast<const uint8_t*>(x);
  const bool bulk = ((reinterpret_cast<uintptr_t>(wq) | reinterpret_cast<uintptr_t>(x)) & 15u) == 0;
  extern __shared__ __align__(16) uint8_t stage_s[];  // STG slots of SB bytes, given at launch
  __shared__ __align__(8) uint64_t bars_s[4];
  const uint32_t bar0 = g4_shared_addr(bars_s);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STG; ++s) g4_mbar_init(bar0 + 8 * s, NW);  // a use of a slot: each warp arrives once
    g4_mbar_init_fence();
  }
  __syncthreads();
  auto issue = [&](int st, int slot) {  // step st into a slot: lanes 0..15 a row each, warp 0's lanes 16.. a token's x
    if (st >= nsteps) return;
    const int runs = min(4, C - 4 * st);
    const uint32_t bar = bar0 + 8 * slot, dst = g4_shared_addr(stage_s) + (uint32_t)(slot * SB);
    if (lane == 0) g4_mbar_expect_tx(bar, (uint32_t)((16 * 72 + (warp == 0 ? M * 256 : 0)) * runs));  // this warp's bytes
    __syncwarp();
    if (lane < 16) {
      g4_bulk_copy(dst + (uint32_t)(RS * (16 * warp + lane)), my_row + (size_t)288 * st, (uint32_t)(72 * runs), bar);
    } else if (warp == 0 && lane - 16 < M) {
      g4_bulk_copy(dst + (uint32_t)(NW * 16 * RS + XS * (lane - 16)), xb + ((size_t)(lane - 16) * K + 512 * st) * 2,
                   (uint32_t)(256 * runs), bar);
    }
  };
  auto copy = [&](int st, int slot) {  // the same bytes by 2-byte loads (rows or x off 16-byte alignment)
    const int runs = min(4, C - 4 * st);
    uint8_t* dst = stage_s + slot * SB;
    if (lane < 16) {
      const uint8_t* src = my_row + (size_t)288 * st;
      unsigned short* d = reinterpret_cast<unsigned short*>(dst + RS * (16 * warp + lane));
      for (int i = 0; i < 36 * runs; ++i) d[i] = (unsigned short)g4_u16(src + 2 * i);
    } else if (warp == 0 && lane - 16 < M) {
      const uint8_t* src = xb + ((size_t)(lane - 16) * K + 512 * st) * 2;
      unsigned short* d = reinterpret_cast<unsigned short*>(dst + NW * 16 * RS + XS * (lane - 16));
      for (int i = 0; i < 128 * runs; ++i) d[i] = (unsigned short)g4_u16(src + 2 * i);
    }
  };
  if (bulk) {
    for (int s = 0; s < STG; ++s) issue(s, s);
  }
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int u = 0; u < nsteps; ++u) {
    const int slot = u % STG;
    if (bulk) {
      g4_mbar_wait(bar0 + 8 * slot, (uint32_t)(u / STG) & 1u);
    } else {
      copy(u, slot);
      __syncthreads();
    }
    const uint8_t* w0 = stage_s + slot * SB + RS * (16 * warp + g);
    const uint8_t* xg = stage_s + slot * SB + NW * 16 * RS + XS * g;
    g4_runs16m_step<RS>(acc, w0, xg, g < M, 4 * min(4, C - 4 * u), t);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // this thread's reads of the slot, before its refill
    __syncthreads();  // every warp has read the slot
    if (bulk) issue(u + STG, slot);
  }
  _Pragma("unroll") for (int j = 0; j < 2; ++j) {  // tokens 2t, 2t + 1
    const int tok = 2 * t + j;
    if (tok < M) {
      if (GU) {
        if (out0 + g < N) out[(size_t)tok * N + out0 + g] = static_cast<T>(g4_gelu_tanh(acc[j]) * acc[2 + j]);
      } else {
        if (out0 + g < N) out[(size_t)tok * N + out0 + g] = static_cast<T>(acc[j]);
        if (out0 + 8 + g < N) out[(size_t)tok * N + out0 + 8 + g] = static_cast<T>(acc[2 + j]);
      }
    }
  }
"""

RUNS_M_ROW_STRIDE = 304
"""Bytes between two rows' 288-byte steps in a runs16m slot (kernel constant RS)."""
RUNS_M_X_STRIDE = 1056
"""Bytes between two tokens' 1024-byte steps of x in a runs16m slot (kernel constant XS)."""
RUNS_M_GEOMETRY_ENV = "GEMMA4_MLX_RUNS_M_GEOMETRY"
"""RunsMConfig fields over default_runs_m_config's, e.g. "warps=2,stages=3" (tuning)."""


@dataclass(frozen=True)
class RunsMConfig:
    """Geometry of the CUDA runs16m kernels (1..8 tokens): warps per threadgroup, each with its
    own 16-row set (they share each step's x), and stages, the slots of a step (the copy of step u +
    STG - 1 overlaps the work on step u). The slots take dynamic shared memory (runs_m_shared_bytes).
    The default, 4 warps x 2 slots, measured best on the H200 (bench/NOTES.md, session 16; 31B FFN
    gate at M = 8: 1 / 2 / 4 / 8 warps x 2 slots 40.2 / 30.7 / 26.3 / 26.9 us; 3 slots 40 us, 2
    threadgroups per SM instead of 4)."""

    warps: int = 4
    stages: int = 2

    def __post_init__(self):
        if type(self.warps) is not int or self.warps not in (1, 2, 4, 8):
            raise ValueError(f"warps must be 1, 2, 4 or 8, got {self.warps!r}")
        if type(self.stages) is not int or self.stages not in (1, 2, 3, 4):
            raise ValueError(f"stages must be 1..4, got {self.stages!r}")
        if runs_m_shared_bytes(self) > RUNS_DYNAMIC_LIMIT:
            raise ValueError(f"{self.warps} warps x {self.stages} stages need {runs_m_shared_bytes(self)} bytes of "
                             f"shared memory, over {RUNS_DYNAMIC_LIMIT}")  # fmt: skip


def runs_m_shared_bytes(cfg: RunsMConfig) -> int:
    """Dynamic shared memory of a runs16m launch: STG slots of the warps' 16 rows and 8 tokens' x."""
    return cfg.stages * (cfg.warps * 16 * RUNS_M_ROW_STRIDE + 8 * RUNS_M_X_STRIDE)


def default_runs_m_config() -> RunsMConfig:
    """RunsMConfig() with GEMMA4_MLX_RUNS_M_GEOMETRY's fields over it."""
    return replace_geometry(RunsMConfig(), geometry_fields(RunsMConfig(), RUNS_M_GEOMETRY_ENV), RUNS_M_GEOMETRY_ENV)


def _runs_m_def(kind: str) -> _KernelDef:
    """The runs16m kernel for dense rows or a gate|up."""
    key = (Q4_0, f"runs16m_{kind}")
    if key not in _KERNEL_DEFS:
        name = {"dense": "g4_q4_0_matvec_runs16m", "gate_up": "g4_q4_0_gate_up_runs16m"}[kind]
        header = prelude("cuda") + _MMA_HEADER_CUDA + _RUNS_HEADER_CUDA + _STREAM_CP_ASYNC_CUDA + _MBAR_BULK_CUDA
        header += _RUNS16M_HEADER_CUDA
        body = _RUNS16M_BODY_CUDA.replace("@GU@", "1" if kind == "gate_up" else "0")
        _KERNEL_DEFS[key] = _KernelDef(name, kind, Q4_0, ("x", "wq"), ("out",), ("T", "NW", "STG"),
                                       {"metal": ("", ""), "cuda": (header, body)})  # fmt: skip
    return _KERNEL_DEFS[key]


def plan_runs_m(kind: str, m: int, n: int, k: int, config: RunsMConfig | None = None) -> LaunchPlan:
    """Launch plan of a runs16m kernel for m tokens; ``n`` is N (dense) or F (gate_up)."""
    if kind not in ("dense", "gate_up"):
        raise ValueError(f"runs16m kernels: kind must be 'dense' or 'gate_up', got {kind!r}")
    if k <= 0 or k % 256:
        raise ValueError(f"runs kernels: K={k} is not a positive multiple of 256")
    if n <= 0:
        raise ValueError(f"runs16m kernels: need at least one output row, got {n}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the runs16m kernels take 1..{MAX_ROWS} tokens, got {m}")
    cfg = config or default_runs_m_config()
    groups = math.ceil(_runs_sets(kind, n, 16) / cfg.warps)
    threads = 32 * cfg.warps
    return LaunchPlan([("T", "bfloat16"), ("NW", cfg.warps), ("STG", cfg.stages)], (groups * threads, 1, 1),
                      (threads, 1, 1), (m, n))  # fmt: skip


def launch_dense_runs_m(x: mx.array, blocks: mx.array, n: int, config: RunsMConfig | None = None,
                        init_value: float | None = None, out_shape: tuple[int, ...] | None = None) -> mx.array:  # fmt: skip
    """CUDA runs16m kernel, Q4_0: bf16 x [..., K] holding 1..8 tokens @ blocks [N, ...].T -> [M, N]
    (or out_shape; CUDA builds only)."""
    return _launch_runs_m("dense", x, blocks, n, n, config, init_value, out_shape)


def launch_gate_up_runs_m(x: mx.array, blocks: mx.array, f: int, config: RunsMConfig | None = None,
                          init_value: float | None = None, out_shape: tuple[int, ...] | None = None) -> mx.array:  # fmt: skip
    """CUDA runs16m kernel for a dense fused gate|up, Q4_0: bf16 x [..., K] holding 1..8 tokens,
    blocks [2F, ...] (gate rows, then up rows) -> gelu_tanh(gate) * up [M, F] (or out_shape), the
    f32 product rounded once."""
    return _launch_runs_m("gate_up", x, blocks, 2 * f, f, config, init_value, out_shape)


def _launch_runs_m(kind, x, blocks, rows, n, config, init_value, out_shape):
    cfg = config or default_runs_m_config()
    return launch_hopper_q4_0("runs16m", _runs_m_def(kind), x, blocks, rows,
                              lambda: plan_runs_m(kind, math.prod(x.shape[:-1]), n, x.shape[-1], cfg),
                              runs_m_shared_bytes(cfg), init_value, out_shape)  # fmt: skip


def launch_hopper_q4_0(what: str, kdef, x: mx.array, blocks: mx.array, rows: int, make_plan, shared: int,
                       init_value: float | None, out_shape: tuple[int, ...] | None) -> mx.array:  # fmt: skip
    """One launch of a Hopper-only Q4_0 kernel of 1..8 tokens (runs16m, custom_kernels.quant_tiles):
    bf16 x [..., K], blocks [rows, ...], the plan make_plan() returns, `shared` bytes of dynamic
    shared memory; RuntimeError off a CUDA GPU of compute capability >= BULK_ARCH."""
    _need_bf16(x)
    _check_dense(x, blocks, Q4_0, rows)
    plan = make_plan()
    if backend() != "cuda" or not _arch_at_least(BULK_ARCH):
        raise RuntimeError(f"the {what} kernels need a CUDA GPU of compute capability >= {BULK_ARCH}")
    return _run(kdef, [x, blocks], plan, x.dtype, init_value, out_shape, shared)


RUNS_STAGE_BYTES = 16 * 288
"""Shared memory of one stage slot of a staged runs16 warp (4 runs, 288 bytes, of each of 16 rows)."""
RUNS_SHARED_LIMIT = 48 * 1024
"""Static shared memory per threadgroup on CUDA: warps x stages x RUNS_STAGE_BYTES stay below it."""
RUNS_DYNAMIC_LIMIT = 200 * 1024
"""Dynamic shared memory per threadgroup for the staged slots (RunsConfig.dynamic; Hopper allows
227 KB per threadgroup, less the kernel's static arrays)."""
RUNS_STAGES = 2
"""default_runs_config's stages for the 16-row form: the staged kernels with 2 slots. Measured on
the H200 (bench/NOTES.md, session 14): 31B gate|up per layer in the step 69.6 -> 61.8 us, E4B
20.4 -> 17.5 us; at the kernel bench's back-to-back rate the 31B gate|up reads at 82% of copy
(runs16 61%). stages=0 brings runs16 back."""

RUNS_DENSE_STAGES = 1
"""default_runs_config's stages for dense rows (family quant_matvec_runs): 1 slot, so that 8 warps
share a row set within the 48 KB of static shared memory. Measured on the H200 (bench/NOTES.md,
session 15, 12-layer 31B step): q|k|v / o_proj / down 31 / 15 / 32 us per call against 33 / 16 / 37
for the split-K kernel; 2 slots in dynamic shared memory (8 warps) were no faster than 1."""

RUNS_BULK = 1
"""default_runs_config's bulk for the staged forms: each row's step arrives by one cp.async.bulk.
Measured on the H200 (bench/NOTES.md, session 15, 12-layer 31B step): gate|up per call 62.3 ->
59.2 us; the dense rows 26.9 -> 24.4 us (o_proj and down, 8 warps x 1 slot)."""

RUNS_DENSE_MIN_WARPS = 2048
"""Dense rows take the runs kernel only when its grid holds at least this many warps (row sets x
warps per set): the 31B projections do (2,048-2,688); E4B's do not (320-1,280; the 16-row form was
slower there than split-K, bench/NOTES.md session 13)."""

RUNS_GEOMETRY_ENV = "GEMMA4_MLX_RUNS_GEOMETRY"
"""RunsConfig fields over default_runs_config's, e.g. "warps=2" (tuning)."""


RUNS_ROWS = 16
"""default_runs_config's rows: the 16-row form (weights as mma's A operand). Measured on the H200
(bench/NOTES.md, session 13): a dense MLP's gate|up per 31B layer 88 -> 71 us, per E4B layer 22.6
-> 20.7 us; full 31B step at 4K, GPU busy 15.4 -> 14.1 ms; decode in alternated processes 67.7 /
65.7 -> 72.7 / 71.3 tok/s (31B), E4B unchanged within its spread."""


@dataclass(frozen=True)
class RunsConfig:
    """Geometry of the CUDA runs kernels: warps per threadgroup, which split a row set's runs,
    prefetch = 1 to load each lane's next run while computing on the current one (36 registers;
    8-row form only), rows: 8 (weights as mma's B operand) or 16 (weights as A, the runs16
    kernels; RUNS_ROWS, the default), l2_prefetch = 1 to give the 16-row form's 16-byte
    weight loads the L2::256B hint, stages = STG >= 1 for the staged 16-row form (weights
    through shared memory in STG slots of 4 runs per row, refilled STG steps ahead; 0: runs16
    itself), bulk = 1 to fill the slots with bulk copies (cp.async.bulk, one per row and
    step) instead of 16-byte cp.async (RUNS_BULK, the default), and dynamic = 1 to give the
    staged slots dynamic shared memory (up to RUNS_DYNAMIC_LIMIT instead of the 48 KB of static
    shared memory: 8 warps x 2 slots for rows with few row sets; no faster than 1 slot, opt-in)."""

    warps: int = 1
    prefetch: int = 0
    rows: int = RUNS_ROWS
    l2_prefetch: int = 0
    stages: int = 0
    bulk: int = 0
    dynamic: int = 0

    def __post_init__(self):
        if self.warps not in (1, 2, 4, 8):
            raise ValueError("warps must be 1, 2, 4 or 8")
        if self.prefetch not in (0, 1):
            raise ValueError("prefetch must be 0 or 1")
        if self.rows not in (8, 16):
            raise ValueError("rows must be 8 or 16")
        if self.rows == 16 and self.prefetch:
            raise ValueError("the 16-row runs kernels have no prefetch")
        if self.l2_prefetch not in (0, 1) or (self.l2_prefetch and self.rows != 16):
            raise ValueError("l2_prefetch is 0 or 1, and 1 needs rows=16")
        if self.stages not in (0, 1, 2, 3, 4) or (self.stages and (self.rows != 16 or self.l2_prefetch)):
            raise ValueError("stages is 0..4, and staging needs rows=16 without l2_prefetch")
        if self.bulk not in (0, 1) or (self.bulk and not self.stages):
            raise ValueError("bulk is 0 or 1, and 1 needs stages >= 1")
        if self.dynamic not in (0, 1) or (self.dynamic and (not self.stages or self.bulk)):
            raise ValueError("dynamic is 0 or 1, and 1 needs stages >= 1 without bulk")
        limit = RUNS_DYNAMIC_LIMIT if self.dynamic else RUNS_SHARED_LIMIT
        if self.warps * self.stages * RUNS_STAGE_BYTES > limit:
            raise ValueError(f"{self.warps} warps x {self.stages} stages x {RUNS_STAGE_BYTES} bytes exceed "
                             f"{limit} bytes of {'dynamic' if self.dynamic else 'static'} shared memory")  # fmt: skip


RUNS_PREFETCH = 0
"""default_runs_config's prefetch. Off: measured slower on the H200 (125 registers instead of 79;
gate|up per E4B layer 22.5 -> 34.7 us, per 31B layer 87.3 -> 110.4 us; bench/NOTES.md, session 12)."""

RUNS_L2_PREFETCH = 0
"""default_runs_config's l2_prefetch for the 16-row form. Off: no gain measured (12-layer 31B
trace, GPU busy 3.14 ms without, 3.16 ms with; bench/NOTES.md, session 13)."""

RUNS_TARGET_WARPS = 2048
"""default_runs_config splits the runs over more warps while the grid has fewer warps than this."""


def default_runs_config(kind: str, n: int, k: int) -> RunsConfig:
    """RUNS_ROWS rows per set; staged slots filled by bulk copies (RUNS_BULK), RUNS_STAGES of them
    for a gate|up and RUNS_DENSE_STAGES for dense rows; one warp per row set, doubled (up to 8, and
    no more than a row's 1024-weight steps) while the grid holds fewer than RUNS_TARGET_WARPS warps
    and the slots fit in static shared memory; GEMMA4_MLX_RUNS_GEOMETRY overrides it (rows=8: the
    8-row form; stages=0: runs16; bulk=0: 16-byte cp.async copies; dynamic=1: slots in dynamic
    shared memory, without bulk copies)."""
    fields = geometry_fields(RunsConfig(), RUNS_GEOMETRY_ENV)
    rows = fields.get("rows", RUNS_ROWS)
    if rows not in (8, 16):
        raise ValueError(f"{RUNS_GEOMETRY_ENV}: rows must be 8 or 16, got {rows}")
    stages = fields.get("stages", (RUNS_STAGES if kind == "gate_up" else RUNS_DENSE_STAGES) if rows == 16 else 0)
    dynamic = fields.get("dynamic", 0)
    bulk = RUNS_BULK if stages and dynamic != 1 and _arch_at_least(BULK_ARCH) else 0
    warps = runs_warps(kind, n, k, rows, stages, RUNS_DYNAMIC_LIMIT if dynamic == 1 else RUNS_SHARED_LIMIT)
    l2 = RUNS_L2_PREFETCH if rows == 16 and not stages else 0
    return replace_geometry(RunsConfig(warps, RUNS_PREFETCH, rows, l2, stages, bulk, dynamic), fields,
                            RUNS_GEOMETRY_ENV)  # fmt: skip


def dense_runs_wide(n: int, k: int) -> bool:
    """True when dense rows [n, k] give the runs kernel's default grid (GEMMA4_MLX_RUNS_GEOMETRY
    left aside, so that a geometry override never moves which rows take the kernel)
    RUNS_DENSE_MIN_WARPS warps or more."""
    warps = runs_warps("dense", n, k, RUNS_ROWS, RUNS_DENSE_STAGES)
    return _runs_sets("dense", n, RUNS_ROWS) * warps >= RUNS_DENSE_MIN_WARPS


def runs_warps(kind: str, n: int, k: int, rows: int, stages: int, limit: int = RUNS_SHARED_LIMIT) -> int:
    """Warps per row set: doubled from 1 (up to 8, and no more than a row's 1024-weight steps)
    while the grid holds fewer than RUNS_TARGET_WARPS warps and the staged slots fit in `limit`."""
    sets = _runs_sets(kind, n, rows)
    groups = math.ceil(k / 1024)  # a warp's step: 1024 weights of each of its rows
    warps = 1
    while (warps < 8 and 2 * warps <= groups and sets * warps < RUNS_TARGET_WARPS
           and 2 * warps * stages * RUNS_STAGE_BYTES <= limit):  # fmt: skip
        warps *= 2
    return warps


def _runs_sets(kind: str, n: int, rows: int) -> int:
    """Threadgroups of a runs kernel: each takes ``rows`` weight rows (half gate, half up)."""
    return math.ceil(n / (rows // 2 if kind == "gate_up" else rows))


def runs_supported(x_dtype: mx.Dtype, k: int) -> bool:
    """True when the runs kernels take this input: bf16 activations, K a multiple of 256."""
    return x_dtype == mx.bfloat16 and k > 0 and k % 256 == 0


def _runs_def(kind: str, rows: int = 8, staged: bool = False, bulk: bool = False, dynamic: bool = False) -> _KernelDef:
    """The runs kernel of one form: 8 rows, 16 rows (runs16), staged 16 rows (slots in static or
    dynamic shared memory), staged with bulk copies."""
    form = "b" if bulk else "d" if dynamic else "s" if staged else ""
    key = (Q4_0, f"runs{rows}{form}_{kind}")
    if key not in _KERNEL_DEFS:
        suffix = f"16{form}" if rows == 16 else ""
        name = {"dense": "g4_q4_0_matvec_runs", "gate_up": "g4_q4_0_gate_up_runs"}[kind] + suffix
        body = (_RUNS16_BODY_CUDA if rows == 16 else _RUNS_BODY_CUDA).replace("@GU@", "1" if kind == "gate_up" else "0")
        body = body.replace("@LOOP@", _RUNS16B_LOOP if bulk else _RUNS16D_LOOP if dynamic else
                            _RUNS16S_LOOP if staged else _RUNS16_LOOP)  # fmt: skip
        header = prelude("cuda") + _MMA_HEADER_CUDA + _RUNS_HEADER_CUDA
        if rows == 16:
            header += _RUNS16_HEADER_CUDA + (_STREAM_CP_ASYNC_CUDA + _RUNS16S_HEADER_CUDA if staged else "")
            header += _RUNS16B_HEADER_CUDA if bulk else ""
        params = (("T", "NW", "STG") if staged else ("T", "NW", "L2P")) if rows == 16 else ("T", "NW", "PF")
        _KERNEL_DEFS[key] = _KernelDef(name, kind, Q4_0, ("x", "wq"), ("out",), params,
                                       {"metal": ("", ""), "cuda": (header, body)})  # fmt: skip
    return _KERNEL_DEFS[key]


def plan_runs(kind: str, n: int, k: int, config: RunsConfig | None = None) -> LaunchPlan:
    """Launch plan of a CUDA runs kernel for one token; ``n`` is N (dense) or F (gate_up)."""
    if k % 256:
        raise ValueError(f"runs kernels: K={k} is not a multiple of 256")
    cfg = config or default_runs_config(kind, n, k)
    threads = 32 * cfg.warps
    sets = _runs_sets(kind, n, cfg.rows)
    template = [("T", "bfloat16"), ("NW", cfg.warps)]
    if cfg.rows == 16:
        template += [("STG", cfg.stages)] if cfg.stages else [("L2P", cfg.l2_prefetch)]
    else:
        template += [("PF", cfg.prefetch)]
    return LaunchPlan(template, (sets * threads, 1, 1), (threads, 1, 1), (1, n))


MMA_ARCH = 80
"""Compute capability (major * 10 + minor) that bf16 mma.sync and cp.async need (the runs, stream
and tensor-core kernels): below it Q4_0 takes the f32-FMA kernels."""
BULK_ARCH = 90
"""Compute capability of the bulk copies and mbarrier transaction counts (Hopper): the staged runs
kernels fill their slots with 16-byte cp.async below it, and the runs16m kernels are off."""


def _arch_at_least(arch: int) -> bool:
    """The CUDA device has compute capability >= arch (an unreported one, 0, counts as the H200
    these defaults were measured on)."""
    have = cuda_arch()
    return have == 0 or have >= arch


def _use_runs(x_dtype: mx.Dtype, k: int, family: str) -> bool:
    """A runs kernel for this Q4_0 call? (families "gate_up_runs" for a dense MLP's one-token
    gate|up, and "quant_matvec_runs" for one-token dense rows wide enough (dense_runs_wide), CUDA
    defaults; "quant_matvec_runs_m" for 2..8 tokens, dense or gate|up, a CUDA default since session
    16, on Hopper only)"""
    arch = BULK_ARCH if family == "quant_matvec_runs_m" else MMA_ARCH
    return backend() == "cuda" and runs_supported(x_dtype, k) and use_kernel(family) and _arch_at_least(arch)


def _use_tiles(x_dtype: mx.Dtype, k: int) -> bool:
    """A tiles kernel (custom_kernels.quant_tiles) for this one-token Q4_0 call? Family
    "quant_matvec_tiles" on (a CUDA default), CUDA on Hopper, bf16 x, K a multiple of 256 in
    [TILES_MIN_K, TILES_MAX_K] (31B q|k|v and gate|up, 12B's projections but FFN down, 26B-A4B's
    o_proj). (The
    kernels take 1..8 tokens, but at M = 8 they were slower than the runs16m kernels on the H200:
    every warp reads its tokens' x from L2, bench/NOTES.md session 23.)"""
    return (backend() == "cuda" and use_kernel("quant_matvec_tiles") and _arch_at_least(BULK_ARCH)
            and _tiles.tiles_supported(x_dtype, k) and _tiles.TILES_MIN_K <= k <= _tiles.TILES_MAX_K)  # fmt: skip


def launch_dense_runs(x: mx.array, blocks: mx.array, n: int, config: RunsConfig | None = None,
                      init_value: float | None = None, out_shape: tuple[int, ...] | None = None) -> mx.array:  # fmt: skip
    """CUDA runs kernel, Q4_0: bf16 x [..., K] holding one token @ blocks [N, ...].T -> [1, N] (or
    out_shape; CUDA builds only)."""
    return _launch_runs("dense", x, blocks, n, n, config, init_value, out_shape)


def launch_gate_up_runs(x: mx.array, blocks: mx.array, f: int, config: RunsConfig | None = None,
                        init_value: float | None = None, out_shape: tuple[int, ...] | None = None) -> mx.array:  # fmt: skip
    """CUDA runs kernel for a dense fused gate|up, Q4_0: bf16 x [..., K] holding one token, blocks
    [2F, ...] (gate rows, then up rows) -> gelu_tanh(gate) * up [1, F] (or out_shape)."""
    return _launch_runs("gate_up", x, blocks, 2 * f, f, config, init_value, out_shape)


def _launch_runs(kind: str, x: mx.array, blocks: mx.array, rows: int, n: int, config, init_value, out_shape):
    _need_bf16(x)
    _check_dense(x, blocks, Q4_0, rows)
    if math.prod(x.shape[:-1]) != 1:
        raise ValueError(f"the runs kernels take one token, got x of shape {x.shape}")
    cfg = config or default_runs_config(kind, n, x.shape[-1])
    kdef = _runs_def(kind, cfg.rows, cfg.stages > 0, cfg.bulk == 1, cfg.dynamic == 1)
    return _run(kdef, [x, blocks], plan_runs(kind, n, x.shape[-1], cfg), x.dtype, init_value, out_shape,
                runs_dynamic_bytes(cfg))  # fmt: skip


def runs_dynamic_bytes(cfg: RunsConfig) -> int:
    """Dynamic shared memory a runs kernel launch needs (its staged slots when cfg.dynamic, else 0)."""
    return cfg.warps * cfg.stages * RUNS_STAGE_BYTES if cfg.dynamic else 0


# --------------------------------------------------------------------------------------------
# Dispatch (public API)
# --------------------------------------------------------------------------------------------


def quant_matvec(x: mx.array, blocks: mx.array, ggml_type: int, n: int) -> mx.array:
    """x [..., K] (bf16/f32/f16) times raw GGUF weight blocks [N, ...] transposed -> [..., N].

    Custom kernel on Metal/CUDA when the flattened row count is 1..8, else the reference.
    """
    _check_dense(x, blocks, ggml_type, n)
    route = _dense_route(x, ggml_type, n)
    if route == "reference":
        return matvec_reference(x, blocks, ggml_type, n)
    # every dense kernel reads K from x's last dimension and writes its rows flat: x goes in
    # unreshaped and the output comes out in the caller's shape (no reshape nodes)
    out_shape = (*x.shape[:-1], n)
    if route == "tiles":
        return _tiles.launch_dense_tiles(x, blocks, n, out_shape=out_shape)
    if route == "runs":
        return launch_dense_runs(x, blocks, n, out_shape=out_shape)
    if route == "runs_m":
        return launch_dense_runs_m(x, blocks, n, out_shape=out_shape)
    if route == "stream":
        return launch_dense_stream(x, blocks, n, out_shape=out_shape)
    if route == "mma":
        return launch_dense_mma(x, blocks, n, out_shape=out_shape)
    return launch_dense(x, blocks, ggml_type, n, out_shape=out_shape)


def _dense_route(x: mx.array, ggml_type: int, n: int) -> str:
    """What quant_matvec runs for x [..., K]: "reference" (kernels off, or not 1..8 rows), "tiles",
    "runs", "runs_m", "stream", "mma" (Q4_0 on CUDA) or "fma" (the f32-FMA dense kernel: every
    type, both backends)."""
    k, m = x.shape[-1], math.prod(x.shape[:-1])
    if not use_kernel("quant_matvec") or not 1 <= m <= MAX_ROWS:
        return "reference"
    if ggml_type == Q4_0 and m == 1 and _use_tiles(x.dtype, k):
        return "tiles"
    if ggml_type == Q4_0 and m == 1 and _use_runs(x.dtype, k, "quant_matvec_runs") and dense_runs_wide(n, k):
        return "runs"
    if ggml_type == Q4_0 and m > 1 and _use_runs(x.dtype, k, "quant_matvec_runs_m"):
        return "runs_m"
    if ggml_type == Q4_0 and _use_stream(x.dtype, k, m):
        return "stream"
    if ggml_type == Q4_0 and m >= MMA_MIN_ROWS and x.dtype == mx.bfloat16 and backend() == "cuda" and _arch_at_least(MMA_ARCH):
        return "mma"
    return "fma"


def quant_matvec_gelu_mul(x: mx.array, blocks: mx.array, ggml_type: int, n: int, mul: mx.array) -> mx.array:
    """gelu_tanh(x @ W.T) * mul: x [..., K], raw GGUF blocks [N, ...], mul [..., N] in x.dtype ->
    [..., N] in x.dtype. One launch (op family "matvec_gelu_mul", on by default on CUDA) where
    quant_matvec would run the f32-FMA dense kernel on Q4_0 / Q8_0 blocks (E4B's per-layer-input
    gate: one token on CUDA, 1..8 on Metal), the product in f32 and rounded once (not bit-identical
    to the two-node form, which rounds y and each step of gelu to x.dtype); else quant_matvec, then
    the product."""
    _check_dense(x, blocks, ggml_type, n)
    lead = x.shape[:-1]
    if tuple(mul.shape) != (*lead, n) or mul.dtype != x.dtype:
        raise ValueError(f"mul must be {(*lead, n)} in {x.dtype} (x's lead dims and dtype), got {mul.shape} {mul.dtype}")
    if ggml_type in (Q4_0, Q8_0) and use_kernel("matvec_gelu_mul") and _dense_route(x, ggml_type, n) == "fma":
        return launch_dense_gelu_mul(x, blocks, ggml_type, n, mul, out_shape=(*lead, n))
    return gelu_tanh(quant_matvec(x, blocks, ggml_type, n)) * mul


def gate_up(x: mx.array, blocks: mx.array, ggml_type: int, f: int, one_expert: mx.array | None = None) -> mx.array:
    """Dense fused gate/up (an MLP's gate_proj and up_proj stored as one matrix): x [..., K],
    Q4_0 / Q8_0 blocks [2F, ...] whose rows 0..F-1 are gate and F..2F-1 up -> gelu_tanh(gate) * up
    [..., F] in x.dtype. With family quant_matvec_tiles on (a CUDA default), one bf16 token with
    Q4_0 blocks on Hopper and K in its range takes its kernel (custom_kernels.quant_tiles). Other
    single rows on a GPU: the expert gate/up kernel with the matrix as the only expert (one
    launch, f32 product rounded once), split K on CUDA (H200 31B step: 97 -> 82 us against the
    stream kernel); for Q4_0 on CUDA with bf16 x and K a multiple of 256 the runs
    kernel instead (family gate_up_runs; its staged 16-row form: 31B 102 -> 62 us, E4B 37-45 ->
    17.5 us per layer). 2..8 rows of bf16 x with Q4_0 blocks on CUDA (family quant_matvec_runs_m):
    the runs16m kernel (one launch, f32 product rounded once; 31B at M = 8: 123 -> 51.5 us). Other
    2..8-row calls: the dense kernel over all 2F rows, then the product in f32 from its x.dtype
    outputs (the expert kernel would re-read the weights per row: 504 us vs 88 us for three ops at
    the 31B shape, M = 8). Else the reference. ``one_expert``: the same
    blocks as [1, 2F, row_bytes], evaluated (a caller that keeps it spares the step an expand node)."""
    k = _check_dense(x, blocks, ggml_type, 2 * f)
    if one_expert is not None and one_expert.shape != (1, *blocks.shape):
        raise ValueError(f"one_expert must be blocks as [1, {', '.join(map(str, blocks.shape))}], got {one_expert.shape}")
    if ggml_type not in (Q4_0, Q8_0):
        raise ValueError(f"gate_up: Q4_0 or Q8_0 blocks only, got GGML type {ggml_type}")
    lead = x.shape[:-1]
    m = math.prod(lead)
    if not use_kernel("quant_matvec") or not 1 <= m <= MAX_ROWS:
        return gate_up_reference(x, blocks, ggml_type, f)
    if m == 1 and ggml_type == Q4_0 and _use_tiles(x.dtype, k):
        return _tiles.launch_gate_up_tiles(x, blocks, f, out_shape=(*lead, f))
    if m > 1 and ggml_type == Q4_0 and _use_runs(x.dtype, k, "quant_matvec_runs_m"):
        return launch_gate_up_runs_m(x, blocks, f, out_shape=(*lead, f))
    if m > 1:
        gu = quant_matvec(x, blocks, ggml_type, 2 * f).astype(mx.float32)
        return (gelu_tanh(gu[..., :f]) * gu[..., f:]).astype(x.dtype)
    if ggml_type == Q4_0 and _use_runs(x.dtype, k, "gate_up_runs"):
        return launch_gate_up_runs(x, blocks, f, out_shape=(*lead, f))
    experts = blocks[None] if one_expert is None else one_expert
    if use_kernel("gate_up_split"):  # CUDA_ONLY: Metal keeps the unsplit kernel unless opted in
        return launch_gate_up(x, _ONE_EXPERT, experts, ggml_type, f, gate_up_split_config(),
                              out_shape=(*lead, f))  # fmt: skip
    return _gate_up(x.reshape(m, k), _ONE_EXPERT, experts, ggml_type, f).reshape(*lead, f)


GATE_UP_SPLIT_GEOMETRY_ENV = "GEMMA4_MLX_GATE_UP_SPLIT_GEOMETRY"


def gate_up_split_config() -> KernelConfig:
    """Geometry of a dense gate|up at M = 1 through the f32-FMA gate/up kernel with split K (op
    family "gate_up_split"): R = 2 gate + 2 up rows per row set, 4 warps sharing it, like the dense
    M = 1 default; GEMMA4_MLX_GATE_UP_SPLIT_GEOMETRY overrides its fields."""
    return geometry_override(KernelConfig(2, 4, 2, 0, 4), GATE_UP_SPLIT_GEOMETRY_ENV)


_ONE_EXPERT = mx.array([[0]], dtype=mx.int32)  # ids [1, 1] of gate_up's one-row call: a constant, not a node per call


def q4_0_matvec(x: mx.array, blocks: mx.array, n: int) -> mx.array:
    """x [..., K] @ Q4_0 weight [N, K].T; blocks uint8 [N, K // 32 * 18] -> [..., N], x.dtype."""
    return quant_matvec(x, blocks, Q4_0, n)


def q8_0_matvec(x: mx.array, blocks: mx.array, n: int) -> mx.array:
    """x [..., K] @ Q8_0 weight [N, K].T; blocks uint8 [N, K // 32 * 34] -> [..., N], x.dtype."""
    return quant_matvec(x, blocks, Q8_0, n)


def q6_k_matvec(x: mx.array, blocks: mx.array, n: int) -> mx.array:
    """x [..., K] @ Q6_K weight [N, K].T (e.g. the tied head); blocks uint8 [N, K // 256 * 210]."""
    return quant_matvec(x, blocks, Q6_K, n)


def _gather(x, ids, blocks, ggml_type, n):
    _check_gather(x, ids, blocks, ggml_type, n)
    if not use_kernel("quant_matvec") or not 1 <= _pairs(x, ids)[0] <= MAX_ROWS:
        return matvec_gather_reference(x, ids, blocks, ggml_type, n)
    if ggml_type == Q4_0 and _use_stream(x.dtype, x.shape[-1]):
        return launch_gather_stream(x, ids, blocks, n)
    return launch_gather(x, ids, blocks, ggml_type, n)


def q4_0_matvec_gather(x: mx.array, ids: mx.array, blocks: mx.array, n: int) -> mx.array:
    """Experts: x [..., K] or [..., k, K], ids int32 [..., k], Q4_0 blocks [E, N, K // 32 * 18] -> [..., k, N]."""
    return _gather(x, ids, blocks, Q4_0, n)


def q8_0_matvec_gather(x: mx.array, ids: mx.array, blocks: mx.array, n: int) -> mx.array:
    """Experts: x [..., K] or [..., k, K], ids int32 [..., k], Q8_0 blocks [E, N, K // 32 * 34] -> [..., k, N]."""
    return _gather(x, ids, blocks, Q8_0, n)


def _gate_up(x, ids, blocks, ggml_type, f):
    _check_gather(x, ids, blocks, ggml_type, 2 * f)
    _check_gate_up(x, ids)
    if not use_kernel("quant_matvec") or not 1 <= _pairs(x, ids)[0] <= MAX_ROWS:
        return gate_up_gather_reference(x, ids, blocks, ggml_type, f)
    if ggml_type == Q4_0 and _use_stream(x.dtype, x.shape[-1]):
        return launch_gate_up_stream(x, ids, blocks, f)
    return launch_gate_up(x, ids, blocks, ggml_type, f)


def q4_0_gate_up_gather(x: mx.array, ids: mx.array, blocks: mx.array, f: int) -> mx.array:
    """Fused expert gate/up: x [..., K], ids [..., k], Q4_0 ``ffn_gate_up_exps`` blocks [E, 2F, ...]
    -> gelu_tanh(gate) * up [..., k, F], x.dtype."""
    return _gate_up(x, ids, blocks, Q4_0, f)


def q8_0_gate_up_gather(x: mx.array, ids: mx.array, blocks: mx.array, f: int) -> mx.array:
    """Fused expert gate/up on Q8_0 blocks [E, 2F, K // 32 * 34] -> [..., k, F], x.dtype."""
    return _gate_up(x, ids, blocks, Q8_0, f)


def _moe_down(x, ids, weights, blocks, ggml_type, n):
    _check_gather(x, ids, blocks, ggml_type, n)
    _check_moe_down(x, ids, weights)
    if not use_kernel("quant_matvec") or not 1 <= _pairs(x, ids)[0] <= MAX_ROWS:
        return moe_down_reference(x, ids, weights, blocks, ggml_type, n)
    if ggml_type == Q4_0 and _use_stream(x.dtype, x.shape[-1]):
        return launch_down_sum_stream(x, ids, weights, blocks, n)
    per_slot = launch_gather(x, ids, blocks, ggml_type, n).astype(mx.float32)
    return (per_slot * weights.astype(mx.float32)[..., None]).sum(axis=-2).astype(x.dtype)


def q4_0_moe_down(x: mx.array, ids: mx.array, weights: mx.array, blocks: mx.array, n: int) -> mx.array:
    """MoE down projection fused with the router-weighted sum over the k slots: x [..., k, K] (one
    row per slot, e.g. gelu(gate) * up), ids int32 [..., k], weights [..., k], Q4_0 blocks [E, N, K //
    32 * 18] -> sum_s weights[m, s] * W[ids[m, s]] @ x[m, s], [..., N] in x.dtype (f32 sums, one rounding).
    One launch on CUDA (stream kernel, bf16); elsewhere the gathered kernel then the weighted sum."""
    return _moe_down(x, ids, weights, blocks, Q4_0, n)


def q8_0_moe_down(x: mx.array, ids: mx.array, weights: mx.array, blocks: mx.array, n: int) -> mx.array:
    """q4_0_moe_down on Q8_0 blocks [E, N, K // 32 * 34]: the gathered kernel, then the weighted sum
    of its f32-cast per-slot outputs."""
    return _moe_down(x, ids, weights, blocks, Q8_0, n)


# --------------------------------------------------------------------------------------------
# Emulator / compile-test registry (see custom_kernels.registry)
# --------------------------------------------------------------------------------------------


def random_blocks(rng: np.random.Generator, ggml_type: int, lead: tuple[int, ...], k: int) -> np.ndarray:
    """Fresh random GGUF blocks uint8 [*lead, row_bytes]: random payload bytes, nonzero finite
    fp16 scales of either sign (every byte pattern of the payload is a valid weight)."""
    f = _fmt(ggml_type)
    nb = k // f.block_weights
    raw = rng.integers(0, 256, size=(*lead, nb, f.block_bytes), dtype=np.uint8)
    mag = np.abs(rng.standard_normal(size=(*lead, nb))) * 0.02 + 0.002
    sign = np.where(rng.random(size=(*lead, nb)) < 0.5, -1.0, 1.0)
    scale = 0.02 if ggml_type == Q6_K else 1.0  # Q6_K: d * int8 scale * q
    d = (mag * sign * scale).astype(np.float16).view(np.uint8).reshape(*lead, nb, 2)
    at = 208 if ggml_type == Q6_K else 0
    raw[..., at : at + 2] = d
    if ggml_type == Q6_K:  # nonzero int8 sub-block scales, so no 16-weight group is all zeros
        sc = rng.integers(1, 128, size=(*lead, nb, 16)) * np.where(rng.random((*lead, nb, 16)) < 0.5, -1, 1)
        raw[..., 192:208] = sc.astype(np.int8).view(np.uint8)
    return raw.reshape(*lead, nb * f.block_bytes)


def dequantize_f64(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    """Test oracle: numpy dequantization (gguf-py) of uint8 blocks [..., bytes] -> float64 [..., K]."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(np.ascontiguousarray(blocks), GGMLQuantizationType(ggml_type)).astype(np.float64)


def _gelu_tanh_f64(v: np.ndarray) -> np.ndarray:
    return 0.5 * v * (1.0 + np.tanh(0.7978845608028654 * (v + 0.044715 * v**3)))


def _activations(rng: np.random.Generator, shape, dtype_name: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """(array as handed to a kernel harness, its exact float64 values, input_dtypes entry)."""
    from .registry import bf16_to_f32, f32_to_bf16

    v = rng.standard_normal(size=shape).astype(np.float32)
    if dtype_name == "bfloat16":
        bits = f32_to_bf16(v)
        return bits, bf16_to_f32(bits).astype(np.float64), {"x": "bfloat16"}
    if dtype_name == "float16":
        h = v.astype(np.float16)
        return h, h.astype(np.float64), {}
    return v, v.astype(np.float64), {}


def _tolerances(dtype_name: str, scale: float) -> tuple[float, float]:
    """(rtol, atol): f32 accumulation error relative to sum |x||w|, plus output rounding."""
    rtol = {"float32": 1e-5, "bfloat16": 4e-3, "float16": 1e-3}[dtype_name]
    return rtol, 1e-5 * scale


def _dense_case(rng, ggml_type, dtype_name, m, n, k, config, gelu_mul=False):
    """A dense kernel's case; gelu_mul: its gelu_tanh(y) * mul form (mul [M, N], activation dtype)."""
    from .registry import KernelCase

    x, x64, in_dt = _activations(rng, (m, k), dtype_name)
    wq = random_blocks(rng, ggml_type, (n,), k)
    w64 = dequantize_f64(wq, ggml_type)
    y = x64 @ w64.T
    y_mag = np.abs(x64) @ np.abs(w64).T  # bounds the f32 accumulation error of y
    inputs, expected, scale = {"x": x, "wq": wq}, y, y_mag
    if gelu_mul:
        inputs["mul"], mul64, mul_dt = _activations(rng, (m, n), dtype_name)
        if mul_dt:
            in_dt = {**in_dt, "mul": mul_dt["x"]}
        expected, scale = _gelu_tanh_f64(y) * mul64, (np.abs(y) + y_mag) * np.abs(mul64)
    rtol, atol = _tolerances(dtype_name, float(scale.max()))
    plan = plan_launch(ggml_type, "dense", dtype_name, m, n, k, config=config)
    return KernelCase(
        inputs=inputs, template=plan.template, grid=plan.grid,
        threadgroup=plan.threadgroup, output_shapes=[plan.output_shape], output_dtypes=[dtype_name],
        expected=[expected], rtol=rtol, atol=atol, input_dtypes=in_dt,
        label=f"{'gelu_mul ' if gelu_mul else ''}{dtype_name} M={m} N={n} K={k} {config}",
    )  # fmt: skip


def _gather_case(rng, ggml_type, kind, dtype_name, m, slots, experts, n, k, x_per_pair, config, lead=None):
    """lead: the M tokens' lead dims of ids / x / out when not (M,) (the kernels read the slot count
    from ids' last dimension)."""
    from .registry import KernelCase

    rows = 2 * n if kind == "gate_up" else n
    x, x64, in_dt = _activations(rng, (m * slots if x_per_pair else m, k), dtype_name)
    ids = np.stack([rng.permutation(experts)[:slots] for _ in range(m)]).astype(np.int32)
    wq = random_blocks(rng, ggml_type, (experts, rows), k)
    w64 = dequantize_f64(wq, ggml_type)[ids]  # [M, k, rows, K]
    xs = x64.reshape(m, slots, k) if x_per_pair else np.broadcast_to(x64[:, None, :], (m, slots, k))
    full = np.einsum("msnk,msk->msn", w64, xs)
    mag = np.einsum("msnk,msk->msn", np.abs(w64), np.abs(xs))
    if kind == "gate_up":
        g, u, sg, su = full[..., :n], full[..., n:], mag[..., :n], mag[..., n:]
        expected = _gelu_tanh_f64(g) * u
        scale = float(((np.abs(g) + sg) * (np.abs(u) + su)).max())
    else:
        expected, scale = full, float(mag.max())
    rtol, atol = _tolerances(dtype_name, scale)
    plan = plan_launch(ggml_type, kind, dtype_name, m, n, k, slots, x_per_pair, config)
    lead = lead or (m,)
    ids, expected = ids.reshape(*lead, slots), expected.reshape(*lead, slots, n)
    x = x.reshape(*lead, *((slots,) if x_per_pair else ()), k)
    return KernelCase(
        inputs={"x": x, "ids": ids, "wq": wq}, template=plan.template, grid=plan.grid,
        threadgroup=plan.threadgroup, output_shapes=[expected.shape], output_dtypes=[dtype_name],
        expected=[expected], rtol=rtol, atol=atol, input_dtypes=in_dt,
        label=f"{dtype_name} lead={lead} k={slots} E={experts} N={n} K={k} xpp={x_per_pair} {config}",
    )  # fmt: skip


def _cases(ggml_type: int, kind: str):
    """Small launches covering every template knob, odd N (not a multiple of R*NSG), K tails."""

    def make(rng: np.random.Generator):
        c = KernelConfig
        if kind == "dense" and ggml_type == Q6_K:
            return [
                _dense_case(rng, ggml_type, "float32", 1, 13, 512, c(4, 2, 2)),
                _dense_case(rng, ggml_type, "bfloat16", 3, 9, 256, c(2, 1, 2)),
                _dense_case(rng, ggml_type, "float32", 8, 11, 768, c(4, 1, 2)),
            ]
        if kind == "dense":
            return [
                _dense_case(rng, ggml_type, "float32", 1, 13, 96, c(4, 2, 2)),
                _dense_case(rng, ggml_type, "bfloat16", 2, 21, 1056, c(4, 2, 1)),
                _dense_case(rng, ggml_type, "float32", 5, 7, 160, c(3, 1, 4)),
                _dense_case(rng, ggml_type, "bfloat16", 8, 9, 64, c(2, 2, 4)),
            ]
        return [
            _gather_case(rng, ggml_type, kind, "float32", 1, 3, 5, 11, 96, False, c(4, 2, 2)),
            _gather_case(rng, ggml_type, kind, "bfloat16", 2, 2, 4, 7, 160, kind == "gather", c(2, 1, 4), (2, 1)),
            _gather_case(rng, ggml_type, kind, "float32", 3, 2, 6, 9, 1056, False, c(4, 1, 1), (1, 3)),
        ]

    return make


def _variant_cases(ggml_type: int, in_place: bool, k_split: bool):
    """The dense kernel's in-place decode and/or split-K variants: every lanes-per-block split,
    M = 1..8, odd N, K tails (split-K: runs of blocks that end inside a split, rows past N in a
    threadgroup's last row set, more (row, m) sums than lanes)."""

    def make(rng: np.random.Generator):
        def c(r, nsg, lpb, ks):
            return KernelConfig(r, nsg, lpb, int(in_place), ks if k_split else 1)

        return [
            _dense_case(rng, ggml_type, "float32", 1, 13, 1056, c(2, 2, 2, 2)),
            _dense_case(rng, ggml_type, "bfloat16", 1, 21, 1056, c(4, 4, 1, 4)),
            _dense_case(rng, ggml_type, "float32", 5, 7, 800, c(3, 2, 4, 2)),
            _dense_case(rng, ggml_type, "bfloat16", 8, 9, 320, c(2, 2, 4, 2)),
            _dense_case(rng, ggml_type, "float32", 8, 11, 2080, c(5, 8, 2, 8)),
        ]

    return make


def _gelu_mul_cases(ggml_type: int, k_split: bool):
    """The dense kernel with the gelu_tanh(y) * mul epilogue, plain or split K: M = 1..8, odd N,
    K tails, f32 and bf16, rows past N in a last row set."""

    def make(rng: np.random.Generator):
        def c(r, nsg, lpb, ks):
            return KernelConfig(r, nsg, lpb, 0, ks if k_split else 1)

        return [
            _dense_case(rng, ggml_type, "bfloat16", 1, 21, 2560, c(2, 4, 2, 4), True),
            _dense_case(rng, ggml_type, "float32", 1, 13, 1056, c(4, 2, 2, 2), True),
            _dense_case(rng, ggml_type, "bfloat16", 5, 7, 800, c(3, 2, 4, 2), True),
            _dense_case(rng, ggml_type, "float32", 8, 11, 320, c(2, 8, 4, 8), True),
        ]

    return make


def _gate_up_split_cases(ggml_type: int):
    """The split-K gate/up kernel: one expert (the dense M = 1 use), several tokens and experts,
    runs of blocks ending inside a split, odd F."""

    def make(rng: np.random.Generator):
        c = KernelConfig
        return [
            _gather_case(rng, ggml_type, "gate_up", "bfloat16", 1, 1, 1, 13, 1056, False, c(2, 4, 2, 0, 4)),
            _gather_case(rng, ggml_type, "gate_up", "float32", 2, 3, 5, 7, 800, False, c(3, 2, 4, 0, 2), (1, 2)),
            _gather_case(rng, ggml_type, "gate_up", "float32", 1, 1, 1, 37, 2080, False, c(5, 8, 1, 0, 8)),
        ]

    return make


def _mma_case(rng, m, n, k, config):
    from .registry import KernelCase

    x, x64, in_dt = _activations(rng, (m, k), "bfloat16")
    wq = random_blocks(rng, Q4_0, (n,), k)
    w64 = dequantize_f64(wq, Q4_0)
    scale = float((np.abs(x64) @ np.abs(w64).T).max())
    rtol, atol = _tolerances("bfloat16", scale)
    plan = plan_mma(m, n, config)
    return KernelCase(
        inputs={"x": x, "wq": wq}, template=plan.template, grid=plan.grid, threadgroup=plan.threadgroup,
        output_shapes=[plan.output_shape], output_dtypes=["bfloat16"], expected=[x64 @ w64.T],
        rtol=rtol, atol=atol, input_dtypes=in_dt, label=f"bfloat16 M={m} N={n} K={k} {config}",
    )  # fmt: skip


def _mma_cases(rng: np.random.Generator):
    return [_mma_case(rng, 2, 37, 96, MmaConfig(1, 2)), _mma_case(rng, 8, 70, 1056, MmaConfig(2, 4)),
            _mma_case(rng, 5, 33, 160, MmaConfig(4, 1))]  # fmt: skip


def _stream_case(rng, kind, m, n, k, slots, experts, x_per_pair, config, lead=None):
    """A bf16 case of a stream kernel: dense (the mma case's numbers) or gathered (the FMA's)."""
    if kind == "dense":
        case = _mma_case(rng, m, n, k, None)
        plan = plan_stream("dense", m, n, k, config=config)
    else:
        case = _gather_case(rng, Q4_0, kind, "bfloat16", m, slots, experts, n, k, x_per_pair, KernelConfig(), lead)
        plan = plan_stream(kind, m, n, k, slots, x_per_pair, config)
    return dataclasses.replace(case, template=plan.template, grid=plan.grid, threadgroup=plan.threadgroup,
                             label=f"{kind} M={m} N={n} K={k} CH={stream_copy_width(row_bytes(Q4_0, k))} {config}")


def _down_sum_case(rng, m, slots, experts, n, k, config, lead=None):
    from .registry import KernelCase

    x, x64, in_dt = _activations(rng, (m * slots, k), "bfloat16")
    ids = np.stack([rng.permutation(experts)[:slots] for _ in range(m)]).astype(np.int32)
    wts = rng.random((m, slots)).astype(np.float32)
    wq = random_blocks(rng, Q4_0, (experts, n), k)
    w64 = dequantize_f64(wq, Q4_0)[ids]  # [M, k, N, K]
    xs = x64.reshape(m, slots, k)
    expected = np.einsum("ms,msnk,msk->mn", wts.astype(np.float64), w64, xs)
    scale = float(np.einsum("ms,msnk,msk->mn", wts.astype(np.float64), np.abs(w64), np.abs(xs)).max())
    rtol, atol = _tolerances("bfloat16", scale)
    plan = plan_stream("down_sum", m, n, k, slots, True, config)
    lead = lead or (m,)
    x, ids, wts = x.reshape(*lead, slots, k), ids.reshape(*lead, slots), wts.reshape(*lead, slots)
    expected = expected.reshape(*lead, n)
    return KernelCase(
        inputs={"x": x, "ids": ids, "wts": wts, "wq": wq}, template=plan.template, grid=plan.grid,
        threadgroup=plan.threadgroup, output_shapes=[expected.shape], output_dtypes=["bfloat16"],
        expected=[expected], rtol=rtol, atol=atol, input_dtypes=in_dt,
        label=f"down_sum lead={lead} k={slots} E={experts} N={n} K={k} {config}",
    )  # fmt: skip


def _stream_cases(kind: str):
    """Odd N, every copy width (K = 1024: 16-byte, 384: 8-byte, 704 and 320: 4-byte copies), a
    partial last group, M = 1..8, tiles/warps/stages/group-size variants."""

    def make(rng: np.random.Generator):
        s = StreamConfig
        if kind == "down_sum":
            return [_down_sum_case(rng, 1, 8, 10, 37, 704, s(1, 8, 2)),
                    _down_sum_case(rng, 2, 3, 5, 21, 1024, s(2, 1, 3, 16), (1, 2))]  # fmt: skip
        if kind == "dense":
            return [_stream_case(rng, kind, 1, 37, 1024, 1, 0, False, s(1, 2, 2, 32)),
                    _stream_case(rng, kind, 8, 70, 704, 1, 0, False, s(2, 2, 3)),
                    _stream_case(rng, kind, 3, 33, 384, 1, 0, False, s(1, 4, 4)),
                    _stream_case(rng, kind, 2, 19, 2816, 1, 0, False, s(1, 1, 2, 64)),
                    _stream_case(rng, kind, 1, 45, 5376, 1, 0, False, s(1, 2, 3, 16, True))]  # fmt: skip
        return [_stream_case(rng, kind, 1, 19, 1024, 4, 6, False, s(1, 2, 3, 8, True)),
                _stream_case(rng, kind, 2, 21, 320, 2, 5, kind == "gather", s(2, 1, 2), (2, 1)),
                _stream_case(rng, kind, 1, 9, 704, 3, 4, kind == "gather", s(1, 2, 4, 16))]  # fmt: skip

    return make


def _runs_case(rng, kind, n, k, config, m=1, lead=None):
    """A bf16 case of a runs kernel: one token for a RunsConfig (8- or 16-row form), m tokens (x with
    lead dims `lead` when given) for a RunsMConfig (runs16m); dense N rows, or gate|up with F = n."""
    if kind == "dense":
        case = _mma_case(rng, m, n, k, None)
    else:  # the expert gate/up case with one expert and one slot, as a dense matrix
        case = _gather_case(rng, Q4_0, "gate_up", "bfloat16", m, 1, 1, n, k, False, KernelConfig())
        case = dataclasses.replace(case, inputs={"x": case.inputs["x"], "wq": case.inputs["wq"][0]},
                                   output_shapes=[(m, n)], expected=[case.expected[0].reshape(m, n)])
    if lead is not None:
        case = dataclasses.replace(case, inputs={**case.inputs, "x": case.inputs["x"].reshape(*lead, k)})
    if isinstance(config, RunsMConfig):
        plan, shared, form = plan_runs_m(kind, m, n, k, config), runs_m_shared_bytes(config), f"runs16m M={m} "
    else:
        plan, shared, form = plan_runs(kind, n, k, config), runs_dynamic_bytes(config), ""
    return dataclasses.replace(case, template=plan.template, grid=plan.grid, threadgroup=plan.threadgroup,
                               label=f"{form}{kind} N={n} K={k} {config}", cuda_shared_memory=shared)


def _runs_cases(kind: str, rows: int = 8, staged: bool = False, bulk: int = 0, dynamic: int = 0):
    """Odd row counts (a partial last row set), one run per row (three lanes of four idle), a
    partial last group of runs (K = 2560, 5376), more warps than groups (idle warps); staged: every
    stage count, a last step of 2 runs (K = 5376), more warps than steps."""

    def make(rng: np.random.Generator):
        if staged:
            r = lambda warps, stages: RunsConfig(warps, 0, 16, 0, stages, bulk, dynamic)  # noqa: E731
            if dynamic:  # past the 48 KB of static shared memory: 8 warps x 2 slots, 4 x 4
                if kind == "dense":
                    return [_runs_case(rng, kind, 37, 5376, r(8, 2)), _runs_case(rng, kind, 16, 2560, r(4, 4)),
                            _runs_case(rng, kind, 9, 256, r(1, 2))]  # fmt: skip
                return [_runs_case(rng, kind, 11, 5376, r(8, 2)), _runs_case(rng, kind, 6, 2816, r(2, 2))]
            if kind == "dense":
                return [_runs_case(rng, kind, 37, 256, r(1, 1)), _runs_case(rng, kind, 45, 2560, r(2, 2)),
                        _runs_case(rng, kind, 16, 5376, r(1, 2)), _runs_case(rng, kind, 9, 768, r(8, 1)),
                        _runs_case(rng, kind, 24, 2816, r(1, 4)), _runs_case(rng, kind, 19, 5376, r(4, 1))]  # fmt: skip
            return [_runs_case(rng, kind, 13, 512, r(1, 1)), _runs_case(rng, kind, 6, 2560, r(2, 2)),
                    _runs_case(rng, kind, 21, 1280, r(1, 2)), _runs_case(rng, kind, 11, 5376, r(1, 3)),
                    _runs_case(rng, kind, 5, 2816, r(8, 1))]  # fmt: skip
        if rows == 16:
            r = lambda warps, l2=0: RunsConfig(warps, 0, 16, l2)  # noqa: E731
            if kind == "dense":
                return [_runs_case(rng, kind, 37, 256, r(1)), _runs_case(rng, kind, 45, 2560, r(2)),
                        _runs_case(rng, kind, 16, 5376, r(4)), _runs_case(rng, kind, 9, 768, r(8)),
                        _runs_case(rng, kind, 24, 2816, r(1)), _runs_case(rng, kind, 19, 5376, r(2, 1))]  # fmt: skip
            return [_runs_case(rng, kind, 13, 512, r(1)), _runs_case(rng, kind, 6, 2560, r(2)),
                    _runs_case(rng, kind, 21, 1280, r(4)), _runs_case(rng, kind, 11, 5376, r(1)),
                    _runs_case(rng, kind, 5, 2816, r(1, 1))]  # fmt: skip
        r = lambda warps, prefetch=0: RunsConfig(warps, prefetch, 8)  # noqa: E731
        if kind == "dense":
            return [_runs_case(rng, kind, 37, 256, r(1)), _runs_case(rng, kind, 45, 2560, r(2)),
                    _runs_case(rng, kind, 16, 5376, r(4)), _runs_case(rng, kind, 9, 768, r(8)),
                    _runs_case(rng, kind, 19, 5376, r(1, 1)), _runs_case(rng, kind, 24, 2816, r(2, 1))]  # fmt: skip
        return [_runs_case(rng, kind, 13, 512, r(1)), _runs_case(rng, kind, 6, 2560, r(2)),
                _runs_case(rng, kind, 21, 1280, r(4)), _runs_case(rng, kind, 11, 5376, r(1, 1)),
                _runs_case(rng, kind, 5, 256, r(2, 1))]  # fmt: skip

    return make


def _runs_m_cases(kind: str):
    """Every token count class (1, odd, 8; lead dims), partial last row sets and threadgroups with
    idle warps, K of one step of 2 runs (256), a last step of 2 runs (768, 5376), every stage count
    and warp count."""

    def make(rng: np.random.Generator):
        c = RunsMConfig
        if kind == "dense":
            return [_runs_case(rng, kind, 37, 5376, c(4, 2), 8), _runs_case(rng, kind, 45, 2560, c(2, 1), 1),
                    _runs_case(rng, kind, 16, 256, c(1, 3), 3), _runs_case(rng, kind, 130, 768, c(8, 4), 6, (2, 3)),
                    _runs_case(rng, kind, 9, 2816, c(1, 2), 5)]  # fmt: skip
        return [_runs_case(rng, kind, 11, 5376, c(4, 2), 8), _runs_case(rng, kind, 13, 512, c(1, 1), 2),
                _runs_case(rng, kind, 21, 768, c(2, 3), 7, (7, 1)), _runs_case(rng, kind, 70, 2560, c(8, 4), 1),
                _runs_case(rng, kind, 5, 2816, c(2, 2), 4)]  # fmt: skip

    return make


def kernel_specs():
    """KernelSpec of every kernel in this module, with small test cases (odd tails included)."""
    from .registry import KernelSpec

    specs = [KernelSpec(_MMA_DEF.name, _MMA_DEF.input_names, _MMA_DEF.output_names, "", "",
                        *_MMA_DEF.text["cuda"], _mma_cases)]  # CUDA only: no Metal text
    for kind in _STREAM_KINDS:  # CUDA only: no Metal text
        sdef = _stream_def(kind)
        specs.append(KernelSpec(sdef.name, sdef.input_names, sdef.output_names, "", "", *sdef.text["cuda"],
                                _stream_cases(kind)))  # fmt: skip
    for rows, staged, bulk, dynamic in ((8, False, 0, 0), (16, False, 0, 0), (16, True, 0, 0), (16, True, 1, 0),
                                        (16, True, 0, 1)):  # fmt: skip
        for kind in ("dense", "gate_up"):  # CUDA only: no Metal text
            rdef = _runs_def(kind, rows, staged, bulk == 1, dynamic == 1)
            specs.append(KernelSpec(rdef.name, rdef.input_names, rdef.output_names, "", "", *rdef.text["cuda"],
                                    _runs_cases(kind, rows, staged, bulk, dynamic)))  # fmt: skip
    for kind in ("dense", "gate_up"):  # CUDA only: no Metal text
        mdef = _runs_m_def(kind)
        specs.append(KernelSpec(mdef.name, mdef.input_names, mdef.output_names, "", "", *mdef.text["cuda"],
                                _runs_m_cases(kind)))  # fmt: skip
    for ggml_type, kind in _ALL_KERNELS:
        kdef = _kernel_def(ggml_type, kind)
        (mh, ms), (ch, cs) = kdef.text["metal"], kdef.text["cuda"]
        specs.append(KernelSpec(kdef.name, kdef.input_names, kdef.output_names, mh, ms, ch, cs,
                                _cases(ggml_type, kind)))  # fmt: skip
    for ggml_type in (Q4_0, Q8_0):
        for in_place, k_split in ((True, False), (False, True), (True, True)):
            kdef = _kernel_def(ggml_type, "dense", in_place, k_split)
            (mh, ms), (ch, cs) = kdef.text["metal"], kdef.text["cuda"]
            specs.append(KernelSpec(kdef.name, kdef.input_names, kdef.output_names, mh, ms, ch, cs,
                                    _variant_cases(ggml_type, in_place, k_split)))  # fmt: skip
        kdef = _kernel_def(ggml_type, "gate_up", False, True)
        (mh, ms), (ch, cs) = kdef.text["metal"], kdef.text["cuda"]
        specs.append(KernelSpec(kdef.name, kdef.input_names, kdef.output_names, mh, ms, ch, cs,
                                _gate_up_split_cases(ggml_type)))  # fmt: skip
        for k_split in (False, True):
            kdef = _kernel_def(ggml_type, "dense", False, k_split, gelu_mul=True)
            (mh, ms), (ch, cs) = kdef.text["metal"], kdef.text["cuda"]
            specs.append(KernelSpec(kdef.name, kdef.input_names, kdef.output_names, mh, ms, ch, cs,
                                    _gelu_mul_cases(ggml_type, k_split)))  # fmt: skip
    return specs


from . import quant_tiles as _tiles  # noqa: E402  (imports this module)

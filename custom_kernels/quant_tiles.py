"""Q4_0 dense rows and dense gate|up for 1..8 bf16 tokens, whole rows at a time (CUDA, Hopper).

    out = launch_dense_tiles(x, blocks, n)      # x [..., K] @ W[N, K].T -> [..., N]
    gu = launch_gate_up_tiles(x, blocks, f)     # gelu_tanh(x @ W[:F].T) * (x @ W[F:].T) -> [..., F]

Op family "quant_matvec_tiles". Kernels ``g4_q4_0_matvec_tiles`` / ``g4_q4_0_gate_up_tiles``: a
thread block takes a tile of 16 weight rows (dense: 16 consecutive rows; gate|up: 8 gate rows and
the 8 up rows of the same outputs) and copies them *whole* into shared memory: lanes 0..15 of warp
0 bulk-copy (cp.async.bulk) a row each, in NC chunks along K with a barrier per chunk, so the tile's
bytes are one contiguous stretch of the tensor (two for gate|up), read front to back. Its NW warps
take the tile's 256-weight steps in turn (warp w: steps w, w + NW, ..., each waiting for its
chunk) with the runs16m kernels' tensor-core arithmetic (tokens are mma's 8 columns, rows g and
g + 8 its A rows), and the warps' partial sums are added in warp order.

Why (bench/NOTES.md, session 23): the decode step runs its projections one call at a time, where
the runs16 kernels read the 31B FFN gate's 65 MB at 53% of copy (32 us; 22 us back to back) and a
grid-stride read probe at 86%. Their warps each walk 16 rows 288 bytes at a time, all in one wave;
whole rows front to back were the guess. Measured one call at a time it gains 2-9% at K = 3840-5376
(28% on a 12288 x 2816 matrix), not the probe's 35%: the work per weight bounds both kernels. In one
process 31B decode at 4K went from 85.4 to 90.2 tok/s with it.

Shared memory: the tile's 16 rows at a stride of an odd number of 16-byte words (the row's bytes,
plus 16 when they are an even number of words), so that lane (g, t)'s 4-byte reads of rows g = 0..7
fall in distinct banks. K must be a multiple of 256 (row bytes a multiple of 16 for the bulk copies);
rows or x off alignment take 2-byte loads (the copy by every thread, then a barrier). With
TilesConfig.bias (the default) a table of each block's x sums follows the tile, and the weights
enter the mma as 128 + q: one PRMT per pair instead of a PRMT and a subtraction, the 136 taken off
by starting each block's mma from -136 x its x sums (session 25: the 31B gate|up 53.0 -> 47.8 us).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import geometry_fields, replace_geometry
from . import quant_matvec as qm
from .dialect import prelude

__all__ = ["TilesConfig", "default_tiles_config", "tiles_supported", "tiles_row_stride", "tiles_shared_bytes",
           "plan_tiles", "launch_dense_tiles", "launch_gate_up_tiles", "kernel_specs", "TILES_SHARED_LIMIT",
           "TILES_MIN_K", "TILES_MAX_K", "tiles_launch_shared"]  # fmt: skip

TILES_SHARED_LIMIT = 110 * 1024
"""Dynamic shared memory of one tile at most: K <= 12,288 (the 31B FFN down, K = 21504, keeps the
runs kernels). Two thread blocks per SM still fit at that K with 8 warps, but only just (2 x
(110.8 KB dynamic + 4.2 KB static part_s + 1 KB reserved) of 228 KB): a larger part_s would halve
the occupancy there."""

TILES_GEOMETRY_ENV = "GEMMA4_MLX_TILES_GEOMETRY"
"""TilesConfig fields over the default, e.g. "warps=8" (tuning)."""


@dataclass(frozen=True)
class TilesConfig:
    """Warps per threadgroup (they split the tile's 256-weight steps), chunks (each row arrives
    in this many bulk copies along K, each with its own barrier: the warps start on the first) and
    bias (1: the weights enter the mma as 128 + q, one PRMT a pair instead of a PRMT and a
    subtraction, and each block's mma starts from -136 x the block's x sums, summed once per
    threadgroup into shared memory after the tile: tiles_shared_bytes).

    The default, 8 warps x 2 chunks with bias, measured on the H200 (bench/NOTES.md, session 25):
    one call at a time the 31B gate|up 53.0 -> 47.8 us and 12B's 30.8 -> 27.8 against session
    23's 8 x 4 without bias, q|k|v equal (24.5 / 24.1); in one process at 4K 31B 85.7 -> 88.3 and
    12B 134.5 -> 146.2 tok/s (medians of 3 noisy rounds). The bias form rounds differently: the
    mma sums 136 x the block's |x| more before the cancellation (f32, ~2^-17 of a block's bound)."""

    warps: int = 8
    chunks: int = 2
    bias: int = 1

    def __post_init__(self):
        if type(self.warps) is not int or self.warps not in (1, 2, 4, 8):
            raise ValueError(f"warps must be 1, 2, 4 or 8, got {self.warps!r}")
        if type(self.chunks) is not int or self.chunks not in (1, 2, 4, 8):
            raise ValueError(f"chunks must be 1, 2, 4 or 8, got {self.chunks!r}")
        if type(self.bias) is not int or self.bias not in (0, 1):
            raise ValueError(f"bias must be 0 or 1, got {self.bias!r}")


def default_tiles_config() -> TilesConfig:
    """TilesConfig() with GEMMA4_MLX_TILES_GEOMETRY's fields over it."""
    return replace_geometry(TilesConfig(), geometry_fields(TilesConfig(), TILES_GEOMETRY_ENV), TILES_GEOMETRY_ENV)


def tiles_row_stride(k: int) -> int:
    """Bytes from one row of a tile to the next in shared memory: the row's bytes, plus 16 when they
    are an even number of 16-byte words."""
    rb = qm.row_bytes(qm.Q4_0, k)
    return rb if (rb // 16) % 2 else rb + 16


def tiles_shared_bytes(k: int, m: int = 1, bias: int = 0) -> int:
    """Dynamic shared memory of a tiles launch: 16 rows at tiles_row_stride(k), then with bias the
    m tokens' f32 block sums (2 tiles_bias_pitch(m) floats a block)."""
    return 16 * tiles_row_stride(k) + (8 * tiles_bias_pitch(m) * (k // 32) if bias else 0)


def tiles_bias_pitch(m: int) -> int:
    """Tokens of the bias table (TilesConfig.bias): m rounded up to 2, 4 or 8; each block holds
    their sums twice, a lane's two tokens for both its rows in one 16-byte load."""
    return 2 if m <= 2 else 4 if m <= 4 else 8


STATIC_SHARED_LIMIT = 48 * 1024
"""A CUDA thread block's shared memory, static and dynamic together, unless the kernel's dynamic
limit is raised; MLX 0.32.4 raises it only for a launch asking more than MLX_RAISE_ABOVE bytes."""
MLX_RAISE_ABOVE = 48000


def tiles_launch_shared(k: int, config: TilesConfig, m: int = 1) -> int:
    """Dynamic shared memory to ask for: the tile (tiles_shared_bytes), or just more than
    MLX_RAISE_ABOVE when the tile is below it but with the static arrays (part_s, the chunk
    barriers) over STATIC_SHARED_LIMIT. Asked as it is, such a launch fails (cuGraphAddKernelNode:
    invalid argument; seen on the H200 in session 24 at 46,592 + 4,160 bytes; K = 5120 at 8 warps,
    46,336 + 4,128, is in that band)."""
    dynamic = tiles_shared_bytes(k, m, config.bias)
    static = 4 * config.warps * 16 * 8 + 8 * config.chunks
    return MLX_RAISE_ABOVE + 16 if dynamic <= MLX_RAISE_ABOVE and dynamic + static > STATIC_SHARED_LIMIT else dynamic


TILES_MIN_K = 3840
TILES_MAX_K = 6144
"""The model routes one-token rows to the tiles kernels for K in [TILES_MIN_K, TILES_MAX_K] only,
as measured one call at a time on the H200 (bench/NOTES.md, session 23): at K = 5376 (31B q|k|v,
gate|up) and 3840-4096 (12B gate|up, o_proj) 2-9% faster than the runs kernels; at K = 8192 (31B
o_proj) and 10240 (E4B down) 1.3-1.7x slower; at K = 2560 (E4B gate|up) slower and at 2816 (a
12288-row matrix) faster per call, but neither E4B's nor 26B-A4B's decode gained in one process
with every row up to K = 6144 on it."""


def tiles_supported(x_dtype: mx.Dtype, k: int) -> bool:
    """True when the tiles kernels take this input: bf16 activations, K a positive multiple of 256
    whose tile fits TILES_SHARED_LIMIT."""
    return x_dtype == mx.bfloat16 and k > 0 and k % 256 == 0 and tiles_shared_bytes(k) <= TILES_SHARED_LIMIT


_HEADER_CUDA = r"""
// bytes i0, i1 of v (low nibbles already masked) -> bf16x2 {128 + q0, 128 + q1}, exact
__device__ __forceinline__ uint32_t g4_q4_pair128(uint32_t v, uint32_t sel) { return __byte_perm(v, 0x43434343u, sel); }
// acc += one block's part (row g: columns 2t, 2t + 1; row g + 8: the same) scaled by the d of the
// block of rows g (p0) and g + 8 (p1)
__device__ __forceinline__ void g4_tiles_scale(float (&acc)[4], const float (&part)[4], const uint8_t* p0,
                                               const uint8_t* p1) {
  const float d0 = g4_half_bits(g4_s16(p0)), d1 = g4_half_bits(g4_s16(p1));
  acc[0] += d0 * part[0]; acc[1] += d0 * part[1]; acc[2] += d1 * part[2]; acc[3] += d1 * part[3];
}
// One 8-block step of lane (g, t) of a tiles warp: rows g (w0, in shared memory) and g + 8 (w0 + 8 RS)
// against token g's x of the step (xs, global memory, read-only path; zeros when tok is false).
// A's k pair (2t, 2t + 1) is weights 4t, 4t + 1 of a block half and (2t + 8, 2t + 9) weights 4t + 2,
// 4t + 3 (qs bytes 4t .. 4t + 3: low nibbles, then high for the second half); B takes x in that
// order. acc: (row g, token 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
// BI > 0: A holds 128 + q (the pairs' PRMT alone) and each block's mma starts from -136 x the
// block's x sums of tokens 2t, 2t + 1, twice (rows g and g + 8: bias [2 BI b], one 16-byte load),
// which takes the 136 back off.
template <int RS, int XA, int BI>
__device__ __forceinline__ void g4_tiles_step(float (&acc)[4], const uint8_t* w0, const uint8_t* xs, bool tok, int t,
                                              const float* bias) {
  _Pragma("unroll") for (int b = 0; b < 8; ++b) {
    const uint8_t* p0 = w0 + 18 * b;
    const uint8_t* p1 = p0 + 8 * RS;
    // qs bytes 4t .. 4t + 3 sit at 18 b + 2 + 4t: 4-byte aligned for odd b (RS and steps are multiples of 16)
    const uint32_t q0 = g4_s32_at(p0 + 2 + 4 * t, b & 1), q1 = g4_s32_at(p1 + 2 + 4 * t, b & 1);
    uint32_t xl0, xl1, xh0, xh1;
    g4_x8<XA>(xl0, xl1, xs + 64 * b + 8 * t, tok);
    g4_x8<XA>(xh0, xh1, xs + 64 * b + 32 + 8 * t, tok);
    const uint32_t l0 = q0 & 0x0F0F0F0Fu, l1 = q1 & 0x0F0F0F0Fu;
    const uint32_t h0 = (q0 >> 4) & 0x0F0F0F0Fu, h1 = (q1 >> 4) & 0x0F0F0F0Fu;
    if (BI) {
      const float4 c = *reinterpret_cast<const float4*>(bias + 2 * BI * b);
      float part[4] = {c.x, c.y, c.z, c.w};
      g4_mma_bf16(part, g4_q4_pair128(l0, 0x4140u), g4_q4_pair128(l1, 0x4140u), g4_q4_pair128(l0, 0x4342u),
                  g4_q4_pair128(l1, 0x4342u), xl0, xl1);
      g4_mma_bf16(part, g4_q4_pair128(h0, 0x4140u), g4_q4_pair128(h1, 0x4140u), g4_q4_pair128(h0, 0x4342u),
                  g4_q4_pair128(h1, 0x4342u), xh0, xh1);
      g4_tiles_scale(acc, part, p0, p1);
    } else {
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      g4_mma_bf16(part, g4_q4_pair(l0, 0x4140u), g4_q4_pair(l1, 0x4140u), g4_q4_pair(l0, 0x4342u),
                  g4_q4_pair(l1, 0x4342u), xl0, xl1);
      g4_mma_bf16(part, g4_q4_pair(h0, 0x4140u), g4_q4_pair(h1, 0x4140u), g4_q4_pair(h0, 0x4342u),
                  g4_q4_pair(h1, 0x4342u), xh0, xh1);
      g4_tiles_scale(acc, part, p0, p1);
    }
  }
}
"""

# Template: T (bfloat16), NW (warps), RS (tiles_row_stride(K)), NC (chunks: each row's bulk copies
# come in NC pieces along K, each with its own barrier, so the warps start on the first while the
# rest arrive), BI (TilesConfig.bias: 0, or the tokens of a block's -136 x sums in shared memory after
# the tile, 2, 4 or 8: tiles_bias_pitch). @GU@: 0 dense (rows 16 b .. 16 b + 15),
# 1 gate|up (gate rows 8 b .. 8 b + 7 and up rows F + 8 b .. -> gelu_tanh(g) * u).
_BODY_CUDA = r"""
  // gemma4-mlx q4_0 tiles kernel (CUDA tensor cores, 1..8 tokens, 16 whole rows per thread block)
  constexpr int GU = @GU@;
  const int K = x_shape[x_ndim - 1];  // x [..., K]: M = the other dimensions' product, 1..8
  int M = 1;
  for (int i = 0; i + 1 < x_ndim; ++i) M *= x_shape[i];
  const int NR = wq_shape[0];
  const int N = GU ? NR / 2 : NR;
  const int row_bytes = wq_shape[1];
  const int nsteps = K >> 8;          // steps of 8 blocks (256 weights) per row
  const int lane = (int)(threadIdx.x & 31u);
  const int warp = (int)(threadIdx.x >> 5);
  const int g = lane >> 2;
  const int t = lane & 3;
  const int out0 = (int)blockIdx.x * (GU ? 8 : 16);
  extern __shared__ __align__(16) uint8_t tile_s[];  // 16 rows, RS bytes apart, given at launch
  __shared__ __align__(8) uint64_t bars_s[NC];  // chunk c of every row: steps c spc .. (c + 1) spc - 1
  __shared__ float part_s[NW][16][8];  // each warp's sums: [tile row][token]
  // weight row of tile row r (a missing row: row 0, finite, never stored)
  auto wrow = [&](int r) -> int {
    const int o = out0 + (GU ? (r & 7) : r);
    return o < N ? (GU && r >= 8 ? N + o : o) : 0;
  };
  const int spc = (nsteps + NC - 1) / NC;  // steps per chunk
  const uint32_t bar0 = g4_shared_addr(bars_s);
  const bool bulk = (reinterpret_cast<uintptr_t>(wq) & 15u) == 0;
  if (bulk) {  // lanes 0..15 of warp 0 copy a row each, chunk by chunk
    if (threadIdx.x == 0) {
      for (int c = 0; c < NC; ++c) g4_mbar_init(bar0 + 8 * c, 1);
      g4_mbar_init_fence();
    }
    __syncthreads();
    if (warp == 0) {
      for (int c = 0; c < NC; ++c) {
        const int s0 = c * spc, s1 = min(nsteps, s0 + spc);
        if (s0 >= s1) break;
        if (lane == 0) g4_mbar_expect_tx(bar0 + 8 * c, (uint32_t)(16 * 144 * (s1 - s0)));
        __syncwarp();
        if (lane < 16) {
          g4_bulk_copy(g4_shared_addr(tile_s) + (uint32_t)(RS * lane + 144 * s0),
                       wq + (size_t)wrow(lane) * row_bytes + 144 * s0, (uint32_t)(144 * (s1 - s0)), bar0 + 8 * c);
        }
      }
    }
  } else {  // rows off 16-byte alignment: 2-byte loads by every thread
    const int hw = row_bytes >> 1;
    for (int i = (int)threadIdx.x; i < 16 * hw; i += 32 * NW) {
      const int r = i / hw, j = i - r * hw;
      reinterpret_cast<unsigned short*>(tile_s + RS * r)[j] = (unsigned short)g4_u16(wq + (size_t)wrow(r) * row_bytes + 2 * j);
    }
    __syncthreads();
  }
  const bool xa = (reinterpret_cast<uintptr_t>(x) & 7u) == 0;
  const int nblk = K >> 5;
  float* bias_s = reinterpret_cast<float*>(tile_s + 16 * RS);  // BI: [K / 32][BI / 2][4], after the tile
  if (BI) {  // -136 x each block's x sum, per token (0 past M), while the tile arrives
    constexpr int BP = BI > 0 ? BI : 1;
    for (int i = (int)threadIdx.x; i < BP * nblk; i += 32 * NW) {
      const int tk = i % BP, b = i / BP;
      const uint8_t* xb = reinterpret_cast<const uint8_t*>(x) + ((size_t)tk * K + 32 * b) * 2;
      float sum = 0.0f;
      if (tk >= M) {
      } else if ((reinterpret_cast<uintptr_t>(x) & 15u) == 0) {
        _Pragma("unroll") for (int j = 0; j < 4; ++j) {
          const uint4 v = __ldg(reinterpret_cast<const uint4*>(xb) + j);
          const uint32_t w[4] = {v.x, v.y, v.z, v.w};
          _Pragma("unroll") for (int e = 0; e < 4; ++e) sum += __uint_as_float(w[e] << 16) + __uint_as_float(w[e] & 0xFFFF0000u);
        }
      } else {
        _Pragma("unroll") for (int j = 0; j < 16; ++j) {
          const uint32_t w = g4_u16(xb + 4 * j) | (g4_u16(xb + 4 * j + 2) << 16);
          sum += __uint_as_float(w << 16) + __uint_as_float(w & 0xFFFF0000u);
        }
      }
      float* e = bias_s + 2 * BP * b + 4 * (tk >> 1) + (tk & 1);  // tokens 2j, 2j + 1, 2j, 2j + 1
      e[0] = e[2] = -136.0f * sum;
    }
    __syncthreads();
  }
  const bool tok = g < M;
  const uint8_t* xs = reinterpret_cast<const uint8_t*>(x) + (size_t)(tok ? g : 0) * K * 2;
  const uint8_t* w0 = tile_s + RS * g;
  const float* bias = bias_s + 4 * min(t, BI / 2 - 1);  // columns past BI: lower tokens' sums, never stored
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int c = 0; c < NC; ++c) {  // warp w: steps w, w + NW, ... of each chunk, once it has arrived
    const int s1 = min(nsteps, (c + 1) * spc);
    int s = c * spc;
    s += (warp - s) & (NW - 1);
    if (s >= s1) continue;
    if (bulk) g4_mbar_wait(bar0 + 8 * c, 0u);
    for (; s < s1; s += NW) {
      if (xa) {
        g4_tiles_step<RS, 1, BI>(acc, w0 + 144 * s, xs + 512 * s, tok, t, bias + 16 * BI * s);
      } else {
        g4_tiles_step<RS, 0, BI>(acc, w0 + 144 * s, xs + 512 * s, tok, t, bias + 16 * BI * s);
      }
    }
  }
  part_s[warp][g][2 * t] = acc[0];
  part_s[warp][g][2 * t + 1] = acc[1];
  part_s[warp][g + 8][2 * t] = acc[2];
  part_s[warp][g + 8][2 * t + 1] = acc[3];
  __syncthreads();
  for (int i = (int)threadIdx.x; i < (GU ? 64 : 128); i += 32 * NW) {
    const int r = i >> 3, tk = i & 7;  // tile row (gate|up: the gate row; its up row is r + 8), token
    if (tk < M && out0 + r < N) {
      float s = part_s[0][r][tk];
      for (int w = 1; w < NW; ++w) s += part_s[w][r][tk];
      if (GU) {
        float u = part_s[0][r + 8][tk];
        for (int w = 1; w < NW; ++w) u += part_s[w][r + 8][tk];
        out[(size_t)tk * N + out0 + r] = static_cast<T>(g4_gelu_tanh(s) * u);
      } else {
        out[(size_t)tk * N + out0 + r] = static_cast<T>(s);
      }
    }
  }
"""


def _tiles_def(kind: str) -> qm._KernelDef:
    """The tiles kernel for dense rows or a gate|up."""
    name = {"dense": "g4_q4_0_matvec_tiles", "gate_up": "g4_q4_0_gate_up_tiles"}[kind]
    header = (prelude("cuda") + qm._MMA_HEADER_CUDA + qm._RUNS_HEADER_CUDA + qm._RUNS16_HEADER_CUDA
              + qm._STREAM_CP_ASYNC_CUDA + qm._MBAR_BULK_CUDA + qm._RUNS16M_HEADER_CUDA + _HEADER_CUDA)  # fmt: skip
    body = _BODY_CUDA.replace("@GU@", "1" if kind == "gate_up" else "0")
    return qm._KernelDef(name, kind, qm.Q4_0, ("x", "wq"), ("out",), ("T", "NW", "RS", "NC", "BI"),
                         {"metal": ("", ""), "cuda": (header, body)})  # fmt: skip


_DEFS = {kind: _tiles_def(kind) for kind in ("dense", "gate_up")}


def plan_tiles(kind: str, m: int, n: int, k: int, config: TilesConfig | None = None) -> qm.LaunchPlan:
    """Launch plan of a tiles kernel for m tokens; ``n`` is N (dense) or F (gate_up)."""
    if kind not in _DEFS:
        raise ValueError(f"tiles kernels: kind must be 'dense' or 'gate_up', got {kind!r}")
    if k <= 0 or k % 256:
        raise ValueError(f"tiles kernels: K={k} is not a positive multiple of 256")
    if tiles_shared_bytes(k) > TILES_SHARED_LIMIT:
        raise ValueError(f"tiles kernels: a tile of K={k} needs {tiles_shared_bytes(k)} bytes of shared memory, "
                         f"over {TILES_SHARED_LIMIT}")  # fmt: skip
    if n <= 0:
        raise ValueError(f"tiles kernels: need at least one output row, got {n}")
    if not 1 <= m <= qm.MAX_ROWS:
        raise ValueError(f"the tiles kernels take 1..{qm.MAX_ROWS} tokens, got {m}")
    cfg = config or default_tiles_config()
    tiles = math.ceil(n / (8 if kind == "gate_up" else 16))
    threads = 32 * cfg.warps
    template = [("T", "bfloat16"), ("NW", cfg.warps), ("RS", tiles_row_stride(k)), ("NC", cfg.chunks),
                ("BI", tiles_bias_pitch(m) if cfg.bias else 0)]
    return qm.LaunchPlan(template, (tiles * threads, 1, 1), (threads, 1, 1), (m, n))


def launch_dense_tiles(x: mx.array, blocks: mx.array, n: int, config: TilesConfig | None = None,
                       init_value: float | None = None, out_shape: tuple[int, ...] | None = None) -> mx.array:  # fmt: skip
    """CUDA tiles kernel, Q4_0: bf16 x [..., K] holding 1..8 tokens @ blocks [N, ...].T -> [M, N]
    (or out_shape; CUDA builds of compute capability >= 90 only)."""
    return _launch("dense", x, blocks, n, n, config, init_value, out_shape)


def launch_gate_up_tiles(x: mx.array, blocks: mx.array, f: int, config: TilesConfig | None = None,
                         init_value: float | None = None, out_shape: tuple[int, ...] | None = None) -> mx.array:  # fmt: skip
    """CUDA tiles kernel for a dense fused gate|up, Q4_0: bf16 x [..., K] holding 1..8 tokens,
    blocks [2F, ...] (gate rows, then up rows) -> gelu_tanh(gate) * up [M, F] (or out_shape), the
    f32 product rounded once."""
    return _launch("gate_up", x, blocks, 2 * f, f, config, init_value, out_shape)


def _launch(kind, x, blocks, rows, n, config, init_value, out_shape):
    cfg = config or default_tiles_config()
    return qm.launch_hopper_q4_0("tiles", _DEFS[kind], x, blocks, rows,
                                 lambda: plan_tiles(kind, math.prod(x.shape[:-1]), n, x.shape[-1], cfg),
                                 tiles_launch_shared(x.shape[-1], cfg, math.prod(x.shape[:-1])), init_value, out_shape)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Compile-test registry (see custom_kernels.registry)
# --------------------------------------------------------------------------------------------


def _case(rng, kind, n, k, config, m=1, lead=None):
    """A runs-kernel case (custom_kernels.quant_matvec._runs_case: same inputs and expected values)
    launched as a tiles kernel."""
    case = qm._runs_case(rng, kind, n, k, qm.RunsMConfig(), m, lead)
    plan = plan_tiles(kind, m, n, k, config)
    return dataclasses.replace(case, template=plan.template, grid=plan.grid, threadgroup=plan.threadgroup,
                               label=f"tiles M={m} {kind} N={n} K={k} {config}",
                               cuda_shared_memory=tiles_launch_shared(k, config, m))  # fmt: skip


def _cases(kind: str):
    """Every token count class (1, odd, 8; lead dims), partial last tiles, every warp and chunk
    count, warps without a step and chunks without steps (K = 256 at 8 warps, 8 chunks), a last chunk
    shorter than the others (K = 5376: 21 steps in chunks of 6), a row stride with padding (K = 2560:
    90 words) and without (K = 768, 5376), a tile past 48 KB of shared memory (K = 6144, the largest
    the model routes there), a tile just under 48 KB whose static arrays take the block over it
    (K = 5120); the bias form at 1, 2 (K = 6144: the largest tile and its table), odd, 5 and 8
    tokens."""

    def make(rng: np.random.Generator):
        c = lambda warps, chunks, bias=0: TilesConfig(warps, chunks, bias)  # noqa: E731
        if kind == "dense":
            return [_case(rng, kind, 37, 5376, c(4, 4), 8), _case(rng, kind, 45, 2560, c(2, 1), 1),
                    _case(rng, kind, 16, 256, c(8, 8), 3), _case(rng, kind, 130, 768, c(1, 2), 6, (2, 3)),
                    _case(rng, kind, 9, 2816, c(8, 4), 1), _case(rng, kind, 19, 6144, c(8, 4), 1),
                    _case(rng, kind, 40, 5120, c(8, 4), 1), _case(rng, kind, 37, 5376, c(8, 4, 1), 1),
                    _case(rng, kind, 16, 256, c(8, 8, 1), 3), _case(rng, kind, 130, 768, c(1, 2, 1), 8, (2, 4)),
                    _case(rng, kind, 19, 6144, c(8, 4, 1), 2)]  # fmt: skip
        return [_case(rng, kind, 11, 5376, c(8, 4), 1), _case(rng, kind, 13, 512, c(1, 8), 2),
                _case(rng, kind, 21, 768, c(2, 1), 7, (7, 1)), _case(rng, kind, 70, 2560, c(8, 2), 1),
                _case(rng, kind, 5, 2816, c(4, 4), 4), _case(rng, kind, 11, 5376, c(8, 4, 1), 1),
                _case(rng, kind, 21, 768, c(2, 1, 1), 5, (5, 1))]  # fmt: skip

    return make


def kernel_specs():
    """KernelSpecs of the two tiles kernels (CUDA only: no Metal text)."""
    from .registry import KernelSpec

    return [KernelSpec(d.name, d.input_names, d.output_names, "", "", *d.text["cuda"], _cases(kind))
            for kind, d in _DEFS.items()]  # fmt: skip

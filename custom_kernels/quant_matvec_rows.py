"""Q4_0 / Q8_0 dense matvec (CUDA) that reads the weights in the order a pure read is fastest in.

Why: on the H200 (bench/NOTES.md, 2026-11-30) a kernel that only reads the 31B FFN gate's 65 MB
reaches 99.5% of copy bandwidth when each warp reads its own 4 consecutive rows front to back in
16-byte words (bench/kernels.py read probes), while q4_0_matvec (f32 FMA, 2-byte weight loads)
reaches 52.5% and the stream kernel (16 rows, a 144-byte piece of each per step) 50-54%.

Kernel: each warp owns R consecutive rows; they are contiguous in memory, and the warp walks them
in chunks of CB blocks (CB a multiple of 8, so a chunk is a whole number of 16-byte words: 8 Q4_0
blocks are 144 bytes, 8 Q8_0 blocks 272). Each lane loads its words of chunk c + 1 into registers
while the warp computes chunk c from its shared-memory stage; LPB lanes share a block, each
decoding its 32 / LPB weights with the 2^23 magic number (exact) and multiplying them with the
activations in f32 (f32 accumulation, d applied per block); a warp sum closes each row. Staging is
warp-private (no block barrier), so warps past N return at once. Needs K % 256 == 0 (chunks of
whole words); a weight pointer or row length that is not 16-byte aligned takes 2-byte loads.

CUDA only (no Metal text): like the stream kernels it is tested by nvcc on the CPU
(tests/test_metal_compile.py, through kernel_specs) and against float64 on the GPU
(tests/test_kernels_gpu.py). Opt-in as kernel family "quant_matvec_rows"
(custom_kernels.UNPROVEN_ENV) until `pytest -m gpu` has run it; dispatch then uses it at M = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import KernelSource, backend, dtype_name, use_kernel
from .dialect import prelude
from .quant_matvec import Q4_0, Q8_0, LaunchPlan, _activations, _run, _tolerances, dequantize_f64, random_blocks

__all__ = ["RowsConfig", "rows_supported", "default_rows_config", "plan_rows", "launch_dense_rows", "use_rows",
           "kernel_specs"]  # fmt: skip

FAMILY = "quant_matvec_rows"
_SHARED_LIMIT = 48 * 1024  # static shared memory per block

# Template: T (activation/output dtype), M (rows of x, 1..8), QT (GGML type: 2 Q4_0, 8 Q8_0),
# R (rows per warp), NW (warps per block), CB (blocks per chunk, % 8 == 0), LPB (lanes per block).
_ROWS_BODY_CUDA = r"""
  // gemma4-mlx rows matvec (CUDA): each warp streams its R consecutive rows front to back
  constexpr int BB = QT == 2 ? 18 : 34;  // bytes per 32-weight block
  constexpr int CW = CB * BB / 16;       // 16-byte words per chunk
  constexpr int U = (CW + 31) / 32;      // words per lane per chunk
  constexpr int WPL = 32 / LPB;          // weights per lane per block
  constexpr int BPI = 32 / LPB;          // blocks per warp pass
  __shared__ __align__(16) uint4 g4_rows_stage[NW * CW];
  const int lane = (int)(threadIdx.x & 31u);
  const int warp = (int)(threadIdx.x >> 5);
  const int K = x_shape[1];
  const int N = wq_shape[0];
  const int row_bytes = wq_shape[1];
  const int nblocks = K / 32;
  const int cpr = (nblocks + CB - 1) / CB;  // chunks per row
  const int row0 = ((int)blockIdx.x * NW + warp) * R;
  if (row0 >= N) return;  // warp-private staging: no block barrier below
  const int nchunks = min(R, N - row0) * cpr;
  uint4* stage = g4_rows_stage + warp * CW;
  const unsigned short* s16 = reinterpret_cast<const unsigned short*>(stage);
  const bool aligned = ((reinterpret_cast<size_t>(wq) | (size_t)row_bytes) & 15u) == 0;
  const int part = lane % LPB;
  uint4 v[U];
  auto fetch = [&](int c) {  // chunk c: row row0 + c / cpr, blocks CB * (c % cpr) ...
    const int b0 = CB * (c % cpr);
    const int words = min(CB, nblocks - b0) * BB / 16;
    const uint8_t* src = wq + (size_t)(row0 + c / cpr) * row_bytes + (size_t)b0 * BB;
    _Pragma("unroll") for (int u = 0; u < U; ++u) {
      const int i = lane + 32 * u;
      if (i < words) {
        if (aligned) {
          v[u] = __ldg(reinterpret_cast<const uint4*>(src) + i);
        } else {
          const unsigned short* h = reinterpret_cast<const unsigned short*>(src) + 8 * i;
          v[u] = make_uint4(__ldg(h) | ((uint32_t)__ldg(h + 1) << 16), __ldg(h + 2) | ((uint32_t)__ldg(h + 3) << 16),
                            __ldg(h + 4) | ((uint32_t)__ldg(h + 5) << 16), __ldg(h + 6) | ((uint32_t)__ldg(h + 7) << 16));
        }
      }
    }
  };
  float acc[M];
  fetch(0);
  for (int c = 0; c < nchunks; ++c) {
    _Pragma("unroll") for (int u = 0; u < U; ++u) {
      const int i = lane + 32 * u;
      if (i < CW) stage[i] = v[u];
    }
    __syncwarp();
    if (c + 1 < nchunks) fetch(c + 1);  // in flight while this chunk is computed
    const int r = row0 + c / cpr;
    const int b0 = CB * (c % cpr);
    const int nv = min(CB, nblocks - b0);
    if (b0 == 0) {
      _Pragma("unroll") for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    }
    for (int b = lane / LPB; b < nv; b += BPI) {
      const int kb = (b0 + b) * 32;
      const float d = g4_half_bits(s16[(b * BB) >> 1]);
      float w[WPL];
      if (QT == 2) {  // low nibble of qs byte j: weight j; high nibble: weight 16 + j
        constexpr int QB = WPL / 2;
        const int o = (b * BB + 2 + part * QB) >> 1;
        _Pragma("unroll") for (int j = 0; j < QB; j += 2) {
          const uint32_t u = s16[o + j / 2];
          w[j] = g4_as_float(0x4B000000u | (u & 15u)) - 8388616.0f;
          w[j + 1] = g4_as_float(0x4B000000u | ((u >> 8) & 15u)) - 8388616.0f;
          w[QB + j] = g4_as_float(0x4B000000u | ((u >> 4) & 15u)) - 8388616.0f;
          w[QB + j + 1] = g4_as_float(0x4B000000u | (u >> 12)) - 8388616.0f;
        }
      } else {  // int8 weights part * WPL + j
        const int o = (b * BB + 2 + part * WPL) >> 1;
        _Pragma("unroll") for (int j = 0; j < WPL; j += 2) {
          const uint32_t u = s16[o + j / 2];
          w[j] = g4_as_float(0x4B000000u | ((u & 255u) ^ 128u)) - 8388736.0f;
          w[j + 1] = g4_as_float(0x4B000000u | ((u >> 8) ^ 128u)) - 8388736.0f;
        }
      }
      _Pragma("unroll") for (int m = 0; m < M; ++m) {
        float xv[WPL];
        if (QT == 2) {
          constexpr int QB = WPL / 2;
          const T* xp = x + (size_t)m * K + kb + part * QB;
          _Pragma("unroll") for (int j = 0; j < QB; j += 4) {
            g4_load4(xp + j, &xv[j]);
            g4_load4(xp + 16 + j, &xv[QB + j]);
          }
        } else {
          const T* xp = x + (size_t)m * K + kb + part * WPL;
          _Pragma("unroll") for (int j = 0; j < WPL; j += 4) g4_load4(xp + j, &xv[j]);
        }
        float p = 0.0f;
        _Pragma("unroll") for (int j = 0; j < WPL; ++j) p += w[j] * xv[j];
        acc[m] += d * p;
      }
    }
    if (b0 + nv == nblocks) {  // the row is complete (warp-uniform)
      _Pragma("unroll") for (int m = 0; m < M; ++m) {
        const float s = g4_simd_sum(acc[m]);
        if (lane == 0) out[(size_t)m * N + r] = static_cast<T>(s);
      }
    }
    __syncwarp();  // every lane is done with the stage before the next chunk lands
  }
"""

_ROWS = KernelSource("g4_quant_matvec_rows", ("x", "wq"), ("out",),
                     {"metal": ("", ""), "cuda": (prelude("cuda"), _ROWS_BODY_CUDA)})  # CUDA only


@dataclass(frozen=True)
class RowsConfig:
    """Geometry: rows per warp, warps per block, blocks per chunk (a multiple of 8), lanes per block."""

    rows: int = 4
    warps: int = 4
    chunk_blocks: int = 64
    lanes_per_block: int = 2

    def __post_init__(self):
        if not 1 <= self.rows <= 64:
            raise ValueError("rows must be 1..64")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError("warps must be 1, 2, 4 or 8")
        if self.chunk_blocks < 8 or self.chunk_blocks % 8:
            raise ValueError("chunk_blocks must be a positive multiple of 8")
        if self.lanes_per_block not in (1, 2, 4):
            raise ValueError("lanes_per_block must be 1, 2 or 4")


def rows_supported(ggml_type: int, k: int) -> bool:
    """Q4_0 / Q8_0 rows of whole 16-byte words per 8 blocks: K a multiple of 256."""
    return ggml_type in (Q4_0, Q8_0) and k % 256 == 0


def default_rows_config(ggml_type: int, m: int, n: int, k: int) -> RowsConfig:
    """A starting point (4 rows per warp, 4 warps, chunks of 64 blocks, 2 lanes per block; 4 lanes
    per block above M = 4 keeps M x 16 activations out of registers); bench/kernels.py sweeps it."""
    return RowsConfig(4, 4, 64, 4 if m > 4 else 2)


def plan_rows(ggml_type: int, dtype: str, m: int, n: int, k: int, config: RowsConfig | None = None) -> LaunchPlan:
    """Launch plan of the rows kernel for x [M, K] and weights [N, K]."""
    if not rows_supported(ggml_type, k):
        raise ValueError(f"rows kernel: Q4_0 / Q8_0 with K % 256 == 0 only, got type {ggml_type}, K={k}")
    if not 1 <= m <= 8:
        raise ValueError(f"rows kernel: M must be 1..8, got {m}")
    cfg = config or default_rows_config(ggml_type, m, n, k)
    block_bytes = 18 if ggml_type == Q4_0 else 34
    if cfg.warps * cfg.chunk_blocks * block_bytes > _SHARED_LIMIT:
        raise ValueError(f"rows kernel: {cfg} stages more than {_SHARED_LIMIT} bytes of shared memory")
    template = [("T", dtype), ("M", m), ("QT", ggml_type), ("R", cfg.rows), ("NW", cfg.warps),
                ("CB", cfg.chunk_blocks), ("LPB", cfg.lanes_per_block)]  # fmt: skip
    threads = 32 * cfg.warps
    grid = (math.ceil(n / (cfg.rows * cfg.warps)) * threads, 1, 1)
    return LaunchPlan(template, grid, (threads, 1, 1), (m, n))


def launch_dense_rows(x2: mx.array, blocks: mx.array, ggml_type: int, n: int, config: RowsConfig | None = None,
                      init_value: float | None = None) -> mx.array:  # fmt: skip
    """Run the rows kernel on x2 [M <= 8, K] (CUDA only, no fallback) -> [M, N] in x2.dtype."""
    m, k = x2.shape
    plan = plan_rows(ggml_type, dtype_name(x2.dtype), m, n, k, config)
    return _run(_ROWS, [x2, blocks], plan, x2.dtype, init_value)


def use_rows(ggml_type: int, m: int, k: int) -> bool:
    """Dispatch: M = 1 on CUDA with the family opted in (GEMMA4_MLX_UNPROVEN_KERNELS)."""
    return m == 1 and use_kernel(FAMILY) and backend() == "cuda" and rows_supported(ggml_type, k)


# --------------------------------------------------------------------------------------------
# Registry: CUDA text for the nvcc compile test, cases for the GPU harness
# --------------------------------------------------------------------------------------------


def _rows_case(rng, ggml_type, dtype, m, n, k, config):
    from .registry import KernelCase

    x, x64, in_dt = _activations(rng, (m, k), dtype)
    wq = random_blocks(rng, ggml_type, (n,), k)
    w64 = dequantize_f64(wq, ggml_type)
    rtol, atol = _tolerances(dtype, float((np.abs(x64) @ np.abs(w64).T).max()))
    plan = plan_rows(ggml_type, dtype, m, n, k, config)
    return KernelCase(
        inputs={"x": x, "wq": wq}, template=plan.template, grid=plan.grid, threadgroup=plan.threadgroup,
        output_shapes=[plan.output_shape], output_dtypes=[dtype], expected=[x64 @ w64.T], rtol=rtol, atol=atol,
        input_dtypes=in_dt, label=f"type {ggml_type} {dtype} M={m} N={n} K={k} {config}",
    )  # fmt: skip


def _rows_cases(rng: np.random.Generator):
    """Odd N (a partial last warp and block), partial last chunks, one chunk per row or many, both
    types, every LPB, M = 1..8."""
    c = RowsConfig
    return [_rows_case(rng, Q4_0, "bfloat16", 1, 37, 1024, c(4, 4, 64, 2)),
            _rows_case(rng, Q4_0, "float32", 3, 13, 512, c(2, 2, 8, 1)),
            _rows_case(rng, Q4_0, "bfloat16", 1, 45, 5376, c(8, 2, 128, 4)),
            _rows_case(rng, Q8_0, "bfloat16", 1, 21, 768, c(3, 1, 16, 4)),
            _rows_case(rng, Q8_0, "float32", 8, 9, 256, c(1, 8, 8, 2))]  # fmt: skip


def kernel_specs():
    """The rows kernel (CUDA only: no Metal text) with small cases."""
    from .registry import KernelSpec

    return [KernelSpec(_ROWS.name, _ROWS.input_names, _ROWS.output_names, "", "", *_ROWS.text["cuda"],
                       _rows_cases)]  # fmt: skip

"""Decode attention straight over the KV cache buffers (split-GQA, sequence partitions).

Semantics (gemma4-spec.md §3.4, §5; the model's ``mx.fast.scaled_dot_product_attention`` call with
the mask of ``TextModel.mask_fn``):

- ``q`` [B, n_q, M, D] (bf16, f32 or f16): M = 1..8 query rows of every head, row m at absolute
  position ``q_positions[m]`` (int32 [M]).
- ``k_cache``, ``v_cache`` [B, n_kv, S, D] (bf16 by default, f32/f16 accepted): whole cache
  buffers; ``positions`` int32 [S] is the absolute position held by each slot, -1 for an empty
  slot. Sliding layers keep a ring (slots in any order); full layers hold positions 0..len-1 in
  slots 0..len-1 and S may be a preallocated capacity larger than len (slots past len hold -1, or
  any position > the query's, which the causal test excludes). ``k_cache`` may also be one K|V
  buffer [2B, n_kv, S, D] (a one-buffer static cache, gemma4_mlx.cache): the kernels and the
  reference read only its first B rows, and ``v_cache`` is then a view of its last B.
- Query row m may attend slot s iff ``positions[s] >= 0``, ``positions[s] <= q_positions[m]`` and,
  on sliding layers, ``q_positions[m] - positions[s] < window`` (W keys including itself).
- Scale 1.0, no softcap. GQA: query head h reads kv head ``h // (n_q // n_kv)``.
- Softmax in f32 with the exact max, f32 accumulation; output [B, n_q, M, D] in q's dtype. A row
  with no attendable slot gives 0 (the model never produces one: a query always sees itself).

Ops:

- ``decode_attention(q, k_cache, v_cache, positions, q_positions, window=None, *, n_slots=None)``:
  the custom kernels on Metal/CUDA (head dim 128/256/512, M <= 8), else the reference.
  ``n_slots`` (optional, int or int32 array [1]): only slots ``0..n_slots-1`` can hold an
  attendable position (a full layer's valid length). It is a work bound, not a mask: slots past
  it are skipped; by default every slot is scanned (always right, and what a ring needs).
- ``decode_attention_reference(...)``: the same in plain MLX ops (f32 matmuls, masked softmax);
  what runs on CPU and the GPU tests' twin.
- ``attend_mask(q_positions, positions, window)``: the bool [M, S] mask above.

Kernel design (one body for Metal and CUDA through ``custom_kernels.dialect``):

1. ``g4_attn_decode_partial``: one threadgroup per (batch x kv head, sequence partition, query
   tile). It loads each K/V row of its partition once and serves all G = n_q / n_kv query heads x
   M rows of its group ("split-GQA", seed 000 K3: one K/V read for the whole GQA group). The query
   rows (G*M of them, in tiles of QT rows: r = g*M + m, contiguous in q) sit in threadgroup memory
   as f32. Slots go in tiles of TS: (a) scores: each SIMD group takes SB consecutive slots at a
   time; lane l holds elements 4l + 128j + {0..3} of each K row (coalesced vector loads straight
   from the cache, converted to f32), forms its partial dot products with every query row and one
   butterfly reduction across the 32 lanes gives all SB scores (SB - 1 + log2(32/SB) shuffles
   instead of 5 per score); masked pairs get -inf; (b) softmax: one SIMD group per row updates the
   running max m and sum l exactly (online softmax), turning scores into exp(s - m) and recording
   the rescale factor exp(m_old - m_new); (c) values: each thread owns 4 output elements of some
   rows, rescales them and adds p * v for the tile's slots, reading each V row once. Slots that no
   query row may attend (empty ring slots, positions past the query, outside the window, past
   n_slots) are never read, so stale or poisoned cache contents cannot leak in; the test is made
   against the span of the rows' positions (consecutive in decode and verification), so with gaps
   between q positions a slot in a gap that no row attends may still be read. Each partition
   writes its unnormalized state (m, l) [BH, P, QR, 2] and acc [BH, P, QR, D] in f32.
2. ``g4_attn_decode_merge``: one threadgroup per output row merges the partitions in ascending
   order (global max first, then sum of exp(m_p - max) * (l_p, acc_p)), divides, and writes q's
   dtype. Fixed order: deterministic, bit-identical run to run.
3. ``g4_attn_decode`` (CUDA only, with ``counters``; family "attention_fused"): both in one
   launch where a group's merge reads little (``FUSED_MERGE_BYTES``: the sliding layers). Each
   partition's threadgroup writes its state as 1. does, fences it and takes a ticket from its
   (kv head, query tile) group's counter; the group's last active partition merges the group's
   rows as 2. does (same order, same operations: the same bits) from L2 and sets the counter back
   to zero. One launch and one graph node fewer per layer.
4. ``g4_attn_decode_staged`` (CUDA on Hopper, with ``counters`` and ``staged``; family
   "attention_staged", opt-in): 3. with each tile's K and V rows brought into shared memory by two
   bulk copies that thread 0 issues before the query rows load; the same arithmetic in the same
   order (the same bits). Faster per call in isolation, not inside the decode step (session 26).
5. ``g4_attn_decode_mma`` (CUDA sm_80+, bf16, with ``mma``; family "attention_mma"): 1. on tensor
   cores, the kv head's G*M <= 16 query rows as the rows of mma.sync m16n8k16 (the f32-FMA kernel
   is bound by its arithmetic where one K/V row serves 8-16 query rows of 512 dims), then
   ``g4_attn_decode_merge_wide``, whose 8 warps split a row's partitions. Within f32 rounding of
   1.-2., not their bits (see the comment above the kernel). Family "attention_mma" is the switch
   for 5.-7.; by default this kernel itself takes only what 6. and 7. leave: 9..16 rows below
   Hopper (12B's full layers on sm_80; sessions 27-29).
6. ``g4_attn_decode_mma8`` (CUDA sm_80+, bf16, with ``mma8``; family "attention_mma8"): 5. for
   4..8 query rows per kv head with both products transposed (slots and head dims as the mma's 16
   rows, the query rows its 8 columns: no padding rows), then the same merge. The model's full
   layers with 4-8 query rows per kv head (31B, 26B-A4B: 8, E4B: 4; session 29) and E2B's
   layers of both types (8 rows; its ring's merge is too large for 3.), before 5. Rows are G x M,
   so verification calls of M >= 2 on the sliding layers whose merge is too large for 3. take it
   too (31B's, 26B-A4B's, 12B's at M = 2..4).
7. ``g4_attn_decode_mma_staged`` (CUDA on Hopper, with ``mma_staged``; family
   "attention_mma_staged"): 5. with each tile's K and V rows bulk-copied into shared memory a tile
   ahead, ~132 thread blocks; the same arithmetic on the same partitions as 5. The model's layers
   that 6. does not take from 4 rows up: 12B's full layers (16 rows; session 29).
A layer with a small enough merge takes 3. (or 4.) first whatever its rows: the sliding layers at
one token (E4B's 4 rows included), and full layers in short caches (e.g. 31B's at 256 slots).

Shape stability: the grid has P partitions fixed by the capacity S (so one compiled decode step
serves every token); the valid length ``n_slots`` is an input array, and each partition's slot
range is computed on the device: chunk = max(CMIN, ceil(n_slots / P)) rounded up to TS, and only
the first ceil(n_slots / chunk) partitions do work (the others exit at once; the merge reads only
those). Template instantiations: one per (dtypes, D, G, M, window, geometry); a model has two
layer types, so decode compiles two pairs of kernels (plus one per extra M used by verification).

exp: the kernels use ``g4_attn_exp``, a Cody-Waite range reduction plus a degree-7 polynomial
(about 1 ulp on the x <= 0 it is used for), so the same text runs on Metal, CUDA and the CPU
compile/emulator tests, whose Metal shim has no exp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import (KernelSource, backend, check_ticket_counters, cuda_arch, dtype_name, geometry_override, template_args,
                ticket_counters, use_reference)
from .dialect import prelude, render

__all__ = [
    "decode_attention",
    "decode_attention_reference",
    "attend_mask",
    "launch_decode_attention",
    "AttentionConfig",
    "default_config",
    "DecodePlan",
    "plan_decode",
    "partition_layout",
    "KERNEL_HEAD_DIMS",
    "MAX_QUERY_ROWS",
    "attention_f64",
    "partials_f64",
    "merge_f64",
    "kernel_specs",
    "new_attention_counters",
    "fused_supported",
    "staged_supported",
    "staged_shared_bytes",
    "FUSED_MERGE_BYTES",
    "default_mma_config",
    "mma_supported",
    "plan_decode_mma",
    "MMA_MIN_ROWS",
    "MMA_STAGED_MIN_ROWS",
    "MMA8_MIN_ROWS",
    "MMA8_MAX_ROWS",
    "mma_staged_shared_bytes",
]

KERNEL_HEAD_DIMS = (128, 256, 512)
"""Head dims the kernels take (D = 32 lanes x 4-element vectors x D/128); others use the reference."""
MAX_QUERY_ROWS = 8
"""Largest M (query rows per head) the kernels take; larger M (prefill) uses the reference."""

_ACT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)

# --------------------------------------------------------------------------------------------
# Reference (plain MLX ops)
# --------------------------------------------------------------------------------------------


def attend_mask(q_positions: mx.array, positions: mx.array, window: int | None) -> mx.array:
    """bool [M, S]: query row m (at q_positions[m]) may attend slot s (holding positions[s])."""
    qp = q_positions.astype(mx.int32)[:, None]
    kp = positions.astype(mx.int32)[None, :]
    diff = qp - kp
    ok = (kp >= 0) & (diff >= 0)
    if window is not None:
        ok = ok & (diff < window)
    return ok


def _check(q: mx.array, k_cache: mx.array, v_cache: mx.array, positions: mx.array, q_positions: mx.array,
           window: int | None) -> tuple[int, int, int, int, int, int]:  # fmt: skip
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"q must be [B, n_q, M, D] and the caches [B, n_kv, S, D], got {q.shape}, {k_cache.shape}")
    B, n_q, M, D = q.shape
    _, n_kv, S, _ = k_cache.shape
    if k_cache.shape not in ((B, n_kv, S, D), (2 * B, n_kv, S, D)) or v_cache.shape != (B, n_kv, S, D):
        raise ValueError(f"caches {k_cache.shape} / {v_cache.shape} do not match q {q.shape} ([B, n_kv, S, D], "
                         "K's also [2B, n_kv, S, D])")  # fmt: skip
    if n_kv == 0 or n_q % n_kv:
        raise ValueError(f"{n_q} query heads are not a multiple of {n_kv} kv heads")
    if q.dtype not in _ACT_DTYPES or k_cache.dtype not in _ACT_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}: expected float32/bfloat16/float16 "
                        "(K and V of one dtype)")  # fmt: skip
    if positions.shape != (S,) or q_positions.shape != (M,):
        raise ValueError(f"positions {positions.shape} / q_positions {q_positions.shape} must be [S={S}] / [M={M}]")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    return B, n_q, M, D, n_kv, S


def decode_attention_reference(q: mx.array, k_cache: mx.array, v_cache: mx.array, positions: mx.array,
                               q_positions: mx.array, window: int | None = None) -> mx.array:  # fmt: skip
    """Reference: scores q k^T in f32 (scale 1), masked softmax in f32, @ v -> [B, n_q, M, D], q.dtype.

    GQA without repeating K/V: the G*M query rows of a kv head (row g*M + m) form one matrix
    [B, n_kv, G*M, D] against K [B, n_kv, S, D]. Assumes the cache holds finite values (masked
    slots get probability 0, and 0 * finite = 0)."""
    B, n_q, M, D, n_kv, S = _check(q, k_cache, v_cache, positions, q_positions, window)
    G = n_q // n_kv
    qf = q.astype(mx.float32).reshape(B, n_kv, G * M, D)
    kf = k_cache[:B].astype(mx.float32)
    vf = v_cache.astype(mx.float32)
    scores = qf @ kf.swapaxes(-1, -2)  # [B, n_kv, G*M, S]
    mask = attend_mask(q_positions, positions, window)
    if G > 1:
        mask = mx.tile(mask, (G, 1))  # row g*M + m -> mask row m
    neg_inf = mx.array(-math.inf, dtype=mx.float32)
    scores = mx.where(mask, scores, neg_inf)
    top = mx.max(scores, axis=-1, keepdims=True)
    top = mx.where(top == neg_inf, 0.0, top)  # rows without any key: keep exp() at 0, not NaN
    p = mx.exp(scores - top)
    total = mx.sum(p, axis=-1, keepdims=True)
    out = (p @ vf) / mx.where(total > 0, total, 1.0)
    return out.reshape(B, n_q, M, D).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Kernel text (shared dialect, see custom_kernels.dialect)
# --------------------------------------------------------------------------------------------

# Per-dialect function qualifier and the grid's partition count (not covered by dialect.py).
_LOCAL = {
    "metal": {"@FN@": "static inline", "@NPART@": "(int)threadgroups_per_grid.y"},
    "cuda": {"@FN@": "__device__ __forceinline__", "@NPART@": "(int)gridDim.y"},
}

_HELPERS = r"""
// gemma4-mlx attention helpers
// e^x for x <= 0 (scores minus a running max): Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2,
// degree-7 Taylor polynomial (truncation 5e-9 relative), scaled by 2^k through the exponent bits.
// 0 below -87 (where e^x is no longer a normal float) and for -inf.
@FN@ float g4_attn_exp(float x) {
  if (x < -87.0f) return 0.0f;
  const int k = (int)(x * 1.4426950408889634f - 0.5f);  // ceil(x log2(e) - 1/2) for x <= 0
  const float kf = (float)k;
  const float r = (x - kf * 0.693145751953125f) - kf * 1.428606765330187e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * g4_as_float((uint32_t)(k + 127) << 23);
}
// Slots per sequence partition: at least cmin, enough that `parts` partitions cover n_slots,
// a multiple of the tile ts. Partition p covers [p * chunk, min((p + 1) * chunk, n_slots)) and
// works only when p * chunk < n_slots (partial and merge kernels agree through this function).
@FN@ int g4_attn_chunk(int n_slots, int parts, int cmin, int ts) {
  int c = (n_slots + parts - 1) / parts;
  c = c < cmin ? cmin : c;
  return (c + ts - 1) / ts * ts;
}
"""

# Template arguments of the partial kernel:
#   T  q dtype           KT  K/V cache dtype      D   head dim (128, 256, 512)
#   G  query heads per kv head                    M   query rows per head (1..8)
#   WIN  sliding window (0: full attention)       QT  query rows per threadgroup (tile)
#   TS   slots per tile (multiple of 8)           NSG SIMD groups per threadgroup (32*NSG >= D/4)
#   CMIN minimum slots per partition (multiple of TS)
# Grid: x = 32*NSG threads x (B * n_kv), y = P partitions, z = ceil(G*M / QT) query tiles.
_PARTIAL_BODY = r"""
  // gemma4-mlx attn_decode_partial: split-GQA decode attention over one sequence partition
  constexpr int QR = G * M;            // query rows of one kv head: r = g * M + m
  constexpr int NT = 32 * NSG;         // threads per group
  constexpr int E = D / 32;            // K elements per lane in the score phase
  constexpr int SB = D >= 512 ? 4 : 8; // slots per SIMD-group step in the score phase
  constexpr int DV = D / 4;            // 4-element vectors per row
  constexpr int RG = NT / DV;          // row groups in the value phase
  constexpr int RPT = (QT + RG - 1) / RG;    // rows per thread in the value phase
  constexpr int RPS = (QT + NSG - 1) / NSG;  // rows per SIMD group in the softmax phase
  constexpr int SUBS = TS / SB;
  const float NEG_INF = g4_as_float(0xff800000u);

  $shared float4 q_s4[QT * DV];  // this tile's query rows, f32
  $shared float s_s[QT * TS];    // scores, then probabilities, of the current slot tile
  $shared float alpha_s[QT];     // rescale of each row's accumulators for the current tile
  $shared int ok_s[TS];          // slot may be attended by some row (else never read)

  const int tid = $tid;
  const int lane = $lane;
  const int sg = $simd;
  const int bh = $tg_x;
  const int part = $tg_y;
  const int row0 = $tg_z * QT;
  const int nparts = @NPART@;
  const int S = k_shape[2];
  const int nslots = n_slots[0] < 0 ? 0 : (n_slots[0] > S ? S : n_slots[0]);
  const int chunk = g4_attn_chunk(nslots, nparts, CMIN, TS);
  const int start = part * chunk;
  if (start >= nslots) return;  // an idle partition (the whole group returns): the merge skips it
  const int end = start + chunk < nslots ? start + chunk : nslots;
  const int nrows = QR - row0 < QT ? QR - row0 : QT;
  int qmin = qpos[0];
  int qmax = qpos[0];
  for (int m = 1; m < M; ++m) {
    qmin = qpos[m] < qmin ? qpos[m] : qmin;
    qmax = qpos[m] > qmax ? qpos[m] : qmax;
  }
  const $device T* qbase = q + ((size_t)bh * QR + row0) * D;
  const $device KT* kbase = k + (size_t)bh * S * D;
  const $device KT* vbase = v + (size_t)bh * S * D;

  for (int i = tid; i < QT * DV; i += NT) {
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (i < nrows * DV) g4_load4(qbase + (size_t)i * 4, a);
    q_s4[i].x = a[0];
    q_s4[i].y = a[1];
    q_s4[i].z = a[2];
    q_s4[i].w = a[3];
  }
  float m_run[RPS];
  float l_run[RPS];
  $unroll for (int j = 0; j < RPS; ++j) { m_run[j] = NEG_INF; l_run[j] = 0.0f; }
  const int dv = tid % DV;
  const int rg = tid / DV;
  float acc[RPT][4];
  $unroll for (int i = 0; i < RPT; ++i) { $unroll for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f; }
  $barrier;

  for (int t0 = start; t0 < end; t0 += TS) {
    // (a) scores of every query row against the tile's slots, -inf where masked
    for (int st = sg; st < SUBS; st += NSG) {
      const int s0 = t0 + st * SB;
      bool ok[SB];
      bool some = false;
      $unroll for (int i = 0; i < SB; ++i) {
        const int p = s0 + i < end ? kpos[s0 + i] : -1;
        ok[i] = p >= 0 && p <= qmax && (WIN == 0 || qmin - p < WIN);
        some = some || ok[i];
      }
      if (lane == 0) {
        $unroll for (int i = 0; i < SB; ++i) ok_s[st * SB + i] = ok[i] ? 1 : 0;
      }
      if (!some) {
        for (int i = lane; i < nrows * SB; i += 32) s_s[(i / SB) * TS + st * SB + i % SB] = NEG_INF;
        continue;
      }
      const int mine = lane / (32 / SB);  // the slot whose score this lane ends up holding
      const int my_p = s0 + mine < end ? kpos[s0 + mine] : -1;
      float kr[SB][E];
      $unroll for (int i = 0; i < SB; ++i) {
        if (ok[i]) {
          const $device KT* kp = kbase + (size_t)(s0 + i) * D + 4 * lane;
          $unroll for (int j = 0; j < E / 4; ++j) g4_load4(kp + 128 * j, &kr[i][4 * j]);
        } else {
          $unroll for (int e = 0; e < E; ++e) kr[i][e] = 0.0f;
        }
      }
      for (int r = 0; r < nrows; ++r) {
        float qv[E];
        $unroll for (int j = 0; j < E / 4; ++j) {
          const float4 a = q_s4[r * DV + 32 * j + lane];
          qv[4 * j] = a.x;
          qv[4 * j + 1] = a.y;
          qv[4 * j + 2] = a.z;
          qv[4 * j + 3] = a.w;
        }
        float d[SB];
        $unroll for (int i = 0; i < SB; ++i) {
          float t = 0.0f;
          $unroll for (int e = 0; e < E; ++e) t += qv[e] * kr[i][e];
          d[i] = t;
        }
        // butterfly: each step halves the values per lane; lanes with bit w set keep the upper half
        $unroll for (int n = SB / 2; n >= 1; n >>= 1) {
          const int w = 32 * n / SB;
          const bool up = (lane & w) != 0;
          $unroll for (int i = 0; i < n; ++i) {
            const float send = up ? d[i] : d[i + n];
            const float keep = up ? d[i + n] : d[i];
            d[i] = keep + g4_shuffle_xor(send, w);
          }
        }
        $unroll for (int w = 16 / SB; w >= 1; w >>= 1) d[0] += g4_shuffle_xor(d[0], w);
        if ((lane & (32 / SB - 1)) == 0) {
          const int qp = qpos[(row0 + r) % M];
          const bool okr = my_p >= 0 && my_p <= qp && (WIN == 0 || qp - my_p < WIN);
          s_s[r * TS + st * SB + mine] = okr ? d[0] : NEG_INF;
        }
      }
    }
    $barrier;
    // (b) online softmax: one SIMD group per row
    $unroll for (int j = 0; j < RPS; ++j) {
      const int r = sg + NSG * j;
      if (r < nrows) {
        float top = NEG_INF;
        for (int c = lane; c < TS; c += 32) top = s_s[r * TS + c] > top ? s_s[r * TS + c] : top;
        top = g4_simd_max(top);
        const float m_new = m_run[j] > top ? m_run[j] : top;
        const bool live = m_new > NEG_INF;
        const float alpha = live ? g4_attn_exp(m_run[j] - m_new) : 1.0f;
        float ps = 0.0f;
        for (int c = lane; c < TS; c += 32) {
          const float p = live ? g4_attn_exp(s_s[r * TS + c] - m_new) : 0.0f;
          s_s[r * TS + c] = p;
          ps += p;
        }
        ps = g4_simd_sum(ps);
        l_run[j] = l_run[j] * alpha + ps;
        m_run[j] = m_new;
        if (lane == 0) alpha_s[r] = alpha;
      }
    }
    $barrier;
    // (c) values: thread (rg, dv) owns elements 4dv..4dv+3 of rows rg, rg + RG, ...
    $unroll for (int i = 0; i < RPT; ++i) {
      const int r = rg + RG * i;
      if (r < nrows) {
        const float a = alpha_s[r];
        $unroll for (int e = 0; e < 4; ++e) acc[i][e] *= a;
      }
    }
    for (int c = 0; c < TS; c += 4) {
      bool okv[4];
      bool some = false;
      $unroll for (int u = 0; u < 4; ++u) { okv[u] = ok_s[c + u] != 0; some = some || okv[u]; }
      if (!some) continue;
      float vv[4][4];
      $unroll for (int u = 0; u < 4; ++u) {
        if (okv[u]) {
          g4_load4(vbase + (size_t)(t0 + c + u) * D + 4 * dv, vv[u]);
        } else {
          $unroll for (int e = 0; e < 4; ++e) vv[u][e] = 0.0f;
        }
      }
      $unroll for (int i = 0; i < RPT; ++i) {
        const int r = rg + RG * i;
        if (r < nrows) {
          $unroll for (int u = 0; u < 4; ++u) {
            const float p = s_s[r * TS + c + u];
            $unroll for (int e = 0; e < 4; ++e) acc[i][e] += p * vv[u][e];
          }
        }
      }
    }
    $barrier;
  }

  const size_t base = ((size_t)bh * nparts + part) * QR + row0;
  $unroll for (int j = 0; j < RPS; ++j) {
    const int r = sg + NSG * j;
    if (r < nrows && lane == 0) {
      ml[(base + r) * 2] = m_run[j];
      ml[(base + r) * 2 + 1] = l_run[j];
    }
  }
  $unroll for (int i = 0; i < RPT; ++i) {
    const int r = rg + RG * i;
    if (r < nrows) {
      $unroll for (int e = 0; e < 4; ++e) pacc[(base + r) * D + 4 * dv + e] = acc[i][e];
    }
  }
"""

# Template arguments of the merge kernel: T (output dtype), D, QR (= G * M), TS, CMIN (as in the
# partial kernel). Grid: x = D/4 threads x (B * n_q * M) output rows; threadgroup D/4.
# The partitions are independent loads: the threads find the top score together, then take the
# partitions NT at a time (thread t computes partition p0 + t's weight into threadgroup memory)
# and every thread adds its 4 elements of the batch's partials in ascending order, 8 loads in
# flight. Every partition below the active count was written by the partial kernel (a fully
# masked one with m = -inf, l = 0 and zero partials: weight 0).
_MERGE_BODY = r"""
  // gemma4-mlx attn_decode_merge: partitions merged in ascending order, normalized, cast
  constexpr int NT = D / 4;             // threads: elements 4t .. 4t+3 of the row each
  constexpr int NSG = (NT + 31) / 32;
  constexpr int LB = 8;                 // partial rows loaded before they are added
  $shared float w_s[NT];                // weights of the current batch of partitions
  $shared float lw_s[NT];               // their weighted softmax denominators
  $shared float top_s[NSG];
  const float NEG_INF = g4_as_float(0xff800000u);
  const int row = $tg_x;  // (b * n_kv + kv head) * QR + r = (b * n_q + head) * M + m
  const int bh = row / QR;
  const int r = row % QR;
  const int t = $tid;
  const int nparts = ml_shape[1];
  const int nslots = n_slots[0] < 0 ? 0 : n_slots[0];
  const int chunk = g4_attn_chunk(nslots, nparts, CMIN, TS);
  int nactive = (nslots + chunk - 1) / chunk;
  nactive = nactive < nparts ? nactive : nparts;
  const size_t base = (size_t)bh * nparts * QR + r;  // partition p: base + p * QR
  float top = NEG_INF;
  for (int p = t; p < nactive; p += NT) {
    const float mp = ml[(base + (size_t)p * QR) * 2];
    top = mp > top ? mp : top;
  }
  top = g4_simd_max(top);
  if ($lane == 0) top_s[$simd] = top;
  $barrier;
  top = top_s[0];
  $unroll for (int i = 1; i < NSG; ++i) top = top_s[i] > top ? top_s[i] : top;
  float total = 0.0f;
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int p0 = 0; p0 < nactive; p0 += NT) {
    {
      const int p = p0 + t;
      float w = 0.0f;
      float l = 0.0f;
      if (p < nactive && top > NEG_INF) {
        const size_t i = base + (size_t)p * QR;
        const float mp = ml[i * 2];
        if (mp > NEG_INF) {
          w = g4_attn_exp(mp - top);
          l = ml[i * 2 + 1];
        }
      }
      w_s[t] = w;
      lw_s[t] = w * l;
    }
    $barrier;
    const int nb = nactive - p0 < NT ? nactive - p0 : NT;
    for (int j0 = 0; j0 < nb; j0 += LB) {
      float x[LB][4];
      $unroll for (int u = 0; u < LB; ++u) {
        if (j0 + u < nb) {
          g4_load4(pacc + (base + (size_t)(p0 + j0 + u) * QR) * D + 4 * t, x[u]);
        } else {
          $unroll for (int e = 0; e < 4; ++e) x[u][e] = 0.0f;
        }
      }
      $unroll for (int u = 0; u < LB; ++u) {
        if (j0 + u < nb) {
          const float w = w_s[j0 + u];
          total += lw_s[j0 + u];
          $unroll for (int e = 0; e < 4; ++e) a[e] += w * x[u][e];
        }
      }
    }
    $barrier;  // the batch's weights are read before the next batch writes them
  }
  $unroll for (int e = 0; e < 4; ++e) {
    out[(size_t)row * D + 4 * t + e] = static_cast<T>(total > 0.0f ? a[e] / total : 0.0f);
  }
"""


def _local(text: str, dialect: str) -> str:
    for key, value in _LOCAL[dialect].items():
        text = text.replace(key, value)
    return text


def _text(body: str) -> dict[str, tuple[str, str]]:
    """{"metal": (header, source), "cuda": (header, source)} for one kernel body."""
    return {d: (prelude(d) + _local(render(_HELPERS, d), d), _local(render(body, d), d)) for d in ("metal", "cuda")}


_PARTIAL = KernelSource("g4_attn_decode_partial", ("q", "k", "v", "kpos", "qpos", "n_slots"), ("ml", "pacc"),
                      _text(_PARTIAL_BODY))  # fmt: skip
_MERGE = KernelSource("g4_attn_decode_merge", ("ml", "pacc", "n_slots"), ("out",), _text(_MERGE_BODY))

FUSED_MERGE_BYTES = 128 * 1024
"""The one-launch form is used where a group's merge reads at most this many bytes of partial
state (P x QT x D x 4: 31B's sliding layers at 4K read 64 KB; its full layers 2 MB, which one
threadgroup would read alone, keep the two launches)."""

# The partial kernel's body, then a ticket per (kv head, query tile) group: the group's last active
# partition merges the group's rows as _MERGE_BODY does (ascending partitions, the same operations:
# w * l rounded before it is added, w * x fused into the sum), its reads from L2 after a
# device-scope fence, and zeroes the counter for the next call. With no valid slot (no active
# partition) partition 0 writes the rows' zeros. Template: the partial kernel's.
_FUSED_IDLE = r"""
  if (start >= nslots) {  // an idle partition; with no slot at all, partition 0 writes the zeros
    if (part == 0) {
      const int rows0 = QR - row0 < QT ? QR - row0 : QT;
      for (int i = tid; i < rows0 * D; i += NT) out[((size_t)bh * QR + row0) * D + i] = static_cast<T>(0.0f);
    }
    return;
  }
"""
_FUSED_TAIL = r"""
  // ticket: the (kv head, query tile) group's last active partition merges the group's rows
  __shared__ int g4_last;
  __shared__ float g4_m[RPMAX];  // the group's (row, partition) maxima and sums: nrows x nactive
  __shared__ float g4_l[RPMAX];
  __threadfence();
  $barrier;
  const int nactive = (nslots + chunk - 1) / chunk < nparts ? (nslots + chunk - 1) / chunk : nparts;
  unsigned int* done = const_cast<unsigned int*>(counters) + (size_t)bh * gridDim.z + blockIdx.z;
  if (tid == 0) g4_last = atomicAdd(done, 1u) == (unsigned int)(nactive - 1) ? 1 : 0;
  $barrier;
  if (g4_last == 0) return;
  __threadfence();
  if (tid == 0) *done = 0u;
  const size_t gbase = (size_t)bh * nparts * QR + row0;  // row r of partition p: gbase + p * QR + r
  for (int i = tid; i < nrows * nactive; i += NT) {
    const size_t j = gbase + (size_t)(i % nactive) * QR + i / nactive;
    g4_m[i] = __ldcg(ml + j * 2);
    g4_l[i] = __ldcg(ml + j * 2 + 1);
  }
  $barrier;
  constexpr int LB = 8;  // partial rows loaded before they are added
  $unroll for (int i = 0; i < RPT; ++i) {
    const int r = rg + RG * i;
    if (r < nrows) {
      const float* mr = g4_m + r * nactive;
      const float* lr = g4_l + r * nactive;
      float top = NEG_INF;
      for (int p = 0; p < nactive; ++p) top = mr[p] > top ? mr[p] : top;
      float total = 0.0f;
      float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int p0 = 0; p0 < nactive && top > NEG_INF; p0 += LB) {
        float4 x[LB];
        $unroll for (int u = 0; u < LB; ++u) {
          const size_t j = gbase + (size_t)(p0 + u) * QR + r;
          x[u] = p0 + u < nactive ? __ldcg(reinterpret_cast<const float4*>(pacc + j * D + 4 * dv)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        $unroll for (int u = 0; u < LB; ++u) {
          if (p0 + u < nactive) {
            const float mp = mr[p0 + u];
            const float w = mp > NEG_INF ? g4_attn_exp(mp - top) : 0.0f;
            total += __fmul_rn(w, mp > NEG_INF ? lr[p0 + u] : 0.0f);
            a[0] += w * x[u].x;
            a[1] += w * x[u].y;
            a[2] += w * x[u].z;
            a[3] += w * x[u].w;
          }
        }
      }
      $unroll for (int e = 0; e < 4; ++e) {
        out[((size_t)bh * QR + row0 + r) * D + 4 * dv + e] = static_cast<T>(total > 0.0f ? a[e] / total : 0.0f);
      }
    }
  }
"""


def _fused_body() -> str:
    """_PARTIAL_BODY with the idle exit of _FUSED_IDLE, then _FUSED_TAIL (its shared arrays hold
    the (row, partition) pairs of a merge of FUSED_MERGE_BYTES: P x QT x D x 4)."""
    body = _PARTIAL_BODY.replace("attn_decode_partial: split-GQA decode attention over one sequence partition",
                                 "attn_decode: the partial kernel, then the group's last partition merges", 1)  # fmt: skip
    old = "  if (start >= nslots) return;  // an idle partition (the whole group returns): the merge skips it\n"
    assert body.count(old) == 1
    rpmax = f"  constexpr int RPMAX = {FUSED_MERGE_BYTES // 4} / D;\n"
    return body.replace(old, _FUSED_IDLE.lstrip("\n")) + rpmax + _FUSED_TAIL


_FUSED = KernelSource("g4_attn_decode", ("q", "k", "v", "kpos", "qpos", "n_slots", "counters"), ("ml", "pacc", "out"),
                      {"metal": ("", ""), "cuda": (_text("")["cuda"][0], _local(render(_fused_body(), "cuda"), "cuda"))})  # fmt: skip
# The one launch with each tile's K and V rows brought into shared memory by two bulk copies
# (family "attention_staged", CUDA on Hopper). In the one-tile partitions of the sliding layers
# the loads were a chain: positions, then K, then V four slots at a time (about ten dependent
# memory round trips per threadgroup for 32 slots). Here thread 0 issues the first tile's copies
# before the query rows load, an mbarrier counts their bytes, and the score and value phases read
# shared memory; the next tile's copies follow the trailing barrier of this one. Masked slots
# arrive with the tile but are never used (their K rows become zeros, their V rows are skipped), so
# the arithmetic and its order are the one launch's: the same bits. Caches off 16-byte alignment
# take the global loads. Template: the partial kernel's.
_STAGED_HELPERS = r"""
// plain 4-element loads into f32 (shared or global memory; g4_load4 reads through the read-only
// global path, which a shared address must not take)
__device__ __forceinline__ void g4_attn_ld4(const float* p, float* o) {
  const float4 a = *reinterpret_cast<const float4*>(p); o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
}
__device__ __forceinline__ void g4_attn_ld4(const __nv_bfloat16* p, float* o) {
  const uint2 a = *reinterpret_cast<const uint2*>(p);
  o[0] = __uint_as_float(a.x << 16); o[1] = __uint_as_float(a.x & 0xffff0000u);
  o[2] = __uint_as_float(a.y << 16); o[3] = __uint_as_float(a.y & 0xffff0000u);
}
__device__ __forceinline__ void g4_attn_ld4(const __half* p, float* o) {
  const __half2* h = reinterpret_cast<const __half2*>(p);
  const float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
  o[0] = a.x; o[1] = a.y; o[2] = b.x; o[3] = b.y;
}
"""
_STAGED_SETUP = r"""
  // staged: the tile's K rows at kv_s, its V rows at kv_s + TS D, from two bulk copies per tile
  __shared__ __align__(128) uint8_t kv_raw[2 * TS * D * sizeof(KT)];
  __shared__ __align__(8) uint64_t kv_bar;
  KT* kv_s = reinterpret_cast<KT*>(kv_raw);
  const uint32_t kv_bar_a = g4_shared_addr(&kv_bar);
  const bool staged = ((reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v)) & 15u) == 0;
  auto issue = [&](int t) {  // thread 0: the copies of the tile at slot t
    const uint32_t bytes = (uint32_t)((end - t < TS ? end - t : TS) * D * (int)sizeof(KT));
    g4_mbar_expect_tx(kv_bar_a, 2u * bytes);
    g4_bulk_copy(g4_shared_addr(kv_raw), reinterpret_cast<const uint8_t*>(kbase + (size_t)t * D), bytes, kv_bar_a);
    g4_bulk_copy(g4_shared_addr(kv_raw) + TS * D * (int)sizeof(KT), reinterpret_cast<const uint8_t*>(vbase + (size_t)t * D),
                 bytes, kv_bar_a);
  };
  if (staged && tid == 0) {
    g4_mbar_init(kv_bar_a, 1);
    g4_mbar_init_fence();
    issue(start);
  }
  uint32_t kv_phase = 0u;
"""
_STAGED_EDITS = (
    # the copies go out first thing, before the query rows load
    ("  const $device KT* vbase = v + (size_t)bh * S * D;\n",
     "  const $device KT* vbase = v + (size_t)bh * S * D;\n" + _STAGED_SETUP),
    ("  for (int t0 = start; t0 < end; t0 += TS) {\n",
     "  for (int t0 = start; t0 < end; t0 += TS) {\n"
     "    if (staged) {\n      g4_mbar_wait(kv_bar_a, kv_phase);\n      kv_phase ^= 1u;\n    }\n"),
    ("          const $device KT* kp = kbase + (size_t)(s0 + i) * D + 4 * lane;\n"
     "          $unroll for (int j = 0; j < E / 4; ++j) g4_load4(kp + 128 * j, &kr[i][4 * j]);\n",
     "          const KT* kp = (staged ? kv_s + (size_t)(s0 + i - t0) * D : kbase + (size_t)(s0 + i) * D) + 4 * lane;\n"
     "          $unroll for (int j = 0; j < E / 4; ++j) g4_attn_ld4(kp + 128 * j, &kr[i][4 * j]);\n"),
    ("          g4_load4(vbase + (size_t)(t0 + c + u) * D + 4 * dv, vv[u]);\n",
     "          g4_attn_ld4((staged ? kv_s + (size_t)(TS + c + u) * D : vbase + (size_t)(t0 + c + u) * D) + 4 * dv, vv[u]);\n"),
    # every thread is done with this tile's rows: the next tile's copies may overwrite them
    ("    $barrier;\n  }\n\n  const size_t base",
     "    $barrier;\n    if (staged && tid == 0 && t0 + TS < end) {\n"
     "      asm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\");\n      issue(t0 + TS);\n    }\n"
     "  }\n\n  const size_t base"),
)


def _staged_body() -> str:
    """_fused_body() with the staged loads (_STAGED_EDITS, each applied exactly once)."""
    body = _fused_body().replace("attn_decode: the partial kernel, then the group's last partition merges",
                                 "attn_decode_staged: the one launch, each tile's K and V rows bulk-copied to shared memory", 1)  # fmt: skip
    for old, new in _STAGED_EDITS:
        assert body.count(old) == 1, old
        body = body.replace(old, new)
    return body


def _staged_text() -> tuple[str, str]:
    from .quant_matvec import _MBAR_BULK_CUDA, _STREAM_CP_ASYNC_CUDA  # g4_shared_addr, mbarriers, bulk copies

    header = _text("")["cuda"][0] + _STREAM_CP_ASYNC_CUDA + _MBAR_BULK_CUDA + _STAGED_HELPERS
    return header, _local(render(_staged_body(), "cuda"), "cuda")


_STAGED = KernelSource("g4_attn_decode_staged", _FUSED.input_names, _FUSED.output_names,
                       {"metal": ("", ""), "cuda": _staged_text()})  # fmt: skip
STAGED_ARCH = 90
"""Compute capability the staged kernel needs (bulk copies, mbarrier transaction counts)."""

# Split-GQA decode attention on tensor cores (family "attention_mma", CUDA sm_80+, bf16 q and
# caches, G * M <= 16 query rows per kv head). bench/attention.py (session 27) had the f32-FMA
# partial kernel at 4-8% of copy bandwidth on the full layers whose K/V head serves many query
# rows (12B: 16 rows at D = 512, 53 us at 4K, 233 us at 32K), where MLX's SDPA read the same bytes
# 3.5-7x faster: with 16 rows x 512 dims per slot the FMA kernel is bound by its arithmetic, not
# by memory. Here the kv head's query rows are the 16 rows of mma.sync m16n8k16 (rows past G*M
# are zeros and attend nothing), so the scores and the values are tensor-core products with f32
# accumulation:
#  - each of the NW warps owns D / NW head dims (a multiple of 64); a 32-slot tile's scores are
#    each warp's partial Q K^T over its dims (K rows straight from the cache, 16-byte loads), summed
#    across the warps through shared memory in warp order (so every warp holds the same scores and
#    the same softmax state), double-buffered: one barrier per tile;
#  - the dot products run over a permutation of each 32-dim block (thread t of a quad holds dims
#    8t..8t+7 of its slot's row, one 16-byte load, and the query fragments use the same order);
#  - the probabilities (f32, exact online softmax as in the FMA kernel) enter the value mma as
#    bf16 hi + lo parts (two mmas: p to ~2^-16 relative, not bf16's 2^-8), V as the B operand
#    built with byte permutes from 16-byte loads of four slots;
#  - V rows of slots no query row attends are zeros (their contents may be NaN), K rows of
#    masked slots give scores that are then replaced by -inf.
# The partition state is the FMA kernel's ([BH, P, QR, 2] and [BH, P, QR, D], f32), merged by
# g4_attn_decode_merge_wide (below). Not the FMA kernel's bits (another summation order): within f32 rounding.
# Template: T, KT (bfloat16), D (256 | 512), G, M, WIN, NW (warps), TS (32), CMIN.
_MMA_HELPERS = r"""
// 8 bf16 (16 bytes) from global memory: one vector load when the arrays are 16-byte aligned
__device__ __forceinline__ uint4 g4_attn_ld16(const __nv_bfloat16* p, bool aligned) {
  if (aligned) return __ldg(reinterpret_cast<const uint4*>(p));
  const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
  uint32_t w[4];
  for (int i = 0; i < 4; ++i) w[i] = (uint32_t)__ldg(h + 2 * i) | ((uint32_t)__ldg(h + 2 * i + 1) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ uint32_t g4_u4(const uint4& u, int i) {
  return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}
// (x, y) -> bf16x2 hi = rn(x, y) and lo = rn(x - hi, y - hi): hi + lo holds ~16 significant bits
__device__ __forceinline__ void g4_attn_split(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x - hf.x, y - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}
"""
# Shared by the tensor-core kernels' texts: the partition of this block (an idle one returns),
# the query positions' range, and each warp's K / V bases.
_MMA_PARTITION = r"""
  const int bh = blockIdx.x;
  const int part = blockIdx.y;
  const int nparts = gridDim.y;
  const int S = k_shape[2];
  const int nslots = n_slots[0] < 0 ? 0 : (n_slots[0] > S ? S : n_slots[0]);
  const int chunk = g4_attn_chunk(nslots, nparts, CMIN, TS);
  const int start = part * chunk;
  if (start >= nslots) return;  // an idle partition (the whole block): the merge skips it
  const int end = start + chunk < nslots ? start + chunk : nslots;
  int qmin = qpos[0];
  int qmax = qpos[0];
  for (int m = 1; m < M; ++m) {
    qmin = qpos[m] < qmin ? qpos[m] : qmin;
    qmax = qpos[m] > qmax ? qpos[m] : qmax;
  }
""".lstrip("\n")
_MMA_KV_BASES = r"""
  const int d0 = w * DW;
  const bool aligned = ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k) |
                         reinterpret_cast<uintptr_t>(v)) & 15u) == 0;
  const __nv_bfloat16* kbase = k + (size_t)bh * S * D + d0;
  const __nv_bfloat16* vbase = v + (size_t)bh * S * D + d0;
""".lstrip("\n")
_MMA_BODY = r"""
  // gemma4-mlx attn_decode_mma: split-GQA decode attention over one sequence partition, on tensor cores
  constexpr int QR = G * M;     // query rows of the kv head: mma rows 0..QR-1 (the rest are zeros)
  constexpr int DW = D / NW;    // head dims of each warp
  constexpr int KB = DW / 32;   // 32-dim blocks of a warp's scores
  constexpr int VB = DW / 64;   // 64-dim blocks of a warp's values
  constexpr int NJ = TS / 8;    // 8-slot score tiles of a slot tile
  static_assert(TS == 32 && QR <= 16 && DW % 64 == 0, "attn_decode_mma: 32-slot tiles, <= 16 rows, 64-dim slices");
  const float NEG_INF = __int_as_float(0xff800000);
  __shared__ float4 s_part[2][NW][NJ][32];  // each warp's partial scores in fragment order, two buffers

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int w = tid >> 5;
  const int g = lane >> 2;  // fragment row (and row + 8), score slot, value dim
  const int t = lane & 3;
""" + _MMA_PARTITION + r"""  int qp[2];  // positions of rows g and g + 8 (-1: a padding row, attends nothing)
  qp[0] = g < QR ? qpos[g % M] : -1;
  qp[1] = g + 8 < QR ? qpos[(g + 8) % M] : -1;
""" + _MMA_KV_BASES + r"""  uint4 qf[KB][2];  // rows g, g + 8: dims d0 + 32 kb + 8t .. + 7
  _Pragma("unroll") for (int kb = 0; kb < KB; ++kb) {
    _Pragma("unroll") for (int h = 0; h < 2; ++h) {
      const int r = g + 8 * h;
      qf[kb][h] = r < QR ? g4_attn_ld16(q + ((size_t)bh * QR + r) * D + d0 + 32 * kb + 8 * t, aligned)
                         : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  float o[VB][8][4];  // value fragments: n-tile i holds dims d0 + 64 vb + 8 n + i, n = 2t, 2t + 1
  _Pragma("unroll") for (int vb = 0; vb < VB; ++vb) {
    _Pragma("unroll") for (int i = 0; i < 8; ++i) { _Pragma("unroll") for (int e = 0; e < 4; ++e) o[vb][i][e] = 0.0f; }
  }
  float m_run[2] = {NEG_INF, NEG_INF};
  float l_run[2] = {0.0f, 0.0f};  // this thread's share of each row's sum (the quad's add up)
  int buf = 0;

  for (int t0 = start; t0 < end; t0 += TS) {
    // positions of this thread's score slots t0 + 8j + 2t + e (also the value rows it loads)
    int kp[NJ][2];
    _Pragma("unroll") for (int j = 0; j < NJ; ++j) {
      _Pragma("unroll") for (int e = 0; e < 2; ++e) {
        const int s = t0 + 8 * j + 2 * t + e;
        kp[j][e] = s < end ? kpos[s] : -1;
      }
    }
    // (a) partial scores over this warp's dims: Q rows x the slots t0 + 8j + g
    float sc[NJ][4];
    _Pragma("unroll") for (int j = 0; j < NJ; ++j) {
      _Pragma("unroll") for (int e = 0; e < 4; ++e) sc[j][e] = 0.0f;
      const int s = t0 + 8 * j + g;
      _Pragma("unroll") for (int kb = 0; kb < KB; ++kb) {
        const uint4 kr = s < end ? g4_attn_ld16(kbase + (size_t)s * D + 32 * kb + 8 * t, aligned)
                                 : make_uint4(0u, 0u, 0u, 0u);
        g4_mma_bf16(sc[j], qf[kb][0].x, qf[kb][1].x, qf[kb][0].y, qf[kb][1].y, kr.x, kr.y);
        g4_mma_bf16(sc[j], qf[kb][0].z, qf[kb][1].z, qf[kb][0].w, qf[kb][1].w, kr.z, kr.w);
      }
      s_part[buf][w][j][lane] = make_float4(sc[j][0], sc[j][1], sc[j][2], sc[j][3]);
    }
    // the value rows of this thread's slots 16ks + 2t + {0, 1, 8, 9}, zeros where no row attends
    uint4 vr[2][VB][4];
    _Pragma("unroll") for (int ks = 0; ks < 2; ++ks) {
      _Pragma("unroll") for (int u = 0; u < 4; ++u) {
        const int j = 2 * ks + (u >> 1);
        const int p = kp[j][u & 1];
        const bool used = p >= 0 && p <= qmax && (WIN == 0 || qmin - p < WIN);
        const int s = t0 + 8 * j + 2 * t + (u & 1);
        _Pragma("unroll") for (int vb = 0; vb < VB; ++vb) {
          vr[ks][vb][u] = used ? g4_attn_ld16(vbase + (size_t)s * D + 64 * vb + 8 * g, aligned)
                               : make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
    __syncthreads();
    // (b) the tile's scores (warps summed in order), masked; online softmax of rows g and g + 8
    float sv[NJ][4];
    _Pragma("unroll") for (int j = 0; j < NJ; ++j) {
      float4 a = s_part[buf][0][j][lane];
      _Pragma("unroll") for (int ww = 1; ww < NW; ++ww) {
        const float4 b = s_part[buf][ww][j][lane];
        a.x += b.x;
        a.y += b.y;
        a.z += b.z;
        a.w += b.w;
      }
      sv[j][0] = a.x;
      sv[j][1] = a.y;
      sv[j][2] = a.z;
      sv[j][3] = a.w;
    }
    buf ^= 1;
    float alpha[2];
    _Pragma("unroll") for (int h = 0; h < 2; ++h) {
      float top = NEG_INF;
      _Pragma("unroll") for (int j = 0; j < NJ; ++j) {
        _Pragma("unroll") for (int e = 0; e < 2; ++e) {
          const int p = kp[j][e];
          const bool ok = p >= 0 && p <= qp[h] && (WIN == 0 || qp[h] - p < WIN);
          sv[j][2 * h + e] = ok ? sv[j][2 * h + e] : NEG_INF;
          top = sv[j][2 * h + e] > top ? sv[j][2 * h + e] : top;
        }
      }
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      const float m_new = m_run[h] > top ? m_run[h] : top;
      const bool live = m_new > NEG_INF;
      alpha[h] = live ? g4_attn_exp(m_run[h] - m_new) : 1.0f;
      float ps = 0.0f;
      _Pragma("unroll") for (int j = 0; j < NJ; ++j) {
        _Pragma("unroll") for (int e = 0; e < 2; ++e) {
          const float p = live ? g4_attn_exp(sv[j][2 * h + e] - m_new) : 0.0f;
          sv[j][2 * h + e] = p;
          ps += p;
        }
      }
      l_run[h] = l_run[h] * alpha[h] + ps;
      m_run[h] = m_new;
    }
    // (c) values: o = alpha o + P V, P as bf16 hi + lo
    _Pragma("unroll") for (int vb = 0; vb < VB; ++vb) {
      _Pragma("unroll") for (int i = 0; i < 8; ++i) {
        o[vb][i][0] *= alpha[0];
        o[vb][i][1] *= alpha[0];
        o[vb][i][2] *= alpha[1];
        o[vb][i][3] *= alpha[1];
      }
    }
    _Pragma("unroll") for (int ks = 0; ks < 2; ++ks) {
      uint32_t ah[4], al[4];  // A fragments: rows g, g + 8 x slots 16ks + 2t + {0, 1} and + {8, 9}
      g4_attn_split(sv[2 * ks][0], sv[2 * ks][1], ah[0], al[0]);
      g4_attn_split(sv[2 * ks][2], sv[2 * ks][3], ah[1], al[1]);
      g4_attn_split(sv[2 * ks + 1][0], sv[2 * ks + 1][1], ah[2], al[2]);
      g4_attn_split(sv[2 * ks + 1][2], sv[2 * ks + 1][3], ah[3], al[3]);
      _Pragma("unroll") for (int vb = 0; vb < VB; ++vb) {
        _Pragma("unroll") for (int i = 0; i < 8; ++i) {
          const uint32_t sel = (i & 1) ? 0x7632u : 0x5410u;  // element i of two rows -> one bf16x2
          const uint32_t b0 = __byte_perm(g4_u4(vr[ks][vb][0], i >> 1), g4_u4(vr[ks][vb][1], i >> 1), sel);
          const uint32_t b1 = __byte_perm(g4_u4(vr[ks][vb][2], i >> 1), g4_u4(vr[ks][vb][3], i >> 1), sel);
          g4_mma_bf16(o[vb][i], ah[0], ah[1], ah[2], ah[3], b0, b1);
          g4_mma_bf16(o[vb][i], al[0], al[1], al[2], al[3], b0, b1);
        }
      }
    }
  }

  _Pragma("unroll") for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  const size_t base = ((size_t)bh * nparts + part) * QR;
  _Pragma("unroll") for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (r < QR) {
      if (w == 0 && t == 0) {
        ml[(base + r) * 2] = m_run[h];
        ml[(base + r) * 2 + 1] = l_run[h];
      }
      _Pragma("unroll") for (int vb = 0; vb < VB; ++vb) {
        _Pragma("unroll") for (int i = 0; i < 8; ++i) {
          _Pragma("unroll") for (int e = 0; e < 2; ++e) {
            pacc[(base + r) * D + d0 + 64 * vb + 8 * (2 * t + e) + i] = o[vb][i][2 * h + e];
          }
        }
      }
    }
  }
"""

# The merge of the tensor-core kernel's partitions (CUDA only): g4_attn_decode_merge gives each
# output row one thread block whose threads walk every partition, 8 loads at a time, so a full
# layer with one or two kv heads (12B: 16 rows, 264 partitions) is a long chain of L2 round trips
# in 16-32 thread blocks. Here a block takes 128 dims of a row and its 8 warps split the
# partitions (warp w: w, w + 8, ...; 8 in flight per warp), then warp 0 adds the warps' sums in
# warp order (deterministic) and normalizes. Template: T (output), D, QR, TS, CMIN (the partial
# kernel's); grid x = 256 threads x rows x D / 128.
_MERGE_WIDE_BODY = r"""
  // gemma4-mlx attn_decode_merge_wide: 8 warps split one row's partitions, then their sums in order
  constexpr int NWM = 8;        // warps
  constexpr int LB = 8;         // partitions a warp loads before adding them
  constexpr int CG = D / 128;   // 128-dim column groups of a row
  __shared__ float top_s[NWM];
  __shared__ float4 a_s[NWM][32];
  __shared__ float tot_s[NWM];
  const float NEG_INF = __int_as_float(0xff800000);
  const int row = blockIdx.x / CG;  // (b * n_kv + kv head) * QR + r
  const int col = (blockIdx.x % CG) * 128 + 4 * (threadIdx.x & 31);
  const int bh = row / QR;
  const int r = row % QR;
  const int lane = threadIdx.x & 31;
  const int w = threadIdx.x >> 5;
  const int nparts = ml_shape[1];
  const int nslots = n_slots[0] < 0 ? 0 : n_slots[0];
  const int chunk = g4_attn_chunk(nslots, nparts, CMIN, TS);
  int nactive = (nslots + chunk - 1) / chunk;
  nactive = nactive < nparts ? nactive : nparts;
  const size_t base = (size_t)bh * nparts * QR + r;  // partition p: base + p * QR
  float top = NEG_INF;
  for (int p = threadIdx.x; p < nactive; p += 32 * NWM) top = fmaxf(top, ml[(base + (size_t)p * QR) * 2]);
  _Pragma("unroll") for (int o = 16; o >= 1; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
  if (lane == 0) top_s[w] = top;
  __syncthreads();
  top = top_s[0];
  _Pragma("unroll") for (int i = 1; i < NWM; ++i) top = fmaxf(top, top_s[i]);
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float total = 0.0f;
  for (int p0 = w; p0 < nactive; p0 += NWM * LB) {
    float4 x[LB];
    float mp[LB];
    float lp[LB];
    _Pragma("unroll") for (int u = 0; u < LB; ++u) {
      const int p = p0 + NWM * u;
      mp[u] = NEG_INF;
      if (p < nactive) {
        const size_t i = base + (size_t)p * QR;
        mp[u] = ml[i * 2];
        lp[u] = ml[i * 2 + 1];
        x[u] = *reinterpret_cast<const float4*>(pacc + i * D + col);
      }
    }
    _Pragma("unroll") for (int u = 0; u < LB; ++u) {
      if (mp[u] > NEG_INF) {  // idle rows (no key in the partition) weigh 0
        const float wt = g4_attn_exp(mp[u] - top);
        total += wt * lp[u];
        a[0] += wt * x[u].x;
        a[1] += wt * x[u].y;
        a[2] += wt * x[u].z;
        a[3] += wt * x[u].w;
      }
    }
  }
  a_s[w][lane] = make_float4(a[0], a[1], a[2], a[3]);
  if (lane == 0) tot_s[w] = total;
  __syncthreads();
  if (w == 0) {
    float4 sum = a_s[0][lane];
    float tsum = tot_s[0];
    _Pragma("unroll") for (int i = 1; i < NWM; ++i) {
      const float4 b = a_s[i][lane];
      sum.x += b.x;
      sum.y += b.y;
      sum.z += b.z;
      sum.w += b.w;
      tsum += tot_s[i];
    }
    T* o = out + (size_t)row * D + col;
    o[0] = static_cast<T>(tsum > 0.0f ? sum.x / tsum : 0.0f);
    o[1] = static_cast<T>(tsum > 0.0f ? sum.y / tsum : 0.0f);
    o[2] = static_cast<T>(tsum > 0.0f ? sum.z / tsum : 0.0f);
    o[3] = static_cast<T>(tsum > 0.0f ? sum.w / tsum : 0.0f);
  }
"""
_MERGE_WIDE = KernelSource("g4_attn_decode_merge_wide", _MERGE.input_names, _MERGE.output_names,
                           {"metal": ("", ""), "cuda": (_text("")["cuda"][0], _local(_MERGE_WIDE_BODY, "cuda"))})  # fmt: skip


def _mma_text(body: str, bulk: bool = False) -> tuple[str, str]:
    """(header, source) of a tensor-core decode-attention kernel: the attention prelude, g4_mma_bf16,
    with ``bulk`` the cp.async / mbarrier / bulk-copy helpers, and _MMA_HELPERS."""
    from .quant_matvec import _MBAR_BULK_CUDA, _MMA_HEADER_CUDA, _STREAM_CP_ASYNC_CUDA

    extra = _STREAM_CP_ASYNC_CUDA + _MBAR_BULK_CUDA if bulk else ""
    return _text("")["cuda"][0] + _MMA_HEADER_CUDA + extra + _MMA_HELPERS, _local(body, "cuda")


_MMA = KernelSource("g4_attn_decode_mma", _PARTIAL.input_names, _PARTIAL.output_names,
                    {"metal": ("", ""), "cuda": _mma_text(_MMA_BODY)})  # fmt: skip
MMA_ARCH = 80
"""Compute capability the tensor-core kernel needs (bf16 mma.sync)."""

# The tensor-core kernel for at most 8 query rows per kv head (family "attention_mma8", CUDA
# sm_80+; written in session 28, a default since session 29). With 8 rows or fewer (31B's and
# 26B-A4B's full layers: 8, E4B's: 4, 31B's sliding layers: 2) g4_attn_decode_mma's 16 mma rows are
# half padding: half its value mmas and accumulators are zero rows (at E4B's 4 rows it needs 138
# registers: one 256-thread block per SM). Here the products are transposed: the slots (scores) and head dims
# (values) are the mma's 16 rows and the query rows its 8 columns:
#  - scores S^T = K Q^T per 16 slots (K rows as the A operand, the same permuted 32-dim blocks as
#    g4_attn_decode_mma), summed across the warps through shared memory stored as [row][slot], so
#    the read-back is already the B-operand layout of the value product (lane g, t: row g, slots
#    2t, 2t + 1, 2t + 8, 2t + 9 of each 16);
#  - values O^T = V^T P^T: V as the A operand (lane g of each 16-dim tile: dims 8g + 2i and
#    8g + 2i + 1 of a 16-byte load, byte-permuted across slot pairs), P (f32, exact online softmax
#    of row g) as bf16 hi + lo B operands; the accumulator's columns are rows 2t, 2t + 1, which take
#    their softmax rescale from lanes 8t and 8t + 4 by shuffle.
# The partition state and merge are g4_attn_decode_mma's. Template: T, KT (bfloat16), D (256 |
# 512), G, M (G * M <= 8), WIN, NW (warps, D / NW a multiple of 64), TS (32), CMIN.
_MMA8_BODY = r"""
  // gemma4-mlx attn_decode_mma8: split-GQA decode attention over one sequence partition, on tensor cores, <= 8 rows
  constexpr int QR = G * M;     // query rows of the kv head: mma columns 0..QR-1 (the rest are zeros)
  constexpr int DW = D / NW;    // head dims of each warp
  constexpr int KB = DW / 32;   // 32-dim blocks of a warp's scores
  constexpr int VB = DW / 64;   // 64-dim blocks of a warp's values
  constexpr int SP = 40;        // floats per row of the score exchange: 32 slots + 8 (float2 reads without conflicts)
  static_assert(TS == 32 && QR <= 8 && DW % 64 == 0, "attn_decode_mma8: 32-slot tiles, <= 8 rows, 64-dim slices");
  const float NEG_INF = __int_as_float(0xff800000);
  __shared__ __align__(16) float s_part[2][NW][8][SP];  // each warp's partial scores [row][slot], two buffers

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int w = tid >> 5;
  const int g = lane >> 2;  // score slot (and slot + 8), query row of the value product, value dims 8g..8g+7
  const int t = lane & 3;   // query rows 2t, 2t + 1 of the products' outputs
""" + _MMA_PARTITION + r"""  const int qg = g < QR ? qpos[g % M] : -1;  // position of row g (-1: a padding row, attends nothing)
""" + _MMA_KV_BASES + r"""  uint4 qf[KB];  // row g: dims d0 + 32 kb + 8t .. + 7 (the score product's B operand)
  _Pragma("unroll") for (int kb = 0; kb < KB; ++kb) {
    qf[kb] = g < QR ? g4_attn_ld16(q + ((size_t)bh * QR + g) * D + d0 + 32 * kb + 8 * t, aligned)
                    : make_uint4(0u, 0u, 0u, 0u);
  }
  float o[VB][4][4];  // value tile i: rows 2t, 2t + 1 x dims d0 + 64 vb + 8g + 2i (e 0, 1) and + 1 (e 2, 3)
  _Pragma("unroll") for (int vb = 0; vb < VB; ++vb) {
    _Pragma("unroll") for (int i = 0; i < 4; ++i) { _Pragma("unroll") for (int e = 0; e < 4; ++e) o[vb][i][e] = 0.0f; }
  }
  float m_run = NEG_INF;
  float l_run = 0.0f;  // this thread's share of row g's sum (the quad's add up)
  int buf = 0;

  for (int t0 = start; t0 < end; t0 += TS) {
    // positions of this thread's value slots t0 + 16ks + 2t + {0, 1, 8, 9} (row g's scores after the exchange)
    int kp[2][4];
    _Pragma("unroll") for (int ks = 0; ks < 2; ++ks) {
      _Pragma("unroll") for (int u = 0; u < 4; ++u) {
        const int s = t0 + 16 * ks + 2 * t + (u & 1) + 8 * (u >> 1);
        kp[ks][u] = s < end ? kpos[s] : -1;
      }
    }
    // (a) partial scores over this warp's dims: slots t0 + 16mt + g (+ 8) x query rows 2t, 2t + 1
    _Pragma("unroll") for (int mt = 0; mt < 2; ++mt) {
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const int sa = t0 + 16 * mt + g;
      const int sb = sa + 8;
      _Pragma("unroll") for (int kb = 0; kb < KB; ++kb) {
        const uint4 ka = sa < end ? g4_attn_ld16(kbase + (size_t)sa * D + 32 * kb + 8 * t, aligned)
                                  : make_uint4(0u, 0u, 0u, 0u);
        const uint4 kc = sb < end ? g4_attn_ld16(kbase + (size_t)sb * D + 32 * kb + 8 * t, aligned)
                                  : make_uint4(0u, 0u, 0u, 0u);
        g4_mma_bf16(sc, ka.x, kc.x, ka.y, kc.y, qf[kb].x, qf[kb].y);
        g4_mma_bf16(sc, ka.z, kc.z, ka.w, kc.w, qf[kb].z, qf[kb].w);
      }
      float* sp = &s_part[buf][w][0][0];
      sp[(2 * t) * SP + 16 * mt + g] = sc[0];
      sp[(2 * t + 1) * SP + 16 * mt + g] = sc[1];
      sp[(2 * t) * SP + 16 * mt + g + 8] = sc[2];
      sp[(2 * t + 1) * SP + 16 * mt + g + 8] = sc[3];
    }
    // the value rows of this thread's slots, zeros where no row attends
    uint4 vr[2][VB][4];
    _Pragma("unroll") for (int ks = 0; ks < 2; ++ks) {
      _Pragma("unroll") for (int u = 0; u < 4; ++u) {
        const int p = kp[ks][u];
        const bool used = p >= 0 && p <= qmax && (WIN == 0 || qmin - p < WIN);
        const int s = t0 + 16 * ks + 2 * t + (u & 1) + 8 * (u >> 1);
        _Pragma("unroll") for (int vb = 0; vb < VB; ++vb) {
          vr[ks][vb][u] = used ? g4_attn_ld16(vbase + (size_t)s * D + 64 * vb + 8 * g, aligned)
                               : make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
    __syncthreads();
    // (b) row g's scores of the tile (warps summed in order), masked; its online softmax
    float sv[2][4];
    _Pragma("unroll") for (int ks = 0; ks < 2; ++ks) {
      float2 lo = *reinterpret_cast<const float2*>(&s_part[buf][0][g][16 * ks + 2 * t]);
      float2 hi = *reinterpret_cast<const float2*>(&s_part[buf][0][g][16 * ks + 2 * t + 8]);
      _Pragma("unroll") for (int ww = 1; ww < NW; ++ww) {
        const float2 a = *reinterpret_cast<const float2*>(&s_part[buf][ww][g][16 * ks + 2 * t]);
        const float2 b = *reinterpret_cast<const float2*>(&s_part[buf][ww][g][16 * ks + 2 * t + 8]);
        lo.x += a.x;
        lo.y += a.y;
        hi.x += b.x;
        hi.y += b.y;
      }
      sv[ks][0] = lo.x;
      sv[ks][1] = lo.y;
      sv[ks][2] = hi.x;
      sv[ks][3] = hi.y;
    }
    buf ^= 1;
    float top = NEG_INF;
    _Pragma("unroll") for (int ks = 0; ks < 2; ++ks) {
      _Pragma("unroll") for (int u = 0; u < 4; ++u) {
        const int p = kp[ks][u];
        const bool ok = p >= 0 && p <= qg && (WIN == 0 || qg - p < WIN);
        sv[ks][u] = ok ? sv[ks][u] : NEG_INF;
        top = sv[ks][u] > top ? sv[ks][u] : top;
      }
    }
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
    const float m_new = m_run > top ? m_run : top;
    const bool live = m_new > NEG_INF;
    const float alpha = live ? g4_attn_exp(m_run - m_new) : 1.0f;
    float ps = 0.0f;
    _Pragma("unroll") for (int ks = 0; ks < 2; ++ks) {
      _Pragma("unroll") for (int u = 0; u < 4; ++u) {
        const float p = live ? g4_attn_exp(sv[ks][u] - m_new) : 0.0f;
        sv[ks][u] = p;
        ps += p;
      }
    }
    l_run = l_run * alpha + ps;
    m_run = m_new;
    // (c) values: o = alpha o + (P V)^T, the rescale of rows 2t and 2t + 1 from lanes 8t and 8t + 4
    const float alpha0 = __shfl_sync(0xffffffffu, alpha, 8 * t);
    const float alpha1 = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
    _Pragma("unroll") for (int vb = 0; vb < VB; ++vb) {
      _Pragma("unroll") for (int i = 0; i < 4; ++i) {
        o[vb][i][0] *= alpha0;
        o[vb][i][1] *= alpha1;
        o[vb][i][2] *= alpha0;
        o[vb][i][3] *= alpha1;
      }
    }
    _Pragma("unroll") for (int ks = 0; ks < 2; ++ks) {
      uint32_t bh0, bl0, bh1, bl1;  // B fragments: row g x slots 16ks + 2t + {0, 1} and + {8, 9}, hi and lo
      g4_attn_split(sv[ks][0], sv[ks][1], bh0, bl0);
      g4_attn_split(sv[ks][2], sv[ks][3], bh1, bl1);
      _Pragma("unroll") for (int vb = 0; vb < VB; ++vb) {
        _Pragma("unroll") for (int i = 0; i < 4; ++i) {
          // A fragments: dims 8g + 2i (row g) and 8g + 2i + 1 (row g + 8) x slot pairs (2t, 2t + 1), (2t + 8, 2t + 9)
          const uint32_t w0 = g4_u4(vr[ks][vb][0], i), w1 = g4_u4(vr[ks][vb][1], i);
          const uint32_t w2 = g4_u4(vr[ks][vb][2], i), w3 = g4_u4(vr[ks][vb][3], i);
          const uint32_t a0 = __byte_perm(w0, w1, 0x5410u), a1 = __byte_perm(w0, w1, 0x7632u);
          const uint32_t a2 = __byte_perm(w2, w3, 0x5410u), a3 = __byte_perm(w2, w3, 0x7632u);
          g4_mma_bf16(o[vb][i], a0, a1, a2, a3, bh0, bh1);
          g4_mma_bf16(o[vb][i], a0, a1, a2, a3, bl0, bl1);
        }
      }
    }
  }

  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  const size_t base = ((size_t)bh * nparts + part) * QR;
  if (w == 0 && t == 0 && g < QR) {
    ml[(base + g) * 2] = m_run;
    ml[(base + g) * 2 + 1] = l_run;
  }
  _Pragma("unroll") for (int e = 0; e < 2; ++e) {
    const int r = 2 * t + e;
    if (r < QR) {
      _Pragma("unroll") for (int vb = 0; vb < VB; ++vb) {
        float4* dst = reinterpret_cast<float4*>(pacc + (base + r) * D + d0 + 64 * vb + 8 * g);
        dst[0] = make_float4(o[vb][0][e], o[vb][0][2 + e], o[vb][1][e], o[vb][1][2 + e]);
        dst[1] = make_float4(o[vb][2][e], o[vb][2][2 + e], o[vb][3][e], o[vb][3][2 + e]);
      }
    }
  }
"""


_MMA8 = KernelSource("g4_attn_decode_mma8", _PARTIAL.input_names, _PARTIAL.output_names,
                     {"metal": ("", ""), "cuda": _mma_text(_MMA8_BODY)})  # fmt: skip
MMA8_MAX_ROWS = 8
"""Query rows per kv head g4_attn_decode_mma8 takes: the mma's 8 columns."""

# The tensor-core kernel with each tile's K and V rows brought into shared memory by bulk copies,
# ST stages (tiles) ahead (family "attention_mma_staged", CUDA on Hopper; written in session 27, its
# registry cases passed on the H200 in session 28, a default since session 29). g4_attn_decode_mma
# loads a tile's K rows, runs the score mmas, loads its V rows and runs the value mmas: two memory
# waits per 32-slot tile, 40% of copy at 31B's full layer at 32K. Here warp 0's lanes copy one K and
# one V row each (RS bytes apart: 16 bytes of padding move each row 4 banks), the tile at slot t
# lands in stage (tile index % ST) and completes that stage's mbarrier; tile i + ST - 1 is issued
# once every warp has passed tile i's score barrier (so all of tile i - 1, the stage's last user, is
# done). The fragments are read from shared memory with the same layout and arithmetic as the
# unstaged kernel (the same bits). Arrays off 16-byte alignment take the unstaged loads.
# Template: the mma kernel's plus ST (stages) and RP (row padding, bytes); dynamic shared memory
# mma_staged_shared_bytes(D, ST, RP); ST and RP are AttentionConfig's stages and row_pad.
_MMA_STAGED_SETUP = r"""
  // staged: stage st holds a tile's TS K rows, then its TS V rows, RS bytes apart
  constexpr int RS = 2 * D + RP;
  constexpr int STAGE = 2 * TS * RS;
  extern __shared__ __align__(128) uint8_t kv_st[];
  __shared__ __align__(8) uint64_t kv_bar[ST];
  const bool staged = aligned;  // bulk copies take 16-byte aligned rows
  const uint32_t bar0 = g4_shared_addr(&kv_bar[0]);
  auto issue = [&](int tile) {  // warp 0: the tile starting at start + tile TS, into stage tile % ST
    const int t1 = start + tile * TS;
    if (t1 >= end) return;
    const int rows = end - t1 < TS ? end - t1 : TS;
    const int st = tile % ST;
    if (lane == 0) g4_mbar_expect_tx(bar0 + 8 * st, (uint32_t)(2 * rows * 2 * D));
    __syncwarp();
    if (lane < rows) {
      const uint32_t dst = g4_shared_addr(kv_st) + (uint32_t)(st * STAGE + lane * RS);
      const size_t row = ((size_t)bh * S + t1 + lane) * D;
      g4_bulk_copy(dst, reinterpret_cast<const uint8_t*>(k + row), 2 * D, bar0 + 8 * st);
      g4_bulk_copy(dst + TS * RS, reinterpret_cast<const uint8_t*>(v + row), 2 * D, bar0 + 8 * st);
    }
  };
  if (staged && w == 0) {
    if (lane == 0) {
      _Pragma("unroll") for (int st = 0; st < ST; ++st) g4_mbar_init(bar0 + 8 * st, 1);
      g4_mbar_init_fence();
    }
    __syncwarp();
    _Pragma("unroll") for (int tile = 0; tile < ST - 1; ++tile) issue(tile);
  }
  __syncthreads();  // the barriers are initialized before any warp waits on them
  int it = 0;  // tile index in the partition
"""
_MMA_STAGED_EDITS = (
    ("  // gemma4-mlx attn_decode_mma: split-GQA decode attention over one sequence partition, on tensor cores\n",
     "  // gemma4-mlx attn_decode_mma_staged: the tensor-core kernel, K and V tiles bulk-copied ST tiles ahead\n"),
    ("  const __nv_bfloat16* vbase = v + (size_t)bh * S * D + d0;\n",
     "  const __nv_bfloat16* vbase = v + (size_t)bh * S * D + d0;\n" + _MMA_STAGED_SETUP),
    ("  for (int t0 = start; t0 < end; t0 += TS) {\n",
     "  for (int t0 = start; t0 < end; t0 += TS) {\n"
     "    const uint8_t* kst = kv_st + (it % ST) * STAGE + 2 * d0;  // this tile's K rows (V: + TS RS)\n"
     "    if (staged) g4_mbar_wait(bar0 + 8 * (it % ST), (uint32_t)((it / ST) & 1));\n"),
    ("        const uint4 kr = s < end ? g4_attn_ld16(kbase + (size_t)s * D + 32 * kb + 8 * t, aligned)\n"
     "                                 : make_uint4(0u, 0u, 0u, 0u);\n",
     "        const uint4 kr = s >= end ? make_uint4(0u, 0u, 0u, 0u)\n"
     "                         : staged ? *reinterpret_cast<const uint4*>(kst + (s - t0) * RS + 2 * (32 * kb + 8 * t))\n"
     "                         : g4_attn_ld16(kbase + (size_t)s * D + 32 * kb + 8 * t, aligned);\n"),
    ("          vr[ks][vb][u] = used ? g4_attn_ld16(vbase + (size_t)s * D + 64 * vb + 8 * g, aligned)\n"
     "                               : make_uint4(0u, 0u, 0u, 0u);\n",
     "          vr[ks][vb][u] = !used ? make_uint4(0u, 0u, 0u, 0u)\n"
     "                          : staged ? *reinterpret_cast<const uint4*>(kst + (TS + s - t0) * RS + 2 * (64 * vb + 8 * g))\n"
     "                          : g4_attn_ld16(vbase + (size_t)s * D + 64 * vb + 8 * g, aligned);\n"),
    # every warp is past tile it - 1, the last user of stage (it + ST - 1) % ST: refill it
    ("    __syncthreads();\n    // (b) the tile's scores",
     "    __syncthreads();\n"
     "    if (staged && w == 0) {\n"
     "      asm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\");\n"
     "      issue(it + ST - 1);\n"
     "    }\n"
     "    // (b) the tile's scores"),
    ("        }\n      }\n    }\n  }\n\n  _Pragma(\"unroll\") for (int h = 0; h < 2; ++h) {\n    l_run[h] += __shfl_xor_sync",
     "        }\n      }\n    }\n    ++it;\n  }\n\n  _Pragma(\"unroll\") for (int h = 0; h < 2; ++h) {\n    l_run[h] += __shfl_xor_sync"),
)


def _mma_staged_body() -> str:
    """_MMA_BODY with the staged loads (_MMA_STAGED_EDITS, each applied exactly once)."""
    body = _MMA_BODY
    for old, new in _MMA_STAGED_EDITS:
        assert body.count(old) == 1, old
        body = body.replace(old, new)
    return body


_MMA_STAGED = KernelSource("g4_attn_decode_mma_staged", _PARTIAL.input_names, _PARTIAL.output_names,
                           {"metal": ("", ""), "cuda": _mma_text(_mma_staged_body(), bulk=True)})  # fmt: skip
MMA_SHARED_LIMIT = 227 * 1024
"""Shared memory one thread block may have on Hopper (static + dynamic, bytes)."""


def mma_staged_shared_bytes(head_dim: int, stages: int, row_pad: int) -> int:
    """Dynamic shared memory of g4_attn_decode_mma_staged: ST stages of 32 K and 32 V rows of
    2 x head_dim + RP bytes."""
    return stages * 2 * 32 * (2 * head_dim + row_pad)

MMA_MAX_ROWS = 16
"""Query rows per kv head (G x M) the tensor-core kernel takes: the mma's 16 rows."""
MMA_MIN_ROWS = 8
"""Query rows per kv head from which decode_attention takes the tensor-core kernel (with ``mma``):
measured on the H200 (bench/NOTES.md, session 27), it beat the f32-FMA kernel on the full layers
with 8 and 16 rows (31B, 26B-A4B, 12B) but not on E4B's with 4 (171 against 127 us at 32K)."""
MMA_STAGED_MIN_ROWS = 4
"""The same for its staged form (``mma_staged`` on Hopper): E4B's full layers (4 rows) 104 against
134 us at 32K, 39 against 48 at 4K; the sliding layers' 2 rows did not gain (session 28)."""
MMA8_MIN_ROWS = 4
"""The same for g4_attn_decode_mma8 (``mma8``, 4..8 rows): E4B's full layers (4 rows), partial +
merge, 34 against the f32-FMA kernels' 41 us at 4K and 69 against 137 at 32K (session 29). The
sliding layers take the FMA one launch before this rule applies (31B's 2 rows: mma8 28 against 35
us per call alone, but 96.4 against 98.1 tok/s in the step, session 29; E4B's 4 rows likewise);
E2B's, whose merge is too large for the one launch, take mma8 (8 rows; not measured)."""

ATTENTION_COUNTER_WORDS = 256
"""uint32 words of an attention layer's counters: one per (batch x kv head, query tile) group."""


def new_attention_counters() -> mx.array:
    """The zeroed uint32 counters one sequence of fused decode-attention calls shares (one per
    layer): custom_kernels.ticket_counters."""
    return ticket_counters(ATTENTION_COUNTER_WORDS)


# --------------------------------------------------------------------------------------------
# Launch planning
# --------------------------------------------------------------------------------------------

_SHARED_LIMIT = {"cuda": 48 * 1024, "metal": 32 * 1024}  # static threadgroup memory per threadgroup


@dataclass(frozen=True)
class AttentionConfig:
    """Geometry: ``rows`` query rows per threadgroup at most (QT), ``simd_groups`` (NSG),
    ``tile`` slots per tile (TS), ``min_chunk`` slots per partition at least (CMIN),
    ``target_groups`` threadgroups to aim for at full length when choosing the partition count,
    ``max_parts`` partitions at most (long caches then get longer partitions), and
    ``min_groups``, which lifts that cap so a layer with few K/V heads still gets that many
    threadgroups when its cache is long enough and ``target_groups`` is at least as large (so a
    strict ``max_parts`` needs ``min_groups=0`` too). ``stages`` and ``row_pad`` are
    g4_attn_decode_mma_staged's ST (tiles of K and V rows in flight) and RP (bytes between staged
    rows beyond the row itself: 16 moves each row 4 banks; 3 stages fit at D = 512 unpadded only)."""

    rows: int = 16
    simd_groups: int = 4
    tile: int = 32
    min_chunk: int = 256
    target_groups: int = 512
    max_parts: int = 4096
    min_groups: int = 0
    stages: int = 2
    row_pad: int = 16

    def __post_init__(self):
        if not 1 <= self.rows <= 64:
            raise ValueError("rows must be 1..64")
        if self.simd_groups not in (1, 2, 4, 8):
            raise ValueError("simd_groups must be 1, 2, 4 or 8")
        if self.tile < 8 or self.tile % 8:
            raise ValueError("tile must be a positive multiple of 8")
        if self.min_chunk < self.tile or self.min_chunk % self.tile:
            raise ValueError("min_chunk must be a positive multiple of tile")
        if self.target_groups < 1:
            raise ValueError("target_groups must be positive")
        if self.max_parts < 1:
            raise ValueError("max_parts must be positive")
        if self.min_groups < 0:
            raise ValueError("min_groups must be >= 0")
        if self.stages < 2:
            raise ValueError("stages must be >= 2")
        if self.row_pad < 0 or self.row_pad % 16:
            raise ValueError("row_pad must be a multiple of 16 bytes (the bulk copies' alignment)")


GEOMETRY_ENV = "GEMMA4_MLX_ATTENTION_GEOMETRY"
"""AttentionConfig fields over default_config's, e.g. "min_chunk=64,target_groups=2048" (tuning)."""


def default_config(head_dim: int, which: str | None = None) -> AttentionConfig:
    """Geometry per backend: 4 SIMD groups; query rows in threadgroup memory as f32 limited to 32 KB
    on CUDA (static shared memory < 48 KB) and 16 KB on Metal (32 KB in all). CUDA (measured on the
    H200, bench/NOTES.md 2026-11-30): partitions of one 32-slot tile, up to 4096 threadgroups and
    at most 512 partitions, since each threadgroup walks its tiles one after another and the GPU
    must hold thousands of them to keep HBM busy; a layer with one K/V head (12B's full layers)
    may take 1024 partitions (min_groups; 12B at 128K, session 11). Metal (not measured):
    partitions of at least 256 slots, about 128 threadgroups. GEMMA4_MLX_ATTENTION_GEOMETRY
    overrides fields."""
    which = which or backend()
    budget = 16 * 1024 if which == "metal" else 32 * 1024
    rows = max(1, min(32, budget // (4 * head_dim)))
    if which == "metal":
        cfg = AttentionConfig(rows=rows, simd_groups=4, tile=32, min_chunk=256, target_groups=128)
    else:
        cfg = AttentionConfig(rows=rows, simd_groups=4, tile=32, min_chunk=32, target_groups=4096, max_parts=512,
                              min_groups=1024)
    return geometry_override(cfg, GEOMETRY_ENV)


def partition_layout(n_slots: int, parts: int, min_chunk: int, tile: int) -> tuple[int, int]:
    """(chunk, active partitions) for ``n_slots`` valid slots: the device-side rule of both kernels."""
    n_slots = max(0, n_slots)
    chunk = max(min_chunk, -(-n_slots // parts))
    chunk = -(-chunk // tile) * tile
    return chunk, min(parts, -(-n_slots // chunk))


@dataclass(frozen=True)
class DecodePlan:
    """Both launches of one decode-attention call."""

    partial_template: list  # [(name, dtype name | int)]
    partial_grid: tuple[int, int, int]
    partial_threadgroup: tuple[int, int, int]
    partial_shapes: list  # [(BH, P, QR, 2), (BH, P, QR, D)]
    merge_template: list
    merge_grid: tuple[int, int, int]
    merge_threadgroup: tuple[int, int, int]
    out_shape: tuple[int, int, int, int]
    parts: int
    shared_bytes: int
    merge_bytes: int  # partial state one (kv head, query tile) group's merge reads: P x QT x D x 4
    dynamic_bytes: int = 0  # the partial kernel's dynamic shared memory (CUDA)


def plan_decode(batch: int, n_q: int, n_kv: int, m: int, slots: int, head_dim: int, q_dtype: str, kv_dtype: str,
                window: int | None, config: AttentionConfig | None = None,
                which: str | None = None) -> DecodePlan:  # fmt: skip
    """Launch plan for q [batch, n_q, m, head_dim] over caches [batch, n_kv, slots, head_dim]."""
    which = which or backend()
    if which not in _SHARED_LIMIT:
        which = "cuda"  # CPU planning (tests): the CUDA limits
    if head_dim not in KERNEL_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} not in {KERNEL_HEAD_DIMS}")
    if not 1 <= m <= MAX_QUERY_ROWS:
        raise ValueError(f"query rows {m} outside 1..{MAX_QUERY_ROWS}")
    cfg = config or default_config(head_dim, which)
    g = n_q // n_kv
    qr = g * m
    bh = batch * n_kv
    dv = head_dim // 4
    common = [("T", q_dtype), ("KT", kv_dtype), ("D", head_dim), ("G", g), ("M", m), ("WIN", int(window or 0))]
    # query tiles of QT rows, NSG SIMD groups sharing each K/V tile
    qt = min(cfg.rows, qr)
    nt, zs = 32 * cfg.simd_groups, -(-qr // qt)
    if nt < dv or nt % dv:
        raise ValueError(f"{nt} threads cannot cover head dim {head_dim} in 4-element vectors "
                         f"(need a multiple of {dv})")  # fmt: skip
    shared = 4 * (qt * head_dim + qt * cfg.tile + qt + cfg.tile)
    if shared > _SHARED_LIMIT[which]:
        raise ValueError(f"{shared} bytes of threadgroup memory exceed {which}'s {_SHARED_LIMIT[which]}")
    template = common + [("QT", qt), ("TS", cfg.tile), ("NSG", cfg.simd_groups), ("CMIN", cfg.min_chunk)]
    # partitions: enough to reach target_groups threadgroups, within [1, slots / min_chunk], <= max_parts
    # (lifted so that the grid keeps min_groups threadgroups)
    cap = max(cfg.max_parts, -(-cfg.min_groups // (bh * zs)))
    parts = max(1, min(-(-slots // cfg.min_chunk), -(-cfg.target_groups // (bh * zs)), cap))
    return DecodePlan(
        partial_template=template,
        partial_grid=(nt * bh, parts, zs),
        partial_threadgroup=(nt, 1, 1),
        partial_shapes=[(bh, parts, qr, 2), (bh, parts, qr, head_dim)],
        merge_template=[("T", q_dtype), ("D", head_dim), ("QR", qr), ("TS", cfg.tile), ("CMIN", cfg.min_chunk)],
        merge_grid=(dv * bh * qr, 1, 1),
        merge_threadgroup=(dv, 1, 1),
        out_shape=(batch, n_q, m, head_dim),
        parts=parts,
        shared_bytes=shared,
        merge_bytes=4 * parts * qt * head_dim,
    )


# --------------------------------------------------------------------------------------------
# Launch and dispatch
# --------------------------------------------------------------------------------------------

def _slots_array(n_slots, slots: int) -> mx.array:
    """int32 [1] valid-slot bound in [0, slots], always the output of a GPU op (Full or Clip): on the
    H200 the sliding partials ran at half speed in some processes while their bound was a constant
    the host had written once, and at full speed in every run with a bound made on the GPU each
    step (bench/NOTES.md, sessions 15 and 16)."""
    if n_slots is None or isinstance(n_slots, (int, np.integer)):
        n = slots if n_slots is None else min(max(int(n_slots), 0), slots)
        return mx.full((1,), n, dtype=mx.int32)
    return mx.clip(n_slots.astype(mx.int32).reshape(1), 0, slots)


def _fused_shared_bytes(plan: DecodePlan) -> int:
    """Static shared memory of g4_attn_decode: the partial kernel's, the merge's (m, l) arrays and
    the last-partition flag."""
    return plan.shared_bytes + 8 * (FUSED_MERGE_BYTES // 4 // dict(plan.partial_template)["D"]) + 4


def fused_supported(plan: DecodePlan) -> bool:
    """True when a call with this plan may take the one-launch kernel g4_attn_decode: a CUDA build,
    a merge of at most FUSED_MERGE_BYTES per group, a counter word for each group, and the partial
    kernel's threadgroup memory plus the merge's within the CUDA limit."""
    groups = plan.partial_grid[0] // plan.partial_threadgroup[0] * plan.partial_grid[2]
    return (backend() == "cuda" and plan.merge_bytes <= FUSED_MERGE_BYTES and groups <= ATTENTION_COUNTER_WORDS
            and _fused_shared_bytes(plan) <= _SHARED_LIMIT["cuda"])  # fmt: skip


def staged_shared_bytes(plan: DecodePlan) -> int:
    """Static shared memory of g4_attn_decode_staged: the one launch's, plus a tile of K and V rows
    (2 x TS x D cache elements) and the tile's mbarrier."""
    t = dict(plan.partial_template)
    elem = 4 if t["KT"] == "float32" else 2
    return _fused_shared_bytes(plan) + 2 * t["TS"] * t["D"] * elem + 8


def staged_supported(plan: DecodePlan) -> bool:
    """True when a call with this plan may take g4_attn_decode_staged: where the one launch may
    (fused_supported), on Hopper or later, with its tile of K and V rows within the static limit
    (bf16 or f16 caches at head dim 256: 32 KB for the 32-slot tile)."""
    return (fused_supported(plan) and cuda_arch() >= STAGED_ARCH
            and staged_shared_bytes(plan) <= _SHARED_LIMIT["cuda"])  # fmt: skip


MMA_GEOMETRY_ENV = "GEMMA4_MLX_ATTENTION_MMA_GEOMETRY"
"""AttentionConfig fields over default_mma_config's (simd_groups = warps, min_chunk, target_groups,
max_parts, and the staged form's stages and row_pad; rows and min_groups unused), e.g.
"target_groups=528" (tuning)."""


def default_mma_config(head_dim: int, staged: bool = False) -> AttentionConfig:
    """Geometry of g4_attn_decode_mma: a warp per 64 head dims (8 at D = 512, 4 at D = 256), 32-slot
    tiles, partitions of at least 64 slots, about 264 thread blocks (twice the H200's 132 SMs; at
    207 registers a 256-thread block has an SM to itself; 132 and 528 were slower at 31B's full
    layer at 32K, session 27); its ``staged`` form about 132 (one per SM: at 32K 26B-A4B's full
    layer 82 against 102 us with 264, 12B's 63 against 72, 31B's 163 against 169; session 28), 2
    stages of rows padded 16 bytes; GEMMA4_MLX_ATTENTION_MMA_GEOMETRY overrides fields."""
    cfg = AttentionConfig(rows=MMA_MAX_ROWS, simd_groups=max(1, min(8, head_dim // 64)), tile=32, min_chunk=64,
                          target_groups=132 if staged else 264, max_parts=512)  # fmt: skip
    return geometry_override(cfg, MMA_GEOMETRY_ENV)


def mma_supported(q_dtype: str, kv_dtype: str, n_q: int, n_kv: int, m: int, head_dim: int) -> bool:
    """True when g4_attn_decode_mma takes the call: a CUDA build on sm_80 or later, bf16 queries and
    caches, head dim 256 or 512, at most MMA_MAX_ROWS query rows per kv head (G x M)."""
    return (backend() == "cuda" and cuda_arch() >= MMA_ARCH and q_dtype == kv_dtype == "bfloat16"
            and head_dim in (256, 512) and (n_q // n_kv) * m <= MMA_MAX_ROWS)  # fmt: skip


def plan_decode_mma(batch: int, n_q: int, n_kv: int, m: int, slots: int, head_dim: int, window: int | None,
                    config: AttentionConfig | None = None, staged: bool = False, mma8: bool = False) -> DecodePlan:  # fmt: skip
    """Launch plan of g4_attn_decode_mma, or with ``staged`` g4_attn_decode_mma_staged (its dynamic
    shared memory: mma_staged_shared_bytes), or with ``mma8`` g4_attn_decode_mma8, then
    g4_attn_decode_merge_wide, for q [batch, n_q, m, head_dim] (bf16) over caches [batch, n_kv,
    slots, head_dim] (bf16)."""
    cfg = config or default_mma_config(head_dim, staged)
    nw, g = cfg.simd_groups, n_q // n_kv
    qr, bh = g * m, batch * n_kv
    if cfg.tile != 32:
        raise ValueError("g4_attn_decode_mma takes 32-slot tiles")
    if head_dim % (64 * nw):
        raise ValueError(f"{nw} warps cannot split head dim {head_dim} in 64-dim slices")
    if qr > MMA_MAX_ROWS:
        raise ValueError(f"{qr} query rows per kv head exceed the mma's {MMA_MAX_ROWS}")
    if mma8 and (staged or qr > MMA8_MAX_ROWS):
        raise ValueError(f"g4_attn_decode_mma8 takes at most {MMA8_MAX_ROWS} query rows per kv head, unstaged")
    parts = max(1, min(-(-slots // cfg.min_chunk), -(-cfg.target_groups // bh), cfg.max_parts))
    template = [("T", "bfloat16"), ("KT", "bfloat16"), ("D", head_dim), ("G", g), ("M", m), ("WIN", int(window or 0)),
                ("NW", nw), ("TS", cfg.tile), ("CMIN", cfg.min_chunk)]  # fmt: skip
    shared = 2 * nw * 8 * 40 * 4 if mma8 else 2 * nw * (cfg.tile // 8) * 32 * 16  # the score exchange
    dynamic = mma_staged_shared_bytes(head_dim, cfg.stages, cfg.row_pad) if staged else 0
    if staged:
        template += [("ST", cfg.stages), ("RP", cfg.row_pad)]
        if shared + dynamic + 8 * cfg.stages > MMA_SHARED_LIMIT:
            raise ValueError(f"{cfg.stages} stages of rows padded {cfg.row_pad} bytes need {dynamic} bytes of shared "
                             f"memory beside {shared}: more than a thread block's {MMA_SHARED_LIMIT}")  # fmt: skip
    return DecodePlan(
        partial_template=template,
        partial_grid=(32 * nw * bh, parts, 1),
        partial_threadgroup=(32 * nw, 1, 1),
        partial_shapes=[(bh, parts, qr, 2), (bh, parts, qr, head_dim)],
        merge_template=[("T", "bfloat16"), ("D", head_dim), ("QR", qr), ("TS", cfg.tile), ("CMIN", cfg.min_chunk)],
        merge_grid=(256 * bh * qr * (head_dim // 128), 1, 1),  # g4_attn_decode_merge_wide
        merge_threadgroup=(256, 1, 1),
        out_shape=(batch, n_q, m, head_dim),
        parts=parts,
        shared_bytes=shared,
        merge_bytes=4 * parts * qr * head_dim,
        dynamic_bytes=dynamic,
    )


def launch_decode_attention(q: mx.array, k_cache: mx.array, v_cache: mx.array, positions: mx.array,
                            q_positions: mx.array, window: int | None = None, n_slots=None,
                            config: AttentionConfig | None = None, init_value: float | None = None,
                            out_shape: tuple[int, ...] | None = None,
                            counters: mx.array | None = None, staged: bool = False, mma: bool = False,
                            mma_config: AttentionConfig | None = None, mma_staged: bool = False,
                            mma8: bool = False) -> mx.array:  # fmt: skip
    """Run the two kernels (GPU builds only, no fallback) -> [B, n_q, M, D] in q.dtype, or the same
    elements in ``out_shape`` (the merge kernel writes its rows flat: no reshape node). With
    ``counters`` (``new_attention_counters()``, one per sequence of calls that run one after
    another: a layer's) the one launch of g4_attn_decode where ``fused_supported``; with ``staged``
    too, g4_attn_decode_staged where ``staged_supported`` (the same bits, K and V through shared
    memory). Otherwise, with ``mma``, the tensor-core partial kernel g4_attn_decode_mma (geometry
    ``mma_config``; with ``mma8`` g4_attn_decode_mma8 where a kv head serves at most MMA8_MAX_ROWS
    query rows, else with ``mma_staged`` on Hopper its staged form g4_attn_decode_mma_staged) where
    ``mma_supported``, then g4_attn_decode_merge_wide.

    ``init_value`` fills every output (partials included) before the kernels run (tests poison
    them with NaN)."""
    B, n_q, M, D, n_kv, S = _check(q, k_cache, v_cache, positions, q_positions, window)
    plan = plan_decode(B, n_q, n_kv, M, S, D, dtype_name(q.dtype), dtype_name(k_cache.dtype), window, config)
    if out_shape is not None and math.prod(out_shape) != math.prod(plan.out_shape):
        raise ValueError(f"output shape {out_shape} does not hold the {plan.out_shape} result")
    bound = _slots_array(n_slots, S)
    inputs = [q, k_cache, v_cache, positions.astype(mx.int32), q_positions.astype(mx.int32), bound]
    if counters is not None and fused_supported(plan):
        check_ticket_counters(counters, ATTENTION_COUNTER_WORDS, "new_attention_counters")
        kernel = _STAGED if staged and staged_supported(plan) else _FUSED
        *_, out = kernel.kernel()(
            inputs=[*inputs, counters],
            template=template_args(plan.partial_template),
            grid=plan.partial_grid,
            threadgroup=plan.partial_threadgroup,
            output_shapes=[*plan.partial_shapes, out_shape or plan.out_shape],
            output_dtypes=[mx.float32, mx.float32, q.dtype],
            init_value=init_value,
        )
        return out
    partial, merge = _PARTIAL.kernel(), _MERGE.kernel()
    if mma and dtype_name(v_cache.dtype) == dtype_name(k_cache.dtype) and mma_supported(
            dtype_name(q.dtype), dtype_name(k_cache.dtype), n_q, n_kv, M, D):  # fmt: skip
        use8 = mma8 and n_q // n_kv * M <= MMA8_MAX_ROWS
        staged_mma = not use8 and mma_staged and cuda_arch() >= STAGED_ARCH
        plan = plan_decode_mma(B, n_q, n_kv, M, S, D, window, mma_config, staged_mma, use8)
        partial = _MMA8.kernel() if use8 else _MMA_STAGED.kernel(plan.dynamic_bytes) if staged_mma else _MMA.kernel()
        merge = _MERGE_WIDE.kernel()
    ml, pacc = partial(
        inputs=inputs,
        template=template_args(plan.partial_template),
        grid=plan.partial_grid,
        threadgroup=plan.partial_threadgroup,
        output_shapes=plan.partial_shapes,
        output_dtypes=[mx.float32, mx.float32],
        init_value=init_value,
    )
    (out,) = merge(
        inputs=[ml, pacc, bound],
        template=template_args(plan.merge_template),
        grid=plan.merge_grid,
        threadgroup=plan.merge_threadgroup,
        output_shapes=[out_shape or plan.out_shape],
        output_dtypes=[q.dtype],
        init_value=init_value,
    )
    return out


def decode_attention(q: mx.array, k_cache: mx.array, v_cache: mx.array, positions: mx.array,
                     q_positions: mx.array, window: int | None = None, *, n_slots=None,
                     merged: bool = False, counters: mx.array | None = None,
                     staged: bool = False, mma: bool = False, mma_staged: bool = False,
                     mma8: bool = False) -> mx.array:  # fmt: skip
    """Attention of q [B, n_q, M, D] over whole cache buffers [B, n_kv, S, D] (K also one K|V
    buffer [2B, n_kv, S, D], of which only the first B rows are read) -> [B, n_q, M, D], or
    with ``merged`` [B, M, n_q * D] (each row's heads side by side, what the output projection
    reads; at M = 1 the kernel writes that shape directly, without a reshape node).

    positions int32 [S] (slot -> absolute position, -1 empty), q_positions int32 [M], window: the
    sliding window (keys per query incl. itself) or None. n_slots (int or int32 array [1],
    optional): slots 0..n_slots-1 are the only ones that can be attended (a full cache's length);
    default all S. Custom kernels on Metal/CUDA for head dim 128/256/512 and M <= 8, else
    ``decode_attention_reference``; with ``counters`` (``new_attention_counters()``, the layer's)
    one launch where ``fused_supported``, and with ``staged`` its form that stages K and V in shared
    memory where ``staged_supported``; elsewhere, with ``mma``, the tensor-core partial kernel where
    ``mma_supported`` and a kv head serves at least MMA_MIN_ROWS query rows (with ``mma_staged``
    on Hopper its staged form, from MMA_STAGED_MIN_ROWS rows; with ``mma8`` g4_attn_decode_mma8 for
    MMA8_MIN_ROWS..MMA8_MAX_ROWS rows). Pass the cache buffers themselves:
    a non-contiguous slice is copied before a kernel reads it."""
    B, n_q, M, D, n_kv, _ = _check(q, k_cache, v_cache, positions, q_positions, window)
    args = (q, k_cache, v_cache, positions, q_positions, window)
    rows = n_q // n_kv * M
    mma_staged = mma_staged and cuda_arch() >= STAGED_ARCH
    mma8 = mma8 and rows <= MMA8_MAX_ROWS
    mma = mma and rows >= (MMA8_MIN_ROWS if mma8 else MMA_STAGED_MIN_ROWS if mma_staged else MMA_MIN_ROWS)
    kernels = not use_reference() and D in KERNEL_HEAD_DIMS and 1 <= M <= MAX_QUERY_ROWS
    if kernels and merged and M == 1:  # [B, n_q, 1, D] and [B, 1, n_q * D] are the same flat rows
        return launch_decode_attention(*args, n_slots, out_shape=(B, 1, n_q * D), counters=counters, staged=staged,
                                       mma=mma, mma_staged=mma_staged, mma8=mma8)  # fmt: skip
    out = (launch_decode_attention(*args, n_slots, counters=counters, staged=staged, mma=mma, mma_staged=mma_staged,
                                   mma8=mma8)
           if kernels
           else decode_attention_reference(*args))  # fmt: skip
    return out.transpose(0, 2, 1, 3).reshape(B, M, n_q * D) if merged else out


# --------------------------------------------------------------------------------------------
# float64 oracle (tests, emulator cases)
# --------------------------------------------------------------------------------------------


def _mask_np(q_positions: np.ndarray, positions: np.ndarray, window: int | None) -> np.ndarray:
    diff = q_positions[:, None].astype(np.int64) - positions[None, :].astype(np.int64)
    ok = (positions[None, :] >= 0) & (diff >= 0)
    if window is not None:
        ok &= diff < window
    return ok


def attention_f64(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, q_positions: np.ndarray,
                  window: int | None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """float64 oracle: (out [B, n_q, M, D], bound [B, n_q, M, D]).

    Masked slots are never touched (they may hold NaN); rows without keys give 0. ``bound`` is the
    error scale of an f32 computation, per element: sum_s p_s (|v_s| + A_s (|v_s| + |out|)) with
    A_s = sum_d |q_d k_sd| (value rounding, plus score rounding relative to the score magnitudes
    moving the weights)."""
    B, n_q, M, D = q.shape
    n_kv = k.shape[1]
    G = n_q // n_kv
    mask = _mask_np(q_positions, positions, window)  # [M, S]
    used = mask.any(axis=0)
    kq = np.where(used[:, None], k, 0.0)
    vq = np.where(used[:, None], v, 0.0)
    qg = q.reshape(B, n_kv, G * M, D).astype(np.float64)
    rows = mask[np.arange(G * M) % M]  # [QR, S]: row r = g * M + m
    s = np.where(rows, qg @ kq.swapaxes(-1, -2), -np.inf)
    mag = np.abs(qg) @ np.abs(kq).swapaxes(-1, -2)
    top = s.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    p = np.where(rows, np.exp(s - top), 0.0)
    total = p.sum(axis=-1, keepdims=True)
    w = p / np.where(total > 0, total, 1.0)
    out = w @ vq
    wa = w * mag
    bound = (w + wa) @ np.abs(vq) + wa.sum(axis=-1, keepdims=True) * np.abs(out)
    return out.reshape(B, n_q, M, D), bound.reshape(B, n_q, M, D)


def partials_f64(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, q_positions: np.ndarray,
                 window: int | None, n_slots: int, parts: int, min_chunk: int,
                 tile: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """float64 per-partition states of the partial kernel: (ml [BH, P, QR, 2], acc [BH, P, QR, D]);
    m = max score (-inf without keys), l = sum exp(s - m), acc = sum exp(s - m) v; NaN for idle
    partitions (never written)."""
    B, n_q, M, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    G = n_q // n_kv
    chunk, active = partition_layout(min(n_slots, S), parts, min_chunk, tile)
    n_slots = min(max(n_slots, 0), S)
    qg = q.reshape(B * n_kv, G * M, D).astype(np.float64)
    kk = k.reshape(B * n_kv, S, D)
    vv = v.reshape(B * n_kv, S, D)
    rows_pos = q_positions[np.arange(G * M) % M]
    mask = _mask_np(rows_pos, positions, window)  # [QR, S]
    ml = np.full((B * n_kv, parts, G * M, 2), np.nan)
    acc = np.full((B * n_kv, parts, G * M, D), np.nan)
    for p in range(active):
        lo, hi = p * chunk, min((p + 1) * chunk, n_slots)
        mk = mask[:, lo:hi]
        used = mk.any(axis=0)
        kp = np.where(used[:, None], kk[:, lo:hi], 0.0)
        vp = np.where(used[:, None], vv[:, lo:hi], 0.0)
        s = np.where(mk, np.einsum("brd,bsd->brs", qg, kp), -np.inf)
        top = s.max(axis=-1) if hi > lo else np.full((B * n_kv, G * M), -np.inf)
        safe = np.where(np.isfinite(top), top, 0.0)
        e = np.where(mk, np.exp(s - safe[..., None]), 0.0)
        ml[:, p, :, 0] = top
        ml[:, p, :, 1] = e.sum(axis=-1)
        acc[:, p] = np.einsum("brs,bsd->brd", e, vp)
    return ml, acc


def merge_f64(ml: np.ndarray, acc: np.ndarray, n_slots: int, min_chunk: int, tile: int) -> np.ndarray:
    """float64 merge of partition states (as the merge kernel): [BH, QR, D] (0 for rows without keys)."""
    bh, parts, qr, _ = ml.shape
    _, active = partition_layout(n_slots, parts, min_chunk, tile)
    if active == 0:
        return np.zeros((bh, qr, acc.shape[-1]))
    m = ml[:, :active, :, 0]
    top = m.max(axis=1)
    safe = np.where(np.isfinite(top), top, 0.0)
    w = np.where(np.isfinite(m), np.exp(m - safe[:, None]), 0.0)  # [BH, active, QR]
    total = (w * np.nan_to_num(ml[:, :active, :, 1])).sum(axis=1)
    num = np.einsum("bpr,bprd->brd", w, np.where(np.isfinite(m)[..., None], acc[:, :active], 0.0))
    return np.where(total[..., None] > 0, num / np.where(total > 0, total, 1.0)[..., None], 0.0)


# --------------------------------------------------------------------------------------------
# Emulator / compile-test registry (see custom_kernels.registry)
# --------------------------------------------------------------------------------------------


def _values(rng: np.random.Generator, shape, dtype_name: str, scale: float):
    """(array handed to a kernel harness, exact float64 values, input_dtypes override or None)."""
    from .registry import bf16_to_f32, f32_to_bf16

    x = (rng.standard_normal(size=shape) * scale).astype(np.float32)
    if dtype_name == "bfloat16":
        bits = f32_to_bf16(x)
        return bits, bf16_to_f32(bits).astype(np.float64), "bfloat16"
    if dtype_name == "float16":
        h = x.astype(np.float16)
        return h, h.astype(np.float64), None
    return x, x.astype(np.float64), None


def _poison_unused(arr: np.ndarray, used: np.ndarray, dtype_name: str) -> np.ndarray:
    """Cache buffer [B, n_kv, S, D] with NaN in slots no query may attend (they must not be read)."""
    out = arr.copy()
    nan = np.uint16(0x7FC0) if dtype_name == "bfloat16" else np.nan
    out[:, :, ~used] = nan
    return out


@dataclass(frozen=True)
class _Problem:
    """One small attention problem for the emulator cases."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    q64: np.ndarray
    k64: np.ndarray
    v64: np.ndarray
    positions: np.ndarray
    q_positions: np.ndarray
    window: int | None
    n_slots: int
    in_dtypes: dict


def _problem(rng, q_dtype, kv_dtype, B, n_q, n_kv, M, D, positions, q_positions, window, n_slots) -> _Problem:
    S = len(positions)
    scale = 1.5 * D**-0.25  # scores ~ N(0, 1.5^2)
    q, q64, qd = _values(rng, (B, n_q, M, D), q_dtype, scale)
    k, k64, kd = _values(rng, (B, n_kv, S, D), kv_dtype, scale)
    v, v64, vd = _values(rng, (B, n_kv, S, D), kv_dtype, 1.0)
    used = _mask_np(np.asarray(q_positions), np.asarray(positions), window).any(axis=0)
    used &= np.arange(S) < n_slots
    k = _poison_unused(k, used, kv_dtype)
    v = _poison_unused(v, used, kv_dtype)
    in_dtypes = {name: d for name, d in (("q", qd), ("k", kd), ("v", vd)) if d}
    return _Problem(q, k, v, q64, k64, v64, np.asarray(positions, np.int32), np.asarray(q_positions, np.int32),
                    window, n_slots, in_dtypes)  # fmt: skip


def _partial_case(rng, q_dtype, kv_dtype, B, n_q, n_kv, M, D, positions, q_positions, window, n_slots, cfg,
                  fused: bool = False):  # fmt: skip
    """A case of the partial kernel, or with ``fused`` of the one-launch kernel (its counters in,
    the merged output out)."""
    from .registry import KernelCase

    pr = _problem(rng, q_dtype, kv_dtype, B, n_q, n_kv, M, D, positions, q_positions, window, n_slots)
    S = len(positions)
    plan = plan_decode(B, n_q, n_kv, M, S, D, q_dtype, kv_dtype, window, cfg, "cuda" if fused else "metal")
    ml, acc = partials_f64(pr.q64, pr.k64, pr.v64, pr.positions, pr.q_positions, window, n_slots, plan.parts,
                           cfg.min_chunk, cfg.tile)  # fmt: skip
    inputs = {"q": pr.q, "k": pr.k, "v": pr.v, "kpos": pr.positions, "qpos": pr.q_positions,
              "n_slots": np.array([n_slots], np.int32)}  # fmt: skip
    shapes, dtypes, expected = list(plan.partial_shapes), ["float32", "float32"], [ml, acc]
    if fused:
        inputs["counters"] = np.zeros(ATTENTION_COUNTER_WORDS, np.uint32)
        shapes.append(plan.out_shape)
        dtypes.append(q_dtype)
        expected.append(merge_f64(ml, acc, n_slots, cfg.min_chunk, cfg.tile).reshape(plan.out_shape))
    return KernelCase(
        inputs=inputs, template=plan.partial_template, grid=plan.partial_grid, threadgroup=plan.partial_threadgroup,
        output_shapes=shapes, output_dtypes=dtypes, expected=expected,
        rtol=2e-5 if not fused or q_dtype == "float32" else 2**-8, atol=1e-5, input_dtypes=pr.in_dtypes,
        label=f"q {q_dtype} kv {kv_dtype} B={B} n_q={n_q} n_kv={n_kv} M={M} D={D} S={S} W={window} "
              f"n_slots={n_slots} P={plan.parts} {cfg}",
    )  # fmt: skip


def _merge_case(rng, out_dtype, B, n_q, n_kv, M, D, positions, q_positions, window, n_slots, cfg):
    from .registry import KernelCase

    pr = _problem(rng, "float32", "float32", B, n_q, n_kv, M, D, positions, q_positions, window, n_slots)
    S = len(positions)
    plan = plan_decode(B, n_q, n_kv, M, S, D, out_dtype, "float32", window, cfg, "metal")
    ml, acc = partials_f64(pr.q64, pr.k64, pr.v64, pr.positions, pr.q_positions, window, n_slots, plan.parts,
                           cfg.min_chunk, cfg.tile)  # fmt: skip
    ml32, acc32 = ml.astype(np.float32), acc.astype(np.float32)  # idle partitions stay NaN: never read
    expected = merge_f64(ml32.astype(np.float64), acc32.astype(np.float64), n_slots, cfg.min_chunk, cfg.tile)
    rtol = 2e-6 if out_dtype == "float32" else 2**-8
    return KernelCase(
        inputs={"ml": ml32, "pacc": acc32, "n_slots": np.array([n_slots], np.int32)},
        template=plan.merge_template, grid=plan.merge_grid, threadgroup=plan.merge_threadgroup,
        output_shapes=[plan.out_shape], output_dtypes=[out_dtype], expected=[expected.reshape(plan.out_shape)],
        rtol=rtol, atol=1e-6, label=f"out {out_dtype} QR={n_q // n_kv * M} D={D} P={plan.parts} n_slots={n_slots}",
    )  # fmt: skip


def _ring(capacity: int, first: int, last: int, empty=(), future=()) -> np.ndarray:
    """Ring positions: slot p % capacity holds p for p in first..last; ``empty`` slots hold -1 and
    ``future`` slots a position past ``last`` (a rolled-back token)."""
    pos = np.full(capacity, -1, np.int32)
    for p in range(first, last + 1):
        pos[p % capacity] = p
    for s in empty:
        pos[s] = -1
    for i, s in enumerate(future):
        pos[s] = last + 3 + i
    return pos


def _common_problems() -> list[tuple]:
    """(q dtype, kv dtype, B, n_q, n_kv, M, D, positions, q_positions, window, n_slots, config) of
    the problems both the partial kernel's and the one-launch kernel's cases run."""
    c = AttentionConfig
    return [
        # sliding ring out of order with empty slots, window edge (W keys incl. self), 3 partitions
        # (8, 8, 4 slots: a partial last one), bf16 cache, f32 q
        ("float32", "bfloat16", 1, 4, 2, 1, 256, _ring(20, 31, 50, empty=(3, 12)), [50], 12, 20,
         c(rows=16, simd_groups=2, tile=8, min_chunk=8, target_groups=6)),
        # full layer: capacity 24 > valid 13 (an idle partition), M = 3 causal inside the chunk,
        # 12 query rows in tiles of 8 + 4, bf16 q, f32 cache, D = 512
        ("bfloat16", "float32", 1, 4, 1, 3, 512, np.arange(24), [10, 11, 12], None, 13,
         c(rows=8, simd_groups=4, tile=8, min_chunk=8, target_groups=8)),
        # G = 8, M = 2, window 5, two sequences, odd capacity 13 with an empty slot and one holding
        # a position past both queries (rolled back), partitions of 8 + 5 slots (D = 256: 8 slots a step)
        ("float32", "float32", 2, 8, 1, 2, 256, _ring(13, 30, 42, empty=(5,), future=(7,)), [41, 42], 5, 13,
         c(rows=16, simd_groups=4, tile=8, min_chunk=8, target_groups=8)),
    ]  # fmt: skip


def _partial_cases(rng: np.random.Generator):
    return [_partial_case(rng, *problem) for problem in _common_problems()] + [
        # the Metal defaults: 12B full layer (G = 16) at M = 3 (6 query tiles of 8 rows), 555 of 600
        # slots valid (partitions 256 + 256 + 43); a wrapped 1024-style ring at M = 8
        _partial_case(rng, "bfloat16", "bfloat16", 1, 16, 1, 3, 512, np.where(np.arange(600) < 555, np.arange(600), -1),
                      np.arange(552, 555), None, 555, default_config(512, "metal")),
        _partial_case(rng, "bfloat16", "bfloat16", 1, 4, 2, 8, 256, _ring(300, 1000, 1299, empty=(7,)),
                      np.arange(1292, 1300), 200, 300, default_config(256, "metal")),
    ]  # fmt: skip


def _merge_cases(rng: np.random.Generator):
    c = AttentionConfig
    return [
        _merge_case(rng, "float32", 1, 4, 2, 1, 256, _ring(20, 31, 50, empty=(3, 12)), [50], 12, 20,
                    c(rows=16, simd_groups=2, tile=8, min_chunk=8, target_groups=6)),
        _merge_case(rng, "bfloat16", 1, 4, 1, 3, 512, np.arange(24), [10, 11, 12], None, 13,
                    c(rows=8, simd_groups=4, tile=8, min_chunk=8, target_groups=8)),
        # a row whose window holds no slot (position 60, keys at <= 50): output 0
        _merge_case(rng, "float32", 1, 2, 1, 2, 128, _ring(16, 35, 50), [50, 60], 4, 16,
                    c(rows=8, simd_groups=1, tile=8, min_chunk=8, target_groups=3)),
        _merge_case(rng, "bfloat16", 1, 16, 1, 3, 512, np.where(np.arange(600) < 555, np.arange(600), -1),
                    np.arange(552, 555), None, 555, default_config(512, "metal")),
        # more partitions than merge threads: 37 of 38 active in batches of 32 + 5 (D = 128)
        _merge_case(rng, "float32", 1, 2, 1, 1, 128, np.arange(300), [289], None, 290,
                    c(rows=8, simd_groups=1, tile=8, min_chunk=8, target_groups=64)),
        # a 600-slot ring with a window of 100 over slots 500..599: partitions 0..61 fully masked,
        # batches of 64 + 11 (D = 256), M = 2
        _merge_case(rng, "bfloat16", 1, 4, 2, 2, 256, _ring(600, 1200, 1799), [1798, 1799], 100, 600,
                    c(rows=16, simd_groups=2, tile=8, min_chunk=8, target_groups=256)),
    ]  # fmt: skip


def _fused_cases(rng: np.random.Generator):
    c = AttentionConfig
    return [_partial_case(rng, *problem, fused=True) for problem in _common_problems()] + [
        # 37 of 38 partitions active (D = 128, one SIMD group), the CUDA tile of 32 slots
        _partial_case(rng, "bfloat16", "bfloat16", 1, 2, 1, 1, 128, np.arange(1216), [1183], None, 1184,
                      c(rows=8, simd_groups=1, tile=32, min_chunk=32, target_groups=38), fused=True),
        # no valid slot: no partition is active, partition 0 writes zeros
        _partial_case(rng, "bfloat16", "bfloat16", 1, 4, 2, 1, 256, np.arange(64), [0], None, 0,
                      c(rows=16, simd_groups=2, tile=8, min_chunk=8, target_groups=8), fused=True),
    ]  # fmt: skip


def _staged_cases(rng: np.random.Generator):
    """The one launch's problems whose tile of K and V fits the staged kernel's shared memory, then
    at the Gemma 4 sliding shape (D = 256, G = 2, 32-slot tiles): a wrapped ring of one-tile
    partitions with empty slots (the model's case), partitions of three tiles (the next tile's
    copies after a tile) with a short last tile (the copies' length), and f16 caches."""
    c = AttentionConfig
    problems = [p for p in _common_problems()
                if staged_shared_bytes(plan_decode(*p[2:6], len(p[7]), p[6], p[0], p[1], p[9], p[11], "cuda"))
                <= _SHARED_LIMIT["cuda"]]  # fmt: skip
    return [_partial_case(rng, *problem, fused=True) for problem in problems] + [
        _partial_case(rng, "bfloat16", "bfloat16", 1, 4, 2, 1, 256, _ring(160, 300, 459, empty=(9, 70)), [459],
                      128, 160, c(rows=16, simd_groups=4, tile=32, min_chunk=32, target_groups=10), fused=True),
        _partial_case(rng, "bfloat16", "bfloat16", 1, 4, 2, 1, 256, np.arange(240), [230], None, 231,
                      c(rows=16, simd_groups=4, tile=32, min_chunk=96, target_groups=6), fused=True),
        _partial_case(rng, "float32", "float16", 1, 4, 1, 1, 128, _ring(72, 100, 171), [171], 64, 72,
                      c(rows=8, simd_groups=1, tile=32, min_chunk=32, target_groups=3), fused=True),
    ]  # fmt: skip


def _mma_case(rng, B, n_q, n_kv, M, D, positions, q_positions, window, n_slots, cfg, staged=False, mma8=False):
    """A case of g4_attn_decode_mma (or with ``staged`` g4_attn_decode_mma_staged, with ``mma8``
    g4_attn_decode_mma8): bf16 q and caches, its partition states out."""
    from .registry import KernelCase

    pr = _problem(rng, "bfloat16", "bfloat16", B, n_q, n_kv, M, D, positions, q_positions, window, n_slots)
    S = len(positions)
    plan = plan_decode_mma(B, n_q, n_kv, M, S, D, window, cfg, staged, mma8)
    ml, acc = partials_f64(pr.q64, pr.k64, pr.v64, pr.positions, pr.q_positions, window, n_slots, plan.parts,
                           cfg.min_chunk, cfg.tile)  # fmt: skip
    inputs = {"q": pr.q, "k": pr.k, "v": pr.v, "kpos": pr.positions, "qpos": pr.q_positions,
              "n_slots": np.array([n_slots], np.int32)}  # fmt: skip
    return KernelCase(
        cuda_shared_memory=plan.dynamic_bytes,
        inputs=inputs, template=plan.partial_template, grid=plan.partial_grid, threadgroup=plan.partial_threadgroup,
        output_shapes=list(plan.partial_shapes), output_dtypes=["float32", "float32"], expected=[ml, acc],
        # p enters the value mma as bf16 hi + lo (~2^-16 relative) and the tensor cores add in f32 in
        # their own order: errors ~1e-5 on sums of up to a hundred p v terms with |v| ~ 1
        rtol=1e-4, atol=5e-5, input_dtypes=pr.in_dtypes,
        label=f"mma{' staged' if staged else '8' if mma8 else ''} B={B} n_q={n_q} n_kv={n_kv} M={M} D={D} S={S} W={window} "
              f"n_slots={n_slots} P={plan.parts} "
              f"warps={cfg.simd_groups} cmin={cfg.min_chunk}",
    )  # fmt: skip


def _mma_cases(rng: np.random.Generator, staged: bool = False):
    """g4_attn_decode_mma at the shapes it serves (D = 512 with 16 and 8 rows per kv head, D = 256) and
    its edges: a short last tile and an idle partition, M = 2 and 4 (causal inside the tile), a ring
    with a window and empty slots, two sequences, positions past the query. (With no valid slot it
    writes nothing, which a case cannot check: tests/test_attention_gpu.py runs that through the
    wide merge, whose case list has it.)"""
    c = AttentionConfig
    full = np.where(np.arange(200) < 150, np.arange(200), -1).astype(np.int32)
    return [
        # 12B full layer (G = 16): partitions of 64 + 64 + 22 slots, capacity past n_slots
        _mma_case(rng, 1, 16, 1, 1, 512, full, [149], None, 150,
                  c(rows=16, simd_groups=8, tile=32, min_chunk=64, target_groups=3), staged),
        # G = 8, M = 2 (16 rows), 4 warps of 128 dims, 4 partitions of 32 (the last idle)
        _mma_case(rng, 1, 8, 1, 2, 512, np.arange(100), [98, 99], None, 99,
                  c(rows=16, simd_groups=4, tile=32, min_chunk=32, target_groups=4), staged),
        # sliding ring (G = 2, D = 256) with a window and empty slots, one tile per partition
        _mma_case(rng, 1, 4, 2, 1, 256, _ring(96, 100, 195, empty=(5, 40)), [195], 64, 96,
                  c(rows=16, simd_groups=4, tile=32, min_chunk=32, target_groups=6), staged),
        # two sequences, G = 4, M = 4 (16 rows), 2 warps of 128 dims, a slot past the queries
        _mma_case(rng, 2, 8, 2, 4, 256, _ring(70, 0, 60, future=(65,)), [57, 58, 59, 60], None, 70,
                  c(rows=16, simd_groups=2, tile=32, min_chunk=64, target_groups=4), staged),
    ]  # fmt: skip


def _mma_staged_cases(rng: np.random.Generator):
    """The tensor-core kernel's cases through its staged form (partitions of one to four tiles, a
    short last tile: the copies' row count), plus partitions of 6 tiles (stages refilled in turn)
    with 2 padded, 3 unpadded (D = 512: the most shared memory a block may have) and 4 stages."""
    c = AttentionConfig
    return _mma_cases(rng, staged=True) + [
        _mma_case(rng, 1, 16, 1, 1, 512, np.arange(200), [190], None, 191,
                  c(rows=16, simd_groups=8, tile=32, min_chunk=192, target_groups=1), staged=True),
        _mma_case(rng, 1, 8, 1, 1, 512, np.arange(400), [390], None, 391,
                  c(rows=16, simd_groups=8, tile=32, min_chunk=192, target_groups=3, stages=3, row_pad=0), staged=True),
        _mma_case(rng, 1, 8, 2, 2, 256, np.arange(200), [180, 181], None, 182,
                  c(rows=16, simd_groups=4, tile=32, min_chunk=192, target_groups=2, stages=4), staged=True),
    ]  # fmt: skip


def _mma8_cases(rng: np.random.Generator):
    """g4_attn_decode_mma8 at the shapes it serves (31B / 26B-A4B full: 8 rows at D = 512, E4B full:
    4; a sliding layer's 2 query heads per kv head at D = 256, with 4 tokens) and its edges: 3 rows (5 padding columns), M = 2 and 4 (causal
    inside the tile), a ring with a window and empty slots, two sequences, a short last tile and an
    idle partition, a slot past the queries, partitions of 6 tiles (the exchange's two buffers in turn)."""
    c = AttentionConfig
    full = np.where(np.arange(200) < 150, np.arange(200), -1).astype(np.int32)
    return [
        # 31B full layer (G = 8, 4 kv heads): partitions of 64 + 64 + 22 slots, capacity past n_slots
        _mma_case(rng, 1, 32, 4, 1, 512, full, [149], None, 150, c(simd_groups=8, min_chunk=64, target_groups=12), mma8=True),
        # E4B full (G = 4), 4 warps of 128 dims, 4 partitions of 32 (the last idle)
        _mma_case(rng, 1, 8, 2, 1, 512, np.arange(100), [89], None, 90, c(simd_groups=4, min_chunk=32, target_groups=8), mma8=True),
        # sliding ring (G = 2, D = 256) with a window and empty slots, M = 4 (8 rows)
        _mma_case(rng, 1, 4, 2, 4, 256, _ring(96, 100, 195, empty=(5, 40)), [192, 193, 194, 195], 64, 96,
                  c(simd_groups=4, min_chunk=32, target_groups=6), mma8=True),
        # two sequences, G = 3 (3 rows), 2 warps of 128 dims, a slot past the queries
        _mma_case(rng, 2, 6, 2, 1, 256, _ring(70, 0, 60, future=(65,)), [60], None, 70,
                  c(simd_groups=2, min_chunk=64, target_groups=4), mma8=True),
        # G = 4, M = 2 (8 rows), one partition of 6 tiles
        _mma_case(rng, 1, 8, 2, 2, 512, np.arange(200), [189, 190], None, 191,
                  c(simd_groups=8, min_chunk=192, target_groups=2), mma8=True),
    ]  # fmt: skip


def _merge_wide_cases(rng: np.random.Generator):
    """g4_attn_decode_merge_wide on the tensor-core kernel's plans: more active partitions than
    8 warps x 8 loads (a second round), an idle partition, D = 256 and 512, two sequences, a row of
    a ring whose window holds no slot (zeros), no valid slot at all."""
    from .registry import KernelCase

    c = AttentionConfig
    cases = []
    for B, n_q, n_kv, M, D, positions, q_positions, window, n_slots, cfg in (
        (1, 16, 1, 1, 512, np.arange(4200), [4129], None, 4130, c(simd_groups=8, tile=32, min_chunk=32, target_groups=140)),
        (2, 8, 2, 2, 256, np.arange(300), [250, 251], None, 252, c(simd_groups=4, tile=32, min_chunk=64, target_groups=10)),
        (1, 8, 1, 2, 256, _ring(96, 10, 80), [80, 200], 64, 96, c(simd_groups=4, tile=32, min_chunk=32, target_groups=3)),
        (1, 8, 1, 1, 512, np.arange(64), [0], None, 0, c(simd_groups=8, tile=32, min_chunk=32, target_groups=2)),
    ):  # fmt: skip
        pr = _problem(rng, "float32", "float32", B, n_q, n_kv, M, D, positions, q_positions, window, n_slots)
        plan = plan_decode_mma(B, n_q, n_kv, M, len(positions), D, window, cfg)
        ml, acc = partials_f64(pr.q64, pr.k64, pr.v64, pr.positions, pr.q_positions, window, n_slots, plan.parts,
                               cfg.min_chunk, cfg.tile)  # fmt: skip
        ml32, acc32 = ml.astype(np.float32), acc.astype(np.float32)  # idle partitions stay NaN: never read
        expected = merge_f64(ml32.astype(np.float64), acc32.astype(np.float64), n_slots, cfg.min_chunk, cfg.tile)
        cases.append(KernelCase(
            inputs={"ml": ml32, "pacc": acc32, "n_slots": np.array([n_slots], np.int32)},
            template=plan.merge_template, grid=plan.merge_grid, threadgroup=plan.merge_threadgroup,
            output_shapes=[plan.out_shape], output_dtypes=["bfloat16"], expected=[expected.reshape(plan.out_shape)],
            rtol=2**-8, atol=1e-6, label=f"wide QR={n_q // n_kv * M} D={D} P={plan.parts} n_slots={n_slots}",
        ))  # fmt: skip
    return cases


def kernel_specs():
    """KernelSpec of the decode-attention kernels, with small emulator cases (odd tails included);
    g4_attn_decode, g4_attn_decode_staged, g4_attn_decode_mma(_staged), g4_attn_decode_mma8 and
    g4_attn_decode_merge_wide are CUDA only (an empty Metal text)."""
    from .registry import KernelSpec

    specs = []
    for kdef, cases in ((_PARTIAL, _partial_cases), (_MERGE, _merge_cases), (_FUSED, _fused_cases),
                        (_STAGED, _staged_cases), (_MMA, _mma_cases), (_MERGE_WIDE, _merge_wide_cases),
                        (_MMA_STAGED, _mma_staged_cases), (_MMA8, _mma8_cases)):
        (mh, ms), (ch, cs) = kdef.text["metal"], kdef.text["cuda"]
        specs.append(KernelSpec(kdef.name, kdef.input_names, kdef.output_names, mh, ms, ch, cs, cases))
    return specs

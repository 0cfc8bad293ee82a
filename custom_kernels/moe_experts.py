"""A MoE layer's expert path in one launch (CUDA, Q4_0, one bf16 token).

``q4_0_moe_experts(x, ids, weights, gate_up_blocks, down_blocks, counters)`` computes

    out = sum_s weights[s] * W_down[ids[s]] @ (gelu_tanh(g_s) * u_s),  [g_s | u_s] = W_gate_up[ids[s]] @ x

what ``q4_0_gate_up_gather`` then ``q4_0_moe_down`` compute in two launches. x [..., H] bf16 with one
token, ids int32 [..., k], weights [..., k] (f32), gate_up_blocks [E, 2F, H // 32 * 18], down_blocks
[E, H, F // 32 * 18] -> [..., H] bf16. The GeGLU products are rounded to bf16 between the two
halves, as the two-launch path rounds them.

Why one launch: on the H200 a launch that binds a layer's expert stacks costs MLX's host 4-12 us
(bench/NOTES.md, sessions 17-18), and the two-launch path measured 24.5-34.8 us per step back to
back against the 11.6 us that 60% of the copy bandwidth allows for its 26.8 MB (26B-A4B). Measured
(session 21's text, 26B-A4B shapes, default geometry): 22.6 us of GPU time per call against the two
launches' 39.2, 25.1 against 42.8 back to back (a kernel that only reads the same bytes: 11.6 / 8.5);
Nsight Compute on an earlier text (session 19): DRAM 15% busy, bound by the latency of its own
instructions.

How (threadgroups of NW = 8 or 16 warps, taking tickets from ``counters`` in the order they start):

- tickets below TA = ceil(k * F / 8 / SETS) compute SETS sets of 8 GeGLU outputs (8 gate and 8 up
  rows of one slot's expert): each set's rows are copied front to back (16-byte ``cp.async``, one
  group per set) into shared memory as pieces of 16 rows x 144 bytes (K / 256 per set); the warps
  take the pieces in turn and multiply set j's as soon as its group has landed (mma.sync, the
  stream kernels' block code: weights as A, x as B); the warps' f32 sums are added in warp order,
  h [k, F] bf16 is stored, then the ticket counts itself done;
- the next TB = H / 16 tickets compute 16 output rows each: the NW / SL warps of slot s (SL: the
  slot count rounded up to a power of two, so one slot gets all the warps) copy its 16 down rows
  (contiguous) into shared memory (16-byte ``cp.async``), which overlaps the gate|up half, then
  wait until all TA gate|up tickets are done, copy h through L2 (``ld.global.cg``: written in this
  launch) into shared memory, each warp multiplies its part of the slot's blocks, and the weighted
  f32 sums are added in slot order (each slot's parts in order), rounded once;
- the last threadgroup to finish sets the counters back to zero for the next call.

A ticket is only taken by a running threadgroup and every down ticket comes after every gate|up
ticket, so the waiting threadgroups never hold back one they wait for, whatever the residency.
``counters`` (uint32 [96], zeros) belongs to one sequence of calls that run one after another (a
layer of a decode step); two calls that could run at once must not share one. A counter that never
reaches its value (it cannot, short of a kernel killed midway) ends the wait with a trap after ~4 s
instead of a hang. Expert ids outside [0, E) make their slot's h row and the whole output NaN, as
in the two-launch kernels.

``q4_0_moe_routed`` (family "moe_route_fold", opt-in) is the same launch with the router's
projection and route as its first tickets (kernel g4_q4_0_moe_routed, counters uint32 [128]);
``q4_0_mlp_one_launch`` (family "mlp_one_launch", opt-in) runs a dense MLP through it as one slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import (backend, check_ticket_counters, cuda_arch, dtype_name, geometry_override, get_kernel, template_args,
               ticket_counters, use_kernel)
from .attention import _text as attention_text
from .dialect import prelude, render
from .router import LOGIT_SUM, MAX_EXPERTS, _fused_route_body
from .quant_matvec import (
    _MMA_HEADER_CUDA,
    _RUNS_HEADER_CUDA,
    _STREAM_HEADER_CUDA,
    MMA_ARCH,
    Q4_0,
    LaunchPlan,
    _KernelDef,
    gate_up_gather_reference,
    moe_down_reference,
    q4_0_gate_up_gather,
    q4_0_moe_down,
    row_bytes,
)

__all__ = ["q4_0_moe_experts", "moe_experts_reference", "moe_experts_supported", "launch_moe_experts",
           "plan_moe_experts", "new_counters", "q4_0_mlp_one_launch", "q4_0_moe_routed", "launch_moe_routed",
           "plan_moe_routed", "new_routed_counters", "kernel_specs"]  # fmt: skip

MAX_SLOTS = 8
"""Slots a call may have: a down ticket gives each slot at least NW / 8 of its warps."""

SETS = 3
"""GeGLU sets (8 outputs, 16 weight rows) per gate|up ticket. 26B-A4B (F = 704, 8 slots): 235
gate|up and 176 down tickets of 76 KB of shared memory, 2 per SM of the H200's 132, so the later
down tickets start (and stage their rows) as gate|up tickets finish. Session 20, GPU time per call
(sets 2 / 3 / 4): 30.4 / 28.8 / 32.8 us with 16 warps, 30.8 / 30.3 / 33.8 with 8."""

WARPS = 16
"""Warps per threadgroup (8 or 16): 16 halves each warp's share of a ticket (the text's 51-64
registers allow 2 threadgroups of 16 warps per SM)."""

MOE_GEOMETRY_ENV = "GEMMA4_MLX_MOE_GEOMETRY"
"""MoeConfig fields of the one-launch kernel, e.g. "sets=3,warps=16" (template values of the
pinned text: tuning without a new kernel text)."""


@dataclass(frozen=True)
class MoeConfig:
    sets: int = SETS  # GeGLU sets per gate|up ticket
    warps: int = WARPS  # warps per threadgroup

    def __post_init__(self):
        if not 1 <= self.sets <= 4:
            raise ValueError(f"sets must be 1..4, got {self.sets}")
        if self.warps not in (8, 16):
            raise ValueError(f"warps must be 8 or 16, got {self.warps}")

_PIECE = 16 * 144  # staged bytes of one gate|up piece: 16 rows x 8 blocks

SHARED_LIMIT = 200 * 1024
"""Dynamic shared memory a block may ask for (the H200 allows 227 KB)."""

# Template: T (bfloat16), NW (warps: 8 or 16), SETS (GeGLU sets per gate|up ticket), S (slots), SMEM
# (the dynamic shared bytes: unused by the text, but it makes each size its own instantiation, and MLX
# sets a kernel's shared-memory limit when it loads it).
_BODY_CUDA = r"""
  // gemma4-mlx q4_0 MoE experts in one launch (CUDA): gate|up + GeGLU, then down + weighted sum
  static_assert(SMEM >= 16, "SMEM: the dynamic shared bytes this instantiation is launched with");
  static_assert(NW == 8 || NW == 16, "NW: 8 or 16 warps");
  // down tickets: warp w serves slot w % SL (SL: S rounded up to a power of two), KS = NW / SL warps
  // per slot, each over its part of the slot's blocks
  constexpr int SL = S <= 1 ? 1 : S <= 2 ? 2 : S <= 4 ? 4 : 8;
  constexpr int KS = NW / SL;
  extern __shared__ __align__(16) uint32_t g4_smem[];
  __shared__ float g4_red[NW][SETS][16];
  __shared__ int g4_ticket;
  const int lane = (int)(threadIdx.x & 31u);
  const int warp = (int)(threadIdx.x >> 5);
  const int g = lane >> 2;
  const int t = lane & 3;
  const int E = wgu_shape[0];
  const int F = wgu_shape[1] / 2;
  const int rbh = wgu_shape[2];   // bytes per gate|up row: H / 32 * 18, a multiple of 144
  const int H = wdn_shape[1];
  const int rbf = wdn_shape[2];   // bytes per down row: F / 32 * 18 (16 rows: a multiple of 16)
  const int sets_total = S * (F / 8);
  const int TA = (sets_total + SETS - 1) / SETS;
  const int TB = H / 16;
  // tickets, gate|up tickets done, blocks done: each on its own 128-byte line, so the polling of
  // the second does not queue the atomics on the others
  unsigned int* tickets = const_cast<unsigned int*>(counters);
  unsigned int* sets_done = tickets + 32;
  unsigned int* blocks_done = tickets + 64;
  if (threadIdx.x == 0) g4_ticket = (int)atomicAdd(tickets, 1u);
  __syncthreads();
  const int ticket = g4_ticket;
  const uint32_t smem_addr = g4_shared_addr(g4_smem);
  const unsigned short* S16 = reinterpret_cast<const unsigned short*>(g4_smem);
  // one 32-weight block (bytes at o0 for fragment row g, o1 for row g + 8) against x pairs b*
  // (halves: read qs as two 2-byte words, for offsets whose alignment is known only at run time)
  auto block_mma = [&](float* acc, int o0, int o1, uint32_t b00, uint32_t b01, uint32_t b10, uint32_t b11,
                       bool halves) {
    uint32_t u[2];
    float d[2];
    const int os[2] = {o0, o1};
    _Pragma("unroll") for (int r = 0; r < 2; ++r) {  // (not h: the output of that name)
      d[r] = g4_half_bits(S16[os[r] >> 1]);
      const int ob = os[r] + 2 + 4 * t;  // qs[4t .. 4t+3], 2-byte aligned
      u[r] = halves ? (uint32_t)S16[ob >> 1] | ((uint32_t)S16[(ob >> 1) + 1] << 16)
                    : __funnelshift_r(g4_smem[ob >> 2], g4_smem[(ob >> 2) + 1], (ob & 3) * 8);
    }
    // weights 4t, 4t+1 (a0, a1) and 4t+2, 4t+3 (a2, a3) of each half: the same k order as the B words
    const uint32_t lo0 = u[0] & 0x0F0F0F0Fu, lo1 = u[1] & 0x0F0F0F0Fu;
    const uint32_t hi0 = (u[0] >> 4) & 0x0F0F0F0Fu, hi1 = (u[1] >> 4) & 0x0F0F0F0Fu;
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    g4_mma_bf16(part, g4_q4_pair(lo0, 0x4140u), g4_q4_pair(lo1, 0x4140u), g4_q4_pair(lo0, 0x4342u), g4_q4_pair(lo1, 0x4342u), b00, b01);
    g4_mma_bf16(part, g4_q4_pair(hi0, 0x4140u), g4_q4_pair(hi1, 0x4140u), g4_q4_pair(hi0, 0x4342u), g4_q4_pair(hi1, 0x4342u), b10, b11);
    acc[0] += d[0] * part[0];
    acc[2] += d[1] * part[2];
  };
  if (ticket < TA) {
    // gate|up: set j of the ticket is 16 rows (8 gate, the 8 up rows F further), staged as pieces
    // (j, c) of 16 rows x 144 bytes (8 blocks); one cp.async group per set, so set j's pieces are
    // multiplied while the later sets are still in flight
    const int groups = rbh / 144;
    const bool aligned = ((reinterpret_cast<size_t>(wgu) | (size_t)rbh) & 15) == 0;
    const int units = rbh / 16;  // 16-byte units per row
    for (int j = 0; j < SETS; ++j) {
      const int q = ticket * SETS + j;
      if (q < sets_total) {
        const int slot = q / (F / 8);
        const int e = ids[slot];
        const size_t row0 = (size_t)((e >= 0 && e < E) ? e : 0) * 2 * F + (q - slot * (F / 8)) * 8;
        for (int i = (int)threadIdx.x; i < 16 * units; i += NW * 32) {  // front to back, row by row
          const int r = i / units, col = i - r * units;
          const int c = col / 9;  // 144-byte column group
          const uint8_t* src = wgu + (row0 + (r >> 3) * F + (r & 7)) * rbh + col * 16;
          const int dst = (j * groups + c) * 2304 + r * 144 + (col - c * 9) * 16;
          if (aligned) {
            g4_cp_async<16>(smem_addr + (uint32_t)dst, src);
          } else {
            _Pragma("unroll") for (int b = 0; b < 16; b += 2) {
              reinterpret_cast<unsigned short*>(g4_smem)[(dst + b) >> 1] = g4_u16(src + b);
            }
          }
        }
      }
      g4_cp_async_commit();
    }
    // x as mma B fragments, one 16-byte word per (block, t), after the pieces in shared memory: the
    // loop then reads one word per block (the lanes of a quad t the same word: a broadcast)
    const int xoff = SETS * groups * 2304;
    const int nbh = rbh / 18;  // blocks per gate|up row: H / 32
    for (int i = (int)threadIdx.x; i < 4 * nbh; i += NW * 32) {
      const int kb = (i >> 2) * 32 + 4 * (i & 3);
      uint2 xa, xc;
      if ((reinterpret_cast<size_t>(x) & 7) == 0) {
        xa = __ldg(reinterpret_cast<const uint2*>(x + kb));       // x[4t .. 4t+3]
        xc = __ldg(reinterpret_cast<const uint2*>(x + kb + 16));  // x[16+4t ..]
      } else {
        const unsigned short* x16 = reinterpret_cast<const unsigned short*>(x);
        xa = make_uint2((uint32_t)__ldg(x16 + kb) | ((uint32_t)__ldg(x16 + kb + 1) << 16),
                        (uint32_t)__ldg(x16 + kb + 2) | ((uint32_t)__ldg(x16 + kb + 3) << 16));
        xc = make_uint2((uint32_t)__ldg(x16 + kb + 16) | ((uint32_t)__ldg(x16 + kb + 17) << 16),
                        (uint32_t)__ldg(x16 + kb + 18) | ((uint32_t)__ldg(x16 + kb + 19) << 16));
      }
      reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(g4_smem) + xoff)[i] = g4_b_frags(xa, xc);
    }
    const uint4* xs = reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(g4_smem) + xoff) + t;
    float acc[SETS][4];
    _Pragma("unroll") for (int j = 0; j < SETS; ++j) {
      acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
      g4_cp_async_wait_upto(SETS - 1 - j);  // set j's group has landed
      __syncthreads();  // a warp reads pieces other warps copied
      if (ticket * SETS + j >= sets_total) continue;  // the same for the whole block
      // the ticket's pieces go to the warps in turn across its sets: p = j * groups + c -> warp p % NW
      for (int c = ((warp - j * groups) % NW + NW) % NW; c < groups; c += NW) {
        const int p = j * groups + c;
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        _Pragma("unroll") for (int bl = 0; bl < 8; ++bl) {
          const uint4 xb = xs[4 * (c * 8 + bl)];
          const int o = p * 2304 + g * 144 + 18 * bl;
          block_mma(a, o, o + 8 * 144, xb.x, xb.y, xb.z, xb.w, false);
        }
        acc[j][0] += a[0];
        acc[j][2] += a[2];
      }
    }
    if (t == 0) {
      _Pragma("unroll") for (int j = 0; j < SETS; ++j) {
        g4_red[warp][j][g] = acc[j][0];
        g4_red[warp][j][8 + g] = acc[j][2];
      }
    }
    __syncthreads();
    if (threadIdx.x < SETS * 8) {
      const int j = (int)threadIdx.x / 8, gq = (int)threadIdx.x % 8;
      const int q = ticket * SETS + j;
      if (q < sets_total) {
        float gs = 0.0f, us = 0.0f;
        for (int w = 0; w < NW; ++w) { gs += g4_red[w][j][gq]; us += g4_red[w][j][8 + gq]; }
        const int slot = q / (F / 8);
        const int e = ids[slot];
        const float v = (e >= 0 && e < E) ? g4_gelu_tanh(gs) * us : g4_nan();
        h[(size_t)slot * F + (q - slot * (F / 8)) * 8 + gq] = static_cast<T>(v);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // release: the block's h stores (ordered by the barrier) before the count
      __threadfence();
      atomicAdd(sets_done, 1u);
    }
  } else if (ticket < TA + TB) {
    // down: 16 output rows from r0; warp (slot sl, part ks) multiplies blocks [ks nb / KS, (ks + 1)
    // nb / KS) of slot sl's rows. The rows are staged before the wait, h [S, F] after it.
    const int r0 = (ticket - TA) * 16;
    const int sl = warp % SL, ks = warp / SL;
    const int e = sl < S ? ids[sl] : 0;
    const bool live = e >= 0 && e < E;
    const uint8_t* wrow = wdn + ((size_t)(live ? e : 0) * H + r0) * rbf;
    const int words = 16 * rbf / 4;  // words of a slot's 16 rows
    const int base = sl * 16 * rbf;
    const int hoff = S * 16 * rbf;   // byte offset of the staged h (a multiple of 16)
    if (sl < S) {  // the 16 rows are contiguous: 16 * rbf bytes, 16-byte aligned with the stack
      const int lt = ks * 32 + lane;  // the slot's KS warps share the copy
      if (((reinterpret_cast<size_t>(wdn)) & 15) == 0) {
        for (int cp = lt; cp < words / 4; cp += KS * 32) {
          g4_cp_async<16>(smem_addr + (uint32_t)(base + cp * 16), wrow + (size_t)cp * 16);
        }
      } else if (((reinterpret_cast<size_t>(wdn)) & 3) == 0) {
        for (int cp = lt; cp < words; cp += KS * 32) {
          g4_cp_async<4>(smem_addr + (uint32_t)(base + cp * 4), wrow + (size_t)cp * 4);
        }
      } else {
        for (int cp = lt; cp < 8 * rbf; cp += KS * 32) {
          reinterpret_cast<unsigned short*>(g4_smem)[(base >> 1) + cp] = g4_u16(wrow + (size_t)cp * 2);
        }
      }
    }
    g4_cp_async_commit();
    if (threadIdx.x == 0) {
      unsigned int done, pause = 32;
      for (long long spin = 0;; ++spin) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(done) : "l"(sets_done) : "memory");
        if (done >= (unsigned int)TA) break;
        if (spin > (1ll << 23)) __trap();
        __nanosleep(pause);
        pause = min(2 * pause, 512u);
      }
    }
    __syncthreads();
    // h, written in this launch: through L2 (an output array: 8-byte aligned), into shared memory as
    // mma B fragments, one 16-byte word per (slot, block, t)
    for (int i = (int)threadIdx.x; i < S * F / 8; i += NW * 32) {
      const T* hp = h + (size_t)(i >> 2) * 32 + 4 * (i & 3);  // word i: block i / 4 of h [S, F] flat
      const uint2 ha = __ldcg(reinterpret_cast<const uint2*>(hp));
      const uint2 hc = __ldcg(reinterpret_cast<const uint2*>(hp + 16));
      reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(g4_smem) + hoff)[i] = g4_b_frags(ha, hc);
    }
    g4_cp_async_wait<0>();
    __syncthreads();  // every warp's staged rows and h, visible to the whole block
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (sl < S) {
      const int nb = F / 32;
      const uint4* hs = reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(g4_smem) + hoff) + sl * 4 * nb + t;
      const int b1 = (ks + 1) * nb / KS;
      for (int b = ks * nb / KS; b < b1; ++b) {
        const uint4 hb = hs[4 * b];
        const int o = base + g * rbf + 18 * b;
        block_mma(acc, o, o + 8 * rbf, hb.x, hb.y, hb.z, hb.w, true);
      }
    }
    if (t == 0) {
      const float wt = sl < S ? (live ? wts[sl] : g4_nan()) : 0.0f;
      g4_red[warp][0][g] = wt * acc[0];
      g4_red[warp][0][8 + g] = wt * acc[2];
    }
    __syncthreads();
    if (threadIdx.x < 16) {  // slots in order, each slot's parts in order
      float s = 0.0f;
      for (int w = 0; w < S; ++w) {
        for (int k = 0; k < KS; ++k) s += g4_red[SL * k + w][0][threadIdx.x];
      }
      out[r0 + threadIdx.x] = static_cast<T>(s);
    }
  }
  // the last block to finish sets the counters back to zero for the next call
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(blocks_done, 1u) == gridDim.x - 1) {
      atomicExch(tickets, 0u);
      atomicExch(sets_done, 0u);
      atomicExch(blocks_done, 0u);
      __threadfence();
    }
  }
"""

# cp.async.wait_group takes an immediate: n from an unrolled loop folds to one case. g4_b_frags: mma's
# B registers of one 32-weight block for lane quad t, from bf16 v[4t .. 4t+3] and v[16+4t .. 16+4t+3]
# given as two 8-byte words each: k slots 2t, 2t+1 take v[4t], v[4t+1], slots 2t+8, 2t+9 v[4t+2], v[4t+3],
# as the weight pairs (g4_q4_pair of bytes 0, 1 and 2, 3 of a lane's 4 bytes) take the weights
_WAIT_UPTO_CUDA = r"""
__device__ __forceinline__ uint4 g4_b_frags(uint2 a, uint2 c) { return make_uint4(a.x, a.y, c.x, c.y); }
__device__ __forceinline__ void g4_cp_async_wait_upto(int n) {  // at most n newer groups still pending
  switch (n) {
    case 0: g4_cp_async_wait<0>(); break;
    case 1: g4_cp_async_wait<1>(); break;
    case 2: g4_cp_async_wait<2>(); break;
    default: g4_cp_async_wait<3>(); break;
  }
}
"""

_DEF = _KernelDef("g4_q4_0_moe_experts", "moe_experts", Q4_0, ("x", "ids", "wts", "wgu", "wdn", "counters"),
                  ("out", "h"), ("T", "NW", "SETS", "S", "SMEM"),
                  {"metal": ("", ""), "cuda": (prelude("cuda") + _MMA_HEADER_CUDA + _STREAM_HEADER_CUDA + _RUNS_HEADER_CUDA + _WAIT_UPTO_CUDA, _BODY_CUDA)})  # fmt: skip


COUNTER_WORDS = 96
"""uint32 words of a call's counters: three counters 128 bytes apart."""


# The route folded in (kernel g4_q4_0_moe_routed, family "moe_route_fold"): TR = ceil(E / NW) router
# tickets come first; warp w of router ticket r computes logit r * NW + w as g4_route_logits does
# (the same sums, rounded to bf16), and the last router ticket to finish routes them with
# g4_route_logits' route text (softmax, top-S, renormalised weights times the per-expert scale),
# writes ids and weights, then counts once more. Every experts ticket first waits for that count
# (tickets in order: the router tickets never wait, so it cannot deadlock) and reads ids and weights
# through L2 (written in this launch). Bit-equal to the two launches on the H200 but slower there
# (26B-A4B 274.0 against 296.0 tok/s): the waiting expert tickets hold every SM, so the dense MLP's
# launches, which ran beside route_logits, wait for this one (bench/NOTES.md, session 32).
_ROUTER_TICKETS_CUDA = r"""
  if (ticket >= 0 && threadIdx.x == 0) {  // the experts' tickets read the route: wait for it
    unsigned int done, pause = 32;
    for (long long spin = 0;; ++spin) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(done) : "l"(routed) : "memory");
      if (done > (unsigned int)TR) break;
      if (spin > (1ll << 23)) __trap();
      __nanosleep(pause);
      pause = min(2 * pause, 512u);
    }
  }
  __syncthreads();
  if (ticket < 0) {
    __shared__ int g4_last;
    const int er = g4_ticket * NW + warp;
    if (er < E) {
      const T* wr = router + (size_t)er * H;
LOGIT_SUM      if (lane == 0) {
        logits[er] = static_cast<T>(acc);
        __threadfence();
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) g4_last = atomicAdd(routed, 1u) == (unsigned int)(TR - 1) ? 1 : 0;
    __syncthreads();
    if (g4_last != 0 && warp == 0) {
      __threadfence();
ROUTE
      if (lane == 0) {  // release: the route's stores before the count the experts' tickets wait for
        __threadfence();
        atomicAdd(routed, 1u);
      }
    }
  } else if (ticket < TA) {"""


def _routed_body() -> str:
    """_BODY_CUDA with the router tickets in front (the comment above)."""
    route = render(_fused_route_body(), "cuda")
    for old, new in (("  const int row = m;\n", "  const int row = 0;  // one token\n"),
                     ("weights[(size_t)row * K + j]", "wts[j]"), ("indices[(size_t)row * K + j]", "ids[j]"),
                     ("  if (lane == 0) *done = 0u;\n", "")):  # fmt: skip
        assert route.count(old) == 1, old
        route = route.replace(old, new)
    def _router_tickets(route: str) -> str:
        text = _ROUTER_TICKETS_CUDA
        for old, new in (("ROUTE\n", "      {\n" + route + "      }\n"), ("LOGIT_SUM", render(LOGIT_SUM, "cuda"))):
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        return text

    body = _BODY_CUDA
    for old, new, n in (
        ("q4_0 MoE experts in one launch (CUDA): gate|up", "q4_0 MoE route and experts in one launch (CUDA): route, gate|up", 1),
        ("  const int TB = H / 16;\n", "  const int TB = H / 16;\n  constexpr int K = S;  // the route's top-k: a slot per chosen expert\n"
                                       "  const int TR = (E + NW - 1) / NW;  // router tickets: an expert row per warp\n", 1),
        ("  unsigned int* blocks_done = tickets + 64;\n",
         "  unsigned int* blocks_done = tickets + 64;\n  unsigned int* routed = tickets + 96;  // router tickets done, + 1 once routed\n", 1),
        ("  const int ticket = g4_ticket;\n", "  const int ticket = g4_ticket - TR;  // the experts' tickets from 0, the router's below\n", 1),
        ("  if (ticket < TA) {", _router_tickets(route), 1),
        ("ids[slot]", "__ldcg(ids + slot)", 2), ("ids[sl]", "__ldcg(ids + sl)", 1), ("wts[sl]", "__ldcg(wts + sl)", 1),
        ("      atomicExch(blocks_done, 0u);\n", "      atomicExch(blocks_done, 0u);\n      atomicExch(routed, 0u);\n", 1),
    ):  # fmt: skip
        assert body.count(old) == n, old
        body = body.replace(old, new)
    return body


ROUTED_COUNTER_WORDS = 128
"""uint32 words of a routed call's counters: four counters 128 bytes apart."""

_DEF_ROUTED = _KernelDef("g4_q4_0_moe_routed", "moe_routed", Q4_0, ("x", "xr", "router", "scale", "wgu", "wdn", "counters"),
                         ("out", "h", "logits", "wts", "ids"), ("T", "TS", "NW", "SETS", "S", "SMEM", "EPL"),
                         {"metal": ("", ""), "cuda": (attention_text("")["cuda"][0] + _MMA_HEADER_CUDA + _STREAM_HEADER_CUDA
                                                      + _RUNS_HEADER_CUDA + _WAIT_UPTO_CUDA, _routed_body())})  # fmt: skip


def new_counters() -> mx.array:
    """The zeroed uint32 [96] counters one sequence of q4_0_moe_experts calls shares (one per layer):
    custom_kernels.ticket_counters."""
    return ticket_counters(COUNTER_WORDS)


def shared_bytes(slots: int, f: int, h: int, sets: int = SETS) -> int:
    """Dynamic shared memory of one threadgroup: the larger of a gate|up ticket's pieces with x [H]
    bf16 and a down ticket's staged rows with h [slots, F] bf16, plus 16 bytes the block reads may
    run past the end."""
    return max(sets * (h // 256) * _PIECE + 2 * h, slots * (16 * row_bytes(Q4_0, f) + 2 * f)) + 16


def plan_moe_experts(slots: int, f: int, h: int, config: MoeConfig | None = None) -> tuple[LaunchPlan, int]:
    """(launch plan, dynamic shared bytes) of one call: TA + TB threadgroups of 32 * warps threads."""
    cfg = config or MoeConfig()
    if slots > MAX_SLOTS:
        raise ValueError(f"moe_experts: {slots} slots, at most {MAX_SLOTS}")
    if h % 256 or f % 32:
        raise ValueError(f"moe_experts: needs H % 256 == 0 and F % 32 == 0, got H={h}, F={f}")
    smem = shared_bytes(slots, f, h, cfg.sets)
    if smem > SHARED_LIMIT:
        raise ValueError(f"moe_experts: {smem} bytes of shared memory per block (H={h}, F={f}), over {SHARED_LIMIT}")
    ta = -(-slots * (f // 8) // cfg.sets)
    template = [("T", "bfloat16"), ("NW", cfg.warps), ("SETS", cfg.sets), ("S", slots), ("SMEM", smem)]
    grid = ((ta + h // 16) * 32 * cfg.warps, 1, 1)
    return LaunchPlan(template, grid, (32 * cfg.warps, 1, 1), (h,)), smem


def moe_experts_supported(x: mx.array, ids: mx.array, f: int, h: int, config: MoeConfig | None = None) -> bool:
    """True when the one-launch kernel takes this call: CUDA (sm_80+), bf16 x of one token, and
    shapes plan_moe_experts accepts for config (default: MoeConfig with GEMMA4_MLX_MOE_GEOMETRY,
    whose bad values are errors, not a fallback)."""
    return math.prod(ids.shape[:-1]) == 1 and _takes(x, ids.shape[-1], f, h, config)


def _takes(x: mx.array, slots: int, f: int, h: int, config: MoeConfig | None) -> bool:
    if not (backend() == "cuda" and cuda_arch() >= MMA_ARCH and x.dtype == mx.bfloat16 and x.size == h):
        return False
    cfg = config or geometry_override(MoeConfig(), MOE_GEOMETRY_ENV)
    try:
        plan_moe_experts(slots, f, h, cfg)
    except ValueError:  # more than 8 slots, H % 256, F % 32, shared memory over SHARED_LIMIT
        return False
    return True


def launch_moe_experts(x: mx.array, ids: mx.array, weights: mx.array, gate_up_blocks: mx.array,
                       down_blocks: mx.array, counters: mx.array, f: int,
                       config: MoeConfig | None = None) -> tuple[mx.array, mx.array]:  # fmt: skip
    """The kernel (no checks, no fallback; CUDA builds only) -> (out [..., H] like x, h [k, F]);
    config: default MoeConfig's, with GEMMA4_MLX_MOE_GEOMETRY."""
    cfg = config or geometry_override(MoeConfig(), MOE_GEOMETRY_ENV)
    plan, smem = plan_moe_experts(ids.shape[-1], f, x.shape[-1], cfg)
    kernel = get_kernel(_DEF.name, _DEF.input_names, _DEF.output_names, _DEF.text["metal"], _DEF.text["cuda"],
                        cuda_shared_memory=smem)  # fmt: skip
    out, gelu = kernel(inputs=[x, ids, weights.astype(mx.float32), gate_up_blocks, down_blocks, counters],
                       template=template_args(plan.template), grid=plan.grid, threadgroup=plan.threadgroup,
                       output_shapes=[x.shape, (ids.shape[-1], f)], output_dtypes=[mx.bfloat16, mx.bfloat16])  # fmt: skip
    return out, gelu


def _check(x: mx.array, ids: mx.array, weights: mx.array, gate_up_blocks: mx.array, down_blocks: mx.array,
           f: int) -> None:  # fmt: skip
    h = x.shape[-1]
    if ids.dtype != mx.int32 or ids.ndim < 1 or weights.shape != ids.shape or x.shape[:-1] != ids.shape[:-1]:
        raise ValueError(f"moe_experts: x [..., H], ids int32 [..., k] and weights [..., k] with the same lead dims; "
                         f"got x {x.shape}, ids {ids.dtype} {ids.shape}, weights {weights.shape}")  # fmt: skip
    _check_stacks(gate_up_blocks, down_blocks, f, h)


def _check_stacks(gate_up_blocks: mx.array, down_blocks: mx.array, f: int, h: int) -> None:
    e = gate_up_blocks.shape[0] if gate_up_blocks.ndim == 3 else -1
    want = ((e, 2 * f, row_bytes(Q4_0, h)), (e, h, row_bytes(Q4_0, f)))
    if gate_up_blocks.dtype != mx.uint8 or down_blocks.dtype != mx.uint8 or (gate_up_blocks.shape, down_blocks.shape) != want:
        raise ValueError(f"moe_experts: Q4_0 stacks must be uint8 gate|up [E, 2F, H/32*18] and down [E, H, F/32*18] "
                         f"(F={f}, H={h}: {want}), got {gate_up_blocks.shape} and {down_blocks.shape}")  # fmt: skip


def moe_experts_reference(x, ids, weights, gate_up_blocks, down_blocks, f: int) -> mx.array:
    """The two-op reference: gate_up_gather_reference then moe_down_reference -> [..., H], x.dtype."""
    gelu = gate_up_gather_reference(x, ids, gate_up_blocks, Q4_0, f)
    return moe_down_reference(gelu, ids, weights, down_blocks, Q4_0, x.shape[-1])


def q4_0_moe_experts(x: mx.array, ids: mx.array, weights: mx.array, gate_up_blocks: mx.array,
                     down_blocks: mx.array, counters: mx.array, f: int) -> mx.array:  # fmt: skip
    """A MoE layer's Q4_0 experts (module doc) -> [..., H] in x.dtype: one launch where the family
    "moe_one_launch" is on and moe_experts_supported; else q4_0_gate_up_gather then q4_0_moe_down."""
    _check(x, ids, weights, gate_up_blocks, down_blocks, f)
    if use_kernel("moe_one_launch"):
        cfg = geometry_override(MoeConfig(), MOE_GEOMETRY_ENV)
        if moe_experts_supported(x, ids, f, x.shape[-1], cfg):
            check_ticket_counters(counters, COUNTER_WORDS, "new_counters")
            return launch_moe_experts(x, ids, weights, gate_up_blocks, down_blocks, counters, f, cfg)[0]
    gelu = q4_0_gate_up_gather(x, ids, gate_up_blocks, f)
    return q4_0_moe_down(gelu, ids, weights, down_blocks, x.shape[-1])


def new_routed_counters() -> mx.array:
    """The zeroed uint32 [128] counters one sequence of q4_0_moe_routed calls shares (one per layer)."""
    return ticket_counters(ROUTED_COUNTER_WORDS)


def plan_moe_routed(slots: int, f: int, h: int, experts: int, scale_dtype: str,
                    config: MoeConfig | None = None) -> tuple[LaunchPlan, int]:  # fmt: skip
    """(launch plan, dynamic shared bytes) of one routed call: plan_moe_experts' with ceil(E / warps)
    router tickets in front."""
    cfg = config or MoeConfig()
    plan, smem = plan_moe_experts(slots, f, h, cfg)
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"moe_routed: {experts} experts, 1..{MAX_EXPERTS}")
    template = [("T", "bfloat16"), ("TS", scale_dtype), *plan.template[1:], ("EPL", -(-experts // 32))]
    grid = (plan.grid[0] + -(-experts // cfg.warps) * 32 * cfg.warps, 1, 1)
    return LaunchPlan(template, grid, plan.threadgroup, plan.output_shape), smem


def launch_moe_routed(x: mx.array, x_router: mx.array, router_w: mx.array, per_expert_scale: mx.array, top_k: int,
                      gate_up_blocks: mx.array, down_blocks: mx.array, counters: mx.array, f: int,
                      config: MoeConfig | None = None) -> tuple[mx.array, ...]:  # fmt: skip
    """The routed kernel (no checks, no fallback; CUDA builds only) -> (out [..., H] like x, h [k, F],
    logits [E] bf16, weights f32 [k], ids int32 [k])."""
    cfg = config or geometry_override(MoeConfig(), MOE_GEOMETRY_ENV)
    e = router_w.shape[0]
    plan, smem = plan_moe_routed(top_k, f, x.shape[-1], e, dtype_name(per_expert_scale.dtype), cfg)
    kernel = get_kernel(_DEF_ROUTED.name, _DEF_ROUTED.input_names, _DEF_ROUTED.output_names, _DEF_ROUTED.text["metal"],
                        _DEF_ROUTED.text["cuda"], cuda_shared_memory=smem)  # fmt: skip
    return tuple(kernel(inputs=[x, x_router, router_w, per_expert_scale, gate_up_blocks, down_blocks, counters],
                        template=template_args(plan.template), grid=plan.grid, threadgroup=plan.threadgroup,
                        output_shapes=[x.shape, (top_k, f), (e,), (top_k,), (top_k,)],
                        output_dtypes=[mx.bfloat16, mx.bfloat16, mx.bfloat16, mx.float32, mx.int32]))  # fmt: skip


def q4_0_moe_routed(x: mx.array, x_router: mx.array, router_w: mx.array, per_expert_scale: mx.array, top_k: int,
                    gate_up_blocks: mx.array, down_blocks: mx.array, counters: mx.array, f: int) -> mx.array | None:  # fmt: skip
    """A MoE layer's route (router.route_logits of x_router, router_w [E, H] bf16) and its Q4_0
    experts (q4_0_moe_experts of x) in one launch -> [..., H] bf16, or None where family
    "moe_route_fold" (or "moe_one_launch", "router_fused", "router") is off or the kernel does not
    take the call: one bf16 token, bf16 router weights, 1 <= top_k <= E <= MAX_EXPERTS (the caller then routes and runs the
    experts as before). counters: new_routed_counters(), one per layer."""
    if not all(use_kernel(fam) for fam in ("moe_route_fold", "moe_one_launch", "router_fused", "router")):
        return None
    h = x.shape[-1]
    _check_stacks(gate_up_blocks, down_blocks, f, h)
    e = gate_up_blocks.shape[0]
    if router_w.shape[0] != e or per_expert_scale.shape != (e,):
        raise ValueError(f"moe_routed: the router's weight [E, H] and per-expert scale [E] must have the stacks' "
                         f"E = {e} experts, got {router_w.shape} and {per_expert_scale.shape}")  # fmt: skip
    if not (x.dtype == x_router.dtype == router_w.dtype == mx.bfloat16 and x.size == h and x_router.shape == x.shape
            and router_w.ndim == 2 and router_w.shape[1] == h and per_expert_scale.dtype in (mx.float32, mx.bfloat16)):  # fmt: skip
        return None
    cfg = geometry_override(MoeConfig(), MOE_GEOMETRY_ENV)
    if not _takes(x, top_k, f, h, cfg) or not 1 <= top_k <= router_w.shape[0] <= MAX_EXPERTS:
        return None
    check_ticket_counters(counters, ROUTED_COUNTER_WORDS, "new_routed_counters")
    return launch_moe_routed(x, x_router, router_w, per_expert_scale, top_k, gate_up_blocks, down_blocks, counters, f, cfg)[0]


MLP_SHARED_LIMIT = 100 * 1024
"""The most shared memory per threadgroup at which a dense MLP takes the one launch: two threadgroups
per SM (26B-A4B's F = 2112: 79.8 KB; E2B's F = 6144: 66.0 KB). Above it (E4B's F = 10240: 110.0 KB,
one threadgroup per SM) the launch ran slower than the two it replaces: E4B at 4K 104.8 against 160.4
tok/s (bench/NOTES.md, session 32)."""


_ONE_SLOT: dict[tuple, tuple[mx.array, mx.array]] = {}


def _one_slot(lead: tuple[int, ...]) -> tuple[mx.array, mx.array]:
    """ids [..., 1] = 0 and weights [..., 1] = 1.0 for x's lead dims: made once from host memory, so
    in a compiled step they are constants, not graph nodes."""
    if lead not in _ONE_SLOT:
        _ONE_SLOT[lead] = (mx.array(np.zeros((*lead, 1), np.int32)), mx.array(np.ones((*lead, 1), np.float32)))
    return _ONE_SLOT[lead]


def q4_0_mlp_one_launch(x: mx.array, gate_up_stack: mx.array, down_stack: mx.array, counters: mx.array,
                        f: int) -> mx.array | None:  # fmt: skip
    """A dense GeGLU MLP's one bf16 token through the one-launch expert kernel as its only slot (id
    0 of one-expert stacks, weight 1): gate|up, GeGLU and down in one launch -> [..., H], or None
    where family "mlp_one_launch" is off, the kernel does not take the call or its shared memory is
    over MLP_SHARED_LIMIT (the caller then runs its two launches). gate_up_stack [1, 2F, H/32*18],
    down_stack [1, H, F/32*18]: the MLP's Q4_0 blocks as one-expert stacks (views); counters: the
    call site's own new_counters()."""
    if not (use_kernel("mlp_one_launch") and use_kernel("moe_one_launch")):  # the same kernel
        return None
    if x.size != x.shape[-1] or x.dtype != mx.bfloat16:  # one bf16 token only (prefill: None, no slots made)
        return None
    ids, weights = _one_slot(x.shape[:-1])
    _check(x, ids, weights, gate_up_stack, down_stack, f)
    cfg = geometry_override(MoeConfig(), MOE_GEOMETRY_ENV)
    if not moe_experts_supported(x, ids, f, x.shape[-1], cfg) or shared_bytes(1, f, x.shape[-1], cfg.sets) > MLP_SHARED_LIMIT:
        return None
    check_ticket_counters(counters, COUNTER_WORDS, "new_counters")
    return launch_moe_experts(x, ids, weights, gate_up_stack, down_stack, counters, f, cfg)[0]


# --------------------------------------------------------------------------------------------
# Emulator / compile-test registry (see custom_kernels.registry)
# --------------------------------------------------------------------------------------------


def _case(rng: np.random.Generator, slots: int, experts: int, f: int, h: int, cfg: MoeConfig, bad_id: bool = False,
          routed: bool = False):  # fmt: skip
    """routed: g4_q4_0_moe_routed's case: ids and weights from a router whose rows are xr's direction
    times distinct logits in [-0.5, 0.5] (one bf16 rounding of a logit cannot reorder the experts; it
    moves a weight by at most ~0.2%, which the tolerances of the weights and the output allow)."""
    from .quant_matvec import _activations, _gelu_tanh_f64, _tolerances, dequantize_f64, random_blocks
    from .registry import KernelCase, bf16_to_f32, f32_to_bf16
    from .router import route_f64

    x, x64, in_dt = _activations(rng, (1, h), "bfloat16")
    if routed:
        xr = rng.standard_normal(h).astype(np.float32)
        target = rng.permutation(np.linspace(-0.5, 0.5, experts))
        wr = f32_to_bf16((target[:, None] * xr[None, :] / float(xr @ xr)).astype(np.float32))
        xr = f32_to_bf16(xr)
        logits = bf16_to_f32(wr).astype(np.float64) @ bf16_to_f32(xr).astype(np.float64)
        scale = rng.uniform(0.5, 2.0, experts).astype(np.float32)
        w64, ids = route_f64(logits[None], scale, slots)
        wts, ids = w64[0].astype(np.float32), ids[0]
    else:
        ids = rng.permutation(experts)[:slots].astype(np.int32)
        if bad_id:
            ids[slots // 2] = experts  # out of range: that slot's h row and the whole output are NaN
        wts = rng.random(slots).astype(np.float32)
    wgu = random_blocks(rng, Q4_0, (experts, 2 * f), h)
    wdn = random_blocks(rng, Q4_0, (experts, h), f)
    safe = np.where((ids >= 0) & (ids < experts), ids, 0)
    gu64 = np.einsum("snk,k->sn", dequantize_f64(wgu, Q4_0)[safe], x64[0])
    gu_mag = np.einsum("snk,k->sn", np.abs(dequantize_f64(wgu, Q4_0)[safe]), np.abs(x64[0]))
    gelu64 = _gelu_tanh_f64(gu64[:, :f]) * gu64[:, f:]
    gelu_scale = float(((np.abs(gu64[:, :f]) + gu_mag[:, :f]) * (np.abs(gu64[:, f:]) + gu_mag[:, f:])).max())
    # the down half reads h rounded to bf16, as the kernel stores it
    hb = bf16_to_f32(f32_to_bf16(gelu64.astype(np.float32))).astype(np.float64)
    dn64 = dequantize_f64(wdn, Q4_0)[safe]  # [k, H, F]
    out64 = np.einsum("s,shf,sf->h", wts.astype(np.float64), dn64, hb)
    out_scale = float(np.einsum("s,shf,sf->h", wts.astype(np.float64), np.abs(dn64), np.abs(hb)).max())
    if bad_id:
        gelu64[slots // 2] = np.nan
        out64[:] = np.nan
    rtol, _ = _tolerances("bfloat16", 1.0)
    # one atol for both outputs: f32 sums against the larger scale, plus a few h entries that f32
    # rounds to the other bf16 neighbour than float64 does (one ulp, 2^-8, each)
    flip = 4 * 2.0**-8 * float(np.abs(wts[:, None, None] * dn64 * hb[:, None, :]).max())
    atol = 1e-5 * max(gelu_scale, out_scale) + flip
    if routed:
        plan, smem = plan_moe_routed(slots, f, h, experts, "float32", cfg)
        return KernelCase(
            inputs={"x": x, "xr": xr, "router": wr, "scale": scale, "wgu": wgu, "wdn": wdn,
                    "counters": np.zeros(ROUTED_COUNTER_WORDS, np.uint32)},
            template=plan.template, grid=plan.grid, threadgroup=plan.threadgroup,
            output_shapes=[(1, h), (slots, f), (experts,), (slots,), (slots,)],
            output_dtypes=["bfloat16", "bfloat16", "bfloat16", "float32", "int32"],
            expected=[out64.reshape(1, h), gelu64, logits, w64[0], ids.astype(np.float64)],
            rtol=rtol, atol=atol, output_tolerances=[(rtol, atol + 4e-3 * out_scale), (rtol, atol), (2.0**-8, 1e-6),
                                                     (4e-3, 1e-6), (0.0, 0.0)],
            input_dtypes={**in_dt, "xr": "bfloat16", "router": "bfloat16"},
            label=f"moe_routed k={slots} E={experts} F={f} H={h} sets={cfg.sets} warps={cfg.warps}",
            cuda_shared_memory=smem,
        )  # fmt: skip
    plan, smem = plan_moe_experts(slots, f, h, cfg)
    return KernelCase(
        inputs={"x": x, "ids": ids.reshape(1, slots), "wts": wts.reshape(1, slots), "wgu": wgu, "wdn": wdn,
                "counters": np.zeros(COUNTER_WORDS, np.uint32)},
        template=plan.template, grid=plan.grid, threadgroup=plan.threadgroup,
        output_shapes=[(1, h), (slots, f)], output_dtypes=["bfloat16", "bfloat16"],
        expected=[out64.reshape(1, h), gelu64], rtol=rtol, atol=atol, input_dtypes=in_dt,
        label=f"moe_experts k={slots} E={experts} F={f} H={h} sets={cfg.sets} warps={cfg.warps}{' bad id' if bad_id else ''}",
        cuda_shared_memory=smem,
    )  # fmt: skip


def _cases(rng: np.random.Generator):
    """A last gate|up ticket with fewer sets (8 sets in tickets of 3), more pieces than warps (H =
    1280 with 8 warps, H = 2304 in 4 sets with 16), F not a multiple of 64 (the MoE fixture's 96)
    with 16 warps (8 per slot of 2 over 3 blocks), one slot, an id out of range, and one expert as
    one slot with the default geometry (family "mlp_one_launch": a dense MLP as the only expert; all
    16 warps on its down rows, F = 704's 22 blocks not a multiple of 16)."""
    c = MoeConfig
    return [_case(rng, 3, 5, 64, 256, c(2, 8)), _case(rng, 8, 10, 128, 1280, c(2, 8)), _case(rng, 1, 2, 64, 512, c(3, 8)),
            _case(rng, 4, 6, 64, 2304, c(4, 16)), _case(rng, 2, 8, 96, 256, c(2, 16)),
            _case(rng, 5, 7, 192, 256, c(1, 8), bad_id=True),
            _case(rng, 1, 1, 64, 256, c(3, 16)), _case(rng, 1, 1, 704, 256, c(3, 16))]  # fmt: skip


def _routed_cases(rng: np.random.Generator):
    """8 of 128 experts (26B-A4B's route) with 8 and 16 warps, 3 of 45 (E not a multiple of 32 or
    of the warps), one of 5 (fewer experts than warps: one router ticket with idle warps), H = 1280
    (H not a multiple of 128 lanes x 4)."""
    c = MoeConfig
    return [_case(rng, 8, 128, 64, 256, c(2, 8), routed=True), _case(rng, 8, 128, 96, 512, c(3, 16), routed=True),
            _case(rng, 3, 45, 64, 1280, c(2, 16), routed=True), _case(rng, 1, 5, 64, 256, c(3, 16), routed=True)]  # fmt: skip


def kernel_specs():
    from .registry import KernelSpec

    return [KernelSpec(d.name, d.input_names, d.output_names, "", "", *d.text["cuda"], cases)  # CUDA only
            for d, cases in ((_DEF, _cases), (_DEF_ROUTED, _routed_cases))]

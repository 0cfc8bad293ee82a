"""MoE expert choice after the router projection, in one launch: softmax over the expert logits,
the top-k experts and their renormalised weights times the per-expert scales (MLX ops take about
eight launches for it: softmax, negate, argpartition, slice, take, sum, divide, gather and casts).

    weights, indices = route(logits, per_expert_scale, top_k)
    # logits [..., E] (f32 math whatever the dtype), per_expert_scale [E]
    # -> weights f32 [..., k], indices int32 [..., k]

Semantics (kernel, ``route_reference`` and the tests' oracle): p = softmax(f32(logits)); the k
experts of highest p, ties to the lower index, in that order (descending p); weight_i =
p_i / sum_j p_j over the k chosen, times f32(per_expert_scale[index_i]).

Kernel (one body for Metal and CUDA, custom_kernels.dialect): one SIMD group per row; lane l holds
the logits of experts l, l + 32, ... (EPL = ceil(E / 32) of them). A SIMD max and sum give the
softmax; k rounds of a SIMD argmax over (p desc, index asc) pick the experts (each lane keeps a
bit per expert it has given away); every lane then knows the k winners, sums their p in order and
lane 0 writes the weights. exp is the attention kernels' g4_attn_exp (same text), so the result
does not depend on a backend's math library.

On by default on GPUs since it passed ``pytest -m gpu`` on the H200 (session 7).

The router's projection before it, ``router_logits(x, w)`` (x [..., H] @ w [E, H].T -> [..., E] in
x's dtype, f32 sums), has its own kernel (op family "router_proj": passes ``pytest -m gpu`` on the
H200 since session 11, a CUDA default since session 21, with norm_moe: +6% for 26B-A4B in one
process): MLX runs that bf16 GEMV as four
graph nodes (flatten, transpose, matmul, unflatten) and a cuBLAS-free gemv that took 13.3 us for
128 x 2816 on the H200 (26B-A4B, session 10); here one SIMD group per expert row reads x and its row
in 4-element vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import (KernelSource, backend, check_ticket_counters, dtype_name, geometry_override, template_args,
               ticket_counters, use_kernel, use_reference)
from .attention import _text as attention_text
from .dialect import render
from .norm import (check_rows, fusable, moe_norm_parts, residual_norm_moe_np, residual_norm_moe_reference, row_case_values,
                   row_geometry, row_template)

__all__ = ["MAX_EXPERTS", "MAX_TOP_K", "kernel_specs", "route", "route_f64", "route_reference", "router_logits",
           "router_logits_reference", "route_logits", "route_logits_supported", "new_router_counters",
           "residual_norm_route", "residual_norm_route_reference", "NORM_ROUTE_MAX_D", "NORM_ROUTE_MAX_EXPERTS",
           "NORM_ROUTE_MAX_TOP_K", "NormRouteConfig"]

MAX_EXPERTS = 1024
MAX_TOP_K = 32

# Template: T (logits dtype), TS (scale dtype), E experts, K chosen, EPL = ceil(E / 32).
_ROUTE_BODY = r"""
  // gemma4-mlx moe_route: softmax, top-K (ties to the lower index), renormalised scaled weights
  const int lane = $lane;
  const int row = $tg_x;  // one SIMD group of 32 lanes per row
  const float NEG_INF = g4_as_float(0xff800000u);
  const $device T* x = logits + (size_t)row * E;
  float p[EPL];
  float top = NEG_INF;
  $unroll for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? static_cast<float>(x[e]) : NEG_INF;
    top = p[i] > top ? p[i] : top;
  }
  top = g4_simd_max(top);
  float z = 0.0f;
  $unroll for (int i = 0; i < EPL; ++i) {
    p[i] = lane + 32 * i < E ? g4_attn_exp(p[i] - top) : 0.0f;
    z += p[i];
  }
  z = g4_simd_sum(z);
  $unroll for (int i = 0; i < EPL; ++i) p[i] = lane + 32 * i < E ? p[i] / z : -1.0f;
  uint32_t taken = 0u;  // bit i: expert lane + 32 i already chosen
  float win_p[K];
  int win_e[K];
  $unroll for (int j = 0; j < K; ++j) {
    float bv = -2.0f;
    int be = 0x7fffffff;
    $unroll for (int i = 0; i < EPL; ++i) {
      const bool avail = ((taken >> i) & 1u) == 0u;
      if (avail && p[i] > bv) {  // i ascending: the first of equal values has the lower index
        bv = p[i];
        be = lane + 32 * i;
      }
    }
    $unroll for (int o = 16; o >= 1; o >>= 1) {
      const float ov = g4_shuffle_xor(bv, o);
      const int oe = (int)g4_as_uint(g4_shuffle_xor(g4_as_float((uint32_t)be), o));
      if (ov > bv || (ov == bv && oe < be)) {
        bv = ov;
        be = oe;
      }
    }
    win_p[j] = bv;
    win_e[j] = be;
    if (be % 32 == lane) taken |= 1u << (be / 32);
  }
  if (lane == 0) {
    float s = 0.0f;
    $unroll for (int j = 0; j < K; ++j) s += win_p[j];
    $unroll for (int j = 0; j < K; ++j) {
      weights[(size_t)row * K + j] = win_p[j] / s * static_cast<float>(scale[win_e[j]]);
      indices[(size_t)row * K + j] = win_e[j];
    }
  }
"""


# the attention module's header (prelude + g4_attn_exp): one exp for every kernel that needs it
_ROUTE = KernelSource("g4_moe_route", ("logits", "scale"), ("weights", "indices"), attention_text(_ROUTE_BODY))

# Template: T (x, w and out dtype), H (row length, a multiple of 4), NSG (SIMD groups per
# threadgroup). Grid: x = 32 NSG x ceil(E / NSG) threads (SIMD group = expert row), y = tokens.
LOGIT_SUM = r"""  float acc = 0.0f;
  $unroll for (int c = 4 * $lane; c < H; c += 128) {
    float a[4];
    float b[4];
    g4_load4(xr + c, a);
    g4_load4(wr + c, b);
    acc += a[0] * b[0] + a[1] * b[1] + a[2] * b[2] + a[3] * b[3];
  }
  acc = g4_simd_sum(acc);
"""
"""One logit, sum_k xr[k] wr[k] over H, in f32 (every lane's own order, then the SIMD sum): also
the routed expert kernel's (custom_kernels.moe_experts), so both give the same bits."""
_LOGITS_BODY = r"""
  // gemma4-mlx router_logits: out[m, e] = sum_k x[m, k] w[e, k], f32 sums, rounded once to T
  const int E = w_shape[0];
  const int e = $tg_x * NSG + $simd;
  if (e >= E) return;  // a whole SIMD group: e is the same for its lanes
  const int m = $tg_y;
  const $device T* xr = x + (size_t)m * H;
  const $device T* wr = w + (size_t)e * H;
""" + LOGIT_SUM + r"""  if ($lane == 0) out[(size_t)m * E + e] = static_cast<T>(acc);
"""
_LOGITS = KernelSource("g4_router_logits", ("x", "w"), ("out",), attention_text(_LOGITS_BODY))
_LOGITS_NSG = 4
_LOGITS_MAX_ROWS = 8  # tokens; more (prefill) take MLX's matmul


# The projection and the route in one launch (kernel g4_route_logits, CUDA only): every threadgroup
# writes its experts' logits as g4_router_logits does, then takes a ticket from its row's counter;
# the row's last threadgroup routes the row as g4_moe_route does (reading the logits from L2 after
# a device-scope fence) and sets the counter back to zero for the next call. Metal has no
# device-scope fence its atomics order against, so it keeps the two launches.
# Template: T (x, w, logits), TS (scale), H, E, K, EPL = ceil(E / 32), NSG.
_FUSED_TICKET = r"""
  $barrier;
  unsigned int* done = const_cast<unsigned int*>(counters) + m;
  if ($tid == 0) g4_last = atomicAdd(done, 1u) == gridDim.x - 1u ? 1 : 0;
  $barrier;
  if (g4_last == 0 || $simd != 0) return;
  __threadfence();
  const int lane = $lane;
"""


def _fused_logits_body() -> str:
    """_LOGITS_BODY's text with E a template value, every SIMD group reaching the ticket's
    barrier, and each logit fenced after its store, then the ticket."""
    body = _LOGITS_BODY.replace("router_logits: out[m, e]", "route_logits: logits[m, e]", 1)
    for old, new in (("  const int E = w_shape[0];\n", "  __shared__ int g4_last;\n"),
                     ("  if (e >= E) return;  // a whole SIMD group: e is the same for its lanes\n  const int m = $tg_y;\n",
                      "  const int m = $tg_y;\n  if (e < E) {\n"),
                     ("  if ($lane == 0) out[(size_t)m * E + e] = static_cast<T>(acc);\n",
                      "  if ($lane == 0) {\n    logits[(size_t)m * E + e] = static_cast<T>(acc);\n    __threadfence();\n  }\n  }\n")):  # fmt: skip
        assert body.count(old) == 1, old
        body = body.replace(old, new)
    return body + _FUSED_TICKET


def _fused_route_body() -> str:
    body = _ROUTE_BODY.replace("moe_route:", "route_logits (route):", 1)
    for old, new in (("  const int lane = $lane;\n", ""),  # the ticket's tail declares it
                     ("  const int row = $tg_x;  // one SIMD group of 32 lanes per row\n", "  const int row = m;\n"),
                     ("  const $device T* x = logits + (size_t)row * E;\n", "  const T* lr = logits + (size_t)row * E;\n"),
                     ("static_cast<float>(x[e])", "static_cast<float>(__ldcg(lr + e))")):  # fmt: skip
        assert body.count(old) == 1, old
        body = body.replace(old, new)
    return body + "  if (lane == 0) *done = 0u;\n"


_FUSED = KernelSource("g4_route_logits", ("x", "w", "scale", "counters"), ("logits", "weights", "indices"),
                      {"metal": ("", ""), "cuda": (attention_text("")["cuda"][0],
                                                   render(_fused_logits_body() + _fused_route_body(), "cuda"))})
ROUTER_COUNTER_WORDS = 8
"""uint32 words of a layer's route_logits counters: one per token row (at most 8 rows)."""


def new_router_counters() -> mx.array:
    """The zeroed uint32 counters one sequence of route_logits calls shares (one per MoE layer):
    custom_kernels.ticket_counters."""
    return ticket_counters(ROUTER_COUNTER_WORDS)


# A MoE layer's post-attention norms and its route in one launch (kernel g4_residual_norm_route,
# CUDA only, op family "norm_route"), for one token: every threadgroup runs g4_residual_norm_moe's
# text over the token's row (the same threads and sums: the same bits), threadgroup 0 stores out, x
# and x2, and each keeps the router's input in shared memory instead of storing it; then each computes
# LPG logits from it with route_logits' text, takes route_logits' ticket, and the last routes.
# One launch instead of g4_residual_norm_moe then g4_route_logits, bit for bit their outputs; each
# threadgroup pays for one norm of a row it reads from L2.
# Template: T, D, TG, QUADS, SCALE (false), NEXT (true) as g4_residual_norm_moe; TS, H = D, E, K, EPL
# as g4_route_logits; LPG: logits per threadgroup (its first LPG SIMD groups), 1..TG / 32. Grid:
# ceil(E / LPG) threadgroups of TG threads.
def _norm_route_body() -> str:
    norm = moe_norm_parts()[1]
    for old, new in (("residual_norm_moe:", "residual_norm_route (norms):"),
                     ("  const size_t base = (size_t)$tg_x * D;\n",
                      "  const size_t base = 0;  // one token\n  const bool first = $tg_x == 0;  // stores out, x and x2\n"),
                     ("        out[base + c + i] = static_cast<T>(o);\n", "        if (first) out[base + c + i] = static_cast<T>(o);\n"),
                     ("          x[base + c + i] = static_cast<T>(wn[k] * n0);\n          x2[base + c + i] = static_cast<T>(w2v[k] * n0);\n"
                      "          xr[base + c + i] = ",
                      "          if (first) {\n            x[base + c + i] = static_cast<T>(wn[k] * n0);\n"
                      "            x2[base + c + i] = static_cast<T>(w2v[k] * n0);\n          }\n          g4_xr[c + i] = ")):  # fmt: skip
        assert norm.count(old) == 1, old
        norm = norm.replace(old, new)
    logits = _fused_logits_body()
    for old, new in (("route_logits: logits[m, e]", "residual_norm_route (logits): logits[m, e]"),
                     ("  const int e = $tg_x * NSG + $simd;\n", "  const int e = $tg_x * LPG + $simd;\n"),
                     ("  if (e < E) {\n", "  if ($simd < LPG && e < E) {\n"),
                     ("  const $device T* xr = x + (size_t)m * H;\n", "  const T* xr = g4_xr;  // the router's input\n"),
                     ("    g4_load4(xr + c, a);\n",  # g4_load4 reads through __ldg: global memory only
                      "    $unroll for (int q = 0; q < 4; ++q) a[q] = static_cast<float>(xr[c + q]);\n")):  # fmt: skip
        assert logits.count(old) == 1, old
        logits = logits.replace(old, new)
    route = _fused_route_body()
    assert route.count("scale[win_e[j]]") == 1
    route = route.replace("scale[win_e[j]]", "e_scale[win_e[j]]")
    return "  __shared__ __align__(16) T g4_xr[D];\n  {\n" + norm + "  }\n  $barrier;\n" + logits + route


_NORM_ROUTE = KernelSource(
    "g4_residual_norm_route",
    ("h", "a", "w_a", "w_next", "scale", "eps", "w_next2", "r_scale", "r_root", "w", "e_scale", "counters"),
    ("out", "x", "x2", "logits", "weights", "indices"),
    {"metal": ("", ""), "cuda": (attention_text("")["cuda"][0] + render(moe_norm_parts()[0], "cuda"),
                                 render(_norm_route_body(), "cuda"))})  # fmt: skip
NORM_ROUTE_MAX_D = 3072
NORM_ROUTE_MAX_EXPERTS = 256
NORM_ROUTE_MAX_TOP_K = 16
"""The largest call the launch takes: rows of at most 768 threads of one quad each, E and top_k small
enough that the route's per-thread arrays keep every instantiation within an SM's 64K registers at
768 threads (ptxas for sm_90, checked by tests/test_metal_compile.py; at E = 128 / k = 8 f32 takes 66
registers, bf16 48; k = 32 or E = 1024 would take 128-173). At 5376 f32 elements, 672 threads of two
quads, the launch failed on the H200 (session 33)."""
NORM_ROUTE_GEOMETRY_ENV = "GEMMA4_MLX_NORM_ROUTE_GEOMETRY"
"""Environment variable: "logits_per_group=N" (custom_kernels.geometry_override), a tuning knob."""


@dataclass(frozen=True)
class NormRouteConfig:
    logits_per_group: int = 0  # expert logits per threadgroup; 0: one per SIMD group (TG / 32)


def _logits_fusable(x: mx.array, w: mx.array) -> bool:
    """x [..., H] and w [E, H] the router-logits kernels take: one float dtype, H a multiple of 4."""
    return x.dtype == w.dtype and x.dtype in (mx.float32, mx.bfloat16) and x.shape[-1] % 4 == 0


def _logits_launch(e: int, rows: int) -> dict:
    """grid and threadgroup of the router-logits kernels: NSG experts per thread block, a row each."""
    return dict(grid=(32 * _LOGITS_NSG * -(-e // _LOGITS_NSG), rows, 1), threadgroup=(32 * _LOGITS_NSG, 1, 1))


def route_logits_supported(x: mx.array, w: mx.array, top_k: int) -> bool:
    """True when route_logits runs its one launch: a CUDA build, x and w of one float dtype, H a
    multiple of 4, 1..8 token rows, E <= MAX_EXPERTS and 1 <= top_k <= min(E, MAX_TOP_K)."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    e = w.shape[0]
    return (backend() == "cuda" and not use_reference() and w.ndim == 2 and x.shape[-1] == w.shape[1]
            and _logits_fusable(x, w) and 1 <= rows <= ROUTER_COUNTER_WORDS and e <= MAX_EXPERTS and 1 <= top_k <= min(e, MAX_TOP_K))  # fmt: skip


def route_logits(x: mx.array, w: mx.array, per_expert_scale: mx.array, top_k: int,
                 counters: mx.array) -> tuple[mx.array, mx.array]:
    """``route(router_logits(x, w), per_expert_scale, top_k)``: one launch of g4_route_logits where
    ``route_logits_supported``, the two ops otherwise -> (weights f32 [..., k], indices int32
    [..., k]). counters: ``new_router_counters()``, one per sequence of calls that run one after
    another (a MoE layer's)."""
    if not route_logits_supported(x, w, top_k):
        return route(router_logits(x, w), per_expert_scale, top_k)
    e, rows = w.shape[0], int(np.prod(x.shape[:-1], dtype=np.int64))
    _check_route_inputs(per_expert_scale, e, counters)
    out = (*x.shape[:-1], top_k)
    _, weights, indices = _FUSED.kernel()(
        inputs=[x, w, per_expert_scale, counters],
        template=template_args(_fused_template(dtype_name(x.dtype), dtype_name(per_expert_scale.dtype),
                                               x.shape[-1], e, top_k)),  # fmt: skip
        **_logits_launch(e, rows),
        output_shapes=[(*x.shape[:-1], e), out, out],
        output_dtypes=[x.dtype, mx.float32, mx.int32],
    )
    return weights, indices


def _check_route_inputs(per_expert_scale: mx.array, e: int, counters: mx.array) -> None:
    """ValueError unless per_expert_scale is [E] and counters new_router_counters()' kind."""
    check_ticket_counters(counters, ROUTER_COUNTER_WORDS, "new_router_counters")
    if per_expert_scale.shape != (e,):
        raise ValueError(f"per_expert_scale [E] expected for {e} experts, got {per_expert_scale.shape}")


def residual_norm_route_reference(h, a, w_a, w_next, w_next2, r_scale, r_root: float, eps: float, w, per_expert_scale,
                                  top_k: int):  # fmt: skip
    """MLX ops: norm.residual_norm_moe_reference's (out, x, x2) and route_reference of its router
    input's logits against w [E, H] -> (out, x, x2, weights f32 [..., k], indices int32 [..., k])."""
    out, x, x2, xr = residual_norm_moe_reference(h, a, w_a, w_next, w_next2, r_scale, r_root, eps)
    return (out, x, x2, *route_reference(router_logits_reference(xr, w), per_expert_scale, top_k))


def residual_norm_route(h, a, w_a, w_next, w_next2, r_scale, r_root: float, eps: float, w, per_expert_scale,
                        top_k: int, counters: mx.array) -> tuple[mx.array, ...] | None:  # fmt: skip
    """A MoE layer's norm.residual_norm_moe (without the router's input) and route_logits of that
    input in one launch of g4_residual_norm_route -> (out, x, x2 [..., H] like h, weights f32 [..., k],
    indices int32 [..., k]), bit for bit the two launches' outputs; or None where op family
    "norm_route" (or "norm_moe", "router_fused", "router") is off or the kernel does not take the
    call: one token, h, a, the norm weights and w [E, H] of one float dtype, H a multiple of 4 up to
    NORM_ROUTE_MAX_D, E up to NORM_ROUTE_MAX_EXPERTS, 1 <= top_k <= min(E, NORM_ROUTE_MAX_TOP_K). The
    caller then takes the two launches. counters: new_router_counters(), the layer's route_logits
    ones."""
    if not all(use_kernel(f) for f in ("norm_route", "norm_moe", "router_fused", "router")):
        return None
    check_rows(h, a, w_a, w_next, None)
    check_rows(h, a, w_next2, r_scale, None)
    d, e = h.shape[-1], w.shape[0]
    if (h.size != d or not route_logits_supported(h, w, top_k) or not fusable(h, a, w_a, w_next)
            or not fusable(h, a, w_next2, r_scale) or d > NORM_ROUTE_MAX_D or e > NORM_ROUTE_MAX_EXPERTS
            or top_k > NORM_ROUTE_MAX_TOP_K):  # fmt: skip
        return None
    _check_route_inputs(per_expert_scale, e, counters)
    tg, _ = row_geometry(d)
    lpg = _logits_per_group(tg)
    lead = h.shape[:-1]
    out, x, x2, _, weights, indices = _NORM_ROUTE.kernel()(
        inputs=[h, a, w_a, w_next, w_a, mx.array([eps], dtype=mx.float32), w_next2, r_scale,
                mx.array([r_root], dtype=h.dtype), w, per_expert_scale, counters],  # w_a: the unread layer scale
        template=template_args(_norm_route_template(dtype_name(h.dtype), dtype_name(per_expert_scale.dtype), d, e, top_k, lpg)),
        grid=(tg * -(-e // lpg), 1, 1), threadgroup=(tg, 1, 1),
        output_shapes=[h.shape] * 3 + [(*lead, e), (*lead, top_k), (*lead, top_k)],
        output_dtypes=[h.dtype] * 4 + [mx.float32, mx.int32],
    )  # fmt: skip
    return out, x, x2, weights, indices


def _logits_per_group(tg: int) -> int:
    lpg = geometry_override(NormRouteConfig(), NORM_ROUTE_GEOMETRY_ENV).logits_per_group or tg // 32
    if not 1 <= lpg <= tg // 32:
        raise ValueError(f"{NORM_ROUTE_GEOMETRY_ENV}: logits_per_group must be 1..{tg // 32} at {tg} threads, got {lpg}")
    return lpg


def _norm_route_template(dtype: str, scale_dtype: str, d: int, e: int, k: int, lpg: int,
                         max_threads: int | None = None) -> list:  # fmt: skip
    route = [(n, v) for n, v in _fused_template(dtype, scale_dtype, d, e, k) if n not in ("T", "NSG")]  # the norm's
    return row_template(dtype, d, False, True, max_threads) + route + [("LPG", lpg)]


def _fused_template(dtype: str, scale_dtype: str, h: int, e: int, k: int) -> list:
    return [("T", dtype), ("TS", scale_dtype), ("H", h), ("E", e), ("K", k), ("EPL", -(-e // 32)),
            ("NSG", _LOGITS_NSG)]  # fmt: skip


def _check(logits: mx.array, per_expert_scale: mx.array, top_k: int) -> tuple[int, int]:
    e = logits.shape[-1]
    if logits.ndim < 1 or per_expert_scale.shape != (e,):
        raise ValueError(f"logits [..., E] and per_expert_scale [E] expected, got {logits.shape} and "
                         f"{per_expert_scale.shape}")  # fmt: skip
    if not 1 <= top_k <= min(e, MAX_TOP_K):
        raise ValueError(f"top_k must be 1..{min(e, MAX_TOP_K)} for {e} experts, got {top_k}")
    if e > MAX_EXPERTS:
        raise ValueError(f"at most {MAX_EXPERTS} experts, got {e}")
    return e, int(np.prod(logits.shape[:-1], dtype=np.int64))


def route_reference(logits: mx.array, per_expert_scale: mx.array, top_k: int) -> tuple[mx.array, mx.array]:
    """MLX ops with the module's semantics (k rounds of argmax, whose first maximum is the lowest
    index) -> (weights f32 [..., k], indices int32 [..., k])."""
    _check(logits, per_expert_scale, top_k)
    p = mx.softmax(logits.astype(mx.float32), axis=-1)
    picked, idx = [], []
    live = p
    for _ in range(top_k):
        i = mx.argmax(live, axis=-1, keepdims=True)
        picked.append(mx.take_along_axis(p, i, axis=-1))
        idx.append(i)
        live = mx.where(mx.arange(p.shape[-1]) == i, -1.0, live)
    w, i = mx.concatenate(picked, axis=-1), mx.concatenate(idx, axis=-1).astype(mx.int32)
    return w / w.sum(axis=-1, keepdims=True) * per_expert_scale.astype(mx.float32)[i], i


def route(logits: mx.array, per_expert_scale: mx.array, top_k: int) -> tuple[mx.array, mx.array]:
    """The module's op: the kernel on GPU builds, ``route_reference`` otherwise."""
    e, rows = _check(logits, per_expert_scale, top_k)
    if use_reference():
        return route_reference(logits, per_expert_scale, top_k)
    # the kernel indexes logits and outputs flat by row, so they keep the caller's lead dims: no
    # reshape nodes in a decode step
    out_shape = (*logits.shape[:-1], top_k)
    weights, indices = _ROUTE.kernel()(
        inputs=[logits, per_expert_scale],
        template=template_args(_template(dtype_name(logits.dtype), dtype_name(per_expert_scale.dtype), e, top_k)),
        grid=(32 * rows, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[out_shape, out_shape],
        output_dtypes=[mx.float32, mx.int32],
    )
    return weights, indices


def router_logits_reference(x: mx.array, w: mx.array) -> mx.array:
    """x [..., H] @ w [E, H].T, what the router's nn.Linear computes."""
    return x @ w.T


def router_logits(x: mx.array, w: mx.array) -> mx.array:
    """The router projection x [..., H] @ w [E, H].T -> [..., E]: one launch of g4_router_logits on
    GPU builds (x and w of one float dtype, H a multiple of 4, at most 8 tokens), the reference
    otherwise. Output in x's dtype from f32 sums (MLX's matmul rounds the same way)."""
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x [..., H] and w [E, H] expected, got {x.shape} and {w.shape}")
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if use_reference() or not _logits_fusable(x, w) or not 1 <= rows <= _LOGITS_MAX_ROWS:
        return router_logits_reference(x, w)
    e = w.shape[0]
    (out,) = _LOGITS.kernel()(
        inputs=[x, w],
        template=template_args(_logits_template(dtype_name(x.dtype), x.shape[-1])),
        **_logits_launch(e, rows),
        output_shapes=[(*x.shape[:-1], e)],
        output_dtypes=[x.dtype],
    )
    return out


def _logits_template(dtype: str, h: int) -> list:
    return [("T", dtype), ("H", h), ("NSG", _LOGITS_NSG)]


def _template(logits_dtype: str, scale_dtype: str, e: int, k: int) -> list:
    return [("T", logits_dtype), ("TS", scale_dtype), ("E", e), ("K", k), ("EPL", -(-e // 32))]


# --------------------------------------------------------------------------------------------
# float64 oracle and emulator / compile-test registry (see custom_kernels.registry)
# --------------------------------------------------------------------------------------------


def route_f64(logits: np.ndarray, scale: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 oracle of the semantics on rows of logits [R, E] -> (weights [R, k], indices [R, k])."""
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    order = np.lexsort((np.broadcast_to(np.arange(x.shape[-1]), x.shape), -p), axis=-1)[:, :top_k]
    w = np.take_along_axis(p, order, axis=-1)
    return w / w.sum(axis=-1, keepdims=True) * scale.astype(np.float64)[order], order.astype(np.int32)


def _case(rng: np.random.Generator, rows: int, e: int, k: int, logits_dtype: str, ties: bool):
    from .registry import KernelCase, bf16_to_f32, f32_to_bf16

    x = (rng.standard_normal((rows, e)) * 3).astype(np.float32)
    if ties:  # equal logits across experts (also the k-th and (k+1)-th), so the index decides
        x[:, 1::3] = x[:, 0:1]
    scale = rng.uniform(0.5, 2.0, e).astype(np.float32)
    inputs = {"logits": x, "scale": scale}
    dtypes = {}
    if logits_dtype == "bfloat16":
        inputs["logits"] = f32_to_bf16(x)
        dtypes["logits"] = "bfloat16"
        x = bf16_to_f32(inputs["logits"])
    w, i = route_f64(x, scale, k)
    return KernelCase(
        inputs=inputs, template=_template(logits_dtype, "float32", e, k), grid=(32 * rows, 1, 1),
        threadgroup=(32, 1, 1), output_shapes=[(rows, k), (rows, k)], output_dtypes=["float32", "int32"],
        expected=[w, i.astype(np.float64)], rtol=1e-5, atol=1e-6, input_dtypes=dtypes,
        label=f"rows={rows} E={e} k={k} {logits_dtype}{' ties' if ties else ''}",
    )  # fmt: skip


def _cases(rng: np.random.Generator):
    return [_case(rng, 3, 128, 8, "float32", False), _case(rng, 2, 128, 8, "float32", True),
            _case(rng, 4, 45, 5, "bfloat16", False), _case(rng, 1, 8, 8, "float32", True),
            _case(rng, 2, 300, 32, "float32", False)]  # fmt: skip


def _logits_case(rng: np.random.Generator, rows: int, e: int, h: int, dtype: str):
    """x [rows, H] @ w [E, H].T against float64; E not a multiple of the SIMD groups, H not a
    multiple of 128 (a lane's last vector past H is skipped)."""
    from .registry import KernelCase, bf16_to_f32, f32_to_bf16

    x = rng.standard_normal((rows, h)).astype(np.float32)
    w = (rng.standard_normal((e, h)) * 0.05).astype(np.float32)
    inputs, dtypes = {"x": x, "w": w}, {}
    if dtype == "bfloat16":
        inputs = {"x": f32_to_bf16(x), "w": f32_to_bf16(w)}
        dtypes = {"x": "bfloat16", "w": "bfloat16"}
        x, w = bf16_to_f32(inputs["x"]), bf16_to_f32(inputs["w"])
    want = x.astype(np.float64) @ w.astype(np.float64).T
    bound = float((np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T).max())
    return KernelCase(
        inputs=inputs, template=_logits_template(dtype, h), **_logits_launch(e, rows), output_shapes=[(rows, e)], output_dtypes=[dtype], expected=[want],
        rtol=2.0**-8 if dtype == "bfloat16" else 0.0, atol=1e-6 * bound, input_dtypes=dtypes,
        label=f"rows={rows} E={e} H={h} {dtype}",
    )  # fmt: skip


def _logits_cases(rng: np.random.Generator):
    return [_logits_case(rng, 1, 13, 260, "float32"), _logits_case(rng, 3, 8, 128, "bfloat16"),
            _logits_case(rng, 2, 6, 516, "bfloat16")]  # fmt: skip


def _fused_case(rng: np.random.Generator, rows: int, e: int, h: int, k: int):
    """route_logits (f32) against float64: the logits and, from them, the weights and indices."""
    x = rng.standard_normal((rows, h)).astype(np.float32)
    w = (rng.standard_normal((e, h)) * 0.1).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, e).astype(np.float32)
    logits = x.astype(np.float64) @ w.astype(np.float64).T
    return _fused_kernel_case(x, w, scale, logits, "float32", k, 1e-5, 1e-5)


def _fused_kernel_case(x, w, scale, logits, dtype: str, k: int, rtol: float, atol: float):
    """The KernelCase of one route_logits launch over x [rows, H] and w [E, H] (f32 values or bf16
    bits), its expectations from the float64 logits."""
    from .registry import KernelCase

    (rows, h), e = x.shape, w.shape[0]
    wts, idx = route_f64(logits, scale, k)
    return KernelCase(
        inputs={"x": x, "w": w, "scale": scale, "counters": np.zeros(ROUTER_COUNTER_WORDS, np.uint32)},
        template=_fused_template(dtype, "float32", h, e, k), **_logits_launch(e, rows), output_shapes=[(rows, e), (rows, k), (rows, k)],
        output_dtypes=[dtype, "float32", "int32"], expected=[logits, wts, idx.astype(np.float64)], rtol=rtol,
        atol=atol, input_dtypes={"x": dtype, "w": dtype} if dtype == "bfloat16" else {},
        label=f"rows={rows} E={e} H={h} k={k} {dtype}",
    )  # fmt: skip


def _fused_case_bf16(rng: np.random.Generator, rows: int, e: int, h: int, k: int):
    """route_logits in bf16: each expert's row is x's direction times a distinct target logit
    (spaced ~10 bf16 steps apart), so the bf16 rounding cannot reorder the experts; checked within
    2% (the weights move with the logits' rounding; the indices, below 50, must be exact)."""
    from .registry import bf16_to_f32, f32_to_bf16

    x = rng.standard_normal((rows, h)).astype(np.float32)
    target = rng.permutation(np.linspace(-2.0, 2.0, e))
    w = target[:, None] * x[0][None, :] / float(x[0] @ x[0])
    x[1:] = x[0]  # every row has the same direction (and so the same ranking)
    xb, wb = f32_to_bf16(x), f32_to_bf16(w.astype(np.float32))
    logits = bf16_to_f32(xb).astype(np.float64) @ bf16_to_f32(wb).astype(np.float64).T
    scale = rng.uniform(0.5, 2.0, e).astype(np.float32)
    return _fused_kernel_case(xb, wb, scale, logits, "bfloat16", k, 2e-2, 1e-2)


def _fused_cases(rng: np.random.Generator):
    return [_fused_case(rng, 1, 128, 260, 8), _fused_case(rng, 3, 45, 128, 5), _fused_case(rng, 2, 300, 516, 32),
            _fused_case_bf16(rng, 2, 45, 128, 5)]  # fmt: skip


def _norm_route_case(rng: np.random.Generator, d: int, e: int, k: int, dtype: str, max_threads: int, lpg: int = 0,
                     scale_dtype: str = "float32"):  # fmt: skip
    """One token through g4_residual_norm_route against the float64 oracles: the norms as
    norm.residual_norm_moe_np rounds them (norm.row_case_values' inputs), the logits of its router
    input, the route of those. bf16: out, x and x2 within one bf16 step, the experts' rows of w set
    so their logits are distinct targets ~10 bf16 steps apart (the rounding cannot reorder them),
    weights within 2%, ids exact; f32: random rows, the ids exact, the rest to f32 sums."""
    from .registry import KernelCase, bf16_to_f32, f32_to_bf16

    bf16 = dtype == "bfloat16"
    vals, inputs = row_case_values(rng, 1, d, bf16, ("w_a", "w_next", "w_next2", "r_scale"), {"r_root": [d ** -0.5]})
    eps = float(inputs["eps"][0])
    out, x, x2, xr = residual_norm_moe_np(*(vals[n] for n in ("h", "a", "w_a", "w_next", "w_next2", "r_scale")),
                                          float(vals["r_root"][0]), eps, bf16)  # fmt: skip
    if bf16:
        target = rng.permutation(np.linspace(-2.0, 2.0, e))
        w = bf16_to_f32(f32_to_bf16((target[:, None] * xr[0][None, :] / float(xr[0].astype(np.float64) @ xr[0])).astype(np.float32)))
    else:
        w = (rng.standard_normal((e, d)) * 0.1).astype(np.float32)
    logits = xr.astype(np.float64) @ w.astype(np.float64).T
    scale = rng.uniform(0.5, 2.0, e).astype(np.float32)
    if scale_dtype == "bfloat16":
        scale = bf16_to_f32(f32_to_bf16(scale))
    wts, ids = route_f64(logits, scale, k)
    inputs.update(scale=inputs["w_a"], w=f32_to_bf16(w) if bf16 else w, e_scale=f32_to_bf16(scale) if scale_dtype == "bfloat16" else scale,
                  counters=np.zeros(ROUTER_COUNTER_WORDS, np.uint32))  # fmt: skip
    act = ("h", "a", "w_a", "w_next", "scale", "w_next2", "r_scale", "r_root", "w")
    tg, quads = row_geometry(d, max_threads)
    lpg = lpg or tg // 32
    norms = (2.0**-7, 1e-6) if bf16 else (2e-5, 1e-5)  # bf16: a last-bit difference of the f32 sums may move one ulp
    return KernelCase(
        inputs={n: inputs[n] for n in _NORM_ROUTE.input_names}, template=_norm_route_template(dtype, scale_dtype, d, e, k, lpg, max_threads),
        grid=(tg * -(-e // lpg), 1, 1), threadgroup=(tg, 1, 1),
        output_shapes=[(1, d)] * 3 + [(1, e), (1, k), (1, k)], output_dtypes=[dtype] * 4 + ["float32", "int32"],
        expected=[out, x, x2, logits, wts, ids.astype(np.float64)], rtol=0.0, atol=0.0,
        output_tolerances=[norms] * 3 + ([(2.0**-8, 1e-6), (2e-2, 1e-2)] if bf16 else [(1e-5, 1e-5)] * 2) + [(0.0, 0.0)],
        input_dtypes={**({n: dtype for n in act} if bf16 else {}), **({"e_scale": "bfloat16"} if scale_dtype == "bfloat16" else {})},
        label=f"D={d} E={e} k={k} TG={tg} QUADS={quads} LPG={lpg} {dtype} scale {scale_dtype}",
    )  # fmt: skip


def _norm_route_cases(rng: np.random.Generator):
    """26B-A4B's shape (one threadgroup of 704 threads per 22 experts; and per 4, the rest of its
    SIMD groups idle after the norms, with bf16 per-expert scales), a row two quads per thread with a last threadgroup of fewer
    experts, one SIMD group per threadgroup (E threadgroups)."""
    return [_norm_route_case(rng, 2816, 128, 8, "bfloat16", 1024), _norm_route_case(rng, 360, 45, 5, "float32", 64),
            _norm_route_case(rng, 96, 10, 10, "bfloat16", 1024), _norm_route_case(rng, 2816, 128, 8, "float32", 1024),
            _norm_route_case(rng, 2816, 128, 8, "bfloat16", 1024, 4, "bfloat16")]  # fmt: skip


def kernel_specs():
    """KernelSpecs of the routing kernel (odd E, ties, k = E, k = 32), the router projection, the
    two in one launch and the residual norms with them (the last two CUDA only)."""
    from .registry import KernelSpec

    return [KernelSpec(k.name, k.input_names, k.output_names, *k.text["metal"], *k.text["cuda"], cases)
            for k, cases in ((_ROUTE, _cases), (_LOGITS, _logits_cases), (_FUSED, _fused_cases),
                             (_NORM_ROUTE, _norm_route_cases))]  # fmt: skip

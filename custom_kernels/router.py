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
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import KernelSource, dtype_name, template_args, use_reference
from .attention import _text as attention_text

__all__ = ["MAX_EXPERTS", "MAX_TOP_K", "kernel_specs", "route", "route_f64", "route_reference"]

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


def kernel_specs():
    """KernelSpec of the routing kernel (odd E, ties, k = E, k = 32)."""
    from .registry import KernelSpec

    return [KernelSpec(_ROUTE.name, _ROUTE.input_names, _ROUTE.output_names, *_ROUTE.text["metal"],
                       *_ROUTE.text["cuda"], _cases)]  # fmt: skip

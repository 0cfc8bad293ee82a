"""A one-token Q4_0 / Q8_0 projection and the residual norm after it, in one launch (CUDA only).

    out, x = matvec_residual_norm(y, blocks, ggml_type, n, h, w_a, w_next, eps, scale, counters)

is ``residual_norm(h, quant_matvec(y, blocks, ggml_type, n), w_a, w_next, eps, scale)``
(custom_kernels.norm): a dense layer's o_proj and its post-attention norm, its FFN down and the
post-FFN norm, E-series' per-layer projection and its norm. Op family "matvec_norm".

Kernel ``g4_{q4_0,q8_0}_matvec_norm``: the split-K dense kernel of custom_kernels.quant_matvec
writes the projection's row a (rounded to the activations' dtype) as it does; each threadgroup
fences it and takes a ticket; the grid's last threadgroup reads a back from L2 and runs the
residual-norm kernel's body over it with its 32 x NSG threads, then zeroes the counter for the
next call. One launch and one graph node fewer per use. The norm's sums of squares run over that
block's threads instead of the norm kernel's geometry, so out and x equal the two launches' up to
the f32 order of two sums (not bit for bit). Metal keeps the two launches (no device-scope fence
its atomics order against).
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np

from . import KernelSource, backend, check_ticket_counters, dtype_name, template_args, ticket_counters, use_kernel, use_reference
from . import norm as _norm
from . import quant_matvec as qm
from .dialect import emit

__all__ = ["matvec_residual_norm", "matvec_norm_supported", "new_matvec_norm_counters", "kernel_specs",
           "COUNTER_WORDS", "MAX_QUADS"]  # fmt: skip

COUNTER_WORDS = 4
"""uint32 words of a call site's counters (the kernel uses the first)."""
MAX_QUADS = 8
"""4-element quads per thread of the norm part at most (registers): N <= 32 x NSG x 4 x MAX_QUADS."""

# __ldcg: the row other threadgroups wrote during this launch, read from L2 (g4_load4 reads
# through the non-coherent read-only path).
_LDCG = r"""
__device__ __forceinline__ void g4_ldcg4(const float* p, float* o) {
  float4 a = __ldcg(reinterpret_cast<const float4*>(p)); o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
}
__device__ __forceinline__ void g4_ldcg4(const __nv_bfloat16* p, float* o) {
  uint2 a = __ldcg(reinterpret_cast<const uint2*>(p));
  o[0] = __uint_as_float(a.x << 16); o[1] = __uint_as_float(a.x & 0xffff0000u);
  o[2] = __uint_as_float(a.y << 16); o[3] = __uint_as_float(a.y & 0xffff0000u);
}
"""

_TICKET = r"""
  // ticket: the grid's last thread block applies the residual norm to the finished row
  __shared__ int g4_last;
  __threadfence();
  $barrier;
  unsigned int* done = const_cast<unsigned int*>(counters);
  if ($tid == 0) g4_last = atomicAdd(done, 1u) == gridDim.x - 1u ? 1 : 0;
  $barrier;
  if (g4_last == 0) return;
  __threadfence();
  if ($tid == 0) *done = 0u;
  constexpr int TG = 32 * NSG;
"""


def _norm_body() -> str:
    """custom_kernels.norm's residual-norm body over the one row this kernel wrote: a read back
    from ``out`` through L2, its results in ``hout`` and ``xn``, in a scope of its own."""
    body = _norm._BODY
    for old, new in (("  const size_t base = (size_t)$tg_x * D;\n", "  const size_t base = 0;\n"),
                     ("g4_load4(a + base + c, av + 4 * j);", "g4_ldcg4(out + base + c, av + 4 * j);"),
                     ("out[base + c + i] = static_cast<T>(o);", "hout[base + c + i] = static_cast<T>(o);"),
                     ("x[base + c + i] = static_cast<T>(wn", "xn[base + c + i] = static_cast<T>(wn")):  # fmt: skip
        assert body.count(old) == 1, old
        body = body.replace(old, new)
    return "  {\n" + body + "  }\n"


def _source(ggml_type: int) -> KernelSource:
    name = {qm.Q4_0: "g4_q4_0_matvec_norm", qm.Q8_0: "g4_q8_0_matvec_norm"}[ggml_type]
    body = qm._body(ggml_type, "dense", k_split=True) + _TICKET + _norm_body()
    cuda = emit(body, _norm._HELPERS + _LDCG, _norm._LOCAL)["cuda"]
    return KernelSource(name, ("x", "wq", "h", "w_a", "w_next", "scale", "eps", "counters"), ("out", "hout", "xn"),
                        {"metal": ("", ""), "cuda": cuda})  # fmt: skip


_SOURCES = {t: _source(t) for t in (qm.Q4_0, qm.Q8_0)}


def new_matvec_norm_counters() -> mx.array:
    """The zeroed uint32 counters of one call site (one per use in a layer):
    custom_kernels.ticket_counters."""
    return ticket_counters(COUNTER_WORDS)


def _plan(ggml_type: int, dtype: str, n: int, k: int, scale: bool, nxt: bool, config: qm.KernelConfig | None = None):
    """(launch plan of the split-K dense kernel at one token, the fused kernel's template)."""
    cfg = dataclasses.replace(config or qm.default_config(ggml_type, "dense", 1, n, k), in_place=0)
    plan = qm.plan_launch(ggml_type, "dense", dtype, 1, n, k, config=cfg)
    tg = plan.threadgroup[0]
    quads = -(-n // (4 * tg))
    return plan, plan.template + [("D", n), ("QUADS", quads), ("SCALE", scale), ("NEXT", nxt)]


def matvec_norm_supported(y: mx.array, ggml_type: int, n: int, h: mx.array, w_a, w_next, scale) -> bool:
    """True when matvec_residual_norm runs its one launch: a CUDA build with family "matvec_norm"
    on, one token of Q4_0 / Q8_0 rows that quant_matvec would give the split-K f32-FMA kernel, one
    dtype (f32 or bf16) for y, h and the norm's weights, N a multiple of 4 and at most MAX_QUADS
    quads per thread."""
    if backend() != "cuda" or use_reference() or not use_kernel("matvec_norm") or ggml_type not in _SOURCES:
        return False
    if math.prod(y.shape[:-1]) != 1 or tuple(h.shape) != (*y.shape[:-1], n) or y.dtype != h.dtype:
        return False
    if not _norm.fusable(h, h, w_a, w_next, scale) or qm._dense_route(y, ggml_type, n) != "fma":
        return False
    plan, template = _plan(ggml_type, dtype_name(y.dtype), n, y.shape[-1], scale is not None, w_next is not None)
    return plan.k_split and dict(template)["QUADS"] <= MAX_QUADS


def matvec_residual_norm(y: mx.array, blocks: mx.array, ggml_type: int, n: int, h: mx.array, w_a: mx.array,
                         w_next: mx.array | None, eps: float, scale: mx.array | None,
                         counters: mx.array) -> tuple[mx.array, mx.array | None]:  # fmt: skip
    """(out, x) of ``residual_norm(h, quant_matvec(y, blocks, ggml_type, n), w_a, w_next, eps,
    scale)``: y [..., K] one token, h [..., N]; one launch where ``matvec_norm_supported``, the two
    ops otherwise. counters: ``new_matvec_norm_counters()``, the call site's."""
    if not matvec_norm_supported(y, ggml_type, n, h, w_a, w_next, scale):
        return _norm.residual_norm(h, qm.quant_matvec(y, blocks, ggml_type, n), w_a, w_next, eps, scale)
    check_ticket_counters(counters, COUNTER_WORDS, "new_matvec_norm_counters")
    nxt = w_next is not None
    plan, template = _plan(ggml_type, dtype_name(y.dtype), n, y.shape[-1], scale is not None, nxt)
    _, out, x = _SOURCES[ggml_type].kernel()(
        inputs=[y, blocks, h, w_a, w_next if nxt else w_a, scale if scale is not None else w_a,
                mx.array([eps], dtype=mx.float32), counters],
        template=template_args(template),
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=[plan.output_shape, h.shape, h.shape if nxt else (1,)],
        output_dtypes=[y.dtype] * 3,
    )  # fmt: skip
    return out, (x if nxt else None)


# --------------------------------------------------------------------------------------------
# Compile-test registry (see custom_kernels.registry)
# --------------------------------------------------------------------------------------------


def _case(rng, ggml_type, dtype, n, k, config, scale: bool, nxt: bool):
    from .registry import KernelCase, bf16_to_f32, f32_to_bf16

    bf16 = dtype == "bfloat16"

    def values(shape, s, offset=0.0):
        v = (rng.standard_normal(shape) * s + offset).astype(np.float32)
        return (f32_to_bf16(v), bf16_to_f32(f32_to_bf16(v))) if bf16 else (v, v)

    x, x32 = values((1, k), 1.0)
    wq = qm.random_blocks(rng, ggml_type, (n,), k)
    a64 = x32.astype(np.float64) @ qm.dequantize_f64(wq, ggml_type).T
    a32 = a64.astype(np.float32)
    a_t = bf16_to_f32(f32_to_bf16(a32)) if bf16 else a32  # the row as the kernel stores it
    h, h32 = values((1, n), 2.0)
    w_a, wa32 = values((n,), 0.3, 1.0)
    w_n, wn32 = values((n,), 0.3, 1.0)
    sc, sc32 = values((1,), 0.1, 0.9)
    out, xn = _norm.residual_norm_np(h32, a_t, wa32, wn32 if nxt else None, 1e-6, sc32[0] if scale else None, bf16)
    plan, template = _plan(ggml_type, dtype, n, k, scale, nxt, config)
    dt = {name: "bfloat16" for name in ("x", "h", "w_a", "w_next", "scale")} if bf16 else {}
    return KernelCase(
        inputs={"x": x, "wq": wq, "h": h, "w_a": w_a, "w_next": w_n, "scale": sc,
                "eps": np.array([1e-6], np.float32), "counters": np.zeros(COUNTER_WORDS, np.uint32)},
        template=template, grid=plan.grid, threadgroup=plan.threadgroup,
        output_shapes=[plan.output_shape, (1, n), (1, n) if nxt else (1,)], output_dtypes=[dtype] * 3,
        expected=[a64, out, xn if nxt else np.full(1, np.nan)], rtol=2**-7 if bf16 else 1e-4,
        atol=2e-2 * max(1.0, float(np.abs(a64).max())) if bf16 else 1e-3, input_dtypes=dt,
        label=f"{dtype} N={n} K={k} {config} scale={scale} next={nxt}",
    )  # fmt: skip


def _cases(ggml_type: int):
    def make(rng: np.random.Generator):
        c = qm.KernelConfig
        return [
            _case(rng, ggml_type, "bfloat16", 2560, 1056, c(2, 4, 2, 0, 4), True, True),  # E4B's N: 5 quads
            _case(rng, ggml_type, "float32", 1000, 800, c(2, 4, 2, 0, 4), False, True),  # a last row set past N
            _case(rng, ggml_type, "bfloat16", 260, 320, c(2, 2, 2, 0, 2), True, False),  # no next norm
        ]

    return make


def kernel_specs():
    """KernelSpecs of the two fused kernels (CUDA only: no Metal text)."""
    from .registry import KernelSpec

    return [KernelSpec(s.name, s.input_names, s.output_names, "", "", *s.text["cuda"], _cases(t))
            for t, s in _SOURCES.items()]

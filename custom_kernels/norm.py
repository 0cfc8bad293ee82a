"""The residual add between two RMS norms, in one launch: a branch's post-norm added to the
residual stream, optionally times the layer scalar, and the next pre-norm of the result (MLX ops
take three or four launches: rms_norm, the add (and scale), rms_norm).

    out, x = residual_norm(h, a, w_a, w_next, eps, scale=None)
    # h, a [..., D]; w_a, w_next [D] (w_next None: no x); scale [1] or None; all one dtype

Semantics (kernel, ``residual_norm_reference`` and the tests' oracle), rounding as MLX's ops do:
out = T(h + T(w_a * T(a * r(a)))), then out = T(out * scale) if a scale is given, and
x = T(w_next * T(out * r(out))), with r(v) = 1 / sqrt(mean(v^2) + eps) in f32 and T() the rounding
to the activations' dtype. Only the order of the f32 sums of squares and 1 / sqrt (MLX: rsqrt)
differ from MLX's rms_norm.

Kernel (one body for Metal and CUDA, custom_kernels.dialect): one threadgroup of TG threads per
row (D a multiple of 4; other rows take the reference); thread t holds the 4-element quads
t + j TG (j < QUADS) of a, h and both weights in registers, all loaded before the first sum, so a
row costs one memory latency; a SIMD sum and a threadgroup sum give each sum of squares.

A MoE layer's end (kernel g4_residual_norm_moe_out, op family "norm_moe_out"): its two branch
outputs normed and summed, m = T(T(w_mlp * T(mlp * r(mlp))) + T(w_moe * T(moe * r(moe)))), then the
residual step above with m as the branch: MLX takes five launches for it (rms_norm, two residual
norms), the kernel one.

    out, x = residual_norm_moe_out(h, mlp, moe, w_mlp, w_moe, w_post, w_next, eps, scale=None)

Op family "norm" (on by default on CUDA, opt-in on Metal): at one row of 5376 it takes 5.1 us on
the H200 where rms_norm + add + rms_norm took 9.4 us, and the 31B decode step 240 launches fewer
(bench/NOTES.md, session 9). Its first form (4-byte loads, h and the weights loaded after each sum)
took 13-15 us (session 7).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import KernelSource, backend, dtype_name, template_args, use_reference
from .dialect import emit, local_tokens
from .sampling import BLOCK_SUM

__all__ = ["kernel_specs", "residual_norm", "residual_norm_reference", "residual_norm_np", "residual_norm_moe",
           "residual_norm_moe_reference", "residual_norm_moe_np", "residual_norm_moe_out",
           "residual_norm_moe_out_reference", "residual_norm_moe_out_np"]

# Template: T (dtype), D (row length, a multiple of 4), TG (threads), QUADS = ceil(D / (4 TG)),
# SCALE, NEXT.
_BODY = r"""
  // gemma4-mlx residual_norm: out = (h + w_a * rmsnorm(a)) [* scale]; x = w_next * rmsnorm(out)
  constexpr int NSG = TG / 32;
  constexpr int V = 4 * QUADS;
  $shared float red[64];
  const int tid = $tid;
  const size_t base = (size_t)$tg_x * D;
  const float e = eps[0];
  const float s = SCALE ? static_cast<float>(scale[0]) : 1.0f;
  // every load is issued before the first sum: a row costs one memory latency, not three
  float av[V];
  float hv[V];
  float wa[V];
  float wn[V];
  $unroll for (int j = 0; j < QUADS; ++j) {
    const int c = 4 * (tid + j * TG);
    $unroll for (int i = 0; i < 4; ++i) {
      av[4 * j + i] = 0.0f;
      hv[4 * j + i] = 0.0f;
      wa[4 * j + i] = 0.0f;
      wn[4 * j + i] = 0.0f;
    }
    if (c < D) {
      g4_load4(a + base + c, av + 4 * j);
      g4_load4(h + base + c, hv + 4 * j);
      g4_load4(w_a + c, wa + 4 * j);
      if (NEXT) g4_load4(w_next + c, wn + 4 * j);
    }
  }
  float ss = 0.0f;
  $unroll for (int i = 0; i < V; ++i) ss += av[i] * av[i];
  const float ra = 1.0f / @SQRT@(g4s_block_sum(ss, red, 0, tid, NSG) / (float)D + e);
  float ss2 = 0.0f;
  $unroll for (int j = 0; j < QUADS; ++j) {
    const int c = 4 * (tid + j * TG);
    if (c < D) {
      $unroll for (int i = 0; i < 4; ++i) {
        const int k = 4 * j + i;
        const float n = g4n_round<T>(wa[k] * g4n_round<T>(av[k] * ra));
        float o = g4n_round<T>(hv[k] + n);
        if (SCALE) o = g4n_round<T>(o * s);
        out[base + c + i] = static_cast<T>(o);
        hv[k] = o;
        ss2 += o * o;
      }
    }
  }
  if (NEXT) {
    const float rn = 1.0f / @SQRT@(g4s_block_sum(ss2, red, 1, tid, NSG) / (float)D + e);
    $unroll for (int j = 0; j < QUADS; ++j) {
      const int c = 4 * (tid + j * TG);
      if (c < D) {
        $unroll for (int i = 0; i < 4; ++i) {
          x[base + c + i] = static_cast<T>(wn[4 * j + i] * g4n_round<T>(hv[4 * j + i] * rn));
        }
      }
    }
  }
"""

# g4s_block_sum (sampling's): `phase` picks one half of red, so two sums need one barrier each.
_HELPERS = r"""
// gemma4-mlx norm helpers
""" + BLOCK_SUM + r"""// v rounded to the activation dtype U and back, as MLX's ops round every result
template <typename U> @FN@ float g4n_round(float v) { return static_cast<float>(static_cast<U>(v)); }
"""

_LOCAL = {
    "metal": {"@FN@": "static inline", "@SQRT@": "sqrt", "@TG@": "threadgroup"},  # @TG@: a shared-memory pointer
    "cuda": {"@FN@": "__device__ __forceinline__", "@SQRT@": "sqrtf", "@TG@": ""},
}


_RESIDUAL_NORM = KernelSource("g4_residual_norm", ("h", "a", "w_a", "w_next", "scale", "eps"), ("out", "x"),
                              emit(_BODY, _HELPERS, _LOCAL))  # fmt: skip

# The MoE layers' post-attention form (kernel g4_residual_norm_moe, always NEXT): besides out and
# x = w_next * n0 with n0 = T(out * r(out)), it writes the layer's other two norms of out, which
# share n0: x2 = T(w_next2 * n0) (pre_feedforward_layernorm_2) and the router's input
# xr = T(T(n0 * r_scale) * r_root) (weightless norm, times its scale vector and H^-1/2).
_MOE_LOADS = ("      if (NEXT) g4_load4(w_next + c, wn + 4 * j);\n", """      if (NEXT) g4_load4(w_next + c, wn + 4 * j);
      g4_load4(w_next2 + c, w2v + 4 * j);
      g4_load4(r_scale + c, rsv + 4 * j);
""")
_MOE_REGS = ("  float wn[V];\n", """  float wn[V];
  float w2v[V];
  float rsv[V];
  const float root = static_cast<float>(r_root[0]);
""")
_MOE_ZERO = ("      wn[4 * j + i] = 0.0f;\n", """      wn[4 * j + i] = 0.0f;
      w2v[4 * j + i] = 0.0f;
      rsv[4 * j + i] = 0.0f;
""")
_MOE_STORE = ("          x[base + c + i] = static_cast<T>(wn[4 * j + i] * g4n_round<T>(hv[4 * j + i] * rn));\n", """          const int k = 4 * j + i;
          const float n0 = g4n_round<T>(hv[k] * rn);
          x[base + c + i] = static_cast<T>(wn[k] * n0);
          x2[base + c + i] = static_cast<T>(w2v[k] * n0);
          xr[base + c + i] = static_cast<T>(g4n_round<T>(n0 * rsv[k]) * root);
""")


def _moe_body() -> str:
    body = _BODY.replace("residual_norm:", "residual_norm_moe:", 1)
    for old, new in (_MOE_REGS, _MOE_ZERO, _MOE_LOADS, _MOE_STORE):
        assert body.count(old) == 1, old
        body = body.replace(old, new)
    return body


def moe_norm_parts() -> tuple[str, str]:
    """(the norm helpers without the prelude, g4_residual_norm_moe's body) with CUDA's module tokens
    in and the $placeholders left: custom_kernels.router builds g4_residual_norm_route on them."""
    return local_tokens(_HELPERS, _LOCAL, "cuda"), local_tokens(_moe_body(), _LOCAL, "cuda")


_RESIDUAL_NORM_MOE = KernelSource(
    "g4_residual_norm_moe", ("h", "a", "w_a", "w_next", "scale", "eps", "w_next2", "r_scale", "r_root"),
    ("out", "x", "x2", "xr"), emit(_moe_body(), _HELPERS, _LOCAL))

# A MoE layer's end (kernel g4_residual_norm_moe_out): the dense MLP's and the experts' outputs
# normed (post_feedforward_layernorm_1 / _2) and summed into m, then out = T(h + T(w_post * T(m *
# r(m)))) [* scale] and x = w_next * rmsnorm(out) as in _BODY; four sums, one barrier each (the
# phases of `red` alternate, so a sum never overwrites one still being read).
_MOE_OUT_BODY = r"""
  // gemma4-mlx residual_norm_moe_out: m = w_mlp * rmsnorm(mlp) + w_moe * rmsnorm(moe);
  // out = (h + w_post * rmsnorm(m)) [* scale]; x = w_next * rmsnorm(out)
  constexpr int NSG = TG / 32;
  constexpr int V = 4 * QUADS;
  $shared float red[64];
  const int tid = $tid;
  const size_t base = (size_t)$tg_x * D;
  const float e = eps[0];
  const float s = SCALE ? static_cast<float>(scale[0]) : 1.0f;
  float mv[V];
  float ev[V];
  float hv[V];
  float w1[V];
  float w2[V];
  float wp[V];
  float wn[V];
  $unroll for (int j = 0; j < QUADS; ++j) {
    const int c = 4 * (tid + j * TG);
    $unroll for (int i = 0; i < 4; ++i) {
      const int k = 4 * j + i;
      mv[k] = 0.0f;
      ev[k] = 0.0f;
      hv[k] = 0.0f;
      w1[k] = 0.0f;
      w2[k] = 0.0f;
      wp[k] = 0.0f;
      wn[k] = 0.0f;
    }
    if (c < D) {
      g4_load4(mlp + base + c, mv + 4 * j);
      g4_load4(moe + base + c, ev + 4 * j);
      g4_load4(h + base + c, hv + 4 * j);
      g4_load4(w_mlp + c, w1 + 4 * j);
      g4_load4(w_moe + c, w2 + 4 * j);
      g4_load4(w_post + c, wp + 4 * j);
      if (NEXT) g4_load4(w_next + c, wn + 4 * j);
    }
  }
  float s1 = 0.0f;
  float s2 = 0.0f;
  $unroll for (int i = 0; i < V; ++i) {
    s1 += mv[i] * mv[i];
    s2 += ev[i] * ev[i];
  }
  const float r1 = 1.0f / @SQRT@(g4s_block_sum(s1, red, 0, tid, NSG) / (float)D + e);
  const float r2 = 1.0f / @SQRT@(g4s_block_sum(s2, red, 1, tid, NSG) / (float)D + e);
  float s3 = 0.0f;
  $unroll for (int i = 0; i < V; ++i) {
    const float n1 = g4n_round<T>(w1[i] * g4n_round<T>(mv[i] * r1));
    const float n2 = g4n_round<T>(w2[i] * g4n_round<T>(ev[i] * r2));
    mv[i] = g4n_round<T>(n1 + n2);
    s3 += mv[i] * mv[i];
  }
  const float r3 = 1.0f / @SQRT@(g4s_block_sum(s3, red, 0, tid, NSG) / (float)D + e);
  float s4 = 0.0f;
  $unroll for (int j = 0; j < QUADS; ++j) {
    const int c = 4 * (tid + j * TG);
    if (c < D) {
      $unroll for (int i = 0; i < 4; ++i) {
        const int k = 4 * j + i;
        float o = g4n_round<T>(hv[k] + g4n_round<T>(wp[k] * g4n_round<T>(mv[k] * r3)));
        if (SCALE) o = g4n_round<T>(o * s);
        out[base + c + i] = static_cast<T>(o);
        hv[k] = o;
        s4 += o * o;
      }
    }
  }
  if (NEXT) {
    const float rn = 1.0f / @SQRT@(g4s_block_sum(s4, red, 1, tid, NSG) / (float)D + e);
    $unroll for (int j = 0; j < QUADS; ++j) {
      const int c = 4 * (tid + j * TG);
      if (c < D) {
        $unroll for (int i = 0; i < 4; ++i) {
          x[base + c + i] = static_cast<T>(wn[4 * j + i] * g4n_round<T>(hv[4 * j + i] * rn));
        }
      }
    }
  }
"""

_RESIDUAL_NORM_MOE_OUT = KernelSource(
    "g4_residual_norm_moe_out", ("h", "mlp", "moe", "w_mlp", "w_moe", "eps", "w_post", "w_next", "scale"),
    ("out", "x"), emit(_MOE_OUT_BODY, _HELPERS, _LOCAL))

MAX_THREADS = {"cuda": 1024, "metal": 512}  # threads per row at most (Metal: a safe pipeline size)


def row_geometry(d: int, max_threads: int | None = None) -> tuple[int, int]:
    """(threads per row, 4-element quads per thread) for rows of d elements: as many threads as
    quads up to max_threads (the backend's by default), in whole SIMD groups."""
    if max_threads is None:
        max_threads = MAX_THREADS["metal" if backend() == "metal" else "cuda"]
    quads = -(-d // 4)
    per = -(-quads // max_threads)
    return -(-quads // (32 * per)) * 32, per


def row_template(dtype: str, d: int, scale: bool, nxt: bool, max_threads: int | None = None) -> list:
    tg, quads = row_geometry(d, max_threads)
    return [("T", dtype), ("D", d), ("TG", tg), ("QUADS", quads), ("SCALE", scale), ("NEXT", nxt)]


def check_rows(h, a, w_a, w_next, scale) -> None:
    d = h.shape[-1]
    if a.shape != h.shape or w_a.shape != (d,) or (w_next is not None and w_next.shape != (d,)):
        raise ValueError(f"h and a [..., D], weights [D] expected, got {h.shape}, {a.shape}, {w_a.shape}, "
                         f"{None if w_next is None else w_next.shape}")  # fmt: skip
    if scale is not None and scale.size != 1:
        raise ValueError(f"scale must hold one value, got shape {scale.shape}")


def residual_norm_reference(h, a, w_a, w_next, eps: float, scale=None):
    """MLX ops: (out, x) as the module doc says; x is None when w_next is None."""
    check_rows(h, a, w_a, w_next, scale)
    out = h + mx.fast.rms_norm(a, w_a, eps)
    if scale is not None:
        out = out * scale
    return out, (None if w_next is None else mx.fast.rms_norm(out, w_next, eps))


def fusable(h, a, w_a, w_next, scale=None) -> bool:
    """True when the kernel computes exactly what the reference does: one dtype everywhere (a
    scale of another dtype would promote `out`), rows a multiple of 4 elements (its loads)."""
    arrays = [a, w_a] + [t for t in (w_next, scale) if t is not None]
    return h.dtype in (mx.float32, mx.bfloat16) and all(t.dtype == h.dtype for t in arrays) and h.shape[-1] % 4 == 0


def residual_norm(h, a, w_a, w_next, eps: float, scale=None):
    """The module's op: the kernel on GPU builds when `fusable`, ``residual_norm_reference``
    otherwise -> (out [..., D], x [..., D] or None)."""
    check_rows(h, a, w_a, w_next, scale)
    if use_reference() or not fusable(h, a, w_a, w_next, scale):
        return residual_norm_reference(h, a, w_a, w_next, eps, scale)
    nxt = w_next is not None
    # unread inputs are stand-ins, not new nodes (every graph node costs host time in a decode step)
    out, x = _launch(_RESIDUAL_NORM, [h, a, w_a, w_next if nxt else w_a, scale if scale is not None else w_a],
                     eps, scale is not None, nxt, [h.shape, h.shape if nxt else (1,)])  # fmt: skip
    return out, (x if nxt else None)


def _launch(source: KernelSource, inputs: list, eps: float, scale: bool, nxt: bool, output_shapes: list) -> list:
    """One threadgroup per row of inputs[0] [..., D] (indexed flat: no reshapes); eps goes in after
    the first five inputs, as both kernels name them."""
    h = inputs[0]
    d = h.shape[-1]
    tg, _ = row_geometry(d)
    rows = int(np.prod(h.shape[:-1], dtype=np.int64))
    return source.kernel()(
        inputs=inputs[:5] + [mx.array([eps], dtype=mx.float32)] + inputs[5:],
        template=template_args(row_template(dtype_name(h.dtype), d, scale, nxt)),
        grid=(tg * rows, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=output_shapes,
        output_dtypes=[h.dtype] * len(output_shapes),
    )


def residual_norm_moe_reference(h, a, w_a, w_next, w_next2, r_scale, r_root: float, eps: float):
    """MLX ops of a MoE layer after attention: out = h + post_norm(a), x = next_norm(out),
    x2 = next_norm2(out), xr = rms_norm(out) * r_scale * r_root (the router's input)."""
    out, x = residual_norm_reference(h, a, w_a, w_next, eps)
    return out, x, mx.fast.rms_norm(out, w_next2, eps), mx.fast.rms_norm(out, None, eps) * r_scale * r_root


def residual_norm_moe(h, a, w_a, w_next, w_next2, r_scale, r_root: float, eps: float):
    """(out, x, x2, xr) [..., D] as ``residual_norm_moe_reference``: one launch of
    g4_residual_norm_moe on GPU builds when `fusable`, the MLX ops otherwise (op family
    "norm_moe", a CUDA default since session 21)."""
    check_rows(h, a, w_a, w_next, None)
    check_rows(h, a, w_next2, r_scale, None)
    if use_reference() or not fusable(h, a, w_a, w_next) or not fusable(h, a, w_next2, r_scale):
        return residual_norm_moe_reference(h, a, w_a, w_next, w_next2, r_scale, r_root, eps)
    # r_root in the activation dtype: MLX rounds a Python scalar to the array's dtype
    return _launch(_RESIDUAL_NORM_MOE, [h, a, w_a, w_next, w_a, w_next2, r_scale, mx.array([r_root], dtype=h.dtype)],
                   eps, False, True, [h.shape] * 4)  # fmt: skip


def residual_norm_moe_out_reference(h, mlp, moe, w_mlp, w_moe, w_post, w_next, eps: float, scale=None):
    """MLX ops of a MoE layer's end: m = rms_norm(mlp, w_mlp) + rms_norm(moe, w_moe), then
    ``residual_norm_reference(h, m, w_post, w_next, eps, scale)`` -> (out, x or None)."""
    check_rows(h, mlp, w_mlp, None, None)
    m, _ = residual_norm_reference(mx.fast.rms_norm(mlp, w_mlp, eps), moe, w_moe, None, eps)
    return residual_norm_reference(h, m, w_post, w_next, eps, scale)


def residual_norm_moe_out(h, mlp, moe, w_mlp, w_moe, w_post, w_next, eps: float, scale=None):
    """(out, x) [..., D] as ``residual_norm_moe_out_reference``: one launch of
    g4_residual_norm_moe_out on GPU builds when `fusable` (op family "norm_moe_out", a CUDA default
    since session 21), the MLX ops otherwise."""
    check_rows(h, mlp, w_mlp, w_moe, None)
    check_rows(h, moe, w_post, w_next, scale)
    if use_reference() or not fusable(h, mlp, w_mlp, w_moe) or not fusable(h, moe, w_post, w_next, scale):
        return residual_norm_moe_out_reference(h, mlp, moe, w_mlp, w_moe, w_post, w_next, eps, scale)
    nxt = w_next is not None
    out, x = _launch(_RESIDUAL_NORM_MOE_OUT, [h, mlp, moe, w_mlp, w_moe, w_post, w_next if nxt else w_post,
                                              scale if scale is not None else w_post],
                     eps, scale is not None, nxt, [h.shape, h.shape if nxt else (1,)])  # fmt: skip
    return out, (x if nxt else None)


# --------------------------------------------------------------------------------------------
# numpy oracle and emulator / compile-test registry (see custom_kernels.registry)
# --------------------------------------------------------------------------------------------


def residual_norm_np(h, a, w_a, w_next, eps: float, scale=None, bf16: bool = False):
    """numpy oracle on f32 values [R, D] with the module's roundings (to bf16 when bf16=True)."""
    from .registry import bf16_to_f32, f32_to_bf16

    def rnd(v):
        v = np.asarray(v, dtype=np.float32)
        return bf16_to_f32(f32_to_bf16(v)) if bf16 else v

    def norm(v, w):
        r = (1.0 / np.sqrt((v.astype(np.float64) ** 2).mean(axis=-1, keepdims=True) + eps)).astype(np.float32)
        return rnd(w * rnd(v * r))

    out = rnd(h + norm(a, w_a))
    if scale is not None:
        out = rnd(out * np.float32(scale))
    return out, (None if w_next is None else norm(out, w_next))


def residual_norm_moe_np(h, a, w_a, w_next, w_next2, r_scale, r_root: float, eps: float, bf16: bool = False):
    """numpy oracle of residual_norm_moe with the module's roundings (to bf16 when bf16=True)."""
    from .registry import bf16_to_f32, f32_to_bf16

    def rnd(v):
        v = np.asarray(v, dtype=np.float32)
        return bf16_to_f32(f32_to_bf16(v)) if bf16 else v

    out, x = residual_norm_np(h, a, w_a, w_next, eps, None, bf16)
    r = (1.0 / np.sqrt((out.astype(np.float64) ** 2).mean(axis=-1, keepdims=True) + eps)).astype(np.float32)
    n0 = rnd(out * r)
    return out, x, rnd(w_next2 * n0), rnd(rnd(n0 * r_scale) * rnd(np.float32(r_root)))


def residual_norm_moe_out_np(h, mlp, moe, w_mlp, w_moe, w_post, w_next, eps: float, scale=None, bf16: bool = False):
    """numpy oracle of residual_norm_moe_out with the module's roundings (to bf16 when bf16=True)."""
    from .registry import bf16_to_f32, f32_to_bf16

    def rnd(v):
        v = np.asarray(v, dtype=np.float32)
        return bf16_to_f32(f32_to_bf16(v)) if bf16 else v

    r = (1.0 / np.sqrt((mlp.astype(np.float64) ** 2).mean(axis=-1, keepdims=True) + eps)).astype(np.float32)
    m, _ = residual_norm_np(rnd(w_mlp * rnd(mlp * r)), moe, w_moe, None, eps, None, bf16)
    return residual_norm_np(h, m, w_post, w_next, eps, scale, bf16)


def row_case_values(rng: np.random.Generator, rows: int, d: int, bf16: bool, weights: tuple, fixed: dict):
    """A case's h, a [rows, d], weight vectors [d] named `weights` and the `fixed` arrays: f32
    values (rounded to bf16 when bf16) and the kernel inputs (bf16 bit patterns when bf16), eps in."""
    from .registry import bf16_to_f32, f32_to_bf16

    vals = {"h": rng.standard_normal((rows, d)) * 4, "a": rng.standard_normal((rows, d)) * 0.3 + 0.1}
    vals.update({w: rng.uniform(0.2, 2.0, d) for w in weights}, **fixed)
    vals = {k: np.asarray(v).astype(np.float32) for k, v in vals.items()}
    if bf16:
        vals = {k: bf16_to_f32(f32_to_bf16(v)) for k, v in vals.items()}
    inputs = {k: (f32_to_bf16(v) if bf16 else v) for k, v in vals.items()}
    inputs["eps"] = np.array([_CASE_EPS], dtype=np.float32)
    return vals, inputs


_CASE_EPS = 1e-6


def _moe_case(rng: np.random.Generator, rows: int, d: int, dtype: str, max_threads: int = 512):
    from .registry import KernelCase

    bf16 = dtype == "bfloat16"
    vals, inputs = row_case_values(rng, rows, d, bf16, ("w_a", "w_next", "w_next2", "r_scale"), {"r_root": [d ** -0.5]})
    tg, quads = row_geometry(d, max_threads)
    want = residual_norm_moe_np(vals["h"], vals["a"], vals["w_a"], vals["w_next"], vals["w_next2"], vals["r_scale"],
                                vals["r_root"][0], _CASE_EPS, bf16)  # fmt: skip
    inputs["scale"] = inputs["w_a"]  # unread (SCALE off): a stand-in, as the dispatcher passes
    # bf16: exact (these rows' sums round the same in f32 and f64), so a dropped rounding step of
    # any output shows; f32: the sum order moves the last bits
    tol = dict(rtol=0.0, atol=0.0) if bf16 else dict(rtol=2e-5, atol=1e-5)
    return KernelCase(
        inputs=inputs, template=row_template(dtype, d, False, True, max_threads), grid=(tg * rows, 1, 1),
        threadgroup=(tg, 1, 1), output_shapes=[(rows, d)] * 4, output_dtypes=[dtype] * 4, expected=list(want),
        input_dtypes={k: dtype for k in ("h", "a", "w_a", "w_next", "scale", "w_next2", "r_scale", "r_root")}
        if bf16 else {}, label=f"moe rows={rows} D={d} TG={tg} QUADS={quads} {dtype}", **tol,
    )  # fmt: skip


def _moe_cases(rng: np.random.Generator):
    return [_moe_case(rng, 2, 68, "float32"), _moe_case(rng, 1, 360, "float32", max_threads=32),
            _moe_case(rng, 2, 96, "bfloat16"), _moe_case(rng, 1, 360, "bfloat16", max_threads=64)]


def _case(rng: np.random.Generator, rows: int, d: int, dtype: str, scale: bool, nxt: bool, max_threads: int = 512):
    from .registry import KernelCase

    bf16 = dtype == "bfloat16"
    vals, inputs = row_case_values(rng, rows, d, bf16, ("w_a", "w_next"), {"scale": [0.75]})
    tg, quads = row_geometry(d, max_threads)
    out, x = residual_norm_np(vals["h"], vals["a"], vals["w_a"], vals["w_next"] if nxt else None, _CASE_EPS,
                              vals["scale"][0] if scale else None, bf16)  # fmt: skip
    # bf16: the sum order may move a value across a rounding boundary (one bf16 step, 2^-8)
    tol = dict(rtol=8e-3, atol=1e-2) if bf16 else dict(rtol=2e-5, atol=1e-5)
    return KernelCase(
        inputs=inputs, template=row_template(dtype, d, scale, nxt, max_threads), grid=(tg * rows, 1, 1),
        threadgroup=(tg, 1, 1), output_shapes=[(rows, d), (rows, d) if nxt else (1,)],
        output_dtypes=[dtype, dtype], expected=[out] + ([x] if nxt else []),
        input_dtypes={k: dtype for k in ("h", "a", "w_a", "w_next", "scale")} if bf16 else {},
        label=f"rows={rows} D={d} TG={tg} QUADS={quads} {dtype}{' scale' if scale else ''}{' next' if nxt else ''}",
        **tol,
    )  # fmt: skip


def _cases(rng: np.random.Generator):
    # idle threads in the last quad row (68: 17 quads on 32 threads), several quads per thread
    # with a partial last one (360 on 32 threads: 3 quads each, 90 of 96 used), one quad each
    return [_case(rng, 3, 68, "float32", False, True), _case(rng, 2, 600, "float32", True, True),
            _case(rng, 1, 1028, "float32", True, False), _case(rng, 2, 96, "bfloat16", True, True),
            _case(rng, 2, 4, "float32", False, True), _case(rng, 2, 360, "float32", True, True, max_threads=32),
            _case(rng, 1, 360, "bfloat16", False, True, max_threads=64)]  # fmt: skip


def _moe_out_case(rng: np.random.Generator, rows: int, d: int, dtype: str, scale: bool, nxt: bool,
                  max_threads: int = 512):
    from .registry import KernelCase, bf16_to_f32, f32_to_bf16

    bf16 = dtype == "bfloat16"
    vals, inputs = row_case_values(rng, rows, d, bf16, ("w_mlp", "w_moe", "w_post", "w_next"), {"scale": [0.75]})
    moe = (rng.standard_normal((rows, d)) * 0.5 - 0.2).astype(np.float32)
    vals["mlp"], vals["moe"] = vals.pop("a"), bf16_to_f32(f32_to_bf16(moe)) if bf16 else moe
    inputs["mlp"], inputs["moe"] = inputs.pop("a"), f32_to_bf16(vals["moe"]) if bf16 else vals["moe"]
    tg, quads = row_geometry(d, max_threads)
    out, x = residual_norm_moe_out_np(vals["h"], vals["mlp"], vals["moe"], vals["w_mlp"], vals["w_moe"], vals["w_post"],
                                      vals["w_next"] if nxt else None, _CASE_EPS, vals["scale"][0] if scale else None,
                                      bf16)  # fmt: skip
    tol = dict(rtol=8e-3, atol=1e-2) if bf16 else dict(rtol=2e-5, atol=1e-5)
    return KernelCase(
        inputs=inputs, template=row_template(dtype, d, scale, nxt, max_threads), grid=(tg * rows, 1, 1),
        threadgroup=(tg, 1, 1), output_shapes=[(rows, d), (rows, d) if nxt else (1,)],
        output_dtypes=[dtype, dtype], expected=[out] + ([x] if nxt else []),
        input_dtypes={k: dtype for k in ("h", "mlp", "moe", "w_mlp", "w_moe", "w_post", "w_next", "scale")}
        if bf16 else {},
        label=f"moe_out rows={rows} D={d} TG={tg} QUADS={quads} {dtype}{' scale' if scale else ''}{' next' if nxt else ''}",
        **tol,
    )  # fmt: skip


def _moe_out_cases(rng: np.random.Generator):
    return [_moe_out_case(rng, 2, 68, "float32", True, True), _moe_out_case(rng, 1, 360, "float32", False, True, 32),
            _moe_out_case(rng, 2, 96, "bfloat16", True, True), _moe_out_case(rng, 2, 128, "float32", True, False),
            _moe_out_case(rng, 1, 360, "bfloat16", True, True, 64)]  # fmt: skip


def kernel_specs():
    """KernelSpecs of the residual-norm kernels (idle threads, one and several quads per thread)."""
    from .registry import KernelSpec

    return [KernelSpec(k.name, k.input_names, k.output_names, *k.text["metal"], *k.text["cuda"], cases)
            for k, cases in ((_RESIDUAL_NORM, _cases), (_RESIDUAL_NORM_MOE, _moe_cases),
                             (_RESIDUAL_NORM_MOE_OUT, _moe_out_cases))]  # fmt: skip

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
row; thread t holds elements 2 (t + j TG) and 2 (t + j TG) + 1 in registers (PAIRS pairs), so the
row is read once; a SIMD sum and a threadgroup sum give each sum of squares.

The model uses it only with the family "norm" named in GEMMA4_MLX_UNPROVEN_KERNELS: it passes
``pytest -m gpu`` on the H200, but at one row it took more GPU time than the three MLX launches it
replaces (bench/NOTES.md, session 7).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import KernelSource, dtype_name, template_args, use_reference
from .dialect import emit
from .sampling import BLOCK_SUM

__all__ = ["kernel_specs", "residual_norm", "residual_norm_reference", "residual_norm_np"]

# Template: T (dtype), D (row length, even), TG (threads), PAIRS = ceil(D / (2 TG)), SCALE, NEXT.
_BODY = r"""
  // gemma4-mlx residual_norm: out = (h + w_a * rmsnorm(a)) [* scale]; x = w_next * rmsnorm(out)
  constexpr int NSG = TG / 32;
  $shared float red[64];
  const int tid = $tid;
  const size_t base = (size_t)$tg_x * D;
  const float e = eps[0];
  float v[2 * PAIRS];
  float ss = 0.0f;
  $unroll for (int j = 0; j < PAIRS; ++j) {
    const int c = 2 * (tid + j * TG);
    v[2 * j] = 0.0f;
    v[2 * j + 1] = 0.0f;
    if (c < D) g4_load2(a + base + c, v + 2 * j);
    ss += v[2 * j] * v[2 * j] + v[2 * j + 1] * v[2 * j + 1];
  }
  const float ra = 1.0f / @SQRT@(g4s_block_sum(ss, red, 0, tid, NSG) / (float)D + e);
  const float s = SCALE ? static_cast<float>(scale[0]) : 1.0f;
  float ss2 = 0.0f;
  $unroll for (int j = 0; j < PAIRS; ++j) {
    const int c = 2 * (tid + j * TG);
    if (c < D) {
      float hv[2];
      g4_load2(h + base + c, hv);
      $unroll for (int i = 0; i < 2; ++i) {
        const float n = g4n_round<T>(static_cast<float>(w_a[c + i]) * g4n_round<T>(v[2 * j + i] * ra));
        float o = g4n_round<T>(hv[i] + n);
        if (SCALE) o = g4n_round<T>(o * s);
        out[base + c + i] = static_cast<T>(o);
        v[2 * j + i] = o;
        ss2 += o * o;
      }
    }
  }
  if (NEXT) {
    const float rn = 1.0f / @SQRT@(g4s_block_sum(ss2, red, 1, tid, NSG) / (float)D + e);
    $unroll for (int j = 0; j < PAIRS; ++j) {
      const int c = 2 * (tid + j * TG);
      if (c < D) {
        $unroll for (int i = 0; i < 2; ++i) {
          x[base + c + i] = static_cast<T>(static_cast<float>(w_next[c + i]) * g4n_round<T>(v[2 * j + i] * rn));
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

MAX_THREADS = 256


def _geometry(d: int) -> tuple[int, int]:
    """(threads per row, pairs per thread) for rows of d elements."""
    tg = min(MAX_THREADS, -(-d // 64) * 32)
    return tg, -(-d // (2 * tg))


def _template(dtype: str, d: int, scale: bool, nxt: bool) -> list:
    tg, pairs = _geometry(d)
    return [("T", dtype), ("D", d), ("TG", tg), ("PAIRS", pairs), ("SCALE", scale), ("NEXT", nxt)]


def _check(h, a, w_a, w_next, scale) -> None:
    d = h.shape[-1]
    if a.shape != h.shape or w_a.shape != (d,) or (w_next is not None and w_next.shape != (d,)):
        raise ValueError(f"h and a [..., D], weights [D] expected, got {h.shape}, {a.shape}, {w_a.shape}, "
                         f"{None if w_next is None else w_next.shape}")  # fmt: skip
    if scale is not None and scale.size != 1:
        raise ValueError(f"scale must hold one value, got shape {scale.shape}")
    if d % 2:
        raise ValueError(f"row length must be even, got {d}")


def residual_norm_reference(h, a, w_a, w_next, eps: float, scale=None):
    """MLX ops: (out, x) as the module doc says; x is None when w_next is None."""
    _check(h, a, w_a, w_next, scale)
    out = h + mx.fast.rms_norm(a, w_a, eps)
    if scale is not None:
        out = out * scale
    return out, (None if w_next is None else mx.fast.rms_norm(out, w_next, eps))


def fusable(h, a, w_a, w_next, scale=None) -> bool:
    """True when the kernel computes exactly what the reference does: one dtype everywhere (a
    scale of another dtype would promote `out`)."""
    arrays = [a, w_a] + [t for t in (w_next, scale) if t is not None]
    return h.dtype in (mx.float32, mx.bfloat16) and all(t.dtype == h.dtype for t in arrays) and h.shape[-1] % 2 == 0


def residual_norm(h, a, w_a, w_next, eps: float, scale=None):
    """The module's op: the kernel on GPU builds when `fusable`, ``residual_norm_reference``
    otherwise -> (out [..., D], x [..., D] or None)."""
    _check(h, a, w_a, w_next, scale)
    if use_reference() or not fusable(h, a, w_a, w_next, scale):
        return residual_norm_reference(h, a, w_a, w_next, eps, scale)
    d = h.shape[-1]
    rows = int(np.prod(h.shape[:-1], dtype=np.int64))
    tg, _ = _geometry(d)
    nxt = w_next is not None
    # the kernel indexes rows flat: no reshapes, and unread inputs are stand-ins, not new nodes
    # (every graph node costs host time in the decode step)
    out, x = _RESIDUAL_NORM.kernel()(
        inputs=[h, a, w_a, w_next if nxt else w_a, scale if scale is not None else w_a,
                mx.array([eps], dtype=mx.float32)],
        template=template_args(_template(dtype_name(h.dtype), d, scale is not None, nxt)),
        grid=(tg * rows, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[h.shape, h.shape if nxt else (1,)],
        output_dtypes=[h.dtype, h.dtype],
    )
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


def _case(rng: np.random.Generator, rows: int, d: int, dtype: str, scale: bool, nxt: bool):
    from .registry import KernelCase, bf16_to_f32, f32_to_bf16

    bf16 = dtype == "bfloat16"
    vals = {"h": rng.standard_normal((rows, d)) * 4, "a": rng.standard_normal((rows, d)) * 0.3 + 0.1,
            "w_a": rng.uniform(0.2, 2.0, d), "w_next": rng.uniform(0.2, 2.0, d), "scale": np.array([0.75])}
    vals = {k: v.astype(np.float32) for k, v in vals.items()}
    if bf16:
        vals = {k: bf16_to_f32(f32_to_bf16(v)) for k, v in vals.items()}
    eps = 1e-6
    out, x = residual_norm_np(vals["h"], vals["a"], vals["w_a"], vals["w_next"] if nxt else None, eps,
                              vals["scale"][0] if scale else None, bf16)  # fmt: skip
    inputs = {k: (f32_to_bf16(v) if bf16 else v) for k, v in vals.items()}
    inputs["eps"] = np.array([eps], dtype=np.float32)
    # bf16: the sum order may move a value across a rounding boundary (one bf16 step, 2^-8)
    tol = dict(rtol=8e-3, atol=1e-2) if bf16 else dict(rtol=2e-5, atol=1e-5)
    return KernelCase(
        inputs=inputs, template=_template(dtype, d, scale, nxt), grid=(_geometry(d)[0] * rows, 1, 1),
        threadgroup=(_geometry(d)[0], 1, 1), output_shapes=[(rows, d), (rows, d) if nxt else (1,)],
        output_dtypes=[dtype, dtype], expected=[out] + ([x] if nxt else []),
        input_dtypes={k: dtype for k in ("h", "a", "w_a", "w_next", "scale")} if bf16 else {},
        label=f"rows={rows} D={d} {dtype}{' scale' if scale else ''}{' next' if nxt else ''}", **tol,
    )  # fmt: skip


def _cases(rng: np.random.Generator):
    return [_case(rng, 3, 70, "float32", False, True), _case(rng, 2, 600, "float32", True, True),
            _case(rng, 1, 1030, "float32", True, False), _case(rng, 2, 96, "bfloat16", True, True),
            _case(rng, 2, 4, "float32", False, True)]  # fmt: skip


def kernel_specs():
    """KernelSpec of the residual-norm kernel (odd pair tails, one and several pairs per thread)."""
    from .registry import KernelSpec

    k = _RESIDUAL_NORM
    return [KernelSpec(k.name, k.input_names, k.output_names, *k.text["metal"], *k.text["cuda"], _cases)]
